"""Whether a graphed call is bound by the host or by the GPU (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_graph_hostbound.py [--variants] [case ...]`` on the GPU machine. Per variant,
microseconds per call three ways: host time (calls back to back, then a synchronize), the benchmark's
time (CUDA events around 20 calls after a synchronize), and the GPU's time alone (the same 20 calls
queued behind a spin kernel, so that the events time only the GPU's work). Where the benchmark's time
exceeds the GPU's, the host sets it. ``--variants``: the fused graph with its biases copied in on a side
stream, in line, and as the module chooses between them (which it names), each forced by a patched
``Parallel._graph_variants``. ``--static``: each graphed variant also called on its graph's own input
buffer, which a replay then reads without copying the input in: what the copy costs.
"""
import statistics
import sys

import torch

from parallel_modules import Parallel, parallel as _parallel
from parallel_modules._cases import CASES
from _timing import events_us, graph_by_hand, host_us  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
CALLS = 20


VARIANTS = "--variants" in sys.argv
STATIC = "--static" in sys.argv
_choose = Parallel._graph_variants


def forced(which):
    r"""A ``Parallel`` subclass whose captures try only the variants ``which`` picks from the usual list."""
    class Forced(Parallel):
        def _graph_variants(self, *a, **k):
            return which(_choose(self, *a, **k))
    return Forced


for name in [a for a in sys.argv[1:] if not a.startswith("--")] or ["mlp8", "mlp16"]:
    case = CASES[name]
    br = case.branches(dev, torch.float32)
    x = case.make_input(8, dev, torch.float32)
    with torch.no_grad():
        variants = {}
        if VARIANTS:
            inline = lambda vs: [v for v in vs if v and _parallel._INLINE_BIAS in v] or vs  # noqa: E731
            variants.update({
                "fused, chosen": Parallel(*br, cuda_graph=True, fuse=True),
                "fused, side stream": forced(lambda vs: vs[:1])(*br, cuda_graph=True, fuse=True),
                "fused, in line": forced(inline)(*br, cuda_graph=True, fuse=True),
            })
        else:
            variants.update({
                "graph Parallel": Parallel(*br, cuda_graph=True),
                "graph fused": Parallel(*br, cuda_graph=True, fuse=True),
                "graph fuse=auto": Parallel(*br, cuda_graph=True, fuse="auto"),
            })
        # (Captured after the modules: fusion moves the branches' parameters, which a graph reads by address.)
        calls = {"floor (one branch, by hand)": graph_by_hand(br[0], x).replay}
        calls.update({k: (lambda v=v: v(x)) for k, v in variants.items()})
        for fn in calls.values():
            for _ in range(30):
                fn()
        if STATIC:  # (after the captures above: the static buffers exist now)
            for k, v in variants.items():
                static = next(iter(v._graphs._graphs.values())).inputs[0]
                static.copy_(x)
                calls[k + ", no copy"] = lambda v=v, static=static: v(static)
        # Enough spin to cover the host's enqueueing of CALLS calls (cycles at ~1.7 GHz).
        spin = int(200e-6 * CALLS * 1.7e9)
        rows = {k: ([], [], []) for k in calls}
        for _ in range(15):
            for k, fn in calls.items():
                h, e, g = rows[k]
                h.append(host_us(fn, 200))
                e.append(events_us(fn, CALLS)[0])
                g.append(events_us(fn, CALLS, spin)[0])
        if VARIANTS:
            print(f"{name}: the module chose", list(variants["fused, chosen"]._graphs.variants().values()))
        floor = statistics.median(rows["floor (one branch, by hand)"][2])
        print(f"{name}: us per call -- host / benchmark (events) / GPU alone (behind a spin); x floor (GPU alone)")
        for k, (h, e, g) in rows.items():
            hm, em, gm = (statistics.median(v) for v in (h, e, g))
            print(f"  {k:<30}{hm:8.1f} {em:8.1f} {gm:8.1f}   {em / floor:5.2f}x {gm / floor:5.2f}x")
