"""ParallelSequential on CUDA: stream ordering, host-to-device overlap, memory, sanitizer.

Outputs computed on the same micro-batches are compared bit-for-bit (fp32, TF32
off in ``conftest.py``); against ``nn.Sequential`` on the whole batch, which may
pick other kernels for the other batch size, within ``RTOL``/``ATOL``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import subprocess
import sys
import warnings
import weakref
from unittest import mock
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from parallel_modules import Parallel, ParallelSequential, pipeline
from parallel_modules._streams import _pool, _stream_count
from tests._helpers import SlowGrad, assert_same_backward

pytestmark = pytest.mark.cuda

RTOL, ATOL = 1e-5, 1e-5
# About 1 ms on current GPUs: long enough that a missing wait lets the next
# kernel run on data that is not there yet.
SLEEP = 2_000_000
ROOT = Path(__file__).resolve().parent.parent


class Sleep(nn.Module):
    """Identity that first keeps the current stream busy."""

    def __init__(self, cycles: int = SLEEP) -> None:
        super().__init__()
        self.cycles = cycles

    def forward(self, x):
        torch.cuda._sleep(self.cycles)
        return x


def _model(chunks: int, sleep_in: int | None = None) -> ParallelSequential:
    stages = [
        nn.Sequential(nn.Linear(32, 64), nn.GELU()),
        nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU()),
        nn.Linear(64, 16),
    ]
    if sleep_in is not None:
        stages[sleep_in] = nn.Sequential(Sleep(), stages[sleep_in])
    return ParallelSequential(*stages, chunks=chunks).cuda()


def _pieces_reference(model: nn.Module, x: torch.Tensor, chunks: int) -> torch.Tensor:
    ref = nn.Sequential(*model)
    return torch.cat([ref(p) for p in x.tensor_split(chunks)])


def _host_batch(pinned: bool) -> torch.Tensor:
    x = torch.randn(13, 32)
    return x.pin_memory() if pinned else x


def _assert_clean(caller: torch.cuda.Stream) -> None:
    assert torch.cuda.current_stream() == caller
    assert _pool(torch.device("cuda")).offset == 0


def _gathered(expected: bool):
    r"""Where ``expected``, the last lane concatenates (``_Gather``): the caller's ``_concat`` must not run."""
    if not expected:
        return contextlib.nullcontext()
    return mock.patch.object(ParallelSequential, "_concat", lambda self, outputs: pytest.fail("not gathered"))


# Recording autograd, the caller concatenates the outputs; without, the last lane does.
GRAD = pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])


@GRAD
@pytest.mark.parametrize("chunks", [1, 2, 3, 8])
def test_bitwise_equal_to_sequential_on_pieces(chunks: int, grad: bool) -> None:
    model = _model(chunks)
    for _ in range(3):  # fresh inputs; batch 13 gives uneven pieces
        x = torch.randn(13, 32, device="cuda")
        with torch.set_grad_enabled(grad), _gathered(not grad and chunks > 1):
            out = model(x)
        assert out.requires_grad == grad  # recording autograd: concatenated by the caller, with history
        assert torch.equal(out, _pieces_reference(model, x, chunks))
        torch.testing.assert_close(out, nn.Sequential(*model)(x), rtol=RTOL, atol=ATOL)
    _assert_clean(torch.cuda.default_stream())


@GRAD
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_delay_inside_each_stage(stage: int, grad: bool) -> None:
    # A stage that starts late on every piece: a missing wait lets the next
    # stage read an unfinished piece; a missing join lets the cat read
    # unfinished outputs; a missing record_stream lets the previous stage's
    # next piece overwrite a block the sleeping stage has yet to read.
    model = _model(4, sleep_in=stage)
    for _ in range(2):
        x = torch.randn(13, 32, device="cuda")
        with torch.set_grad_enabled(grad), _gathered(not grad):
            out = model(x)
        assert out.requires_grad == grad
        assert torch.equal(out, _pieces_reference(model, x, 4))


