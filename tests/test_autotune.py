r"""The schedule tuner's decision rule (``streams="auto"``/``fuse="auto"``), on recorded timings.

The CUDA tests run the tuner on real calls; these feed it timings measured on the H100 machine
(microseconds per call) through stand-ins for CUDA events, so the rule is checked on the CPU.
"""
from __future__ import annotations

import pytest

from parallel_modules import _autotune
from parallel_modules._autotune import _choose, _Trial

SEQ, FORK = "sequential", "streams"


class _Stamp:
    r"""Stands in for a pair of timing events: ``start.elapsed_time(end)`` in milliseconds."""

    def __init__(self, us: float) -> None:
        self.us = us

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_Stamp") -> float:
        return end.us / 1e3


def _trial(**per_call: tuple[float, float]) -> _Trial:
    r"""A trial whose every call of a schedule took (CPU us, GPU us), with a little noise around it."""
    trial = _Trial(list(per_call))
    for schedule, (cpu, gpu) in per_call.items():
        for wobble in (0.98, 1.0, 1.02, 0.99, 1.01):
            trial.samples[schedule].append((cpu * wobble / 1e6, _Stamp(0.0), _Stamp(gpu * wobble)))
    return trial


def _decide(trial: _Trial) -> str:
    return _choose({c: trial.timing(c) for c in trial.candidates}, SEQ)


def test_timing_reports_the_medians_of_cpu_and_gpu_time():
    timing = _trial(sequential=(300.0, 400.0)).timing(SEQ)
    assert timing.cpu == pytest.approx(300e-6) and timing.gpu == pytest.approx(400e-6)
    assert timing.cost == pytest.approx(400e-6)  # GPU-bound: 1.2 x 300 us of CPU is still less


def test_forking_that_saves_little_gpu_time_for_much_cpu_is_not_kept(monkeypatch):
    # Inception, batch 8, fp32, one tuning trial on the H100 machine: forking looked 6% cheaper
    # (404 against 429 us) by GPU time, at 21% more CPU; on a slower host it ran at 0.81x.
    trial = dict(sequential=(330.0, 428.7), streams=(400.0, 404.1))
    assert _decide(_trial(**trial)) == SEQ
    monkeypatch.setattr(_autotune, "_CPU_WEIGHT", 1.0)  # the rule before the CPU was weighted
    assert _decide(_trial(**trial)) == FORK


def test_forking_that_saves_clearly_more_gpu_time_than_it_costs_is_kept():
    # Four identical conv branches, batch 8: 10% less GPU time for 26% more CPU, still GPU-bound.
    assert _decide(_trial(sequential=(403.0, 634.6), streams=(507.6, 573.4))) == FORK


def test_cpu_bound_calls_keep_the_cheaper_cpu_schedule():
    # Two tiny branches: every call waits for the CPU, and forking only adds to it.
    assert _decide(_trial(sequential=(67.0, 68.0), streams=(112.0, 113.0))) == SEQ
    # A fused schedule launching fewer kernels wins on CPU alone.
    fused = _trial(sequential=(1200.0, 1205.0), fused=(236.0, 240.0))
    assert _choose({c: fused.timing(c) for c in fused.candidates}, SEQ) == "fused"


def test_a_win_inside_the_margin_keeps_the_sequential_schedule():
    assert _decide(_trial(sequential=(100.0, 500.0), streams=(100.0, 490.0))) == SEQ  # 2% < 3%
    assert _decide(_trial(sequential=(100.0, 500.0), streams=(100.0, 480.0))) == FORK  # 4%


# ----------------------------------------------------------------------------------------------
# The tuner inside Parallel, on the CPU: CUDA-only pieces replaced by stand-ins.

import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from parallel_modules import Parallel  # noqa: E402
from parallel_modules import parallel as _parallel  # noqa: E402
from parallel_modules._autotune import _SAMPLES, _WARMUP, _ScheduleTuner  # noqa: E402

_TRIAL = 2 * (_WARMUP + _SAMPLES)  # calls of a trial of two schedules


