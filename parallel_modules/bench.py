r"""Benchmark: how much faster is a model with ``Parallel``, and when is it not.

Run ``python -m parallel_modules.bench`` (or ``parallel-modules-bench``). On a
CUDA GPU every case is timed in every mode that applies, modes interleaved on
the same inputs in one process, after each mode's output was checked against
the plain sequential module. Without a GPU a reduced suite checks every mode's
output on the CPU and times the eager modes; streams and graphs need CUDA.

Timing: each sample synchronizes, records a CUDA event, runs ``--group``
back-to-back calls (so launch overhead and GPU time overlap as in a real
model), records another event; a sample is the mean call time of the group.
Outputs are dropped before the next call, in warm-up too, as inside a model:
CUDA graphs (by hand, ``cuda_graph=True``, reduce-overhead) then return their
own output buffers without a copy.
The median and the interquartile range of ``--reps`` samples are reported.
Modes whose calls take milliseconds use smaller groups, and then every mode
more samples, so that a sample lasts about 20 ms at most and every mode still
sees 100 calls or more; each mode's group is sized by its own call.
The floor of a case is its longest single branch captured alone in a CUDA
graph: no schedule of the branches can beat it; its replay is sampled with
the modes, round by round. Graphs captured by hand (the floor, *graph seq*)
read the case's input in place, as ``cuda_graph=True`` does at an input
address it has seen: neither is charged a copy the other is spared. The host probe is the CPU's
time for a tiny ``nn.Linear`` call, taken once per round of samples: the
speed of the host the case's CPU-bound figures were measured at.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import inspect
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

from . import Parallel, ParallelSequential
from ._cases import CASES, PIPELINES, Case, PipelineCase, SequentialBranches
from ._autotune import _warm_up
from ._fusion import _groups
from ._graphs import _clear_cublas_workspaces, _collector_paused

__all__ = ["main"]

# A sample of slow calls lasts about this long (fewer than --group calls); each mode gets at least
# _MIN_RUNS calls.
_SAMPLE_S = 20e-3
_MIN_RUNS = 100
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# How far a mode that sums in another order (fused, compiled, pipelined) may stray from the sequential
# module, as a fraction of the reference's largest magnitude (_check; _check_training for gradients).
# float32: rounding of sums reordered over up to 4096 terms stays below 1e-6 of the output on the CPU,
# so that a mode 0.01% off fails; half precision: a few units of its last place (eps 1e-3 and 8e-3),
# below which a wrong mode cannot be told from rounding.
_TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def _graph_supported() -> bool:
    return "cuda_graph" in inspect.signature(Parallel.__init__).parameters


def _capture(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, in_place: bool = False) -> Callable:
    r"""Capture ``fn`` in a CUDA graph by hand (the baseline a user would write).

    Its replay copies the input in and returns the graph's own output, which the
    next replay overwrites, as ``torch.compile(mode="reduce-overhead")`` does and
    as ``cuda_graph=True`` modules do for a caller that drops each output before
    the next call. ``in_place``: the graph reads ``x`` itself, and replays only
    for it, copying nothing in, as ``cuda_graph=True`` modules do at an input
    address they have seen; the cases time every mode on one input tensor.
    """
    static_x = x if in_place else x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            fn(static_x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    # cuBLAS workspaces allocated inside the capture, from the graph's pool: the
    # reduce-overhead mode clears the process-wide ones (see _graphs._clear_cublas).
    _clear_cublas_workspaces()
    with torch.no_grad(), _collector_paused(), torch.cuda.graph(g):
        static_out = fn(static_x)
    _clear_cublas_workspaces()

    def replay(inp: torch.Tensor):
        if in_place:
            if inp is not static_x:
                raise ValueError("bench: a graph captured reading its input in place was called on another tensor")
        else:
            static_x.copy_(inp)
        g.replay()
        return static_out

    # The graph reads ``fn``'s parameters by address: keep them alive as long as the replay.
    replay.graph, replay.module = g, fn
    return replay


def _modes(case: Case, device: torch.device, dtype: torch.dtype, x: torch.Tensor, quick: bool) -> dict[str, Callable]:
    branches = case.branches(device, dtype)

    def parallel(**kw: Any) -> nn.Module:
        return case.model(Parallel(*branches, join=case.join, dim=case.dim, **kw), device, dtype)

    def graphed(**kw: Any) -> Callable:
        # Alone, a Parallel captures itself (cuda_graph=True); behind a trunk, the
        # user captures the whole model, and the Parallel forks inside the capture.
        if case.trunk is None and _graph_supported():
            return parallel(cuda_graph=True, **kw)
        return _capture(parallel(**{"streams": True, **kw}), x, in_place=True)

    seq = case.model(SequentialBranches(branches, case.join, case.dim), device, dtype)
    modes: dict[str, Callable] = {"eager seq": seq, "eager Parallel": parallel()}
    fusable = bool(_groups(branches)[0])
    if fusable:  # identical branches: fused, forced and chosen automatically
        modes["eager Parallel fused"] = parallel(fuse=True)
    if device.type != "cuda":
        return modes
    modes["eager Parallel streams"] = parallel(streams=True)
    modes["graph seq"] = _capture(seq, x, in_place=True)
    modes["graph Parallel"] = graphed()
    if fusable:
        modes["eager Parallel fuse=auto"] = parallel(fuse="auto")
        modes["graph Parallel fused"] = graphed(fuse=True)
        if case.trunk is None:  # choosing between captures is cuda_graph=True's job
            modes["graph Parallel fuse=auto"] = parallel(fuse="auto", cuda_graph=True)
    if not quick and case.compiled:
        torch._dynamo.reset()
        modes["compile"] = torch.compile(seq)
        modes["compile reduce-overhead"] = torch.compile(
            case.model(SequentialBranches(branches, case.join, case.dim), device, dtype), mode="reduce-overhead")
        if _graph_supported():  # each branch compiled by inductor, under our multi-stream graph
            modes["compile branches + graph"] = graphed(compile="inductor")
    return modes


def _train_modes(case: Case, device: torch.device, dtype: torch.dtype) -> dict[str, Callable]:
    r"""Training steps (zero_grad, forward, backward, SGD step), each mode on its own copy of the branches."""
    def step(model: nn.Module) -> Callable:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def run(x: torch.Tensor) -> nn.Module:
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
            return model

        run.module = model  # (for _schedules)
        return run

    def parallel(**kw: Any) -> nn.Module:
        return case.model(Parallel(*case.branches(device, dtype), join=case.join, dim=case.dim, **kw), device, dtype)

    seq = case.model(SequentialBranches(case.branches(device, dtype), case.join, case.dim), device, dtype)
    modes = {"eager seq": step(seq), "eager Parallel": step(parallel()), "eager Parallel fused": step(parallel(fuse=True))}
    if device.type == "cuda":
        modes["graph Parallel"] = step(parallel(cuda_graph=True))
        modes["graph Parallel fused"] = step(parallel(cuda_graph=True, fuse=True))
        # The parameters' gradients written by the backward replay, not autograd's accumulators.
        modes["graph Parallel direct_grads"] = step(parallel(cuda_graph=True, direct_grads=True))
        modes["graph Parallel fused direct_grads"] = step(parallel(cuda_graph=True, fuse=True, direct_grads=True))
    return modes


def _check_training(name: str, model: nn.Module, ref: nn.Module, start: list[torch.Tensor], dtype: torch.dtype) -> str:
    r"""After the same steps from the same ``start`` as the sequential ``ref``: the last gradients and the
    parameters equal, or close for fused modes.

    Closeness is judged on the gradients and on how far the parameters moved,
    each against the reference's own scale: a step of ``lr * grad`` moves a
    parameter by far less than any tolerance on its value, so comparing values
    alone cannot tell a step from none.
    """
    def fail(what: str) -> AssertionError:
        return AssertionError(f"bench: training mode {name!r} differs from the sequential module: {what}")

    params, expected = list(model.parameters()), list(ref.parameters())
    if [p.shape for p in params] != [e.shape for e in expected]:
        raise fail(f"parameter shapes {[tuple(p.shape) for p in params]}, expected {[tuple(e.shape) for e in expected]}")
    if any(p.grad is None for p in params):
        raise fail("a parameter has no gradient after the step (no backward reached it)")
    if "fuse" not in name:
        if all(torch.equal(p, e) and torch.equal(p.grad, e.grad) for p, e in zip(params, expected)):
            return "equal"
        err = max((p - e).abs().max().item() for p, e in zip(params, expected))
        raise fail(f"parameters not bit-for-bit equal (max abs error {err:.3g})")
    # Fused groups sum in another order (a batched matrix product): each result within ``tol`` of the
    # reference's largest, and the parameters within the rounding of three steps (half an ulp each).
    tol = _TOLERANCE[dtype]
    eps = torch.finfo(dtype).eps
    # (In half precision three steps may move no parameter at all, lr * grad being below half
    # an ulp: then none must move, and the gradients carry the check.)
    moved = [e.detach() - s for e, s in zip(expected, start)]
    for i, (p, e, s, m) in enumerate(zip(params, expected, start, moved)):
        g, ge = p.grad.float(), e.grad.float()
        if not torch.allclose(g, ge, rtol=tol, atol=tol * ge.abs().max().item()):
            raise fail(f"parameter {i}'s gradient (max abs error {(g - ge).abs().max().item():.3g}, "
                       f"largest {ge.abs().max().item():.3g})")
        err = ((p.detach() - s).float() - m.float()).abs()
        if (err > tol * m.abs().max().float() + 4 * eps * torch.maximum(s.abs(), p.detach().abs()).float()).any():
            raise fail(f"parameter {i} moved by {(p.detach() - s).abs().max().item():.3g} at most, the reference's "
                       f"by {m.abs().max().item():.3g} (max abs difference {err.max().item():.3g})")
    return f"close({tol:g})"


def _train_checks(modes: dict[str, Callable], inputs: list[torch.Tensor], dtype: torch.dtype) -> dict[str, str]:
    r"""Every mode's training steps on ``inputs`` from the sequential module's parameters, checked against its.

    Run after the warm-up, so that what is checked is what is timed (graphed
    steps replay). The parameters are copied in place, as an optimizer step
    writes them: graphs and fused groups read them where they are.
    """
    ref = modes["eager seq"].module
    with torch.no_grad():
        for name, fn in modes.items():
            if name != "eager seq":
                for p, e in zip(fn.module.parameters(), ref.parameters()):
                    p.copy_(e)
    start = [e.detach().clone() for e in ref.parameters()]
    for fn in modes.values():
        for xi in inputs:
            fn(xi)
    return {name: "reference" if name == "eager seq" else _check_training(name, fn.module, ref, start, dtype)
            for name, fn in modes.items()}


def _pipeline_modes(case: PipelineCase, device: torch.device, dtype: torch.dtype,
                    x: torch.Tensor) -> dict[str, Callable]:
    stages = case.stages(device, dtype)
    seq = nn.Sequential(*stages)
    if case.host_input and device.type == "cuda":
        modes: dict[str, Callable] = {"eager seq": lambda x: seq(x.to(device, non_blocking=True))}
    else:
        modes = {"eager seq": seq}
    # (A batch smaller than the chunks cannot be split into them: ParallelSequential refuses it.)
    chunks = [c for c in case.chunks if c <= len(x)]
    for c in chunks:
        modes[f"ParallelSequential chunks={c}"] = ParallelSequential(*stages, chunks=c)
    if device.type == "cuda":
        if case.host_input:
            # Copy then replay; the modules replay each stage per micro-batch, the copies eager.
            replay = _capture(seq, x.to(device))
            modes["graph seq"] = lambda x: replay(x.to(device, non_blocking=True))
        else:
            modes["graph seq"] = _capture(seq, x, in_place=True)
        for c in chunks:
            modes[f"graph ParallelSequential chunks={c}"] = ParallelSequential(*stages, chunks=c, cuda_graph=True)
    return modes


def _error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    r"""The largest ``|out - ref|``, the reference's largest magnitude, and the first over the second."""
    if out.numel() == 0:
        return 0.0, 0.0, 0.0
    # (Equal elements count no error: an infinity met by the same infinity differs by NaN.)
    err = (out.float() - ref.float()).abs().masked_fill_(out == ref, 0).max().item()
    # (Of the finite elements: an infinity in the reference would make any error "close".)
    scale = ref.float().abs().masked_fill_(ref.isinf(), 0).max().item()
    return err, scale, err / scale if scale else (0.0 if err == 0 else float("inf"))


