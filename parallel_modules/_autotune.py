r"""Choosing, per input signature, how a ``Parallel`` schedules its branches.

A schedule is a pair ``(fused, forked)``: whether groups of identical branches
run as one batched computation, and whether units run on side streams. Side
streams help when branches leave the GPU underfilled and the GPU, not the CPU,
sets the pace; they cost CPU time (events, stream switches) and help nothing
when each branch fills the GPU or when the CPU cannot launch kernels as fast as
the GPU runs them. Fusion cuts launches but may pick slower kernels (grouped
convolutions). Which schedule wins depends on the branches, the shapes, the GPU
and the CPU, so, like ``torch.backends.cudnn.benchmark``, the module measures
it: the first calls of a new signature cycle through the candidate schedules,
and the fastest is kept.

The measurements are taken on the user's real calls -- nothing runs twice, so
modules with side effects (BatchNorm statistics, dropout RNG) behave exactly
as without tuning. Each call's cost is estimated without synchronizing as
``max(CPU time to launch it, GPU time between its first and last kernel)``,
the time a call takes in a steady stream of calls.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Hashable, Sequence

import torch

__all__: list[str] = []

# Discard the first calls of each schedule (cuDNN/cuBLAS heuristics, a
# workspace per new stream, stream creation, lazy module initialisation), then
# time this many of each. With 1 and 5 the H100 machine's noisy CPU once kept
# the slower schedule (inception, batch 8, fp16: 0.89x); the calls are the
# user's own, so more samples cost nothing.
_WARMUP = 2
_SAMPLES = 12
# A schedule must beat the first candidate (the plain sequential one) by this
# much to be kept: a schedule that only ties costs CPU time the next layer
# could use, and measurements are noisy.
_MARGIN = 0.97
# Signatures being tuned at once per module; beyond this the oldest trial is dropped.
_MAX_TRIALS = 256


class _Trial:
    __slots__ = ("count", "candidates", "samples")

    def __init__(self, candidates: Sequence[Hashable]) -> None:
        self.count = 0
        self.candidates = tuple(candidates)
        # schedule -> list of (cpu seconds, start event, end event)
        self.samples: dict[Hashable, list] = {c: [] for c in self.candidates}

    def cost(self, schedule: Hashable) -> float:
        costs = []
        for cpu, start, end in self.samples[schedule]:
            end.synchronize()
            costs.append(max(cpu, start.elapsed_time(end) / 1e3))
        return statistics.median(costs)


class _ScheduleTuner:
    r"""Per-signature trials of candidate schedules; the caller keeps the decisions."""

    def __init__(self) -> None:
        self.trials: dict[Hashable, _Trial] = {}
        # The median cost measured for each candidate, per decided signature:
        # ``explain()`` shows it, so a user can see why a schedule was kept.
        self.costs: dict[Hashable, dict[Hashable, float]] = {}

    def clear(self) -> None:
        self.trials.clear()
        self.costs.clear()

    def run(self, key: Hashable, stream: torch.cuda.Stream, candidates: Sequence[Hashable],
            run: Callable[[Hashable], Any]) -> tuple[Any, Hashable | None]:
        r"""Run one call of signature ``key`` with the schedule whose turn it is, and time it.

        Returns the call's outputs and, once enough calls were timed, the
        chosen schedule (``None`` before that).
        """
        trial = self.trials.get(key)
        if trial is None or trial.candidates != tuple(candidates):
            if len(self.trials) >= _MAX_TRIALS:
                self.trials.pop(next(iter(self.trials)))
            trial = self.trials[key] = _Trial(candidates)
        k = len(trial.candidates)
        schedule = trial.candidates[trial.count % k]
        keep = trial.count >= k * _WARMUP
        trial.count += 1
        if not keep:
            return run(schedule), None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t0 = time.perf_counter()
        out = run(schedule)
        cpu = time.perf_counter() - t0
        end.record(stream)
        trial.samples[schedule].append((cpu, start, end))
        if trial.count < k * (_WARMUP + _SAMPLES):
            return out, None
        del self.trials[key]
        costs = {c: trial.cost(c) for c in trial.candidates}
        if len(self.costs) >= _MAX_TRIALS:
            self.costs.pop(next(iter(self.costs)))
        self.costs[key] = costs
        best = min(costs, key=costs.__getitem__)
        baseline = trial.candidates[0]
        return out, (best if costs[best] < _MARGIN * costs[baseline] else baseline)
