"""Whether the batched linear kernel pays eagerly: host time of a fused MLP layer by cuBLAS and by Triton (dev tool).

Usage: ``PYTHONPATH=. python3 tools/exp_triton_eager.py [N ...]`` on the GPU machine (default 8 16).

Host microseconds per call (back to back, best of 3 samples) of one fused layer of ``N`` members on
8 rows, 256 -> 256, GELU: ``baddbmm`` + ``gelu`` as the eager fused group runs it, the Triton kernel
through ``_batched_linear.linear`` (into a buffer made once, and into one allocated per call), the
kernel's ``CompiledKernel`` launched directly (``warmup`` once, then its C launcher), and the four
layers of the module both ways, against ``Parallel(fuse=True)``'s eager call with its kernels
(launched directly) and without (cuBLAS), in three interleaved rounds. Then the largest difference
between the two ways.
"""
import sys

import torch
import torch.nn.functional as F

from parallel_modules import Parallel
from parallel_modules import _batched_linear as bl
from _timing import cpu_us, mlp_stacks  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("no triton")

for n in [int(a) for a in sys.argv[1:]] or [8, 16]:
    branches, x, seq, ref, W, B = mlp_stacks(n)
    h = x.expand(n, *x.shape)
    w, b = W[1], B[1]
    wt, b3 = w.mT, b.unsqueeze(1)
    out = torch.empty(n, 8, 256, device=x.device)
    with torch.no_grad():
        calls = {
            "baddbmm + gelu": lambda: F.gelu(torch.baddbmm(b3, h, wt)),
            "baddbmm": lambda: torch.baddbmm(b3, h, wt),
            "linear() into a buffer": lambda: bl.linear(h, w, b, out, bl._GELU),
            "empty + linear()": lambda: bl.linear(h, w, b, torch.empty(n, 8, 256, device=x.device), bl._GELU),
            "torch.empty": lambda: torch.empty(n, 8, 256, device=x.device),
        }
        assert bl.linear(h, w, b, out, bl._GELU) is not None, bl.unavailable()
        try:  # the compiled kernel itself, past JITFunction.run's binding and cache lookup
            kernel = bl._kernel()
            dot, bm, bn, bk, st = bl._blocks(8, 256, 256, n, None, x.device)
            ints = (8, 256, 256, *h.stride(), *w.stride(), b.stride(0), *out.stride())
            grid = (-(-256 // bn), n)
            consts = dict(HAS_BIAS=True, ACT=1, DOT=dot, PRECISION="tf32x3", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                          num_warps=4, num_stages=st)
            compiled = kernel.warmup(h, w, b, out, *ints, grid=grid, **consts)
            runner = compiled[(grid[0], grid[1], 1)]
            args = (h, w, b, out, *ints, True, 1, dot, "tf32x3", bm, bn, bk)
            try:
                runner(*args)
            except TypeError:
                args = (h, w, b, out, *ints)
                runner(*args)
            torch.cuda.synchronize()
            calls["CompiledKernel runner"] = lambda: runner(*args)
        except Exception as e:  # (the API moves between Triton versions)
            print("  no direct launch:", type(e).__name__, e)
        for label, fn in calls.items():
            print(f"mlp{n} {label:<28}{cpu_us(fn, 3000):7.2f} us")

        def kernels(v):
            hh = v.expand(n, *v.shape)
            o = None
            for i in range(4):
                o = torch.empty(8, n * 256, device=v.device).view(8, n, 256).transpose(0, 1) if i == 3 else \
                    torch.empty(n, 8, 256, device=v.device)
                bl.linear(hh, W[i], B[i], o, bl._GELU)
                hh = o
            return o.transpose(0, 1).reshape(8, n * 256)

        def cublas(v):
            hh = v.expand(n, *v.shape)
            for i in range(4):
                hh = F.gelu(torch.baddbmm(B[i].unsqueeze(1), hh, W[i].mT))
            return hh.transpose(0, 1).reshape(8, n * 256)

        fused = Parallel(*branches, fuse=True).eval()

        def cublas_module(v):  # the module with its eager kernels off (as where launches are not direct)
            bl._direct = False
            try:
                return fused(v)
            finally:
                bl._direct = True

        for _ in range(3):  # (interleaved rounds: the host's speed drifts)
            for label, fn in {"4 layers by cuBLAS": lambda: cublas(x), "4 layers by Triton": lambda: kernels(x),
                              "Parallel(fuse=True), cuBLAS": lambda: cublas_module(x),
                              "Parallel(fuse=True)": lambda: fused(x), "sequential": lambda: seq(x)}.items():
                print(f"mlp{n} {label:<28}{cpu_us(fn, 1000):7.2f} us")
        torch.testing.assert_close(fused(x), ref, rtol=1e-5, atol=1e-5)
        print(f"mlp{n} max |Triton - sequential| {(kernels(x) - ref).abs().max().item():.2e}, "
              f"|cuBLAS - sequential| {(cublas(x) - ref).abs().max().item():.2e}")
