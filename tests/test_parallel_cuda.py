"""``Parallel`` on CUDA streams: the reliability tests of the design specification (1-3, 5-7, 9).

Every result is compared bit-for-bit with the sequential computation (fp32, TF32 off). The
delay tests use ``torch.cuda._sleep`` (a kernel spinning for a number of GPU clock cycles)
so that, were an event wait or a ``record_stream`` missing, the GPU would almost surely
read data before it is written or after its memory was handed to someone else.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import threading
import traceback
import warnings
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn

from parallel_modules import Parallel
from parallel_modules import _streams
from tests._reference import assert_same, reference
from tests._helpers import Sleepy, sleep_in_backward

pytestmark = pytest.mark.cuda

DEV = "cuda"
# GPU clock cycles: ~50-70 ms on an H100, far longer than the CPU needs to enqueue the
# work that follows. Used a dozen times in this file, so the file stays fast.
SLEEP = 100_000_000


@pytest.fixture(autouse=True)
def _deterministic_cudnn():
    # Convolutions: same algorithm on every stream, so results can be compared bit-for-bit.
    old = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old
        torch.cuda.synchronize()


def mlp(i: int = 64, o: int = 32) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, 64), nn.GELU(), nn.Linear(64, o))


def side_streams() -> list[torch.cuda.Stream]:
    r"""The library's side streams on the current device (created by earlier calls)."""
    return list(_streams._pool(torch.device(DEV)).streams)




class StreamProbe(nn.Module):
    r"""Records the stream its forward runs on under ``name`` in ``log``."""

    def __init__(self, name: str, inner: nn.Module, log: dict) -> None:
        super().__init__()
        self.name, self.inner, self.log = name, inner, log

    def forward(self, x):
        self.log[self.name] = torch.cuda.current_stream()
        return self.inner(x)


def _scribble_on_side_streams(shape, count: int = 8) -> list[torch.Tensor]:
    r"""Allocate and fill tensors on every side stream, without waiting for anything.

    Blocks freed to a side stream's pool are handed out again here; if one is still to be
    read by the (delayed) caller's stream, the fill overwrites it first.
    """
    junk = []
    for s in side_streams():
        with torch.cuda.stream(s):
            junk += [torch.full(shape, 1e4, device=DEV) for _ in range(count)]
    return junk


# ----------------------------------------------------- 1. bit-for-bit equality
@pytest.mark.parametrize("n", [1, 2, 8, 40])
@pytest.mark.parametrize("join", ["cat", "sum"])
def test_many_branches_bit_exact(n, join):
    torch.manual_seed(n)
    p = Parallel(*[mlp() for _ in range(n)], join=join, streams=True).to(DEV)
    caller = torch.cuda.current_stream()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(16, 64, device=DEV)
            out = p(x)
            assert torch.cuda.current_stream() == caller
            assert_same(out, reference(p, x))


def _conv_relu(cin, cout, k):
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2), nn.ReLU())


def test_inception_block_bit_exact():
    block = Parallel(
        _conv_relu(192, 64, 1),
        nn.Sequential(_conv_relu(192, 48, 1), _conv_relu(48, 64, 5)),
        nn.Sequential(_conv_relu(192, 64, 1), _conv_relu(64, 96, 3), _conv_relu(96, 96, 3)),
        nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), _conv_relu(192, 32, 1)),
        join="cat", dim=1, streams=True,
    ).to(DEV).eval()
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 192, 35, 35, device=DEV)
            out = block(x)
            assert out.shape == (2, 256, 35, 35)
            assert_same(out, reference(block, x))


def _nested_block():
    return Parallel(
        Parallel(mlp(), mlp(), join="sum", streams=True),
        nn.Sequential(nn.Linear(64, 64), Parallel(mlp(64, 16), mlp(64, 16), mlp(64, 16), streams=True)),
        mlp(),
        join="cat", streams=True,
    )


def test_nested_blocks_bit_exact():
    p = _nested_block().to(DEV)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(16, 64, device=DEV)
            assert_same(p(x), reference(p, x))


def test_branches_run_on_distinct_side_streams_and_nested_blocks_fork_from_their_branch():
    log: dict = {}

    def probe(name, inner):
        return StreamProbe(name, inner, log)

    inner = Parallel(probe("i0", nn.Linear(64, 8)), probe("i1", nn.Linear(64, 8)), probe("i2", nn.Linear(64, 8)),
                     join="sum", streams=True)
    outer = Parallel(
        probe("o0", nn.Linear(64, 8)),
        nn.Sequential(probe("o1", nn.Identity()), inner),
        probe("o2", nn.Linear(64, 8)),
        join="cat", streams=True,
    ).to(DEV)
    caller = torch.cuda.current_stream()
    x = torch.randn(4, 64, device=DEV)
    with torch.no_grad():
        out = outer(x)
    assert log["o0"] == caller  # the first branch runs on the caller's stream
    assert caller not in (log["o1"], log["o2"]) and log["o1"] != log["o2"]
    assert log["i0"] == log["o1"]  # a nested block forks from its branch's stream ...
    nested_sides = {log["i1"], log["i2"]}
    assert len(nested_sides) == 2  # ... onto streams its enclosing block is not using
    assert not nested_sides & {caller, log["o1"], log["o2"]}
    assert torch.cuda.current_stream() == caller
    assert_same(out, reference(outer, x))


