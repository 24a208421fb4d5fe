"""``Parallel`` with branches placed on two GPUs (``parallel_modules/_placement.py``).

Multi-GPU tests compare every result bit-for-bit (fp32, TF32 off in ``conftest.py``) with
running each branch on its own device one after the other:
``branch(x.to(branch_device)).to(x.device)``, joined as the plain expression would join
them. Gradients upstream of the fork are compared within fp32 rounding (rtol=1e-5,
atol=1e-6): the autograd engine adds the branches' contributions in whatever order its
per-device threads deliver them, in the reference too (and parameters follow them after
the first step). Delay tests use ``torch.cuda._sleep`` so that a missing event wait or
join would almost surely let a kernel read data before it is written.
"""

from __future__ import annotations

import copy
import gc
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from parallel_modules import Parallel
from parallel_modules import _streams
from tests._reference import assert_close, assert_same, join_reference, reference
from tests._helpers import SlowGrad, Sleepy

# ~50-70 ms of GPU clock cycles on an H100/H200: far longer than the CPU needs to enqueue
# what follows, so work that should have waited runs too early.
SLEEP = 100_000_000
D0, D1 = torch.device("cuda", 0), torch.device("cuda", 1)
pytestmark = [pytest.mark.cuda, pytest.mark.multigpu]


def mlp(i: int = 32, o: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, 32), nn.GELU(), nn.Linear(32, o))


def _home(module: nn.Module, default: torch.device) -> torch.device:
    devices = {t.device for t in [*module.parameters(), *module.buffers()]}
    return next(iter(devices)) if len(devices) == 1 else default


