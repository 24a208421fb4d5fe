r"""See branches overlap: GPU kernels per CUDA stream, from a ``torch.profiler`` trace.

A :class:`Timeline` holds the GPU kernels of a few calls of a module, each with
the CUDA stream it ran on and its start and end time, and measures how much of
the GPU's busy time had kernels running on two or more streams at once (see
:attr:`Timeline.overlap_fraction`). It comes from one of two places:

* :func:`record_timeline` profiles a module live (needs a CUDA GPU);
* :func:`load_timelines` reads a Chrome trace written by
  :meth:`torch.profiler.profile.export_chrome_trace`, or the compact file
  written by :func:`save_timelines` -- this works anywhere, the CPU included,
  so a trace recorded on a GPU machine can be committed and looked at later.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from parallel_modules import Parallel
    >>> from parallel_modules.timeline import load_timelines, record_timeline, save_timelines
    >>> block = Parallel(nn.Conv2d(192, 64, 1), nn.Conv2d(192, 32, 3, padding=1),
    ...                  cuda_graph=True).cuda().eval()  # needs a CUDA GPU
    >>> with torch.no_grad():
    ...     tl = record_timeline(block, torch.randn(1, 192, 35, 35, device="cuda"))
    >>> print(tl.summary())  # doctest: +ELLIPSIS
    Parallel: ... kernels on ... stream(s)
    ...
      >= 2 streams at once: ... us = ...% of busy time
    >>> ax = tl.plot()  # one row per stream (matplotlib)
    >>> save_timelines("trace.json", tl)  # kernels only: small enough to commit
    >>> load_timelines("trace.json")["Parallel"].streams == tl.streams
    True

Kernels replayed from a CUDA graph are in the trace too: the profiler
(Kineto) records CUPTI's per-kernel activity records, which include the
kernels of a ``cudaGraphLaunch``, each with the stream CUPTI reports for it
(recent versions also put ``"graph id"`` and ``"graph node id"`` in the
kernel's ``args``). For graph kernels these stream ids are the ones the graph
ran on, which need not be the streams used during capture. The launch itself
is one ``cudaGraphLaunch`` runtime event on the CPU side, not kept here; nor
are memory copies and sets, which are not kernels.
"""

from __future__ import annotations

import datetime
import decimal
import gzip
import json
import math
import os
import platform
import reprlib
import tempfile
import zlib
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence, Union, get_type_hints

import torch
from torch.utils import _pytree as pytree

from . import _autotune
from ._inputs import _integer

__all__ = ["KernelEvent", "Timeline", "record_timeline", "load_timelines", "save_timelines"]

_PathLike = Union[str, "os.PathLike[str]"]

# Written into the compact files so that load_timelines can tell them from Kineto's traces.
_FORMAT = "parallel_modules.timeline/1"

class KernelEvent(NamedTuple):
    r"""One GPU kernel: its name, the CUDA stream and device it ran on, and when (microseconds).

    Args:
        name: the kernel's name.
        stream: the id of the CUDA stream it ran on.
        start_us: when it started, in microseconds.
        end_us: when it ended, in microseconds (at least ``start_us``).
        device: the index of the GPU it ran on. Default: ``0``.
    """

    name: str
    stream: int
    start_us: float
    end_us: float
    device: int = 0

    @property
    def duration_us(self) -> float:
        r"""``end_us - start_us``."""
        return self.end_us - self.start_us


# typing.NamedTuple keeps the hints above, strings under ``from __future__ import annotations``,
# on ``__new__`` as ForwardRef objects, which help() printed as ``name: ForwardRef('str')``.
KernelEvent.__new__.__annotations__ = get_type_hints(KernelEvent)


