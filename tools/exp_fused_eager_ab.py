"""Eager fused calls of this checkout against a copy of an earlier one, side by side (dev tool).

Usage: ``git archive <commit> parallel_modules | tar -x -C tools/pm_before && mv tools/pm_before/parallel_modules
tools/pm_before/pm_before``, then ``PYTHONPATH=. python3 tools/exp_fused_eager_ab.py [case ...]``. Host
microseconds per call (back to back, then a synchronize; rounds interleaved, median of rounds) of the
sequential module and of ``Parallel(fuse=True)`` from each version, with the results' difference.
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "pm_before"))
import pm_before  # noqa: E402
from parallel_modules import Parallel  # noqa: E402
from parallel_modules._cases import CASES, SequentialBranches  # noqa: E402
from _timing import host_us  # noqa: E402  (tools/ is the script's directory)

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")


for name in sys.argv[1:] or ["mlp8", "mlp16", "tiny2", "tiny8", "tiny16"]:
    case = CASES[name]
    br = case.branches(dev, torch.float32)
    x = case.make_input(8, dev, torch.float32)
    seq = SequentialBranches(br)
    # Each version stacks the parameters it fuses: give each its own copy of the branches.
    mods = {"seq": seq, "before": pm_before.Parallel(*case.branches(dev, torch.float32), fuse=True),
            "after": Parallel(*case.branches(dev, torch.float32), fuse=True)}
    mods["before"].load_state_dict(Parallel(*br).state_dict())
    mods["after"].load_state_dict(Parallel(*br).state_dict())
    with torch.no_grad():
        ref = seq(x)
        diffs = {k: (m(x) - ref).abs().max().item() for k, m in mods.items() if k != "seq"}
        samples = {k: [] for k in mods}
        for _ in range(30):  # rounds interleaved: the host's speed drifts
            for k, m in mods.items():
                samples[k].append(host_us(lambda: m(x)))
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"{name:<7}" + "  ".join(f"{k} {v:7.1f} us" for k, v in med.items())
          + f"   seq/before {med['seq'] / med['before']:.2f}x  seq/after {med['seq'] / med['after']:.2f}x"
          + f"  before/after {med['before'] / med['after']:.2f}x   max|diff| {diffs}")