# ------------------------------------------------ 2. caller on a non-default stream
def test_caller_on_side_stream_forks_from_it():
    log: dict = {}
    branches = [StreamProbe(f"b{i}", mlp(), log) for i in range(4)]
    p = Parallel(*branches, join="cat", streams=True).to(DEV)
    s = torch.cuda.Stream()
    src = torch.randn(16, 64, device=DEV)
    x = torch.zeros(16, 64, device=DEV)
    torch.cuda.synchronize()
    with torch.no_grad(), torch.cuda.stream(s):
        # The input is produced on ``s`` after a long delay. Had the side streams forked
        # from the default stream, they would read zeros.
        torch.cuda._sleep(SLEEP)
        x.copy_(src)
        out = p(x)
        assert torch.cuda.current_stream() == s
        consumed = out * 1  # a consumer on ``s``
    assert log["b0"] == s and s not in {log[f"b{i}"] for i in range(1, 4)}
    torch.cuda.synchronize()
    expected = reference(p, src)
    assert_same(out, expected)
    assert_same(consumed, expected)


# --------------------------------------------------------------- 3. delay injection
def test_delay_before_input_producer():
    p = Parallel(*[mlp() for _ in range(4)], join="cat", streams=True).to(DEV)
    src = torch.randn(16, 64, device=DEV)
    x = torch.zeros(16, 64, device=DEV)
    torch.cuda.synchronize()
    with torch.no_grad():
        torch.cuda._sleep(SLEEP)
        x.copy_(src)  # the producer, delayed: side streams must wait for it
        out = p(x)
    torch.cuda.synchronize()
    assert_same(out, reference(p, src))


@pytest.mark.parametrize("join", ["cat", None])
def test_delay_inside_one_branch(join):
    # The slow branch is a side branch: the caller's join (cat, or the consumer below)
    # must wait for it; and the caller frees and reuses the input while it may still run.
    branches = [mlp(), mlp(), Sleepy(mlp()), mlp()]
    p = Parallel(*branches, join=join, streams=True).to(DEV)
    x = torch.randn(16, 64, device=DEV)
    keep = x.clone()
    with torch.no_grad():
        out = p(x)
        consumed = torch.cat(out, 1) if join is None else out * 1
        del x
        junk = torch.full((16, 64), 1e4, device=DEV)  # likely gets the input's block
    torch.cuda.synchronize()
    del junk
    expected = reference(p, keep)
    assert_same(out, expected)
    assert_same(consumed, expected if join == "cat" else torch.cat(expected, 1))


def test_delay_inside_nested_branch():
    inner = Parallel(mlp(), Sleepy(mlp()), join="sum", streams=True)
    p = Parallel(mlp(), nn.Sequential(nn.Linear(64, 64), inner), mlp(), join="cat", streams=True).to(DEV)
    x = torch.randn(16, 64, device=DEV)
    with torch.no_grad():
        out = p(x)
        consumed = out + 1
    torch.cuda.synchronize()
    expected = reference(p, x)
    assert_same(out, expected)
    assert_same(consumed, expected + 1)


# ------------------------------------ 3 + 5. delayed consumer and allocator reuse
def test_delay_before_consumer_with_allocator_reuse():
    p = Parallel(*[nn.Linear(64, 64) for _ in range(4)], join=None, streams=True).to(DEV)
    x = torch.randn(16, 64, device=DEV)
    with torch.no_grad():
        out = p(x)  # outputs 1..3 live in side streams' memory
        torch.cuda._sleep(SLEEP)  # the caller's stream is late to consume them
        consumed = [o * 1 for o in out]
        kept = out[2]
        del out  # freed while the caller's stream has yet to read them ...
        junk = _scribble_on_side_streams((16, 64))  # ... and reallocated on the side streams
    torch.cuda.synchronize()
    del junk
    expected = reference(p, x)
    for c, e in zip(consumed, expected):
        assert_same(c, e)
    assert_same(kept, expected[2])


def test_slow_first_branch_joined_output_survives_allocator_reuse():
    # Branch 0 runs on the caller's stream, so the cat of the side outputs is enqueued
    # behind its delay; the side outputs are freed on the CPU right after. Their blocks
    # must not be handed to new side-stream allocations before the cat has read them.
    p = Parallel(Sleepy(nn.Linear(64, 64)), *[nn.Linear(64, 64) for _ in range(3)],
                 join="cat", streams=True).to(DEV)
    x = torch.randn(16, 64, device=DEV)
    with torch.no_grad():
        out = p(x)
        junk = _scribble_on_side_streams((16, 64))
        out2 = p(torch.randn(16, 64, device=DEV))  # another call, same streams and sizes
        junk += _scribble_on_side_streams((16, 64))
    torch.cuda.synchronize()
    del junk, out2
    assert_same(out, reference(p, x))