def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    r"""Union of intervals as sorted, disjoint ``(start, end)`` pairs; empty intervals dropped."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _time_with_at_least(per_stream: Mapping[int, list[tuple[float, float]]], k: int) -> float:
    r"""Total time during which at least ``k`` of the streams are busy.

    ``per_stream`` holds each stream's merged (disjoint) intervals, so the count
    of open intervals at a time is the number of busy streams.
    """
    edges = [(t, +1) for ivs in per_stream.values() for t, _ in ivs]
    edges += [(t, -1) for ivs in per_stream.values() for _, t in ivs]
    # Time accrues only between distinct edge times, so kernels that touch (one
    # ends as the other starts) add no overlap, whatever the order at equal times.
    edges.sort()
    total, busy, since = 0.0, 0, 0.0
    for t, step in edges:
        if busy >= k:
            total += t - since
        busy += step
        since = t
    return total


def _check_label(owner: str, label: Any, fix: str) -> None:
    r"""Refuses a ``label`` that is not a ``str``, saying how to give one (``fix``, formatted with ``name=``).

    A label names the timeline in summaries and plots and keys the dict :func:`load_timelines`
    returns, and a file written by :func:`save_timelines` keeps it as a string: an int would be
    read back as a string, a float or ``None`` not at all.
    """
    if not isinstance(label, str):
        raise TypeError(f"{owner}: a timeline's label must be a str, got {label!r} ({type(label).__name__}); "
                        f"give it a name, e.g. {fix.format(name=repr(str(label)))}")


class Timeline:
    r"""The GPU kernels of a profiled call, grouped by CUDA stream, and how much they overlap.

    Times are in microseconds from the first kernel's start. Let ``n(t)`` be
    the number of streams that have a kernel running at time ``t`` (several
    kernels on one stream count once). Then

    * :attr:`busy_us` is the time with ``n(t) >= 1``: the GPU runs something;
    * :attr:`overlap_us` is the time with ``n(t) >= 2``;
    * :attr:`overlap_fraction` is ``overlap_us / busy_us`` (``0.0`` without
      kernels): the share of the GPU's busy time during which kernels of two
      or more streams ran together. ``0`` means fully serial, values near
      ``1`` mean streams almost always overlapped. Idle gaps (CPU-bound
      launches, time between calls) are in neither, so the fraction does not
      depend on how many calls were recorded or how far apart they were;
    * :attr:`span_us` is the time from the first kernel's start to the last
      kernel's end, and ``span_us - busy_us`` the GPU's idle time within it.

    Intervals touching end to start do not overlap. Timelines are per GPU:
    :func:`load_timelines` splits a trace with kernels on several devices,
    and kernels of several devices, or ending before they start, are refused.

    Args:
        kernels: the kernels, in any order.
        label: a name for the recording, a ``str``, e.g. ``"eager sequential"``.
            Default: ``"trace"``.
        metadata: where and how it was recorded (GPU, versions, date, ...),
            copied. Default: ``None`` (none).

    Example::

        >>> tl = Timeline([KernelEvent("a", 7, 0.0, 10.0), KernelEvent("b", 13, 5.0, 15.0)])
        >>> tl.busy_us, tl.overlap_us, tl.overlap_fraction
        (15.0, 5.0, 0.3333333333333333)
    """

    def __init__(self, kernels: Iterable[KernelEvent], label: str = "trace",
                 metadata: Mapping[str, Any] | None = None) -> None:
        _check_label("Timeline", label, "Timeline(kernels, {name})")
        kernels = sorted(kernels, key=lambda k: (k.start_us, k.end_us, k.stream))
        devices = sorted({k.device for k in kernels})
        if len(devices) > 1:
            # Stream ids of two GPUs are not comparable: stream 7 of each would make one row, and
            # their kernels' overlap would not count.
            raise ValueError(f"Timeline: kernels of devices {devices}, but a timeline is of one GPU; make one "
                             f"Timeline per device, e.g. Timeline([k for k in kernels if k.device == "
                             f"{devices[0]}]) (load_timelines splits a trace so)")
        for k in kernels:
            if k.end_us < k.start_us:
                raise ValueError(f"Timeline: kernel {k.name!r} on stream {k.stream} ends at {k.end_us} us, before it "
                                 f"starts at {k.start_us} us; give each kernel an end_us >= its start_us")
        t0 = kernels[0].start_us if kernels else 0.0
        self.kernels: list[KernelEvent] = [k._replace(start_us=k.start_us - t0, end_us=k.end_us - t0) for k in kernels]
        self.label = label
        self.metadata: dict[str, Any] = dict(metadata or {})

    def __repr__(self) -> str:
        return (f"Timeline({self.label!r}, kernels={len(self.kernels)}, streams={self.streams}, "
                f"overlap_fraction={self.overlap_fraction:.3f})")

    @property
    def streams(self) -> list[int]:
        r"""The CUDA stream ids that ran kernels, in order of their first kernel."""
        return list(dict.fromkeys(k.stream for k in self.kernels))

    def intervals(self) -> dict[int, list[tuple[float, float]]]:
        r"""Per stream, the ``(start_us, end_us)`` intervals of its kernels, in start order."""
        out: dict[int, list[tuple[float, float]]] = {s: [] for s in self.streams}
        for k in self.kernels:
            out[k.stream].append((k.start_us, k.end_us))
        return out

    def _busy(self) -> dict[int, list[tuple[float, float]]]:
        return {s: _merge(ivs) for s, ivs in self.intervals().items()}

    @property
    def span_us(self) -> float:
        r"""Time from the first kernel's start to the last kernel's end (``0.0`` without kernels)."""
        return max((k.end_us for k in self.kernels), default=0.0)

    @property
    def busy_us(self) -> float:
        r"""Time during which at least one stream runs a kernel."""
        return _time_with_at_least(self._busy(), 1)

    @property
    def overlap_us(self) -> float:
        r"""Time during which kernels of two or more streams run together."""
        return _time_with_at_least(self._busy(), 2)

    @property
    def overlap_fraction(self) -> float:
        r"""``overlap_us / busy_us``: ``0.0`` fully serial (or without kernels), near ``1.0`` almost always
        overlapped."""
        busy = self._busy()
        total = _time_with_at_least(busy, 1)
        return _time_with_at_least(busy, 2) / total if total > 0 else 0.0

    def summary(self) -> str:
        r"""A few lines: kernels and busy time per stream, then span, busy, idle and overlap."""
        if not self.kernels:
            return f"{self.label}: no GPU kernels"
        busy = self._busy()
        lines = [f"{self.label}: {len(self.kernels)} kernels on {len(busy)} stream(s)"]
        for s, ivs in busy.items():
            n = sum(1 for k in self.kernels if k.stream == s)
            lines.append(f"  stream {s:>4}: {n:4d} kernels, busy {sum(e - b for b, e in ivs):9.1f} us")
        total = _time_with_at_least(busy, 1)
        lines.append(f"  span {self.span_us:.1f} us, GPU busy {total:.1f} us, idle {self.span_us - total:.1f} us")
        lines.append(f"  >= 2 streams at once: {self.overlap_us:.1f} us = {100 * self.overlap_fraction:.1f}% of busy time")
        return "\n".join(lines)

    def plot(self, ax: Any = None, *, title: str | None = None) -> Any:
        r"""Draw the timeline, one row per stream, with matplotlib; returns the ``Axes``.

        A grey band above the rows marks where two or more streams run at once.

        Args:
            ax: a matplotlib ``Axes`` to draw into. Default: ``None`` (a new figure).
            title: the title. Default: ``None`` (the label and the overlap fraction).
        """
        plt = _pyplot()
        own_figure = ax is None
        if own_figure:
            _, ax = plt.subplots(figsize=(10, 0.6 * max(1, len(self.streams)) + 1.2))
        streams = self.streams
        colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
        for row, s in enumerate(streams):
            bars = [(b, e - b) for b, e in self.intervals()[s]]
            ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=colors[row % len(colors)], edgecolors="black",
                           linewidth=0.3)
        overlap = _overlap_intervals(self._busy())
        if overlap:
            ax.broken_barh([(b, e - b) for b, e in overlap], (-0.9, 0.3), facecolors="0.4")
        ax.set_yticks([-0.75, *range(len(streams))], [">= 2 streams", *(f"stream {s}" for s in streams)])
        ax.set_ylim(len(streams) - 0.5, -1.0)  # first stream on top, overlap band above it
        ax.set_xlim(0, max(self.span_us, 1e-3))
        ax.set_xlabel("time since first kernel (us)")
        ax.set_title(title if title is not None else
                     f"{self.label}: {100 * self.overlap_fraction:.0f}% of GPU busy time on >= 2 streams")
        if own_figure:
            ax.figure.tight_layout()
        return ax


def _overlap_intervals(per_stream: Mapping[int, list[tuple[float, float]]]) -> list[tuple[float, float]]:
    r"""The intervals during which at least two streams are busy (for the plot's band)."""
    edges = sorted([(t, +1) for ivs in per_stream.values() for t, _ in ivs] +
                   [(t, -1) for ivs in per_stream.values() for _, t in ivs])
    out: list[tuple[float, float]] = []
    busy, since = 0, 0.0
    for t, step in edges:
        if busy >= 2 and t > since:
            out.append((since, t))
        busy += step
        since = t
    return _merge(out)


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        if (e.name or "").partition(".")[0] != "matplotlib":  # installed, but something it imports failed
            raise ImportError(f"parallel_modules.timeline: plotting needs matplotlib, and importing "
                              f"matplotlib.pyplot failed: {e}") from e
        raise ImportError("parallel_modules.timeline: plotting needs matplotlib, which is not installed: "
                          "pip install matplotlib (or pip install 'parallel_modules[plot]')") from e
    return plt


# ----------------------------------------------------------------------------------------------
# Reading traces


class _Exact(float):
    r"""A float read from JSON that keeps its text, so that sums of times are exact (see :func:`_kernels`)."""

    __slots__ = ("text",)


def _exact_float(text: str) -> _Exact:
    value = _Exact(text)
    value.text = text
    return value


def _read_json(path: _PathLike) -> Any:
    path = os.fspath(path)
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"  # torch's tensorboard handler writes .json.gz; any name is read
    opener = gzip.open if gzipped else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:  # what Kineto writes, whatever the locale
            return json.load(f, parse_float=_exact_float)
    except (ValueError, OSError, EOFError, zlib.error) as e:
        # (JSONDecodeError and UnicodeDecodeError are ValueErrors; a truncated gzip file raises
        # EOFError, a corrupted one zlib.error)
        raise ValueError(f"parallel_modules.timeline: cannot read {path!r} as a JSON trace "
                         f"({'gzip' if gzipped else 'plain text'}): {e}") from e


def _is_kernel(event: Any) -> bool:
    # Kineto writes GPU kernels as complete ("X") events of category "kernel" ("Kernel" in old
    # versions); memcpy/memset are "gpu_memcpy"/"gpu_memset", CPU ops "cpu_op", launches "cuda_runtime".
    # (Entries that are not objects are not events: skipped, as trace viewers do.)
    return isinstance(event, Mapping) and event.get("ph") == "X" and str(event.get("cat", "")).lower() == "kernel"


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _decimal(event: Mapping[str, Any], key: str, index: int, default: Any = None) -> decimal.Decimal:
    value = event.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"parallel_modules.timeline: kernel event #{index} ({event.get('name', '?')!r}) has "
                         f"{'no' if value is None else 'a non-numeric'} {key!r}: expected microseconds, got "
                         f"{value!r}")
    try:
        number = decimal.Decimal(getattr(value, "text", None) or (repr(value) if isinstance(value, float) else value))
    except decimal.InvalidOperation:
        number = decimal.Decimal("nan")
    if not number.is_finite():
        raise ValueError(f"parallel_modules.timeline: kernel event #{index} has {key}={value!r}, not a "
                         f"number of microseconds")
    return number


