r"""Deciding, per input signature, whether forking onto side streams pays.

Side streams help when branches leave the GPU underfilled and the GPU, not
the CPU, sets the pace. They cost CPU time (events, stream switches) and help
nothing when each branch fills the GPU or when the CPU cannot launch kernels
as fast as the GPU runs them. Which case holds depends on the branches, the
shapes, the GPU and the CPU, so, like ``torch.backends.cudnn.benchmark``, the
module measures it: the first calls of a new signature alternate between the
sequential and the forked schedule, and the faster one is kept.

The measurements are taken on the user's real calls -- nothing runs twice, so
modules with side effects (BatchNorm statistics, dropout RNG) behave exactly
as without tuning. Each call's cost is estimated without synchronizing as
``max(CPU time to launch it, GPU time between its first and last kernel)``,
the time a call takes in a steady stream of calls.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable

import torch

__all__: list[str] = []

# Discard the first call of each schedule (cuDNN/cuBLAS heuristics, stream
# creation, lazy module initialisation), then time this many of each. With 5
# the H100 machine's noisy CPU once kept the slower schedule (inception, batch
# 8, fp16: 0.89x); the calls are the user's own, so more samples cost nothing.
_WARMUP = 1
_SAMPLES = 12
# Forking must win by this much to be kept: a schedule that only ties costs
# CPU time the next layer could use, and measurements are noisy.
_MARGIN = 0.97
# Signatures remembered per module; beyond this the oldest is forgotten.
_MAX_SIGNATURES = 256


class _Trial:
    __slots__ = ("count", "samples")

    def __init__(self) -> None:
        self.count = 0
        # forked -> list of (cpu seconds, start event, end event)
        self.samples: dict[bool, list] = {False: [], True: []}

    def cost(self, forked: bool) -> float:
        costs = []
        for cpu, start, end in self.samples[forked]:
            end.synchronize()
            costs.append(max(cpu, start.elapsed_time(end) / 1e3))
        return statistics.median(costs)


class _StreamTuner:
    r"""Per-signature choice between sequential and forked execution."""

    def __init__(self, on_decided: Callable[[Hashable, bool], None]) -> None:
        self.decisions: dict[Hashable, bool | _Trial] = {}
        self._on_decided = on_decided

    def clear(self) -> None:
        self.decisions.clear()

    def decided(self, key: Hashable) -> bool | None:
        d = self.decisions.get(key)
        return d if isinstance(d, bool) else None

    def run(self, key: Hashable, stream: torch.cuda.Stream, sequential, forked):
        r"""Run one undecided call with the schedule whose turn it is, and time it."""
        trial = self.decisions.get(key)
        if not isinstance(trial, _Trial):
            if len(self.decisions) >= _MAX_SIGNATURES:
                self.decisions.pop(next(iter(self.decisions)))
            trial = self.decisions[key] = _Trial()
        use_fork = trial.count % 2 == 1
        keep = trial.count >= 2 * _WARMUP
        trial.count += 1
        if not keep:
            return forked() if use_fork else sequential()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t0 = time.perf_counter()
        out = forked() if use_fork else sequential()
        cpu = time.perf_counter() - t0
        end.record(stream)
        trial.samples[use_fork].append((cpu, start, end))
        if trial.count >= 2 * (_WARMUP + _SAMPLES):
            forked = trial.cost(True) < _MARGIN * trial.cost(False)
            self.decisions[key] = forked
            self._on_decided(key, forked)
        return out
