"""The profiling helper: kernels per stream, overlap, plots, traces saved and loaded.

The interval logic is checked on the CPU with synthetic traces in Kineto's Chrome-trace layout
whose answers are worked out by hand below, and against a brute-force count on random traces.
The ``cuda`` tests record real ``Parallel`` calls and are run on the GPU machine.
"""

from __future__ import annotations

import gzip
import inspect
import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch

from parallel_modules import Parallel
from parallel_modules._cases import CASES, SequentialBranches
from parallel_modules.timeline import KernelEvent, Timeline, load_timelines, record_timeline, save_timelines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = 1_000_000.5  # traces count from an arbitrary origin; timelines count from their first kernel


def kernel(name: str, stream: int, start: float, end: float, device: int = 0) -> dict:
    # The fields Kineto writes for a GPU kernel (libkineto output_json.cpp / CuptiActivity.cpp).
    return {"ph": "X", "cat": "kernel", "name": name, "pid": device, "tid": stream, "ts": T0 + start,
            "dur": end - start, "args": {"device": device, "stream": stream, "correlation": 1, "grid": [1, 1, 1]}}


def noise() -> list[dict]:
    r"""Events of a real trace that are not kernels and overlap everything: must be ignored."""
    return [
        {"ph": "X", "cat": "cpu_op", "name": "aten::conv2d", "pid": 99, "tid": 99, "ts": T0 - 5, "dur": 100.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 99, "tid": 99, "ts": T0, "dur": 50.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "pid": 0, "tid": 7, "ts": T0 + 1, "dur": 30.0,
         "args": {"device": 0, "stream": 7}},
        {"ph": "f", "id": 1, "pid": 0, "tid": 7, "ts": T0, "cat": "ac2g", "name": "ac2g", "bp": "e"},
        {"name": "thread_name", "ph": "M", "ts": T0, "pid": 0, "tid": 7, "args": {"name": "stream 7"}},
        {"name": "Record Window End", "ph": "i", "s": "g", "pid": "", "tid": "", "ts": T0 + 99},
    ]


def hand_trace() -> dict:
    r"""Three streams; the answers, worked out by hand (times relative to the first kernel):

    stream 7:  [0, 10], [2, 4] (inside the first: counts once), [12, 20]   busy 18
    stream 13: [5, 15]                                                     busy 10
    stream 21: [14, 16], [20, 25] (starts as stream 7 ends: no overlap)    busy 7
    busy (>= 1 stream): [0, 25]                          = 25
    >= 2 streams:       [5, 10] + [12, 16]               = 5 + 4 = 9
    >= 3 streams:       [14, 15]                         = 1
    overlap fraction    9 / 25                           = 0.36
    """
    events = [kernel("a", 7, 0, 10), kernel("a_inner", 7, 2, 4), kernel("b", 13, 5, 15), kernel("c", 7, 12, 20),
              kernel("d", 21, 14, 16), kernel("e", 21, 20, 25), kernel("empty", 13, 30, 30)]
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "Test GPU"}],
            "traceEvents": noise() + events[::-1]}


def test_overlap_of_hand_computed_trace() -> None:
    (tl,) = load_timelines(hand_trace()).values()
    assert tl.streams == [7, 13, 21]
    assert len(tl.kernels) == 7
    assert tl.intervals() == {7: [(0, 10), (2, 4), (12, 20)], 13: [(5, 15), (30, 30)], 21: [(14, 16), (20, 25)]}
    assert tl.busy_us == 25
    assert tl.overlap_us == 9
    assert tl.overlap_fraction == pytest.approx(0.36)
    assert tl.span_us == 30  # the zero-length kernel ends the span but adds no busy time
    assert tl.metadata["gpu"] == "Test GPU"
    assert "36.0% of busy time" in tl.summary()


def test_serial_streams_do_not_overlap() -> None:
    # Back to back on two streams (each starts as the other ends), as a sequential schedule does.
    tl = Timeline([KernelEvent("a", 1, 0, 4), KernelEvent("b", 2, 4, 6), KernelEvent("c", 1, 6, 9)])
    assert (tl.busy_us, tl.overlap_us, tl.overlap_fraction) == (9, 0, 0.0)
    assert Timeline([]).overlap_fraction == 0.0 and "no GPU kernels" in Timeline([]).summary()


def brute_force(kernels: list[KernelEvent]) -> tuple[int, int]:
    r"""Busy and >=2-stream time on an integer grid: count the streams busy in each unit cell."""
    busy = overlap = 0
    for t in range(max(k.end_us for k in kernels)):
        n = len({k.stream for k in kernels if k.start_us <= t and t + 1 <= k.end_us})
        busy += n >= 1
        overlap += n >= 2
    return busy, overlap