def _kernels(events: Sequence[Any]) -> list[KernelEvent]:
    r"""The kernel events of a trace, timed in microseconds from the first one's start.

    Kineto writes times as microseconds since an epoch with three decimals
    (4.7e12 us): a float that large is 1 ns coarse, so the end of a kernel
    computed in floats (``ts + dur``) lands a step away from the start of one
    that began as it ended, inventing (or hiding) overlap. Times are taken as
    the decimals written, and made relative to the first kernel exactly.
    """
    raw = []
    for i, e in enumerate(events):
        if not _is_kernel(e):
            continue
        args = e.get("args")
        args = args if isinstance(args, Mapping) else {}
        # Kineto puts the stream in args["stream"] and also uses it as the row ("tid"); the device
        # is args["device"] and the row group ("pid").
        stream = _int(args.get("stream", e.get("tid")), 0)
        device = _int(args.get("device", e.get("pid")), 0)
        start, dur = _decimal(e, "ts", i), _decimal(e, "dur", i, 0)
        if dur < 0:
            raise ValueError(f"parallel_modules.timeline: kernel event #{i} ({e.get('name', '?')!r}) has a negative "
                             f"'dur' ({e['dur']!r}): expected its duration in microseconds, >= 0")
        raw.append((str(e.get("name", "?")), stream, start, start + dur, device))
    t0 = min((r[2] for r in raw), default=decimal.Decimal(0))
    return [KernelEvent(name, stream, float(start - t0), float(end - t0), device)
            for name, stream, start, end, device in raw]


