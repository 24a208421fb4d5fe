"""``cuda_graph=True``: whole-forward CUDA graphs captured per input signature and replayed.

CPU tests cover the eager fallback, the settings and the container semantics; ``cuda``
tests cover replay correctness (bit-for-bit against eager in fp32, TF32 off), output
aliasing, training, the signature cache, threads, capture failures (in a subprocess) and
memory.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref

import pytest
import torch
from torch import nn

from parallel_modules import Parallel, ParallelSequential
from parallel_modules._cases import inception_branches, mlp_branches
from tests._helpers import DoubledInTraining, ScaleBy, Steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
cuda = pytest.mark.cuda


def _mlp(n: int = 8, width: int = 64, depth: int = 2) -> list[nn.Module]:
    torch.manual_seed(0)
    return mlp_branches(n, width=width, depth=depth)


def _run_python(script: str, *args: str, timeout: int) -> subprocess.CompletedProcess:
    r"""Run ``script`` in a fresh interpreter (the package importable from the checkout), its output captured."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _reference(branches, *args) -> torch.Tensor:
    return torch.cat([b(*args) for b in branches], 1)


def _graph_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "cuda_graph" in str(w.message) or "CUDA graph" in str(w.message)]


@cuda
def test_a_capture_failing_in_its_cleanup_leaves_this_thread_no_capture_under_way(monkeypatch):
    # Found by tools/exp_gpu_inject.py: the capture's cleanup cleared cuBLAS's workspaces before
    # resetting the thread's flags, so an error there (a CUDA error, a KeyboardInterrupt arriving
    # in it) left ``active`` set: every later call of the thread ran as if capturing.
    from parallel_modules import _graphs
    from parallel_modules._streams import _capture_underway

    def failing() -> None:
        raise RuntimeError("CUDA error: an injected failure")

    block = _graphed(_mlp(2))
    x = torch.randn(8, 64, device="cuda")
    monkeypatch.setattr(_graphs, "_clear_cublas_workspaces", failing)
    with torch.no_grad(), pytest.raises(RuntimeError, match="injected"):
        block(x)
    assert not _capture_underway()
    monkeypatch.undo()
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(8, 64, device="cuda")
            assert torch.equal(block(x), _reference(list(block), x))
    assert len(block._graphs._graphs) == 1


@cuda
@pytest.mark.parametrize("assigns", [False, True])
def test_a_capture_failing_in_its_cleanup_still_puts_the_modules_buffers_back(monkeypatch, assigns):
    # The capture's cleanup cleared cuBLAS's workspaces before putting back the buffers that
    # warm-up had updated (in place: BatchNorm's running statistics) or assigned anew
    # (``Steps``): an error in the clear left the module with the warm-up calls' updates.
    from parallel_modules import _graphs

    def failing() -> None:
        raise RuntimeError("CUDA error: an injected failure")

    torch.manual_seed(0)
    branches = [Steps(16), Steps(16)] if assigns else [nn.BatchNorm1d(16), nn.BatchNorm1d(16)]
    block = Parallel(*branches, cuda_graph=True).cuda()
    before = copy.deepcopy(block.state_dict())
    slots = [b._buffers["steps"] for b in branches] if assigns else None
    x = torch.randn(4, 16, device="cuda")
    monkeypatch.setattr(_graphs, "_clear_cublas_workspaces", failing)
    with torch.no_grad(), pytest.raises(RuntimeError, match="injected"):
        block(x)
    after = block.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    if assigns:  # the module's own tensors, not the warm-up's
        assert all(b._buffers["steps"] is t for b, t in zip(branches, slots))


@cuda
def test_a_branch_assigning_a_buffer_in_forward_is_refused_at_capture():
    # Before: captured, and the replay read the tensor the warm-up had assigned, whose memory
    # went with a variant's graph timed and freed: an illegal memory access (the CUDA context
    # lost for the rest of the process).
    torch.manual_seed(0)
    block = Parallel(Steps(16), Steps(16), cuda_graph=True).cuda().eval()
    x = torch.randn(4, 16, device="cuda")
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"(?s)assigns a new tensor to the buffer 0\.steps.*in place"):
            block(x)
        assert [int(m.steps) for m in block] == [0, 0]  # the module's own buffers, as they were
        block.graph_fallback = True
        with pytest.warns(UserWarning, match="assigns a new tensor"):
            out = block(x)
        assert torch.equal(out, torch.cat([m.lin(x) for m in block], 1))
        for _ in range(3):
            block(x)
        assert [int(m.steps) for m in block] == [4, 4]
        torch.cuda.synchronize()


# ---------------------------------------------------------------------- CPU
def test_buffers_assigned_in_warm_up_are_refused_and_put_back_torchscript_ones_left_alone():
    # What a capture checks after its warm-up (see the CUDA test above), on the CPU. Before (a
    # review): a TorchScript module's buffers, behind a view that is not a dict, made it raise
    # AttributeError, which graph_fallback=True did not catch.
    from parallel_modules._graphs import _buffer_slots, _CaptureError, _CudaGraphs, _restore_slots

    scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    block = Parallel(scripted, Steps(4), cuda_graph=True)
    slots = _buffer_slots(block)
    assert [name for name, _, _ in slots] == ["1"]  # (the scripted module's are its own)
    own = block[1].steps
    block(torch.randn(3, 4))  # (warned: the CPU runs eagerly) -- assigns block[1].steps anew
    assert block[1].steps is not own
    with pytest.raises(_CaptureError, match=r"(?s)assigns a new tensor to the buffer 1\.steps.*in place"):
        _CudaGraphs._refuse_reassigned(block._graphs, slots, [torch.randn(3, 4)])
    assert block[1].steps is own
    block[1].steps = torch.ones(())
    _restore_slots(slots)
    assert block[1].steps is own


def test_cpu_input_warns_once_and_runs_eagerly():
    block = Parallel(*_mlp(3, width=16), cuda_graph=True)
    other = Parallel(*_mlp(2, width=16), cuda_graph=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(4, 16)
            assert torch.equal(block(x), _reference(block, x))
        other(torch.randn(4, 16))
    messages = _graph_warnings(record)
    assert len(messages) == 2, messages  # once per module
    assert "Parallel" in messages[0] and "cpu" in messages[0] and "eagerly" in messages[0]
    assert len(block._graphs) == 0


def test_cuda_graph_off_never_warns():
    block = Parallel(*_mlp(2, width=16))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        block(torch.randn(4, 16))
    assert _graph_warnings(record) == []


def test_repr_shows_graph_settings_and_slicing_keeps_them():
    plain = Parallel(nn.Linear(4, 4), nn.Linear(4, 4))
    assert "cuda_graph" not in repr(plain)
    block = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), cuda_graph=True, max_graphs=3,
                     static_outputs=True, graph_fallback=True, direct_grads=True)
    text = repr(block)
    for setting in ("cuda_graph=True", "max_graphs=3", "static_outputs=True", "graph_fallback=True",
                    "direct_grads=True"):
        assert setting in text
    assert "direct_grads" not in repr(Parallel(nn.Linear(4, 4), cuda_graph=True))
    part = block[1:]
    assert isinstance(part, Parallel) and len(part) == 2
    assert (part.cuda_graph, part.max_graphs, part.static_outputs, part.graph_fallback) == (True, 3, True, True)
    assert part._graphs is not block._graphs and part._graphs.max_graphs == 3
    assert part.direct_grads and part._graphs.direct_grads
    clone = pickle.loads(pickle.dumps(block))
    assert clone.direct_grads and clone._graphs.direct_grads


def test_pipeline_repr_shows_graph_settings_as_parallel_does():
    # The same settings the same way: direct_grads only where it was opted in.
    text = repr(ParallelSequential(nn.Linear(4, 4), chunks=2, cuda_graph=True, max_graphs=3))
    for setting in ("chunks=2", "cuda_graph=True", "max_graphs=3", "static_outputs=False", "graph_fallback=False"):
        assert setting in text
    assert "direct_grads" not in text
    assert "direct_grads=True" in repr(ParallelSequential(nn.Linear(4, 4), cuda_graph=True, direct_grads=True))
    assert "cuda_graph" not in repr(ParallelSequential(nn.Linear(4, 4), chunks=2))


def test_state_dict_unaffected():
    branches = _mlp(3, width=8)
    block = Parallel(*copy.deepcopy(branches), cuda_graph=True)
    reference = nn.ModuleList(copy.deepcopy(branches))
    assert list(block.state_dict()) == list(reference.state_dict())
    block.load_state_dict(reference.state_dict())
    x = torch.randn(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(block(x), _reference(reference, x))


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "8"])
def test_invalid_max_graphs(bad):
    # A value of the wrong type is a TypeError, an int below 1 a ValueError.
    with pytest.raises(ValueError if type(bad) is int else TypeError, match="max_graphs"):
        Parallel(nn.Linear(2, 2), cuda_graph=True, max_graphs=bad)


def test_copy_and_pickle_get_a_fresh_cache():
    block = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), cuda_graph=True, max_graphs=2)
    for clone in (copy.deepcopy(block), pickle.loads(pickle.dumps(block))):
        assert clone._graphs is not block._graphs
        assert clone._graphs._owner() is clone and clone._graphs.max_graphs == 2
        x = torch.randn(3, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert torch.equal(clone(x), _reference(clone, x))


def test_direct_grads_reuse_their_copies_only_when_nothing_holds_them():
    # direct_grads hands the parameters the copies it made last time, refilled, once nothing
    # holds them any more; a copy, its buffer or its memory held anywhere gets new copies, and
    # what is held is never overwritten.
    from parallel_modules._graphs import _GradCopies

    grads = [torch.randn(3, 4), None, torch.randn(3, 4), torch.randn(5),
             torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)]
    present = [g for g in grads if g is not None]
    copies = _GradCopies(grads)

    def refill() -> None:
        for g in present:
            g.normal_()
        for c, g in zip(copies.reused(), present):
            assert torch.equal(c, g) and c.stride() == g.stride()

    refill()
    kept = copies.kept
    refill()
    assert copies.kept is kept  # nothing held them: the same copies, refilled
    for hold in (lambda c: c[0], lambda c: c[3], lambda c: c[2].view(-1), lambda c: c[0]._base,
                 lambda c: c[1].untyped_storage()):
        held = hold(copies.kept)
        snapshot = held.clone() if isinstance(held, torch.Tensor) else None
        kept = copies.kept
        refill()
        assert copies.kept is not kept  # new copies: one of the last is still held
        if snapshot is not None:
            assert torch.equal(held, snapshot)
        del held, kept
        kept = copies.kept
        refill()
        assert copies.kept is kept  # let go of: reused again


def test_accumulate_sets_or_sums_like_autograd():
    # ``direct_grads`` hands a training replay's gradients out with ``_accumulate``: a ``.grad``
    # that is None takes the gradient itself, any other is summed into in place, exactly as
    # autograd's accumulators do for the same gradients.
    from parallel_modules._graphs import _accumulate

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3, 4)) for _ in range(3)]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    params[1].grad = torch.randn(3, 4)
    twins[1].grad = params[1].grad.clone()
    kept = params[1].grad
    grads = (torch.randn(3, 4), torch.randn(3, 4), None)
    _accumulate(tuple(params), grads)
    sum((t * g).sum() for t, g in zip(twins, grads) if g is not None).backward()
    assert params[0].grad is grads[0] and params[1].grad is kept and params[2].grad is None
    for p, t in zip(params, twins):
        assert (p.grad is None) == (t.grad is None)
        if p.grad is not None:
            assert torch.equal(p.grad, t.grad)


def test_hand_out_gives_each_parameter_its_own_gradient():
    # A backward graph computes gradients for some parameters only (one frozen by the
    # forward's path, say): ``plan_grads`` lines up the parameters that take one with
    # their copies, and the hand-out sets, then sums, exactly those, call after call.
    from types import SimpleNamespace

    from parallel_modules._graphs import _Graph, _hand_out

    torch.manual_seed(0)
    params = tuple(nn.Parameter(torch.randn(3, 4)) for _ in range(3))
    grads = [torch.randn(3, 4), None, torch.randn(3, 4)]
    graph = SimpleNamespace(inputs=[torch.randn(2)], params=params, grad_inputs=[torch.randn(2), *grads])
    _Graph.plan_grads(graph)
    assert graph.takers == (params[0], params[2])
    for step in (1, 2):
        _hand_out(graph.takers, graph.param_copies)
        assert params[1].grad is None
        for p, g in ((params[0], grads[0]), (params[2], grads[2])):
            assert torch.equal(p.grad, g * step)
            assert p.grad.data_ptr() != g.data_ptr()  # a copy: the next replay overwrites the buffer
    for p in params:
        p.grad = None
    _hand_out(graph.takers, graph.param_copies)  # after zero_grad(): set again, not summed
    assert torch.equal(params[0].grad, grads[0]) and params[1].grad is None


def test_direct_grads_defer_to_parameter_hooks():
    # A hook on a parameter listens on its accumulator: calls made meanwhile go through autograd.
    from parallel_modules._graphs import _direct_allowed

    params = tuple(nn.Parameter(torch.randn(2)) for _ in range(3))
    assert _direct_allowed(params) and _direct_allowed(params)
    for register in (lambda p: p.register_hook(lambda g: g),
                     lambda p: p.register_post_accumulate_grad_hook(lambda p: None)):
        handle = register(params[1])
        assert not _direct_allowed(params)
        assert not _direct_allowed(params)  # a hook found is looked for again on the next call
        handle.remove()
        assert _direct_allowed(params)


class _Stream:
    r"""A stand-in CUDA stream that notes which streams it was made to wait for."""

    def __init__(self, name: str) -> None:
        self.name, self.waited = name, []

    def wait_stream(self, other: "_Stream") -> None:
        self.waited.append(other.name)


def _lending_graph(monkeypatch, shapes=((3, 4), (5,), (3, 4))):
    r"""A training graph's hand-out state on the CPU: parameters, and buffers standing for its gradients."""
    from parallel_modules import _graphs

    monkeypatch.setattr(_graphs, "_hand_outs", {})
    torch.manual_seed(0)
    params = tuple(nn.Parameter(torch.randn(s)) for s in shapes)
    graph = _graphs._Graph.__new__(_graphs._Graph)
    graph.device, graph.inputs, graph.params = torch.device("cpu"), [], params
    graph.param_ids = frozenset(map(id, params))
    graph.grad_inputs = [torch.randn(s) for s in shapes]
    graph.plan_grads()
    graph.lends_grads, graph.lent, graph.grads_lent = True, [], False
    return graph


def _replayed(graph) -> list[torch.Tensor]:
    r"""What a backward replay does to ``graph``'s buffers: new gradients written in place; returns them."""
    new = [torch.randn_like(g) for g in graph.param_copies.sources]
    for g, v in zip(graph.param_copies.sources, new):
        g.copy_(v)
    return new


def test_lent_gradients_are_the_graphs_buffers_until_taken_back(monkeypatch):
    # After zero_grad(), a plain backward's hand-out gives .grad (views of) the backward graph's
    # own buffers, nothing copied; the next forward takes them back, moving their versions.
    from parallel_modules._graphs import _hand_out

    graph = _lending_graph(monkeypatch)
    for step in range(3):
        new = _replayed(graph)
        _hand_out(graph.takers, graph.param_copies, graph)
        assert graph.grads_lent and graph.param_copies.kept is None
        for p, g, v in zip(graph.params, graph.param_copies.sources, new):
            assert p.grad.data_ptr() == g.data_ptr() and p.grad is not g and torch.equal(p.grad, v)
        versions = [g._version for g in graph.param_copies.sources]
        for p in graph.params:
            p.grad = None  # zero_grad()
        assert graph.reclaim(None)
        assert not graph.grads_lent and graph.lends_grads
        assert all(g._version > v for g, v in zip(graph.param_copies.sources, versions))


@pytest.mark.parametrize("holder", ["reference", "view", "detached", "data", "storage", "another grad",
                                    "saved by autograd", "re-pointed"])
def test_lent_gradients_still_held_are_not_taken_back(holder, monkeypatch):
    # Whatever still holds a lent gradient after zero_grad() -- a reference, a view, its storage,
    # another tensor's .grad, a tensor autograd saved -- or re-pointed it, keeps the replay
    # from overwriting it: reclaim refuses, and the call runs otherwise.
    from parallel_modules._graphs import _hand_out

    graph = _lending_graph(monkeypatch)
    _replayed(graph)
    _hand_out(graph.takers, graph.param_copies, graph)
    p = graph.params[0]
    other = nn.Parameter(torch.zeros_like(p))
    w = torch.randn_like(p, requires_grad=True)
    kept = {"reference": lambda: p.grad, "view": lambda: p.grad.view(-1), "detached": lambda: p.grad.detach(),
            "data": lambda: p.grad.data, "storage": lambda: p.grad.untyped_storage(),
            "another grad": lambda: setattr(other, "grad", p.grad), "saved by autograd": lambda: (p.grad * w).sum(),
            "re-pointed": lambda: setattr(p.grad, "data", torch.zeros_like(p))}[holder]()
    if holder != "re-pointed":
        p.grad = None
    assert not graph.reclaim(None)
    if holder == "re-pointed":
        assert torch.equal(p.grad, torch.zeros_like(p))  # what it was re-pointed at, not a copy of the buffer
    del kept


def test_taking_lent_gradients_back_waits_for_other_hand_outs_to_the_same_parameters(monkeypatch):
    # Another graph of the same parameters (another signature) may have summed into a lent
    # gradient on its own stream: the replay about to overwrite it waits for that stream, and
    # later hand-outs to those parameters wait for the replay's.
    from parallel_modules import _graphs

    graph = _lending_graph(monkeypatch)
    _replayed(graph)
    _graphs._hand_out(graph.takers, graph.param_copies, graph)
    other, unrelated, mine = _Stream("other"), _Stream("unrelated"), _Stream("mine")
    _graphs._hand_outs[graph.device] = {frozenset({id(graph.params[0])}): other, frozenset({-1}): unrelated}
    for p in graph.params:
        p.grad = None
    assert graph.reclaim(mine)
    assert mine.waited == ["other"] and _graphs._hand_outs[graph.device][graph.param_ids] is mine


def test_a_kept_gradient_is_not_taken_back_when_grad_holds_it_too(monkeypatch):
    # Reclaim reads .grad only when the counts differ from the lent baseline. With .grad still
    # holding its lent gradient (accumulation) and a reference kept elsewhere, the .grad gets its
    # copy, and the kept reference must still be seen, by counting again.
    from parallel_modules._graphs import _hand_out

    graph = _lending_graph(monkeypatch)
    _replayed(graph)
    _hand_out(graph.takers, graph.param_copies, graph)
    kept = graph.params[1].grad
    assert not graph.reclaim(None)
    assert not graph.lends_grads
    for p, g in zip(graph.params, graph.param_copies.sources):
        assert p.grad.data_ptr() != g.data_ptr() and torch.equal(p.grad, g)
    del kept


def test_a_grad_of_the_callers_own_is_left_alone_and_lending_goes_on(monkeypatch):
    # Equal counts with a .grad set: the caller's own tensor, not a lent one. Nothing is copied,
    # the gradients are taken back, and the next hand-out after zero_grad() lends again.
    from parallel_modules._graphs import _hand_out

    graph = _lending_graph(monkeypatch)
    _replayed(graph)
    _hand_out(graph.takers, graph.param_copies, graph)
    for p in graph.params:
        p.grad = None
    own = torch.zeros_like(graph.params[0])
    graph.params[0].grad = own
    assert graph.reclaim(None) and graph.lends_grads and graph.params[0].grad is own
    for p in graph.params:
        p.grad = None
    _hand_out(graph.takers, graph.param_copies, graph)
    assert graph.grads_lent and graph.params[0].grad.data_ptr() == graph.param_copies.sources[0].data_ptr()


def _eager_grads(graph, change, held):
    r"""The ``.grad`` eager accumulators leave on twins of ``graph.params``, given the hand-out's gradients.

    ``change`` is applied to the twins after their forward (a freeze, a ``grad_dtype``), as
    to the parameters between a graphed forward and its backward; ``held``: their ``.grad``.
    """
    twins = [nn.Parameter(p.detach().clone()) for p in graph.params]
    for t, g in zip(twins, held):
        t.grad = None if g is None else g.clone()
    loss = sum((t * g).sum() for t, g in zip(twins, graph.param_copies.sources))
    change(twins)
    loss.backward()
    return [t.grad for t in twins]


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("held", ["none", "set"])
@pytest.mark.parametrize("change", ["frozen", "grad_dtype", "grad_dtype any"])
def test_hand_out_after_a_parameter_changed_since_the_forward_is_as_eager(change, held, staged, monkeypatch):
    # An accumulator reads its parameter when it runs: one frozen between the forward and its
    # backward gets no gradient, one given a grad_dtype gets its gradient cast (or kept as it
    # comes, with None). The hand-out, from the graph's buffers (lending or summing) or from
    # copies staged before a forward replay overwrote them, leaves .grad as they would.
    from parallel_modules import _graphs

    if not hasattr(torch.Tensor, "grad_dtype") and change != "frozen":
        pytest.skip("this torch has no Tensor.grad_dtype")
    graph = _lending_graph(monkeypatch)
    _replayed(graph)

    def apply(params):
        p = params[1]
        if change == "frozen":
            p.requires_grad_(False)
        else:  # (torch refuses a grad_dtype other than that of a .grad set: cleared, then set again)
            grad, p.grad = p.grad, None
            p.grad_dtype = torch.float64 if change == "grad_dtype" else None
            p.grad = None if grad is None else grad.double()

    initial = [None if held == "none" else torch.randn_like(p) for p in graph.params]
    expected = _eager_grads(graph, apply, initial)
    for p, g in zip(graph.params, initial):
        p.grad = None if g is None else g.clone()
    apply(graph.params)
    if staged:
        _graphs._accumulate(graph.takers, tuple(graph.param_copies.fresh()))
    else:
        _graphs._hand_out(graph.takers, graph.param_copies, graph)
    for p, e in zip(graph.params, expected):
        assert (p.grad is None) == (e is None)
        if e is not None:
            assert p.grad.dtype == e.dtype and torch.equal(p.grad, e)
    # Nothing lent where not every parameter took its buffer: the next replay need take nothing back.
    assert not graph.grads_lent