@pytest.mark.parametrize("seed", range(20))
def test_overlap_matches_brute_force_on_random_traces(seed: int) -> None:
    rng = random.Random(seed)
    kernels = []
    for _ in range(rng.randint(1, 25)):
        start = rng.randint(0, 60)
        kernels.append(KernelEvent("k", rng.choice([3, 5, 8, 13]), start, start + rng.randint(0, 12)))
    tl = Timeline(kernels)
    t0 = min(k.start_us for k in kernels)
    busy, overlap = brute_force([k._replace(start_us=k.start_us - t0, end_us=k.end_us - t0) for k in kernels])
    assert (tl.busy_us, tl.overlap_us) == (busy, overlap)


def test_load_from_json_and_gzip_files(tmp_path) -> None:
    plain, packed = tmp_path / "run.json", tmp_path / "run.pt.trace.json.gz"
    plain.write_text(json.dumps(hand_trace()))
    with gzip.open(packed, "wt") as f:
        json.dump(hand_trace(), f)
    for path, label in ((plain, "run"), (packed, "run")):
        (name, tl), = load_timelines(path).items()
        assert name == tl.label == label
        assert (tl.busy_us, tl.overlap_us) == (25, 9)
    # Chrome's JSON array format: a bare list of events.
    (tl,) = load_timelines(hand_trace()["traceEvents"]).values()
    assert tl.overlap_us == 9


def test_kernels_on_two_devices_give_two_timelines() -> None:
    trace = {"traceEvents": [kernel("a", 7, 0, 10, device=0), kernel("b", 7, 5, 15, device=1),
                             kernel("c", 9, 5, 15, device=1)]}
    tls = load_timelines(trace)
    assert sorted(tls) == ["trace cuda:0", "trace cuda:1"]
    assert tls["trace cuda:0"].overlap_us == 0  # same stream id on another GPU is not concurrency here
    assert tls["trace cuda:1"].overlap_us == 10


def test_not_a_trace_is_refused() -> None:
    with pytest.raises(ValueError, match="not a Chrome trace.*traceEvents"):
        load_timelines({"events": []})


def test_compact_file_round_trip(tmp_path) -> None:
    (full,) = load_timelines(hand_trace()).values()
    serial = Timeline([KernelEvent("x" * 300, 7, 0, 4), KernelEvent("y", 7, 4, 9)], "eager sequential",
                      {"gpu": "Test GPU", "calls": 3})
    full.label = "Parallel"
    path = tmp_path / "compact.json"
    save_timelines(path, serial, full, metadata={"recorded": "2026-01-02T03:04:05", "case": "hand"})
    doc = json.loads(path.read_text())
    # Kernels only (plus the names of rows), and a valid Chrome trace: one process per timeline.
    assert {e["ph"] for e in doc["traceEvents"]} == {"X", "M"}
    assert all(e["cat"] == "kernel" for e in doc["traceEvents"] if e["ph"] == "X")
    assert sorted({e["pid"] for e in doc["traceEvents"]}) == [0, 1]
    loaded = load_timelines(path)
    assert list(loaded) == ["eager sequential", "Parallel"]
    for before in (serial, full):
        after = loaded[before.label]
        assert [(k.name, k.stream, k.device) for k in after.kernels] == [(k.name, k.stream, k.device)
                                                                          for k in before.kernels]
        assert [k.start_us for k in after.kernels] == pytest.approx([k.start_us for k in before.kernels])
        assert (after.busy_us, after.overlap_us) == pytest.approx((before.busy_us, before.overlap_us))
    assert loaded["eager sequential"].metadata == {"recorded": "2026-01-02T03:04:05", "case": "hand",
                                                   "gpu": "Test GPU", "calls": 3}
    assert loaded["Parallel"].metadata["gpu"] == "Test GPU"  # from the trace it was loaded from


def test_save_refuses_duplicate_labels(tmp_path) -> None:
    with pytest.raises(ValueError, match="distinct.*'a', 'a'"):
        save_timelines(tmp_path / "x.json", Timeline([], "a"), Timeline([], "a"))


def two_streams(label: str = "t", metadata: dict | None = None) -> Timeline:
    return Timeline([KernelEvent("a", 7, 0, 10), KernelEvent("b", 13, 5, 15)], label, metadata)


def test_save_to_a_gz_path_writes_gzip(tmp_path) -> None:
    path = tmp_path / "t.json.gz"
    save_timelines(path, two_streams())
    with gzip.open(path, "rt") as f:
        json.load(f)
    assert load_timelines(path)["t"].overlap_us == 5


def test_a_save_that_fails_leaves_the_old_file(tmp_path) -> None:
    path = tmp_path / "t.json"
    save_timelines(path, two_streams())
    with pytest.raises(TypeError):  # metadata is checked first; a kernel name of bytes fails in json.dumps
        save_timelines(path, Timeline([KernelEvent(b"conv", 1, 0.0, 1.0)], "t"))
    assert load_timelines(path)["t"].overlap_us == 5