@pytest.mark.parametrize("keep", ["hook", "view", "saved for backward"])
def test_joined_output_kept_elsewhere_survives_allocator_reuse(keep):
    # A joined side output is freed without record_stream only when nothing but the
    # fork holds it. Here something does (a hook's stash, a view, a tensor autograd
    # saved): after the call the caller's stream, delayed, reads it; then it is dropped
    # and its block offered to new side-stream allocations, which must wait for the read.
    kept: list[torch.Tensor] = []
    side = nn.Linear(64, 64)
    if keep == "hook":
        side.register_forward_hook(lambda m, i, o: kept.append(o))
    elif keep == "view":
        side.register_forward_hook(lambda m, i, o: kept.append(o[:, :32]))
    branches = [nn.Linear(64, 64), side if keep != "saved for backward" else nn.Sequential(side, nn.Tanh())]
    p = Parallel(*branches, join="cat", streams=True).to(DEV)
    x = torch.randn(16, 64, device=DEV, requires_grad=keep == "saved for backward")
    with torch.set_grad_enabled(keep == "saved for backward"):
        out = p(x)
    if keep == "saved for backward":  # tanh saves its output: the kept tensor is the side output
        kept.append(out.grad_fn.next_functions[1][0]._saved_result)
    with torch.no_grad():
        torch.cuda._sleep(SLEEP)
        read = kept[0] * 1  # the caller's stream reads the side output late ...
        expected_read = branches[1](x)[:, :32] if keep == "view" else branches[1](x)
        kept.clear()
        del out  # ... and its memory is released to its side stream's pool
        junk = _scribble_on_side_streams(tuple(read.shape))
    torch.cuda.synchronize()
    del junk
    assert_same(read, expected_read.detach())


