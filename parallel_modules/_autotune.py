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
as without tuning. Each call's cost is estimated without synchronizing (a
schedule is chosen once the GPU has run the timed calls) as
``max(CPU time to launch it, GPU time between its first and last kernel)``,
the time a call takes in a steady stream of calls -- with the CPU time
weighted by ``_CPU_WEIGHT``: a schedule is kept for the rest of the run, while
the host's speed varies (1.7x between two leases of one GPU machine) and the
rest of the model needs the CPU too. On the H100 machine the Inception block
at batch 8 forked in 398 us of GPU time against 404 us sequentially, but
took 396 us of CPU against 317 us: timed as equal costs, noise kept forking
in one trial of four, and on a slower host that choice ran 19% slower than
sequential. Weighted, a schedule that saves GPU time only by spending more
CPU is kept only when it saves clearly more than it spends.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
import threading
import time
import weakref
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import torch

from ._inputs import _bounded_add

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
# Signatures being tuned at once per module. Beyond this, a trial not called during
# the last _IDLE_CALLS calls of the module's tuner is dropped (a signature seen a few
# times, then no more); if none is, the new signature keeps the plain sequential
# schedule at once. (Dropping the oldest trial instead, shapes cycling through more
# signatures than this would never end a trial, every call paying for tuning.)
_MAX_TRIALS = 256
_IDLE_CALLS = 16 * _MAX_TRIALS
# A timed call inside which another tuner tried a schedule (a block nested in a
# branch, called once per call of this one, trying its own schedules at the same
# calls) is not a sample: the inner block's schedule would follow this one's turn
# by turn, so that only two of the four combinations were ever timed. Such calls
# are sampled anyway once this many rounds of samples were dropped (an inner block
# that never decides); each dropped call makes the trial one call longer.
_NESTED_ROUNDS = 2


class _Trying(threading.local):
    calls = 0  # calls of any tuner on this thread that tried a schedule: see _NESTED_ROUNDS


_trying = _Trying()
# How much more a microsecond of the host's CPU counts than one of the GPU (see above).
_CPU_WEIGHT = 1.2


class _Timing(NamedTuple):
    r"""A schedule's cost per call as compared, and its medians of CPU and GPU time (seconds)."""

    cost: float
    cpu: float
    gpu: float


class _Trial:
    __slots__ = ("count", "candidates", "samples", "last", "dropped")

    def __init__(self, candidates: Sequence[Hashable]) -> None:
        self.count = 0
        self.dropped = 0  # timed calls not sampled: see _NESTED_ROUNDS
        self.last = 0  # the tuner's call count at this trial's latest call
        self.candidates = tuple(candidates)
        # schedule -> list of (cpu seconds, start event, end event)
        self.samples: dict[Hashable, list] = {c: [] for c in self.candidates}

    def ready(self) -> bool:
        r"""Whether the GPU has run the first ``_SAMPLES`` timed calls of every schedule that has samples.

        Deciding before that would wait for the GPU to drain its queue (an
        event's ``synchronize``): the deciding call would block the host for
        up to a whole queue of work, a stall no other call has. Until then
        the trial goes on, each call one more sample.
        """
        return all(not samples or samples[min(len(samples), _SAMPLES) - 1][2].query()
                   for samples in self.samples.values())

    def timing(self, schedule: Hashable) -> _Timing:
        cpus, gpus = [], []
        for cpu, start, end in self.samples[schedule][:_SAMPLES]:
            end.synchronize()
            cpus.append(cpu)
            gpus.append(start.elapsed_time(end) / 1e3)
        # Per call, then the median: a call the host ran slowly weighs as one sample.
        cost = statistics.median(max(_CPU_WEIGHT * c, g) for c, g in zip(cpus, gpus))
        return _Timing(cost, statistics.median(cpus), statistics.median(gpus))


# Every tuner alive: a profiler's warm-up (``timeline.record_timeline``) sees whether a call of
# any callable still tried schedules, without finding the blocks inside it.
_tuners: weakref.WeakSet[_ScheduleTuner] = weakref.WeakSet()


def _tuned_calls() -> int:
    r"""Calls that every tuner alive has run: a call that moves it tried schedules (see ``timeline``)."""
    while True:
        try:
            return sum([t.calls for t in list(_tuners)])
        except RuntimeError:  # ("set changed size during iteration": another thread made a block)
            continue


