"""Host-to-device pipeline: which of its parts pays (dev tool, not shipped).

Times, interleaved in one process, the h2d case (64 x 3x224x224 fp32, pinned) copied then computed
on one stream against ``ParallelSequential(chunks=4)`` with the copy lane issued first or in the
wavefront, and the last stage's pieces concatenated by the last lane as they come or by the caller
at the end; GPU time per call (events around back-to-back calls) and CPU time per call.
Usage: ``PYTHONPATH=. python3 tools/exp_h2d.py [chunks] [lanes|slots]``; ends with the operators that take the CPU time of
a chunked call (a profile of 20 calls), the GPU activity of one graphed call, and its host
operations of 10 us or more. ``lanes``: only when each lane of the graphed call
reaches each point, from timing events, over calls made back to back. ``slots``: only the
library's graphed call (also with its stages replayed from graphs captured by hand) against a
pipeline written by hand with one graph per micro-batch slot (the copy writes the graph's input),
with one graph whose input is copied in, and with pieces allocated per call; then the host time,
the periods of calls back to back, and one call from an idle GPU under the profiler (``window``:
the host operations between its first two replays).
"""
import sys
import time

import torch
from torch import nn

from parallel_modules import ParallelSequential, pipeline
from parallel_modules._cases import PIPELINES
from parallel_modules.bench import _capture
from _timing import cpu_us, gpu_medians, op_table  # tools/ is the script's directory

torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")
chunks = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 4
case = PIPELINES["h2d"]
stages = case.stages(dev, torch.float32)
seq = nn.Sequential(*stages)
x = case.make_input(64, dev, torch.float32)
model = ParallelSequential(*stages, chunks=chunks)

FLAGS = {"ahead": True, "gather": True}
pinned, add = pipeline._pinned, pipeline._Gather.add
pipeline._pinned = lambda v: FLAGS["ahead"] and pinned(v)
run_pipeline = ParallelSequential._pipeline


def forced_pipeline(self, stages, input, pieces, device, copy, ahead=False):
    return run_pipeline(self, stages, input, pieces, device, copy, FLAGS.get("force_ahead", ahead))


ParallelSequential._pipeline = forced_pipeline


def gather_add(self, m, value):
    if not FLAGS["gather"]:
        self.ok = False
    return add(self, m, value)


pipeline._Gather.add = gather_add


def variant(ahead, gather):
    def run():
        FLAGS.update(ahead=ahead, gather=gather)
        FLAGS.pop("force_ahead", None)
        return model(x)
    return run


variants = {"copy then compute": lambda: seq(x.to(dev, non_blocking=True))}
for ahead in (True, False):
    for gather in (True, False):
        variants[f"c{chunks} copies first={ahead} gather={gather}"] = variant(ahead, gather)
graphed = ParallelSequential(*stages, chunks=chunks, cuda_graph=True)
for ahead in (True, False):
    variants[f"c{chunks} graphed per stage, copies first={ahead}"] = (
        lambda ahead=ahead: (FLAGS.update(ahead=True, gather=True, force_ahead=ahead), graphed(x))[1])