def test_gradients_still_out_are_taken_back_under_the_hand_outs_lock(monkeypatch):
    # A graph that stopped lending (its last reclaim gave an accumulating .grad a copy, and was
    # refused) may still have gradients out, which a thread that picked the graph up earlier
    # takes back: that writes .grad and the hand-outs' order, so it takes the hand-outs' lock.
    from parallel_modules import _graphs

    graph = _lending_graph(monkeypatch)
    _replayed(graph)
    _graphs._hand_out(graph.takers, graph.param_copies, graph)
    graph.lends_grads = False  # (as a refused reclaim after a rehome leaves it)
    taken = []

    class _Lock:
        def __enter__(self):
            taken.append(True)

        def __exit__(self, *exc):
            return False

    class _Ctx:
        def mark_non_differentiable(self, *tensors):
            pass

    monkeypatch.setattr(_graphs, "_hand_outs_lock", _Lock())
    monkeypatch.setattr(_graphs, "_current_stream", lambda device: _Stream("caller"))
    monkeypatch.setattr(_graphs, "_launch", lambda g: None)
    graph.lock, graph.last, graph.pending, graph.gen = threading.Lock(), None, None, 0
    graph.fwd, graph.outputs, graph.out_grad, graph.state_saved = None, [], [], ()
    for p in graph.params:
        p.grad = None
    _graphs._Replay.forward(_Ctx(), graph, False, True)
    assert taken and not graph.grads_lent


def test_accumulating_grad_gets_a_copy_of_its_lent_gradient(monkeypatch):
    # zero_grad() not called (or set_to_none=False): .grad still holds its lent gradient when the
    # next forward comes. It gets a copy, the graph stops lending, and the next hand-out sums.
    from parallel_modules._graphs import _hand_out

    graph = _lending_graph(monkeypatch)
    first = _replayed(graph)
    _hand_out(graph.takers, graph.param_copies, graph)
    assert graph.reclaim(None) and not graph.lends_grads
    for p, g, v in zip(graph.params, graph.param_copies.sources, first):
        assert p.grad.data_ptr() != g.data_ptr() and torch.equal(p.grad, v)
    second = _replayed(graph)
    _hand_out(graph.takers, graph.param_copies, graph)
    for p, a, b in zip(graph.params, first, second):
        torch.testing.assert_close(p.grad, a + b)


def test_gradients_sharing_memory_are_not_lent():
    # An add passes one gradient tensor to both its sides: two parameters' .grad must not be one.
    from parallel_modules._graphs import _own_memory

    a, b = torch.randn(4, 4), torch.randn(4, 4)
    assert _own_memory([a, b])
    assert not _own_memory([a, a]) and not _own_memory([a, a.view(-1)]) and not _own_memory([a, a[1:]])


def test_a_create_graph_backward_through_a_training_replay_is_refused(monkeypatch):
    # The backward graph's gradients are constants to autograd. Before, a create_graph=True pass
    # from ``out.sum()`` (whose incoming gradient requires none, which ``once_differentiable``
    # let through) returned them as if differentiable: a gradient penalty lost the block's part.
    from parallel_modules import _graphs

    graph = _graphs._Graph.__new__(_graphs._Graph)
    graph.name, graph.device, graph.lock, graph.last, graph.pending = "Parallel", torch.device("cpu"), \
        threading.Lock(), None, None
    graph.gen, graph.bwd_gen, graph.token, graph.direct = 0, -1, None, False
    graph.lends_grads = graph.grads_lent = graph.expanded = False
    graph.inputs, graph.outputs = [torch.zeros(3)], [torch.zeros(3)]
    graph.out_grad, graph.out_saved, graph.grad_outputs = [True], [], [torch.zeros(3)]
    graph.state_saved = ()
    graph.params, graph.grad_inputs = (), [torch.zeros(3)]
    graph.plan_grads()
    graph.fwd, graph.bwd = "fwd", "bwd"

    def launch(which):  # the graphs of ``y = 2 * x``
        if which == "fwd":
            graph.outputs[0].copy_(graph.inputs[0] * 2)
        else:
            graph.grad_inputs[0].copy_(graph.grad_outputs[0] * 2)

    monkeypatch.setattr(_graphs, "_launch", launch)
    monkeypatch.setattr(_graphs, "_current_stream", lambda device: _Stream("caller"))
    x = torch.randn(3, requires_grad=True)
    (out,) = _graphs._Replay.apply(graph, False, False, x)
    with pytest.raises(RuntimeError, match=r"Parallel: backward with create_graph=True.*cuda_graph=False"):
        torch.autograd.grad(out.sum(), x, create_graph=True)
    assert graph.bwd_gen == -1  # nothing consumed: a plain backward still runs
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(grad, torch.full((3,), 2.0))


def test_direct_grads_on_the_cpu_train_through_autograd():
    branches = _mlp(3, width=16)
    reference = nn.ModuleList(copy.deepcopy(branches))
    block = Parallel(*branches, cuda_graph=True, direct_grads=True)
    for _ in range(2):
        x = torch.randn(4, 16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            block(x).square().sum().backward()
        _reference(reference, x).square().sum().backward()
        for p, p_ref in zip(block.parameters(), reference.parameters()):
            assert torch.equal(p.grad, p_ref.grad)


def test_hand_outs_wait_for_earlier_ones_to_the_same_parameters_only(monkeypatch):
    # Ordering every hand-out on a device after the one before made a model trained on one
    # stream wait for whatever an unrelated model had enqueued on its own stream by then.
    from parallel_modules import _graphs
    from parallel_modules._graphs import _after_hand_outs

    a, b, c = _Stream("a"), _Stream("b"), _Stream("c")
    last: dict = {}
    _after_hand_outs(last, frozenset({1, 2}), a)  # model 1 on stream a
    _after_hand_outs(last, frozenset({3, 4}), b)  # model 2 on stream b: unrelated
    assert a.waited == [] and b.waited == []
    _after_hand_outs(last, frozenset({2, 5}), c)  # shares parameter 2 with model 1
    assert c.waited == ["a"]
    _after_hand_outs(last, frozenset({1, 2}), a)  # model 1 again: after c, which wrote parameter 2
    assert a.waited == ["c"]
    _after_hand_outs(last, frozenset({3, 4}), b)  # model 2 again, on its own stream: nothing to wait for
    assert b.waited == []
    # Past the bound, the oldest set is forgotten only after the newest hand-out's stream has
    # waited for it and taken its parameters on: a later hand-out to them still waits.
    monkeypatch.setattr(_graphs, "_MAX_HAND_OUTS", 3)
    d, e = _Stream("d"), _Stream("e")
    _after_hand_outs(last, frozenset({6}), d)  # forgets {2, 5} (c), the oldest
    assert d.waited == ["c"] and len(last) == 3
    _after_hand_outs(last, frozenset({5}), e)  # waits for d, which came after c (and forgets a)
    assert e.waited == ["d", "a"] and set(last.values()) == {b, d, e}


def test_saved_outputs_are_those_the_backward_reads():
    # static_outputs refuses a change in place before backward only to these, as eager does.
    from parallel_modules._graphs import _saved

    def _saved_outputs(outputs):
        return _saved(None, outputs)[0]

    class Doubled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            y = t * 2
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.randn(4, 8, requires_grad=True)
    linear = nn.Linear(8, 8)
    a = linear(x)  # addmm saves its inputs, not its output
    relu = torch.relu(linear(x))  # relu saves its output
    joined = torch.cat([a, relu], 1)
    doubled = Doubled.apply(x)
    assert _saved_outputs([a, relu, joined, doubled, doubled.view(-1)]) == [False, True, False, True, True]
    part = linear(x) * 1
    part[:, :4].sigmoid_()  # a CopySlices node, whose saved tensors Python cannot read: taken as saved
    empty = linear(x[:0])  # every empty tensor's data_ptr is 0
    assert _saved_outputs([part, a]) == [True, True]
    assert _saved_outputs([empty, torch.relu(x[:0])]) == [False, False]  # (nothing to change in place)
    # Saved through a checkpoint's hooks: taken as saved, without running the unpack hook,
    # which recomputed the checkpointed forward (and kept its activations) on every read.
    runs = []

    def body(t):
        runs.append(1)
        return torch.relu(linear(t))

    checkpointed = torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False)
    assert _saved_outputs([checkpointed, a]) == [True, True] and len(runs) == 1
    # Nor through a custom Function's node, whose ``saved_tensors`` property is the unpack.
    runs.clear()
    checkpointed = torch.utils.checkpoint.checkpoint(lambda t: Doubled.apply(body(t)), x, use_reentrant=False)
    assert _saved_outputs([checkpointed]) == [True] and len(runs) == 1


def test_moving_or_changing_branches_drops_graphs():
    block = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), cuda_graph=True)
    for change in (lambda: block.double(), lambda: block.append(nn.Linear(4, 4)), lambda: block.__delitem__(-1)):
        block._graphs._graphs["a signature"] = object()  # stands in for a captured graph
        change()
        assert len(block._graphs) == 0


def test_explain_shows_each_graph_of_one_signature_by_what_its_key_holds_apart(cuda_autocast_flag):
    # A graph's key holds more than its input signature: submodules' modes, autocast, which
    # parameters require grad, the default dtype, arguments baked in, kernel settings, where the
    # inputs lie. Before, explain() described graphs by the signature alone: graphs of one
    # signature read alike and overwrote each other, so it listed fewer than were cached (the
    # one left possibly not the next call's). The graphs are stood in for: keys the cache makes.
    from types import SimpleNamespace

    from parallel_modules._inputs import _value_key

    class Config:
        def __repr__(self) -> str:
            return "Config()"

    block = Parallel(nn.Sequential(nn.Linear(4, 4), nn.Dropout()), nn.Linear(4, 4), cuda_graph=True).eval()
    graphs = block._graphs
    x = torch.randn(2, 4)

    def cache(args=(x,), kwargs=None, extra=()) -> None:
        graphs._graphs[graphs._key(block, args, kwargs or {}, extra)] = SimpleNamespace(variant=None, reader=None)

    with torch.no_grad():
        cache()
    cache()
    cuda_autocast_flag(True)
    cache()
    cuda_autocast_flag(False)
    block[0][1].train()
    cache()
    block[0][1].eval()
    block[1].weight.requires_grad_(False)
    cache()
    block.requires_grad_(False)
    cache()
    block.requires_grad_(True)
    torch.set_default_dtype(torch.float64)
    try:
        cache()
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.inference_mode():
        cache()
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = not benchmark
    try:
        cache()
    finally:
        torch.backends.cudnn.benchmark = benchmark
    cache(args=(torch.randn(9)[1:].view(2, 4),))  # (4 bytes past where a fresh tensor lies)
    config = Config()
    cache(kwargs={"config": config}, extra=(_value_key(config),))
    schedules = block.explain()["schedules"]
    assert len(graphs) == 11 and list(schedules) == [
        "Tensor(2, 4) float32 on cpu, no grad",
        "Tensor(2, 4) float32 on cpu",
        "Tensor(2, 4) float32 on cpu, autocast to bfloat16",
        "Tensor(2, 4) float32 on cpu, submodules ['0.1'] in training mode",
        "Tensor(2, 4) float32 on cpu, parameters ['1.weight'] frozen",
        "Tensor(2, 4) float32 on cpu, parameters frozen",
        "Tensor(2, 4) float32 on cpu, default dtype float64",
        "Tensor(2, 4) float32 on cpu, no grad, inference mode",
        f"Tensor(2, 4) float32 on cpu, kernel settings cudnn_benchmark={not benchmark}",
        "Tensor(2, 4) float32 on cpu, input at 4 bytes past 16-byte alignment",
        "Tensor(2, 4) float32 on cpu, config=Config, arguments Config()",
    ], schedules
    assert set(schedules.values()) == {"CUDA graph, unfused, streams"}


# --------------------------------------------------------------------- CUDA
def _graphed(branches, **kwargs) -> Parallel:
    return Parallel(*branches, cuda_graph=True, **kwargs).cuda()


def _only_graph(block: Parallel):
    graphs = list(block._graphs._graphs.values())
    assert len(graphs) == 1
    return graphs[0]


@cuda
def test_explain_shows_the_graphs_with_and_without_autocast_of_one_signature():
    # The CUDA counterpart of the test above: two graphs of one input signature, one captured
    # under autocast. Before, explain() gave one entry for both.
    block = _graphed(_mlp(2)).eval()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        block(x)
        with torch.autocast("cuda", torch.bfloat16):
            block(x)
    assert len(block._graphs) == 2
    schedules = block.explain()["schedules"]
    graphed = [k for k, v in schedules.items() if v.startswith("CUDA graph")]
    assert graphed == [f"Tensor(8, 64) float32 on {x.device}, no grad",
                       f"Tensor(8, 64) float32 on {x.device}, no grad, autocast to bfloat16"], schedules


@cuda
def test_replay_equals_eager_mlp():
    block = _graphed(_mlp(8))
    with torch.no_grad():
        for _ in range(20):
            x = torch.randn(8, 64, device="cuda")
            assert torch.equal(block(x), _reference(block, x))
    assert block._graphs.captures == 1 and len(block._graphs) == 1


@cuda
def test_replay_equals_eager_inception():
    torch.manual_seed(0)
    block = _graphed([b.eval() for b in inception_branches()])
    with torch.no_grad():
        for _ in range(20):
            x = torch.randn(1, 192, 35, 35, device="cuda")
            out = block(x)
            assert out.shape == (1, 256, 35, 35)
            assert torch.equal(out, _reference(block, x))
    assert block._graphs.captures == 1


@cuda
@pytest.mark.parametrize("move", ["branch .to()", ".data ="])
def test_a_branch_moved_on_its_own_replays_the_memory_captured(move):
    # The branch's own _apply gives its parameters new memory and frees the old, which
    # the graph reads by address: the graph keeps it alive (never reads reused memory).
    block = _graphed(_mlp(3))
    captured = copy.deepcopy(block)
    with torch.no_grad():
        for _ in range(3):
            block(torch.randn(8, 64, device="cuda"))
        if move == ".data =":
            block[1][0].weight.data = block[1][0].weight.data * 2
        else:
            block[1].double().float()
            block[1][0].weight.mul_(2)
        for _ in range(3):
            junk = [torch.full((64 * 64,), float("nan"), device="cuda") for _ in range(64)]  # takes freed blocks
            x = torch.randn(8, 64, device="cuda")
            assert torch.equal(block(x), _reference(captured, x))
            del junk
        block.cuda()  # what the documentation says to do: captured anew
        x = torch.randn(8, 64, device="cuda")
        assert torch.equal(block(x), _reference(block, x))
    assert block._graphs.captures == 2


class _Cat(nn.ModuleList):
    r"""The branches of a ``Parallel`` (same names), run one after another and joined along dimension 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x) for b in self], 1)


def _swap_in(model: nn.Module, how: str) -> None:
    r"""Give ``model``'s parameters other values, keeping each ``Parameter`` object (seeded: alike for two models)."""
    torch.manual_seed(1)
    if how == "load_state_dict":
        state = {k: torch.randn_like(v) / 8 for k, v in model.state_dict().items()}  # (of the scale of the init)
        previous = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.load_state_dict(state, assign=True)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(previous)
    else:
        name = [n for n, _ in model.named_parameters()][2]  # (a weight of branch 1: one member of a group)
        weight = model.get_parameter(name)
        torch.utils.swap_tensors(weight, nn.Parameter(torch.randn_like(weight) / 8))


@cuda
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("how", ["load_state_dict", "swap_tensors"])
@pytest.mark.parametrize("build", ["unfused", "fused", "pipeline"])
def test_parameters_swapped_in_after_capture_are_read(build, how, train):
    # Under torch.__future__.set_swap_module_params_on_conversion(True), load_state_dict(assign=True)
    # swaps the loaded tensors into the Parameter objects (torch.utils.swap_tensors), as .to() and
    # .half() do: nothing is registered, every object stays, and the graphs replayed the weights
    # they were captured with (kept alive), where without the flag the new Parameters registered
    # are seen and captured anew. So did one member's weight swapped by hand.
    branches = _mlp(3)
    if build == "pipeline":
        first, last = nn.Linear(64, 64), nn.Linear(3 * 64, 64)
        reference = nn.Sequential(copy.deepcopy(first), _Cat(copy.deepcopy(branches)), copy.deepcopy(last))
        block = ParallelSequential(first, Parallel(*branches, fuse=True), last, chunks=2, cuda_graph=True)
    else:
        reference = _Cat(copy.deepcopy(branches))
        block = Parallel(*branches, cuda_graph=True, fuse=build == "fused")
    block, reference = block.cuda().train(train), reference.cuda().train(train)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (block, reference)]
    # (Fused, or in micro-batches: float32 sums in another order.)
    tol = {} if build == "unfused" else dict(rtol=1e-5, atol=1e-5)
    for step in range(6):
        if step == 3:
            _swap_in(block, how)
            _swap_in(reference, how)
        x = torch.randn(8, 64, device="cuda")
        with torch.set_grad_enabled(train):
            out, expected = block(x), reference(x)
        torch.testing.assert_close(out, expected, **tol)
        if train:
            for optimizer in optimizers:
                optimizer.zero_grad()
            out.square().mean().backward()
            expected.square().mean().backward()
            for p, p_ref in zip(block.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, p_ref.grad, **tol)
            for optimizer in optimizers:
                optimizer.step()


@cuda
def test_kept_outputs_are_not_overwritten():
    block = _graphed(_mlp(4))
    with torch.no_grad():
        x1, x2 = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
        y1 = block(x1)
        kept = y1.clone()
        y2 = block(x2)
        assert y1.data_ptr() != y2.data_ptr()
        assert torch.equal(y1, kept) and torch.equal(y2, _reference(block, x2))


def test_lending_follows_reference_counts():
    # _Lending on plain CPU tensors standing in for a graph's output buffers.
    from parallel_modules._graphs import _LEND_AFTER, _Lending

    static = [torch.randn(3), torch.randn(2, 2)]
    lending = _Lending()
    for _ in range(_LEND_AFTER + 1):  # outputs dropped before each next call
        assert not lending.held()
        out = lending.outputs(static)
        assert all(o.data_ptr() != s.data_ptr() for o, s in zip(out, static))
        del out
    assert lending.lent
    out = lending.outputs(static)
    assert [o.data_ptr() for o in out] == [s.data_ptr() for s in static]
    del out
    assert not lending.held()  # released: the buffers may be overwritten
    out = lending.outputs(static)
    view = out[1][0]  # the caller keeps a view of one output only
    del out
    assert lending.held() and not lending.lent
    del view
    out = lending.outputs(static)  # clones from now on
    assert all(o.data_ptr() != s.data_ptr() for o, s in zip(out, static)) and not lending.lent

    keeper, kept = _Lending(), []
    for _ in range(40):  # a caller collecting results is never lent a buffer
        assert not keeper.held()
        kept.append(keeper.outputs(static))
    assert not keeper.lent and keeper.watch == 0


def test_storage_use_count_still_counts_aliases():
    # Lending rests on torch._C._storage_Use_Count (as inductor's cudagraph trees
    # do); a torch release that drops or changes it must fail here.
    from parallel_modules._graphs import _use_count

    assert _use_count is not None
    t = torch.randn(4)
    from torch.multiprocessing.reductions import StorageWeakRef

    ref = StorageWeakRef(t.untyped_storage())
    base = _use_count(ref.cdata)
    alias = t.detach()
    view = alias[1:]
    assert _use_count(ref.cdata) == base + 2
    del alias, view
    assert _use_count(ref.cdata) == base


@cuda
def test_released_outputs_are_lent_and_a_kept_one_is_never_overwritten():
    block = _graphed(_mlp(4))
    graph = None
    with torch.no_grad():
        for _ in range(6):  # outputs consumed and dropped, as inside a model
            x = torch.randn(8, 64, device="cuda")
            assert torch.equal(block(x), _reference(block, x))
        graph = _only_graph(block)
        assert graph.lending.lent
        x1, x2 = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
        y1 = block(x1)
        assert y1.data_ptr() == graph.outputs[0].data_ptr()  # lent, not copied
        part = y1[:, :5]
        del y1  # only a view of the lent output survives
        y2 = block(x2)  # must not overwrite it: runs eagerly, stops lending
        assert torch.equal(part, _reference(block, x1)[:, :5])
        assert torch.equal(y2, _reference(block, x2))
        assert not graph.lending.lent and block._graphs.captures == 1
        for _ in range(3):  # nor do the calls after it while the view lives
            x = torch.randn(8, 64, device="cuda")
            assert torch.equal(block(x), _reference(block, x))
        assert torch.equal(part, _reference(block, x1)[:, :5])
        del part
        for _ in range(5):
            y = block(x1)  # the caller keeps outputs now: clones
            assert y.data_ptr() != graph.outputs[0].data_ptr() and torch.equal(y, _reference(block, x1))


@cuda
def test_kept_outputs_in_a_loop_are_never_lent():
    block = _graphed(_mlp(4), join=None)
    results = []
    with torch.no_grad():
        for _ in range(30):
            x = torch.randn(8, 64, device="cuda")
            y = block(x)  # the previous y is still alive at each call
            results.append((x, y[2]))
        for x, kept in results:
            assert torch.equal(kept, block[2](x))
        assert not _only_graph(block).lending.lent


@cuda
def test_lent_output_read_on_one_stream_is_safe_from_a_replay_on_another():
    block = _graphed(_mlp(4))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.no_grad():
        with torch.cuda.stream(s1):
            for _ in range(6):
                block(torch.randn(8, 64, device="cuda"))
        assert _only_graph(block).lending.lent
        for _ in range(5):
            x1 = torch.randn(8, 64, device="cuda")
            x2 = torch.randn(8, 64, device="cuda")
            torch.cuda.synchronize()
            with torch.cuda.stream(s1):
                y = block(x1)
                torch.cuda._sleep(1_000_000)  # s1 reads the lent buffer late
                doubled = y * 2
                del y
            with torch.cuda.stream(s2):
                block(x2)  # must wait for s1 before overwriting the buffer
            torch.cuda.synchronize()
            assert torch.equal(doubled, _reference(block, x1) * 2)


@cuda
def test_static_outputs_alias_the_graph_buffers():
    block = _graphed(_mlp(4), static_outputs=True)
    with torch.no_grad():
        x1, x2 = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
        y1 = block(x1)
        assert torch.equal(y1, _reference(block, x1))
        y2 = block(x2)
        # Documented: the same buffer, valid until the next call, which overwrote it.
        assert y1.data_ptr() == y2.data_ptr()
        assert torch.equal(y1, _reference(block, x2))