def test_delay_before_producer_on_non_default_caller_stream() -> None:
    model = _model(3)
    base = torch.randn(13, 32, device="cuda")
    expected = _pieces_reference(model, base, 3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x = torch.full_like(base, float("nan"))
            torch.cuda._sleep(SLEEP)  # the input is produced late, on the caller's stream
            x.copy_(base)
            out = model(x)
            _assert_clean(side)
            # Consumer right away, on the same stream.
            assert torch.equal(out, expected)
    torch.cuda.current_stream().wait_stream(side)


@GRAD
@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_host_to_device(pinned: bool, chunks: int, grad: bool) -> None:
    # (Pinned: the copy lane is issued whole before the stages.)
    model = _model(chunks, sleep_in=0)
    for _ in range(2):
        x = _host_batch(pinned)
        expected = model(x.cuda())
        torch.cuda._sleep(SLEEP)  # delays the copies: they fork from the caller's stream
        with torch.set_grad_enabled(grad), _gathered(not grad and chunks > 1):
            out = model(x)
        assert out.device.type == "cuda"
        if pinned:
            # As after x.to("cuda", non_blocking=True): the copies may still be
            # queued, but freeing the input is safe -- its pinned block is not
            # handed out again before they ran.
            del x
            junk = [torch.full((13, 32), float("nan")).pin_memory() for _ in range(4)]
            del junk
        else:
            # A pageable input was staged during the call: overwriting it is safe at once.
            x.fill_(float("nan"))
        assert torch.equal(out, expected)
    _assert_clean(torch.cuda.default_stream())


@pytest.mark.parametrize("chunks", [1, 3])
def test_pinned_input_is_asked_once(chunks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each is_pinned() asks the CUDA driver: a pinned input is checked once per call, its
    # pieces not again (a pageable one's pieces are, each staged as it is copied).
    model = _model(chunks, sleep_in=0)
    x, y = _host_batch(True), _host_batch(False)
    expected, expected_y = model(x.cuda()), model(y.cuda())
    asked = []
    is_pinned = torch.Tensor.is_pinned

    def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        asked.append(tuple(self.shape))
        return is_pinned(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "is_pinned", counting)
    assert torch.equal(model(x), expected)
    assert asked == [tuple(x.shape)]
    if chunks > 1:  # and the pieces the copy lane took for pinned are (recording autograd too)
        monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
        copied = []
        to_device = pipeline._to_device
        monkeypatch.setattr(pipeline, "_to_device", lambda v, *a, **k: copied.append(v.is_pinned()) or to_device(v, *a, **k))
        with torch.enable_grad():
            assert torch.equal(model(x), expected)
        assert copied == [True] * chunks
        monkeypatch.setattr(pipeline, "_to_device", to_device)
        monkeypatch.setattr(torch.Tensor, "is_pinned", counting)
    asked.clear()
    assert torch.equal(model(y), expected_y)
    assert len(asked) == 1 + (chunks if chunks > 1 else 0)


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_host_input_graphed_per_stage(pinned: bool, chunks: int) -> None:
    # cuda_graph=True with a CPU input: copies eager, each stage replayed per micro-batch.
    eager = _model(chunks, sleep_in=0)
    model = ParallelSequential(*copy.deepcopy(list(eager)), chunks=chunks, cuda_graph=True)
    kept = []
    with torch.no_grad():
        for _ in range(4):
            x = _host_batch(pinned)
            expected = eager(x.cuda())
            torch.cuda._sleep(SLEEP)  # delays the copies: they fork from the caller's stream
            with _gathered(chunks > 1):
                out = model(x)
            _assert_clean(torch.cuda.default_stream())
            assert torch.equal(out, expected)
            kept.append((out, expected))  # a later call must not overwrite an output still held
    # One graph per stage and micro-batch size (13 in 3 pieces: 5, 4, 4), none of the whole call.
    sizes = len({p.shape[0] for p in torch.empty(13).tensor_split(chunks)})
    assert [c.captures for c in model._per_stage.values()] == [sizes] * 3
    assert model._graphs.captures == 0
    for out, expected in kept:
        assert torch.equal(out, expected)
    # A new stage object gets graphs of its own; a .to() that moves them forgets them all
    # (one that moves nothing keeps them).
    model[2] = copy.deepcopy(eager[2])
    with torch.no_grad():
        assert torch.equal(model(x), eager(x.cuda()))
    assert model._per_stage["2"]._owner() is model[2]
    model.to(torch.device("cuda"))
    assert len(model._per_stage) == 3
    model.to(torch.float64)
    assert model._per_stage == {}


def test_host_input_graphed_training_runs_eagerly() -> None:
    model = _model(3)
    model.cuda_graph = True
    ref = copy.deepcopy(model)
    ref.cuda_graph = False
    x = torch.randn(13, 32)
    with pytest.warns(UserWarning, match="training cannot use"):
        model(x).square().sum().backward()
    ref(x).square().sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad)
    assert model._per_stage == {} and model._graphs.captures == 0


class _Item(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum().item() > -1e30 else x  # a host sync: cannot be captured


def test_host_input_graphed_capture_failure_names_the_stage() -> None:
    model = ParallelSequential(nn.Linear(8, 8), _Item(), chunks=2, cuda_graph=True).cuda()
    x = torch.randn(4, 8)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"ParallelSequential stage '1': CUDA graph capture failed"):
            model(x)
        _assert_clean(torch.cuda.default_stream())
        expected = nn.Sequential(*model)(x.cuda())
        model.cuda_graph = False  # eager calls still work afterwards
        assert torch.equal(model(x), expected)
        fallback = ParallelSequential(*model, chunks=2, cuda_graph=True, graph_fallback=True)
        with pytest.warns(UserWarning, match="graph_fallback=True"):
            assert torch.equal(fallback(x), expected)
        assert torch.equal(fallback(x), expected)


class _LayoutBySize(nn.Module):
    def forward(self, x):
        # Contiguous for 5 samples, transposed for fewer: the last lane takes the
        # first micro-batch of 13 in 3 (5, 4, 4) into the result, then gives up.
        return x * 2 if x.shape[0] == 5 else (x * 2).t().contiguous().t()


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_gather_gives_up_after_taking_a_piece(graphed: bool) -> None:
    model = ParallelSequential(nn.Linear(8, 8), _LayoutBySize(), chunks=3, cuda_graph=graphed).cuda()
    reference = nn.Sequential(*model)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(13, 8)
            expected = torch.cat([reference(p) for p in x.cuda().tensor_split(3)])
            assert torch.equal(model(x if graphed else x.cuda()), expected)


class _Queries(nn.Module):
    r"""Returns its buffer, whatever the input: the same tensor from every micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("q", torch.randn(4, 5))

    def forward(self, x):
        return self.q


@pytest.mark.parametrize("host_input", [False, True])
def test_the_same_tensor_from_every_micro_batch_is_not_gathered(host_input: bool) -> None:
    # Before: the last lane copied it into a result of 8 rows as if batched, where
    # nn.Sequential returns it (4 rows).
    stage = _Queries().cuda()
    model = ParallelSequential(nn.Linear(8, 8), stage, chunks=2).cuda()
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(8, 8)
            assert model(x if host_input else x.cuda()) is stage.q


class _Outlives(nn.Module):
    r"""Doubles its input, and records at each call how many of its earlier outputs are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []
        self.alive: list[int] = []

    def forward(self, x):
        gc.collect()
        self.alive.append(sum(r() is not None for r in self.made))
        out = x * 2
        self.made.append(weakref.ref(out))
        return out


def test_gathered_pieces_are_let_go_as_they_are_taken() -> None:
    # Before: each micro-batch's output was kept until the call's end (for the checks of
    # outputs written again, which a piece copied into the result as it came needs not), so
    # the last lane's pieces were all alive at once, and a graphed last stage saw its
    # output still held and copied the next instead of lending it.
    stage = _Outlives()
    model = ParallelSequential(nn.Linear(8, 8), stage, chunks=4).cuda()
    with torch.no_grad(), _gathered(True):
        out = model(x := torch.randn(16, 8, device="cuda"))
    assert stage.alive == [0, 0, 0, 0]
    assert torch.equal(out, torch.cat([model[0](p) * 2 for p in x.tensor_split(4)]))


class _TableRows(nn.Module):
    r"""Returns a new view of the first rows of its table, as many as its input's dimension 1."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(16, 4))

    def forward(self, x):
        return self.table[: x.shape[1]]


def test_one_view_of_a_table_with_the_first_micro_batchs_rows_is_returned_as_nn_sequential_does() -> None:
    # Micro-batches of 3 and 2 samples each return table[:3]: the last lane took the first into
    # the result, as if batched, then gave up at the second; the concatenation then got back
    # the copy, not the table's memory, and refused it as not batched. Now the view itself.
    stage = _TableRows().cuda()
    model = ParallelSequential(nn.Identity(), stage, chunks=2).cuda()
    with torch.no_grad():
        out = model(torch.randn(5, 3, 4, device="cuda"))
    assert out.shape == (3, 4) and out.data_ptr() == stage.table.data_ptr()


class _WritesItsBuffer(nn.Module):
    r"""Returns its buffer, written with each micro-batch's values: the same tensor from every one."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("out", torch.zeros(4, 8))

    def forward(self, x):
        return torch.mul(x, 2, out=self.out)


def test_the_same_tensor_written_by_every_micro_batch_is_refused_after_the_gather_took_it() -> None:
    # The last lane copies micro-batch 0's output into the result, then gives up at micro-batch 1's,
    # the same tensor: the concatenation gets it back, and must see that it was written since.
    model = ParallelSequential(nn.Linear(8, 8), _WritesItsBuffer(), chunks=2).cuda()
    with torch.no_grad(), pytest.raises(ValueError, match="written again since micro-batch 0 returned it"):
        model(torch.randn(8, 8, device="cuda"))
    assert torch.equal(model[1](torch.ones(4, 8, device="cuda")), torch.full((4, 8), 2.0, device="cuda"))


class ToHost(nn.Module):
    """Copies its input to the host without blocking, behind a delay on its stream."""

    def forward(self, x):
        torch.cuda._sleep(5 * SLEEP)
        return x.to("cpu", non_blocking=True)


@pytest.mark.parametrize("grad", [False, True])
def test_last_stage_copying_to_the_host_without_blocking(grad: bool) -> None:
    # nn.Sequential hands such a result back for the caller to synchronize on; micro-batches
    # are concatenated on the host first, which must wait for the lanes' copies.
    lin = nn.Linear(32, 32).cuda()
    model = ParallelSequential(lin, ToHost(), chunks=4)
    for _ in range(2):
        x = torch.randn(16, 32, device="cuda")
        with torch.no_grad():
            expected = torch.cat([lin(p).cpu() for p in x.tensor_split(4)])
        with torch.set_grad_enabled(grad):
            out = model(x)
        torch.cuda.synchronize()
        assert out.device.type == "cpu" and torch.equal(out.detach(), expected)


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
def test_host_input_requiring_grad_through_frozen_graphed_stages(pinned: bool) -> None:
    # Saliency maps: only the input requires grad. Stage graphs replayed micro-batch after
    # micro-batch would overwrite what each one's backward needs: such calls run eagerly.
    model = _model(2).requires_grad_(False)
    graphed = copy.deepcopy(model)
    graphed.cuda_graph = True
    for _ in range(2):
        x = torch.randn(8, 32)
        grads = []
        for m in (model, graphed):
            leaf = (x.pin_memory() if pinned else x.clone()).requires_grad_()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m(leaf).square().sum().backward()
            grads.append(leaf.grad)
        assert torch.equal(grads[0], grads[1])


def test_host_to_device_structured_input() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, ab):
            return self.lin(ab["a"]) + ab["b"]

    model = ParallelSequential(Two(), nn.ReLU(), chunks=2).cuda()
    a, b = torch.randn(6, 8), torch.randn(6, 4).pin_memory()
    expected = model({"a": a.cuda(), "b": b.cuda()})
    assert torch.equal(model({"a": a, "b": b}), expected)