def _check(case: str, name: str, out: Any, ref: Any, dtype: torch.dtype, exact: bool) -> str:
    r"""Mode ``name``'s ``out`` against the sequential module's ``ref``: ``"equal"``, ``"close(tol): rel"``, or raise.

    Modes that run the sequential module's own kernels (TF32 off: see
    :func:`main`) must match bit for bit. Fused and compiled modes may sum in
    another order (a batched matrix product, a grouped convolution, a Triton
    kernel, inductor's kernels), and so may pipelines (``exact=False``: a
    micro-batch may pick other kernels than the whole batch): each must come
    within ``_TOLERANCE[dtype]`` of the reference's largest magnitude. Scaled to
    it, not absolute: some cases' outputs are of magnitude 0.02-0.1, at which an
    absolute 1e-4 let a mode 0.1% off pass. ``rel`` is the error found, as that
    fraction: the margin a run leaves under the tolerance, kept in its results.
    """
    where = f"bench: case {case}, mode {name!r}"
    exact = exact and not name.startswith("compile") and "fuse" not in name
    if out.shape != ref.shape or out.dtype != ref.dtype:  # (allclose would broadcast)
        raise AssertionError(f"{where} returned {tuple(out.shape)} {out.dtype}, the sequential module "
                             f"{tuple(ref.shape)} {ref.dtype}")
    if exact and torch.equal(out, ref):
        return "equal"
    tol = _TOLERANCE[dtype]
    err, scale, rel = _error(out, ref)
    if not exact and err <= tol * scale:  # (NaN fails: every comparison with it is false)
        return f"close({tol:g}): {rel:.2g}"
    if exact:
        raise AssertionError(
            f"{where} differs from the sequential module (max abs error {err:.3g}, {rel:.3g} of the reference's "
            f"largest magnitude {scale:.3g}), where it must be bit-for-bit equal: it runs the same kernels in "
            f"{dtype} with TF32 off, so any difference is a bug in the mode, not rounding")
    raise AssertionError(
        f"{where} differs from the sequential module (max abs error {err:.3g}, {rel:.3g} of the reference's "
        f"largest magnitude {scale:.3g}; tolerance {tol:g} of it in {dtype}, for another summation order). "
        f"If the mode is right and only rounds differently here, widen bench._TOLERANCE[{dtype}]; otherwise "
        f"it computes something else")