@cuda
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("input_grad", [True, False])
def test_training_gradients_equal_eager(input_grad, direct, monkeypatch):
    branches = _mlp(8)
    reference = nn.ModuleList(copy.deepcopy(branches)).cuda()
    block = _graphed(branches, direct_grads=direct)
    handed = _count_hand_outs(monkeypatch)
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    weight = torch.randn(8, 8 * 64, device="cuda")
    lent = []  # the gradients' storages after each backward
    for _ in range(5):
        base = torch.randn(8, 64, device="cuda")
        x, x_ref = base.clone().requires_grad_(input_grad), base.clone().requires_grad_(input_grad)
        out, out_ref = block(x), _reference(reference, x_ref)
        torch.testing.assert_close(out, out_ref)
        (out * weight).sum().backward()
        (out_ref * weight).sum().backward()
        lent.append([p.grad.data_ptr() for p in block.parameters()])
        if input_grad:
            torch.testing.assert_close(x.grad, x_ref.grad)
        for p, p_ref in zip(block.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad)
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    for p, p_ref in zip(block.parameters(), reference.parameters()):
        torch.testing.assert_close(p, p_ref)
    graph = _only_graph(block)
    assert graph.bwd is not None and block._graphs.captures == 1
    # A plain backward() with nothing listening on the parameters: the replay's backward
    # wrote their gradients itself, with or without direct_grads, and .grad holds the
    # graph's own buffers (nothing copied them); zero_grad() let go of them every step.
    assert handed == [5]
    assert all(ptrs == [g.data_ptr() for g in graph.param_copies.sources] for ptrs in lent)
    assert graph.param_copies.kept is None and graph.lends_grads


@cuda
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("change", ["frozen", "grad_dtype"])
def test_a_parameter_changed_between_forward_and_backward_takes_its_gradient_as_eagerly(change, direct, fuse):
    # An accumulator reads its parameter when the backward runs it: a parameter frozen between
    # a forward and its backward gets no gradient, one given a grad_dtype meanwhile gets its
    # gradient cast. The replay's hand-out to .grad did neither (it wrote the frozen one's
    # .grad, and the cast one's setter raised at the end of the backward pass).
    if change == "grad_dtype" and not hasattr(torch.Tensor, "grad_dtype"):
        pytest.skip("this torch has no Tensor.grad_dtype")
    branches = _mlp(2)
    reference = nn.ModuleList(copy.deepcopy(branches)).cuda()
    block = _graphed(branches, direct_grads=direct, fuse=fuse)  # (fused: a member's own slice of the stacks)
    for step in range(4):  # the capture, then replays; .grad set to None, or zeroed, between them
        x = torch.randn(8, 64, device="cuda")
        out, out_ref = block(x), _reference(reference, x)
        changed = [next(module.parameters()) for module in (block, reference)]
        for p in changed:
            if change == "frozen":
                p.requires_grad_(False)
            elif step == 0:
                p.grad_dtype = torch.float64
        out.square().sum().backward()
        out_ref.square().sum().backward()
        for p, p_ref in zip(block.parameters(), reference.parameters()):
            assert (p.grad is None) == (p_ref.grad is None)
            if p.grad is not None:
                assert p.grad.dtype == p_ref.grad.dtype
                # (Fused: float32 sums in another order, then cast: float32's tolerance, not float64's.)
                torch.testing.assert_close(p.grad, p_ref.grad, **(dict(rtol=1.3e-6, atol=1e-5) if fuse else {}))
        for p in changed:
            p.requires_grad_(True)
        block.zero_grad(set_to_none=step % 2 == 0)
        reference.zero_grad(set_to_none=step % 2 == 0)
    assert changed[0].grad is None if change == "frozen" else changed[0].grad.dtype == torch.float64


def _count_hand_outs(monkeypatch) -> list[int]:
    r"""Count the calls of ``_graphs._hand_out`` (``direct_grads`` handing gradients to ``.grad``)."""
    from parallel_modules import _graphs

    calls = [0]
    real = _graphs._hand_out

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(_graphs, "_hand_out", counted)
    return calls


def test_fresh_gradients_are_copies_in_order_and_layout():
    # How a training replay hands out the backward graph's gradients (``_Graph.fresh_grads``),
    # on the CPU: gradients of mixed shapes and dtypes, and a channels-last one, come back in
    # order, equal, in their own layout, and in no memory of the graph's.
    from parallel_modules._graphs import _Graph

    graph = _Graph.__new__(_Graph)
    graph.device = torch.device("cpu")
    graph.inputs = []
    grads = [torch.randn(3, 4), None, torch.randn(5), torch.randn(3, 4, dtype=torch.float64),
             torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), torch.randn(3, 4), torch.randn(5)]
    graph.grad_inputs = grads
    graph.params = tuple(nn.Parameter(torch.zeros_like(g if g is not None else torch.empty(0))) for g in grads)
    graph.plan_grads()
    assert graph.takers == tuple(p for p, g in zip(graph.params, grads) if g is not None)
    present = [g for g in grads if g is not None]
    for _ in range(2):
        fresh = graph.fresh_grads()
        assert len(fresh) == len(present)
        for f, g in zip(fresh, present):
            assert torch.equal(f, g) and f.dtype == g.dtype and f.stride() == g.stride()
            assert f.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()
    same_shape = [f.untyped_storage().data_ptr() for f in fresh if f.shape == (3, 4) and f.dtype == torch.float32]
    assert len(same_shape) == 2 and same_shape[0] == same_shape[1]  # one buffer per shape and dtype


@cuda
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("between", ["set_to_none", "view", "accumulate"])
def test_training_gradients_are_never_overwritten_by_a_later_replay(between, fuse, direct):
    # The first backward lends the graph's gradient buffers to .grad. .grad tensors kept after
    # zero_grad(set_to_none=True) (or views of them), or accumulated into over several
    # backwards, must see no later replay: the next call finds them held and runs eagerly, and
    # the module copies gradients out from then on; accumulating .grad gets a copy of its own.
    branches = _mlp(4)
    reference = nn.ModuleList(copy.deepcopy(branches)).cuda()
    block = _graphed(branches, fuse=fuse, direct_grads=direct)
    kept, kept_ref = [], []
    for step in range(4):
        x = torch.randn(8, 64, device="cuda")
        block(x).square().sum().backward()
        _reference(reference, x).square().sum().backward()
        if step == 0:
            # (A fused group's gradients are views of its stacked gradients, one memory: copied.)
            assert _only_graph(block).grads_lent == (not fuse)
        tol = dict(rtol=1e-5, atol=1e-5) if fuse else {}
        for p, p_ref in zip(block.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, **tol)
        if between != "accumulate":
            kept.append([p.grad if between == "set_to_none" else p.grad.view(-1) for p in block.parameters()])
            kept_ref.append([p.grad.clone().view_as(k) for p, k in zip(reference.parameters(), kept[-1])])
            block.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
    for grads, grads_ref in zip(kept, kept_ref):
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref, **tol)
    graph = _only_graph(block)
    assert not graph.lends_grads and graph.param_copies.sources
    # Kept: the lending graph was dropped and the module captured one that copies; accumulated:
    # the same graph, copying from the second backward on.
    assert block._graphs.captures == (1 if between == "accumulate" or fuse else 2)