def _plain(meta: dict[str, Any]) -> dict[str, Any]:
    r"""``meta`` with the floats :func:`_read_json` read as plain floats."""
    return pytree.tree_map(lambda v: float(v) if type(v) is _Exact else v, meta)


def _trace_metadata(trace: Mapping[str, Any], device: int | None = None) -> dict[str, Any]:
    r"""What a full Kineto trace says about where it was recorded."""
    meta: dict[str, Any] = {}
    props = trace.get("deviceProperties")
    # (Metadata only: a trace whose list is missing or malformed still has its kernels read.)
    props = [p for p in props if isinstance(p, Mapping) and "name" in p] if isinstance(props, list) else []
    match = [p for p in props if device is None or p.get("id", device) == device]
    if match:
        meta["gpu"] = match[0]["name"]
    for key in ("cuda_runtime_version", "cuda_driver_version", "with_cuda_graphs"):
        if key in trace:
            meta[key] = trace[key]
    return _plain(meta)


def _runs(runs: Any) -> dict[int, Mapping[str, Any]]:
    r"""The recordings a compact file lists, by process id: each an object with an int ``pid`` and a ``label``."""
    if not isinstance(runs, list) or not all(
            isinstance(r, Mapping) and isinstance(r.get("pid"), int) and isinstance(r.get("label"), (str, int))
            for r in runs):
        raise ValueError(f"parallel_modules.timeline: cannot read this file's list of recordings: expected "
                         f"otherData['runs'] to be a list of objects each with an int 'pid' and a 'label', as "
                         f"save_timelines writes them, got {runs!r:.200}")
    return {r["pid"]: r for r in runs}


