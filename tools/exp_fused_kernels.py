"""The kernels of a fused graphed call, one replay, against the floor's (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_fused_kernels.py [case ...]`` on the GPU machine (default mlp8).
For the floor (one branch captured by hand) and ``Parallel(cuda_graph=True, fuse=True)``, replayed
behind a spin kernel so that the host is out of the way: every kernel of the last replay with its
start (from the replay's first kernel), its duration and the gap before it, on which stream; and the
replay's span. Where the fused graph spends GPU time that the floor does not, it shows here.
"""
import sys

import torch

from parallel_modules import Parallel
from parallel_modules._cases import CASES
from parallel_modules.parallel import _INLINE_BIAS
from _timing import graph_by_hand  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")


def kernels(fn, calls=5):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(int(1e6))
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    ev = [e for e in ev if "sleep" not in e.name and "spin" not in e.name]
    per = len(ev) // calls
    return ev[-per:]


for name in sys.argv[1:] or ["mlp8"]:
    case = CASES[name]
    br = case.branches(dev, torch.float32)
    x = case.make_input(case.batches[0], dev, torch.float32)
    with torch.no_grad():
        fused = Parallel(*br, cuda_graph=True, fuse=True)
        auto = Parallel(*br, cuda_graph=True, fuse="auto")
        streams = Parallel(*br, cuda_graph=True, fuse=False)
        # The fused block's two captures, each alone: biases copied in on a side stream, or in line.
        side = Parallel(*br, cuda_graph=True, fuse=True)
        side._graph_variants = lambda *a: [None]
        in_line = Parallel(*br, cuda_graph=True, fuse=True)
        in_line._graph_variants = lambda *a: [(_INLINE_BIAS,)]
        floor = graph_by_hand(br[0], x)
        for label, fn in [("floor", floor.replay), ("fused", lambda: fused(x)), ("auto", lambda: auto(x)),
                          ("fused, biases on a side stream", lambda: side(x)),
                          ("fused, biases in line", lambda: in_line(x)),
                          ("streams", lambda: streams(x))]:
            ev = kernels(fn)
            t0 = ev[0].time_range.start
            end = max(e.time_range.end for e in ev)
            print(f"---- {name} {label}: {len(ev)} kernels, span {end - t0:.1f} us")
            prev = t0
            for e in ev:
                s = e.time_range.start
                print(f"  {s - t0:7.1f} +{e.time_range.elapsed_us():6.1f}  gap {s - prev:5.1f}  "
                      f"stream {getattr(e, 'stream', '?')}  {e.name[:90]}")
                prev = max(prev, e.time_range.end)
        for label, m in (("fused", fused), ("auto", auto), ("side", side), ("in line", in_line), ("streams", streams)):
            g = next(iter(m._graphs._graphs.values()))
            print(label, "variants:", list(m._graphs.variants().values()), "reader kept:", g.reader is not None,
                  "readable:", g.readable)