def _sample(fn: Callable, x: torch.Tensor, group: int, cuda: bool, host: list[float] | None = None) -> float:
    r"""Mean seconds per call over ``group`` back-to-back calls.

    On CUDA, the GPU's time between an event before the calls and one after;
    ``host`` receives the CPU's mean time per call to enqueue them, which is
    what a module's own overhead costs (a GPU that keeps up waits for it).
    """
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(group):
            fn(x)
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        if host is not None:
            host.append((t1 - t0) / group)
        return start.elapsed_time(end) / 1e3 / group
    t0 = time.perf_counter()
    for _ in range(group):
        fn(x)
    return (time.perf_counter() - t0) / group


_PROBE: list[Any] = []  # the host probe's module and input, made at its first use


def _host_probe(calls: int = 20) -> float:
    r"""Seconds per call of a tiny ``nn.Linear`` on the CPU: how fast the host runs right now.

    Figures of CPU-bound modes (eager calls of small branches, graph replays
    of launch-bound ones) move with the host's speed, GPU-bound ones do not,
    so ratios between the two kinds move too. On the H100 machine each of
    the 16 vCPUs ran this call in about 10 us or about 16 us, switching
    between the two from one tenth of a second to the next (a shared host):
    the median of a case's probes, one per round of samples, says which
    speed its figures were measured at.
    """
    if not _PROBE:
        _PROBE[:] = [nn.Linear(16, 16), torch.randn(8, 16)]
    lin, x = _PROBE
    with torch.no_grad():
        t0 = time.perf_counter()
        for _ in range(calls):
            lin(x)
        return (time.perf_counter() - t0) / calls