def _timelines_from_trace(trace: Any, label: str) -> dict[str, Timeline]:
    if isinstance(trace, list):  # the JSON array format of Chrome traces
        trace = {"traceEvents": trace}
    if not isinstance(trace, Mapping) or not isinstance(trace.get("traceEvents"), list):
        # (A dict is the expected kind of object: its keys tell what it is instead, e.g. a
        # profiler's summary, or the trace's events under another name.)
        if not isinstance(trace, Mapping):
            got = type(trace).__name__
        elif "traceEvents" in trace:
            got = f"a 'traceEvents' of type {type(trace['traceEvents']).__name__}"
        else:
            got = f"an object with the keys {reprlib.repr(sorted(map(str, trace)))}"  # (a long list cut, marked so)
        raise ValueError("parallel_modules.timeline: not a Chrome trace: expected a JSON object with a "
                         f"'traceEvents' list (or a list of events), got {got}")
    other = trace.get("otherData")
    other = other if isinstance(other, Mapping) else {}
    written = other.get("format")
    if isinstance(written, str) and written.startswith(_FORMAT.rpartition("/")[0] + "/") and written != _FORMAT:
        raise ValueError(f"parallel_modules.timeline: this file is in format {written!r}, written by another "
                         f"version of parallel_modules; this one reads {_FORMAT!r}. Load it with the version that "
                         f"wrote it, or record the timeline again.")
    if written == _FORMAT:  # our compact file: one process ("pid") per recording
        meta = _plain({k: v for k, v in other.items() if k not in ("format", "runs")})
        runs = _runs(other.get("runs", []))
        events: dict[int, list[Any]] = defaultdict(list)
        for e in trace["traceEvents"]:
            if _is_kernel(e):
                events[_int(e.get("pid"), 0)].append(e)
        by_pid = {pid: _kernels(es) for pid, es in events.items()}
        out = {}
        for pid in sorted(set(runs) | set(by_pid)):
            run = runs.get(pid, {"label": f"run {pid}"})
            # (Labels are strings; save_timelines once also wrote ints, read here as the strings they print as.)
            name = str(run["label"])  # (not the argument ``label``: that names a foreign trace)
            if name in out:
                raise ValueError(f"parallel_modules.timeline: this file holds two recordings labelled "
                                 f"{name!r}; save_timelines writes distinct labels, so it was edited "
                                 f"since. Give each of its 'runs' its own label.")
            out[name] = Timeline(by_pid.get(pid, []), name,
                                 {**meta, **_plain({k: v for k, v in run.items() if k not in ("label", "pid")})})
        return out
    kernels = _kernels(trace["traceEvents"])
    devices = sorted({k.device for k in kernels})
    if len(devices) <= 1:
        return {label: Timeline(kernels, label, _trace_metadata(trace, devices[0] if devices else None))}
    return {f"{label} cuda:{d}": Timeline([k for k in kernels if k.device == d], f"{label} cuda:{d}",
                                          _trace_metadata(trace, d))
            for d in devices}