class _HostEvent:
    r"""``torch.cuda.Event`` on the host clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3


@pytest.fixture
def host_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)


@pytest.fixture
def forks(monkeypatch, host_events):
    r"""Inputs taken for CUDA inputs; a fork runs the branches in turn, is counted, and raises as
    the real one does for a branch that changes the input in place; timing always prefers forking."""
    seen: list[int] = []
    monkeypatch.setattr(_parallel, "_input_device", lambda a, k: torch.device("cuda", 0))
    monkeypatch.setattr(_parallel, "_check_devices", lambda *a: None)
    monkeypatch.setattr(_parallel, "_current_stream", lambda d: None)
    monkeypatch.setattr(_parallel, "_current_device", lambda: 0)
    monkeypatch.setattr(_parallel, "_capture_underway", lambda: False)

    def run_forked(calls, device, run, capturing, inputs, join, high, order, args, kwargs, error):
        seen.append(1)
        watched = [a for a in args if isinstance(a, torch.Tensor) and not a.is_inference()]
        versions = [a._version for a in watched]
        outs = [run(i, c) if run is not None else c(*args, **kwargs) for i, c in enumerate(calls)]
        if versions != [a._version for a in watched]:
            raise RuntimeError("a branch changed its input in place")
        return outs if join is None else join(outs)

    monkeypatch.setattr(_parallel, "_run_forked", run_forked)
    monkeypatch.setattr(_parallel, "_fork_join", lambda calls, device, args, kwargs, join, error: run_forked(
        calls, device, None, False, (), join, 0, None, args, kwargs, error))
    monkeypatch.setattr(_autotune, "_choose", lambda costs, baseline: next((c for c in costs if c.forked), baseline))
    return seen


def test_a_schedule_that_raises_is_never_kept(host_events):
    # Before: the deciding call, after its work ran, raised StatisticsError on the failed schedule's empty samples.
    tuner, calls = _ScheduleTuner(), []

    def run(s: str) -> str:
        calls.append(s)
        if s == "fork":
            raise RuntimeError("fork refused")
        return "out"

    for _ in range(_TRIAL):
        try:
            tuner.run("k", None, ["seq", "fork"], run)
        except RuntimeError:
            pass
    out, decided = tuner.run("k", None, ["seq", "fork"], run)
    assert (out, decided, calls[-1]) == ("out", "seq", "seq")


def test_signatures_cycling_past_the_trial_table_still_decide(host_events, monkeypatch):
    # Shapes cycling through more signatures than the table holds: before, each new one
    # dropped the oldest trial, so no trial ever ended and every call paid for tuning.
    # Now the overflow keeps the sequential schedule at once, and the others decide.
    monkeypatch.setattr(_autotune, "_MAX_TRIALS", 3)
    monkeypatch.setattr(_autotune, "_IDLE_CALLS", 100)
    tuner, decided = _ScheduleTuner(), {}
    for _ in range(_TRIAL):
        for key in "abcde":
            if key not in decided:
                out, choice = tuner.run(key, None, ["seq", "fork"], lambda s: s)
                if choice is not None:
                    decided[key] = choice
    assert decided["d"] == decided["e"] == "seq" and set(decided) == set("abcde")
    assert not tuner.trials and set(tuner.costs) == set("abc")  # a, b and c were timed to the end


def test_a_trial_left_idle_makes_room(host_events, monkeypatch):
    # A signature seen a few times and then no more does not hold its place forever.
    monkeypatch.setattr(_autotune, "_MAX_TRIALS", 1)
    monkeypatch.setattr(_autotune, "_IDLE_CALLS", 5)
    tuner = _ScheduleTuner()
    tuner.run("once", None, ["seq", "fork"], lambda s: s)
    assert tuner.run("new", None, ["seq", "fork"], lambda s: s)[1] == "seq"  # "once" is still recent
    for _ in range(5):
        tuner.run("once", None, ["seq", "fork"], lambda s: s)
    for _ in range(5):  # the table is full, "once" recent: each decided at once
        assert tuner.run("other", None, ["seq", "fork"], lambda s: s)[1] == "seq"
    assert tuner.run("new", None, ["seq", "fork"], lambda s: s)[1] is None  # "once" idle: "new" is tried
    assert set(tuner.trials) == {"new"}


def test_two_threads_finishing_one_trial_both_return(host_events):
    # Before: the second call to reach the count deleted the trial again (KeyError).
    tuner = _ScheduleTuner()
    for _ in range(_TRIAL - 2):
        tuner.run("k", None, ["seq", "fork"], lambda s: s)
    inside, release, errors = threading.Event(), threading.Event(), []

    def slow(s: str) -> str:
        inside.set()
        release.wait(5)
        return s

    def worker() -> None:
        try:
            tuner.run("k", None, ["seq", "fork"], slow)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(5)
    assert tuner.run("k", None, ["seq", "fork"], lambda s: s)[1] is not None
    release.set()
    t.join(5)
    assert not errors, errors


def test_auto_keeps_branches_sequential_when_one_changes_the_input_in_place(forks):
    # Before: every forked call of the trial raised (the fork refuses it), then the decision did.
    p = Parallel(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4)), nn.Linear(4, 4), streams="auto")
    with torch.no_grad():
        for _ in range(_TRIAL + 4):
            x = torch.randn(2, 4)
            expected = torch.cat([p[0](x.clone()), p[1](x.clone().relu())], 1)
            torch.testing.assert_close(p(x), expected, rtol=0, atol=0)
    assert not forks
    assert p._plans and not any(plan.forked for plan in p._plans.values())


def test_outputs_recording_through_a_closure_tensor_are_tuned_once(forks):
    # The weight is neither a parameter nor an input: "auto" offered forking, chose it,
    # then saw the outputs record and started over, call after call.
    w = torch.randn(4, 4, requires_grad=True)
    p = Parallel(lambda x: x @ w, lambda x: x @ w.t(), streams="auto")
    x = torch.randn(2, 4)
    for _ in range(4 * _TRIAL):
        torch.testing.assert_close(p(x), torch.cat([x @ w, x @ w.t()], 1), rtol=0, atol=0)
    assert p._tuner.calls <= 2 * _TRIAL and p._plans
    assert not any(plan.forked for plan in p._plans.values())


def test_a_fork_chosen_while_frozen_is_dropped_when_training_starts(forks):
    p = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), streams="auto")
    p.requires_grad_(False)  # a frozen backbone: forking may be chosen
    x = torch.randn(2, 4)
    for _ in range(_TRIAL):
        p(x)
    assert any(plan.forked for plan in p._plans.values())
    p.requires_grad_(True)  # same signature; "auto" does not fork in training
    forks.clear()
    # Seen on the first call's outputs (which require grad now): that call still forks
    # (correct, as streams=True is), and the plan is dropped; the next calls do not fork.
    p(x).sum().backward()
    assert len(forks) == 1 and not any(plan.forked for plan in p._plans.values())
    for _ in range(_TRIAL):
        p(x).sum().backward()
    assert len(forks) == 1 and p._plans and not any(plan.forked for plan in p._plans.values())
    assert p[0].weight.grad is not None


def test_a_fork_dropped_across_a_setting_change_is_not_kept(forks):
    # Before: a call of a signature "auto" had forked while frozen, which saw its outputs record
    # (training had started), kept the signature's plan without the fork, even when another
    # thread set fuse=True while the branches ran: the unfused plan landed among those made
    # anew for fuse=True, and the signature's calls never ran the branches fused.
    inside, go = threading.Event(), threading.Event()

    class Gated(nn.Module):  # alike: fuse=True groups them
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if threading.current_thread() is not threading.main_thread():
                inside.set()
                assert go.wait(5)
            return self.lin(x)

    torch.manual_seed(0)
    p = Parallel(Gated(), Gated(), streams="auto")
    p.requires_grad_(False)
    x = torch.randn(2, 4)
    for _ in range(_TRIAL):
        p(x)
    assert any(plan.forked for plan in p._plans.values())
    p.requires_grad_(True)
    outputs = []
    t = threading.Thread(target=lambda: outputs.append(p(x)))
    t.start()
    try:
        assert inside.wait(5)
        p.fuse = True  # set by another thread while the call runs
    finally:
        go.set()
        t.join(5)
    assert not t.is_alive() and len(outputs) == 1 and outputs[0].requires_grad
    expected = torch.cat([b.lin(x) for b in p], 1)
    torch.testing.assert_close(outputs[0], expected, rtol=0, atol=0)
    for _ in range(2):
        torch.testing.assert_close(p(x), expected)
    assert p.explain()["fused"] == [["0", "1"]]
    assert p._plans and all(plan.fused for plan in p._plans.values())


def test_a_decision_made_across_a_setting_change_is_dropped(forks):
    gate_in, gate_out, count = threading.Event(), threading.Event(), [0]

    class Gate(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            count[0] += 1
            if count[0] == 2 * _TRIAL - 1:  # the trial's last call, in its second branch
                gate_in.set()
                gate_out.wait(5)
            return x

    p = Parallel(Gate(), Gate(), streams="auto")
    x = torch.randn(2, 4)

    def call() -> None:
        with torch.no_grad():
            p(x)

    for _ in range(_TRIAL - 1):
        call()
    t = threading.Thread(target=call)
    t.start()
    gate_in.wait(5)
    p.streams = False  # set by another thread while the deciding call runs
    gate_out.set()
    t.join(5)
    forks.clear()
    call()
    assert not forks


def test_fuse_auto_does_not_tune_fusion_under_deterministic_algorithms(forks):
    p = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), fuse="auto", streams=False)
    fusion = p._fusion_for((torch.randn(2, 4),), {})
    assert [c.fused for c in p._candidates(fusion, (), {})] == [False, True]
    torch.use_deterministic_algorithms(True)
    try:
        assert [c.fused for c in p._candidates(fusion, (), {})] == [False]
        assert p._graph_variants((torch.randn(2, 4),), {}) == [("unfused",)]
    finally:
        torch.use_deterministic_algorithms(False)


def test_one_failed_call_of_the_baseline_does_not_bias_the_choice(monkeypatch):
    # A bad batch raised once on the sequential schedule's turn; forking is twice as slow.
    times, current = {"seq": 1.0, "fork": 2.0}, {}

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            pass

        def record(self, stream=None) -> None:
            self.schedule = current["s"]

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end) -> float:
            return times[end.schedule]

    monkeypatch.setattr(torch.cuda, "Event", Event)
    tuner = _ScheduleTuner()

    def run(s: str, fail: bool = False) -> str:
        current["s"] = s
        if fail:
            raise ValueError("one bad batch")
        return s

    with pytest.raises(ValueError):
        tuner.run("k", None, ["seq", "fork"], lambda s: run(s, fail=True))
    decided = None
    while decided is None:
        _, decided = tuner.run("k", None, ["seq", "fork"], run)
    assert decided == "seq"


def test_decides_only_once_the_gpu_ran_the_timed_calls(monkeypatch):
    # Deciding on a sample the GPU has not run would wait for its whole queue (the
    # deciding call blocking the host): the trial goes on until the samples are done.
    state = {"done": False}

    class Event(_HostEvent):
        def query(self) -> bool:
            return state["done"]

        def synchronize(self) -> None:
            assert state["done"], "the tuner waited for the GPU"

    monkeypatch.setattr(torch.cuda, "Event", Event)
    tuner = _ScheduleTuner()
    results = [tuner.run("k", None, ["seq", "fork"], lambda s: s)[1] for _ in range(_TRIAL + 5)]
    assert results == [None] * (_TRIAL + 5) and "k" in tuner.trials
    state["done"] = True
    assert tuner.run("k", None, ["seq", "fork"], lambda s: s)[1] in ("seq", "fork")
    assert "k" not in tuner.trials


# ------------------------------------------- found by a review of the schedule decisions
class _FirstInPlace(nn.Module):
    r"""Changes the first tensor of its input in place, then reads it."""

    def forward(self, x):
        t = x[0] if isinstance(x, list) else x
        t.mul_(2)
        return t + 1


def test_auto_keeps_sequential_a_branch_changing_a_nested_input_in_place(forks):
    # Before: only top-level tensor arguments were watched; block([x]) forked.
    p = Parallel(_FirstInPlace(), lambda xs: xs[0] * 3, streams="auto")
    with torch.no_grad():
        for _ in range(_TRIAL + 4):
            x = torch.randn(2, 4)
            expected = torch.cat([x * 2 + 1, x * 2 * 3], 1)  # sequential: the second sees the change
            torch.testing.assert_close(p([x]), expected, rtol=0, atol=0)
    assert not forks and p._plans and not any(plan.forked for plan in p._plans.values())


@pytest.mark.parametrize("compile", [None, "eager"])
@pytest.mark.parametrize("streams", ["auto", True])
def test_a_branch_writing_to_an_inference_input_is_not_forked(forks, streams, compile):
    # Inference tensors keep no version: before, nothing saw the write, and the fork raced. With
    # compile=, the first call was not watched for such writes at all (before a later review).
    p = Parallel(_FirstInPlace(), nn.Linear(4, 4), streams=streams, compile=compile)
    with torch.inference_mode():
        x = torch.randn(2, 4)
        expected = torch.cat([x * 2 + 1, p[1](x * 2)], 1)
        if streams is True:  # refused, as where versions show it
            with pytest.raises(RuntimeError, match=r"(?s)changed its input in place.*inference tensors"):
                p(x.clone())
            return
        for _ in range(_TRIAL + 4):
            torch.testing.assert_close(p(x.clone()), expected, rtol=0, atol=0)
    assert not forks and not any(plan.forked for plan in p._plans.values())
    if compile is not None:  # the watched call ran the branches as they are; the next ones, compiled
        assert [len(c.failed) for c in p._compiler._calls] == [0, 0] and all(c.fn for c in p._compiler._calls)


def test_inference_inputs_that_no_branch_writes_to_are_forked(forks):
    p = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), streams=True)
    with torch.inference_mode():
        x = torch.randn(2, 4)
        for _ in range(3):
            torch.testing.assert_close(p(x), torch.cat([p[0](x), p[1](x)], 1), rtol=0, atol=0)
    assert len(forks) == 2 and p._unwritten  # the first call ran watched, in turn


def test_writes_sees_in_place_and_out_writes_through_views():
    from parallel_modules._streams import _Writes

    x, other = torch.randn(4, 4), torch.randn(4, 4)
    for write, wrote in ((lambda: other.relu_(), False), (lambda: x[1:].relu_(), True),
                         (lambda: torch.add(other, 1, out=x[:, 0]), True), (lambda: x + 1, False)):
        watch = _Writes([x])
        with watch:
            write()
        assert watch.wrote is wrote


def test_a_fused_plan_is_dropped_when_deterministic_algorithms_are_asked_for():
    # Before: "auto" fused at the first call, and kept fusing after the switch.
    branches = [nn.Linear(257, 3) for _ in range(3)]
    p = Parallel(*branches, fuse="auto")
    x = torch.randn(3, 257)
    p(x)
    assert any(plan.fused for plan in p._plans.values())
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.equal(p(x), torch.cat([b(x) for b in branches], 1))
        assert not any(plan.fused for plan in p._plans.values())
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_tuner_drops_the_idlest_trial_when_full(host_events, monkeypatch):
    monkeypatch.setattr(_autotune, "_MAX_TRIALS", 3)
    monkeypatch.setattr(_autotune, "_IDLE_CALLS", 1)
    tuner = _ScheduleTuner()
    for key in ("a", "b", "c", "a", "d"):  # "b" is the idlest when "d" comes
        tuner.run(key, None, ["seq", "fork"], lambda s: s)
    assert list(tuner.trials) == ["c", "a", "d"]


def test_a_nested_tuner_trying_schedules_leaves_no_sample_in_the_outer_one(host_events):
    # A block nested in a branch, called once per call, tried its schedules in step with
    # the outer block's: the outer timed (seq, seq) against (fork, fork) only, never
    # (fork, seq). Its samples are now taken once the inner block has decided.
    outer, inner, state = _ScheduleTuner(), _ScheduleTuner(), {"calls": 0, "inner decided at": None}

    def outer_call(schedule: str) -> str:
        out, decided = inner.run("inner", None, ["seq", "fork"], lambda s: s)
        if decided is not None and state["inner decided at"] is None:
            state["inner decided at"] = state["calls"]
        return out

    decided = None
    while decided is None and state["calls"] < 500:
        state["calls"] += 1
        _, decided = outer.run("outer", None, ["seq", "fork"], outer_call)
    assert decided is not None and state["inner decided at"] is not None
    # Every sample of the outer trial came after the inner decision: a round per schedule.
    assert state["calls"] - state["inner decided at"] >= 2 * _autotune._SAMPLES


def test_a_nested_tuner_that_never_decides_does_not_hold_the_outer_one_forever(host_events):
    outer, inner, calls = _ScheduleTuner(), _ScheduleTuner(), [0]

    def outer_call(schedule: str) -> str:
        calls[0] += 1
        return inner.run(("inner", calls[0]), None, ["seq", "fork"], lambda s: s)[0]  # a new signature each call

    decided = None
    for _ in range(500):
        _, decided = outer.run("outer", None, ["seq", "fork"], outer_call)
        if decided is not None:
            break
    assert decided is not None and calls[0] <= 2 * (_autotune._WARMUP + (1 + _autotune._NESTED_ROUNDS) * _autotune._SAMPLES)


def test_a_signature_decided_anew_keeps_the_other_signatures_costs(host_events, monkeypatch):
    # Before: a full table dropped its oldest entry even for a key already in it, so a
    # signature timed again (after forget) took another signature's costs out of explain().
    monkeypatch.setattr(_autotune, "_MAX_TRIALS", 2)
    tuner = _ScheduleTuner()

    def decide(key: str) -> None:
        for _ in range(_TRIAL):
            if tuner.run(key, None, ["seq", "fork"], lambda s: s)[1] is not None:
                return
        raise AssertionError(f"{key!r} was not decided")

    for key in ("a", "b", "b"):
        decide(key)
    assert set(tuner.costs) == {"a", "b"}


def test_a_plan_set_anew_in_a_full_table_drops_no_other():
    from parallel_modules._inputs import _bounded_add

    plans: dict[str, str] = {}
    for key in "abc":
        _bounded_add(plans, key, "sequential", limit=3)
    _bounded_add(plans, "c", "streams", limit=3)  # (a fork dropped in training, say: see _outputs)
    assert plans == {"a": "sequential", "b": "sequential", "c": "streams"}
    _bounded_add(plans, "d", "sequential", limit=3)
    assert list(plans) == ["b", "c", "d"]


def test_a_full_table_filled_from_several_threads_at_once_raises_nothing():
    # Threads calling one block with new shapes add plans to its full table at once. Before: a
    # thread switch between ``iter`` and ``next`` in the drop of the oldest entry let another
    # thread change the table, and the call raised "dictionary changed size during iteration";
    # and two threads dropping the same oldest entry each added their own, one past the limit
    # for good (42 entries of 8 here).
    from parallel_modules._inputs import _bounded_add

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (a switch at almost every chance: without the fix it fails at once)
    plans: dict[tuple[int, int], None] = {}
    errors: list[BaseException] = []

    def add(thread: int) -> None:
        try:
            for i in range(100_000):
                _bounded_add(plans, (thread, i), limit=8)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=add, args=(t,)) for t in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert len(plans) <= 8 + len(threads)  # (each thread may add one past the limit at the same moment)


def test_explain_says_why_a_block_streams_auto_forked_runs_in_order(forks, monkeypatch):
    # A branch writing its input on a later call: the fork is refused and "auto" keeps the
    # branches in order. Before, explain() showed the sequential schedule next to the costs
    # that had chosen streams, and no word on why (it said it only for fused groups).
    from parallel_modules._streams import _changed_in_place

    def refusing(calls, device, run, capturing, inputs, join, high, order, args, kwargs, error):
        versions = [a._version for a in args]
        outs = [c(*args, **kwargs) for c in calls]
        if versions != [a._version for a in args]:
            raise error(_changed_in_place(), 0)  # as the real fork raises it
        return outs if join is None else join(outs)

    monkeypatch.setattr(_parallel, "_run_forked", refusing)
    monkeypatch.setattr(_parallel, "_fork_join", lambda calls, device, args, kwargs, join, error: refusing(
        calls, device, None, False, (), join, 0, None, args, kwargs, error))
    class SometimesInPlace(nn.Module):
        writes = False

        def forward(self, x):
            return x.mul_(2) if self.writes else x * 2

    writer = SometimesInPlace()
    p = Parallel(writer, nn.Linear(4, 4), streams="auto")
    with torch.no_grad():
        for _ in range(_TRIAL):
            p(torch.randn(2, 4))
        [schedule] = p.explain()["schedules"].values()
        assert schedule.startswith("unfused, streams (timed per call")
        writer.writes = True
        with pytest.raises(RuntimeError, match="changed its input in place"):
            p(torch.randn(2, 4))
        p(torch.randn(2, 4))
        p(torch.randn(3, 4))  # a signature first seen since: not timed
    assert list(p.explain()["schedules"].values()) == [
        "unfused, sequential (a branch changed its input in place on an earlier call: the branches run one after "
        "another)" + schedule[len("unfused, streams"):],
        "unfused, sequential (a branch changed its input in place on an earlier call: the branches run one after "
        "another)",
    ]


@pytest.mark.parametrize("fuse", [False, "auto"])
def test_explain_says_why_a_branch_writing_an_inference_input_keeps_its_signature_in_turn(forks, fuse):
    # Before: "unfused, sequential" with no reason, where a CPU signature kept in turn by
    # the same write says why (the README promises it for fuse="auto").
    p = Parallel(_FirstInPlace(), nn.Linear(4, 4), nn.Linear(4, 4), streams="auto", fuse=fuse)
    with torch.inference_mode():
        p(torch.randn(2, 4))
    assert list(p.explain()["schedules"].values()) == [
        "unfused, sequential (a branch changed its input in place on the first call: the branches run one after "
        "another)"]


def test_compiled_branches_on_inference_inputs_no_branch_writes_to_are_forked(forks):
    p = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), streams=True, compile="eager")
    with torch.inference_mode():
        x = torch.randn(2, 4)
        for _ in range(3):
            torch.testing.assert_close(p(x), torch.cat([p[0](x), p[1](x)], 1), rtol=0, atol=0)
    assert len(forks) == 2 and p._unwritten  # the first call ran watched, in turn


def test_a_schedule_timed_without_autocast_is_not_kept_under_it(forks, cuda_autocast_flag):
    # Under autocast the branches run other kernels on other dtypes: a schedule timed in float32
    # was not timed for them. Before: the float32 plan was looked up for the bfloat16 call too.
    p = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), streams="auto")
    p.requires_grad_(False)  # (a frozen block: forking may be chosen)
    x = torch.randn(2, 4)
    for _ in range(_TRIAL):
        p(x)
    assert len(p._plans) == 1 and not p._tuner.trials
    cuda_autocast_flag(True)
    p(x)
    assert len(p._tuner.trials) == 1  # timed anew, under autocast
    for _ in range(_TRIAL):
        p(x)
    assert len(p._plans) == 2 and not p._tuner.trials
    schedules = p.explain()["schedules"]
    assert sorted(k.endswith(", autocast to bfloat16") for k in schedules) == [False, True]
    cuda_autocast_flag(False)
    trials = p._tuner.calls
    p(x)
    assert p._tuner.calls == trials  # the float32 plan, as it was