@pytest.mark.parametrize("file_meta, meta, message", [
    ({"format": "NCHW"}, None, "the file's metadata has the key(s) ['format'], which the file format reserves "
                               "('format' and 'runs'); rename them, e.g. 'format' to 'format_'"),
    ({"runs": 3}, None, "the file's metadata has the key(s) ['runs'], which the file format reserves "
                        "('format' and 'runs'); rename them, e.g. 'runs' to 'runs_'"),
    (None, {"pid": 4242}, "the metadata of timeline 'a' has the key(s) ['pid'], which the file format reserves for "
                          "each timeline ('label' and 'pid'); rename them, e.g. "
                          "timeline.metadata['pid_'] = timeline.metadata.pop('pid')"),
    (None, {"label": "x", "pid": 1}, "the metadata of timeline 'a' has the key(s) ['label', 'pid'], which the file "
                                     "format reserves for each timeline ('label' and 'pid'); rename them, e.g. "
                                     "timeline.metadata['label_'] = timeline.metadata.pop('label')"),
])
def test_save_refuses_metadata_keys_the_format_uses(tmp_path, file_meta, meta, message) -> None:
    # Such keys would have replaced the file's format marker, a timeline's row or its label: the message
    # says which keys are reserved, and how to keep the facts (under another key).
    with pytest.raises(ValueError, match=f"^save_timelines: {re.escape(message)}$"):
        save_timelines(tmp_path / "t.json", two_streams("a", meta), two_streams("b"), metadata=file_meta)
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("file_meta, meta", [
    (None, {1: "one", "1": "str"}), ({"sizes": {64: 1.0}}, None),  # int keys came back as strings (and one)
    (None, {"ms": float("nan")}), ({"x": [float("inf")]}, None),  # not JSON: trace viewers refuse the file
])
def test_save_refuses_what_would_not_load_back_as_it_was(tmp_path, file_meta, meta) -> None:
    with pytest.raises(ValueError, match=r"save_timelines: .*(key (1|64) \(int\)|JSON cannot hold)"):
        save_timelines(tmp_path / "t.json", two_streams("t", meta), metadata=file_meta)
    assert not (tmp_path / "t.json").exists()
    save_timelines(tmp_path / "t.json", two_streams("t", {"sizes": {"64": 1.0}, "ms": None}))  # what loads back
    assert load_timelines(tmp_path / "t.json")["t"].metadata == {"sizes": {"64": 1.0}, "ms": None}


@pytest.mark.parametrize("label", [3, None, 1.5])
def test_a_label_that_is_not_a_str_is_refused_with_a_type_error(tmp_path, label) -> None:
    # A label keys the dict load_timelines returns and a file keeps it as a string. save_timelines took
    # an int, though its message said "must be a string" (a float or None was written, then not read).
    shown = rf"got {re.escape(repr(label))} \({type(label).__name__}\); give it a name, e\.g\. "
    with pytest.raises(TypeError, match=rf"^Timeline: a timeline's label must be a str, {shown}"
                                        rf"Timeline\(kernels, '{re.escape(str(label))}'\)$"):
        two_streams(label)
    tl, path = two_streams(), tmp_path / "t.json"
    tl.label = label  # (an attribute: set after Timeline checked it)
    with pytest.raises(TypeError, match=rf"^save_timelines: .* must be a str, {shown}timeline\.label = "):
        save_timelines(path, tl)
    assert not path.exists()
    if label is None:  # (record_timeline's default: the module's class name)
        return
    calls = []
    with pytest.raises(TypeError, match=rf"^record_timeline\(function\): .* must be a str, {shown}"
                                        rf"record_timeline\(\.\.\., label="):
        record_timeline(lambda x: calls.append(x), torch.randn(2), label=label)
    assert calls == []  # refused before the warm-up, on any machine


def test_an_int_label_in_a_file_loads_as_a_str(tmp_path) -> None:
    # save_timelines once wrote int labels: such a file still loads, with labels as str as all others.
    path = tmp_path / "t.json"
    save_timelines(path, two_streams("3"))
    doc = json.loads(path.read_text())
    doc["otherData"]["runs"][0]["label"] = 3
    path.write_text(json.dumps(doc))
    assert {label: tl.label for label, tl in load_timelines(path).items()} == {"3": "3"}


def test_each_device_gets_its_own_gpu_name() -> None:
    trace = {"deviceProperties": [{"id": 0, "name": "A100"}, {"id": 1, "name": "H100"}],
             "traceEvents": [kernel("a", 7, 0, 5, device=0), kernel("b", 7, 0, 5, device=1)]}
    loaded = load_timelines(trace)
    assert loaded["trace cuda:0"].metadata["gpu"] == "A100"
    assert loaded["trace cuda:1"].metadata["gpu"] == "H100"


def test_rounding_on_save_invents_no_overlap(tmp_path) -> None:
    # Start and end are rounded, not start and duration: an end cannot move past the next start.
    tl = Timeline([KernelEvent("a", 1, 0.0, 0.0), KernelEvent("b", 1, 0.0006, 0.0012),
                   KernelEvent("c", 2, 0.0012, 0.002)])
    assert tl.overlap_us == 0
    save_timelines(tmp_path / "t.json", tl)
    assert load_timelines(tmp_path / "t.json")["trace"].overlap_us == 0


