"""Fused training steps and eager ``fuse="auto"`` calls of this checkout against an earlier one (dev tool).

Usage: ``git archive <commit> parallel_modules | tar -x -C tools/pm_before && mv tools/pm_before/parallel_modules
tools/pm_before/pm_before``, then ``PYTHONPATH=. python3 tools/exp_train_ab.py`` on the GPU machine. For mlp8:
GPU microseconds per training step (the benchmark's: zero_grad, forward, loss, backward, SGD step) of
``Parallel(fuse=True)`` eager, graphed, and graphed with ``direct_grads``; and host microseconds per eager
inference call of ``fuse="auto"`` (one group: the write watch's inline path). Rounds interleaved, medians.
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "pm_before"))
import pm_before  # noqa: E402
from parallel_modules import Parallel  # noqa: E402
from parallel_modules._cases import CASES  # noqa: E402
from _timing import gpu_medians, host_us, train_step  # noqa: E402  (tools/ is the script's directory)

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
case = CASES["mlp8"]
x = case.make_input(8, dev, torch.float32)
state = Parallel(*case.branches(dev, torch.float32)).state_dict()


def block(cls, **kw):
    m = cls(*case.branches(dev, torch.float32), **kw)
    m.load_state_dict(state)
    return m


steps, models = {}, {}
for label, kw in (("eager fused", dict(fuse=True)), ("graph fused", dict(fuse=True, cuda_graph=True)),
                  ("graph fused direct_grads", dict(fuse=True, cuda_graph=True, direct_grads=True))):
    for version, cls in (("before", pm_before.Parallel), ("after", Parallel)):
        m = models[f"{label} {version}"] = block(cls, **kw)
        steps[f"{label} {version}"] = train_step(m, torch.optim.SGD(m.parameters(), lr=1e-3), x)[0]
for fn in steps.values():
    for _ in range(5):
        fn()
med = gpu_medians(steps, rounds=30, per_sample=5)
for label in ("eager fused", "graph fused", "graph fused direct_grads"):
    b, a = med[f"{label} before"], med[f"{label} after"]
    same = all(torch.equal(p, q) for p, q in zip(models[f"{label} before"].parameters(),
                                                   models[f"{label} after"].parameters()))
    print(f"mlp8 training step, {label:26s} before {b:8.1f} us  after {a:8.1f} us  ({a / b:.3f}x)"
          f"  parameters equal after the same steps: {same}")

auto = {"before": block(pm_before.Parallel, fuse="auto").eval(), "after": block(Parallel, fuse="auto").eval()}
with torch.no_grad():
    for m in auto.values():
        for _ in range(5):
            m(x)
    samples = {k: [] for k in auto}
    for _ in range(30):
        for k, m in auto.items():
            samples[k].append(host_us(lambda: m(x), n=100))
b, a = (statistics.median(samples[k]) for k in ("before", "after"))
print(f"mlp8 eager fuse='auto' inference, host us per call: before {b:.1f}  after {a:.1f}  ({a / b:.3f}x)")