class _Fields(dict):
    r"""A dict of the user's class, which pytree keeps whole."""


class _Rows(list):
    r"""A list of the user's class, with a batched tensor kept in an attribute."""


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("chunks", [1, 2])
def test_host_to_device_input_in_a_container_of_the_users_class(chunks: int, pinned: bool) -> None:
    # Before: the CPU tensors of a dict or list subclass were not seen (pytree keeps such
    # containers whole), so the input was not copied in, and the first stage failed on
    # tensors of two devices; a dict of the same tensors is copied in. Now both are.
    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, v):
            return self.lin(v["a"][0]) * v["a"].mask + v["b"]

    model = ParallelSequential(Reads(), nn.ReLU(), chunks=chunks).cuda()
    a, m, b = torch.randn(6, 8), torch.randn(6, 4), torch.randn(6, 4)
    if pinned:
        a, m, b = a.pin_memory(), m.pin_memory(), b.pin_memory()

    def make(device: str | None) -> _Fields:
        rows = _Rows([a.to(device)])
        rows.mask = m.to(device)
        return _Fields(a=rows, b=b.to(device))

    expected = model(make("cuda"))
    assert torch.equal(model(make(None)), expected)


def test_gradients_several_iterations() -> None:
    model = _model(3)
    ref_model = copy.deepcopy(model)
    ref = nn.Sequential(*ref_model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for _ in range(4):
        x = torch.randn(13, 32, device="cuda")
        assert_same_backward(model, ref, x, RTOL, ATOL)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()


def test_gradients_from_host_input() -> None:
    model = _model(3)
    x = torch.randn(13, 32)
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x.cuda()).sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=RTOL, atol=ATOL)