def test_touching_kernels_at_kineto_timestamps_do_not_overlap(tmp_path) -> None:
    # Kineto counts microseconds since an epoch (4.7e12) with three decimals, where a float is
    # 1 ns coarse: added as floats, ts + dur of a kernel landed a step past the start of the
    # kernel that began as it ended, on another stream, in about a quarter of such pairs.
    rng = random.Random(0)
    events, t = [], 4_712_345_678_901_123  # nanoseconds
    for i in range(200):
        dur = rng.randrange(1_000, 50_000)
        for stream, start in ((7, t), (13, t + dur)):  # the second starts as the first ends
            events.append({"ph": "X", "cat": "kernel", "name": f"k{i}", "pid": 0, "tid": stream,
                           "ts": f"{start // 1000}.{start % 1000:03d}", "dur": f"{dur // 1000}.{dur % 1000:03d}",
                           "args": {"device": 0, "stream": stream}})
        t += 2 * dur + 10_000
    # Written as JSON numbers, exactly as Kineto writes them.
    text = json.dumps({"traceEvents": events}).replace('"ts": "', '"ts": ').replace('"dur": "', '"dur": ')
    text = text.replace('", "args"', ', "args"').replace('", "dur"', ', "dur"')
    path = tmp_path / "touching.json"
    path.write_text(text)
    (tl,) = load_timelines(path).values()
    assert len(tl.kernels) == 400
    assert tl.overlap_us == 0.0
    # The durations survive the move to times from the first kernel.
    assert tl.kernels[1].duration_us == pytest.approx(float(events[1]["dur"]), abs=1e-6)


def test_malformed_traces_get_a_clear_error_or_are_skipped(tmp_path) -> None:
    # Entries that are not objects are no events (skipped, as trace viewers do).
    (tl,) = load_timelines({"traceEvents": ["junk", 3, kernel("a", 7, 0, 1)], "otherData": []}).values()
    assert [k.name for k in tl.kernels] == ["a"]
    bad = kernel("no_start", 7, 0, 1)
    del bad["ts"]
    with pytest.raises(ValueError, match=r"kernel event #1 \('no_start'\) has no 'ts'"):
        load_timelines({"traceEvents": [kernel("a", 7, 0, 1), bad]})
    bad["ts"] = float("nan")
    with pytest.raises(ValueError, match=r"kernel event #1 has ts=nan, not a number of microseconds"):
        load_timelines({"traceEvents": [kernel("a", 7, 0, 1), bad]})
    # A gzip file is read whatever its name; a file that is no JSON says which file it is.
    zipped = tmp_path / "trace.json"
    with gzip.open(zipped, "wt") as f:
        json.dump(hand_trace(), f)
    assert load_timelines(zipped)["trace"].overlap_fraction == pytest.approx(0.36)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .*broken.json.* as a JSON trace"):
        load_timelines(broken)


def test_a_compact_file_of_another_format_version_is_refused(tmp_path) -> None:
    path = tmp_path / "t.json"
    save_timelines(path, Timeline([KernelEvent("a", 1, 0.0, 1.0)], "one"), Timeline([], "two"))
    doc = json.loads(path.read_text())
    doc["otherData"]["format"] = "parallel_modules.timeline/2"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="format 'parallel_modules.timeline/2'.*reads 'parallel_modules.timeline/1'"):
        load_timelines(path)


@pytest.mark.parametrize("runs", [[{"label": "x"}], [{"pid": "0", "label": "x"}], [{"pid": 0}], {"pid": 0}, ["x"]])
def test_a_compact_file_with_a_broken_list_of_recordings_is_refused_clearly(runs) -> None:
    doc = {"otherData": {"format": "parallel_modules.timeline/1", "runs": runs}, "traceEvents": []}
    with pytest.raises(ValueError, match=r"cannot read this file's list of recordings: expected .*'pid' and a 'label'"):
        load_timelines(doc)


def test_a_compact_file_with_two_recordings_of_one_label_is_refused(tmp_path) -> None:
    path = tmp_path / "t.json"
    save_timelines(path, Timeline([KernelEvent("a", 1, 0.0, 1.0)], "one"), Timeline([KernelEvent("b", 2, 0.0, 2.0)], "two"))
    doc = json.loads(path.read_text())
    assert set(load_timelines(doc)) == {"one", "two"}
    doc["otherData"]["runs"][1]["label"] = "one"  # edited by hand: neither recording may silently win
    with pytest.raises(ValueError, match="two recordings labelled 'one'"):
        load_timelines(doc)


def test_loaded_metadata_holds_plain_floats(tmp_path) -> None:
    path = tmp_path / "t.json"
    save_timelines(path, Timeline([KernelEvent("a", 1, 0.0, 1.0)], "one", {"ms": 1.5}), metadata={"x": [0.25]})
    meta = load_timelines(path)["one"].metadata
    assert meta == {"ms": 1.5, "x": [0.25]}
    assert type(meta["ms"]) is float and type(meta["x"][0]) is float