class _Summed(nn.Module):
    r"""``x @ (a + b)``: the add hands one gradient tensor to both parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(64, 64) / 8)
        self.b = nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.a + self.b)


@cuda
def test_parameters_given_one_gradient_tensor_get_a_grad_each():
    # The backward graph computes one tensor for both of _Summed's parameters: lent, their .grad
    # would be one memory, and clip_grad_norm_ (a multi-tensor scale in place) scale it twice.
    torch.manual_seed(0)
    branches = [_Summed(), nn.Linear(64, 64)]
    reference = nn.ModuleList(copy.deepcopy(branches)).cuda()
    block = _graphed(branches)
    for _ in range(3):
        x = torch.randn(8, 64, device="cuda")
        block(x).square().sum().backward()
        _reference(reference, x).square().sum().backward()
        for module in (block, reference):
            torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
        for p, p_ref in zip(block.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad)
        block.zero_grad()
        reference.zero_grad()
    graph = _only_graph(block)
    assert not graph.lends_grads and block._graphs.captures == 1


@cuda
@pytest.mark.parametrize("direct", [False, True])
def test_a_lent_gradient_saved_by_autograd_is_never_read_overwritten(direct):
    # A lent gradient used in a differentiable expression is saved by autograd, in C++, where
    # no Python reference shows. The next replay either sees it held (the call runs eagerly)
    # or moves its version: a later backward through it then gets the values it saved, or
    # autograd's error for a tensor changed in place, never the next step's gradient.
    block = _graphed(_mlp(2), direct_grads=direct)
    w = torch.randn(64, 64, device="cuda", requires_grad=True)
    block(torch.randn(8, 64, device="cuda")).square().sum().backward()
    weight = next(block.parameters())
    saved = weight.grad.clone()
    aux = (weight.grad * w).sum()  # saves the lent gradient for w's gradient
    block.zero_grad(set_to_none=True)
    block(torch.randn(8, 64, device="cuda")).square().sum().backward()
    try:
        aux.backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
    else:
        torch.testing.assert_close(w.grad, saved)


@cuda
def test_training_backward_after_a_later_forward_is_refused():
    block = _graphed(_mlp(2))
    x = torch.randn(8, 64, device="cuda")
    block(x).sum().backward()  # capture
    first = block(x)
    block(x)  # overwrites the activations ``first`` needs
    with pytest.raises(RuntimeError, match="backward"):
        first.sum().backward()
    block(x).sum().backward()  # still usable


@cuda
@pytest.mark.parametrize("direct", [False, True])
def test_training_backward_with_create_graph_is_refused(direct):
    # A gradient penalty through a graphed block: eagerly the input's gradient depends on the
    # weights; the captured backward's is a constant, and the penalty lost the block's part
    # silently (from ``out.sum()`` no incoming gradient requires grad, which once_differentiable
    # let through).
    block = _graphed(_mlp(2), direct_grads=direct)
    for _ in range(2):  # the capture, then a replay
        x = torch.randn(8, 64, device="cuda", requires_grad=True)
        out = block(x)
        with pytest.raises(RuntimeError, match=r"Parallel: backward with create_graph=True.*cuda_graph=False"):
            torch.autograd.grad(out.sum(), x, create_graph=True)
        out.sum().backward()  # nothing was consumed: the plain backward still runs
    block.zero_grad()
    block.cuda_graph = False  # what the error advises: the penalty then reaches the weights
    plain = nn.ModuleList(copy.deepcopy(list(block))).cuda()
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(block(x).sum(), x, create_graph=True)
    g.square().sum().backward()
    (gr,) = torch.autograd.grad(_reference(plain, xr).sum(), xr, create_graph=True)
    gr.square().sum().backward()
    for (name, p), r in zip(block.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and p.grad.abs().sum() > 0, name  # (each layer's GELU' reads its bias)
        torch.testing.assert_close(p.grad, r.grad, msg=name)


@cuda
@pytest.mark.parametrize("listener", [None, "post_accumulate_hook", "tensor_hook", "late_hook"])
def test_parameters_stay_in_autograds_graph_without_direct_grads(listener, monkeypatch):
    # Without direct_grads the parameters are inputs of the replay's autograd node, as in any
    # graph: torch.autograd.grad and backward(inputs=...) may name them, hooks on them run as
    # they do on the eager module -- one registered between a forward and its backward too --
    # and only a plain backward() with nothing listening lets the replay write .grad itself.
    branches = _mlp(3)
    reference = nn.ModuleList(copy.deepcopy(branches)).cuda()
    block = _graphed(branches)
    handed = _count_hand_outs(monkeypatch)
    params, params_ref = list(block.parameters()), list(reference.parameters())
    seen: list[torch.Tensor] = []
    seen_ref: list[torch.Tensor] = []

    def listen(step: int) -> None:
        for p, into in ((params[0], seen), (params_ref[0], seen_ref)):
            if listener == "post_accumulate_hook" and step == 0:
                p.register_post_accumulate_grad_hook(lambda p, into=into: into.append(p.grad.clone()))
            elif (listener == "tensor_hook" and step == 0) or (listener == "late_hook" and step == 1):
                p.register_hook(lambda g, into=into: into.append(g.clone()))

    for step in range(3):
        base = torch.randn(8, 64, device="cuda")
        x, x_ref = base.clone().requires_grad_(), base.clone().requires_grad_()
        if listener != "late_hook":
            listen(step)
        grads = torch.autograd.grad(block(x).square().sum(), [x, *params])
        grads_ref = torch.autograd.grad(_reference(reference, x_ref).square().sum(), [x_ref, *params_ref])
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref)
        block(x).square().sum().backward(inputs=[params[1]])
        assert params[1].grad is not None and all(p.grad is None for i, p in enumerate(params) if i != 1)
        torch.testing.assert_close(params[1].grad, grads_ref[2])
        block.zero_grad()
        out, out_ref = block(x), _reference(reference, x_ref)
        if listener == "late_hook":
            listen(step)  # between the forward and its backward
        out.square().sum().backward()
        out_ref.square().sum().backward()
        for p, p_ref in zip(params, params_ref):
            torch.testing.assert_close(p.grad, p_ref.grad)
        torch.testing.assert_close(x.grad, x_ref.grad)
        block.zero_grad()
        reference.zero_grad()
    assert len(seen) == len(seen_ref) and bool(seen) == (listener is not None)
    for g, g_ref in zip(seen, seen_ref):
        torch.testing.assert_close(g, g_ref)
    # The replay wrote .grad itself on the plain backward()s no hook listened to.
    assert handed == [{None: 3, "late_hook": 1}.get(listener, 0)]


@cuda
@pytest.mark.parametrize("outside_first", [False, True])
def test_training_gradients_of_a_parameter_also_used_outside_the_block(outside_first):
    # A parameter the graphed block shares with the rest of the model (tied weights): the
    # replay writes its share into .grad, the accumulator adds the rest, in whichever order
    # the engine runs them; with .grad set by an earlier backward, both add to it.
    branches = _mlp(3)
    head = nn.Linear(64, 64).cuda()
    block = _graphed(branches)
    reference = nn.ModuleList(copy.deepcopy(branches)).cuda()
    head_ref = copy.deepcopy(head)
    shared, shared_ref = branches[1][0].weight, reference[1][0].weight

    def loss(blk, hd, w, x):
        out = blk(x) if blk is block else _reference(blk, x)
        tied = torch.nn.functional.linear(hd(x), w)  # the shared weight, outside the block
        return (out.square().sum() + tied.sum()) if outside_first else (tied.sum() + out.square().sum())

    for step in range(4):
        x = torch.randn(8, 64, device="cuda")
        loss(block, head, shared, x).backward()
        loss(reference, head_ref, shared_ref, x).backward()
        for p, p_ref in zip([*block.parameters(), *head.parameters()],
                            [*reference.parameters(), *head_ref.parameters()]):
            torch.testing.assert_close(p.grad, p_ref.grad)
        if step % 2:  # every other step, accumulate over two backwards
            for m in (block, head, reference, head_ref):
                m.zero_grad()


class _SlowGrad(torch.autograd.Function):
    # The identity, whose backward first keeps its stream busy for about 10 ms (when captured
    # into a backward graph, on each replay), so that an unordered write after it shows.
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        torch.cuda._sleep(20_000_000)
        return g


class _SlowGradFor(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def forward(self, x):  # (decided while captured: one signature is slow, the other not)
        return _SlowGrad.apply(x) if x.shape[0] == self.rows else x


@cuda
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("case", ["block called from two streams", "parameter used outside on another stream"])
def test_gradients_handed_to_grad_are_ordered_with_other_streams(case, direct):
    # Before: the backward replay wrote .grad on its own stream, unordered with the block's
    # backward for a call made on another stream, and with the accumulator of a parameter
    # also used outside the block on another stream: one contribution was lost (max error
    # 10-14 on the H100). Now .grad is written when the backward pass ends, on its caller's stream.
    torch.manual_seed(0)
    shared, other = nn.Linear(64, 64), nn.Linear(64, 64)
    reference = nn.ModuleList([copy.deepcopy(shared), copy.deepcopy(other)]).cuda()
    block = _graphed([nn.Sequential(shared, _SlowGradFor(8)), other], direct_grads=direct)
    side, other_side = torch.cuda.Stream(), torch.cuda.Stream()
    for step in range(4):
        x, z = torch.randn(8, 64, device="cuda"), torch.randn(4, 64, device="cuda")
        w, v = torch.randn(8, 128, device="cuda"), torch.randn(4, 128 if case.startswith("block") else 64,
                                                                 device="cuda")
        torch.cuda.synchronize()
        if case.startswith("block"):  # one block, two signatures, two streams
            with torch.cuda.stream(other_side):
                b = block(z)
            with torch.cuda.stream(side):
                a = block(x)
            expected = lambda r: (_reference(r, x) * w).sum() + (_reference(r, z) * v).sum()  # noqa: E731
        else:  # shared's weight, used outside the block on the default stream first
            b = block[0][0](z)
            with torch.cuda.stream(side):
                a = block(x)
            expected = lambda r: (r[0](z) * v).sum() + (_reference(r, x) * w).sum()  # noqa: E731
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.current_stream().wait_stream(other_side)
        ((a * w).sum() + (b * v).sum()).backward()
        expected(reference).backward()
        for p, p_ref in zip(block.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-4)
        if step % 2:  # every other step, accumulate over two backwards
            block.zero_grad()
            reference.zero_grad()


class _Gate(torch.autograd.Function):
    # A CPU node whose backward waits for ``event``: it holds a backward pass open on the
    # calling thread, while the device's autograd thread stays free for other passes.
    @staticmethod
    def forward(ctx, c, event):
        ctx.event = event
        return c * 1

    @staticmethod
    def backward(ctx, g):
        assert ctx.event.wait(120)
        return g, None


@cuda
def test_another_threads_training_step_while_a_backward_pass_is_open(monkeypatch):
    # The parameters' gradients wait in the graph's buffers until the backward pass ends. Thread
    # B's training step, meanwhile: its forward replay overwrites those buffers, and so first
    # copies them out; its hand-out, on its own stream and held back there by a sleep, comes
    # first, and A's must add to it after it, not before (before: B's copy into .grad then
    # overwrote A's sum, leaving B's gradients alone).
    from parallel_modules._graphs import _HandOut

    staged = []
    real_stage = _HandOut.stage
    monkeypatch.setattr(_HandOut, "stage", lambda self, graph: (staged.append(1), real_stage(self, graph))[1])
    torch.manual_seed(0)
    branches = _mlp(2)
    reference = nn.ModuleList(copy.deepcopy(branches)).cuda()
    block = _graphed(branches)
    for _ in range(3):  # captured, then replayed
        block(torch.randn(8, 64, device="cuda")).sum().backward()
    block.zero_grad(set_to_none=True)
    graph = _only_graph(block)
    xa, xb = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
    wa, wb = torch.randn(8, 128, device="cuda"), torch.randn(8, 128, device="cuda")
    fa, ca, fb, cb = (torch.cuda.Stream() for _ in range(4))
    b_done, errors = threading.Event(), []

    def thread_b() -> None:
        try:
            for _ in range(60_000):  # until A's backward replay has queued its hand-out
                if graph.pending is not None:
                    break
                time.sleep(0.001)
            with torch.cuda.stream(fb):
                loss = (block(xb) * wb).sum()
            with torch.cuda.stream(cb):
                cb.wait_stream(fb)
                torch.cuda._sleep(100_000_000)  # about 50 ms on the H100
                loss.backward()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
        finally:
            b_done.set()

    with torch.cuda.stream(fa):
        loss = (block(xa) * wa).sum()
    thread = threading.Thread(target=thread_b)
    thread.start()
    with torch.cuda.stream(ca):
        ca.wait_stream(fa)
        torch.autograd.backward([loss, _Gate.apply(torch.zeros(1, requires_grad=True), b_done).sum()])
    thread.join()
    torch.cuda.current_stream().wait_stream(ca)
    assert not errors and staged == [1]
    for x, w in ((xa, wa), (xb, wb)):
        (_reference(reference, x) * w).sum().backward()
    for p, p_ref in zip(block.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad)
    block.zero_grad(set_to_none=True)
    block(xa).sum().backward()  # and the next step as usual
    assert block._graphs.captures == 1


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom")


@cuda
def test_backward_pass_that_raises_after_the_replay():
    # A pass that raises runs no final callback: the gradients its replay left are dropped by
    # the next forward replay, the next step is as usual, and nothing keeps the graph alive
    # once evicted (before: a reference cycle kept it, its pool included, until a collection).
    torch.manual_seed(0)
    branches = _mlp(2)
    reference = nn.ModuleList(copy.deepcopy(branches)).cuda()
    block = _graphed(branches, max_graphs=1)
    for _ in range(3):  # captured, then replayed
        block(torch.randn(8, 64, device="cuda")).sum().backward()
    block.zero_grad(set_to_none=True)
    c = torch.zeros(1, device="cuda", requires_grad=True)

    def failing_step() -> None:  # (_Boom's node is older than the replay's: its backward runs after it)
        boom = _Boom.apply(c)
        with pytest.raises(RuntimeError, match="boom"):
            (block(torch.randn(8, 64, device="cuda")).sum() + boom.sum()).backward()

    failing_step()
    block.zero_grad(set_to_none=True)
    x = torch.randn(8, 64, device="cuda")
    block(x).sum().backward()
    _reference(reference, x).sum().backward()
    for p, p_ref in zip(block.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, p_ref.grad)
    failing_step()
    assert block._graphs.captures == 1
    graph = weakref.ref(_only_graph(block))
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            block(torch.randn(4, 64, device="cuda")).sum().backward()  # another signature: evicts it
        assert graph() is None
    finally:
        gc.enable()


@cuda
def test_direct_grads_leave_grad_alone_outside_backward(monkeypatch):
    # torch.autograd.grad and backward(inputs=...) name the tensors whose gradients they want:
    # the parameters' .grad must stay as it is, as autograd leaves it; a plain backward fills it.
    branches = _mlp(3)
    reference = nn.ModuleList(copy.deepcopy(branches)).cuda()
    block = _graphed(branches, direct_grads=True)
    handed = _count_hand_outs(monkeypatch)
    for _ in range(2):
        base = torch.randn(8, 64, device="cuda")
        x, x_ref = base.clone().requires_grad_(), base.clone().requires_grad_()
        (g,) = torch.autograd.grad(block(x).square().sum(), x)
        (g_ref,) = torch.autograd.grad(_reference(reference, x_ref).square().sum(), x_ref)
        torch.testing.assert_close(g, g_ref)
        block(x).square().sum().backward(inputs=[x])
        torch.testing.assert_close(x.grad, g_ref)
        assert all(p.grad is None for p in block.parameters())
    assert handed == [0]
    # Documented: the parameters are not in autograd's graph, so asking for theirs fails.
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(block(x).sum(), [next(block.parameters())])
    block(x).square().sum().backward()
    _reference(reference, x_ref).square().sum().backward()
    for p, p_ref in zip(block.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad)
    assert handed == [1]


@cuda
@pytest.mark.parametrize("listener", ["post_accumulate_hook", "tensor_hook", "process_group"])
def test_direct_grads_defer_to_hooks_and_process_groups(listener, monkeypatch):
    from parallel_modules import _graphs

    branches = _mlp(3)
    reference = nn.ModuleList(copy.deepcopy(branches)).cuda()
    block = _graphed(branches, direct_grads=True)
    handed = _count_hand_outs(monkeypatch)
    block(torch.randn(8, 64, device="cuda")).sum().backward()  # captured; direct
    assert handed == [1]
    block.zero_grad()
    first = next(block.parameters())
    seen: list[torch.Tensor] = []
    distributed = _graphs._distributed
    if listener == "post_accumulate_hook":
        handle = first.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    elif listener == "tensor_hook":
        handle = first.register_hook(lambda g: seen.append(g.clone()))
    else:
        monkeypatch.setattr(_graphs, "_distributed", lambda: True)
    for _ in range(2):
        x = torch.randn(8, 64, device="cuda")
        block(x).square().sum().backward()
        _reference(reference, x).square().sum().backward()
        for p, p_ref in zip(block.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad)
    assert handed == [1]  # autograd's accumulators took them, and ran the hooks
    if listener == "process_group":
        monkeypatch.setattr(_graphs, "_distributed", distributed)
    else:
        assert len(seen) == 2
        if listener == "post_accumulate_hook":
            torch.testing.assert_close(seen[-1], first.grad)
        handle.remove()
    block(x).sum().backward()
    assert handed == [2]  # nothing listens any more: direct again
    # A hook registered between a direct forward and its backward could not run: refused, by name.
    out = block(x)
    handle = first.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(RuntimeError, match="Parallel.*hook.*before the forward"):
        out.sum().backward()
    handle.remove()
    block(x).sum().backward()
    assert handed == [3]  # and the module works on


@cuda
def test_direct_grads_in_a_graphed_pipeline(monkeypatch):
    from parallel_modules import ParallelSequential

    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)]
    reference = nn.Sequential(*copy.deepcopy(stages)).cuda()
    model = ParallelSequential(*stages, chunks=2, cuda_graph=True, direct_grads=True).cuda()
    handed = _count_hand_outs(monkeypatch)
    for _ in range(3):
        x = torch.randn(16, 32, device="cuda")
        model(x).square().mean().backward()
        reference(x).square().mean().backward()
        for p, p_ref in zip(model.parameters(), reference.parameters()):
            # Two micro-batches against the whole batch: another summation order.
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6)
    assert handed == [3]


@cuda
@pytest.mark.parametrize("grad", [False, True])
def test_batchnorm_buffers_match_eager(grad):
    torch.manual_seed(0)
    branches = [nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16)) for _ in range(3)]
    reference = nn.ModuleList(copy.deepcopy(branches)).cuda().train()
    block = _graphed(branches).train()
    with torch.set_grad_enabled(grad):
        for _ in range(5):
            x = torch.randn(8, 16, device="cuda")
            torch.testing.assert_close(block(x), _reference(reference, x))
    for b, b_ref in zip(block.buffers(), reference.buffers()):
        torch.testing.assert_close(b, b_ref)
    assert all(int(m.num_batches_tracked) == 5 for m in block.modules() if isinstance(m, nn.BatchNorm1d))
    assert block._graphs.captures == 1


@cuda
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("frozen", [False, True])
def test_a_buffer_made_to_require_grad_gets_its_gradient_eagerly(fuse, frozen):
    # Before (a hunt): a graph's backward gave gradients to parameters and inputs alone, so such a
    # buffer silently got none (and with the parameters frozen the output did not require grad).
    torch.manual_seed(0)
    branches = [nn.Sequential(nn.Linear(16, 16), ScaleBy(16)) for _ in range(3)]
    block = Parallel(*copy.deepcopy(branches), cuda_graph=True, fuse=fuse).cuda().requires_grad_(not frozen)
    x = torch.randn(8, 16, device="cuda")
    with torch.no_grad():
        block(x)
    if not frozen:  # (training graphs as ever while no buffer requires grad: a review)
        block(x).sum().backward()
        assert block._graphs.captures == 2
    captures = block._graphs.captures
    for b in block:
        b[1].s.requires_grad_()
    tensors = [*(p for p in block.parameters() if p.requires_grad), *(b[1].s for b in block)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for t in tensors:
            t.grad = None
        out = block(x)
        assert out.requires_grad
        out.sum().backward()
    assert any("require grad" in m for m in _graph_warnings(record))
    got = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    _reference(list(block), x).sum().backward()
    for g, t in zip(got, tensors):
        torch.testing.assert_close(g, t.grad)
    with torch.no_grad():  # (without grad, the graph captured before)
        torch.testing.assert_close(block(x), _reference(list(block), x))
    assert block._graphs.captures == captures


@cuda
def test_new_signature_captures_and_cache_is_bounded():
    block = _graphed(_mlp(4), max_graphs=2)
    with torch.no_grad():
        x = torch.randn(8, 64, device="cuda")
        block(x)
        block(x)
        assert block._graphs.captures == 1
        with pytest.warns(UserWarning, match="recaptured"):
            for batch in [1, 2, 3] * 3:
                x = torch.randn(batch, 64, device="cuda")
                assert torch.equal(block(x), _reference(block, x))
                assert len(block._graphs) <= 2
        assert block._graphs.captures == 10
        block.eval()  # train/eval is part of the signature
        x = torch.randn(3, 64, device="cuda")
        assert torch.equal(block(x), _reference(block, x))
        assert block._graphs.captures == 11
        block.float()  # a cast that changes nothing keeps the graphs (a loop may call it)
        assert len(block._graphs) == 2
        block.double()  # one that changes the parameters drops every graph
        assert len(block._graphs) == 0


@cuda
def test_a_repeated_signature_skips_the_cache_but_sees_every_change():
    # Calls with the signature of the last replay take a shortcut past the cache; the same
    # tensor under another mode must still capture (or find) the graph of that mode.
    block = _graphed(_mlp(4)).eval()
    x = torch.randn(8, 64, device="cuda")
    modes = {
        "eval": lambda: torch.no_grad(),
        "autocast": lambda: torch.autocast("cuda", dtype=torch.float16),
        "inference_mode": lambda: torch.inference_mode(),
    }
    for round in range(2):  # the second round finds every graph in the cache
        for name, mode in modes.items():
            for _ in range(3):
                with mode():
                    out, expected = block(x), _reference(block, x)
                assert out.dtype == expected.dtype and torch.equal(out, expected), name
        block.train()
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(block(x), _reference(block, x))
        block.eval()
        assert block._graphs.captures == 4, round
    # Recording autograd for an input that requires grad: a training graph, gradients included.
    xg = x.clone().requires_grad_()
    out = block(xg)
    assert out.requires_grad and block._graphs.captures == 5
    (grad,) = torch.autograd.grad(out.sum(), xg)
    (expected,) = torch.autograd.grad(_reference(block, xg).sum(), xg)
    assert torch.equal(grad, expected)


@cuda
def test_a_branch_captured_on_a_high_priority_stream_replays_equal(monkeypatch):
    # Heterogeneous branches are also captured with each side branch on a high-priority
    # stream; here the last variant (branch '2' first) is made to replay fastest.
    from parallel_modules import _graphs

    monkeypatch.setattr(_graphs, "_fastest", lambda graphs, stream: graphs[-1])
    torch.manual_seed(0)
    branches = [nn.Linear(64, 32), nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16)),
                nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(64, 64), nn.ReLU())])]
    block = _graphed(branches).eval()
    with torch.no_grad():
        for _ in range(4):  # fresh inputs: replays equal eager bit for bit
            x = torch.randn(8, 64, device="cuda")
            assert torch.equal(block(x), _reference(block, x))
    (variant,) = block._graphs.variants().values()
    assert [type(v).__name__ for v in variant] == ["_Priority"] and variant[0].index == 2
    (described,) = block.explain()["schedules"].values()
    assert described.endswith("streams, branch '2' on a high-priority stream"), described
    assert block._graphs.captures == 1  # one signature, however many variants it tried


@cuda
def test_a_launch_order_and_a_high_priority_slot_together():
    # A variant may give both (as tools/exp_inception_variants.py does): the slot's branch is
    # the one the order launches there, and explain() names that one.
    from parallel_modules.parallel import _Order, _Priority

    torch.manual_seed(0)
    branches = [nn.Linear(64, 32), nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16)),
                nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(64, 64), nn.ReLU())])]
    block = _graphed(branches).eval()
    block._graph_variants = lambda args, kwargs, first_only=False: [(_Order((1, 2, 0)), _Priority(2))]
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 64, device="cuda")
            assert torch.equal(block(x), _reference(block, x))
    (described,) = block.explain()["schedules"].values()
    assert described.endswith("streams, branch '0' on a high-priority stream, launched in the order "
                              "['1', '2', '0']"), described


class _Sleepy(nn.Module):
    r"""A linear layer behind a GPU spin of ``cycles``: branches whose lengths are known.

    Under a capture, each call appends ``(tag, stream)`` to ``launches``.
    """

    def __init__(self, cycles: int, tag: int = 0, launches: list | None = None) -> None:
        super().__init__()
        self.cycles, self.tag, self.launches = cycles, tag, launches
        self.linear = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.launches is not None and torch.cuda.is_current_stream_capturing():
            self.launches.append((self.tag, torch.cuda.current_stream()))
        torch.cuda._sleep(self.cycles)
        return self.linear(x)


@cuda
def test_branches_captured_longest_first_replay_equal(monkeypatch):
    # Heterogeneous branches are also captured in the order of their time alone, longest
    # first (a replay starts the graph's streams one after another); here that variant is
    # made to replay fastest.
    from parallel_modules import _graphs
    from parallel_modules.parallel import _Order

    def ordered_if_any(graphs, stream):
        return next((g for g in graphs if g.variant and isinstance(g.variant[0], _Order)), graphs[0])

    monkeypatch.setattr(_graphs, "_fastest", ordered_if_any)
    torch.manual_seed(0)
    launches: list = []
    block = _graphed([_Sleepy(c, i, launches) for i, c in enumerate([10_000, 4_000_000, 1_000_000])]).eval()
    x = torch.randn(8, 64, device="cuda")
    assert block._longest_first((x,), {}) == (1, 2, 0)
    # Timed on copies: a branch changing its input in place does not change the caller's.
    seen = []
    block[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].data_ptr()))
    block._longest_first((x,), {})
    assert seen and x.data_ptr() not in seen
    block[0]._forward_pre_hooks.clear()
    with torch.no_grad():
        for _ in range(4):  # fresh inputs: replays equal eager bit for bit, outputs in branch order
            x = torch.randn(8, 64, device="cuda")
            assert torch.equal(block(x), _reference(block, x))
    assert list(block._graphs.variants().values()) == [(_Order((1, 2, 0)),)]
    # Captures: branch order (0 on the capture stream), then longest first (1 on it), then
    # each side branch on a high-priority stream.
    captures = [launches[i:i + 3] for i in range(0, len(launches), 3)]
    assert [[tag for tag, _ in c] for c in captures[:2]] == [[0, 1, 2], [1, 2, 0]]
    assert captures[1][0][1] == captures[0][0][1]  # the first launched runs on the capture stream
    assert len({s for _, s in captures[1]}) == 3
    (described,) = block.explain()["schedules"].values()
    assert described.endswith("streams, launched in the order ['1', '2', '0']"), described
    # Training captures one variant only, and does not time the branches for the others.
    monkeypatch.setattr(Parallel, "_longest_first", lambda *a: pytest.fail("timed for training"))
    block.train()
    xg = torch.randn(8, 64, device="cuda", requires_grad=True)
    (grad,) = torch.autograd.grad(block(xg).sum(), xg)
    (expected,) = torch.autograd.grad(_reference(block, xg).sum(), xg)
    assert torch.equal(grad, expected)


@cuda
def test_threads_on_their_own_streams():
    block = _graphed(_mlp(8))
    errors: list[BaseException] = []
    mismatches: list[int] = []
    barrier = threading.Barrier(4)

    def work(i: int) -> None:
        try:
            stream = torch.cuda.Stream()
            batch = 8 if i % 2 == 0 else 4  # two signatures, captured under contention
            with torch.cuda.stream(stream), torch.no_grad():
                barrier.wait()
                for _ in range(10):
                    x = torch.randn(batch, 64, device="cuda")
                    # Delay this stream: a replay that did not wait for another
                    # stream's replay would overwrite its static inputs early.
                    torch.cuda._sleep(200_000)
                    out = block(x)
                    if not torch.equal(out, _reference(block, x)):
                        mismatches.append(i)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not mismatches
    assert block._graphs.captures == 2


@cuda
def test_two_modules_interleaved():
    a, b = _graphed(_mlp(4)), _graphed(_mlp(3, width=64 * 4))
    with torch.no_grad():
        for _ in range(10):
            x = torch.randn(8, 64, device="cuda")
            ya = a(x)
            yb = b(ya)
            x2 = torch.randn(8, 64, device="cuda")
            ya2 = a(x2)
            assert torch.equal(yb, _reference(b, _reference(a, x)))
            assert torch.equal(ya, _reference(a, x)) and torch.equal(ya2, _reference(a, x2))
    assert a._graphs.captures == 1 and b._graphs.captures == 1


@cuda
def test_nested_parallel_is_recorded_by_the_outer_graph():
    torch.manual_seed(0)
    inner = Parallel(*_mlp(3), cuda_graph=True)
    outer = _graphed([inner, *_mlp(2)])
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(8, 64, device="cuda")
            expected = torch.cat([_reference(inner, x), outer[1](x), outer[2](x)], 1)
            assert torch.equal(outer(x), expected)
    assert outer._graphs.captures == 1
    assert inner._graphs.captures == 0 and len(inner._graphs) == 0


@cuda
def test_memory_flat_over_replays_and_recaptures():
    block = _graphed(_mlp(8))
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(10):
            y = block(x)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(1000):
            y = block(x)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
        assert torch.equal(y, _reference(block, x))

        allocated, reserved = [], []
        for _ in range(20):
            block._graphs.clear()
            y = block(x)
            gc.collect()
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
            reserved.append(torch.cuda.memory_reserved())
        assert block._graphs.captures == 21
        assert all(a == allocated[2] for a in allocated[2:]), allocated
        assert max(reserved[3:]) <= reserved[2] + 8 * 2**20, reserved


# ------------------------------------------------- inputs read where they lie
@pytest.fixture
def kept_readers(monkeypatch):
    # A reader is kept where it times faster than copying in, which these small blocks are
    # on any host (they are bound by the host's launches); the timing is made to agree.
    from parallel_modules import _graphs

    monkeypatch.setattr(_graphs, "_quickest", lambda calls, *args, **kwargs: 0)


@cuda
@pytest.mark.parametrize("static_outputs", [False, True])
def test_an_input_kept_at_the_first_calls_address_is_read_in_place_and_replays_equal(static_outputs, kept_readers):
    block = _graphed(_mlp(8), static_outputs=static_outputs)
    x = torch.empty(8, 64, device="cuda")
    buffers = set()
    with torch.no_grad():
        for i in range(12):
            x.copy_(torch.randn(8, 64, device="cuda"))  # new values, same address
            y = block(x)
            assert torch.equal(y, _reference(block, x)), i
            if static_outputs:
                buffers.add(y.data_ptr())
            del y
    graph = _only_graph(block)
    assert graph.reader is not None and graph.reader_at == x.data_ptr()
    assert block._graphs.captures == 1  # (the signature's graph; the reader is not a new signature)
    (described,) = block.explain()["schedules"].values()
    assert described.startswith("CUDA graph (input read in place), "), described
    if static_outputs:  # the same buffers whichever graph ran
        assert len(buffers) == 1
    # Nothing was copied in since the first call: the static buffer holds its input.
    assert not torch.equal(graph.inputs[0], x)


@cuda
def test_inputs_elsewhere_are_copied_in_and_replay_equal(kept_readers):
    block = _graphed(_mlp(4))
    a, b = torch.empty(8, 64, device="cuda"), torch.empty(8, 64, device="cuda")
    view = torch.randn(16, 64, device="cuda")[8:]  # an offset into a larger block (2 KiB: aligned)
    with torch.no_grad():
        for i in range(6):
            for x in (a, b, view, torch.randn(8, 64, device="cuda")):
                x.normal_()
                assert torch.equal(block(x), _reference(block, x)), i
    assert _only_graph(block).reader_at == a.data_ptr()


def _laid_out(layout: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    r"""A (8, 6, 5) input of ``layout``: a view whose strides or address a dense copy would not keep."""
    make = {"expanded": lambda: torch.randn(8, 1, 5).expand(8, 6, 5),
            "sliced": lambda: torch.randn(16, 6, 5)[::2],
            "offset": lambda: torch.randn(8, 6, 6)[..., 1:],  # (4 bytes in: no longer 16-byte aligned)
            "transposed": lambda: torch.randn(5, 6, 8).transpose(0, 2)}[layout]
    return _moved(make(), device, dtype)


def _moved(t: torch.Tensor, device: str, dtype: torch.dtype) -> torch.Tensor:
    r"""``t`` on ``device``, with its strides and storage offset (``.to`` makes a view dense)."""
    base = t._base if t._base is not None else t
    return base.to(device, dtype).as_strided(t.shape, t.stride(), t.storage_offset())


@pytest.mark.parametrize("layout", ["expanded", "sliced", "offset", "transposed"])
def test_static_inputs_keep_the_callers_strides_and_values(layout):
    from parallel_modules._graphs import _copy_into, _static_like

    x = _laid_out(layout)
    static = _static_like(x)
    assert static.stride() == x.stride() and torch.equal(static, x)
    assert static.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    fresh = _laid_out(layout)
    _copy_into(static, fresh)  # (an expanded one is written once per element: copy_ refuses it whole)
    assert torch.equal(static, fresh) and static.stride() == x.stride()


def test_static_inputs_without_strides_are_copies():
    from parallel_modules._graphs import _static_like

    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2))
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(3, 3)])
    for t in (sparse, nested):
        static = _static_like(t)
        assert static.layout == t.layout and static.is_nested == t.is_nested
        assert all(torch.equal(a, b) for a, b in zip(static.unbind(), t.unbind())) if t.is_nested else (
            torch.equal(static.to_dense(), t.to_dense()))



def test_a_quantized_static_input_is_a_copy_with_its_quantizer():
    # (An empty tensor of a quantized dtype has no scale nor zero point: a copy into it failed.)
    from parallel_modules._graphs import _static_like

    q = torch.quantize_per_tensor(torch.randn(8, 6), 0.1, 3, torch.quint8)[::2]
    static = _static_like(q)
    assert static.is_quantized and static.q_scale() == q.q_scale() and static.q_zero_point() == q.q_zero_point()
    assert torch.equal(static.int_repr(), q.int_repr())

def test_static_inputs_of_subclasses_keep_their_type_and_values():
    # A plain buffer set to a subclass's strides dropped its type (its operations would not
    # run at capture) and, for a wrapper subclass, its values (its memory is not its own).
    from torch.testing._internal.two_tensor import TwoTensor

    from parallel_modules._graphs import _static_like

    tagged = torch.randn(8, 1).expand(8, 4).as_subclass(_Tagged)
    pair = TwoTensor(torch.randn(3, 4), torch.randn(3, 4))
    static = _static_like(tagged)
    assert type(static) is _Tagged
    assert torch.equal(static.as_subclass(torch.Tensor), tagged.as_subclass(torch.Tensor))
    static = _static_like(pair)
    assert type(static) is TwoTensor and torch.equal(static.a, pair.a) and torch.equal(static.b, pair.b)


def test_a_few_elements_of_a_large_input_get_a_dense_static_input():
    from parallel_modules._graphs import _MAX_SPAN, _static_like

    last = torch.randn(8, 64, 16)[:, -1]  # (the last token's features: 16 of every 1024)
    static = _static_like(last)
    assert torch.equal(static, last) and static.is_contiguous()
    assert static.untyped_storage().nbytes() == last.numel() * last.element_size()
    every_other = torch.randn(16, 6)[::2]  # (a span of 2: kept as it is)
    assert _static_like(every_other).stride() == every_other.stride() and _MAX_SPAN >= 2


@cuda
@pytest.mark.parametrize("layout", ["expanded", "sliced", "offset", "transposed"])
@pytest.mark.parametrize("training", [False, True])
def test_graphs_read_inputs_laid_out_as_the_callers(layout, training):
    # Before (a GPU differential fuzz): the static inputs were dense copies, whose kernels
    # (a Conv1d on an expanded input, a training BatchNorm1d on a sliced one) rounded the
    # last bit otherwise than eager on the caller's own tensor.
    torch.manual_seed(0)
    branches = [nn.Sequential(nn.Conv1d(6, 3, 3, padding=1), nn.BatchNorm1d(3), nn.Sigmoid()),
                nn.Sequential(nn.AvgPool1d(3, 1, 1), nn.Conv1d(6, 3, 1)),
                nn.Sequential(nn.Flatten(), nn.Linear(30, 4))]
    plain = [copy.deepcopy(b).cuda().train(training) for b in branches]
    block = _graphed(branches, join=None).train(training)
    for i in range(5):
        x = _laid_out(layout, "cuda")
        leaf = (x._base if x._base is not None else x).detach()
        xb, xr = (leaf.clone().requires_grad_(training).as_strided(x.shape, x.stride(), x.storage_offset())
                  for _ in range(2))
        out, expected = block(xb), [m(xr) for m in plain]
        for o, e in zip(out, expected):
            assert torch.equal(o, e), (layout, i)
        if training:
            weights = [torch.randn_like(e) for e in expected]
            sum((o * w).sum() for o, w in zip(out, weights)).backward()
            sum((e * w).sum() for e, w in zip(expected, weights)).backward()
            for p, q in zip(block.parameters(), (q for m in plain for q in m.parameters())):
                torch.testing.assert_close(p.grad, q.grad)
    assert _only_graph(block).inputs[0].stride() == x.stride()


@cuda
def test_inference_tensors_are_read_in_place(kept_readers):
    block = _graphed(_mlp(4))
    with torch.inference_mode():
        x = torch.empty(8, 64, device="cuda")
        for _ in range(6):
            x.normal_()
            assert torch.equal(block(x), _reference(block, x))
    graph = _only_graph(block)
    assert graph.reader_at == x.data_ptr()
    assert not torch.equal(graph.inputs[0], x)  # (nothing copied in since the first call)


class _Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x, y, *, scale):
        return self.lin(x) * scale + y


@cuda
def test_several_inputs_are_read_in_place_only_where_all_lie_as_at_the_first_call(kept_readers):
    block = Parallel(_Mix(), _Mix(), cuda_graph=True).cuda()
    a, b, c = (torch.empty(8, 64, device="cuda") for _ in range(3))
    with torch.no_grad():
        for i in range(4):
            for x, y in ((a, b), (a, c), (b, a), (a, a)):
                x.normal_(), y.normal_()
                expected = torch.cat([m(x, y, scale=2.0) for m in block], 1)
                assert torch.equal(block(x, y=y, scale=2.0), expected), (i, x is a, y is b)
    graph = _only_graph(block)
    assert graph.reader_at == (a.data_ptr(), b.data_ptr())


class _Twice(nn.Module):
    def forward(self, x):
        return x * 2


@cuda
def test_a_conjugate_view_at_the_readers_address_is_copied_in(kept_readers):
    # The signature does not tell a conjugate view from its base: the copy resolves the bit,
    # which a graph reading the memory would not.
    block = Parallel(_Twice(), _Twice(), cuda_graph=True)
    z = torch.randn(4, 8, dtype=torch.complex64, device="cuda")
    with torch.no_grad():
        assert torch.equal(block(z), torch.cat([z * 2, z * 2], 1))
        for _ in range(3):
            for v in (z.conj(), z):
                assert torch.equal(block(v), torch.cat([v * 2, v * 2], 1))
    assert _only_graph(block).reader_at == z.data_ptr()


@cuda
def test_outputs_kept_across_calls_are_never_overwritten_by_the_reader(kept_readers):
    block = _graphed(_mlp(4))
    x = torch.empty(8, 64, device="cuda")
    kept = []
    with torch.no_grad():
        for _ in range(8):
            x.normal_()
            kept.append((block(x), _reference(block, x)))
    assert _only_graph(block).reader is not None
    for y, expected in kept:
        assert torch.equal(y, expected)


@cuda
def test_a_stage_writing_its_input_in_place_keeps_copying_it():
    from parallel_modules import ParallelSequential

    class Doubles(nn.Module):
        def forward(self, x):
            return x.mul_(2)

    pipe = ParallelSequential(Doubles(), nn.Linear(64, 64), cuda_graph=True).cuda()
    x = torch.empty(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(6):
            x.normal_()
            before = x.clone()
            assert torch.equal(pipe(x), pipe[1](before * 2))
            # The graph doubles its static copy, and copies it back: the caller's tensor is doubled,
            # as an eager call doubles it. (Before a review of session 69: left as it was.)
            assert torch.equal(x, before * 2)
    graph = next(iter(pipe._graphs._graphs.values()))
    assert not graph.readable and graph.reader is None


@cuda
def test_no_reader_for_outgrown_or_aliased_outputs():
    from parallel_modules import _graphs

    # Outputs of 8 rows of floats: 4 KiB more than the spare bytes; the input 2 KiB.
    wide = Parallel(nn.Linear(64, _graphs._IN_PLACE_SPARE_BYTES // 32 + 128), cuda_graph=True).cuda()
    # An identity branch returns the input: a reader would return (and hold) the caller's tensor.
    tupled = Parallel(nn.Identity(), nn.Linear(64, 64), join=None, cuda_graph=True).cuda()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(wide(x), wide[0](x))
            same, out = tupled(x)
            assert torch.equal(same, x) and same.data_ptr() != x.data_ptr() and torch.equal(out, tupled[1](x))
    for block in (wide, tupled):
        graph = _only_graph(block)
        assert not graph.readable and graph.reader is None


@cuda
def test_inputs_aligned_otherwise_get_graphs_of_their_own(kept_readers):
    # cuBLAS and cuDNN kernels are chosen by the inputs' alignment, which a graph bakes in: a
    # graph captured for aligned inputs must not replay for an input 4 bytes off (nor the
    # other way round), and the static input of each lies as its callers' do.
    block = _graphed(_mlp(2))
    memory = torch.empty(8 * 64 + 1, device="cuda")
    aligned, unaligned = memory[:-1].view(8, 64), memory[1:].view(8, 64)
    with torch.no_grad():
        for _ in range(3):
            for x in (aligned, unaligned):
                x.normal_()
                assert torch.equal(block(x), _reference(block, x))
    assert block._graphs.captures == 2
    residues = sorted(g.inputs[0].data_ptr() % 16 for g in block._graphs._graphs.values())
    assert residues == [0, 4]


@cuda
def test_a_reader_slower_than_copying_in_is_dropped(monkeypatch):
    from parallel_modules import _graphs

    timed = []

    def copying_is_faster(calls, *args, **kwargs):
        timed.append(len(calls))
        return len(calls) - 1  # (the reader's calls come first: the last is the copying one)

    monkeypatch.setattr(_graphs, "_quickest", copying_is_faster)
    block = _graphed(_mlp(4))
    x = torch.empty(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(4):
            x.normal_()
            assert torch.equal(block(x), _reference(block, x))
    graph = _only_graph(block)
    assert timed and timed[-1] == 2 and graph.readable and graph.reader is None and graph.first_outputs is None
    (described,) = block.explain()["schedules"].values()
    assert described.startswith("CUDA graph, ") and "in place" not in described, described


@cuda
def test_a_reader_of_several_outputs_replays_them_all(kept_readers):
    # (Calls copying in copy several outputs into the reader's by one multi-tensor copy, one by a plain copy.)
    torch.manual_seed(0)
    block = Parallel(nn.Linear(64, 32), nn.Linear(64, 16), nn.Tanh(), join="tuple", cuda_graph=True).cuda()
    x, elsewhere = torch.empty(8, 64, device="cuda"), torch.empty(8, 64, device="cuda")
    with torch.no_grad():
        for i in range(6):
            for v in (x, elsewhere):
                v.normal_()
                out = block(v)
                assert len(out) == 3
                for o, b in zip(out, block):
                    assert torch.equal(o, b(v)), i
                del out
    graph = _only_graph(block)
    assert graph.reader is not None and len(graph.outputs) == 3


@cuda
@pytest.mark.parametrize("static_outputs", [False, True])
def test_calls_read_in_place_and_copied_in_hand_out_the_same_buffers(static_outputs, kept_readers):
    # The reader's buffers are the signature's outputs: a call copying in copies the first
    # graph's outputs into them, so whichever graph ran, a call's outputs are those buffers.
    block = _graphed(_mlp(4), static_outputs=static_outputs)
    at, elsewhere = torch.empty(8, 64, device="cuda"), torch.empty(8, 64, device="cuda")
    buffers, kept = set(), []
    with torch.no_grad():
        for i in range(5):
            for x in (at, elsewhere, elsewhere):
                x.normal_()
                y = block(x)
                assert torch.equal(y, _reference(block, x)), i
                if static_outputs:
                    buffers.add(y.data_ptr())
                else:
                    kept.append((y, _reference(block, x)))
    graph = _only_graph(block)
    assert graph.reader_at == at.data_ptr() and graph.first_outputs is not None
    assert graph.outputs[0].data_ptr() != graph.first_outputs[0].data_ptr()
    if static_outputs:
        assert buffers == {graph.outputs[0].data_ptr()}
    for y, expected in kept:  # (kept: cloned, never lent)
        assert torch.equal(y, expected)


@cuda
def test_a_reader_missed_call_after_call_is_dropped(kept_readers):
    from parallel_modules import _graphs

    block = _graphed(_mlp(4))
    at = torch.empty(8, 64, device="cuda")
    kept = []
    with torch.no_grad():
        at.normal_()
        kept.append((block(at), _reference(block, at)))
        graph = _only_graph(block)
        reader_buffer = graph.outputs[0].data_ptr()
        for i in range(_graphs._READER_MISSES + 4):
            x = torch.randn(8, 64, device="cuda")
            y = block(x)
            assert torch.equal(y, _reference(block, x)), i
            assert (graph.reader is None) == (i >= _graphs._READER_MISSES - 1), i
            kept.append((y, _reference(block, x)))
        # Back to the first graph's buffers, written by it alone; the input at the old address copied in.
        assert graph.first_outputs is None and graph.outputs[0].data_ptr() != reader_buffer
        at.normal_()
        assert torch.equal(block(at), _reference(block, at))
    for y, expected in kept:
        assert torch.equal(y, expected)


@cuda
def test_an_output_lent_before_the_reader_is_dropped_and_kept_after_is_never_overwritten(kept_readers):
    from parallel_modules import _graphs

    block = _graphed(_mlp(4))
    at, elsewhere = torch.randn(8, 64, device="cuda"), torch.empty(8, 64, device="cuda")
    with torch.no_grad():
        assert torch.equal(block(at), _reference(block, at))
        graph = _only_graph(block)
        for i in range(_graphs._READER_MISSES - 1):  # outputs dropped at once: lent
            elsewhere.normal_()
            assert torch.equal(block(elsewhere), _reference(block, elsewhere)), i
        assert graph.lending.lent and graph.reader is not None
        elsewhere.normal_()
        y = block(elsewhere)  # the last miss: the reader is dropped, this output kept
        expected = _reference(block, elsewhere)
        assert graph.reader is None
        for _ in range(3):
            x = torch.randn(8, 64, device="cuda")
            assert torch.equal(block(x), _reference(block, x))
    assert torch.equal(y, expected)


@cuda
def test_static_outputs_keep_their_buffers_and_reader_however_often_calls_miss(kept_readers):
    from parallel_modules import _graphs

    block = _graphed(_mlp(4), static_outputs=True)
    at = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        buffer = block(at)
        for i in range(_graphs._READER_MISSES + 2):
            x = torch.randn(8, 64, device="cuda")
            assert block(x) is not None
            assert torch.equal(buffer, _reference(block, x)), i  # the same buffer, this call's values
    assert _only_graph(block).reader is not None


class _Spread(nn.Module):
    def forward(self, x):
        return (x * 2).sum(1, keepdim=True).expand(-1, 64)  # (every column one memory location)


@cuda
@pytest.mark.parametrize("n", [1, 2])
def test_no_reader_for_outputs_that_cannot_be_copied_into(n, kept_readers):
    # An expanded output cannot be written by a copy: the first graph's outputs could never be
    # copied into the reader's, so the signature keeps its first graph alone.
    block = Parallel(*[_Spread() for _ in range(n)], join=None, cuda_graph=True, fuse=False)
    at = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for x in (at, torch.randn(8, 64, device="cuda"), at):
            for out, branch in zip(block(x), block):
                assert torch.equal(out, branch(x))
    graph = _only_graph(block)
    assert graph.readable and graph.reader is None and graph.first_outputs is None


def _copies(call) -> int:
    r"""The memory copies on the GPU in one ``call()``."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" in e.name.lower())