def test_nested_parallel_stage_with_delays() -> None:
    block = Parallel(
        nn.Sequential(Sleep(), nn.Linear(64, 8)), nn.Sequential(nn.Linear(64, 8), Sleep()), join="cat", streams=True
    )
    model = ParallelSequential(nn.Sequential(nn.Linear(32, 64), nn.GELU()), block, Sleep(), chunks=4).cuda()
    x = torch.randn(13, 32, device="cuda")
    assert torch.equal(model(x), _pieces_reference(model, x, 4))
    _assert_clean(torch.cuda.default_stream())


def _settled_allocated() -> int:
    # Blocks freed while another stream still used them (record_stream) are
    # released by the allocator's next malloc once that stream has passed.
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")
    return torch.cuda.memory_allocated()


def test_memory_and_streams_flat() -> None:
    # Garbage earlier tests left in reference cycles, holding device memory, must not be
    # collected in the middle of the readings: on the two-GPU machine a collection freed
    # 466 KiB between two of them, a drop that read as jitter above the allowance.
    gc.collect()
    model = _model(3)
    x_dev = torch.randn(13, 32, device="cuda")
    x_host = torch.randn(13, 32)
    seen: list[tuple[int, int]] = []
    for i in range(500):
        with torch.no_grad():
            out = model(x_dev if i % 2 else x_host)
        del out
        if i % 2 == 0:
            model(x_dev).sum().backward()
            model.zero_grad(set_to_none=True)
        if i >= 20 and i % 40 == 0:
            seen.append((_settled_allocated(), _stream_count()))
    # No stream growth at all. Memory: no growth; a reading may still count one
    # small block whose reuse waits on an event recorded for another stream
    # (seen on the H100: 5 KiB either way), so allow 64 KiB of jitter.
    assert len({streams for _, streams in seen}) == 1, seen
    allocated = [a for a, _ in seen]
    assert max(allocated) - min(allocated) <= 64 * 1024, seen
    assert allocated[-1] <= allocated[0] + 64 * 1024, seen