def _move(value: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def placed_reference(module: nn.Module, x: torch.Tensor) -> Any:
    r"""Each branch on its own device, one after the other, outputs back on ``x``'s device."""
    if not isinstance(module, Parallel):
        return reference(module, x)  # single-device blocks inside, unrolled
    names = [n for n, _ in module.named_children()]
    outs = []
    for branch in module:
        home = _home(branch, x.device)
        outs.append(_move(placed_reference(branch, x.to(home)), x.device))
    return join_reference(module.join, module.dim, names, outs)




class Probe(nn.Module):
    r"""Records the current device and stream its forward runs on."""

    def __init__(self, inner: nn.Module, log: list) -> None:
        super().__init__()
        self.inner, self.log = inner, log

    def forward(self, x):
        self.log.append((torch.cuda.current_device(), torch.cuda.current_stream(), x.device))
        return self.inner(x)


STREAMS: list = []  # the streams SlowGrad(streams=STREAMS) slept on


# ----------------------------------------------------------- two GPUs: values
def _two_device_block(join: str = "cat", streams: Any = "auto") -> Parallel:
    torch.manual_seed(0)
    branches = OrderedDict(
        a=mlp().to(D0),
        b=mlp().to(D1),
        c=nn.Sequential(nn.Linear(32, 16), nn.Tanh()).to(D1),
        act=nn.Tanh(),  # no parameters: runs on the input's device
        d=mlp().to(D0),
    )
    return Parallel(branches, join=join, streams=streams)


@pytest.mark.parametrize("input_device", [0, 1])
@pytest.mark.parametrize("join", ["cat", "sum", "tuple", "dict"])
@pytest.mark.parametrize("streams", [True, "auto", False])
def test_branches_on_two_gpus_bit_exact(join, input_device, streams):
    p = _two_device_block(join, streams)
    if join == "sum":  # needs 16 features from every branch
        p.act = nn.Sequential(nn.Linear(32, 16), nn.Tanh()).to(D1)
    device = torch.device("cuda", input_device)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(64, 32, device=device)
            out = p(x)
            for leaf in pytree.tree_leaves(out):
                assert leaf.device == device
            assert_same(out, placed_reference(p, x))
            assert torch.cuda.current_device() == 0


def test_remote_branches_run_on_their_device_on_distinct_side_streams():
    log_b, log_c, log_a = [], [], []
    p = Parallel(Probe(mlp(), log_a).to(D0), Probe(mlp(), log_b).to(D1), Probe(mlp(), log_c).to(D1),
                 streams=True)
    with torch.no_grad():
        x = torch.randn(8, 32, device=D0)
        assert_same(p(x), placed_reference(p, x))
    (dev_a, stream_a, in_a), (dev_b, stream_b, in_b), (dev_c, stream_c, in_c) = log_a[0], log_b[0], log_c[0]
    assert (dev_a, stream_a, in_a) == (0, torch.cuda.current_stream(D0), D0)  # first local branch: caller's stream
    assert dev_b == dev_c == 1 and in_b == in_c == D1
    assert stream_b.device == stream_c.device == D1
    assert stream_b != stream_c and torch.cuda.default_stream(D1) not in (stream_b, stream_c)
    # Nothing left current: both devices' streams and the current device are restored.
    assert torch.cuda.current_stream(D1) == torch.cuda.default_stream(D1)
    assert torch.cuda.current_stream(D0) == torch.cuda.default_stream(D0)
    assert torch.cuda.current_device() == 0


def test_nested_blocks_across_devices():
    torch.manual_seed(0)
    inner = Parallel(mlp().to(D0), mlp().to(D1), join="sum")  # spans both devices: runs on the input's
    p = Parallel(mlp().to(D1), inner, nn.Sequential(nn.Linear(32, 32).to(D1), Parallel(mlp(), mlp()).to(D1)))
    with torch.no_grad():
        for device in (D0, D1):
            x = torch.randn(16, 32, device=device)
            assert_same(p(x), placed_reference(p, x))


def test_caller_on_side_stream_of_each_device():
    p = _two_device_block()
    s0, s1 = torch.cuda.Stream(D0), torch.cuda.Stream(D1)
    with torch.no_grad():
        p(torch.randn(8, 32, device=D0))
        # (Entering a stream context also makes its device current: s0 last, so cuda:0.)
        with torch.cuda.stream(s1), torch.cuda.stream(s0):
            assert torch.cuda.current_device() == 0
            base = torch.randn(64, 32, device=D0)
            torch.cuda._sleep(SLEEP)  # on s0: the input below is produced late
            x = base * 2
            out = p(x)
            assert torch.cuda.current_stream(D0) == s0 and torch.cuda.current_stream(D1) == s1
            assert torch.cuda.current_device() == 0
        torch.cuda.synchronize(D0)
        torch.cuda.synchronize(D1)
        assert_same(out, placed_reference(p, x))


# ---------------------------------------------------------- two GPUs: delays
def test_delay_before_input_producer():
    p = _two_device_block(streams=True)
    with torch.no_grad():
        p(torch.randn(8, 32, device=D0))
        base = torch.randn(64, 32, device=D0)
        torch.cuda._sleep(SLEEP)
        x = base + 1  # produced on the caller's stream after the sleep: the copy to cuda:1 must wait
        out = p(x)
        assert_same(out, placed_reference(p, x))


def _scribble_on_side_streams(device: torch.device, shape, count: int = 8) -> list[torch.Tensor]:
    r"""Allocate and fill tensors on every side stream of ``device``, waiting for nothing.

    A block freed to a side stream's pool is handed out again here; if the (delayed)
    caller's stream is still to read it, the fill overwrites it first.
    """
    junk = []
    for s in _streams._pool(device).streams:
        with torch.cuda.stream(s):
            junk += [torch.full(shape, 1e4, device=device) for _ in range(count)]
    return junk


@pytest.mark.parametrize("join", ["cat", "tuple"])
def test_delay_inside_branches_and_allocator_reuse_of_gathered_outputs(join):
    torch.manual_seed(0)
    # The local branch keeps the caller's stream busy twice as long as the remote one: the
    # output gathered from cuda:1 (allocated on a side stream of cuda:0) is ready long
    # before the caller's stream reads it, and must not be handed out again meanwhile.
    p = Parallel(Sleepy(mlp(), 2 * SLEEP).to(D0), Sleepy(mlp()).to(D1), join=join, streams=True)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(64, 32, device=D0)
            expected = placed_reference(p, x)
            torch.cuda.synchronize()
            out = p(x)
            total = [o * 1 for o in out] if join == "tuple" else out * 1  # on the caller's stream
            del out
            junk = _scribble_on_side_streams(D0, (64, 16))
            torch.cuda.synchronize()
            assert_same(total, list(expected) if join == "tuple" else expected)
            del junk


def test_parameter_update_on_remote_device_before_call_is_seen():
    torch.manual_seed(0)
    p = Parallel(mlp().to(D0), mlp().to(D1), streams=True)
    x = torch.randn(64, 32, device=D0)
    with torch.no_grad():
        p(x)
        with torch.cuda.device(D1):
            torch.cuda._sleep(SLEEP)  # cuda:1's current stream is busy, then updates the weights
            for q in p[1].parameters():
                q.mul_(0.5).add_(0.25)
        out = p(x)
        torch.cuda.synchronize()
        assert_same(out, placed_reference(p, x))


def test_remote_device_stream_waits_for_branch_before_later_writes():
    torch.manual_seed(0)
    p = Parallel(mlp().to(D0), Sleepy(mlp()).to(D1), streams=True)
    x = torch.randn(64, 32, device=D0)
    with torch.no_grad():
        p(x)
        expected = placed_reference(p, x)
        torch.cuda.synchronize()
        out = p(x)  # the branch on cuda:1 sleeps, then reads its weights
        for q in p[1].parameters():  # written on cuda:1's current stream right away
            q.add_(100.0)
        torch.cuda.synchronize()
        assert_same(out, expected)


# ------------------------------------------------------------- two GPUs: grads
def test_gradients_across_devices_with_delay_in_remote_backward():
    torch.manual_seed(0)
    trunk = nn.Linear(32, 32).to(D0)
    block = Parallel(OrderedDict(
        a=mlp().to(D0),
        b=nn.Sequential(nn.Linear(32, 32), SlowGrad(SLEEP, STREAMS), nn.GELU(), nn.Linear(32, 16)).to(D1),
        c=mlp().to(D1),
    ), join="cat", streams=True)
    head = nn.Linear(48, 4).to(D0)
    model = nn.Sequential(trunk, nn.ReLU(), block, head)
    ref = copy.deepcopy(model)
    ref[2].b[1].streams = STREAMS  # (deepcopy copied the list: both note their streams in the one list)

    def ref_forward(x):  # the model written out: each branch on its device, one after the other
        h = torch.relu(ref[0](x))
        rb = ref[2]
        outs = [rb.a(h), rb.b(h.to(D1)).to(D0), rb.c(h.to(D1)).to(D0)]
        return ref[3](torch.cat(outs, 1))

    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref))
    STREAMS.clear()
    for step in range(3):
        x = torch.randn(32, 32, device=D0, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        out, expected = model(x), ref_forward(xr)
        if step == 0:
            assert_same(out, expected)  # same parameters, same kernels
        assert_close(out, expected)
        w = torch.randn_like(out)
        (out * w).sum().backward()
        (expected * w).sum().backward()
        assert_close(x.grad, xr.grad)
        for (name, q), r in zip(model.named_parameters(), ref.parameters()):
            assert q.grad.device == q.device, name
            if step == 0 and not name.startswith("0."):  # downstream of the fork: one order of sums
                assert_same(q.grad, r.grad)
            assert_close(q.grad, r.grad)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for q, r in zip(model.parameters(), ref.parameters()):
        assert_close(q, r)
    # The delayed backward ran on the remote branch's side stream (the model's) and on
    # cuda:1's default stream (the reference's).
    assert len(STREAMS) == 6
    model_streams, ref_streams = STREAMS[0::2], STREAMS[1::2]
    assert all(s.device == D1 and s != torch.cuda.default_stream(D1) for s in model_streams)
    assert all(s == torch.cuda.default_stream(D1) for s in ref_streams)



@pytest.mark.parametrize("join", ["sum", "mean"])
def test_a_join_of_remote_branches_holds_its_gradients(join, monkeypatch):
    # Before: with one branch on the input's device or none, the call ran no fork of
    # _streams' own and noted none, so the join's gradient -- read on the lanes by the
    # remote outputs' copies beside the local branch on the caller's stream -- was not held.
    held = []
    hold = _streams._hold_gradients

    def counted(grads, outs):  # (returns None, as a post-hook that leaves the gradients as they are must)
        held.append(len(grads))
        hold(grads, outs)

    monkeypatch.setattr(_streams, "_hold_gradients", counted)
    torch.manual_seed(0)
    block = Parallel(OrderedDict(a=mlp().to(D0), b=mlp().to(D1), c=mlp().to(D1)), join=join, streams=True)
    ref = copy.deepcopy(block)
    x = torch.randn(8, 32, device=D0)
    out = block(x)
    outs = [ref.a(x), ref.b(x.to(D1)).to(D0), ref.c(x.to(D1)).to(D0)]
    expected = sum(outs) / (1 if join == "sum" else 3)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    (expected * w).sum().backward()
    assert held  # (the join's own nodes: its adds, each handing its gradient to both sides)
    for (name, q), r in zip(block.named_parameters(), ref.parameters()):
        torch.testing.assert_close(q.grad, r.grad, msg=name)


# ------------------------------------------------------------ two GPUs: errors
def test_exception_in_remote_branch_names_it_and_module_keeps_working():
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 16)
            self.fail = True

        def forward(self, x):
            y = self.lin(x)
            if self.fail:
                raise ValueError("boom")
            return y

    flaky = Flaky().to(D1)
    p = Parallel(OrderedDict(a=mlp().to(D0), flaky=flaky, c=mlp().to(D1)), streams=True)
    x = torch.randn(8, 32, device=D0)
    with pytest.raises(ValueError) as ei:
        p(x)
    text = str(ei.value) + "".join(getattr(ei.value, "__notes__", []))
    assert "'flaky'" in text and "Parallel" in text
    assert torch.cuda.current_stream(D0) == torch.cuda.default_stream(D0)
    assert torch.cuda.current_stream(D1) == torch.cuda.default_stream(D1)
    assert torch.cuda.current_device() == 0
    flaky.fail = False
    with torch.no_grad():
        assert_same(p(x), placed_reference(p, x))