@cuda
def test_a_call_read_in_place_copies_nothing(kept_readers):
    # (Unfused: Linear, GELU and cat kernels, no copy in the graphs; no clones of the outputs either.)
    block = _graphed(_mlp(4), static_outputs=True, fuse=False)
    at, elsewhere = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        block(at)
        # The input copied in and the outputs copied out: two; read in place: none.
        assert _copies(lambda: block(elsewhere)) == 2
        assert _copies(lambda: block(at)) == 0


@cuda
def test_the_quickest_call_keeps_the_first_within_its_slack():
    from parallel_modules._graphs import _quickest

    stream = torch.cuda.Stream()

    def sleeper(cycles):
        return lambda: torch.cuda._sleep(cycles)

    # About 8% apart: the faster second is picked without slack, the first kept with 20%.
    close = [sleeper(100_000), sleeper(92_000)]
    assert _quickest(close, stream, budget_ms=30, least=4) == 1
    assert _quickest(close, stream, budget_ms=30, least=4, slack=0.2) == 0
    # Twice as fast is faster than any slack below 100%.
    assert _quickest([sleeper(100_000), sleeper(50_000)], stream, budget_ms=30, least=4, slack=0.2) == 1


@cuda
def test_a_reader_that_fails_to_capture_leaves_the_graph_working(monkeypatch):
    from parallel_modules import _graphs

    def refuse(*args):
        raise RuntimeError("refused")

    block = _graphed(_mlp(4))
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad(), monkeypatch.context() as patch:
        patch.setattr(_graphs, "_matching_outputs", refuse)  # (what the reader's capture calls last)
        first = block(x)
    assert torch.equal(first, _reference(block, x))
    graph = _only_graph(block)
    assert graph.readable and graph.reader is None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # (the pool is the first graph's: it must not have been released)
    junk = [torch.full((1 << 16,), float("nan"), device="cuda") for _ in range(64)]
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(8, 64, device="cuda")
            assert torch.equal(block(x), _reference(block, x))
    del junk