def test_stream_error_leaves_module_usable() -> None:
    class Boom(nn.Module):
        armed = True

        def forward(self, x):
            if self.armed and x.shape[0] == 4:  # the last pieces of 13 in 3
                raise ValueError("boom")
            return x

    boom = Boom()
    model = ParallelSequential(OrderedDict(a=nn.Linear(32, 32), b=nn.Sequential(Sleep(), boom)), chunks=3).cuda()
    x = torch.randn(13, 32, device="cuda")
    with pytest.raises(ValueError) as info:
        model(x)
    assert "stage 'b' (index 1) on micro-batch 1 of 3" in "\n".join(info.value.__notes__)
    _assert_clean(torch.cuda.default_stream())
    boom.armed = False
    assert torch.equal(model(x), _pieces_reference(model, x, 3))


def _run_sanitizer(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_sanitizer_pipeline.py"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def test_clean_under_stream_sanitizer() -> None:
    result = _run_sanitizer()
    assert result.returncode == 0, result.stderr[-4000:]
    assert "CSAN" not in result.stderr, result.stderr[-4000:]


def test_sanitizer_catches_a_missing_wait() -> None:
    # Proves the harness: with stream waits disabled the sanitizer must fail the run.
    result = _run_sanitizer("--broken")
    assert result.returncode != 0 and "CSAN" in result.stderr, result.stderr[-4000:]


def test_stage_deleted_by_attribute_is_not_replayed() -> None:
    # ``del pipe.name`` registers nothing: the graphs captured with the stage must go.
    model = ParallelSequential(OrderedDict(a=nn.Linear(32, 32), b=nn.Linear(32, 32), c=nn.ReLU()),
                               chunks=2, cuda_graph=True).cuda()
    x = torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        model(x)
        model(x)
        del model.b
        assert torch.equal(model(x), model.c(model.a(x)))


class _Probe(nn.Module):
    r"""Identity that notes the streams its forward runs on."""

    def __init__(self, seen: set) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x):
        self.seen.add(torch.cuda.current_stream().stream_id)
        return x * 1.0


