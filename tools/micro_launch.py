"""Does launching a CUDA graph block while its previous launch still runs? (dev tool, not shipped)

Times each host call (copy_, replay, clone) in a steady stream of calls, for one
graph exec replayed back to back and for two execs of the same work alternated.
Usage: ``PYTHONPATH=. python3 tools/micro_launch.py``
"""
import statistics
import time

import torch

from parallel_modules import Parallel
from parallel_modules._cases import CASES

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")


def capture(fn, x, pool=None):
    sx = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            fn(sx)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g, pool=pool):
        out = fn(sx)
    return g, sx, out


for name, batch in [("tiny8", 8), ("mlp8", 8), ("inception", 1)]:
    case = CASES[name]
    br = case.branches(dev, torch.float32)
    x = case.make_input(batch, dev, torch.float32)
    par = Parallel(*br, streams=True)
    execs = [capture(par, x) for _ in range(2)]
    for label, order in [("one exec", [0]), ("two execs alternated", [0, 1])]:
        t_copy, t_rep, t_clone, t_call = [], [], [], []
        torch.cuda.synchronize()
        n = 400
        t_start = time.perf_counter()
        for i in range(n):
            g, sx, out = execs[order[i % len(order)]]
            a = time.perf_counter()
            sx.copy_(x)
            b = time.perf_counter()
            g.replay()
            c = time.perf_counter()
            y = out.clone()
            d = time.perf_counter()
            t_copy.append(b - a), t_rep.append(c - b), t_clone.append(d - c), t_call.append(d - a)
        torch.cuda.synchronize()
        total = (time.perf_counter() - t_start) / n
        med = lambda v: statistics.median(v[50:]) * 1e6
        print(f"{name:<10}{label:<22} copy {med(t_copy):6.1f}  replay {med(t_rep):6.1f}  clone {med(t_clone):6.1f}"
              f"  call {med(t_call):6.1f}  wall/call {total * 1e6:6.1f} us")
    # Graph GPU time alone, for reference.
    g, sx, out = execs[0]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); g.replay(); e1.record(); e1.synchronize()
    print(f"{name:<10}graph GPU time {e0.elapsed_time(e1) * 1e3:.1f} us")
