"""Host-side timing helpers shared by the micro-benchmark tools (dev tool, not shipped)."""
import cProfile
import io
import pstats
import statistics
import time
from typing import Callable

import torch


def cpu_us(fn: Callable[[], object], n: int = 2000, warmup: int = 100, repeats: int = 3,
           pick: Callable[[list[float]], float] = min) -> float:
    r"""Host microseconds per call: ``n`` calls then one sync, ``repeats`` times; ``pick`` of those."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return pick(samples)


def host_us(fn: Callable[[], object], n: int = 300) -> float:
    r"""Host microseconds per call of ``n`` calls back to back, from a synchronize to the one after them.

    One sample, the final wait for the GPU included: for tools that interleave their variants in rounds
    and take medians (see ``cpu_us`` for the best of a few samples of host time alone).
    """
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def events_us(fn: Callable[[], object], calls: int, spin_cycles: int = 0) -> tuple[float, float]:
    r"""Microseconds per call of ``calls`` calls: by CUDA events around them, and the host's to issue them.

    From a synchronize; with ``spin_cycles``, queued behind a spin kernel of that many cycles, so that
    the events time the GPU's work alone (where the host issues the calls within the spin) and the
    host's time excludes any wait for the GPU.
    """
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if spin_cycles:
        torch.cuda._sleep(spin_cycles)
    a.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = (time.perf_counter() - t0) / calls * 1e6
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / calls, issued


def graph_by_hand(module: Callable[[torch.Tensor], object], x: torch.Tensor) -> torch.cuda.CUDAGraph:
    r"""``module`` on a copy of ``x`` captured in a CUDA graph by hand, after a warm-up on a side stream.

    Capture it after any ``Parallel(fuse=...)`` built on the same branches: fusion stacks their parameters
    into new memory, which a graph reads by address.
    """
    from parallel_modules._graphs import _clear_cublas_workspaces

    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            module(static)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    # cuBLAS workspaces from the graph's own pool (the modules' captures clear the shared ones).
    _clear_cublas_workspaces()
    with torch.cuda.graph(g):
        module(static)
    _clear_cublas_workspaces()
    g.static = static  # read by address: must outlive the graph (later captures empty the cache)
    return g


def profile(name: str, fn: Callable[[], object], n: int = 2000, top: int = 14, warmup: int = 0) -> None:
    r"""Print the ``top`` functions by own time of a cProfile of ``n`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    print(f"---- cProfile {name} ({n} calls)")
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip() and "function calls" not in line)[:3500])


def op_table(fn: Callable[[], object], calls: int = 20, rows: int = 18) -> None:
    r"""Print a torch.profiler table (CPU operators by self time) of ``calls`` calls of ``fn``."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def gpu_medians(calls: dict[str, Callable[[], object]], rounds: int = 30, per_sample: int = 10) -> dict[str, float]:
    r"""Median GPU microseconds per call of each entry, sampled interleaved (``per_sample`` calls per sample)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_sample):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / per_sample)
    return {name: statistics.median(t) for name, t in times.items()}


def host_medians(calls: dict[str, Callable[[], object]], rounds: int = 25, per_sample: int = 200,
                 warmup: int = 50) -> dict[str, float]:
    r"""Median host microseconds per call of each entry, sampled interleaved (``per_sample`` calls, then a sync)."""
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            for _ in range(per_sample):
                fn()
            times[name].append((time.perf_counter() - t0) * 1e6 / per_sample)
            torch.cuda.synchronize()
    return {name: statistics.median(t) for name, t in times.items()}


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
               x: torch.Tensor) -> tuple[Callable[[], None], dict[str, list[float]]]:
    r"""The benchmark's training step on ``x``, and the host microseconds of each of its parts, one entry per step.

    ``zero_grad(set_to_none=True)``, the forward and ``square().mean()``, ``backward()``, the optimizer's ``step``.
    """
    parts: dict[str, list[float]] = {k: [] for k in ("zero_grad", "forward+loss", "backward", "opt.step")}

    def step() -> None:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        loss = model(x).square().mean()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        for k, a, b in zip(parts, (t0, t1, t2, t3), (t1, t2, t3, t4)):
            parts[k].append((b - a) * 1e6)

    return step, parts


def hand_fork_join(branches: list, x: torch.Tensor, caller, sides: list, fork, joins: list,
                   release: str | None = "wait", events: bool = True, switch: bool = True) -> torch.Tensor:
    r"""The fork/join of ``_streams._run_forked`` written out by hand for ``branches`` on ``x``, joined by cat.

    Branch 0 on ``caller``, branch i on ``sides[i - 1]``, forked with ``fork``,
    joined with ``joins[i - 1]``, through the C bindings ``_streams`` holds
    (read at each call, so that a tool may stand them in). ``release``: how the
    side outputs are freed after the cat -- ``"wait"`` (every side stream waits
    for the caller's, as the library does), ``"record_stream"``, or ``None``
    (not at all: unsafe, a measure only). ``events`` / ``switch``: leave out
    the events, the stream switches.
    """
    from parallel_modules import _streams

    record, wait, switch_to = _streams._record, _streams._wait, _streams._set_current
    if events:
        record(fork, caller)
    outs = [branches[0](x)]
    for branch, side, join in zip(branches[1:], sides, joins):
        if switch:
            switch_to(side.stream_id, side.device_index, side.device_type)
        if events:
            wait(fork, side)
        outs.append(branch(x))
        if events:
            record(join, side)
    if switch:
        switch_to(caller.stream_id, caller.device_index, caller.device_type)
    if events:
        for join in joins:
            wait(join, caller)
    y = torch.cat(outs, 1)
    if release == "record_stream":
        for out in outs[1:]:
            out.record_stream(caller)
    elif release == "wait":
        record(fork, caller)
        for side in sides:
            wait(fork, side)
    return y


def hand_h2d_pipeline(model: Callable[[torch.Tensor], torch.Tensor], host_pieces: list[torch.Tensor],
                      copy_stream: torch.cuda.Stream) -> Callable[[], torch.Tensor]:
    r"""A host-to-device pipeline written by hand: each piece of pinned host memory copied on
    ``copy_stream``, computed on the caller's stream after its copy's event, the outputs ``cat``.

    What ``ParallelSequential(model, chunks=len(host_pieces))`` does for a CPU input, as a user would
    write it, for the h2d tools to compare with.
    """
    def run() -> torch.Tensor:
        cur = torch.cuda.current_stream()
        copy_stream.wait_stream(cur)
        events, ins = [], []
        with torch.cuda.stream(copy_stream):
            for h in host_pieces:
                d = h.to("cuda", non_blocking=True)
                e = torch.cuda.Event()
                e.record(copy_stream)
                ins.append(d)
                events.append(e)
        outs = []
        for d, e in zip(ins, events):
            cur.wait_event(e)
            d.record_stream(cur)  # (made on the copy stream, read and freed on this one)
            outs.append(model(d))
        return torch.cat(outs)
    return run


def mlp_stacks(n: int, batch: int = 8):
    r"""The benchmark's ``mlp{n}`` case in eval mode on CUDA (fp32), stacked by hand for the fused tools.

    Returns ``(branches, x, seq, ref, W, B)``: the branches, an input of ``batch`` rows, the sequential
    module, its output on ``x``, and each layer's weights ``[n, out, in]`` and biases ``[n, out]`` stacked.
    """
    from parallel_modules._cases import CASES, SequentialBranches

    dev, dt = torch.device("cuda"), torch.float32
    branches = CASES[f"mlp{n}"].branches(dev, dt).copy()
    for b in branches:
        b.eval()
    x = CASES[f"mlp{n}"].make_input(batch, dev, dt)
    seq = SequentialBranches(branches)
    with torch.no_grad():
        ref = seq(x)
    depth = len(branches[0]) // 2
    W = [torch.stack([b[2 * k].weight.detach() for b in branches]) for k in range(depth)]
    B = [torch.stack([b[2 * k].bias.detach() for b in branches]) for k in range(depth)]
    return branches, x, seq, ref, W, B