_FAILURE_SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    from collections import OrderedDict
    import torch
    from torch import nn
    from parallel_modules import Parallel

    torch.backends.cuda.matmul.allow_tf32 = False

    class Sync(nn.Module):
        def forward(self, x):
            if x.sum().item() > 1e30:  # a host sync: cannot be captured
                return x
            return x * 2

    def block(bad_first, **kwargs):
        items = [("good", nn.Linear(8, 8)), ("bad", Sync())]
        if bad_first:
            items.reverse()
        return Parallel(OrderedDict(items), cuda_graph=True, **kwargs).cuda()

    def expected(m, x):
        return torch.cat([m.good(x) if name == "good" else x * 2 for name in m._modules], 1)

    mode = sys.argv[1]
    if mode == "raise":
        for bad_first in (True, False):
            m = block(bad_first)
            x = torch.randn(4, 8, device="cuda")
            try:
                m(x)
            except RuntimeError as e:
                msg = str(e)
            else:
                raise SystemExit("capture did not fail")
            assert "Parallel" in msg and "CUDA graph capture failed" in msg, msg
            assert "branch 'bad'" in msg, msg
            assert "cuda_graph=False" in msg and "graph_fallback=True" in msg, msg
            assert not torch.cuda.is_current_stream_capturing()
            assert len(m._graphs) == 0
            # The same module, eagerly: CUDA and the side streams still work.
            m.cuda_graph = False
            for _ in range(4):
                x = torch.randn(4, 8, device="cuda")
                assert torch.equal(m(x), expected(m, x))
        # A fresh graphed module captures and replays.
        ok = Parallel(nn.Linear(8, 8), nn.Linear(8, 8), cuda_graph=True).cuda()
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(4, 8, device="cuda")
                assert torch.equal(ok(x), torch.cat([ok[0](x), ok[1](x)], 1))
        assert ok._graphs.captures == 1
    else:
        m = block(False, graph_fallback=True)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in range(3):
                x = torch.randn(4, 8, device="cuda")
                assert torch.equal(m(x), expected(m, x))
        messages = [str(w.message) for w in record if "graph_fallback" in str(w.message)]
        assert len(messages) == 1, messages
        assert "branch 'bad'" in messages[0], messages[0]
        assert m._graphs.captures == 0 and len(m._graphs) == 0
    torch.cuda.synchronize()
    print("OK")
    """
)


@cuda
@pytest.mark.parametrize("mode", ["raise", "fallback"])
def test_capture_failure_in_subprocess(mode):
    done = _run_python(_FAILURE_SCRIPT, mode, timeout=180)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr


_MISMATCH_SCRIPT = textwrap.dedent(
    """
    import warnings, torch
    from torch import nn
    from parallel_modules import Parallel
    torch.manual_seed(0)
    block = Parallel(*[nn.Linear(16, 16) for _ in range(3)], cuda_graph=True).cuda()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            block(torch.randn(4, 16, device="cuda", requires_grad=True)).sum().backward()
    assert block._graphs.captures == 1
    messages = [str(w.message) for w in record if "AccumulateGrad" in str(w.message)]
    assert not messages, messages
    # Only the module's own capture was spared the warning: the setting is the user's again.
    assert torch._C._warn_on_accumulate_grad_stream_mismatch()
    print("OK")
    """
)


@cuda
@pytest.mark.skipif(not hasattr(torch._C, "_warn_on_accumulate_grad_stream_mismatch"),
                    reason="this torch does not warn of accumulators fed from other streams")
def test_capture_does_not_warn_of_its_own_side_stream_gradients():
    # Capturing the training graph differentiates an input that branches on side streams
    # read: its accumulator gets gradients from other streams, by design. PyTorch warns of
    # that once per process, hence a fresh process.
    done = _run_python(_MISMATCH_SCRIPT, timeout=180)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr


# ------------------------------------------------- changes after capture (found by a review)
def _cat_of_branches(block: Parallel, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([b(x) for b in block], 1)


@pytest.mark.cuda
@pytest.mark.parametrize("change", ["append", "setitem", "delitem", "insert", "nested"])
def test_pipeline_stages_changed_after_capture_are_run(change):
    from parallel_modules import ParallelSequential

    torch.manual_seed(0)
    pipe = ParallelSequential(nn.Linear(64, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 32)), cuda_graph=True).cuda()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        pipe(x)
        pipe(x)  # captured, replayed
        if change == "append":
            pipe.append(nn.Linear(32, 10).cuda())
        elif change == "setitem":
            pipe[0] = nn.Linear(64, 64).cuda()
        elif change == "delitem":
            del pipe[2]
        elif change == "insert":
            pipe.insert(1, nn.Tanh())
        else:
            pipe[2][0] = nn.Linear(64, 32).cuda()  # below a stage, as adapters inject layers
        expected = nn.Sequential(*pipe)(x)
        out = pipe(x)
    assert torch.equal(out, expected)


@pytest.mark.cuda
@pytest.mark.parametrize("change", ["insert", "delitem", "delattr"])
def test_a_block_changed_below_a_graphed_block_is_run(change):
    # A block's own insert and del register nothing (inserted here: a module built before the
    # first call): the graphed block around it must capture anew, not replay the old branches.
    torch.manual_seed(0)
    spare = nn.Linear(64, 64).cuda()
    inner = Parallel(nn.Linear(64, 64), nn.Linear(64, 64), join="sum")
    block = Parallel(inner, nn.Linear(64, 64), cuda_graph=True).cuda()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        block(x)
        block(x)  # captured, replayed
        if change == "insert":
            inner.insert(1, spare)
        elif change == "delitem":
            del inner[1]
        else:
            delattr(inner, "1")
        expected = _cat_of_branches(block, x)
        out = block(x)
    assert torch.equal(out, expected)


@pytest.mark.cuda
def test_a_callable_branch_given_another_callable_after_capture_is_run():
    # ``block[i].fn = g`` registers nothing: the graph captured with the old callable was replayed.
    block = Parallel(lambda t: t * 2, nn.Linear(64, 64), cuda_graph=True).cuda()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        block(x)
        block(x)  # captured, replayed
        block[0].fn = lambda t: t + 1
        expected = _cat_of_branches(block, x)
        out = block(x)
    assert torch.equal(out, expected)

@pytest.mark.cuda
@pytest.mark.parametrize("child", ["dropout", "batchnorm"])
def test_child_mode_changed_after_capture_is_seen(child):
    # The owner stays in training mode; only a child is switched (the "freeze BatchNorm" idiom).
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.9)) if child == "dropout" else nn.BatchNorm1d(64)
    block = Parallel(first, nn.Linear(64, 64), cuda_graph=True).cuda()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        block(x)
        block(x)
        for m in block.modules():
            if isinstance(m, (nn.Dropout, nn.BatchNorm1d)):
                m.eval()
        stats = [b.clone() for b in block.buffers()]
        expected = _cat_of_branches(block, x)
        out = block(x)
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(block.buffers(), stats))  # eval BatchNorm keeps its statistics


@pytest.mark.cuda
@pytest.mark.parametrize("owner", ["Parallel", "ParallelSequential"])
def test_a_linears_mode_read_by_a_module_of_the_users_is_not_replayed_stale(owner):
    # Before: a Linear's mode was left out of the graph's key (its output does not depend on
    # it), though the module holding it read it: switched after capture, the replay returned
    # the doubled output the eager call no longer computes.
    torch.manual_seed(0)
    if owner == "Parallel":
        block = Parallel(DoubledInTraining(16), nn.Linear(16, 16), cuda_graph=True).cuda()
        expected = lambda x: _cat_of_branches(block, x)  # noqa: E731
    else:
        block = ParallelSequential(DoubledInTraining(16), nn.Linear(16, 16), chunks=2, cuda_graph=True).cuda()
        expected = lambda x: block[1](block[0](x))  # noqa: E731
    x = torch.randn(8, 16, device="cuda")
    with torch.no_grad():
        for _ in range(2):
            block(x)
        block[0].lin.eval()
        assert torch.equal(block(x), expected(x))
        block[0].lin.train()
        assert torch.equal(block(x), expected(x))


@pytest.mark.cuda
def test_pipeline_mode_toggles_and_chunks_changes():
    from parallel_modules import ParallelSequential

    pipe = ParallelSequential(nn.Linear(64, 64), nn.BatchNorm1d(64), cuda_graph=True).cuda()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(3):  # one graph per mode, captured once
            pipe.train()
            pipe(x)
            pipe.eval()
            pipe(x)
        assert pipe._graphs.captures == 2
        pipe.train()
        pipe.chunks = 2  # BatchNorm in training mode mixes the batch: refused, not replayed from chunks=1
        with pytest.raises(RuntimeError, match="mixes samples"):
            pipe(x)


class _LateReader(nn.Module):
    def forward(self, x):
        torch.cuda._sleep(200_000)  # reads its input late on its lane's stream
        return x * 1


@pytest.mark.cuda
def test_graphed_stage_outputs_read_by_the_next_lane_are_not_lent():
    # A graphed Parallel inside a pipeline lane: its next replay (next micro-batch, same
    # stream) must not overwrite the output the next lane has yet to read.
    torch.manual_seed(0)
    inner = Parallel(nn.Linear(64, 64), nn.Linear(64, 64), cuda_graph=True).cuda()
    from parallel_modules import ParallelSequential

    pipe = ParallelSequential(inner, _LateReader(), chunks=4).cuda()
    with torch.no_grad():
        for _ in range(6):  # lending would start after a few micro-batches
            x = torch.randn(32, 64, device="cuda")
            out = pipe(x)
            expected = torch.cat([_cat_of_branches(inner, piece) for piece in x.chunk(4)])
            assert torch.equal(out, expected)


@pytest.mark.cuda
def test_torch_func_transforms_run_eagerly():
    torch.manual_seed(0)
    block = Parallel(nn.Linear(64, 64), nn.Linear(64, 64), cuda_graph=True).cuda()
    xs = torch.randn(3, 8, 64, device="cuda")
    with torch.no_grad():
        block(xs[0])
        out = torch.vmap(block)(xs)
    assert torch.allclose(out, torch.stack([_cat_of_branches(block, x) for x in xs]), rtol=1e-5, atol=1e-5)


def _leave_to_the_collector(obj) -> None:
    cycle = [obj]
    cycle.append(cycle)  # garbage once this returns, freed by the collector only


class _DropsAGraphWhileCaptured(nn.Linear):
    # Leaves another graph to the garbage collector in the middle of a capture: the collector
    # runs whenever allocations pass its threshold, and a CUDA graph it frees then is reset,
    # which the driver refuses on a capturing thread -- it invalidates that thread's capture.
    def __init__(self, doomed: torch.cuda.CUDAGraph) -> None:
        super().__init__(64, 64)
        self.doomed = [doomed]

    def forward(self, x):
        if self.doomed and torch.cuda.is_current_stream_capturing():
            _leave_to_the_collector(self.doomed.pop())
            junk = [[] for _ in range(100)]  # past the threshold: a collection, were the collector on
            del junk
        return super().forward(x)


@cuda
def test_a_graph_collected_during_a_capture_does_not_break_it():
    torch.manual_seed(0)
    x = torch.randn(8, 64, device="cuda")
    doomed = torch.cuda.CUDAGraph()
    with torch.cuda.graph(doomed):
        x.mul(2).relu_()  # (no matrix product: cuBLAS may not be set up on this thread yet)
    freed_while_capturing = []
    weakref.finalize(doomed, lambda: freed_while_capturing.append(torch.cuda.is_current_stream_capturing()))
    block = _graphed([_DropsAGraphWhileCaptured(doomed), nn.Linear(64, 64)])
    del doomed
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        with torch.no_grad():
            out = block(x)
            assert not block[0].doomed, "the capture did not run the branch"
            assert torch.equal(out, _reference(block, x))
            assert torch.equal(block(x), _reference(block, x))  # replayed
    finally:
        gc.set_threshold(*threshold)
    gc.collect()
    assert freed_while_capturing == [False]
    assert block._graphs.captures == 1


@cuda
def test_settings_changed_after_capture_are_used():
    # A graph captured with the old join would replay it: the setting makes the block capture anew.
    block = _graphed(_mlp(3))
    x1, x2 = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        block(x1)
        block(x1)
        block.join = "sum"
        torch.testing.assert_close(block(x1), sum(b(x1) for b in block))
        block.join, block.dim = "stack", 0
        assert torch.equal(block(x2), torch.stack([b(x2) for b in block]))
        block.join, block.dim = "cat", 1
        block.static_outputs = True  # now the graph's own buffers
        y1 = block(x1)
        y2 = block(x2)
        assert y1.data_ptr() == y2.data_ptr() and torch.equal(y1, _reference(block, x2))
    assert block._graphs.captures == 1  # (a cache of its own since static_outputs changed)


@dataclasses.dataclass
class _Pair:
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class _RegisteredPair:
    a: torch.Tensor
    b: torch.Tensor


torch.utils._pytree.register_dataclass(_RegisteredPair)


@cuda
def test_dataclass_outputs_are_refused_unless_registered():
    # pytree sees an unregistered dataclass as one leaf: a replay would return the captured
    # object itself, its tensors overwritten by the next replay.
    torch.manual_seed(0)
    x1, x2 = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
    block = Parallel(nn.Linear(64, 64), nn.Linear(64, 64), join=lambda outs: _Pair(*outs), cuda_graph=True).cuda()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"Parallel: cannot replay .* tensors inside a _Pair object"):
            block(x1)
        block.graph_fallback = True
        with pytest.warns(UserWarning, match="_Pair"):
            out = block(x1)
        assert torch.equal(out.a, block[0](x1)) and torch.equal(out.b, block[1](x1))
        block.join = lambda outs: _RegisteredPair(*outs)
        y1 = block(x1)
        y2 = block(x2)
        assert block._graphs.captures == 1
        for y, x in ((y1, x1), (y2, x2)):
            assert isinstance(y, _RegisteredPair)
            assert torch.equal(y.a, block[0](x)) and torch.equal(y.b, block[1](x))


class _Tagged(torch.Tensor):
    r"""A tensor subclass that operations propagate (``torch.Tensor.__torch_function__``)."""


@cuda
def test_a_tensor_subclass_input_gets_a_graph_of_its_own():
    # A graph captured for plain tensors replays plain kernels into plain buffers: a
    # subclass input (code may run differently for it, and it returns its own type)
    # is captured on its own.
    block = Parallel(*_mlp(3, width=16), cuda_graph=True).cuda()
    x = torch.randn(4, 16, device="cuda")
    with torch.no_grad():
        plain = block(x)
        tagged = block(x.as_subclass(_Tagged))
        again = block(torch.randn(4, 16, device="cuda").as_subclass(_Tagged))
    assert type(plain) is torch.Tensor and type(tagged) is _Tagged and type(again) is _Tagged
    assert torch.equal(tagged.as_subclass(torch.Tensor), plain)
    assert block._graphs.captures == 2


# ------------------------------------------- where autograd and torch.func reach into a call
def test_autograd_busy_under_saved_tensor_hooks_backward_and_forward_ad():
    from torch.autograd import forward_ad

    from parallel_modules._graphs import _autograd_busy

    assert _autograd_busy() == ""
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert _autograd_busy() == "saved-tensor hooks"
        with torch.no_grad():
            assert _autograd_busy() == ""  # nothing is saved
    with torch.autograd.graph.save_on_cpu():
        assert _autograd_busy() == "saved-tensor hooks"
    with forward_ad.dual_level():
        assert _autograd_busy() == "forward-mode AD"
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(_autograd_busy())  # inside a backward pass (autograd's thread on CUDA)
            return g

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == ["a backward pass"] and not _autograd_busy()


def test_swapped_tells_tensors_swapped_into_parameter_slots():
    from parallel_modules._watch import _swapped

    lin = nn.Linear(3, 3)
    slots = [lin._parameters]
    snapshot = [d.copy() for d in slots]
    for scalars in (False, True):
        assert not _swapped(slots, snapshot, scalars)
        with torch.nn.utils.stateless._reparametrize_module(lin, {"weight": torch.zeros(3, 3)}):
            assert _swapped(slots, snapshot, scalars)  # (by value, many elements: raises, caught)
        with torch.nn.utils.stateless._reparametrize_module(lin, {"weight": nn.Parameter(lin.weight.detach().clone())}):
            assert _swapped(slots, snapshot, scalars)
        assert not _swapped(slots, snapshot, scalars)
    # One element: a tensor of the same value is not the same tensor.
    scale = nn.Module()
    scale.t = nn.Parameter(torch.tensor(2.0))
    slots = [scale._parameters]
    snapshot = [d.copy() for d in slots]
    with torch.nn.utils.stateless._reparametrize_module(scale, {"t": torch.tensor(2.0, requires_grad=True)}):
        assert _swapped(slots, snapshot, True)


def test_check_leaves_refuses_a_closure_parameter():
    from parallel_modules._graphs import _CaptureError, _CudaGraphs

    w = nn.Parameter(torch.randn(8, 16))
    block = Parallel(nn.Linear(16, 8), lambda x: x @ w.t())
    graphs = _CudaGraphs(block)
    surface = tuple(block.parameters())

    def call():
        # Many nodes between the output and the closure's leaf: their Python wrappers come and go.
        out = block(torch.ones(4, 16))
        for _ in range(50):
            out = out * 1.0 + 0.0
        return out

    strays = graphs._check_leaves(call(), surface, None)  # the first warm-up call: noted
    assert len(strays) == 1 and strays[0] is w
    with pytest.raises(_CaptureError, match=r"neither an input nor a parameter.*Tensor\(8, 16\) float32"):
        graphs._check_leaves(call(), surface, strays)  # found again: refused
    assert graphs._check_leaves(block[0](torch.ones(4, 16)), surface, []) == []  # registered: fine
    with torch.no_grad():
        assert graphs._check_leaves(block(torch.ones(4, 16)), (), None) == []  # nothing recorded


def test_check_leaves_allows_a_leaf_made_by_each_call():
    from parallel_modules._graphs import _CudaGraphs

    class Energy(nn.Module):  # forces as the gradient of an energy, differentiated inside forward
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, pos):
            pos = pos.detach().requires_grad_()
            energy = self.lin(pos).square().sum()
            return -torch.autograd.grad(energy, pos, create_graph=True)[0] + pos

    block = Parallel(Energy(), Energy(), join="sum")
    graphs = _CudaGraphs(block)
    surface = tuple(block.parameters())
    first = graphs._check_leaves(block(torch.randn(5, 3)), surface, None)
    assert first  # each call's own position leaf
    graphs._check_leaves(block(torch.randn(5, 3)), surface, first)  # a new one: not refused


def test_tf32_key_reads_the_precision_api_too():
    # Once torch.backends.fp32_precision (torch >= 2.9) is set, the legacy getters raise:
    # the key must not, and must tell the settings apart.
    script = textwrap.dedent("""
        import torch
        from torch import nn
        from parallel_modules import Parallel
        from parallel_modules._graphs import _CudaGraphs
        block = Parallel(nn.Linear(4, 4), nn.Linear(4, 4))
        graphs = _CudaGraphs(block)
        x = torch.randn(2, 4)
        before = graphs._key(block, (x,), {}, ())
        if hasattr(torch.backends, "fp32_precision"):
            torch.backends.fp32_precision = "tf32"
            assert graphs._key(block, (x,), {}, ()) != before
            torch.backends.cuda.matmul.fp32_precision = "ieee"
            torch.backends.cudnn.conv.fp32_precision = "ieee"
        else:
            torch.backends.cuda.matmul.allow_tf32 = not torch.backends.cuda.matmul.allow_tf32
        assert graphs._key(block, (x,), {}, ()) != before
        print("ok")
    """)
    done = _run_python(script, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_tensors_swapped_in_for_calls_in_a_row_are_taken_as_the_owners():
    from parallel_modules._graphs import _SWAPS_KEPT, _CudaGraphs

    block = Parallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Linear(4, 4)).eval()
    graphs = _CudaGraphs(block)
    graphs._look(block)
    assert graphs._unchanged()
    # functional_call, call after call with new tensors, alternating with plain calls: never kept.
    for _ in range(2 * _SWAPS_KEPT):
        new = {k: v.clone() for k, v in block.state_dict().items()}
        with torch.nn.utils.stateless._reparametrize_module(block, new):
            assert not graphs._unchanged()
        assert graphs._unchanged()
    assert graphs._params is not None
    # A child's buffers replaced by its own _apply (block[0].half() and the like), which
    # registers nothing: the same new tensors, call after call.
    bn = block[0][1]
    bn._buffers["running_mean"] = bn.running_mean.clone()
    for _ in range(_SWAPS_KEPT):
        assert not graphs._unchanged()
    assert graphs._params is None  # freed: the next call looks again and captures with them
    graphs._look(block)
    assert graphs._unchanged()


def test_hooks_on_the_owner_itself_matter_only_where_the_graphs_call_it():
    from parallel_modules._graphs import _CudaGraphs

    block = Parallel(nn.Linear(4, 4), nn.Linear(4, 4))
    around, inside = _CudaGraphs(block), _CudaGraphs(block, calls_owner=True)
    around._look(block)
    inside._look(block)
    handle = block.register_forward_hook(lambda m, i, o: o)
    assert around._unchanged() and around._params is not None  # Parallel: its hooks run around the graphs
    assert not inside._unchanged() and inside._params is None  # a pipeline stage's graphs call it
    handle.remove()
    below = block[1].register_forward_pre_hook(lambda m, i: None)
    assert not around._unchanged() and around._params is None
    below.remove()


def _train_steps(block, inputs):
    grads = []
    for x in inputs:
        block.zero_grad(set_to_none=True)
        block(x).square().sum().backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in block.parameters()])
    return grads


@cuda
def test_tied_weights_get_every_branchs_gradient():
    torch.backends.cuda.matmul.allow_tf32 = False

    def make(graph):
        torch.manual_seed(0)
        a, b = nn.Linear(16, 8), nn.Linear(16, 8)
        b.weight = a.weight  # tied across two branches
        return Parallel(a, nn.Sequential(b, nn.Tanh()), cuda_graph=graph).cuda()

    inputs = [torch.randn(4, 16, device="cuda") for _ in range(4)]
    for got, want in zip(_train_steps(make(True), inputs), _train_steps(make(False), inputs)):
        for g, w in zip(got, want):
            assert torch.equal(g, w)


@cuda
def test_functional_call_reads_the_tensors_given():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    block = Parallel(*_mlp(3, width=16), cuda_graph=True).cuda()
    x = torch.randn(4, 16, device="cuda")
    other = {k: torch.randn_like(v) for k, v in block.state_dict().items()}
    with torch.no_grad():
        for _ in range(3):
            own = block(x)  # captured, replayed
        swapped = torch.func.functional_call(block, other, (x,))
        expected = torch.func.functional_call(Parallel(*_mlp(3, width=16)).cuda(), other, (x,))
        assert torch.equal(swapped, expected) and not torch.equal(swapped, own)
        assert torch.equal(block(x), own) and block._graphs.captures == 1  # the graph again afterwards
    # Training: gradients reach the tensors swapped in.
    leaves = {k: v.clone().requires_grad_() for k, v in other.items()}
    torch.func.functional_call(block, leaves, (x,)).sum().backward()
    assert all(v.grad is not None for v in leaves.values())


@cuda
def test_first_call_inside_functional_call_captures_nothing():
    block = Parallel(*_mlp(2, width=16), cuda_graph=True).cuda()
    x = torch.randn(4, 16, device="cuda")
    other = {k: torch.zeros_like(v) for k, v in block.state_dict().items()}
    with torch.no_grad():
        assert torch.count_nonzero(torch.func.functional_call(block, other, (x,))) == 0
        assert block._graphs.captures == 0
        assert torch.equal(block(x), _reference(block, x)) and block._graphs.captures == 1


@cuda
def test_hooks_registered_or_removed_after_capture_are_honoured():
    torch.manual_seed(0)
    block = Parallel(*_mlp(2, width=16), cuda_graph=True).cuda()
    x = torch.randn(4, 16, device="cuda")
    with torch.no_grad():
        plain = block(x).clone()
        block(x)
        handle = block[0][0].register_forward_hook(lambda m, i, o: o * 0)
        hooked = block(x).clone()  # captured anew, with the hook
        assert block._graphs.captures == 2
        assert torch.equal(hooked, _reference(block, x)) and not torch.equal(hooked, plain)
        assert torch.equal(block(x), hooked)
        handle.remove()
        assert torch.equal(block(x), plain) and block._graphs.captures == 3
        # A hook anywhere else (a tensor's) frees nothing.
        torch.ones(1, requires_grad=True).register_hook(lambda g: g)
        assert torch.equal(block(x), plain) and block._graphs.captures == 3


@cuda
def test_checkpoint_and_save_on_cpu_run_the_block_eagerly():
    # Non-reentrant checkpoint recomputes the block on autograd's thread while the first
    # call captures: that hung. Run in a subprocess, so that a hang fails the test.
    script = textwrap.dedent("""
        import torch
        from torch import nn
        from torch.utils.checkpoint import checkpoint
        from parallel_modules import Parallel
        torch.backends.cuda.matmul.allow_tf32 = False

        def make(graph):
            torch.manual_seed(0)
            return Parallel(nn.Linear(16, 8), nn.Sequential(nn.Linear(16, 8), nn.Tanh()), cuda_graph=graph).cuda()

        ref, block = make(False), make(True)
        for wrap in ("checkpoint", "reentrant", "save_on_cpu"):
            for _ in range(3):
                x = torch.randn(4, 16, device="cuda", requires_grad=True)
                grads = []
                for m in (ref, block):
                    m.zero_grad(set_to_none=True)
                    if wrap == "save_on_cpu":
                        with torch.autograd.graph.save_on_cpu():
                            y = m(x)
                    else:
                        y = checkpoint(m, x, use_reentrant=wrap == "reentrant")
                    x.grad = None
                    y.square().sum().backward()  # (a reentrant checkpoint refuses autograd.grad)
                    grads.append([x.grad, *(p.grad for p in m.parameters())])
                assert all(torch.equal(a, b) for a, b in zip(*grads)), wrap
        print("ok", block._graphs.captures)
    """)
    done = _run_python(script, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@cuda
def test_closure_parameter_is_refused_with_fallback_to_eager():
    w = nn.Parameter(torch.randn(8, 16, device="cuda"))
    x = torch.ones(4, 16, device="cuda")
    for branches in ([nn.Linear(16, 8).cuda(), lambda t: t @ w.t()], [lambda t: t @ w.t()]):
        with pytest.raises(RuntimeError, match="neither an input nor a parameter"):
            Parallel(*branches, cuda_graph=True)(x)
        block = Parallel(*branches, cuda_graph=True, graph_fallback=True)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in range(2):
                w.grad = None
                block(x).sum().backward()
                assert torch.equal(w.grad, torch.full_like(w, 4.0))
        assert len(_graph_warnings(record)) == 1


@cuda
def test_tensor_inside_an_argument_object_is_refused():
    class Ctx:
        def __init__(self, scale):
            self.scale = scale

    class Scaled(nn.Module):
        def forward(self, x, ctx):
            return x * ctx.scale

    ctx = Ctx(torch.tensor(2.0, device="cuda"))
    x = torch.ones(4, 4, device="cuda")
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="holds tensors inside a Ctx object.*Pass the tensors as arguments"):
            Parallel(Scaled(), Scaled(), cuda_graph=True)(x, ctx)
        block = Parallel(Scaled(), Scaled(), cuda_graph=True, graph_fallback=True)
        with pytest.warns(UserWarning, match="Ctx"):
            block(x, ctx)
        ctx.scale = torch.tensor(3.0, device="cuda")
        assert torch.equal(block(x, ctx), torch.full((4, 8), 3.0, device="cuda"))


@cuda
def test_tf32_setting_is_part_of_the_signature():
    torch.manual_seed(0)
    block = Parallel(nn.Linear(256, 256), nn.Linear(256, 256), cuda_graph=True).cuda()
    x = torch.randn(64, 256, device="cuda")
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        with torch.no_grad():
            torch.backends.cuda.matmul.allow_tf32 = False
            exact = block(x).clone()
            assert torch.equal(block(x), exact) and torch.equal(exact, _reference(block, x))
            torch.backends.cuda.matmul.allow_tf32 = True
            fast = block(x).clone()
            assert not torch.equal(fast, exact)  # TF32 kernels captured anew
            assert torch.allclose(fast, _reference(block, x), atol=1e-2)
            torch.backends.cuda.matmul.allow_tf32 = False
            assert torch.equal(block(x), exact)
        assert block._graphs.captures == 2
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@cuda
def test_forward_ad_tangents_pass_through_a_graphed_block():
    from torch.autograd import forward_ad

    block = Parallel(*_mlp(2, width=16), cuda_graph=True).cuda()
    x, t = torch.randn(4, 16, device="cuda"), torch.randn(4, 16, device="cuda")
    with torch.no_grad():
        block(x)
        block(x)
    with forward_ad.dual_level():
        out = forward_ad.unpack_dual(block(forward_ad.make_dual(x, t))).tangent
    expected = torch.func.jvp(lambda v: _reference(block, v), (x,), (t,))[1]
    assert out is not None and torch.allclose(out, expected)


@cuda
def test_most_recently_replayed_graph_is_not_evicted():
    block = Parallel(*_mlp(2, width=16), cuda_graph=True, max_graphs=2).cuda()
    a, b, c = (torch.randn(n, 16, device="cuda") for n in (2, 3, 5))
    with torch.no_grad():
        block(a)  # the single-tensor shortcut's graph from here on
        block(input=b)  # (a keyword: through the cache, which it makes the most recent)
        for _ in range(3):
            block(a)  # the shortcut: a is the most recent now
        block(c)  # evicts b, the least recently used
        assert block._graphs.captures == 3
        block(a)
    assert block._graphs.captures == 3


# ----------------------------------------------- settings read at capture (review of session 36)
@pytest.mark.cuda
def test_kernel_settings_and_dispatch_modes_are_not_replayed_stale():
    # Deterministic algorithms and cuBLAS's reduced-precision settings choose the kernels a
    # capture bakes in: part of the signature, as TF32 is. Under a dispatch mode (FlopCounterMode)
    # the call runs eagerly, so that the mode sees its operations.
    from torch.utils.flop_counter import FlopCounterMode

    block = Parallel(*_mlp(4), join="cat", cuda_graph=True).cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        block(x)
        captured = len(block._graphs._graphs)
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            assert torch.equal(block(x), _reference(list(block), x))
        finally:
            torch.use_deterministic_algorithms(previous)
        assert len(block._graphs._graphs) == captured + 1  # a graph of its own
        with FlopCounterMode(display=False) as counter:
            block(x)
        with FlopCounterMode(display=False) as expected:
            _reference(list(block), x)
        assert counter.get_total_flops() == expected.get_total_flops() > 0


class _ScalesLinear(torch.overrides.TorchFunctionMode):
    r"""Doubles what ``F.linear`` returns: a torch function mode that changes results."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.nn.functional.linear else out


def test_only_torch_function_modes_that_may_change_results_are_told():
    from parallel_modules._streams import _result_changing_function_modes

    assert not _result_changing_function_modes()
    with torch.device("cpu"):  # (torch's DeviceContext: the device of tensors made without one)
        assert not _result_changing_function_modes()
        with _ScalesLinear():
            assert _result_changing_function_modes()
    with _ScalesLinear(), torch.device("cpu"):
        assert _result_changing_function_modes()


@pytest.mark.cuda
def test_torch_function_modes_are_not_replayed_stale():
    # Before: a graph captured under a mode changing results replayed them without it, and one
    # captured without replayed without it under the mode. Such calls run eagerly now; under
    # torch's own DeviceContext (torch.set_default_device) they still replay.
    block = Parallel(*_mlp(3), join="cat", cuda_graph=True).cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        with _ScalesLinear():
            expected = _reference(list(block), x)
            assert torch.equal(block(x), expected)
        assert block._graphs.captures == 0
        plain = _reference(list(block), x)
        assert not torch.equal(plain, expected)
        assert torch.equal(block(x), plain) and block._graphs.captures == 1
        with _ScalesLinear():
            assert torch.equal(block(x), expected)
        with torch.device("cuda"):
            assert torch.equal(block(x), plain)
        assert block._graphs.captures == 1


