"""Where a graphed training step's host time goes, with and without ``direct_grads`` (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_train_step.py [prof]`` (``prof``: and a cProfile and a
torch.profiler table of the ``direct_grads`` steps)

The graphed mlp8 training step spent most of its host time outside its two graphs, in the
autograd engine's per-parameter work: one ``AccumulateGrad`` node per parameter, fed by the
replay's ``autograd.Function``, which takes every parameter as an input. Measured side by side
(bench-style GPU time per step, host time per part, and parameters after the same steps):

* ``eager seq``, ``graph Parallel`` and ``graph Parallel fused``;
* the same with ``direct_grads=True``: the replay's Function takes only the call's tensors and
  a zero-size token, and its backward hands each parameter its gradient itself, so the engine
  runs no accumulator per parameter;
* the graphs' token dropped, so that the parameters' gradients go through autograd's
  accumulators, as every training graph without ``direct_grads`` did before;
* the engine alone: ``backward()`` through a Function with 0 and 64 leaf inputs whose backward
  returns ready-made gradients (``kept``: which the accumulators must copy, they are held
  elsewhere; ``fresh``: views of a new buffer, which they may keep) or none.
"""
import statistics
import sys
import time

import torch

from parallel_modules import Parallel
from parallel_modules._cases import CASES, SequentialBranches
from _timing import gpu_medians, op_table, profile, train_step  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")


case = CASES["mlp8-train"]
x = case.make_input(8, dev, torch.float32)
# ``accumulators``: the graphs' token dropped after capture, so that their parameters' gradients go
# through autograd's accumulators (how every training graph ran before the token served them all).
variants = [("eager seq", None), ("graph Parallel accumulators", dict(cuda_graph=True)),
            ("graph Parallel", dict(cuda_graph=True)),
            ("graph Parallel direct_grads", dict(cuda_graph=True, direct_grads=True)),
            ("graph Parallel fused", dict(cuda_graph=True, fuse=True)),
            ("graph Parallel fused direct_grads", dict(cuda_graph=True, fuse=True, direct_grads=True))]
steps, params = {}, {}
torch.manual_seed(0)
base = case.branches(dev, torch.float32)
for label, kw in variants:
    br = case.branches(dev, torch.float32)
    for b, src in zip(br, base):
        b.load_state_dict(src.state_dict())
    model = case.model(SequentialBranches(br, case.join, case.dim) if kw is None else
                       Parallel(*br, join=case.join, dim=case.dim, **kw), dev, torch.float32)
    steps[label] = train_step(model, torch.optim.SGD(model.parameters(), lr=1e-3), x)
    params[label] = model
    if "accumulators" in label:
        steps[label][0]()  # captures
        for m in model.modules():
            for g in getattr(getattr(m, "_graphs", None), "_graphs", {}).values():
                g.token = None
for _ in range(30):
    for step, _ in steps.values():
        step()
torch.cuda.synchronize()
for a, b in [("graph Parallel accumulators", "graph Parallel"), ("graph Parallel", "graph Parallel direct_grads"),
             ("graph Parallel fused", "graph Parallel fused direct_grads"), ("eager seq", "graph Parallel direct_grads")]:
    pa, pb = list(params[a].parameters()), list(params[b].parameters())
    err = max((p - q).abs().max().item() for p, q in zip(pa, pb))
    print(f"parameters after the same steps, {a} vs {b}: max abs difference {err:.3g}")
for _, parts in steps.values():
    for v in parts.values():
        v.clear()
gpu = gpu_medians({k: s for k, (s, _) in steps.items()}, rounds=30, per_sample=10)
print("==== mlp8 training step (batch 8, fp32): GPU us per step (bench style), host us per part (medians)")
for k, (_, parts) in steps.items():
    print(f"{k:<36} step {gpu[k]:7.1f} ({gpu['eager seq'] / gpu[k]:4.2f}x)  "
          + "  ".join(f"{p} {statistics.median(v):6.1f}" for p, v in parts.items()))
if "prof" in sys.argv:
    for label in ("graph Parallel direct_grads", "graph Parallel fused direct_grads"):
        step = steps[label][0]
        profile(f"{label} step", step, n=500, top=25)
        op_table(step, calls=20, rows=25)


leaves = [torch.zeros(256, 256, device=dev, requires_grad=True) for _ in range(64)]
ready = [torch.ones(256, 256, device=dev) for _ in range(64)]
x0 = torch.zeros(8, device=dev, requires_grad=True)
for k, how in ((0, "kept"), (64, "kept"), (64, "fresh"), (64, "none")):
    class _Ready(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *leaves):
            return x.clone()

        @staticmethod
        def backward(ctx, g, k=k, how=how):
            if how == "none":
                return (g,) + (None,) * k
            if how == "fresh":  # views of one new buffer, which the accumulators may keep
                return (g, *torch.empty(k, 256, 256, device=dev).unbind(0))
            return (g, *ready[:k])

    samples = []
    for rep in range(600):
        for p in leaves:
            p.grad = None
        x0.grad = None
        loss = _Ready.apply(x0, *leaves[:k]).sum()
        t0 = time.perf_counter()
        loss.backward()
        samples.append((time.perf_counter() - t0) * 1e6)
    print(f"engine alone: backward through a Function with {k:2d} leaf inputs, gradients {how}: "
          f"{statistics.median(samples[100:]):6.1f} us")
