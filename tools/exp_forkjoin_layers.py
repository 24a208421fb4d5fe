"""Where a forked eager call of N tiny branches spends its host time, layer by layer (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_forkjoin_layers.py [N]`` on the GPU machine.

Each variant adds one layer of the library's call path to the one before: the branches in a
loop, a hand-written fork/join, the pool lookups, ``_run_forked``, ``Parallel._run``,
``Parallel.forward``. Variants are sampled interleaved (rounds of a few thousand calls each),
so the host's drift hits them alike; medians per call are printed with the step from the
previous variant.
"""
import sys

import torch
from torch import nn

from parallel_modules import Parallel
from parallel_modules._streams import _current_stream, _pool, _run_forked
from _timing import hand_fork_join, host_medians  # tools/ is the script's directory

dev = torch.device("cuda")
x = torch.randn(8, 16, device=dev)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
lins = [nn.Linear(16, 16).to(dev) for _ in range(n)]
par = Parallel(*lins, streams=True)
pool = _pool(dev, False)
cur = torch.cuda.current_stream()
sides = pool.side_streams(0, n - 1, cur)
forks, joins = pool.events(n)
fork = forks[0]


def hand(lookups=False):
    if lookups:  # what _run_forked looks up before it forks
        _pool(dev, False).slots(0, n, _current_stream(dev))
    return hand_fork_join(lins, x, cur, sides, fork, joins[1:n])


def run(i, call):
    return call(x)


cat = lambda outs: torch.cat(outs, 1)  # noqa: E731
variants = {
    "loop+cat": lambda: torch.cat([l(x) for l in lins], 1),
    "hand": hand,
    "hand+lookups": lambda: hand(True),
    "_run_forked": lambda: _run_forked(lins, dev, run, False, (x,), cat),
    "_run_forked+_combine": lambda: _run_forked(lins, dev, run, False, (x,), par._combine),
    "Parallel._run": lambda: par._run((x,), {}, dev, None, False),
    "Parallel()": lambda: par(x),
}
with torch.no_grad():
    medians = host_medians(variants, rounds=15, per_sample=1000, warmup=300)
prev = None
for k, m in medians.items():
    print(f"N={n} {k:<24}{m:8.1f} us" + (f"  {m - prev:+6.1f}" if prev is not None else ""))
    prev = m