@pytest.mark.cuda
def test_amp_backward_of_a_float32_region_is_captured_in_float32():
    # AMP's backward runs outside autocast; captured inside the forward's autocast, the backward of
    # a region with autocast disabled computed in half precision.
    class Float32Region(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            with torch.autocast("cuda", enabled=False):
                return self.lin(x.float())

    torch.manual_seed(0)
    eager = Parallel(Float32Region(), nn.Linear(64, 64), join="sum").cuda()
    graphed = copy.deepcopy(eager)
    graphed.cuda_graph = True
    for _ in range(3):
        x = torch.randn(8, 64, device="cuda")
        for block in (eager, graphed):
            block.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                out = block(x)
            out.float().square().sum().backward()
        for a, b in zip(eager.parameters(), graphed.parameters()):
            assert torch.equal(a.grad, b.grad)


@pytest.mark.cuda
def test_sparse_gradients_are_refused_at_capture_with_the_layer_to_change():
    block = Parallel(nn.Embedding(16, 8, sparse=True), nn.Embedding(16, 8), join="sum", cuda_graph=True).cuda()
    with pytest.raises(RuntimeError, match=r"(?s)sparse_coo gradient.*sparse=False"):
        block(torch.randint(0, 16, (4, 3), device="cuda")).sum().backward()
    with torch.no_grad():  # inference captures, and the module works after the refusal
        idx = torch.randint(0, 16, (4, 3), device="cuda")
        assert torch.equal(block(idx), block[0](idx) + block[1](idx))


@pytest.mark.cuda
def test_setting_of_a_nested_block_changed_after_the_outer_capture():
    inner = Parallel(nn.Linear(16, 16), nn.Linear(16, 16), join="sum")
    outer = Parallel(inner, nn.Linear(16, 16), join="sum", cuda_graph=True).cuda().eval()
    x = torch.randn(4, 16, device="cuda")
    with torch.no_grad():
        outer(x)
        inner.join = "mean"  # the outer graph ran the old join
        assert torch.equal(outer(x), (inner[0](x) + inner[1](x)) / 2 + outer[1](x))


@pytest.mark.cuda
def test_hooks_below_a_graphed_block_warn_that_they_run_only_while_captured():
    block = Parallel(*_mlp(2), join="cat", cuda_graph=True).cuda().eval()
    seen = []
    block[0].register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad(), pytest.warns(UserWarning, match="run only while a graph is captured"):
        for _ in range(3):
            block(torch.randn(8, 64, device="cuda"))


# ---------------------------------------- found by a review of feature combinations
@pytest.mark.cuda
def test_a_graphed_side_branch_lends_nothing_a_later_fork_overwrites():
    # G runs on a pool side stream for callers on two streams; its output, read late on
    # the first caller's stream, was overwritten by G's next replay for the second caller
    # (it had started lending its buffers: the outer fork dropped them in time).
    g0, g1 = nn.Linear(64, 64), nn.Linear(64, 64)
    inner = Parallel(g0, g1, cuda_graph=True)
    outer = Parallel(nn.Linear(64, 64), inner, join=None, streams=True).cuda().eval()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.no_grad():
        for _ in range(8):  # outputs dropped at once: the graph starts lending its buffers
            outer(torch.randn(16, 64, device="cuda"))
        for _ in range(3):
            x1, x2 = torch.randn(16, 64, device="cuda"), torch.randn(16, 64, device="cuda")
            torch.cuda.synchronize()
            with torch.cuda.stream(s1):
                out = outer(x1)
                torch.cuda._sleep(20_000_000)
                late = out[1] * 1.0  # read on s1, after the next call was enqueued on s2's fork
            del out
            with torch.cuda.stream(s2):
                out = outer(x2)
            del out
            torch.cuda.synchronize()
            torch.testing.assert_close(late, torch.cat([g0(x1), g1(x1)], 1), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_static_outputs_changed_in_place_before_backward_are_refused():
    # Before: the backward graph read the changed buffer and gave wrong gradients silently.
    # (The block's output is the ReLU's, whose backward reads it; a cat's output is not
    # read by the backward, and may change, as eager allows.)
    from parallel_modules import ParallelSequential

    block = ParallelSequential(nn.Linear(8, 8), nn.ReLU(), cuda_graph=True, static_outputs=True).cuda()
    x = torch.randn(4, 8, device="cuda")
    for _ in range(3):  # captured, then replayed
        block(x).sum().backward()
    y = block(x)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    block.zero_grad()
    block(x).sum().backward()  # the next call works, with the gradients of the eager pipeline
    plain = copy.deepcopy(block[0])
    plain.zero_grad()
    torch.relu(plain(x)).sum().backward()
    torch.testing.assert_close(block[0].weight.grad, plain.weight.grad)
    torch.testing.assert_close(block[0].bias.grad, plain.bias.grad)


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (recent torch warns that torch.jit is deprecated)
def test_torchscript_stage_is_graphed_in_training():
    # Before: the capture's note of the modules' parameter dicts called ``.copy()`` on a
    # TorchScript module's, which is a view of C++ state without one (AttributeError).
    from parallel_modules import ParallelSequential

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid()).cuda()
    reference = copy.deepcopy(eager)  # (a deepcopy of a scripted module gets no .grad)
    scripted = torch.jit.script(eager)
    block = ParallelSequential(nn.Identity(), scripted, cuda_graph=True, static_outputs=True).cuda()
    for _ in range(4):  # captured, then replayed
        x = torch.randn(4, 8, device="cuda")
        block(x).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
        for p, q in zip(block.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
            p.grad = q.grad = None
    assert block._graphs.captures == 1
    y = block(x)
    y.mul_(2)  # the Sigmoid's output, which its backward reads: refused, as eager refuses it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_the_parameters_a_backward_graph_reads_are_those_autograd_saved():
    # The parameters a replay saves for its backward (so that autograd refuses a change in
    # place before it, as eagerly): those whose memory the captured call's autograd graph
    # saved -- a weight whose layer's input requires grad, frozen or not --, not a bias nor the
    # first weight of a call whose input requires none, nor a buffer (see _saved).
    from parallel_modules._graphs import _saved

    m = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4), nn.BatchNorm1d(4))
    names = {id(t): n for n, t in m.named_parameters()}
    for requires_grad, expected in [(True, ["0.weight", "2.weight", "3.weight"]),
                                    (False, ["2.weight", "3.weight"])]:
        out = m(torch.randn(3, 4, requires_grad=requires_grad))
        assert [names[id(t)] for t in _saved(m, [out])[1]] == expected
    m[2].weight.requires_grad_(False)  # (frozen, and read by the backward all the same)
    out = m(torch.randn(3, 4, requires_grad=True))
    assert [names[id(t)] for t in _saved(m, [out])[1]] == ["0.weight", "2.weight", "3.weight"]


class _ScalesASlice(nn.Module):
    r"""Scales part of its input in place: autograd records a ``CopySlices``, whose saved tensors Python cannot read."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((2,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1
        y[:, :2] *= self.scale
        return y


def test_the_state_saved_past_a_node_python_cannot_read_is_no_more_than_autograd_saved():
    # Before (a review): a captured call with a node whose saved tensors Python cannot read (an
    # in-place write to part of a tensor) counted as saving every parameter and buffer, and its
    # replays refused a backward after a change in place that eager autograd lets pass: a bias,
    # BatchNorm's count of batches (which the warm-up of another signature moves). Walked past,
    # that node's own saves are not found -- a change to them passes, as before replays saved
    # any --, the other nodes' are.
    from parallel_modules._graphs import _saved

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), _ScalesASlice())
    named = [*m.named_parameters(), *m.named_buffers()]
    refused = set()
    for name, t in named:
        out = m(torch.randn(3, 4, requires_grad=True))
        with torch.no_grad():
            t.add_(0)  # (a new version, the same values)
        try:
            out.sum().backward()
        except RuntimeError as e:
            assert "modified by an inplace operation" in str(e), e
            refused.add(name)
    assert refused == {"0.weight", "1.weight", "1.running_mean", "1.running_var", "2.scale"}
    names = {id(t): n for n, t in named}
    saved = {names[id(t)] for t in _saved(m, [m(torch.randn(3, 4, requires_grad=True))])[1]}
    # (2.scale: saved by the in-place write's node, not found; the running statistics: buffers)
    assert saved == refused - {"2.scale", "1.running_mean", "1.running_var"}


def test_the_state_saved_leaves_out_tensors_without_memory_of_their_own():
    # Before (a review): a wrapper subclass (torchao's float8 and quantized weights, DTensor), as a
    # parameter or as a tensor autograd saved, has no storage of its own to look up, and every
    # training capture raised "invalid python storage" (where, before replays saved state, it
    # captured). Left out, as what Python cannot read is: its memory is its inner tensors'.
    from torch.testing._internal.two_tensor import TwoTensor

    from parallel_modules._graphs import _saved

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    m[1].weight = nn.Parameter(TwoTensor(torch.randn(4, 4), torch.randn(4, 4)))
    out = m(torch.randn(3, 4, requires_grad=True))
    out_saved, state_saved = _saved(m, [out])
    assert [t is m[0].weight for t in state_saved] == [True]
    # (The same walk, left incomplete for the outputs: counted as saved, the safe side.)
    assert out_saved == [True]


def _changed_before_backward(block: nn.Module, x: torch.Tensor, change: str) -> tuple:
    r"""What ``block`` gives for a backward after ``change`` to its tensors since the forward:
    the error, or the gradients."""
    block.zero_grad()
    x.grad = None
    y = block(x)
    layer = block[1][2]
    with torch.no_grad():
        if change == "bias":
            layer.bias.mul_(0.5)
        elif change != "none":  # (as an optimizer's step between forward and backward)
            layer.weight.mul_(0.5)
    try:
        y.sum().backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e), e
        return ("refused",)
    return ("passed", x.grad.clone(), *[p.grad.clone() for p in block.parameters() if p.grad is not None])


@pytest.mark.cuda
@pytest.mark.parametrize("fuse", [False, True], ids=["streams", "fused"])
@pytest.mark.parametrize("direct", [False, True], ids=["accumulated", "direct_grads"])
@pytest.mark.parametrize("change", ["weight", "frozen weight", "bias"])
def test_block_tensors_changed_before_the_backward_of_a_replay_are_refused_as_eagerly(change, direct, fuse):
    # Before (a hunt): the backward graph read the block's weights where the forward graph
    # had, not as saved tensors, so a change in place between a replay and its backward (an
    # optimizer step before backward()) gave the gradients of the new weights silently, where
    # eager autograd refuses. A bias, which no backward reads, may change, as eagerly. A fused
    # group's forward graph stacks its members' weights, and its backward graph reads the
    # stacks: it passes, with the gradients of the weights the forward read (README).
    torch.manual_seed(0)
    branches = [nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32)) for _ in range(4)]
    eager = Parallel(*copy.deepcopy(branches), join="sum", fuse=fuse).cuda()
    graphed = Parallel(*copy.deepcopy(branches), join="sum", fuse=fuse, cuda_graph=True, direct_grads=direct).cuda()
    if change == "frozen weight":
        for block in (eager, graphed):
            for branch in block:
                branch[2].weight.requires_grad_(False)
    x = torch.randn(8, 32, device="cuda", requires_grad=True)  # (so that frozen weights are saved too)
    for _ in range(3):  # captured, then replayed
        graphed(x).sum().backward()
    assert graphed._graphs.captures == 1
    for _ in range(2):  # (refused once, the next call works: changed alike, both blocks stay equal)
        before = _changed_before_backward(copy.deepcopy(eager), x, "none")
        want = _changed_before_backward(eager, x, change)
        got = _changed_before_backward(graphed, x, change)
        assert want[0] == ("passed" if change == "bias" else "refused")
        if fuse and change != "bias":
            assert got[0] == "passed"
            want = before
        assert got[0] == want[0]
        for g, w in zip(got[1:], want[1:], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    graphed.zero_grad()
    eager.zero_grad()
    graphed(x).sum().backward()
    eager(x).sum().backward()
    for p, q in zip(graphed.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert graphed._graphs.captures == 1


@pytest.mark.cuda
@pytest.mark.parametrize("direct", [False, True], ids=["accumulated", "direct_grads"])
def test_a_weight_swapped_before_the_backward_of_a_replay_is_refused(direct):
    # As eagerly, where torch.utils.swap_tensors refuses to swap a tensor autograd saved:
    # the replay's backward would otherwise read the memory the weight left.
    torch.manual_seed(0)
    block = Parallel(*_mlp(2, 32), join="sum", cuda_graph=True, direct_grads=direct).cuda()
    x = torch.randn(8, 32, device="cuda", requires_grad=True)
    for _ in range(3):  # captured, then replayed
        block(x).sum().backward()
    y = block(x)
    weight = block[1][2].weight
    with pytest.raises(RuntimeError):
        torch.utils.swap_tensors(weight, nn.Parameter(weight.detach() * 0.5))
    y.sum().backward()
    block.zero_grad()
    block(x).sum().backward()
    assert block._graphs.captures == 1 and weight.grad is not None


@pytest.mark.cuda
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_capture_before_the_backward_of_another_signatures_replay_trains_as_eagerly(training):
    # (A review.) A capture puts back the buffers its warm-up updated with copy_, which gives
    # them new versions; had the replay of another signature, its backward yet to run, saved
    # BatchNorm's running statistics (as eager autograd saves them), that backward would be
    # refused ("modified by an inplace operation"), where eagerly, BatchNorm updating them
    # without a new version, it passes: two input sizes through one block before one backward
    # (multi-crop), the first time the second size comes. Replays save no buffers.
    torch.manual_seed(0)
    branches = [nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16)) for _ in range(3)]
    eager = Parallel(*copy.deepcopy(branches), join="sum", fuse=False).cuda().train(training)
    graphed = Parallel(*copy.deepcopy(branches), join="sum", fuse=False, cuda_graph=True).cuda().train(training)
    a = torch.randn(8, 16, device="cuda", requires_grad=True)
    b = torch.randn(4, 16, device="cuda", requires_grad=True)
    grads = []
    for block in (eager, graphed):
        for _ in range(2):  # a's signature captured, then replayed
            block(a).sum().backward()
        block.zero_grad()
        a.grad = b.grad = None
        (block(a).sum() + block(b).square().sum()).backward()  # (b's captured between a's replay and backward)
        grads.append([a.grad.clone(), b.grad.clone(), *[p.grad.clone() for p in block.parameters()],
                      *block.buffers()])
    for g, w in zip(*grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert graphed._graphs.captures == 2


@pytest.mark.cuda
def test_static_outputs_no_backward_reads_may_change_in_place():
    # Linear's and cat's backward read no output: eager accepts y.mul_(2) before
    # backward (an in-place ReLU after the block, ``y += skip``), and so must the replay.
    torch.manual_seed(0)
    branches = [nn.Linear(64, 64), nn.Linear(64, 64)]
    block = Parallel(*copy.deepcopy(branches), cuda_graph=True, static_outputs=True).cuda()
    reference = nn.ModuleList(branches).cuda()
    for _ in range(4):  # captured, then replayed
        x = torch.randn(16, 64, device="cuda")
        y, y_r = block(x), _reference(reference, x)
        y.mul_(2)
        y_r.mul_(2)
        (y * y).sum().backward()
        (y_r * y_r).sum().backward()
        for p, q in zip(block.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
            p.grad = q.grad = None
    assert block._graphs.captures == 1


@cuda
@pytest.mark.parametrize("outer", ["parallel", "pipeline"])
def test_training_capture_sees_a_layer_replaced_in_a_nested_fused_block(outer):
    # A training capture runs the blocks below with aliases for the parameters, in
    # which a fused block took the replaced layer's change for the aliases' and ran
    # its old parameters (the capture was refused: a stray tensor requiring grad).
    from parallel_modules import ParallelSequential

    torch.manual_seed(0)
    width = 32
    stem, members, head = nn.Linear(16, width), _mlp(4, width=width), nn.Linear(4 * width, 8)
    stem_r, members_r, head_r = copy.deepcopy((stem, members, head))
    inner = Parallel(*members, fuse=True)
    if outer == "pipeline":
        model = ParallelSequential(stem, inner, head, chunks=2, cuda_graph=True).cuda()
    else:
        model = nn.Sequential(stem, Parallel(inner, cuda_graph=True), head).cuda()
    chunks = 2 if outer == "pipeline" else 1
    reference = nn.ModuleList([stem_r, *members_r, head_r]).cuda()

    def expected(x):
        return torch.cat([head_r(_reference(members_r, stem_r(c))) for c in x.tensor_split(chunks)])

    for step in range(4):
        if step == 2:
            new = nn.Linear(width, width).cuda()
            members_r[1][0] = copy.deepcopy(new)
            inner[1][0] = new
        x = torch.randn(8, 16, device="cuda")
        y, y_r = model(x), expected(x)
        torch.testing.assert_close(y, y_r, rtol=1e-4, atol=1e-5)
        y.square().mean().backward()
        y_r.square().mean().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
            p.grad = q.grad = None
    assert inner.explain()["fused"] == [["0", "1", "2", "3"]]


# ------------------------------------ kernel settings the key missed (review of session 69)
def test_key_tells_the_rnn_tf32_setting_and_cudnn_enabled_apart():
    # cuDNN's recurrent layers read a TF32 setting of their own, and cudnn.enabled = False runs
    # torch's own kernels: both choose what a capture bakes in, as the matmul and conv settings
    # do. Before: neither moved the key, and a graph captured under one replayed under the other.
    # (Nor did the math attention backend's half-precision reductions; the preferred BLAS library,
    # which a CPU build cannot set, is the CUDA test's below.)
    # (In a subprocess: setting the RNN's precision alone makes the legacy getters that conftest
    # reads raise.)
    script = textwrap.dedent("""
        import torch
        from torch import nn
        from parallel_modules import Parallel
        from parallel_modules._graphs import _CudaGraphs
        block = Parallel(nn.Linear(4, 4), nn.Linear(4, 4))
        graphs = _CudaGraphs(block)
        x = torch.randn(2, 4)
        before = graphs._key(block, (x,), {}, ())
        torch.backends.cudnn.enabled = not torch.backends.cudnn.enabled
        assert graphs._key(block, (x,), {}, ()) != before
        torch.backends.cudnn.enabled = not torch.backends.cudnn.enabled
        assert graphs._key(block, (x,), {}, ()) == before
        allow = getattr(torch.backends.cuda, "allow_fp16_bf16_reduction_math_sdp", None)
        if allow is not None:
            allow(not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed())
            assert graphs._key(block, (x,), {}, ()) != before
            allow(not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed())
            assert graphs._key(block, (x,), {}, ()) == before
        if hasattr(torch.backends.cudnn, "rnn"):
            rnn = torch.backends.cudnn.rnn.fp32_precision
            torch.backends.cudnn.rnn.fp32_precision = "ieee" if rnn == "tf32" else "tf32"
            assert graphs._key(block, (x,), {}, ()) != before
        print("ok")
    """)
    done = _run_python(script, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


_RNN_TF32_SCRIPT = textwrap.dedent(
    """
    import warnings
    import torch
    from torch import nn
    from parallel_modules import Parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    class LSTMOutputs(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.lstm = nn.LSTM(width, width, batch_first=True)

        def forward(self, x):
            return self.lstm(x)[0]

    torch.manual_seed(0)
    block = Parallel(LSTMOutputs(256), LSTMOutputs(256), cuda_graph=True, graph_fallback=True).cuda().eval()
    x = torch.randn(32, 8, 256, device="cuda")

    def reference():
        return torch.cat([b(x) for b in block], 1)

    with torch.no_grad():
        torch.backends.cudnn.rnn.fp32_precision = "ieee"
        exact = reference()
        torch.backends.cudnn.rnn.fp32_precision = "tf32"
        fast = reference()
        if torch.equal(exact, fast):
            raise SystemExit(print("SKIP cuDNN's LSTM rounds alike with and without TF32 here"))
        torch.backends.cudnn.rnn.fp32_precision = "ieee"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert torch.equal(block(x), exact)
        if len(block._graphs) == 0:
            raise SystemExit(print("SKIP cuDNN's LSTM could not be captured (graph_fallback ran it eagerly)"))
        assert torch.equal(block(x), exact)  # replayed
        torch.backends.cudnn.rnn.fp32_precision = "tf32"
        assert torch.equal(block(x), fast), "the float32 graph replayed under TF32"
        torch.backends.cudnn.rnn.fp32_precision = "ieee"
        assert torch.equal(block(x), exact)
    assert block._graphs.captures == 2
    torch.cuda.synchronize()
    print("OK")
    """
)


@cuda
def test_rnn_tf32_setting_changed_after_capture_captures_anew():
    # (In a subprocess: cuDNN's LSTM may not be capturable on every torch, and capture failures run
    # apart, as test_capture_failure_in_subprocess's; its RNN precision set alone also makes the
    # legacy getter that conftest reads raise.)
    if not hasattr(torch.backends.cudnn, "rnn"):
        pytest.skip("this torch has no TF32 setting of cuDNN's recurrent layers of its own")
    done = _run_python(_RNN_TF32_SCRIPT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    if done.stdout.startswith("SKIP"):
        pytest.skip(done.stdout[5:].strip())
    assert "OK" in done.stdout, done.stdout + done.stderr[-3000:]


@cuda
def test_cudnn_disabled_after_capture_captures_anew():
    torch.manual_seed(0)
    block = Parallel(nn.Conv2d(64, 64, 3, padding=1), nn.Conv2d(64, 32, 5, padding=2), cuda_graph=True).cuda().eval()
    x = torch.randn(8, 64, 32, 32, device="cuda")
    saved = torch.backends.cudnn.enabled
    try:
        with torch.no_grad():
            cudnn = _reference(block, x)
            torch.backends.cudnn.enabled = False
            native = _reference(block, x)
            torch.backends.cudnn.enabled = True
            if torch.equal(cudnn, native):
                pytest.skip("cuDNN's convolutions and torch's own round alike here")
            for _ in range(2):
                assert torch.equal(block(x), cudnn)
            torch.backends.cudnn.enabled = False
            assert torch.equal(block(x), native)  # before: the cuDNN graph replayed
            torch.backends.cudnn.enabled = True
            assert torch.equal(block(x), cudnn)
        assert block._graphs.captures == 2
    finally:
        torch.backends.cudnn.enabled = saved


# ------------------------------------------- anomaly detection (review of session 69)
def test_autograd_busy_under_anomaly_detection_while_recording(monkeypatch):
    # The engine reads each backward operation's output on the host to look for NaNs: a captured
    # backward cannot, so calls that record run eagerly (warned once); those that do not replay.
    from parallel_modules._graphs import _autograd_busy

    assert _autograd_busy() == ""
    with torch.autograd.set_detect_anomaly(True):
        assert _autograd_busy() == "anomaly detection"
        with torch.no_grad():
            assert _autograd_busy() == ""  # nothing to differentiate: no backward to capture
    assert _autograd_busy() == ""
    block = Parallel(*_mlp(2, width=16), cuda_graph=True)
    monkeypatch.setattr(block._graphs, "_lookup", lambda *a: pytest.fail("looked up a graph"))
    x = torch.randn(4, 16)
    with torch.autograd.set_detect_anomaly(True), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            assert torch.equal(block(x), _reference(block, x))
    messages = _graph_warnings(record)
    assert len(messages) == 1 and "anomaly detection" in messages[0], messages


_ANOMALY_SCRIPT = textwrap.dedent(
    """
    import copy, warnings
    import torch
    from torch import nn
    from parallel_modules import Parallel
    from parallel_modules._cases import mlp_branches

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    block = Parallel(*mlp_branches(2, width=16, depth=2), cuda_graph=True).cuda()
    reference = copy.deepcopy(block)
    reference.cuda_graph = False
    x = torch.randn(4, 16, device="cuda")
    with torch.autograd.set_detect_anomaly(True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            for m in (block, reference):
                m.zero_grad()
                m(x).square().sum().backward()  # before: a CUDA graph capture error
            for p, q in zip(block.parameters(), reference.parameters()):
                assert torch.equal(p.grad, q.grad)
        assert len(block._graphs) == 0

        class NaNGrad(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.clone()

            @staticmethod
            def backward(ctx, g):
                return g * float("nan")

        class Applied(nn.Module):
            def forward(self, t):
                return NaNGrad.apply(t)

        nan = Parallel(nn.Sequential(nn.Linear(16, 16), Applied()), cuda_graph=True).cuda()
        try:
            nan(x).sum().backward()
        except RuntimeError as e:
            assert "NaNGradBackward" in str(e) and "returned nan" in str(e), str(e)
        else:
            raise SystemExit("anomaly detection did not name the NaN")
    # Outside it, the same calls are graphed.
    block.zero_grad()
    block(x).square().sum().backward()
    assert len(block._graphs) == 1
    torch.cuda.synchronize()
    print("OK")
    """
)


@cuda
def test_graphed_training_under_anomaly_detection_runs_eagerly():
    # Before: the warm-up passed, and the capture of the backward pass failed on the engine's NaN
    # check (a host read inside the capture): a CUDA graph capture error for a call that runs
    # eagerly. Now such calls run eagerly, and a NaN is named where it is made. (In a subprocess,
    # as capture failures are tested: before the fix, this one failed a capture.)
    done = _run_python(_ANOMALY_SCRIPT, timeout=300)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr[-3000:]


# ------------------------------- a forward changing its input in place (review of session 69)
class _Residual(nn.Module):
    r"""``x + block(x)``: reads its input after the block, as eagerly changed by it if the block changed it."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


def test_static_inputs_requiring_grad_refuse_a_write_in_place_as_a_capture_error():
    # The mechanism, on the CPU: a training capture's static copy of an input requiring grad is a
    # leaf, which torch refuses to change in place where the caller's input, a layer's output,
    # is changed eagerly. The capture now raises that as a capture error, which graph_fallback
    # catches (before, torch's error went on as raised: a graphed call failed where eager ran).
    from parallel_modules import ParallelSequential
    from parallel_modules._graphs import _CaptureError, _static_like

    pipe = ParallelSequential(nn.ReLU(inplace=True), nn.Linear(16, 16), cuda_graph=True)
    x = torch.randn(4, 16, requires_grad=True) * 2  # (not a leaf: eagerly changed in place)
    pipe._eager(x.clone())
    static = _static_like(x.detach()).requires_grad_(True)
    with pytest.raises(RuntimeError) as info:
        pipe._eager(static)
    with pytest.raises(_CaptureError, match="changes in place a tensor that requires grad") as refused:
        pipe._graphs._written_leaf(info.value, [static], [x])
    assert refused.value.__cause__ is info.value
    pipe._graphs._written_leaf(info.value, [static.detach()], [x])  # no input requires grad: not this
    pipe._graphs._written_leaf(RuntimeError("another error"), [static], [x])


@cuda
def test_a_branch_changing_the_input_in_place_changes_the_callers_tensor_as_eagerly():
    # Before: the graph changed its static copy only, and the caller's tensor was left as it was:
    # x + block(x) added the input as it was before the block's ReLU, where eagerly it added the
    # ReLU's result. The gradients of the parameters too.
    from parallel_modules import ParallelSequential

    torch.manual_seed(0)
    branches = [nn.Sequential(nn.ReLU(inplace=True), nn.Linear(16, 16)), nn.Linear(16, 16)]
    blocks = [Parallel(*copy.deepcopy(branches), join="sum", streams=False, cuda_graph=True),
              ParallelSequential(nn.ReLU(inplace=True), nn.Linear(16, 16), cuda_graph=True)]
    for block in blocks:
        graphed = _Residual(block).cuda()
        eager = copy.deepcopy(graphed)
        eager.block.cuda_graph = False
        for training in (False, True):
            for _ in range(3):
                x = torch.randn(4, 16, device="cuda")
                x_eager = x.clone()
                with torch.set_grad_enabled(training):
                    out, expected = graphed(x), eager(x_eager)
                assert torch.equal(x, x_eager)  # changed in place, as eagerly
                assert torch.equal(out, expected)
                if training:
                    out.square().sum().backward()
                    expected.square().sum().backward()
                    for p, q in zip(graphed.parameters(), eager.parameters()):
                        assert torch.equal(p.grad, q.grad)
                        p.grad = q.grad = None
        assert len(block._graphs) == 2  # an inference graph and a training one: replayed, not eager


@cuda
def test_a_training_input_requiring_grad_changed_in_place_is_refused_at_capture():
    # A block inside a model: its input is a layer's output, which requires grad and which an eager
    # call changes in place. Before: the warm-up raised torch's "a leaf Variable that requires grad is
    # being used in an in-place operation" (the graph's static copy is a leaf), which graph_fallback
    # did not catch. Now a capture error: named, and with graph_fallback the call runs eagerly.
    from parallel_modules import ParallelSequential

    torch.manual_seed(0)
    stem = nn.Linear(16, 16).cuda()
    pipe = ParallelSequential(nn.ReLU(inplace=True), nn.Linear(16, 16), cuda_graph=True).cuda()
    x = torch.randn(4, 16, device="cuda")
    with pytest.raises(RuntimeError, match="changes in place a tensor that requires grad"):
        pipe(stem(x))
    pipe.graph_fallback = True
    eager = copy.deepcopy(pipe)
    eager.cuda_graph = False
    stem_eager = copy.deepcopy(stem)
    for step in range(2):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            h, h_eager = stem(x), stem_eager(x)
            out, expected = _Residual(pipe)(h), _Residual(eager)(h_eager)
        warned = [m for m in _graph_warnings(record) if "changes in place a tensor that requires grad" in m]
        assert len(warned) == (1 if step == 0 else 0), _graph_warnings(record)
        assert torch.equal(h, h_eager) and torch.equal(out, expected)
        out.sum().backward()
        expected.sum().backward()
        for p, q in zip([*stem.parameters(), *pipe.parameters()], [*stem_eager.parameters(), *eager.parameters()]):
            assert torch.equal(p.grad, q.grad)
            p.grad = q.grad = None
    assert len(pipe._graphs) == 0


@cuda
def test_preferred_blas_library_changed_after_capture_captures_anew():
    # cuBLAS and cuBLASLt pick their own kernels for a product: a graph captured under one replayed
    # its kernels after the other was preferred, where eager calls ran the other's.
    torch.manual_seed(0)
    block = Parallel(nn.Linear(512, 512, bias=False), nn.Linear(512, 256, bias=False), cuda_graph=True).cuda().eval()
    x = torch.randn(64, 512, device="cuda")
    saved = torch.backends.cuda.preferred_blas_library()
    try:
        with torch.no_grad():
            torch.backends.cuda.preferred_blas_library("cublas")
            cublas = _reference(block, x)
            try:
                torch.backends.cuda.preferred_blas_library("cublaslt")
            except RuntimeError:
                pytest.skip("this torch has no cuBLASLt")
            lt = _reference(block, x)
            if torch.equal(cublas, lt):
                pytest.skip("cuBLAS and cuBLASLt round these products alike here")
            torch.backends.cuda.preferred_blas_library("cublas")
            for _ in range(2):
                assert torch.equal(block(x), cublas)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            assert torch.equal(block(x), lt)  # before: the cuBLAS graph replayed
            torch.backends.cuda.preferred_blas_library("cublas")
            assert torch.equal(block(x), cublas)
        assert block._graphs.captures == 2
    finally:
        torch.backends.cuda.preferred_blas_library(saved)


@cuda
def test_a_numpy_scalar_replays_only_its_own_graph():
    # Before: numpy's float32 was keyed by value, so -0.0 replayed 0.0's graph (1 / s baked in
    # with the other sign) and a NaN, unequal to itself, captured a new graph at every call.
    np = pytest.importorskip("numpy")
    block = Parallel(lambda x, s: x / s, lambda x, s: x * s, cuda_graph=True).cuda()
    x = torch.rand(4, 8, device="cuda") + 1
    for s in (np.float32(0.0), np.float32(-0.0)):
        torch.testing.assert_close(block(x, s), torch.cat([x / s, x * s], 1))
    assert block._graphs.captures == 2
    for _ in range(3):
        assert block(x, np.float32("nan")).isnan().all()
    assert block._graphs.captures == 3


# ------------------------------- process settings the key missed (bug hunt of session 71)
def test_key_tells_the_default_dtype_and_other_kernel_settings_apart():
    # Each of these decides what a capture bakes in, and none moved the key: a graph captured
    # under one replayed under another. The default dtype is that of what a forward makes
    # without naming one (and of the results it takes part in); warn_only=True let a capture run
    # an operation that has no deterministic algorithm, where eager then raises; the others pick
    # kernels. The attention backends' priority order is a list: kept as such, the key was
    # unhashable and every call ran eagerly, warned of as an unhashable argument.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.utils.deterministic

    from parallel_modules._graphs import _CudaGraphs

    block = Parallel(nn.Linear(4, 4), nn.Linear(4, 4))
    graphs = _CudaGraphs(block)
    x = torch.randn(2, 4)
    before = graphs._key(block, (x,), {}, ())
    hash(before)

    def changed(set_it, restore) -> None:
        set_it()
        try:
            key = graphs._key(block, (x,), {}, ())
            hash(key)
            assert key != before
        finally:
            restore()
        assert graphs._key(block, (x,), {}, ()) == before

    dtype = torch.get_default_dtype()
    changed(lambda: torch.set_default_dtype(torch.float64), lambda: torch.set_default_dtype(dtype))
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        before = graphs._key(block, (x,), {}, ())
        changed(lambda: torch.use_deterministic_algorithms(True, warn_only=not warn_only),
                lambda: torch.use_deterministic_algorithms(True, warn_only=warn_only))
        fill = torch.utils.deterministic.fill_uninitialized_memory

        def set_fill(value: bool) -> None:
            torch.utils.deterministic.fill_uninitialized_memory = value

        changed(lambda: set_fill(not fill), lambda: set_fill(fill))
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    before = graphs._key(block, (x,), {}, ())
    benchmark = torch.backends.cudnn.benchmark
    changed(lambda: setattr(torch.backends.cudnn, "benchmark", not benchmark),
            lambda: setattr(torch.backends.cudnn, "benchmark", benchmark))
    if hasattr(torch.backends.cudnn, "depthwise_kernel"):
        depthwise = torch.backends.cudnn.depthwise_kernel
        other = "native" if depthwise != "native" else "cudnn"
        changed(lambda: setattr(torch.backends.cudnn, "depthwise_kernel", other),
                lambda: setattr(torch.backends.cudnn, "depthwise_kernel", depthwise))
    if hasattr(torch._C, "_set_sdp_use_fa3"):
        fa3 = torch._C._get_fa3_sdp_enabled()
        changed(lambda: torch._C._set_sdp_use_fa3(not fa3), lambda: torch._C._set_sdp_use_fa3(fa3))
    order = sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                         SDPBackend.CUDNN_ATTENTION], set_priority=True)
    changed(order.__enter__, lambda: order.__exit__(None, None, None))


class _MakesOnes(nn.Module):
    r"""Adds a tensor of ones it makes without naming a dtype: the default dtype's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.ones(x.shape[-1], device=x.device)


@cuda
def test_default_dtype_changed_after_capture_captures_anew():
    # Before: the graph captured under float32 replayed after set_default_dtype(float64), and
    # returned float32 where the eager call promotes to float64.
    block = Parallel(_MakesOnes(), nn.Identity(), cuda_graph=True).cuda()
    x = torch.randn(4, 8, device="cuda")
    dtype = torch.get_default_dtype()
    try:
        with torch.no_grad():
            for _ in range(2):
                assert block(x).dtype == torch.float32
            torch.set_default_dtype(torch.float64)
            out = block(x)
            assert out.dtype == torch.float64
            assert torch.equal(out, torch.cat([x + torch.ones(8, device="cuda"), x], 1))
        assert block._graphs.captures == 2
    finally:
        torch.set_default_dtype(dtype)


class _Attends(nn.Module):
    r"""Self-attention of its input with itself, by ``F.scaled_dot_product_attention``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(x, x, x)


@cuda
def test_attention_backends_priority_changed_after_capture_captures_anew():
    # With flash and math attention both enabled, sdpa_kernel(..., set_priority=True) decides
    # which runs. Before: the graph captured with flash attention first replayed it under a
    # priority that puts math first, where eager calls run math (rounding otherwise).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    block = Parallel(_Attends(), _Attends(), join="sum", cuda_graph=True).cuda()
    x = torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.float16)
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    with torch.no_grad():
        with sdpa_kernel(backends, set_priority=True):
            flash = _Attends()(x) * 2
        with sdpa_kernel(backends[::-1], set_priority=True):
            math = _Attends()(x) * 2
        if torch.equal(flash, math):
            pytest.skip("flash and math attention round these inputs alike here")
        with sdpa_kernel(backends, set_priority=True):
            for _ in range(2):
                assert torch.equal(block(x), flash)
        with sdpa_kernel(backends[::-1], set_priority=True):
            assert torch.equal(block(x), math)  # before: the flash graph replayed
    assert block._graphs.captures == 2


