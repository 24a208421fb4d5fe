"""Eager fused mlp8: the module's CPU time against the same batched operations written by hand (dev tool).

Usage: ``PYTHONPATH=. python3 tools/exp_fused_eager.py [mlp8|mlp16]``. Host microseconds per call (back to
back, then one synchronize) of the sequential module, ``Parallel(fuse=True)``, the operations the fused
group launches written out by hand, and ``forward`` against the general path it skips for a decided
all-fused schedule; then a cProfile of the fused call.
"""
import sys

import torch
import torch.nn.functional as F

from parallel_modules import Parallel
from parallel_modules._cases import CASES, SequentialBranches
from parallel_modules._inputs import _signature
from _timing import cpu_us, profile  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
name = sys.argv[1] if len(sys.argv) > 1 else "mlp8"
dev = torch.device("cuda")
case = CASES[name]
br = case.branches(dev, torch.float32)
x = case.make_input(8, dev, torch.float32)
n = len(br)
seq, fused = SequentialBranches(br), Parallel(*br, fuse=True)
w0, b0 = torch.randn(n * 256, 256, device=dev), torch.randn(n * 256, device=dev)
W, B = torch.randn(3, n, 256, 256, device=dev), torch.randn(3, n, 1, 256, device=dev)
Wt = [w.mT for w in W]


def by_hand(x):
    r"""The first layer as one wide product (channels layout), the cat read off that layout."""
    h = F.gelu(F.linear(x, w0, b0)).view(8, n, 256).transpose(0, 1)
    for i in range(3):
        h = F.gelu(torch.baddbmm(B[i], h, Wt[i]))
    return h.transpose(0, 1).flatten(1)


W0t, B0 = w0.view(n, 256, 256).mT, b0.view(n, 1, 256)


def as_the_module(x, join=True):
    r"""The operations the eager fused call runs: the first layer batched too, the cat from the stacked layout."""
    h = F.gelu(torch.baddbmm(B0, x.expand(n, -1, -1), W0t))
    for i in range(3):
        h = F.gelu(torch.baddbmm(B[i], h, Wt[i]))
    return h.movedim(0, 1).flatten(1, 2) if join else h


with torch.no_grad():
    fused(x), fused(x)
    key = _signature((x,), {}, fused.training)
    plan = fused._plans[key]
    group = fused._fusion.groups[0]
    calls = {"eager seq": seq, "eager fused": fused, "fused ops by hand": by_hand,
             "fused forward()": fused.forward,
             "fused, general path": lambda x: fused._joined(fused._outputs((x,), {}, (key, plan))),
             "group.bind() (no change)": lambda x: group.bind(),
             "group._run (no join)": lambda x: group._run(x, False),
             "the module's ops, no join": lambda x: as_the_module(x, join=False),
             "the module's ops by hand": as_the_module,
             "one F.gelu": lambda x: F.gelu(x), "one torch.baddbmm": lambda x: torch.baddbmm(B[0], W[0], Wt[0])}
    best: dict[str, float] = {}
    for _ in range(3):  # rounds interleaved: the host's speed drifts
        for label, f in calls.items():
            best[label] = min(best.get(label, 1e9), cpu_us(lambda: f(x), n=1000, repeats=2))
    for label, us in best.items():
        print(f"{label:<26}{us:8.1f} us CPU per call")
    # One stacked layer, [N, 8, 256] x [N, 256, 256] + bias, each way (CPU us per call).
    h = torch.randn(n, 8, 256, device=dev)
    hc = torch.randn(8, n * 256, device=dev)
    hv = hc.view(8, n, 256).transpose(0, 1)  # the channels layout, seen stacked
    layer = {
        "baddbmm(bias [N,1,D], h, W^T)": lambda: torch.baddbmm(B[0], h, Wt[0]),
        "bmm(h, W^T)": lambda: torch.bmm(h, Wt[0]),
        "bmm(h, W^T).add_(bias)": lambda: torch.bmm(h, Wt[0]).add_(B[0]),
        "h @ W^T + bias": lambda: h @ Wt[0] + B[0],
        "baddbmm on a channels view": lambda: torch.baddbmm(B[0], hv, Wt[0]),
        "bmm on a channels view": lambda: torch.bmm(hv, Wt[0]),
        "F.linear 2D (one member)": lambda: F.linear(h[0], W[0, 0], B[0, 0, 0]),
        "torch.mm 2D (one member)": lambda: torch.mm(h[0], Wt[0][0]),
        "empty + baddbmm_(out=) ": lambda: torch.baddbmm(B[0], h, Wt[0], out=torch.empty_like(h)),
    }
    for label, f in layer.items():
        print(f"   {label:<34}{cpu_us(f, n=3000):8.1f} us CPU per call")
    profile("eager fused", lambda: fused(x), n=2000, top=22, warmup=100)
