"""Graphed calls of this checkout against a copy of an earlier one, side by side (dev tool, not shipped).

Usage: ``git archive <commit> parallel_modules | tar -x -C tools/pm_before && mv tools/pm_before/parallel_modules
tools/pm_before/pm_before``, then ``PYTHONPATH=. python3 tools/exp_graph_ab.py [case ...]`` on the GPU machine.
For ``cuda_graph=True`` with ``fuse=True``, ``fuse="auto"`` and ``fuse=False``, from each version, called
on one input as the benchmark does: microseconds per call by CUDA events around 20 calls (the benchmark's
figure), and the GPU's time alone (the calls queued behind a spin kernel), rounds interleaved, medians.
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "pm_before"))
import pm_before  # noqa: E402
from parallel_modules import Parallel  # noqa: E402
from parallel_modules._cases import CASES  # noqa: E402
from _timing import events_us, graph_by_hand  # noqa: E402  (tools/ is the script's directory)

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")
CALLS = 20

for name in sys.argv[1:] or ["mlp8", "mlp16", "tiny8"]:
    case = CASES[name]
    batch = case.batches[0]
    x = case.make_input(batch, dev, torch.float32)
    ref_branches = case.branches(dev, torch.float32)
    state = Parallel(*ref_branches).state_dict()
    mods = {}
    with torch.no_grad():
        for fuse in (True, "auto", False):
            for label, cls in (("before", pm_before.Parallel), ("after", Parallel)):
                try:
                    m = cls(*case.branches(dev, torch.float32), cuda_graph=True, fuse=fuse).train(case.train)
                except ValueError:  # (fuse=True refuses branches that differ, as Inception's do)
                    continue
                m.load_state_dict(state)
                mods[f"{label} fuse={fuse}"] = m
        ref = torch.cat([b(x) for b in ref_branches], 1) if case.join == "cat" else None
        calls = {"floor": graph_by_hand(ref_branches[0], x).replay}
        calls.update({k: (lambda m=m: m(x)) for k, m in mods.items()})
        for k, fn in calls.items():
            for _ in range(30):
                fn()
        spin = int(200e-6 * CALLS * 1.7e9)
        rows = {k: ([], []) for k in calls}
        for _ in range(25):
            for k, fn in calls.items():
                rows[k][0].append(events_us(fn, CALLS)[0])
                rows[k][1].append(events_us(fn, CALLS, spin)[0])
        floor = statistics.median(rows["floor"][1])
        print(f"{name} (batch {batch}): us per call -- benchmark (events) / GPU alone; x floor (GPU alone {floor:.1f})")
        for k, (e, g) in rows.items():
            em, gm = statistics.median(e), statistics.median(g)
            extra = ""
            if k in mods:
                m = mods[k]
                graph = next(iter(m._graphs._graphs.values()))
                out = m(x)
                diff = (out - ref).abs().max().item() if ref is not None else float("nan")
                extra = f"  reader {graph.reader is not None}  variant {list(m._graphs.variants().values())}  max|diff| {diff:.1e}"
            print(f"  {k:<22}{em:8.1f} {gm:8.1f}   {em / floor:5.2f}x {gm / floor:5.2f}x{extra}")