def test_cpu_input_refused_naming_devices():
    p = _two_device_block()
    with pytest.raises(RuntimeError) as ei:
        p(torch.randn(8, 32))
    msg = str(ei.value)
    assert "cuda:0" in msg and "cuda:1" in msg and "on cpu" in msg
    x = torch.randn(8, 32, device=D0)
    with torch.no_grad():
        assert_same(p(x), placed_reference(p, x))


def test_cuda_graph_refused_naming_module_and_devices():
    p = _two_device_block()
    p.cuda_graph = True
    x = torch.randn(8, 32, device=D0)
    for _ in range(2):
        with pytest.raises(RuntimeError) as ei:
            p(x)
        msg = str(ei.value)
        assert "Parallel" in msg and "cuda_graph=True" in msg and "cuda:0" in msg and "cuda:1" in msg
    p.cuda_graph = False  # the block keeps working eagerly
    with torch.no_grad():
        assert_same(p(x), placed_reference(p, x))


def test_cuda_graph_with_fallback_runs_placed_branches_eagerly():
    # graph_fallback=True: a signature that cannot be captured runs eagerly with one
    # warning -- branches on two devices too, as they run with cuda_graph=False.
    p = _two_device_block()
    p.cuda_graph, p.graph_fallback = True, True
    with torch.no_grad(), pytest.warns(UserWarning, match="several CUDA devices") as record:
        for _ in range(3):
            x = torch.randn(8, 32, device=D0)
            assert_same(p(x), placed_reference(p, x))
    assert len([w for w in record if "graph_fallback=True" in str(w.message)]) == 1


