"""Signature corner cases: argument structure/values, aliasing, layouts, dtypes, empty batch.

_inputs._signature / _CudaGraphs._lookup key tensors by (shape, stride, dtype, device,
requires_grad[, type]) and non-tensor leaves by (type, value) (floats by hex), the pytree
spec included; _bind rebuilds the call with static clones in flatten order; _copy_in
skips a copy when data_ptr() matches (0 for every empty tensor); static inputs are
t.clone() (preserve_format: a non-dense input -- sliced, expanded -- gets a *contiguous*
static buffer, so the graph runs other strides than eager). Cases, each against the eager
block bit for bit (values, dtype, strides where eager's are defined by the input):
the same tensor passed twice vs two tensors; kwargs in swapped order; None vs tensor;
scale -0.0 vs 0.0 (sign bit) and 1 / True / 1.0; integer and bool inputs (Embedding,
mask); channels_last vs contiguous conv input; sliced, expanded (stride 0) and
transposed inputs; a 0-row batch (inference and training) for Parallel and
ParallelSequential. Expected (correct library): all equal.
"""
import copy
import os
import sys
import warnings

import torch
from torch import nn

NAME = "args_layouts"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x, y=None, scale=1.0):
        out = self.lin(x) * scale
        return out if y is None else out + 2 * y


class EmbMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 8)

    def forward(self, idx, mask):
        return (self.emb(idx) * mask[..., None]).flatten(1)


def bits(t):
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def main():
    from parallel_modules import Parallel, ParallelSequential

    problems = []

    def cmp(label, got, want, strides=False):
        if got.dtype != want.dtype or got.shape != want.shape:
            problems.append(f"{label}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}")
        elif not torch.equal(bits(got), bits(want)):
            diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0
            problems.append(f"{label}: values differ (max {diff:.3g})")
        elif strides and got.stride() != want.stride():
            problems.append(f"{label}: strides {got.stride()} vs eager {want.stride()}")

    torch.manual_seed(0)
    br = [Two().to(DEV), Two().to(DEV)]
    g, e = Parallel(*br, cuda_graph=True), Parallel(*br)
    x, y = torch.randn(8, 64, device=DEV), torch.randn(8, 64, device=DEV)
    calls = [
        ("(x, y)", (x, y), {}), ("(x, x) aliased", (x, x), {}), ("(x, y) again", (x, y), {}),
        ("kw y,scale", (x,), {"y": y, "scale": 2.0}), ("kw scale,y", (x,), {"scale": 2.0, "y": y}),
        ("kw y,scale again", (x,), {"y": y, "scale": 2.0}), ("y=None", (x,), {"y": None}),
        ("scale=0.0", (x,), {"scale": 0.0}), ("scale=-0.0", (x,), {"scale": -0.0}),
        ("scale=0.0 again", (x,), {"scale": 0.0}), ("scale=1", (x,), {"scale": 1}),
        ("scale=True", (x,), {"scale": True}), ("scale=1.0", (x,), {"scale": 1.0}),
    ]
    with torch.no_grad():
        for label, a, k in calls:
            for _ in range(2):
                cmp(label, g(*a, **k), e(*a, **k))

    torch.manual_seed(1)
    br = [EmbMask().to(DEV), EmbMask().to(DEV)]
    g, e = Parallel(*br, cuda_graph=True), Parallel(*br)
    with torch.no_grad():
        for dt in (torch.bool, torch.float32, torch.bool):
            idx = torch.randint(0, 100, (4, 5), device=DEV)
            mask = torch.rand(4, 5, device=DEV) > 0.5
            mask = mask.to(dt)
            cmp(f"int/{dt} inputs", g(idx, mask), e(idx, mask))

    torch.manual_seed(2)
    br = [nn.Conv2d(8, 16, 3, padding=1).to(DEV), nn.Conv2d(8, 16, 1).to(DEV)]
    g, e = Parallel(*br, cuda_graph=True), Parallel(*br)
    base = torch.randn(2, 8, 12, 12, device=DEV)
    with torch.no_grad():
        for label, t in (("contiguous", base), ("channels_last", base.to(memory_format=torch.channels_last)),
                         ("contiguous again", base.clone()),
                         ("channels_last again", base.to(memory_format=torch.channels_last).clone())):
            for _ in range(2):
                cmp(f"conv {label}", g(t), e(t), strides=True)

    torch.manual_seed(3)
    br = [nn.Linear(64, 32).to(DEV), nn.Linear(64, 32).to(DEV)]
    g, e = Parallel(*br, cuda_graph=True), Parallel(*br)
    wide = torch.randn(8, 128, device=DEV)
    with torch.no_grad():
        for label, t in (("sliced", wide[:, :64]), ("expanded", wide[0, :64].expand(8, 64)),
                         ("transposed", torch.randn(64, 8, device=DEV).t()), ("plain", wide[:, 64:].contiguous())):
            for _ in range(2):
                cmp(f"linear {label}", g(t), e(t))

    # Empty batch.
    torch.manual_seed(4)
    br = [nn.Linear(64, 32), nn.Sequential(nn.Linear(64, 32), nn.ReLU())]
    g = Parallel(*copy.deepcopy(br), cuda_graph=True).to(DEV)
    e = Parallel(*copy.deepcopy(br)).to(DEV)
    ps_g = ParallelSequential(*copy.deepcopy(br[1]), cuda_graph=True).to(DEV)
    ps_e = nn.Sequential(*copy.deepcopy(br[1])).to(DEV)
    z = torch.zeros(0, 64, device=DEV)
    with torch.no_grad():
        for _ in range(2):
            cmp("empty batch Parallel", g(z), e(z))
            cmp("empty batch ParallelSequential", ps_g(z), ps_e(z))
    for _ in range(2):
        zin = {}
        for tag, m in (("g", g), ("e", e)):
            m.zero_grad(set_to_none=False)
            zz = zin[tag] = z.clone().requires_grad_()
            m(zz).sum().backward()
        for (n, p), q in zip(g.named_parameters(), e.parameters()):
            if p.grad is None or not torch.equal(p.grad, q.grad):
                problems.append(f"empty batch training: {n}.grad")
                break
        if zin["g"].grad is None or zin["g"].grad.shape != (0, 64):
            problems.append("empty batch training: input grad")
    if problems:
        return False, "; ".join(problems[:6]) + (f" (+{len(problems) - 6} more)" if len(problems) > 6 else "")
    return True, ""


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if DEV == "cuda" and not torch.cuda.is_available():
        print(f"FAIL {NAME}: no CUDA device")
        sys.exit(0)
    try:
        ok, detail = main()
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()
        ok, detail = False, f"exception {type(e).__name__}: {msg[0][:300] if msg else ''}"
    print(f"PASS {NAME}" if ok else f"FAIL {NAME}: {detail}")