def test_warm_up_continues_while_the_last_call_tried_schedules() -> None:
    # record_timeline's warm-up, on the CPU: a call "tries schedules" when it moves a tuner's
    # count of calls, as Parallel(streams="auto" / fuse="auto") does until it decides.
    from parallel_modules._autotune import _MAX_EXTRA_WARMUP, _ScheduleTuner, _Trial, _warm_up

    tuner = _ScheduleTuner()
    made = []

    def tuning_until(n):
        def call(x):
            made.append(x)
            if len(made) <= n:  # a trial's call; the n-th decides
                tuner.calls += 1
        return call

    # Reached through any callable: here a plain function, not a module.
    assert _warm_up(lambda f=tuning_until(40): f(0), 30) == 41 == len(made)  # the 41st call ran decided
    made.clear()
    assert _warm_up(lambda f=tuning_until(10): f(0), 30) == 30  # decided within the warm-up
    made.clear()
    assert _warm_up(lambda f=tuning_until(10**6): f(0), 5) == 5 + _MAX_EXTRA_WARMUP  # bounded
    # A trial left unfinished for another input signature does not move: no extra calls.
    stale = _ScheduleTuner()
    stale.trials[("another signature",)] = _Trial(("sequential", "forked"))
    made.clear()
    assert _warm_up(lambda f=tuning_until(0): f(0), 30) == 30
    assert _warm_up(lambda f=tuning_until(0): f(0), 0) == 0


def test_real_cpu_profiler_trace_loads_without_kernels(tmp_path) -> None:
    # Kineto's own file, as written on this machine: CPU operators only, no GPU kernels.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        Parallel(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))(torch.randn(2, 8))
    path = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(path))
    assert any(e.get("cat") == "cpu_op" for e in json.loads(path.read_text())["traceEvents"])
    (tl,) = load_timelines(path).values()
    assert tl.kernels == [] and tl.streams == [] and tl.overlap_fraction == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_record_without_cuda_says_so() -> None:
    block = Parallel(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match=r"record_timeline\(Parallel\): stream timelines need a CUDA GPU"):
        record_timeline(block, torch.randn(2, 4))


@pytest.mark.parametrize("kwargs, error, message", [
    ({"calls": 0}, ValueError, "calls must be an int >= 1, got 0"),
    ({"calls": 2.5}, TypeError, "calls must be an int >= 1, got 2.5 (float)"),
    ({"calls": "3"}, TypeError, "calls must be an int >= 1, got '3' (str)"),
    ({"warmup": -1}, ValueError, "warmup must be an int >= 0, got -1"),
    ({"warmup": True}, TypeError, "warmup must be an int >= 0, got True (bool)"),
])
def test_record_refuses_bad_counts_before_running_anything(kwargs, error, message) -> None:
    # (Before the CUDA checks: said on any machine, and before a warm-up of the module.)
    calls = []
    with pytest.raises(error, match=r"record_timeline\(block\): " + re.escape(message)):
        record_timeline(lambda x: calls.append(x), torch.randn(2), label="block", **kwargs)
    assert calls == []


def test_a_0_dim_integer_tensor_count_is_kept_as_an_int() -> None:
    # As the blocks' integer settings take it (one rule: _inputs._integer); a float or bool tensor is refused.
    from parallel_modules.timeline import _count

    count = _count("block", "calls", torch.tensor(3), 1)
    assert type(count) is int and count == 3
    json.dumps({"calls": count})
    for wrong in (torch.tensor(3.0), torch.tensor(True), torch.tensor([3])):
        with pytest.raises(TypeError, match=r"record_timeline\(block\): calls must be an int >= 1"):
            _count("block", "calls", wrong, 1)


def test_a_numpy_count_is_kept_as_an_int() -> None:
    # A count from numpy is an integer as an int is, and is kept as one: the timeline's metadata
    # holds it, and save_timelines refused a timeline holding np.int64 (JSON holds no numpy scalar).
    from parallel_modules.timeline import _count

    np = pytest.importorskip("numpy")
    for value in (np.int64(2), np.int32(0), 5):
        count = _count("block", "calls", value, 0)
        assert type(count) is int and count == value
    json.dumps({"calls": _count("block", "calls", np.int64(2), 1)})