# ------------------------------------------------ messages (audit of session 78)
class _Second(nn.Module):
    r"""A branch taking a second argument it does not read."""

    def forward(self, x: torch.Tensor, other: object) -> torch.Tensor:
        return x * 2


@cuda
def test_inputs_no_graph_can_take_run_eagerly_with_a_warning_that_says_how_to_replay():
    block = Parallel(_Second(), _Second(), cuda_graph=True).cuda()
    x = torch.randn(2, 3, device="cuda")
    expected = torch.cat([x * 2, x * 2], 1)
    with pytest.warns(UserWarning, match=r"unhashable arguments .*running eagerly \(pass such values as tensors, "
                                         r"or hashable ones, a tuple for a list, a frozenset for a set, to "
                                         r"replay a graph\)"):
        assert torch.equal(block(x, {1, 2}), expected)  # (a set: a leaf of the inputs, and unhashable)
    with pytest.warns(UserWarning, match=r"needs every tensor input on cuda:0; got \['cpu', 'cuda:0'\]\. Running "
                                         r"eagerly \(move every tensor input to cuda:0 to replay a graph\)"):
        assert torch.equal(block(x, torch.randn(2, 3)), expected)
    assert torch.equal(block(x, 1), expected) and len(block._graphs) == 1  # (and then a graph replays)


# ------------------------------------------------------------ mixed precision and saved tensors
@cuda
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("direct", [False, True])
def test_grad_scaler_training_of_a_graphed_block_equals_the_plain_branches(direct, fuse):
    # AMP: the forward under fp16 autocast, the scaled backward outside it, the scaler unscaling
    # in place the gradients the graphed backward handed to .grad (the graph's own buffers), and
    # skipping the step whose gradients are not finite, as for the plain branches.
    branches = _mlp(4)
    reference = _Cat(copy.deepcopy(branches)).cuda()
    block = _graphed(branches, direct_grads=direct, fuse=fuse)
    models = (block, reference)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0 ** 10) for _ in models]
    weight = torch.randn(8, 4 * 64, device="cuda")
    # (Fused: batched products round in half precision in another order.)
    tol = dict(rtol=1e-2, atol=1e-2) if fuse else {}
    for step in range(6):
        x = torch.randn(8, 64, device="cuda")
        before = [p.detach().clone() for p in block.parameters()]
        outs = []
        for model, optimizer, scaler in zip(models, optimizers, scalers):
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
            outs.append(out)
            loss = (out.float() * weight).mean()
            if step == 3:
                loss = loss * float("inf")  # gradients that are not finite: the scaler skips the step
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        assert outs[0].dtype == outs[1].dtype == torch.float16
        torch.testing.assert_close(outs[0], outs[1], **tol)
        assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0 ** (9 if step >= 3 else 10)
        if step == 3:
            assert all(torch.equal(p, q) for p, q in zip(block.parameters(), before))
        for p, q in zip(block.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, **(dict(rtol=1e-3, atol=1e-3) if fuse else {}))
    assert block._graphs.captures == 1


@cuda
@pytest.mark.parametrize("build", ["Parallel", "fused", "ParallelSequential"])
def test_a_training_graph_captured_under_autocast_is_not_replayed_without_it(build):
    # The autocast dtype is part of a graph's key: each call replays the graph of its own
    # autocast, whose forward casts (or not) and whose backward matches.
    branches = _mlp(3)
    if build == "ParallelSequential":
        first = nn.Linear(64, 64)
        reference = nn.Sequential(copy.deepcopy(first), _Cat(copy.deepcopy(branches))).cuda()
        block = ParallelSequential(first, Parallel(*branches), chunks=2, cuda_graph=True).cuda()
    else:
        reference = _Cat(copy.deepcopy(branches)).cuda()
        block = _graphed(branches, fuse=build == "fused")
    # (Fused: batched products round in another order; in micro-batches, other batch sizes' kernels.)
    exact = build == "Parallel"
    for step in range(6):
        on = step % 2 == 0
        # (Not a leaf: autocast caches its cast of a leaf that requires grad for the thread, which a
        # capture does without, so that the branches' gradients for it would sum in another precision.)
        x = torch.randn(8, 64, device="cuda", requires_grad=True) * 1
        grads = []
        for model in (block, reference):
            with torch.autocast("cuda", dtype=torch.float16, enabled=on):
                out = model(x)
            assert out.dtype == (torch.float16 if on else torch.float32)
            grads.append((out, *torch.autograd.grad(out.float().square().sum(), [x, *model.parameters()])))
        for a, b in zip(*grads):
            if exact:
                torch.testing.assert_close(a, b)
            else:
                torch.testing.assert_close(a, b, **(dict(rtol=1e-2, atol=1e-2) if on else dict(rtol=1e-4, atol=1e-4)))
    assert len(block._graphs) == 2 and block._graphs.captures == 2


@cuda
@pytest.mark.parametrize("amp", [False, True])
def test_saved_tensor_hooks_around_a_graphed_block_see_what_the_plain_branches_save(amp):
    # Under saved-tensor hooks a graphed block runs eagerly (its graphs save nothing autograd
    # could hand the hooks): they pack and unpack what the plain branches do, once each.
    branches = _mlp(3)
    reference = _Cat(copy.deepcopy(branches)).cuda()
    block = _graphed(branches)
    for step in range(3):
        x = torch.randn(8, 64, device="cuda", requires_grad=True) * 1  # (see the test above)
        counts, grads = [], []
        for model in (block, reference):
            packed, unpacked = [], []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t,
                                                          lambda t: unpacked.append(1) or t):
                with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                    out = model(x)
                before = len(unpacked)
                grads.append((out, *torch.autograd.grad(out.float().square().sum(), [x, *model.parameters()])))
            counts.append((len(packed), before, len(unpacked)))
        assert counts[0] == counts[1] and counts[0][1] == 0 and counts[0][0] == counts[0][2], counts
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b)
        # Between them, calls without hooks replay the graph.
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            out = block(x)
        torch.testing.assert_close(out, grads[1][0])
        out.float().sum().backward()
    assert block._graphs.captures == 1


_GRAPH_OPTIMIZERS = {
    "adam-fused": lambda g: torch.optim.Adam(g, fused=True, weight_decay=0.01),
    "adamw-foreach-maximize": lambda g: torch.optim.AdamW(g, foreach=True, maximize=True, weight_decay=0.1),
    "adam-capturable": lambda g: torch.optim.Adam(g, capturable=True, foreach=True, amsgrad=True),
    "sgd-fused-momentum": lambda g: torch.optim.SGD(g, fused=True, momentum=0.9, nesterov=True),
}


@cuda
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("make", list(_GRAPH_OPTIMIZERS.values()), ids=list(_GRAPH_OPTIMIZERS))
def test_optimizers_train_a_graphed_block_as_eager(make, direct, fuse):
    # (Session 85's training hunt; written on a machine without a GPU.) Fused and multi-tensor
    # CUDA optimizers (capturable Adam keeps its step on the GPU) read the gradients a graphed
    # backward lent to .grad and write the weights its next replay reads: with a learning rate
    # per branch that a scheduler changes, clipping, .grad set to None or kept at zero between
    # steps, and an EMA copy of the whole block, as eager.
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    branches = _mlp(3)
    reference = nn.ModuleList(copy.deepcopy(branches)).cuda()
    block = _graphed(branches, direct_grads=direct, fuse=fuse)
    tol = dict(rtol=1e-4, atol=1e-5) if fuse else {}  # (a batched product sums in another order)

    def groups(members):
        return [{"params": list(m.parameters()), "lr": 0.01 * (i + 1)} for i, m in enumerate(members)]

    opt, opt_ref = make(groups(block)), make(groups(reference))
    scheds = [torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5) for o in (opt, opt_ref)]
    ema, ema_ref = (AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9)) for m in (block, reference))
    for step in range(5):
        x = torch.randn(8, 64, device="cuda")
        for o in (opt, opt_ref):
            o.zero_grad(set_to_none=step % 3 != 1)
        out, out_ref = block(x), _reference(reference, x)
        torch.testing.assert_close(out, out_ref, **tol)
        out.square().mean().backward()
        out_ref.square().mean().backward()
        for m in (block, reference):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, foreach=True)
        for p, p_ref in zip(block.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, **tol)
        opt.step(), opt_ref.step()
        for s in scheds:
            s.step()
        ema.update_parameters(block), ema_ref.update_parameters(reference)
        for p, p_ref in zip(block.parameters(), reference.parameters()):
            torch.testing.assert_close(p, p_ref, **tol)
    for p, p_ref in zip(ema.parameters(), ema_ref.parameters()):
        torch.testing.assert_close(p, p_ref, **tol)
    assert block._graphs.captures >= 1
