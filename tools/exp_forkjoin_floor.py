"""What a fork/join of N tiny branches costs at least, against the library's (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_forkjoin_floor.py [N ...]`` on the GPU machine.

Times, per call and on the host, N x Linear(16, 16) joined by cat: the branches in a loop,
a hand-written fork/join with the C bindings ``_streams`` uses (with and without
record_stream), the same with each step left out in turn, and ``Parallel(streams=True)``;
then a cProfile of the library's call. The gap between the hand-written and the library's
call is what the library adds; the gap between the loop and the hand-written call is the
floor that CUDA's stream and event calls set on this host.
"""
import statistics
import sys

import torch
from torch import nn

from parallel_modules import Parallel
from _timing import cpu_us, hand_fork_join, profile  # tools/ is the script's directory

dev = torch.device("cuda")
x = torch.randn(8, 16, device=dev)


def per_call(fn):
    return cpu_us(fn, 5000, warmup=300, repeats=7, pick=statistics.median)


for n in [int(a) for a in sys.argv[1:]] or [2, 4, 8, 16]:
    lins = [nn.Linear(16, 16).to(dev) for _ in range(n)]
    sides = [torch.cuda.Stream() for _ in range(n - 1)]
    cur = torch.cuda.current_stream()
    fork = torch.cuda.Event()
    joins = [torch.cuda.Event() for _ in range(n - 1)]

    def hand(release="wait", events=True, switch=True):
        return hand_fork_join(lins, x, cur, sides, fork, joins, release, events, switch)

    par = Parallel(*lins, streams=True)
    with torch.no_grad():
        t = {
            "loop+cat": per_call(lambda: torch.cat([l(x) for l in lins], 1)),
            "hand record_stream": per_call(lambda: hand("record_stream")),
            "hand wait-after": per_call(hand),
            "hand no release": per_call(lambda: hand(None)),
            "hand no events": per_call(lambda: hand(None, events=False)),
            "hand no switch": per_call(lambda: hand(None, events=False, switch=False)),
            "Parallel streams=True": per_call(lambda: par(x)),
        }
        base = t["loop+cat"]
        print(f"N={n}: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))
        print(f"N={n}: per side branch over loop+cat: " + ", ".join(
            f"{k} {(v - base) / (n - 1):.1f}" for k, v in t.items() if k != "loop+cat"))
        if n == 2:
            profile("Parallel streams=True N=2", lambda: par(x), 3000, 22, warmup=300)