def _floor(case: Case, device, dtype, x) -> Callable:
    r"""The longest single branch (behind the trunk, if any), captured alone in a graph: its replay.

    Which branch is longest is decided here, on a few samples; the replay is
    then timed with the modes, round by round, so that a slow spell of the
    host (the H100 machine's vCPUs have them) weighs on it as on them. Timed
    alone after the modes, it once came out at 108 us for an mlp8 branch that
    replays in 22 us.
    """
    replays = []
    for b in case.branches(device, dtype):
        replay = _capture(case.model(b, device, dtype), x, in_place=True)
        for _ in range(10):
            replay(x)
        replays.append((statistics.median(_sample(replay, x, 10, True) for _ in range(10)), replay))
    return max(replays, key=lambda r: r[0])[1]


def _parts(case: PipelineCase, device, dtype, x: torch.Tensor, group: int) -> dict[str, float]:
    r"""What a pipeline overlaps, each part timed alone on the whole batch: what overlapping can gain.

    A host-input case: the copy and the compute. Otherwise each stage, on the
    previous stage's output: micro-batches can at best hide all but the longest.
    """
    stages = case.stages(device, dtype)
    if case.host_input:
        seq = nn.Sequential(*stages)
        on_device = x.to(device)
        parts = {"copy_us": lambda t: t.to(device, non_blocking=True), "compute_us": lambda t: seq(on_device)}
    else:
        parts, value = {}, x
        for i, stage in enumerate(stages):
            parts[f"stage{i}_us"] = lambda t, stage=stage, value=value: stage(value)
            value = stage(value)
    return {k: 1e6 * statistics.median(_sample(fn, x, group, True) for _ in range(20)) for k, fn in parts.items()}


