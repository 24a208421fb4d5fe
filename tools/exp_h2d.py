"""Host-to-device pipeline: which of its parts pays (dev tool, not shipped).

Times, interleaved in one process, the h2d case (64 x 3x224x224 fp32, pinned) copied then computed
on one stream against ``ParallelSequential(chunks=4)`` with the copy lane issued first or in the
wavefront, and the last stage's pieces concatenated by the last lane as they come or by the caller
at the end; GPU time per call (events around back-to-back calls) and CPU time per call.
Usage: ``PYTHONPATH=. python3 tools/exp_h2d.py [chunks] [lanes]``; ends with the operators that take the CPU time of
a chunked call (a profile of 20 calls), the GPU activity of one graphed call, and its host
operations of 10 us or more. ``lanes``: only when each lane of the graphed call
reaches each point, from timing events, over calls made back to back.
"""
import sys

import torch
from torch import nn

from parallel_modules import ParallelSequential, pipeline
from parallel_modules._cases import PIPELINES
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
