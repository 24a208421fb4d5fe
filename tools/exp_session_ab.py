"""Eager tiny blocks and graphed training steps of this checkout against an earlier one (dev tool, not shipped).

Usage: ``git archive <commit> parallel_modules | tar -x -C tools/pm_before && mv tools/pm_before/parallel_modules
tools/pm_before/pm_before``, then ``PYTHONPATH=. python3 tools/exp_session_ab.py`` on the GPU machine. Medians of
interleaved rounds, microseconds per call by CUDA events (as the benchmark times them): the default eager
``Parallel`` of tiny2 and tiny4 from each version beside the branches called in a loop, and mlp8's training step
(the benchmark's: zero_grad, forward, loss, backward, SGD step) graphed, by default and with ``direct_grads``.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "pm_before"))
import pm_before  # noqa: E402
from parallel_modules import Parallel  # noqa: E402
from parallel_modules._cases import CASES, SequentialBranches  # noqa: E402
from _timing import gpu_medians, train_step  # noqa: E402  (tools/ is the script's directory)

torch.backends.cuda.matmul.allow_tf32 = False
dev, dtype = torch.device("cuda"), torch.float32
VERSIONS = (("before", pm_before.Parallel), ("after", Parallel))

for name in ("tiny2", "tiny4"):
    case = CASES[name]
    x = case.make_input(8, dev, dtype)
    branches = case.branches(dev, dtype)
    calls = {"loop": SequentialBranches(branches, case.join, case.dim)}
    for version, cls in VERSIONS:
        calls[version] = cls(*branches, join=case.join, dim=case.dim)
    with torch.no_grad():
        for m in calls.values():
            for _ in range(20):
                m(x)
        med = gpu_medians({k: (lambda m=m: m(x)) for k, m in calls.items()}, rounds=60, per_sample=20)
    print(f"{name} b8 eager, us per call: loop {med['loop']:.1f}  before {med['before']:.1f} "
          f"({med['loop'] / med['before']:.3f}x the loop)  after {med['after']:.1f} ({med['loop'] / med['after']:.3f}x)")

case = CASES["mlp8"]
x = case.make_input(8, dev, dtype)
state = Parallel(*case.branches(dev, dtype)).state_dict()
for label, kw in (("default", {}), ("direct_grads", dict(direct_grads=True))):
    steps = {}
    for version, cls in VERSIONS:
        m = cls(*case.branches(dev, dtype), cuda_graph=True, **kw)
        m.load_state_dict(state)
        steps[version] = train_step(m, torch.optim.SGD(m.parameters(), lr=1e-3), x)[0]
    for fn in steps.values():
        for _ in range(5):
            fn()
    med = gpu_medians(steps, rounds=30, per_sample=5)
    print(f"mlp8 graphed training step, {label}: before {med['before']:.1f} us  after {med['after']:.1f} us "
          f"({med['after'] / med['before']:.3f}x)")