def test_graphed_block_per_device_inside_a_placed_block():
    torch.manual_seed(0)
    p = Parallel(
        Parallel(mlp(), mlp(), join="sum", cuda_graph=True).to(D0),
        Parallel(mlp(), mlp(), join="sum", cuda_graph=True).to(D1),
        join="cat",
    )
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(16, 32, device=D0)
            assert_same(p(x), placed_reference(p, x))
    assert p[0]._graphs.captures == 1 and p[1]._graphs.captures == 1


# ----------------------------------------------------- two GPUs: compile, memory
def test_compile_traces_plain_copies():
    torch._dynamo.reset()
    p = _two_device_block()
    compiled = torch.compile(p, backend="eager", fullgraph=True)
    with torch.no_grad():
        x = torch.randn(8, 32, device=D0)
        assert_same(compiled(x), placed_reference(p, x))
    torch._dynamo.reset()


def _settled_memory(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    gc.collect()
    torch.empty(1, device=device)  # lets the allocator process finished record_stream events
    return torch.cuda.memory_allocated(device)


def test_memory_and_streams_flat_over_many_calls():
    p = _two_device_block(streams=True)
    x = torch.randn(16, 32, device=D0)
    with torch.no_grad():
        for _ in range(20):
            p(x)
        base = (_settled_memory(D0), _settled_memory(D1), _streams._stream_count())
        for _ in range(500):
            y = p(x)
        del y
    assert (_settled_memory(D0), _settled_memory(D1), _streams._stream_count()) == base