def test_parallel_stages_fork_onto_streams_of_their_own() -> None:
    # The Parallel stages of two lanes took the same slots: their side branches shared a
    # stream, and one lane's work waited for the other's joins, which stopped pipelining.
    seen = [set(), set()]
    model = ParallelSequential(Parallel(nn.Identity(), _Probe(seen[0]), streams=True),
                               Parallel(nn.Identity(), _Probe(seen[1]), streams=True), chunks=4).cuda()
    x = torch.randn(8, 4, device="cuda")
    with torch.no_grad():
        out = model(x)
    assert torch.equal(out, torch.cat([x] * 4, 1))
    assert len(seen[0]) == len(seen[1]) == 1, seen  # each lane's nested block: one stream, piece after piece
    assert not seen[0] & seen[1], seen


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_pipeline_gets_the_gradients_of_sequential(reentrant) -> None:
    # Non-reentrant checkpointing recomputes in the backward pass, from the last lane's
    # stream: the lanes before it must get their own streams again (their backward reads
    # what they recompute), the last one joins into it.
    import torch.utils.checkpoint as cp

    torch.manual_seed(0)
    # (The recomputation starts on the last lane's stream; forked from there, the last stage
    # ran on another lane's stream, late, while its backward read its activations.)
    model = ParallelSequential(nn.Linear(256, 1024),
                               nn.Sequential(Sleep(50_000_000), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 64)),
                               chunks=4).cuda()
    plain = nn.Sequential(*copy.deepcopy(list(model)))
    x0, w = torch.randn(2048, 256, device="cuda"), torch.randn(2048, 64, device="cuda")

    def grads(m):
        m.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        (cp.checkpoint(m, x, use_reentrant=reentrant) * w).sum().backward()
        torch.cuda.synchronize()
        return [x.grad] + [p.grad for p in m.parameters()]

    for _ in range(2):
        for g, e in zip(grads(model), grads(plain)):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


class _Batch(dict):
    r"""A dict subclass, which pytree keeps whole: a graph cannot take its tensors as inputs."""


class _Doubles(nn.Module):
    def forward(self, batch):
        return batch["x"] * 2


@pytest.mark.parametrize("make", [lambda: ParallelSequential(_Doubles(), chunks=2, cuda_graph=True, graph_fallback=True),
                                  lambda: Parallel(_Doubles(), _Doubles(), cuda_graph=True, graph_fallback=True)],
                         ids=["ParallelSequential", "Parallel"])
