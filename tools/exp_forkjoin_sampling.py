"""Why the benchmark's fork/join figure is 2-4x what the fork/join tools measure (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_forkjoin_sampling.py [N ...]`` on the GPU machine.

The benchmark times each mode in samples of 20 calls from a synchronized, idle GPU, interleaved with
the other modes; ``exp_forkjoin_floor``/``_layers`` time thousands of calls back to back. Here the
same variants (N x Linear(16, 16) joined by cat: a loop, a hand-written fork/join, ``Parallel``
sequential and forked) are timed both ways in one process, and within the benchmark's samples call by
call: whether the cost is in every call, or in the first calls after the GPU went idle.
"""
import statistics
import sys
import time

import torch
from torch import nn

from parallel_modules import Parallel
from parallel_modules._streams import _pool
from _timing import cpu_us, hand_fork_join  # tools/ is the script's directory

dev = torch.device("cuda")
x = torch.randn(8, 16, device=dev)
GROUP = 20

for n in [int(a) for a in sys.argv[1:]] or [2, 16]:
    lins = [nn.Linear(16, 16).to(dev) for _ in range(n)]
    pool = _pool(dev, False)
    cur = torch.cuda.current_stream()
    sides = pool.side_streams(0, n - 1, cur)
    forks, joins = pool.events(n)
    variants = {
        "loop+cat": lambda: torch.cat([l(x) for l in lins], 1),
        "hand fork/join": lambda: hand_fork_join(lins, x, cur, sides, forks[0], joins[1:n]),
        "Parallel streams=False": Parallel(*lins, streams=False),
        "Parallel streams=True": Parallel(*lins, streams=True),
    }
    variants = {k: (v if not isinstance(v, nn.Module) else (lambda m=v: m(x))) for k, v in variants.items()}
    with torch.no_grad():
        for fn in variants.values():
            for _ in range(300):
                fn()
        torch.cuda.synchronize()
        # Benchmark-style: sync, GROUP calls, each timed; interleaved rounds.
        per_call = {k: [[] for _ in range(GROUP)] for k in variants}
        sample = {k: [] for k in variants}
        for _ in range(300):
            for k, fn in variants.items():
                torch.cuda.synchronize()
                t = [time.perf_counter()]
                for _ in range(GROUP):
                    fn()
                    t.append(time.perf_counter())
                sample[k].append((t[-1] - t[0]) / GROUP * 1e6)
                for i in range(GROUP):
                    per_call[k][i].append((t[i + 1] - t[i]) * 1e6)
        # Long loops, as the fork/join tools time.
        long = {k: cpu_us(fn, 3000, warmup=100, repeats=5, pick=statistics.median) for k, fn in variants.items()}
    print(f"N={n}: host us per call (medians)")
    print(f"  {'variant':<26}{'bench-style':>12}{'long loop':>11}   first 3 calls / calls 10-20 of a sample")
    base = None
    for k in variants:
        b, l = statistics.median(sample[k]), long[k]
        firsts = " ".join(f"{statistics.median(per_call[k][i]):.1f}" for i in range(3))
        rest = statistics.median([v for i in range(10, GROUP) for v in per_call[k][i]])
        print(f"  {k:<26}{b:12.1f}{l:11.1f}   {firsts} / {rest:.1f}")