if "slots" in sys.argv:
    # By hand, the pipeline with one graph per micro-batch slot, each captured on its own device
    # staging buffer, into which the copy stream writes the piece (no copy into a graph's input);
    # against one graph for every slot (its input copied in, as the library's stages are).
    piece = 64 // chunks
    copy_s, comp_s, caller = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.current_stream()
    staging = [torch.empty((piece, *x.shape[1:]), device=dev) for _ in range(chunks)]

    def capture_on(buf):
        # As ``_capture``, but the graph reads ``buf`` itself: a replay copies nothing in.
        side = torch.cuda.Stream()
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            for _ in range(3):
                seq(buf)
        caller.wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = seq(buf)
        return lambda _buf: (g.replay(), out)[1]

    with torch.no_grad():
        per_slot = [capture_on(s) for s in staging]
        shared = _capture(seq, staging[0])
    ev = [torch.cuda.Event() for _ in range(chunks)]

    def by_hand(slots, allocate=False):
        copy_s.wait_stream(caller)
        comp_s.wait_stream(caller)
        pieces = list(staging)
        with torch.cuda.stream(copy_s):
            for m in range(chunks):
                if allocate:  # as the library: a new tensor per piece, read on the compute stream
                    pieces[m] = x[m * piece:(m + 1) * piece].to(dev, non_blocking=True)
                    pieces[m].record_stream(comp_s)
                else:
                    staging[m].copy_(x[m * piece:(m + 1) * piece], non_blocking=True)
                ev[m].record()
        out = None
        with torch.cuda.stream(comp_s):
            for m in range(chunks):
                comp_s.wait_event(ev[m])
                y = per_slot[m](staging[m]) if slots else shared(pieces[m])
                if out is None:
                    out = torch.empty((64, *y.shape[1:]), device=dev)
                out[m * piece:(m + 1) * piece].copy_(y)
        caller.wait_stream(comp_s)
        out.record_stream(caller)
        return out

    # The library's pipeline with each stage replayed by a graph captured by hand (no _CudaGraphs):
    # what the pipeline's own machinery costs, apart from the graph cache's call.
    class HandStage:
        def __init__(self, stage):
            with torch.no_grad():
                self.replay = _capture(stage, x[:piece].to(dev))

        def __call__(self, forward, args, kwargs):
            return self.replay(args[0])

    hand_stages = ParallelSequential(*stages, chunks=chunks, cuda_graph=True)
    hand_stages._stage_graphs = lambda plan, kept=[HandStage(s) for s in stages]: kept

    runs = {"copy then compute": variants["copy then compute"],
            f"c{chunks} library graphed, copies first": variants[f"c{chunks} graphed per stage, copies first=True"],
            f"c{chunks} library, stages replayed by hand": lambda: (FLAGS.update(ahead=True, gather=True),
                                                                    FLAGS.pop("force_ahead", None),
                                                                    hand_stages(x))[-1],
            f"c{chunks} by hand, one graph per slot": lambda: by_hand(True),
            f"c{chunks} by hand, one graph, copied in": lambda: by_hand(False),
            f"c{chunks} by hand, copied in, pieces allocated": lambda: by_hand(False, True)}
    with torch.no_grad():
        ref = seq(x.to(dev))
        for name, fn in runs.items():
            torch.testing.assert_close(fn(), ref, rtol=1e-4, atol=1e-4)
        for rep in range(2):
            times = gpu_medians(runs, rounds=30, per_sample=5)
            for name, t in times.items():
                print(f"{name:<48}{t:10.1f} us {times['copy then compute'] / t:6.3f}x")
        for name, fn in runs.items():
            # Host time per call, and the GPU's period between calls made back to back (events on the
            # caller's stream before each call).
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(9)]
            torch.cuda.synchronize()
            for e in marks:
                e.record()
                fn()
            torch.cuda.synchronize()
            periods = " ".join(f"{a.elapsed_time(b) * 1e3:6.1f}" for a, b in zip(marks, marks[1:]))
            # Whether a call waits for the GPU: calls queued behind a long kernel.
            torch.cuda._sleep(50_000_000)
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            behind = (time.perf_counter() - t0) / 5 * 1e6
            torch.cuda.synchronize()
            print(f"{name:<48} host {cpu_us(fn, n=20, warmup=3):7.1f} us/call ({behind:7.1f} queued behind a "
                  f"long kernel); periods {periods}")
        for cache in graphed._per_stage.values():
            for key, g in cache._graphs.items():
                print(f"stage graph {key[0][0]}: lent={g.lending.lent} watch={g.lending.watch} streak={g.lending.streak}")
        # One call from an idle GPU: when the host issues each copy and replay (CUDA runtime calls,
        # us from the call's start) and when the GPU runs them.
        for name in [n for n in runs if "library graphed" in n or "copied in, pieces" in n]:
            for _ in range(3):
                runs[name]()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                runs[name]()
                torch.cuda.synchronize()
            evs = sorted(prof.events(), key=lambda e: e.time_range.start)
            t0 = evs[0].time_range.start
            if "window" in sys.argv:
                # Every host operation between the first two graph launches.
                launches = [e.time_range.start for e in evs if e.name.startswith("cudaGraphLaunch")]
                print(f"---- {name}: host operations between the first two graph launches (us from the call's start)")
                for e in evs:
                    if (e.device_type != torch.autograd.DeviceType.CUDA
                            and launches[0] <= e.time_range.start <= launches[1]):
                        print(f"  {e.time_range.start - t0:8.1f} {e.time_range.end - t0:8.1f}  {e.name[:70]}")
                continue
            print(f"---- {name}: one call from an idle GPU (us from its start)")
            for e in evs:
                gpu = e.device_type == torch.autograd.DeviceType.CUDA
                if gpu or e.name.startswith(("cudaMemcpyAsync", "cudaGraphLaunch", "cudaMalloc", "cudaFree",
                                             "cudaStreamSynchronize", "cudaEventSynchronize")):
                    print(f"  {'GPU' if gpu else 'CPU'} {e.time_range.start - t0:8.1f} {e.time_range.end - t0:8.1f}  "
                          f"{e.name[:50]}")
    sys.exit()