def load_timelines(trace: _PathLike | Mapping[str, Any] | list) -> dict[str, Timeline]:
    r"""Reads the GPU kernels of a Chrome trace, or of a file written by :func:`save_timelines`.

    Works without a GPU. Only kernel events are kept (memory copies, CPU
    operators and CUDA runtime calls are dropped).

    Args:
        trace: the path of a ``.json`` (or ``.json.gz``) trace -- a file from
            ``prof.export_chrome_trace(path)`` or from :func:`save_timelines`
            -- or the already parsed JSON.

    Returns:
        The timelines by label: for a compact file, one per recording saved in
        it; for a profiler trace, one labelled with the file's name (one per
        device if kernels ran on several GPUs). A trace without kernels gives a
        timeline without kernels.

    Example::

        >>> prof.export_chrome_trace("trace.json")
        >>> (tl,) = load_timelines("trace.json").values()
    """
    if isinstance(trace, (Mapping, list)):
        return _timelines_from_trace(trace, "trace")
    if not isinstance(trace, (str, os.PathLike)):
        raise TypeError(f"load_timelines: expected the path of a trace file (a str or os.PathLike) or its parsed "
                        f"JSON (a dict, or a list of events), got {type(trace).__name__}")
    name = os.path.basename(os.fspath(trace))
    for suffix in (".gz", ".json", ".pt.trace"):
        name = name[: -len(suffix)] if name.endswith(suffix) else name
    return _timelines_from_trace(_read_json(trace), name or "trace")