class _ScheduleTuner:
    r"""Per-signature trials of candidate schedules; the caller keeps the decisions."""

    def __init__(self) -> None:
        # In the order of their latest calls, the idlest first (see _room).
        self.trials: OrderedDict[Hashable, _Trial] = OrderedDict()
        # The median cost measured for each candidate, per decided signature:
        # ``explain()`` shows it, so a user can see why a schedule was kept.
        self.costs: dict[Hashable, dict[Hashable, _Timing]] = {}
        self._lock = threading.Lock()  # calls from several threads share the trials
        self.calls = 0  # calls run through ``run``: those that tried a schedule, or were decided by it
        _tuners.add(self)

    def clear(self) -> None:
        self.trials.clear()
        self.costs.clear()

    def forget(self, key: Hashable) -> None:
        r"""Drop the trial of ``key``, if any (another thread's call may be timing it)."""
        with self._lock:
            self.trials.pop(key, None)

    def _room(self) -> bool:
        r"""Whether a new trial may start, dropping an idle one if the table is full (lock held)."""
        if len(self.trials) < _MAX_TRIALS:
            return True
        idle = next(iter(self.trials))
        if self.calls - self.trials[idle].last <= _IDLE_CALLS:
            return False
        del self.trials[idle]
        return True

    def run(self, key: Hashable, stream: torch.cuda.Stream, candidates: Sequence[Hashable],
            run: Callable[[Hashable], Any]) -> tuple[Any, Hashable | None]:
        r"""Run one call of signature ``key`` with the schedule whose turn it is, and time it.

        Returns the call's outputs and, once enough calls were timed, the
        chosen schedule (``None`` before that).
        """
        with self._lock:
            self.calls += 1
            trial = self.trials.get(key)
            full = trial is None and not self._room()
            if not full:
                if trial is None or trial.candidates != tuple(candidates):
                    trial = self.trials[key] = _Trial(candidates)
                self.trials.move_to_end(key)
                trial.last = self.calls
                k = len(trial.candidates)
                schedule = trial.candidates[trial.count % k]
                keep = trial.count >= k * _WARMUP
                trial.count += 1
        if full:  # (every trial still in use: see _MAX_TRIALS)
            return run(candidates[0]), candidates[0]
        trying = _trying
        trying.calls += 1
        if not keep:
            return run(schedule), None
        mark = trying.calls
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t0 = time.perf_counter()
        out = run(schedule)  # (a call that raises leaves no sample)
        cpu = time.perf_counter() - t0
        end.record(stream)
        with self._lock:
            if trying.calls == mark or trial.dropped >= k * _NESTED_ROUNDS * _SAMPLES:
                trial.samples[schedule].append((cpu, start, end))
            else:
                trial.dropped += 1
            if (trial.count < k * (_WARMUP + _SAMPLES) + trial.dropped or self.trials.get(key) is not trial
                    or not trial.ready()):
                return out, None  # more to time, another thread's call decided, or the GPU is behind
            del self.trials[key]
        baseline = trial.candidates[0]
        # Only schedules that ran: one that raised on every call (a fork refuses a branch
        # that changes its input in place) is never kept; one bad call costs one sample.
        costs = {c: trial.timing(c) for c in trial.candidates if trial.samples[c]}
        if not costs:
            return out, baseline
        with self._lock:
            _bounded_add(self.costs, key, costs, limit=_MAX_TRIALS)
        return out, _choose(costs, baseline)


def _choose(costs: dict[Hashable, _Timing], baseline: Hashable) -> Hashable:
    # The cheapest schedule, if it beats ``baseline`` (the plain sequential one) by ``_MARGIN``.
    best = min(costs, key=lambda c: costs[c].cost)
    if baseline not in costs:  # (it raised)
        return best
    return best if costs[best].cost < _MARGIN * costs[baseline].cost else baseline


# Calls ``_warm_up`` adds while a block still tries schedules: a trial of four candidates
# (the most ``Parallel`` has) takes 56 calls, up to twice its samples more while a nested
# block tries its own (see _NESTED_ROUNDS), and waits for the GPU to run its timed calls.
_MAX_EXTRA_WARMUP = 4 * (_WARMUP + (1 + _NESTED_ROUNDS) * _SAMPLES) + 8


def _warm_up(call: Callable[[], Any], warmup: int) -> int:
    r"""Calls ``call`` ``warmup`` times, then while its last call still tried schedules; returns the calls made.

    A call tried schedules when it advanced a schedule tuner (``streams`` or
    ``fuse="auto"``): any tuner, since ``call`` may run any blocks. A trial
    left unfinished for another input signature does not advance, so it does
    not prolong the warm-up. (The profiler's and the benchmark's warm-up:
    what they time must be the schedules kept.)
    """
    before = _tuned_calls()
    for _ in range(warmup):
        before = _tuned_calls()
        call()
    calls = warmup
    while warmup and calls < warmup + _MAX_EXTRA_WARMUP and _tuned_calls() != before:
        before = _tuned_calls()
        call()
        calls += 1
    return calls