# ------------------------------------------------------------------- 6. gradients
class SlowGradBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = mlp()

    def forward(self, x):
        return self.inner(sleep_in_backward(x, SLEEP // 2))


@pytest.mark.parametrize("use_backward", [True, False], ids=["backward", "autograd.grad"])
def test_gradients_bit_exact_over_iterations(use_backward):
    torch.manual_seed(0)
    trunk = nn.Linear(64, 64)
    block = Parallel(
        mlp(), SlowGradBranch(), Parallel(mlp(), mlp(), join="sum", streams=True), mlp(),
        join="cat", streams=True,
    )
    model = nn.Sequential(trunk, nn.ReLU(), block, nn.Linear(128, 8)).to(DEV)
    ref = copy.deepcopy(model)
    ref_block = ref[2]

    def ref_forward(x):  # the sequential model, written out
        h = torch.relu(ref[0](x))
        inner = ref_block[2]
        outs = [ref_block[0](h), ref_block[1](h), inner[0](h) + inner[1](h), ref_block[3](h)]
        return ref[3](torch.cat(outs, 1))

    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref))
    for _ in range(3):
        x = torch.randn(16, 64, device=DEV, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        out, expected = model(x), ref_forward(xr)
        assert_same(out, expected)
        w = torch.randn_like(out)
        params, ref_params = list(model.parameters()), list(ref.parameters())
        if use_backward:
            (out * w).sum().backward()
            (expected * w).sum().backward()
            got = [x.grad] + [q.grad for q in params]
            want = [xr.grad] + [q.grad for q in ref_params]
        else:
            got = list(torch.autograd.grad((out * w).sum(), [x, *params]))
            want = list(torch.autograd.grad((expected * w).sum(), [xr, *ref_params]))
            for q, g in zip(params, got[1:]):
                q.grad = g
            for q, g in zip(ref_params, want[1:]):
                q.grad = g
        for g, e in zip(got, want):
            assert_same(g, e)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for q, r in zip(model.parameters(), ref.parameters()):
        assert_same(q, r)


class _TwoHeads(nn.Module):
    r"""``inner``'s output and a scaled column of it: the output's node sums two gradients."""

    def __init__(self, inner: nn.Module, slow: bool = False) -> None:
        super().__init__()
        self.inner, self.slow = inner, slow

    def forward(self, x):
        y = self.inner(x)
        heads = (y, y[..., 0] * 0.5)
        return tuple(sleep_in_backward(h, SLEEP // 4) for h in heads) if self.slow else heads


def _mean_of_heads(outputs: list) -> tuple:
    return tuple(sum(o[i] for o in outputs) / 3 for i in range(2))


@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("join", ["mean", "sum", _mean_of_heads], ids=["mean", "sum", "callable"])
def test_a_join_gradient_read_on_two_streams_is_not_summed_into(cuda_graph, join):
    # Before (a GPU differential fuzz): a mean join's backward hands one gradient to every
    # branch; a fused group on the caller's stream and a side branch read it, and the engine
    # summed another gradient into it in place while the other stream's reads were queued --
    # the group's parameters got wrong gradients (off by up to 2, float64), every time under
    # a CUDA graph, and eagerly with the side branch's backward delayed.
    torch.manual_seed(0)

    def head(pooled: bool, slow: bool = False) -> nn.Module:
        conv = nn.Conv2d(4, 4, 3, padding=1)
        return _TwoHeads(nn.Sequential(conv, nn.ReLU()) if pooled else conv, slow)

    branches = [head(True), head(False, slow=not cuda_graph), head(True)]
    plain = [copy.deepcopy(b).to(DEV, torch.float64) for b in branches]
    block = Parallel(*branches, join=join, fuse="auto", streams=True, cuda_graph=cuda_graph).to(DEV, torch.float64)
    for _ in range(3):
        x = torch.randn(2, 4, 3, 4, device=DEV, dtype=torch.float64)
        out, outs = block(x), [m(x) for m in plain]
        expected = [sum(o[i] for o in outs) / (1 if join == "sum" else 3) for i in range(2)]
        weights = [torch.randn_like(e) for e in expected]
        for module in (block, *plain):
            module.zero_grad(set_to_none=True)
        sum((o * w).sum() for o, w in zip(out, weights)).backward()
        sum((e * w).sum() for e, w in zip(expected, weights)).backward()
        for (name, q), r in zip(block.named_parameters(), (r for m in plain for r in m.parameters())):
            torch.testing.assert_close(q.grad, r.grad, msg=name)
    assert block._fusion is not None and block._fusion.groups  # (the heads of branches 0 and 2 ran fused)


# --------------------------------------------------------- 7. memory and streams
def _settled_memory() -> int:
    torch.cuda.synchronize()
    gc.collect()
    # An allocation makes the allocator process finished ``record_stream`` events, so
    # blocks whose last use has passed are counted as free in both measurements.
    torch.empty(1, device=DEV)
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("streams", [True, "auto"])
def test_memory_and_stream_count_flat_over_many_calls(streams):
    p = Parallel(*[nn.Linear(32, 32) for _ in range(4)],
                 Parallel(nn.Linear(32, 16), nn.Linear(32, 16), streams=streams),
                 join="cat", streams=streams).to(DEV)
    x = torch.randn(8, 32, device=DEV)
    with torch.no_grad():
        for _ in range(50):  # warm-up: streams, cuBLAS workspaces, tuning
            p(x)
        base_memory, base_streams = _settled_memory(), _streams._stream_count()
        for _ in range(2000):
            y = p(x)
        del y
    assert _streams._stream_count() == base_streams
    assert _settled_memory() == base_memory


def test_memory_flat_in_training():
    p = Parallel(*[nn.Linear(32, 32) for _ in range(4)], join="sum", streams=True).to(DEV)
    opt = torch.optim.SGD(p.parameters(), lr=1e-3)

    def step():
        x = torch.randn(8, 32, device=DEV, requires_grad=True)
        p(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    for _ in range(20):
        step()
    base_memory, base_streams = _settled_memory(), _streams._stream_count()
    for _ in range(300):
        step()
    assert _streams._stream_count() == base_streams
    assert _settled_memory() == base_memory


# -------------------------------------------------------------------- 9. threads
def test_concurrent_calls_from_threads():
    p = Parallel(mlp(), Sleepy(mlp(), cycles=1_000_000), Parallel(mlp(), mlp(), join="sum", streams=True),
                 mlp(), join="cat", streams=True).to(DEV)
    with torch.no_grad():
        p(torch.randn(8, 64, device=DEV))  # create the side streams before the threads race
    torch.cuda.synchronize()
    errors: list = []
    barrier = threading.Barrier(4)

    def worker(seed: int) -> None:
        try:
            stream = torch.cuda.Stream()
            gen = torch.Generator(device=DEV).manual_seed(seed)
            barrier.wait(timeout=60)
            with torch.no_grad(), torch.cuda.stream(stream):
                for i in range(50):
                    x = torch.randn(8, 64, device=DEV, generator=gen)
                    out = p(x)
                    if torch.cuda.current_stream() != stream:
                        errors.append(f"thread {seed}: current stream changed")
                        return
                    expected = reference(p, x)
                    if not torch.equal(out, expected):
                        errors.append(f"thread {seed}, call {i}: wrong result")
                        return
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {seed}: {e!r}")

    threads = [threading.Thread(target=worker, args=(seed,), daemon=True) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors


# -------------------------------------------------------------------- tuner, misc
def test_auto_streams_decides_and_stays_correct():
    p = Parallel(*[mlp() for _ in range(4)], join="cat", streams="auto").to(DEV)
    x = torch.randn(16, 64, device=DEV)
    with torch.no_grad():
        from parallel_modules._autotune import _SAMPLES, _WARMUP

        for i in range(2 * (_WARMUP + _SAMPLES) + 2):  # more than the tuner's trial calls
            if i == 2 * (_WARMUP + _SAMPLES):
                torch.cuda.synchronize()  # (the tuner decides once the GPU has run the timed calls)
            x = torch.randn(16, 64, device=DEV)
            assert_same(p(x), reference(p, x))
        assert not p._tuner.trials, "the trial ends after its calls"
        assert len(p._plans) == 1, "one input signature, so one decision"
        (plan,) = p._plans.values()
        assert not plan.fused and plan.cuda, "fuse=False never fuses"
        (described,) = p.explain()["schedules"].values()
        chosen = "unfused, streams" if plan.forked else "unfused, sequential"
        # The schedule kept, then what each candidate measured: the kept one is the cheaper, or the
        # plain sequential one when forking did not win by the tuner's margin.
        assert described.startswith(chosen + " (timed per call: unfused, sequential: CPU "), described
        costs = p._tuner.costs[next(iter(p._plans))]
        assert set(costs) == {plan._replace(forked=False), plan._replace(forked=True)}
        assert (min(costs, key=lambda s: costs[s].cost) == plan) or not plan.forked
        for _ in range(4):
            x = torch.randn(16, 64, device=DEV)
            assert_same(p(x), reference(p, x))


def test_tuner_times_each_schedule_with_its_join():
    # The join is part of what a schedule costs (an unfused cat is an operation more,
    # a fused group's join a view): every candidate's measured CPU time holds it.
    import time

    from parallel_modules._autotune import _SAMPLES, _WARMUP

    def slow_cat(outputs):
        time.sleep(0.002)
        return torch.cat(outputs, 1)

    p = Parallel(*[nn.Linear(16, 16) for _ in range(2)], join=slow_cat, fuse="auto").to(DEV).eval()
    x = torch.randn(8, 16, device=DEV)
    with torch.no_grad():
        for i in range(3 * (_WARMUP + _SAMPLES) + 2):
            if i == 3 * (_WARMUP + _SAMPLES):
                torch.cuda.synchronize()  # (the tuner decides once the GPU has run the timed calls)
            # (fused, a batched product may sum in another order)
            torch.testing.assert_close(p(x), reference(p, x), rtol=1e-5, atol=1e-5)
    (costs,) = p._tuner.costs.values()
    assert len(costs) == 3, costs  # sequential, forked, fused
    assert all(t.cpu >= 0.002 for t in costs.values()), costs


@pytest.mark.parametrize("join", ["cat", None])
def test_identity_branches(join):
    # Branches returning their input unchanged, on the caller's stream and on side streams.
    lin = nn.Linear(64, 64)
    p = Parallel(nn.Identity(), lin, nn.Identity(), Sleepy(nn.Identity(), cycles=SLEEP // 4),
                 join=join, streams=True).to(DEV)
    s = torch.cuda.Stream()
    for caller in (torch.cuda.current_stream(), s):
        with torch.no_grad(), torch.cuda.stream(caller):
            x = torch.randn(16, 64, device=DEV)
            out = p(x)
            consumed = torch.cat(out, 1) if join is None else out * 1
            if join is None:
                assert all(out[i].data_ptr() == x.data_ptr() for i in (0, 2, 3))
        torch.cuda.synchronize()
        expected = reference(p, x)
        assert_same(out, expected)
        assert_same(consumed, torch.cat(expected, 1) if join is None else expected)


@pytest.mark.parametrize("decided_calls", [0, 2])
def test_exception_in_side_branch_restores_stream_and_joins(decided_calls):
    # decided_calls: calls that succeed first, so that the failing one takes the
    # fork of a decided schedule (its streams and events already looked up).
    written = torch.zeros(1024, device=DEV)
    written_by_failing = torch.zeros(1024, device=DEV)
    torch.cuda.synchronize()

    class Writer(nn.Module):
        def forward(self, x):
            torch.cuda._sleep(SLEEP)
            written.fill_(1.0)
            return x * 2

    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fail = True

        def forward(self, x):
            torch.cuda._sleep(SLEEP)
            written_by_failing.fill_(1.0)
            if self.fail:
                raise KeyError("failing branch")
            return x * 3

    failing = Failing()
    p = Parallel(OrderedDict(lin=nn.Linear(64, 64), writer=Writer(), failing=failing, last=nn.Linear(64, 64)),
                 join="cat", streams=True).to(DEV)
    s = torch.cuda.Stream()
    x = torch.randn(16, 64, device=DEV)
    failing.fail = False
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(decided_calls):
            p(x)
    failing.fail = True
    torch.cuda.synchronize()
    written.zero_()
    written_by_failing.zero_()
    torch.cuda.synchronize()
    with torch.no_grad(), torch.cuda.stream(s):
        with pytest.raises(KeyError) as ei:
            p(x)
        assert torch.cuda.current_stream() == s  # restored to the caller's stream
        # Enqueued on the caller's stream after the error: sees the branches' writes only
        # if their streams were joined into it.
        seen = written.clone()
        seen_failing = written_by_failing.clone()
    torch.cuda.synchronize()
    assert "branch 'failing'" in "".join(traceback.format_exception(ei.value))
    assert seen.eq(1).all() and seen_failing.eq(1).all()

    failing.fail = False
    with torch.no_grad(), torch.cuda.stream(s):
        x = torch.randn(16, 64, device=DEV)
        out = p(x)
        assert torch.cuda.current_stream() == s
    torch.cuda.synchronize()
    assert_same(out, reference(p, x))


@pytest.mark.multigpu
def test_module_on_second_gpu():
    p = _nested_block().to("cuda:1")
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(16, 64, device="cuda:1")
            out = p(x)
            assert out.device == torch.device("cuda:1")
            assert_same(out, reference(p, x))
    assert torch.cuda.current_device() == 0


# ------------------------------------------- stream orderings found by a review (delays widen them)
_LONG = 50_000_000  # cycles of torch.cuda._sleep: ~25 ms on an H100, long enough to lag a stream


class _Sleep(nn.Module):
    def forward(self, x):
        torch.cuda._sleep(_LONG)
        return x


@pytest.mark.cuda
def test_a_layer_shared_by_branches_under_autocast():
    # Autocast caches a weight's cast copy per thread, not per stream: branch 1 on its side
    # stream must not read the copy branch 0 has yet to write on the caller's stream.
    torch.manual_seed(0)
    d = 2048
    shared = nn.Linear(d, d).cuda()
    x = torch.randn(64, d, device="cuda")
    forked = Parallel(nn.Sequential(_Sleep(), shared), shared, streams=True)
    plain = Parallel(nn.Sequential(_Sleep(), shared), shared, streams=False)
    for _ in range(3):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            expected = plain(x)
        torch.cuda.synchronize()
        junk = torch.full((d, d), 1000.0, device="cuda", dtype=torch.float16)
        del junk  # leaves a freed block of 1000s for the cast to be given
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            out = forked(x)
        assert torch.equal(out, expected)


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        torch.cuda._sleep(_LONG)
        return g


class _SlowBackward(nn.Module):
    def forward(self, y):
        return _SleepInBackward.apply(y)  # its backward delays the side stream's weight gradient


class _AddBias(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x + self.b  # saves nothing for backward


@pytest.mark.cuda
def test_an_input_saved_by_a_side_branch_is_not_reused_before_its_backward_reads_it():
    # x needs no grad and is held only by what autograd saved: freed once branch 1's backward
    # (on its side stream, delayed) is enqueued, its memory must not go to branch 0's gradient.
    torch.manual_seed(0)

    def block(streams):
        torch.manual_seed(0)
        return Parallel(nn.Sequential(_AddBias(512), nn.Linear(512, 256)),
                        nn.Sequential(nn.Linear(512, 256), _SlowBackward()), streams=streams).cuda()

    def grads(p, inp, w):
        p.zero_grad(set_to_none=True)
        (p(inp * 2.0) * w).sum().backward()
        torch.cuda.synchronize()
        return [q.grad.clone() for q in p.parameters()]

    inp, w = torch.randn(4096, 512, device="cuda"), torch.randn(4096, 512, device="cuda")
    forked, plain = block(True), block(False)
    for _ in range(2):
        for a, b in zip(grads(forked, inp, w), grads(plain, inp, w)):
            torch.testing.assert_close(a, b)


@dataclasses.dataclass
class _Held:
    t: Any


class _Wrapped(nn.Module):
    def __init__(self, k: float, in_list: bool = False) -> None:
        super().__init__()
        self.k, self.in_list = k, in_list

    def forward(self, x):
        return _Held([x * self.k]) if self.in_list else _Held(x * self.k)


@pytest.mark.cuda
@pytest.mark.parametrize("in_list", [False, True])
def test_tensors_in_dataclass_outputs_made_on_side_streams_are_recorded(in_list):
    # Read late on one caller stream, then dropped: a call from another caller stream must not
    # get that memory on the side stream before the read. (In a list in the dataclass too.)
    block = Parallel(_Wrapped(1.0, in_list), _Wrapped(2.0, in_list), join=None, streams=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    x, y = torch.ones(1 << 22, device="cuda"), torch.full((1 << 22,), 5.0, device="cuda")
    torch.cuda.synchronize()
    for _ in range(3):
        with torch.cuda.stream(s1):
            outs = block(x)
            torch.cuda._sleep(_LONG)
            kept = (outs[1].t[0] if in_list else outs[1].t).clone()
        del outs
        with torch.cuda.stream(s2):
            other = block(y)
        torch.cuda.synchronize()
        assert kept[0].item() == 2.0
        del other, kept


@pytest.mark.cuda
def test_a_branch_changing_the_shared_input_in_place_is_refused_on_streams():
    x = torch.randn(8, 16, device="cuda")
    forked = Parallel(nn.Identity(), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(16, 16)), streams=True).cuda()
    with pytest.raises(RuntimeError, match=r"a branch changed its input in place") as info:
        forked(x.clone())
    assert "branch '1'" in str(info.value) or any("branch '1'" in n for n in getattr(info.value, "__notes__", []))
    forked[1][0].inplace = False
    assert torch.equal(forked(x), torch.cat([x, forked[1](x)], 1))
    # One after another, the branches see what the sequential loop sees.
    plain = Parallel(nn.Sequential(nn.ReLU(inplace=True)), nn.Identity(), streams=False).cuda()
    y = x.clone()
    assert torch.equal(plain(y), torch.cat([x.relu(), x.relu()], 1))



class _ReadsField(nn.Module):
    def __init__(self, slow: bool) -> None:
        super().__init__()
        self.lin, self.slow = nn.Linear(768, 256), slow
        self.b = nn.Parameter(torch.zeros(768))

    def forward(self, probe, arg):
        t = arg.t if isinstance(arg, _Held) else arg
        return _SleepInBackward.apply(self.lin(t)) if self.slow else self.lin(t + self.b)


def test_an_input_in_a_dataclass_saved_by_a_side_branch_is_not_reused_early():
    # As the test above, with the input inside a dataclass argument: found there too.
    torch.manual_seed(0)
    forked = Parallel(_ReadsField(False), _ReadsField(True), streams=True).cuda()
    plain = copy.deepcopy(forked)
    plain.streams = False
    inp, w = torch.randn(4096, 768, device=DEV), torch.randn(4096, 512, device=DEV)
    probe = torch.zeros(1, device=DEV)

    def grads(p):
        p.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        arg = inp * 2.0
        out = p(probe, _Held(arg))
        del arg  # only autograd holds the input now
        (out * w).sum().backward()
        torch.cuda.synchronize()
        return [q.grad.clone() for q in p.parameters() if q.grad is not None]

    for _ in range(2):
        got, want = grads(forked), grads(plain)
        assert len(got) == len(want) == 5
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_forked_block_gets_the_gradients_of_the_plain_one(reentrant):
    # Non-reentrant checkpointing recomputes the forward in the unpack hook of the first
    # backward node that needs a saved tensor, on that node's (side) stream: forked from
    # there, branch 0's activations were recomputed on a stream its backward never waits on.
    import torch.utils.checkpoint as cp

    torch.manual_seed(0)
    a = nn.Sequential(Sleepy(nn.Identity(), cycles=SLEEP), nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 64))
    b = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 64))
    forked = Parallel(a, b, streams=True).cuda()
    plain = copy.deepcopy(forked)
    plain.streams = False
    x0, w = torch.randn(2048, 256, device=DEV), torch.randn(2048, 128, device=DEV)

    def grads(model):
        model.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        _scribble_on_side_streams((2048, 1024), count=4)
        (cp.checkpoint(model, x, use_reentrant=reentrant) * w).sum().backward()
        torch.cuda.synchronize()
        return [x.grad] + [p.grad for p in model.parameters()]

    for _ in range(2):
        for g, e in zip(grads(forked), grads(plain)):
            torch.testing.assert_close(g, e)


class _Scale(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x):
        return x * self.k


class _ToSparse(nn.Module):
    def forward(self, x):
        return (x * 2).to_sparse()


def _dense(t):
    if isinstance(t, (tuple, list)):
        return [_dense(v) for v in t]
    if t.is_nested:
        return list(t.unbind())
    return t.to_dense() if t.layout != torch.strided else t


@pytest.mark.parametrize("grad", [False, True])
def test_sparse_and_nested_tensors_through_forked_branches(grad):
    # record_stream has kernels for dense tensors only, and sparse tensors have no storage
    # to count references of: their dense parts are recorded instead.
    d = torch.randn(8, 16, device=DEV)
    nested = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], device=DEV)
    cases = [
        (Parallel(_Scale(2.0), _Scale(3.0), join="sum", streams=True), d.to_sparse_csr(), [d * 5]),
        (Parallel(_ToSparse(), _ToSparse(), join="cat", dim=0, streams=True), d, [torch.cat([d * 2, d * 2])]),
        (Parallel(_Scale(2.0), _Scale(3.0), join=None, streams=True), nested,
         [[u * 2 for u in nested.unbind()], [u * 3 for u in nested.unbind()]]),
    ]
    with torch.set_grad_enabled(grad):
        for block, x, expected in cases:
            for _ in range(2):  # the first call, then the decided path
                out = block.cuda()(x)
            got = _dense(out) if isinstance(out, (tuple, list)) else [_dense(out)]
            torch.testing.assert_close(got, expected)


def test_blocks_nested_in_sibling_branches_fork_onto_their_own_streams():
    # Sibling nested blocks took the same slots: their side branches shared a stream, and
    # the second waited for the first's whole join.
    log: dict = {}

    def inner(tag):
        return Parallel(StreamProbe(tag + "0", nn.Identity(), log), StreamProbe(tag + "1", nn.Identity(), log),
                        streams=True)

    outer = Parallel(inner("a"), inner("b"), inner("c"), streams=True).cuda()
    x = torch.randn(4, 8, device=DEV)
    with torch.no_grad():
        assert torch.equal(outer(x), torch.cat([x] * 6, 1))
    sides = [log[t + "1"] for t in "abc"]
    assert len({s.stream_id for s in sides}) == 3, sides
    callers = {log[t + "0"].stream_id for t in "abc"}
    assert not callers & {s.stream_id for s in sides}
    # Blocks nested one after another in one branch take the same slots again.
    log.clear()
    seq = Parallel(nn.Sequential(inner("a"), inner("b")), nn.Identity(), streams=True).cuda()
    with torch.no_grad():
        seq(x)
    assert log["a1"].stream_id == log["b1"].stream_id


def test_capture_streams_are_never_the_eager_streams():
    # PyTorch hands out 32 streams per priority round-robin: past 32, the eager and the
    # capture pools of one priority would share streams, and another thread's eager work
    # would enter a capture.
    device = torch.device(DEV)
    eager, capture = _streams._pool(device, False), _streams._pool(device, True)
    eager.side_streams(0, 40)
    capture.side_streams(0, 40)
    from parallel_modules._graphs import _capture_stream

    captured = {s.stream_id for s in capture.streams} | {_capture_stream(device.index or 0).stream_id}
    assert not captured & {s.stream_id for s in eager.streams}
    assert not captured & {torch.cuda.Stream().stream_id for _ in range(40)}


# ------------------------------------ found by reviews of the eager fork and its tuning
class _Scaled(nn.Module):
    def forward(self, x):
        return x * 2.0


@pytest.mark.parametrize("streams", ["auto", True])
def test_a_branch_writing_to_an_inference_input_never_races(streams):
    # Inference tensors keep no version, so the fork's in-place check did not see the
    # ReLU: forked, branch 1 read the input while branch 0 changed it (44 of 60 calls wrong).
    block = Parallel(nn.Sequential(Sleepy(nn.Identity(), 300_000), nn.ReLU(inplace=True)),
                     nn.Sequential(_Scaled(), Sleepy(nn.Identity(), 300_000)), streams=streams).to(DEV)
    with torch.inference_mode():
        for _ in range(40):
            x = torch.randn(64, 256, device=DEV)
            expected = torch.cat([x.relu(), x.relu() * 2.0], 1)
            if streams is True:
                with pytest.raises(RuntimeError, match="changed its input in place"):
                    block(x)
                continue
            assert_same(block(x), expected)
    assert not any(plan.forked for plan in block._plans.values())


def test_fuse_auto_keeps_a_branch_writing_to_an_inference_input_in_order():
    # streams=False: the first call of an inference-tensor signature was not watched, and
    # the identical branches 0 and 2 ran fused, ahead of branch 1's ReLU (14 of 60 wrong).
    torch.manual_seed(0)
    same = nn.Linear(64, 64)
    branches = [same, nn.Sequential(nn.ReLU(inplace=True), nn.Linear(64, 64)), copy.deepcopy(same)]
    block = Parallel(*copy.deepcopy(branches), fuse="auto", streams=False).to(DEV).eval()
    branches = [b.to(DEV) for b in branches]
    with torch.inference_mode():
        for _ in range(30):
            x = torch.randn(16, 64, device=DEV)
            xr = x.clone()
            assert_same(block(x), torch.cat([b(xr) for b in branches], 1))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_graphed_fork_sees_a_branch_writing_to_its_input(mode):
    # Captured under inference_mode, the static input was an inference tensor, which
    # keeps no version: the forked capture raced with the in-place ReLU (wrong from the
    # first call, max error 1.42). Now it is refused as under no_grad; without forks
    # the block captures and replays it in order.
    torch.manual_seed(0)
    branches = [nn.Sequential(Sleepy(nn.Identity(), 5_000_000), nn.ReLU(inplace=True), nn.Linear(64, 64)),
                nn.Linear(64, 64)]
    forked = Parallel(*copy.deepcopy(branches), cuda_graph=True).to(DEV).eval()
    in_turn = Parallel(*copy.deepcopy(branches), cuda_graph=True, streams=False).to(DEV).eval()
    branches = [b.to(DEV) for b in branches]
    with getattr(torch, mode)():
        with pytest.raises(RuntimeError, match="changed its input in place"):
            forked(torch.randn(32, 64, device=DEV))
        for _ in range(5):
            x = torch.randn(32, 64, device=DEV)
            xr = x.clone()
            assert_same(in_turn(x), torch.cat([b(xr) for b in branches], 1))
    assert len(in_turn._graphs) == 1


def test_a_branch_writing_to_a_nested_input_never_races():
    # Only top-level tensor arguments were watched: block([x]) forked and raced.
    first_in_place = lambda xs: torch.relu_(Sleepy(nn.Identity(), 300_000)(xs[0]))  # noqa: E731
    block = Parallel(first_in_place, lambda xs: Sleepy(nn.Identity(), 300_000)(xs[0] * 2.0)).to(DEV)
    with torch.no_grad():
        for _ in range(40):
            x = torch.randn(64, 256, device=DEV)
            expected = torch.cat([x.relu(), x.relu() * 2.0], 1)
            assert_same(block([x]), expected)
    assert block._plans and not any(plan.forked for plan in block._plans.values())


def test_torch_func_transforms_run_forked_blocks_in_turn():
    # Before: NotImplementedError, "Cannot access storage of BatchedTensorImpl" (the
    # release of side outputs, record_stream on wrapped tensors).
    block = Parallel(nn.Linear(8, 8), nn.Linear(8, 8), join="sum", streams=True).to(DEV)
    xs = torch.randn(3, 4, 8, device=DEV)
    assert_same(torch.vmap(block)(xs), torch.stack([block[0](x) + block[1](x) for x in xs]))
    x = torch.randn(4, 8, device=DEV)
    grad = torch.func.grad(lambda t: block(t).sum())(x)
    expected = torch.func.grad(lambda t: (block[0](t) + block[1](t)).sum())(x)
    torch.testing.assert_close(grad, expected)


def test_an_activation_fed_to_a_forked_block_can_be_saved():
    # The backward join's hook was an attribute of the tensor, which torch.save pickles
    # ("cannot pickle 'Stream' object").
    import io

    pre = nn.Linear(8, 8).to(DEV)
    block = Parallel(nn.Linear(8, 8), nn.Linear(8, 8), join="sum", streams=True).to(DEV)
    h = pre(torch.randn(4, 8, device=DEV))
    block(h).sum().backward()
    buffer = io.BytesIO()
    torch.save(h.detach(), buffer)
    torch.save(h, buffer)
    assert not h.__dict__
    assert pre.weight.grad is not None


def test_frozen_branches_called_with_grad_enabled_hold_no_input_for_backward(monkeypatch):
    # Nothing recorded, nothing for a backward pass to order: before, every call
    # record_stream'ed each input on each side stream (and hooked it).
    joined = []
    monkeypatch.setattr(_streams, "_join_backward", lambda inputs, streams: joined.append(1))
    block = Parallel(nn.Linear(8, 8), nn.Linear(8, 8), join="sum", streams=True).to(DEV).requires_grad_(False)
    x = torch.randn(4, 8, device=DEV)
    for _ in range(3):
        assert_same(block(x), block[0](x) + block[1](x))
    assert not joined
    block.requires_grad_(True)
    block(x).sum().backward()
    assert joined and block[0].weight.grad is not None


@pytest.mark.parametrize("join", [None, "sum"])
def test_forward_ad_tangents_of_side_outputs_survive_allocator_reuse(join):
    # Under forward-mode AD each side output carries a tangent made on its side stream, with
    # memory of its own. Read late on the caller's stream and then dropped, its block must
    # not go to new side-stream allocations before the read (record_stream on the tangent).
    import torch.autograd.forward_ad as fwAD

    p = Parallel(*[nn.Linear(64, 64) for _ in range(4)], join=join, streams=True).to(DEV)
    x, t = torch.randn(16, 64, device=DEV), torch.randn(16, 64, device=DEV)
    with torch.no_grad(), fwAD.dual_level():
        out = p(fwAD.make_dual(x, t))
        outs = out if join is None else [out]
        torch.cuda._sleep(SLEEP)  # the caller's stream is late to read the tangents
        read = [fwAD.unpack_dual(o).tangent * 1 for o in outs]
        del out, outs  # freed while the caller's stream has yet to read them ...
        junk = _scribble_on_side_streams((16, 64))  # ... and reallocated on the side streams
    torch.cuda.synchronize()
    del junk
    # A linear layer's tangent is the tangent times its weight.
    expected = [t @ b.weight.T for b in p]
    if join == "sum":
        expected = [sum(expected)]
    for r, e in zip(read, expected):
        torch.testing.assert_close(r, e)