def _agg_pyplot():
    try:  # in the test extra: fail rather than skip where it is missing, as CI must run the plots
        import matplotlib
    except ImportError:
        if os.environ.get("PARALLEL_MODULES_ALLOW_MISSING_EXTRAS"):
            pytest.skip("matplotlib missing and PARALLEL_MODULES_ALLOW_MISSING_EXTRAS is set")
        raise
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def test_plot_one_row_per_stream() -> None:
    plt = _agg_pyplot()
    (tl,) = load_timelines(hand_trace()).values()
    ax = tl.plot()
    try:
        assert [t.get_text() for t in ax.get_yticklabels()] == [">= 2 streams", "stream 7", "stream 13", "stream 21"]
        bars = [len(c.get_paths()) for c in ax.collections]
        # One bar per kernel on each stream's row, then the band where >= 2 streams run:
        # [5, 10] and [12, 16].
        assert bars == [3, 2, 2, 2]
        band = ax.collections[-1].get_paths()
        assert [tuple(p.get_extents().intervalx) for p in band] == [(5, 10), (12, 16)]
        assert "36%" in ax.get_title()
    finally:
        plt.close(ax.figure)


def test_plot_without_matplotlib_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match="plotting needs matplotlib.*pip install"):
        Timeline([KernelEvent("a", 1, 0, 1)]).plot()


def test_plot_says_what_failed_when_matplotlib_is_installed_but_breaks(monkeypatch) -> None:
    import builtins

    real = builtins.__import__

    def broken(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ModuleNotFoundError("No module named 'numpy.core'", name="numpy.core")
        return real(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "matplotlib.pyplot", raising=False)
    monkeypatch.setattr(builtins, "__import__", broken)
    with pytest.raises(ImportError, match="importing matplotlib.pyplot failed: No module named 'numpy.core'") as e:
        Timeline([KernelEvent("a", 1, 0, 1)]).plot()
    assert "not installed" not in str(e.value)


def test_tool_without_cuda_exits_with_the_message(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the message given without CUDA")
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_timeline_trace.py"), str(out)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode != 0
    assert "need a CUDA GPU" in proc.stderr
    assert not out.exists()


# ---------------------------------------------------------------------------------------- CUDA


def inception():
    case = CASES["inception"]
    branches = case.branches("cuda", torch.float32)
    x = case.make_input(1, "cuda", torch.float32)
    return branches, x


@pytest.mark.cuda
def test_record_streams_true_runs_on_several_streams() -> None:
    branches, x = inception()
    with torch.no_grad():
        seq = record_timeline(SequentialBranches(branches), x, warmup=3)
        par = record_timeline(Parallel(*branches, streams=True), x, warmup=3)
    assert len(seq.streams) == 1, seq.summary()
    assert len(par.streams) >= 2, par.summary()
    assert par.label == "Parallel" and par.metadata["gpu"] == torch.cuda.get_device_name()
    # Same convolutions either way: about as many kernels (the join may differ by a copy).
    assert abs(len(par.kernels) - len(seq.kernels)) <= 3 * 3, (seq.summary(), par.summary())


@pytest.mark.cuda
def test_record_cuda_graph_replay_shows_kernels_on_several_streams(tmp_path) -> None:
    branches, x = inception()
    with torch.no_grad():
        tl = record_timeline(Parallel(*branches, cuda_graph=True), x, calls=3)
    # Kernels replayed from the graph are in the trace, on more than one stream.
    assert len(tl.kernels) >= 3 * 4, tl.summary()
    assert len(tl.streams) >= 2, tl.summary()
    path = tmp_path / "graph.json"
    save_timelines(path, tl)
    (back,) = load_timelines(path).values()
    # Saved times are rounded to the nanosecond, so the fraction agrees to about 1e-5 on a ~400 us span.
    assert back.overlap_fraction == pytest.approx(tl.overlap_fraction, abs=1e-4)
    assert back.metadata["gpu"] == torch.cuda.get_device_name()


@pytest.mark.cuda
def test_record_waits_for_schedule_tuning_to_end() -> None:
    # streams="auto" and fuse="auto" try four schedules, 56 calls: more than the default warm-up.
    block = Parallel(*[torch.nn.Conv2d(16, 16, 3, padding=1) for _ in range(3)], fuse="auto").cuda().eval()
    with torch.no_grad():
        record_timeline(block, torch.randn(2, 16, 16, 16, device="cuda"))
    assert not block._tuner.trials


@pytest.mark.cuda
def test_record_waits_for_tuning_inside_any_callable_and_only_for_its_own_input() -> None:
    block = Parallel(*[torch.nn.Conv2d(16, 16, 3, padding=1) for _ in range(3)], fuse="auto").cuda().eval()
    calls = []

    def model(x):  # a callable around the block, as a user profiles a model's forward
        calls.append(x.shape)
        return block(x)

    x = torch.randn(2, 16, 16, 16, device="cuda")
    with torch.no_grad():
        record_timeline(model, x)
        assert not block._tuner.trials  # the profiled calls ran the schedule kept
        # Two calls at another shape leave that shape's trial unfinished: it must not prolong
        # the warm-up of a shape already decided.
        block(torch.randn(3, 16, 16, 16, device="cuda"))
        block(torch.randn(3, 16, 16, 16, device="cuda"))
        assert block._tuner.trials
        calls.clear()
        record_timeline(model, x, warmup=10, calls=2)
    assert len(calls) == 12


@pytest.mark.cuda
def test_record_finds_the_device_of_nested_inputs() -> None:
    x = torch.randn(8, 8, device="cuda")
    assert record_timeline(lambda xs: xs["x"] * 2, {"x": x}, warmup=1).kernels


@pytest.mark.cuda
def test_record_refuses_a_cpu_call_on_a_gpu_machine() -> None:
    with pytest.raises(RuntimeError, match="no input and no parameter is on a CUDA device"):
        record_timeline(Parallel(torch.nn.Linear(4, 4)), torch.randn(2, 4))


@pytest.mark.cuda
def test_tool_writes_both_recordings(tmp_path) -> None:
    out = tmp_path / "inception.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_timeline_trace.py"), str(out)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    runs = load_timelines(out)
    assert list(runs) == ["eager sequential", "Parallel(cuda_graph=True)"]
    assert len(runs["eager sequential"].streams) == 1
    assert len(runs["Parallel(cuda_graph=True)"].streams) >= 2
    assert os.path.getsize(out) < 200_000


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_a_damaged_gzip_file_says_which_file(tmp_path, damage) -> None:
    # Before (a CPU hunt): gzip's EOFError (a file cut short, as by an interrupted copy) and
    # zlib.error (damaged data) came through bare, naming no file.
    path = tmp_path / "t.json.gz"
    save_timelines(path, two_streams())
    data = path.read_bytes()
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = data[:12] + b"\xff" * 8 + data[20:]
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"cannot read .*t\.json\.gz.* as a JSON trace \(gzip\)"):
        load_timelines(path)


