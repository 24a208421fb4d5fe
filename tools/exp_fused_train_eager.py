"""Where an eager fused mlp8 training step's time goes on CUDA, against the sequential one's (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_fused_train_eager.py`` on the GPU machine.

The benchmark's step (``zero_grad``, forward, ``square().mean()``, ``backward()``, SGD's ``step``) of
eager sequential branches and of ``Parallel(fuse=True)``, each phase timed from a synchronize to the next
(host and GPU together), medians of 200 steps in µs; then the profiler's busiest operators of 20 fused
steps by self CPU time, and the kernels' count per step.
"""
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from parallel_modules import Parallel
from parallel_modules._cases import CASES, SequentialBranches

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
case = CASES["mlp8-train"]
x = case.make_input(8, dev, torch.float32)
models = {"eager seq": SequentialBranches(case.branches(dev, torch.float32), case.join, case.dim),
          "eager fused": Parallel(*case.branches(dev, torch.float32), join=case.join, dim=case.dim, fuse=True)}


def phases(model, opt):
    out = {}
    t = time.perf_counter()

    def mark(name):
        nonlocal t
        torch.cuda.synchronize()
        now = time.perf_counter()
        out[name] = (now - t) * 1e6
        t = now

    opt.zero_grad(set_to_none=True)
    mark("zero_grad")
    y = model(x)
    mark("forward")
    loss = y.square().mean()
    mark("loss")
    loss.backward()
    mark("backward")
    opt.step()
    mark("step")
    return out


for name, model in models.items():
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(20):
        phases(model, opt)
    samples = [phases(model, opt) for _ in range(200)]
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    print(f"{name:12s} " + "  ".join(f"{k} {v:7.1f}" for k, v in med.items())
          + f"  total {sum(med.values()):7.1f} us")

model = models["eager fused"]
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        phases(model, opt)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
print(f"kernels per step: {len(kernels) / 20:.1f}")
