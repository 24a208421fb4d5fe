"""Where a graphed module call's host time goes, layer by layer (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_hot_layers.py [case ...]`` on the GPU machine (default mlp8 tiny8);
``FUSE=auto`` (or ``1``) in the environment builds the blocks with ``fuse="auto"`` (``True``).
Each figure: host microseconds to issue one call, 20 calls queued behind a spin kernel (the GPU never
holds the host back), median of 30 rounds; the layers peel the call from the outside in:
``m(x)`` (``nn.Module.__call__``), ``m.forward(x)``, the graph cache's ``__call__``, ``_Graph.replay``,
the launch alone; then the cache's checks, each timed after a launch and alone (whether a launch
slows the Python after it, as the driver's code evicts the interpreter's from the CPU's caches).
"""
import os
import statistics
import sys

import torch

from parallel_modules import Parallel
from parallel_modules import _graphs as G, _streams as S, _watch as W
from parallel_modules._cases import CASES
from parallel_modules._graphs import _launch
from _timing import events_us, graph_by_hand  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
FUSE = {"": False, "0": False, "1": True, "auto": "auto"}[os.environ.get("FUSE", "")]
CALLS = 20

for name in sys.argv[1:] or ["mlp8", "tiny8"]:
    case = CASES[name]
    x = case.make_input(case.batches[0], dev, torch.float32)
    with torch.no_grad():
        m = Parallel(*case.branches(dev, torch.float32), cuda_graph=True, fuse=FUSE).train(False)
        for _ in range(30):
            m(x)
        c = m._graphs
        g = next(iter(c._graphs.values()))
        first = g.reader if g.reader is not None else g.fwd
        hand = graph_by_hand(case.branches(dev, torch.float32)[0], x)
        key = lambda: c._key(m, (x,), {}, ())  # noqa: E731
        checks = {
            "key": key,
            "swapped": lambda: W._swapped(c._slots, c._slot_values, c._scalars),
            "guards": lambda: (S._is_tracing(), G._functorch_active(), G._dispatch_modes(), G._autograd_busy(),
                               S._capture_underway()),
            "kernel settings": G._kernel_settings,
            "current stream": lambda: S._current_stream(dev),
        }
        calls = {
            "m(x)": lambda: m(x),
            "m.forward(x)": lambda: m.forward(x),
            "cache(_forward)": lambda: c(m._forward, (x,), {}),
            "_Graph.replay": lambda: g.replay([x], False),
            "launch (the graph it replays)": lambda: _launch(first),
            "hand graph: copy_ + replay": lambda: (hand.replay()),
        }
        for k, fn in checks.items():
            calls[f"check {k} alone"] = fn
            calls[f"launch + check {k}"] = lambda fn=fn: (_launch(first), fn())
        # The same two calls again, last in each round: whether the first sample of a round pays
        # for something (the caches the round's end left cold) that the module call does not.
        calls["m(x), last"] = lambda: m(x)
        calls["m.forward(x), last"] = lambda: m.forward(x)
        for fn in calls.values():
            for _ in range(20):
                fn()
        torch.cuda.synchronize()
        spin = int(400e-6 * CALLS * 1.7e9)
        rows = {k: [] for k in calls}
        for _ in range(30):
            for k, fn in calls.items():
                rows[k].append(events_us(fn, CALLS, spin)[1])
        print(f"{name}: host us to issue one call (behind a spin), median of 30 rounds; reader={g.reader is not None}"
              f" lending={g.lending.lent if g.lending else None}")
        for k, v in rows.items():
            print(f"  {k:<40}{statistics.median(v):7.2f}   (min {min(v):6.2f})")
