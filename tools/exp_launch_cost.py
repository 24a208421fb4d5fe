"""Host time to issue a graphed call, by its parts, with the GPU kept busy (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_launch_cost.py [case ...]`` on the GPU machine (default mlp8 mlp16).
Each figure: microseconds of host time per call to issue 20 calls queued behind a spin kernel (so the GPU
never holds the host back, as it does when thousands of launches fill its queue), median of rounds:
a graph of one branch captured by hand (``CUDAGraph.replay``), the library's fused graph launched alone
(first graph and reader), its ``_Graph.replay``, and the module call. Beside it, the host time of the same
20 calls issued from an idle GPU, as the benchmark issues them, and the benchmark's figure (CUDA events):
where the host takes longer than behind the spin, the GPU's progress slows it down.
"""
import statistics
import sys

import torch

from parallel_modules import Parallel
from parallel_modules._cases import CASES
from parallel_modules._graphs import _launch
from _timing import events_us, graph_by_hand  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
CALLS = 20

for name in sys.argv[1:] or ["mlp8", "mlp16"]:
    case = CASES[name]
    x = case.make_input(case.batches[0], dev, torch.float32)
    br = case.branches(dev, torch.float32)
    with torch.no_grad():
        mods = {f: Parallel(*case.branches(dev, torch.float32), cuda_graph=True, fuse=f).train(False)
                for f in (True, False)}
        for m in mods.values():
            for _ in range(30):
                m(x)
        hand = graph_by_hand(br[0], x)
        calls = {"hand graph (1 branch): replay()": hand.replay,
                 "hand graph: _launch": lambda: _launch(hand)}
        for f, m in mods.items():
            g = next(iter(m._graphs._graphs.values()))
            calls[f"fuse={f}: first graph _launch"] = lambda g=g: _launch(g.fwd)
            if g.reader is not None:
                calls[f"fuse={f}: reader _launch"] = lambda g=g: _launch(g.reader)
            calls[f"fuse={f}: _Graph.replay"] = lambda g=g: g.replay([x], False)
            calls[f"fuse={f}: module call"] = lambda m=m: m(x)
        for fn in calls.values():
            for _ in range(20):
                fn()
        spin = int(300e-6 * CALLS * 1.7e9)
        rows = {k: ([], [], []) for k in calls}
        for _ in range(30):
            for k, fn in calls.items():
                rows[k][0].append(events_us(fn, CALLS, spin)[1])
                live = events_us(fn, CALLS)
                rows[k][1].append(live[1])
                rows[k][2].append(live[0])
        print(f"{name}: host us per call, issued behind a spin / issued to an idle GPU (events, the benchmark's figure)")
        for k, (spun, live, ev) in rows.items():
            print(f"  {k:<40}{statistics.median(spun):7.2f} / {statistics.median(live):7.2f}"
                  f"  ({statistics.median(ev):7.2f})")