def test_save_names_the_metadata_json_cannot_hold(tmp_path) -> None:
    # json.dumps raised a bare "Object of type dtype is not JSON serializable", naming neither the
    # key nor the timeline.
    path = tmp_path / "t.json"
    with pytest.raises(ValueError, match=r"metadata\['run'\]\['dtype'\] is torch.float16 \(dtype\).*timeline 'one'"):
        save_timelines(path, Timeline([], "one", {"run": {"dtype": torch.float16}}))
    assert not path.exists()


def test_a_timeline_of_kernels_on_several_devices_is_refused() -> None:
    # Stream 7 of cuda:0 and stream 7 of cuda:1 would be one row, their overlap not counted.
    kernels = [KernelEvent("a", 7, 0.0, 10.0, device=0), KernelEvent("b", 7, 5.0, 15.0, device=1)]
    with pytest.raises(ValueError, match=r"Timeline: kernels of devices \[0, 1\].*one Timeline per device"):
        Timeline(kernels)


def test_a_kernel_that_ends_before_it_starts_is_refused() -> None:
    # It was kept with end < start: no busy time, yet a bar drawn backwards and a wrong span.
    with pytest.raises(ValueError, match=r"kernel event #1 \('b'\) has a negative 'dur'"):
        load_timelines({"traceEvents": [kernel("a", 7, 0, 5), kernel("b", 8, 10, 4)]})
    with pytest.raises(ValueError, match=r"Timeline: kernel 'b' on stream 8 ends at 4.0 us, before it starts"):
        Timeline([KernelEvent("a", 7, 0.0, 5.0), KernelEvent("b", 8, 10.0, 4.0)])


def test_device_properties_that_are_not_a_list_are_ignored() -> None:
    # Metadata only: it crashed with "'int' object is not iterable" instead of reading the kernels.
    (tl,) = load_timelines({"traceEvents": [kernel("a", 7, 0, 5)], "deviceProperties": 5}).values()
    assert tl.busy_us == 5 and "gpu" not in tl.metadata


@pytest.mark.parametrize("trace", [5, (kernel("a", 7, 0, 1),), b"trace.json"])
def test_load_something_that_is_neither_a_path_nor_a_trace_says_what_it_takes(trace) -> None:
    # It failed inside os.fspath or str.endswith, with no word of load_timelines or of what it reads.
    with pytest.raises(TypeError, match=r"load_timelines: expected the path of a trace file .* or its parsed JSON"):
        load_timelines(trace)


# The public API's docstrings, as tests/test_readme.py checks those of the blocks: what
# help(parallel_modules.timeline) shows documents every name, parameter and default.
_TIMELINE_API = [KernelEvent, Timeline, Timeline.plot, load_timelines, save_timelines, record_timeline]