def _unsaved(value: Any, where: str) -> str | None:
    r"""Why metadata ``value`` (found at ``where``) would not load back as it was saved, or ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        # (json writes them as NaN and Infinity, which Python reads back but JSON is without:
        # chrome://tracing and Perfetto refuse the whole file.)
        return f"{where} is {value!r}, which JSON cannot hold; store None or a string instead"
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                # (JSON's keys are strings: 1 would load back as "1", and 1 and "1" as one key.)
                return (f"{where} has the key {key!r} ({type(key).__name__}), which JSON keeps only as a string; "
                        f"use string keys")
            why = _unsaved(item, f"{where}[{key!r}]")
            if why is not None:
                return why
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            why = _unsaved(item, f"{where}[{i}]")
            if why is not None:
                return why
    elif value is not None and not isinstance(value, (str, int, float)):
        # (json.dumps would fail on it with a message naming neither the key nor the timeline.)
        return (f"{where} is {value!r} ({type(value).__name__}), which JSON cannot hold; store a string, "
                f"number, bool, None, list or dict instead, e.g. str(value)")
    return None


def save_timelines(path: _PathLike, *timelines: Timeline, metadata: Mapping[str, Any] | None = None) -> None:
    r"""Writes timelines to a small JSON file: kernel events only, one process per timeline.

    The file is a valid Chrome trace (open it in ``chrome://tracing`` or
    Perfetto: each timeline is a process, each stream a thread) and
    :func:`load_timelines` reads it back with labels and metadata. Each
    timeline's metadata is kept with it; ``metadata`` applies to the file.

    Args:
        path: where to write.
        *timelines: the timelines, with distinct labels.
        metadata: extra facts about the whole file (e.g. what was recorded).
            Default: ``None``.

    Metadata is saved as JSON, which holds strings, numbers, booleans, None,
    lists and dicts, keys objects by strings and holds no NaN or infinity:
    other values, other keys and such floats are refused, as they would not
    load back as they were.
    """
    for i, tl in enumerate(timelines):
        # (Else an AttributeError on ``.metadata`` below: a list passed as one argument, or the path
        # and a timeline swapped.)
        if not isinstance(tl, Timeline):
            if isinstance(tl, (list, tuple)):
                fix = "pass them as separate arguments, save_timelines(path, *timelines)"
            elif isinstance(tl, (str, os.PathLike)):
                fix = "the path comes first, save_timelines(path, timeline, ...)"
            else:
                fix = "pass the Timeline objects record_timeline and load_timelines return"
            raise TypeError(f"save_timelines: timeline #{i} (argument {i + 2}) must be a Timeline, got "
                            f"{type(tl).__name__}; {fix}")
    # The file format writes these keys itself, which such metadata would have replaced: the file's format
    # marker and list of recordings, each recording's label and process id (its row).
    used = [k for k in ("format", "runs") if k in (metadata or {})]
    if used:
        raise ValueError(f"save_timelines: the file's metadata has the key(s) {used}, which the file format reserves "
                         f"('format' and 'runs'); rename them, e.g. {used[0]!r} to {used[0] + '_'!r}")
    for tl in timelines:
        used = [k for k in ("label", "pid") if k in tl.metadata]
        if used:
            raise ValueError(f"save_timelines: the metadata of timeline {tl.label!r} has the key(s) {used}, which the "
                             f"file format reserves for each timeline ('label' and 'pid'); rename them, e.g. "
                             f"timeline.metadata[{used[0] + '_'!r}] = timeline.metadata.pop({used[0]!r})")
    labels = [t.label for t in timelines]
    for tl in timelines:
        # (Timeline checks the label it is given, but the attribute can be set since.)
        _check_label("save_timelines", tl.label, "timeline.label = {name}")
    for owner, meta in [("the file", metadata or {}), *((f"timeline {t.label!r}", t.metadata) for t in timelines)]:
        why = _unsaved(meta, "metadata")
        if why is not None:
            raise ValueError(f"save_timelines: {why} (in the metadata of {owner})")
    if len(set(labels)) != len(labels):
        raise ValueError(f"save_timelines: timeline labels must be distinct to be told apart, got {labels}")
    events: list[dict[str, Any]] = []
    runs = []
    for pid, tl in enumerate(timelines):
        runs.append({"label": tl.label, "pid": pid, **tl.metadata})
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": tl.label}})
        for s in tl.streams:
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": s, "args": {"name": f"stream {s}"}})
        for k in tl.kernels:
            events.append({"ph": "X", "cat": "kernel", "name": k.name, "pid": pid, "tid": k.stream,
                           "ts": round(k.start_us, 3), "dur": round(round(k.end_us, 3) - round(k.start_us, 3), 3),
                           "args": {"stream": k.stream, "device": k.device}})
    doc = {"otherData": {"format": _FORMAT, **dict(metadata or {}), "runs": runs},
           "displayTimeUnit": "ms", "traceEvents": events}
    text = json.dumps(doc, indent=0, separators=(",", ":")) + "\n"  # fails before the file is touched
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write(text)


# ----------------------------------------------------------------------------------------------
# Recording


def _environment(device: torch.device) -> dict[str, Any]:
    return {"recorded": datetime.datetime.now().isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}


def _cuda_device(args: Sequence[Any], kwargs: Mapping[str, Any], module: Any) -> torch.device | None:
    # The first CUDA tensor of the inputs (nested in lists and dicts too), else of the module.
    tensors = [a for a in pytree.tree_leaves((list(args), dict(kwargs))) if isinstance(a, torch.Tensor)]
    if isinstance(module, torch.nn.Module):
        tensors += [*module.parameters(), *module.buffers()]
    for t in tensors:
        if t.is_cuda:
            return t.device
    return None


def _count(name: str, arg: str, value: Any, least: int) -> int:
    r"""``value``, a count of calls given to ``record_timeline(name)`` as ``arg``, as an ``int`` of at least ``least``.

    Any integer (see :func:`~parallel_modules._inputs._integer`) is taken as the ``int`` it is: the
    timeline's metadata keeps it, and JSON holds no numpy scalar (``save_timelines`` refused such
    a timeline). ``bool`` is refused, though ``int`` takes it.
    """
    count = _integer(value)
    if count is None:
        raise TypeError(f"record_timeline({name}): {arg} must be an int >= {least}, got {value!r} "
                        f"({type(value).__name__})")
    if count < least:
        raise ValueError(f"record_timeline({name}): {arg} must be an int >= {least}, got {value!r}")
    return count


def record_timeline(module: Callable[..., Any], *args: Any, warmup: int = 30, calls: int = 3,
                    label: str | None = None, **kwargs: Any) -> Timeline:
    r"""Profiles ``calls`` calls of ``module(*args, **kwargs)`` and returns their GPU kernels.

    The ``warmup`` calls run first, outside the profiler, so that lazy
    initialisation, cuDNN's choices, the stream tuning of
    ``Parallel(streams="auto")`` and ``fuse="auto"`` (14 calls per input
    signature and candidate schedule) and CUDA graph capture are not in the
    timeline; while the last of them still tried schedules (in any block the
    callable runs), up to 160 more calls run, so that the
    profiled calls all run the schedules kept. The warm-up calls are real calls: in training mode
    they update BatchNorm statistics and draw dropout masks like any other. The recorded calls are then
    run back to back under :class:`torch.profiler.profile` with CUDA activity,
    followed by a synchronisation, and the trace is read like
    :func:`load_timelines` reads a file, except that only the kernels of one
    GPU are kept: the device of the first CUDA tensor among the inputs (else
    among the module's parameters and buffers). For branches on several GPUs,
    profile with :class:`torch.profiler.profile` yourself and read the trace
    with :func:`load_timelines`, which gives one timeline per device. Grad
    mode is the caller's: wrap the call in ``torch.no_grad()`` to record
    inference.

    Stream timelines need CUDA: without a CUDA GPU, or when no argument nor
    parameter is on a CUDA device, this raises ``RuntimeError`` rather than
    return an empty timeline. A trace recorded on a GPU can be read anywhere
    with :func:`load_timelines`.

    Args:
        module: the module (or any callable) to profile.
        *args, **kwargs: its inputs.
        warmup: calls before profiling. Default: ``30``.
        calls: profiled calls. Default: ``3``.
        label: the timeline's label. Default: ``None`` (the module's class name).

    Example::

        >>> with torch.no_grad():
        ...     tl = record_timeline(block, x)
        >>> tl.overlap_fraction
    """
    if label is not None:
        _check_label(f"record_timeline({type(module).__name__})", label, "record_timeline(..., label={name})")
    name = label or type(module).__name__
    # Checked before anything runs, on the CPU too: a float or a string failed only in range(), after the
    # warm-up, and a negative warm-up ran none, then went on as if some calls still tried schedules.
    calls, warmup = _count(name, "calls", calls, 1), _count(name, "warmup", warmup, 0)
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"record_timeline({name}): stream timelines need a CUDA GPU, and torch.cuda.is_available() is False "
            f"(torch {torch.__version__}). On the CPU branches run one after another, so there is no timeline "
            "to record; read a trace recorded on a GPU with parallel_modules.timeline.load_timelines(path).")
    device = _cuda_device(args, kwargs, module)
    if device is None:
        raise RuntimeError(
            f"record_timeline({name}): no input and no parameter is on a CUDA device, so the call would run no "
            "GPU kernels. Move the module and its inputs to CUDA first, e.g. module.cuda(), x.cuda().")
    from torch.profiler import ProfilerActivity, profile

    if ProfilerActivity.CUDA not in torch.profiler.supported_activities():
        raise RuntimeError(f"record_timeline({name}): this torch build's profiler cannot record CUDA activity "
                           f"(torch.profiler.supported_activities() lacks ProfilerActivity.CUDA); a CUDA build "
                           f"of torch with the Kineto profiler can")
    _autotune._warm_up(lambda: module(*args, **kwargs), warmup)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            module(*args, **kwargs)
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        trace = _read_json(path)
    kernels = _kernels(trace["traceEvents"])
    # The input's GPU only: stream ids of two GPUs are not comparable (load_timelines splits by device).
    kernels = [k for k in kernels if k.device == device.index]
    meta = {**_environment(device), "calls": calls, "warmup": warmup, **_trace_metadata(trace, device.index)}
    if not kernels:
        raise RuntimeError(f"record_timeline({name}): the profiler recorded no GPU kernels in {calls} call(s) "
                           "on " + str(device) + ". Does the module run on CUDA?")
    return Timeline(kernels, name, meta)
