"""Fused LayerNorm against its branches over input, weight and bias dtypes, affine kinds, autocast, grad (dev tool).

Usage: ``PYTHONPATH=. python3 tools/exp_layer_norm_dtypes.py [cpu|cuda]``: prints each case where the fused block's
outcome (error or not), dtype, value or input gradient differs from its branches called one by one, then the count.
"""
import sys
import warnings, torch, itertools
from torch import nn
from parallel_modules import Parallel
warnings.simplefilter("ignore")
torch.manual_seed(0)
dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
low = torch.bfloat16 if dev == "cpu" else torch.float16
D = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
short = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16"}
def outcome(f):
    try:
        o = f(); return ("ok", o)
    except Exception as e:
        return ("err", type(e).__name__ + ": " + str(e).split("\n")[0][:60])
bad = 0
for xd, wd, bd, aff, dims, ac, grad in itertools.product(D, D, D, ["wb", "w", "none"], [2, 3], [False, True], [False, True]):
    if aff != "wb" and bd != D[0]: continue
    if aff == "none" and wd != D[0]: continue
    lns = []
    for _ in range(3):
        ln = nn.LayerNorm(8, elementwise_affine=aff != "none", bias=aff == "wb")
        with torch.no_grad():
            if ln.weight is not None: ln.weight.normal_()
            if ln.bias is not None: ln.bias.normal_()
        if ln.weight is not None: ln.weight.data = ln.weight.data.to(wd)
        if ln.bias is not None: ln.bias.data = ln.bias.data.to(bd)
        lns.append(nn.Sequential(ln, nn.Identity()))
    p = Parallel(*lns, join=None, fuse=True).to(dev)
    x = torch.randn(*([4, 3][:dims - 1]), 8).to(dev, xd).requires_grad_(grad)
    ctx = (lambda: torch.autocast(dev, dtype=low)) if ac else (lambda: torch.autocast(dev, enabled=False))
    def fused():
        with ctx(): return p(x)
    def each():
        with ctx(): return [b(x) for b in p]
    with torch.no_grad():
        try: p(x.detach().to(wd)); p(x.detach().to(wd))
        except Exception as e: print('warm fail', e)
    outcome(fused); outcome(fused); outcome(fused)
    a, b = outcome(fused), outcome(each)
    fusedness = p.explain()["fused"]
    tag = f"x={short[xd]} w={short[wd]} b={short[bd]} {aff} {dims}D ac={ac} grad={grad} fused={fusedness}"
    if a[0] != b[0]:
        bad += 1; print("MISMATCH-OUTCOME", tag, "fused:", a if a[0]=="err" else [o.dtype for o in a[1]], "each:", b if b[0]=="err" else [o.dtype for o in b[1]])
    elif a[0] == "ok":
        for u, v in zip(a[1], b[1]):
            if u.dtype != v.dtype or u.shape != v.shape:
                bad += 1; print("MISMATCH-DTYPE", tag, u.dtype, v.dtype); break
            tol = 1e-2 if u.dtype in (torch.float16, torch.bfloat16) else 1e-5
            if not torch.allclose(u.float(), v.float(), atol=tol, rtol=tol):
                bad += 1; print("MISMATCH-VALUE", tag, (u.float()-v.float()).abs().max().item()); break
        if grad and a[0] == "ok":
            ga = torch.autograd.grad(sum(o.float().sum() for o in a[1]), x)[0]
            gb = torch.autograd.grad(sum(o.float().sum() for o in b[1]), x)[0]
            if not torch.allclose(ga.float(), gb.float(), atol=5e-2, rtol=5e-2):
                bad += 1; print("MISMATCH-GRAD", tag, (ga.float()-gb.float()).abs().max().item())
    if a[0]=="err" and a[1].split(":")[0] != b[1].split(":")[0]:
        print("diff-error", tag, a[1], "|", b[1])
print("bad", bad)