def test_timeline_api_is_documented():
    import inspect

    import parallel_modules.timeline as timeline

    undocumented = [name for name in timeline.__all__ if not (getattr(timeline, name).__doc__ or "").strip()]
    undocumented += [f"{cls.__name__}.{name}" for cls in (KernelEvent, Timeline) for name, value in vars(cls).items()
                     if not name.startswith("_") and isinstance(value, property) and not (value.fget.__doc__ or "").strip()]
    assert not undocumented, f"without a docstring: {undocumented}"
    for api in _TIMELINE_API:
        # (A NamedTuple's __init__ is tuple's: its fields are the parameters, as __new__ takes them.)
        signature = inspect.signature(api.__new__ if api is KernelEvent else api)
        args = api.__doc__.split("Args:", 1)[1]
        indent = re.match(r"\n( +)", args).group(1)  # (an entry's; its continuation lines are deeper)
        for name, parameter in signature.parameters.items():
            if name in ("self", "_cls", "kwargs"):  # (**kwargs: documented with *args)
                continue
            shown = f"*{name}" if parameter.kind is parameter.VAR_POSITIONAL else name
            entry = re.search(rf"^{indent}{re.escape(shown)}(?:, \*\*\w+)?: (.*?)(?=^{indent}[*\w]|\n\n|\Z)",
                              args, re.M | re.S)
            assert entry, f"{api.__qualname__}: {shown} is not under Args:"
            if parameter.default is not parameter.empty:
                default = f"Default: ``{parameter.default!r}``".replace("'", '"')
                assert default in " ".join(entry.group(1).split()), f"{api.__qualname__}: {name} lacks {default}"


def test_timeline_class_example_runs():
    import doctest

    test = doctest.DocTestParser().get_doctest(Timeline.__doc__, {"Timeline": Timeline, "KernelEvent": KernelEvent},
                                               "Timeline", None, 0)
    runner = doctest.DocTestRunner()
    report: list[str] = []
    runner.run(test, out=report.append)
    assert test.examples and not runner.failures, "".join(report)



def _run_module_example(doc: str) -> None:
    import doctest

    test = doctest.DocTestParser().get_doctest(doc, {}, "parallel_modules.timeline", None, 0)
    runner = doctest.DocTestRunner()
    report: list[str] = []
    runner.run(test, out=report.append)
    assert test.examples and not runner.failures, "".join(report)


def test_module_example_runs_on_the_cpu_given_a_recording(tmp_path, monkeypatch) -> None:
    # The module docstring's example as printed, less the recording, which needs CUDA: moved to the
    # CPU and handed a recorded trace, it must import every name it uses (it used nn and torch
    # without) and print what it shows.
    import parallel_modules.timeline as timeline

    def recorded(module, *args, **kwargs):
        (tl,) = load_timelines(hand_trace()).values()
        tl.label = type(module).__name__
        return tl

    plt = _agg_pyplot()
    monkeypatch.setattr(timeline, "record_timeline", recorded)  # (the example imports it from the module)
    monkeypatch.chdir(tmp_path)
    try:
        _run_module_example(timeline.__doc__.replace(".cuda()", "").replace('device="cuda"', 'device="cpu"'))
    finally:
        plt.close("all")
    assert load_timelines(tmp_path / "trace.json")["Parallel"].overlap_us == 9


@pytest.mark.cuda
def test_module_example_runs_as_printed(tmp_path, monkeypatch) -> None:
    import parallel_modules.timeline as timeline

    plt = _agg_pyplot()
    monkeypatch.chdir(tmp_path)  # (it writes trace.json)
    try:
        _run_module_example(timeline.__doc__)
    finally:
        plt.close("all")


@pytest.mark.parametrize("args, fix", [
    (lambda path: (path, [Timeline([], "a"), Timeline([], "b")]), "list; pass them as separate arguments"),
    (lambda path: (Timeline([], "a"), path), "str; the path comes first"),
    (lambda path: (path, {"a": Timeline([], "a")}), "dict; pass the Timeline objects"),
])
def test_save_refuses_what_is_not_a_timeline(tmp_path, args, fix) -> None:
    # Before: AttributeError: 'list' object has no attribute 'metadata', naming neither the function nor the fix.
    path = str(tmp_path / "t.json")
    with pytest.raises(TypeError, match=rf"^save_timelines: timeline #0 \(argument 2\) must be a Timeline, got {fix}"):
        save_timelines(*args(path))
    assert not os.path.exists(path)
    save_timelines(path, Timeline([], "a"), Timeline([], "b"))  # (the right call works after it)
    assert sorted(load_timelines(path)) == ["a", "b"]


@pytest.mark.parametrize("trace, got", [
    ({"events": [], "otherData": {}}, r"an object with the keys \['events', 'otherData'\]"),
    ({"traceEvents": {"a": 1}}, r"a 'traceEvents' of type dict"),
])
def test_not_a_trace_says_what_came(trace, got) -> None:
    # Before: a dict without a 'traceEvents' list was refused as "got dict", which is what was expected.
    with pytest.raises(ValueError, match=r"not a Chrome trace: expected a JSON object with a 'traceEvents' list "
                                         r"\(or a list of events\), got " + got + "$"):
        load_timelines(trace)


def test_kernel_event_shows_its_fields_types_in_help():
    # typing.NamedTuple keeps the hints of ``from __future__ import annotations`` on __new__ as
    # ForwardRef objects, which help() and inspect printed as ``name: ForwardRef('str')``.
    assert str(inspect.signature(KernelEvent)) == (
        "(name: str, stream: int, start_us: float, end_us: float, device: int = 0)")
