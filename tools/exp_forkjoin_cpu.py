"""The Python overhead of a forked ``Parallel`` call, measured on a CPU (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_forkjoin_cpu.py [N]`` -- no GPU needed.

The CUDA bindings ``_streams`` calls (stream switches, event records and waits, the current
stream and device) are replaced by no-op stand-ins, and N x Linear(16, 16) run on CPU tensors,
so what remains is the library's own Python on the forked path, layer by layer: the benchmark's
sequential module (its "eager seq"), a hand-written
fork/join making the same binding calls, ``_run_forked``, ``Parallel._run`` and
``Parallel.__call__``. The minimum over many repeats of the thread's CPU time
(not the wall clock, which counts the time the thread waits for a core) is steady to a
fraction of a microsecond, where the GPU machine's host drifts by more than the differences
sought.
"""
import sys
import time
import timeit
import types

import torch
from torch import nn

import parallel_modules._streams as S
from parallel_modules import Parallel
from parallel_modules._cases import SequentialBranches
from parallel_modules._inputs import _signature
import parallel_modules.parallel as P
from parallel_modules.parallel import _Schedule
from _timing import hand_fork_join  # tools/ is the script's directory

n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
noop = lambda *a, **k: None  # noqa: E731


class FakeStream(types.SimpleNamespace):
    def __hash__(self):
        return hash(self.stream_id)


S._record, S._wait, S._set_current = noop, noop, noop
S._capturing = lambda: False
S._get_current = lambda index: (0, 0, 1)
S._streams_by_id[(0, 0, 1)] = FakeStream(stream_id=0, device_index=0, device_type=1)
torch.cuda.current_device = S._current_device = P._current_device = lambda: 0
pool = S._pool(torch.device("cuda", 0), False)
pool.streams = [FakeStream(stream_id=i + 1, device_index=0, device_type=1) for i in range(S._MAX_SIDE_STREAMS)]
pool.ids = {s.stream_id for s in pool.streams}
pool._local.forks = [object() for _ in range(64)]
pool._local.joins = [object() for _ in range(64)]

x = torch.randn(8, 16)
lins = [nn.Linear(16, 16) for _ in range(n)]
par = Parallel(*lins, streams=True)
seq = SequentialBranches(lins)  # the benchmark's sequential module
with torch.no_grad():  # the key of a call without autograd
    par(x)  # (its first call takes the tree's count of changes, and would forget a plan set before)
    par._plans[_signature((x,), {}, par.training, floats=False)] = _Schedule(False, True, True)
dev = torch.device("cuda", 0)
cur = S._current_stream(dev)
sides = pool.streams[:n - 1]
fork, joins = pool._local.forks[0], pool._local.joins


def hand():
    return hand_fork_join(lins, x, cur, sides, fork, joins[1:n])


def run(i, call):
    return call(x)


cat = lambda outs: torch.cat(outs, 1)  # noqa: E731
variants = {
    "loop+cat": lambda: torch.cat([l(x) for l in lins], 1),
    "SequentialBranches": lambda: seq(x),
    "hand": hand,
    "_run_forked": lambda: S._run_forked(lins, dev, run, False, (x,), cat),
    "Parallel._run": lambda: par._run((x,), {}, dev, None, False),
    "Parallel()": lambda: par(x),
}
with torch.no_grad():
    assert torch.equal(par(x), variants["loop+cat"]())
    res = {k: min(timeit.repeat(fn, timer=time.thread_time, number=2000, repeat=25)) / 2000 * 1e6 for k, fn in variants.items()}
prev = None
for k, m in res.items():
    print(f"N={n} {k:<16}{m:8.2f} us" + (f"  {m - prev:+6.2f}" if prev is not None else "")
          + (f"   over loop+cat per side branch {(m - res['loop+cat']) / (n - 1):5.2f}" if prev is not None else ""))
    prev = m