def _closest(widths: tuple[int, ...], time_of: Callable[[int], float], target: float) -> tuple[int, float]:
    r"""The width, and its time, among ``widths`` (ascending) whose time comes closest to ``target``.

    Times grow with the width: the search stops at the first width that takes
    ``target`` or longer, so a GPU much faster than the copy does not build
    every size.
    """
    best: tuple[int, float] | None = None
    for w in widths:
        t = time_of(w)
        if best is None or abs(t - target) < abs(best[1] - target):
            best = (w, t)
        if t >= target:
            break
    if best is None:
        raise ValueError("bench: a case to calibrate needs at least one width")
    return best


def _calibrated(case: PipelineCase, device, dtype, x: torch.Tensor) -> PipelineCase:
    r"""``case`` built at the width whose compute, on the whole batch, takes about as long as copying ``x`` in.

    The host-to-device goal is stated for a model whose compute takes about as
    long as the copy: the copy runs at the bus's speed, the compute at the
    GPU's, so no one model fits every machine (width 32 took 81% of the copy's
    time on the H100 machine, 73% on the H200).
    """
    def timed(fn: Callable) -> float:
        for _ in range(3):  # lazy initialisation, cuDNN's choice of kernels
            fn(x)
        return 1e6 * statistics.median(_sample(fn, x, 5, True) for _ in range(10))

    copy = timed(lambda t: t.to(device, non_blocking=True))
    on_device = x.to(device)

    def compute(width: int) -> float:
        seq = nn.Sequential(*dataclasses.replace(case, width=width).stages(device, dtype))
        return timed(lambda t: seq(on_device))

    width, _ = _closest(case.widths, compute, copy)
    return dataclasses.replace(case, width=width)


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self.t0 = total, 0, enabled, time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // self.total
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:5.0f}s {label:<28}")
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


