"""GPU time of the products a fused MLP group runs, per BLAS backend and layout (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_bmm.py``. Each variant is captured 20 times in one CUDA
graph, so that the replay time per product is the kernels' own (no launch overhead), and compared
with the single-branch ``addmm`` that sets the floor, and the same products as grouped 1x1
convolutions (cuDNN, bias in the epilogue), and with the bias folded into the product as a row of the
weights against a ones column of the input (what a replay without the biases' prefill copy would run).
"""
import statistics

import torch
import torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")


def per_call_us(fn, reps=20, samples=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    times = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


B, D = 8, 256
for backend in ("default", "cublaslt"):
    if backend != "default":
        try:
            torch.backends.cuda.preferred_blas_library(backend)
        except Exception as e:  # noqa: BLE001
            print(backend, "unavailable:", e)
            continue
    x1 = torch.randn(B, D, device=dev)
    w1, b1 = torch.randn(D, D, device=dev), torch.randn(D, device=dev)
    print(f"-- {backend}: single branch F.linear [{B},{D}]x[{D},{D}]+bias: {per_call_us(lambda: F.linear(x1, w1, b1)):.2f} us")
    for n in (8, 16):
        x = torch.randn(n, B, D, device=dev)
        w = torch.randn(n, D, D, device=dev)
        bias = torch.randn(n, 1, D, device=dev)
        out = torch.empty(B, n, D, device=dev).transpose(0, 1)
        wide = torch.randn(n * D, D, device=dev)
        bw = torch.randn(n * D, device=dev)
        cases = {
            "bmm x W^T (contiguous out)": lambda: torch.bmm(x, w.mT),
            "bmm into channels layout (out=)": lambda: torch.bmm(x, w.mT, out=out),
            "baddbmm_ onto prefilled channels": lambda: out.baddbmm_(x, w.mT),
            "bmm W x^T": lambda: torch.bmm(w, x.mT),
            # The bias inside the product: a ones column on the input, the bias as a row of the
            # weights (K = D + 4, for 16-byte rows), so that no copy prefills the output.
            "bmm, bias as a row of K = D + 4": lambda: torch.bmm(x_aug, w_aug.mT),
            "gelu into [N, B, D] of a [N, B, D + 4] buffer": lambda: torch._C._nn.gelu(out, out=x_aug[..., :D]),
            "prefill copy of 3 layers' biases": lambda: fill.copy_(biases.unsqueeze(1).expand(3, B, n, D)),
            "shared input: one F.linear [N*D, D] + bias": lambda: F.linear(x1, wide, bw),
            "gelu on [B, N*D]": lambda: F.gelu(out),
            # The channels layout [B, N*D] is a grouped 1x1 convolution's: bias in the epilogue.
            "grouped conv1d [B, N*D, 1] + bias": lambda: F.conv1d(xc1, wc1, bw, groups=n),
            "grouped conv2d [B, N*D, 1, 1] + bias": lambda: F.conv2d(xc2, wc2, bw, groups=n),
        }
        x_aug = torch.zeros(n, B, D + 4, device=dev)
        x_aug[..., D] = 1
        w_aug = torch.zeros(n, D, D + 4, device=dev)
        w_aug[..., :D], w_aug[..., D] = w, bias.squeeze(1)
        fill, biases = torch.empty(3, B, n, D, device=dev), torch.randn(3, n, D, device=dev)
        xc1 = out.transpose(0, 1).reshape(B, n * D, 1)
        xc2 = xc1.unsqueeze(-1)
        wc1 = w.reshape(n * D, D, 1)
        wc2 = wc1.unsqueeze(-1)
        for bench in (False, True):
            torch.backends.cudnn.benchmark = bench
            for name in ("grouped conv1d [B, N*D, 1] + bias", "grouped conv2d [B, N*D, 1, 1] + bias"):
                print(f"   N={n:<3}{name + (' (cudnn.benchmark)' if bench else ''):<44}{per_call_us(cases[name]):6.2f} us")
        torch.backends.cudnn.benchmark = False
        for name in [k for k in cases if k.startswith("grouped")]:
            del cases[name]
        for name, fn in cases.items():
            print(f"   N={n:<3}{name:<44}{per_call_us(fn):6.2f} us")
torch.backends.cuda.preferred_blas_library("default") if hasattr(torch.backends.cuda, "preferred_blas_library") else None
