"""Graphed mlp8 training steps of this checkout against a copy of an earlier one, side by side (dev tool, not shipped).

Usage: ``git archive <commit> parallel_modules | tar -x -C tools/pm_before && mv tools/pm_before/parallel_modules
tools/pm_before/pm_before``, then ``PYTHONPATH=. python3 tools/exp_train_ab.py`` on the GPU machine.

The benchmark's step (``zero_grad(set_to_none=True)``, forward, ``square().mean()``, ``backward()``, SGD's
``step``) with ``cuda_graph=True``, by default and with ``direct_grads=True``, from each version and the eager
sequential module: GPU microseconds per step as the benchmark times them (CUDA events around 10 steps)
and the host's per part, rounds interleaved, medians; then the parameters after the same steps.
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "pm_before"))
import pm_before  # noqa: E402
from parallel_modules import Parallel  # noqa: E402
from parallel_modules._cases import CASES, SequentialBranches  # noqa: E402
from _timing import gpu_medians, train_step  # noqa: E402  (tools/ is the script's directory)

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
case = CASES["mlp8-train"]
x = case.make_input(8, dev, torch.float32)
torch.manual_seed(0)
base = case.branches(dev, torch.float32)
variants = {"eager seq": None}
for kw, tag in ((dict(), ""), (dict(direct_grads=True), " direct_grads")):
    for label, cls in (("before", pm_before.Parallel), ("after", Parallel)):
        variants[f"{label}{tag}"] = (cls, kw)
steps, models = {}, {}
for label, spec in variants.items():
    br = case.branches(dev, torch.float32)
    for b, src in zip(br, base):
        b.load_state_dict(src.state_dict())
    model = SequentialBranches(br, case.join, case.dim) if spec is None else spec[0](
        *br, join=case.join, dim=case.dim, cuda_graph=True, **spec[1])
    steps[label], models[label] = train_step(model, torch.optim.SGD(model.parameters(), lr=1e-3), x), model
for _ in range(30):
    for step, _ in steps.values():
        step()
torch.cuda.synchronize()
for _, parts in steps.values():
    for v in parts.values():
        v.clear()
gpu = gpu_medians({k: s for k, (s, _) in steps.items()}, rounds=40, per_sample=10)
print(f"==== mlp8 training step (batch 8, fp32), torch {torch.__version__}, {torch.cuda.get_device_name()}: "
      f"GPU us per step (bench style), host us per part (medians)")
for k, (_, parts) in steps.items():
    print(f"{k:<22} step {gpu[k]:7.1f} ({gpu['eager seq'] / gpu[k]:4.2f}x)  "
          + "  ".join(f"{p} {statistics.median(v):6.1f}" for p, v in parts.items()))
ref = list(models["eager seq"].parameters())
for k, m in models.items():
    err = max((p - q).abs().max().item() for p, q in zip(m.parameters(), ref))
    print(f"parameters after the same steps, {k} vs eager seq: max abs difference {err:.3g}")