def run_case(case: Case | PipelineCase, batch: int, dtype: torch.dtype, device: torch.device, reps: int, group: int,
             quick: bool, only: list[str] | None = None) -> dict[str, Any]:
    cuda = device.type == "cuda"
    x = case.make_input(batch, device, dtype)
    pipeline = isinstance(case, PipelineCase)
    if pipeline and cuda and case.host_input and case.widths:
        with torch.no_grad():
            case = _calibrated(case, device, dtype, x)
    train = not pipeline and case.train
    with torch.no_grad() if not train else contextlib.nullcontext():
        if train:
            modes = _train_modes(case, device, dtype)
        else:
            modes = _pipeline_modes(case, device, dtype, x) if pipeline else _modes(case, device, dtype, x, quick)
        if only:  # the reference always runs: every speed-up and check is relative to it
            kept = {k: v for k, v in modes.items() if k == "eager seq" or any(o in k for o in only)}
            if not any(o in k for k in modes for o in only):  # (a typo, or a CUDA mode on the CPU: not a table
                # of the reference alone in silence; "seq" naming the reference itself is no typo)
                print(f"bench: no mode of {case.name} contains {' or '.join(map(repr, only))}: only its reference "
                      f"runs; its modes here: {', '.join(modes)}", file=sys.stderr)
            modes = kept
        if train:
            for fn in modes.values():
                _warm_up(lambda: fn(x), 40 if cuda else 2)  # warm-up, as below
            # The same steps on the same fresh inputs in every mode, then compare.
            checks = _train_checks(modes, [case.make_input(batch, device, dtype) for _ in range(3)], dtype)
        else:
            # Checked on the timed input and on other values in it: graphed modes read
            # their input where it is, and a replay that missed new values would still
            # match on the values it was captured with.
            values, fresh = x.clone(), case.make_input(batch, device, dtype)

            def rewrite(value: torch.Tensor) -> None:
                # (A host input is read by copies still in flight: not written under them.)
                if cuda:
                    torch.cuda.synchronize()
                x.copy_(value)

            ref = modes["eager seq"](x)
            rewrite(fresh)
            ref_fresh = modes["eager seq"](x)
            rewrite(values)
            checks = {}
            for name, fn in modes.items():
                # Warm-up (lazy init, stream tuning, capture, compilation) calls
                # as the timing does: each output dropped before the next call,
                # as inside a model, so a graphed module lends its buffers
                # instead of copying them out, as it does while timed.
                # Then while a block still tries schedules.
                _warm_up(lambda: fn(x), 40 if cuda else 2)
                if name == "eager seq":
                    checks[name] = "reference"
                    continue
                # Pipelines: micro-batches may pick other kernels than the whole
                # batch, and transposed convolutions are not deterministic.
                label = f"{case.name!r} (batch {batch}, {str(dtype).replace('torch.', '')})"
                checks[name] = _check(label, name, fn(x), ref, dtype, not pipeline)
                rewrite(fresh)
                _check(f"{label} on new values in its input", name, fn(x), ref_fresh, dtype, not pipeline)
                rewrite(values)
        replay = _floor(case, device, dtype, x) if cuda and not pipeline and not train else None
        # Slow modes (a compute-bound call takes 20 ms) get fewer calls per
        # sample, and every mode more samples, so that each still sees >= 100
        # calls and the whole suite stays within minutes. Sized by each mode's
        # own call, not the case's slowest: a sample starts from an idle GPU,
        # which waits for the first call's host time, and that start weighs on
        # a sample in proportion to its calls' time only where its length, not
        # its number of calls, is fixed (graphed mlp16 timed in samples of 8
        # calls, as its eager reference's 2.5 ms call made them, took 1.16-1.24x
        # the floor, and 1.04-1.09x in samples of 20: tools/exp_bench_group.py).
        groups = {name: group for name in modes}
        if cuda:
            for name, fn in (*modes.items(), *((("floor", replay),) if replay is not None else ())):
                call = min(_sample(fn, x, 1, cuda) for _ in range(3))  # (one slow call would shrink it)
                groups[name] = max(1, min(group, round(_SAMPLE_S / call)))
            reps = max(reps, -(-_MIN_RUNS // min(groups.values())))
        samples: dict[str, list[float]] = {name: [] for name in modes}
        host: dict[str, list[float]] = {name: [] for name in modes}
        probes, floors = [], []
        for _ in range(reps):  # interleaved: every mode, and the floor, see the same conditions
            probes.append(_host_probe())
            for name, fn in modes.items():
                samples[name].append(_sample(fn, x, groups[name], cuda, host[name]))
            if replay is not None:
                floors.append(_sample(replay, x, groups["floor"], cuda))
        floor = statistics.median(floors) if floors else None
        parts = _parts(case, device, dtype, x, groups["eager seq"]) if cuda and pipeline else {}
    result: dict[str, Any] = {"case": case.name, "batch": batch, "dtype": str(dtype).replace("torch.", ""),
                              "shape": list(x.shape), "floor_us": floor and floor * 1e6, **parts,
                              **({"width": case.width} if pipeline and case.width is not None else {}),
                              "host_probe_us": statistics.median(probes) * 1e6, "modes": {}}
    base = statistics.median(samples["eager seq"])
    for name, s in samples.items():
        q = statistics.quantiles(s, n=4)
        med = statistics.median(s)
        schedules = _schedules(modes[name])
        result["modes"][name] = {
            "median_us": med * 1e6, "iqr_us": (q[2] - q[0]) * 1e6, "runs": len(s) * groups[name],
            "speedup_vs_eager_seq": base / med, "x_floor": med / floor if floor else None, "check": checks[name],
            "host_median_us": statistics.median(host[name]) * 1e6 if host[name] else None,
            **({"schedules": schedules} if schedules else {}),
        }
    return result


def _schedules(mode: Callable) -> list[str]:
    r"""How the ``Parallel`` of a mode ran, as ``explain()`` says (which capture variant a graph kept, say).

    A mode that is not a module (a training step, a graph captured by hand)
    names the module it runs as its ``module``.
    """
    mode = getattr(mode, "module", mode)
    blocks = [m for m in mode.modules() if isinstance(m, Parallel)] if isinstance(mode, nn.Module) else []
    return list(blocks[0].explain()["schedules"].values()) if blocks else []


def _environment(device: torch.device) -> dict[str, Any]:
    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
           "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
    else:
        env.update(cpu=platform.processor() or platform.machine())
    return env


def _table(results: list[dict[str, Any]]) -> str:
    # (Columns a space apart: a CPU run's medians of seconds fill the widths.)
    lines = [f"{'case':<10}{'batch':>6} {'dtype':<8}{'mode':<26} {'median us':>11} {'IQR':>9}"
             f"{'vs eager seq':>14}{'x floor':>9}  check"]
    for r in results:
        for name, m in r["modes"].items():
            xf = f"{m['x_floor']:.2f}" if m["x_floor"] else "-"
            lines.append(f"{r['case']:<10}{r['batch']:>6} {r['dtype']:<8}{name:<26} {m['median_us']:>11.1f}"
                         f" {m['iqr_us']:>9.1f}{m['speedup_vs_eager_seq']:>13.2f}x{xf:>9}  {m['check']}")
        if r["floor_us"]:
            lines.append(f"{'':<24}{'floor (longest branch, graphed)':<26}{r['floor_us']:>11.1f}")
        if r.get("host_probe_us"):  # (results saved before the probe existed have none)
            lines.append(f"{'':<24}{'host probe (CPU Linear)':<26}{r['host_probe_us']:>11.1f}")
        if "width" in r:
            lines.append(f"{'':<24}{'width (compute ~ copy)':<26}{r['width']:>11}")
        if "copy_us" in r:
            lines.append(f"{'':<24}{'alone: host-to-device copy':<26}{r['copy_us']:>11.1f}")
            lines.append(f"{'':<24}{'alone: compute':<26}{r['compute_us']:>11.1f}")
        stages = [v for k, v in r.items() if k.startswith("stage") and k.endswith("_us")]
        for i, us in enumerate(stages):
            lines.append(f"{'':<24}{f'alone: stage {i}':<26}{us:>11.1f}")
        if stages:
            # Every stage overlapped with the others, for free: only the longest remains.
            lines.append(f"{'':<24}{'bound: sum / longest':<26}{sum(stages) / max(stages):>10.2f}x")
    return "\n".join(lines)


def _fork_overhead(results: list[dict[str, Any]], key: str = "median_us") -> dict[int, float]:
    r"""Per side branch: eager ``Parallel(streams=True)`` of N tiny branches minus the sequential module, / (N - 1).

    ``key``: ``"host_median_us"`` for the CPU's time (the fork/join's own
    cost), ``"median_us"`` for the GPU's (which adds the latency of each
    cross-stream wait on the GPU).
    """
    out = {}
    for r in results:
        if r["case"].startswith("tiny") and "eager Parallel streams" in r["modes"]:
            n = int(r["case"][4:])
            m = r["modes"]
            out[n] = (m["eager Parallel streams"][key] - m["eager seq"][key]) / (n - 1)
    return out


def _unwritable(path: str) -> str | None:
    r"""Why ``path`` cannot be opened for writing, or ``None``; an existing file is left as it is.

    Tried by opening it, as the writes will: permissions (and root, who has
    them all), read-only file systems and special folders such as ``/proc``
    each refuse in their own way, which a check of the mode bits cannot tell.
    """
    # (The file the path names, a symbolic link's target too: a link to nothing is left as it was,
    # and the file the check made at its target removed.)
    target = os.path.realpath(path)
    existed = os.path.exists(target)
    try:
        with open(path, "a"):  # (appending truncates nothing)
            pass
    except OSError as e:
        return e.strerror or str(e)
    if not existed:
        os.remove(target)
    return None


def _write_json(path: str, env: dict[str, Any], results: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"environment": env, "results": results}, f, indent=1)


def _pyplot() -> Any:
    r"""``matplotlib.pyplot`` drawing to files, or ``SystemExit`` saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("bench: --plot needs matplotlib, which cannot be imported "
                         f"({e}): pip install 'parallel_modules[plot]', or leave out --plot") from e
    return plt


def _plot(results: list[dict[str, Any]], path: str) -> None:
    plt = _pyplot()
    labels = [f"{r['case']} b{r['batch']} {r['dtype']}" for r in results]
    # Every case's modes, in the order first met: cases differ in theirs (a pipeline's chunk counts, the
    # fused modes of identical branches, compiled modes), and the first case's alone left the others' out.
    modes = list(dict.fromkeys(m for r in results for m in r["modes"] if m != "eager seq"))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4))
    width = 0.8 / max(1, len(modes))
    # (Colours of a qualitative map with a colour for each mode, not the default cycle's ten, which
    # repeats past the tenth mode and gave two modes of one case one colour.)
    colours = plt.get_cmap("tab20" if len(modes) <= 20 else "turbo")
    for j, mode in enumerate(modes):
        # (A case without the mode gets no bar: NaN, where a 0 has no place on the log scale.)
        ys = [r["modes"].get(mode, {}).get("speedup_vs_eager_seq", float("nan")) for r in results]
        colour = colours(j if len(modes) <= 20 else j / max(1, len(modes) - 1))
        ax.bar([i + j * width for i in range(len(labels))], ys, width, label=mode, color=colour)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(labels))], labels, rotation=30, ha="right")
    ax.set_ylabel("speed-up over eager sequential")
    ax.set_yscale("log")
    # (Beside the axes, not over them: with every case's modes it covered the last cases' bars.)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


_GPU_ONLY = ("compute", "h2d", "conv4")  # cases the CPU suite skips


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="parallel-modules-bench", description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="Without a CUDA GPU: the reduced CPU suite (eager modes, float32, at most 5 samples of 2 calls; "
               f"{', '.join(_GPU_ONLY)} skipped), which checks every mode against the sequential module.")
    p.add_argument("--quick", action="store_true", help="fewer cases and runs, no torch.compile modes")
    p.add_argument("--case", action="append", choices=sorted({**CASES, **PIPELINES}),
                   help="run only this case; repeatable")
    p.add_argument("--batch", type=int, action="append",
                   help="run this batch size instead of the cases' own; repeatable")
    p.add_argument("--dtype", choices=sorted(_DTYPES), action="append",
                   help="run this dtype instead of the cases' own; repeatable")
    p.add_argument("--mode", action="append", metavar="TEXT",
                   help="run only the modes whose name contains TEXT (and 'eager seq'); repeatable")
    p.add_argument("--reps", type=int, default=None, help="samples per mode, each of --group calls (default 40, quick 20)")
    p.add_argument("--group", type=int, default=20, help="back-to-back calls per sample (default 20; fewer for modes "
                   "whose calls take milliseconds)")
    p.add_argument("--json", metavar="PATH", help="write every figure and the environment as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of the speed-ups (needs matplotlib)")
    return p


def main(argv: list[str] | None = None) -> int:
    r"""Run the benchmark with the command line ``argv`` (``sys.argv[1:]`` when ``None``); returns the exit status."""
    p = _parser()
    args = p.parse_args(argv)
    if args.reps is not None and args.reps < 2:
        p.error(f"--reps must be at least 2 (medians and spreads need two samples), got {args.reps}")
    if args.group < 1:
        p.error(f"--group must be at least 1 (calls per sample), got {args.group}")
    if args.batch and min(args.batch) < 1:
        p.error(f"--batch must be at least 1, got {min(args.batch)}")
    for flag, path, example in (("--json", args.json, "bench.json"), ("--plot", args.plot, "bench.png")):
        # Before minutes of measurements, not after the first case.
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            p.error(f"cannot write {path!r}: its folder {os.path.dirname(os.path.abspath(path))!r} does not exist")
        if path and os.path.isdir(path):
            p.error(f"{flag} {path!r} is a folder: give a file in it, e.g. {os.path.join(path, example)!r}")
        if path and (why := _unwritable(path)):
            p.error(f"{flag}: cannot write {path!r} ({why}); give a path in a folder you can write to")
    if args.json and args.plot and os.path.abspath(args.json) == os.path.abspath(args.plot):
        # The plot, written last, would replace the figures.
        p.error(f"--json and --plot both name {args.json!r}: give each its own file")
    if args.plot:
        _pyplot()  # (matplotlib missing: said now, not after the measurements)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    quick = args.quick or not cuda
    reps = args.reps or (20 if quick else 40)
    if not cuda:
        print("bench: no CUDA GPU found: running the reduced CPU suite, which checks every mode's output "
              "against the sequential module. Streams and CUDA graphs need a CUDA GPU.")
        reps, args.group = min(reps, 5), min(args.group, 2)  # a check of every mode, and rough CPU timings
    every = {**CASES, **PIPELINES}
    names = args.case or [n for n, c in every.items() if c.quick or not quick]
    if not cuda:
        skipped = [n for n in names if n in _GPU_ONLY]
        names = [n for n in names if n not in _GPU_ONLY]
        if skipped:
            print(f"bench: skipping {', '.join(skipped)} without a CUDA GPU (too slow on a CPU, or host-to-device)")
        if args.dtype and set(args.dtype) != {"fp32"}:
            print("bench: the CPU suite runs float32 only")
        if not names:
            print("bench: nothing left to run", file=sys.stderr)
            return 2
    work = []
    for n in names:
        case = every[n]
        dtypes = [_DTYPES[d] for d in args.dtype] if args.dtype else list(case.dtypes)
        if not cuda:
            dtypes = [d for d in dtypes if d == torch.float32] or [torch.float32]
        batches = args.batch or (case.batches if not quick else case.batches[:2])
        work += [(case, b, d) for b in batches for d in dtypes]
    progress = _Progress(len(work), enabled=sys.stderr.isatty() or cuda)
    results = []
    for case, b, d in work:
        results.append(run_case(case, b, d, device, reps, args.group, quick, args.mode))
        if args.json:  # after every case: a crash later on keeps what was measured
            _write_json(args.json, _environment(device), results)
        progress.step(f"{case.name} b{b} {str(d).replace('torch.', '')}")
    env = _environment(device)
    print(f"parallel_modules benchmark  {env}")
    print(_table(results))
    for key, what in (("host_median_us", "CPU time"), ("median_us", "GPU time")):
        overhead = _fork_overhead(results, key)
        if overhead:
            print(f"fork/join overhead per side branch, {what} (eager Parallel streams=True minus eager seq, / (N-1)): "
                  + ", ".join(f"N={n}: {us:.1f} us" for n, us in overhead.items()))
    if args.json:
        _write_json(args.json, env, results)
    if args.plot:
        _plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