def test_a_dict_subclass_input_is_not_replayed_with_the_tensors_it_was_captured_with(make):
    # Before: its tensors were not seen as the graph's inputs (nor as tensors to record on the
    # streams that read them): a graph captured on the first call's tensors was replayed for
    # later ones, reading the first call's memory. Now refused for capture, run eagerly here.
    model = make().cuda()
    with torch.no_grad(), pytest.warns(UserWarning, match="holds tensors inside a _Batch object"):
        for _ in range(3):
            x = torch.randn(4, 4, device="cuda")
            out = model(_Batch(x=x))
            expected = x * 2 if isinstance(model, ParallelSequential) else torch.cat([x * 2, x * 2], 1)
            assert torch.equal(out, expected)


def test_a_layer_written_into_a_dict_of_children_below_a_graphed_pipeline_is_seen():
    # A layer without tensors written straight into a ``_modules`` dict registers nothing: the
    # pipeline's graphs, captured with the old layer, would replay it. (A Parallel does not look:
    # see _watch.)
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).cuda() for _ in range(3)]
    m = ParallelSequential(*layers, chunks=2, cuda_graph=True).eval()
    with torch.no_grad():
        for _ in range(4):
            m(torch.randn(4, 8, device="cuda"))
        m[0]._modules["1"] = nn.ReLU()
        x = torch.randn(4, 8, device="cuda")
        expected = x
        for layer in m._modules.values():
            expected = layer(expected)
        torch.testing.assert_close(m(x), expected)


@pytest.mark.parametrize("anew", [False, True], ids=["own dict", "dict given anew"])
def test_a_stage_written_into_a_graphed_pipelines_dict_of_stages_is_run(anew):
    # As above, one level up: the pipeline's own dict of stages (the tree no longer holds the
    # pipeline, but still watches its dict), or a dict of stages given anew holding the same
    # stages (the tree kept watching the old dict). Before the fixes the graphs replayed the old ReLU.
    torch.manual_seed(0)
    m = ParallelSequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), chunks=2, cuda_graph=True).cuda().eval()
    if anew:
        m._modules = OrderedDict(m._modules)
    with torch.no_grad():
        for _ in range(4):
            m(torch.randn(4, 8, device="cuda"))
        m._modules["1"] = nn.Tanh()
        x = torch.randn(4, 8, device="cuda")
        torch.testing.assert_close(m(x), nn.Sequential(*m)(x))


class _WritesFirstReadsSecond(nn.Module):
    def forward(self, inputs):
        first, second = inputs
        first.mul_(2)
        return first + second


@pytest.mark.parametrize("grad", [False, True])
def test_input_tensors_sharing_memory_across_micro_batches_are_refused_written_on_the_lanes(grad) -> None:
    # The lanes' path (_pipeline) watches the shared tensors as the CPU's does: a later stage,
    # on its own stream, writing input tensors that share memory across micro-batches is refused.
    pipe = ParallelSequential(nn.Identity(), _WritesFirstReadsSecond(), chunks=2).cuda()
    x = torch.randn(7, 4, device="cuda", requires_grad=grad)
    with torch.set_grad_enabled(grad):
        with pytest.raises(RuntimeError, match=r"stage '1' \(index 1\) wrote in place on micro-batch 0 of 2 "
                                               r"into input\[0\] and input\[1\]"):
            y = x * 1
            pipe((y[:-1], y[1:]))
        y = x * 1
        out = pipe((y[:-1].clone(), y[1:]))
        torch.cuda.synchronize()
        z = x * 1
        torch.testing.assert_close(out, nn.Sequential(*pipe)((z[:-1].clone(), z[1:])), rtol=RTOL, atol=ATOL)


@GRAD
def test_called_from_several_threads_at_once(grad: bool) -> None:
    # Threads share the pool's lane streams but not their events (thread-local, see
    # pipeline._take_events): an event re-recorded by another thread between a record and
    # the wait on it, or one thread's join not covering its own last piece, would let a
    # thread read another's half-written micro-batches. Each thread calls from a stream of
    # its own, and the middle stage starts every piece late.
    import threading

    model = _model(4, sleep_in=1)
    inputs = [torch.randn(13, 32, device="cuda") for _ in range(4)]
    expected = [_pieces_reference(model, x, 4) for x in inputs]
    torch.cuda.synchronize()
    barrier, errors = threading.Barrier(len(inputs)), []

    def work(i: int) -> None:
        try:
            stream = torch.cuda.Stream()
            barrier.wait()
            with torch.cuda.stream(stream), torch.set_grad_enabled(grad):
                for _ in range(3):
                    out = model(inputs[i])
                    assert out.requires_grad == grad
                    assert torch.equal(out, expected[i]), f"thread {i}: wrong output"
        except BaseException as e:  # (re-raised on the main thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