if "lanes" in sys.argv:
    # Timing events: the pipeline's own (fork, copy of each piece, the last piece's end), and
    # ours around the graphed stage's copy-in and the gather copy of each piece.
    from parallel_modules import _graphs
    marks: list = []
    copy_in = _graphs._Graph._copy_in

    def mark(label):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append((label, e))

    def timed_copy_in(self, tensors):
        mark("stage start")
        copy_in(self, tensors)

    def timed_add(self, m, value):
        mark(f"computed {m}")
        taken = add(self, m, value)
        mark(f"gathered {m}")
        return taken

    _graphs._Graph._copy_in, pipeline._Gather.add = timed_copy_in, timed_add
    with torch.no_grad():
        for _ in range(10):
            graphed(x)
        torch.cuda.synchronize()
        calls = []
        for k in range(6):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(64)]
            pipeline._local.events = {dev.index or 0: events}
            marks = []
            graphed(x)
            calls.append((events, marks))
        torch.cuda.synchronize()
    lanes = 2
    origin = calls[0][0][chunks * lanes]
    for k, (events, marks) in enumerate(calls):
        fork = events[chunks * lanes]
        at = lambda e: origin.elapsed_time(e) * 1e3  # noqa: E731
        copies = " ".join(f"{at(events[m * lanes]) - at(fork):6.1f}" for m in range(chunks))
        print(f"call {k}: fork at {at(fork):8.1f} us; copies done at {copies}; "
              f"end {at(events[chunks * lanes - 1]) - at(fork):6.1f}")
        print("   " + ", ".join(f"{label} {at(e) - at(fork):6.1f}" for label, e in marks))
    sys.exit()

with torch.no_grad():
    ref = seq(x.to(dev))
    for name, fn in variants.items():
        torch.testing.assert_close(fn(), ref, rtol=1e-4, atol=1e-4)
    times = gpu_medians(variants, rounds=30, per_sample=5)
    host = {name: cpu_us(fn, n=50, warmup=5) for name, fn in variants.items()}
    FLAGS.pop("force_ahead", None)
print(f"{'variant':<48}{'GPU us/call':>12}{'speed-up':>10}{'CPU us/call':>13}")
for name, t in times.items():
    print(f"{name:<48}{t:12.1f}{times['copy then compute'] / t:9.2f}x{host[name]:13.1f}")

# Where the CPU time of a chunked call goes: operators by their own CPU time over 20 calls.
FLAGS.update(ahead=True, gather=True)
with torch.no_grad():
    op_table(lambda: model(x), calls=20, rows=14)

# One call of the graphed module (host input: copies eager, the stage replayed per micro-batch):
# every GPU activity, microseconds from the first, with its stream.
with torch.no_grad():
    for _ in range(20):
        graphed(x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graphed(x)
        torch.cuda.synchronize()
events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
t0 = events[0].time_range.start
print(f"---- graphed chunks={chunks}: GPU activity of one call (us from the first)")
for e in events:
    print(f"  {e.time_range.start - t0:8.1f} {e.time_range.end - t0:8.1f}  stream {e.device_resource_id:>3}  {e.name[:70]}")

# The host side of one graphed call: a cProfile, and what a pinned-memory check costs.
from _timing import profile  # noqa: E402
with torch.no_grad():
    FLAGS.update(ahead=True, gather=True)
    FLAGS.pop("force_ahead", None)
    print(f"x.is_pinned(): {cpu_us(x.is_pinned, n=200):.1f} us, of a piece {cpu_us(x[16:32].is_pinned, n=200):.1f} us")
    profile(f"graphed chunks={chunks}", lambda: graphed(x), n=50, top=25, warmup=5)

# The CUDA runtime calls of one graphed call that took the host 10 us or more, from its start:
# a copy issued late by a host that blocked (an allocation, a synchronisation) shows here.
with torch.no_grad():
    for _ in range(20):
        graphed(x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        graphed(x)
        torch.cuda.synchronize()
cpu = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU),
             key=lambda e: e.time_range.start)
t0 = cpu[0].time_range.start
print("---- graphed call: host operations of 10 us or more (us from the call's start)")
for e in cpu:
    if e.time_range.end - e.time_range.start >= 10 or e.name.startswith(("cudaMalloc", "cudaFree", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")):
        print(f"  {e.time_range.start - t0:8.1f} {e.time_range.end - t0:8.1f}  {e.name[:60]}")