def test_host_to_device_non_contiguous_input(pinned: bool) -> None:
    # A transposed host batch: its micro-batches are not contiguous, so each copy goes
    # through a contiguous host temporary (torch's copy_) instead of the pinned staging
    # buffer or the caller's pinned memory. The copies must still be ordered after the
    # caller's earlier work, and the input overwritten once the call returned (pageable)
    # or freed (pinned, as after x.to("cuda", non_blocking=True)) must not show.
    model = _model(3, sleep_in=0)
    for _ in range(2):
        base = torch.randn(32, 13)
        x = (base.pin_memory() if pinned else base).t()
        assert not x.is_contiguous() and x.is_pinned() == pinned
        with torch.no_grad():
            expected = _pieces_reference(model, x.contiguous().cuda(), 3)
        torch.cuda._sleep(SLEEP)  # delays the copies: they fork from the caller's stream
        with torch.no_grad(), _gathered(True):
            out = model(x)
        if pinned:
            del x, base
            junk = [torch.full((32, 13), float("nan")).pin_memory() for _ in range(4)]
            del junk
        else:
            x.fill_(float("nan"))
        # (Within fp32's tolerance, not bit for bit: on the H200 the two differed in their last
        # bits, by a cause not yet pinned down -- the layout the lane gives each copied piece?;
        # a copy read too early or too late gives NaNs or another batch's rows, far outside it.)
        torch.testing.assert_close(out, expected)
    _assert_clean(torch.cuda.default_stream())


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gradients_with_a_backward_delayed_on_each_lane(stage: int) -> None:
    # Stage ``stage``'s backward starts late on its lane's stream, piece after piece: the
    # earlier stages' backward must wait for the gradients it hands them, and the caller,
    # reading the parameters' .grad and the input's after backward(), for the sums of
    # every piece on every lane.
    model = _model(4)
    model[stage] = nn.Sequential(model[stage], SlowGrad())
    ref_model = copy.deepcopy(model)
    ref = nn.Sequential(*ref_model)
    for _ in range(2):
        x = torch.randn(13, 32, device="cuda")
        assert_same_backward(model, ref, x, RTOL, ATOL)
        model.zero_grad(), ref.zero_grad()


@pytest.mark.parametrize("host", [False, True], ids=["gpu_input", "host_input"])
def test_graphed_pipeline_with_chunks_and_batch_changing_between_calls(host: bool) -> None:
    # Whole-call graphs (GPU input) are captured per signature and dropped when chunks
    # changes; per-stage graphs (host input) are kept per micro-batch size, so a batch of 4
    # at chunks=1 (replayed on the caller's stream) and of 12 at chunks=3 (pieces of 4,
    # replayed on the lanes' streams) share each stage's graph: a replay on a lane must wait
    # for the previous one on the caller's stream and the other way round. Outputs kept
    # across calls must not be overwritten by later replays.
    eager = _model(1, sleep_in=0)
    model = ParallelSequential(*copy.deepcopy(list(eager)), chunks=1, cuda_graph=True)
    kept = []
    with torch.no_grad():
        for chunks, batch in [(1, 4), (3, 12), (1, 4), (3, 12), (2, 12), (3, 9), (3, 12)]:
            model.chunks = eager.chunks = chunks
            x = torch.randn(batch, 32) if host else torch.randn(batch, 32, device="cuda")
            expected = _pieces_reference(eager, x.cuda(), chunks)
            torch.cuda._sleep(SLEEP)  # the caller's stream is busy when the call is issued
            out = model(x)
            _assert_clean(torch.cuda.default_stream())
            assert torch.equal(out, expected), (chunks, batch)
            kept.append((out, expected))
    for out, expected in kept:
        assert torch.equal(out, expected)
    if host:
        assert model._graphs.captures == 0 and model._per_stage
    else:
        assert not model._per_stage
