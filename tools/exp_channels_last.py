"""Compiled conv branches: does one channels_last conversion before the fork pay? (dev tool, not shipped)

Per-branch inductor converts an NCHW input to channels_last in every branch (one
``triton_poi_fused_convolution`` of ~24 us per branch at batch 64 fp16 on an H100);
whole-model compilation converts once. Variants captured by hand, timed interleaved.
Usage: ``PYTHONPATH=. python3 tools/exp_channels_last.py [b64-fp16 b8-fp32 ...]``
"""
import sys

import torch

from parallel_modules import Parallel
from parallel_modules._cases import CASES, SequentialBranches as Seq
from parallel_modules.bench import _capture
from _timing import gpu_medians  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
CL = torch.channels_last
DEV, INCEPTION = torch.device("cuda"), CASES["inception"]


def run(batch, dtype):
    x = torch.randn(batch, 192, 35, 35, device="cuda", dtype=dtype)
    cat = Parallel(*INCEPTION.branches(DEV, dtype), streams=True, compile="inductor")
    tup = Parallel(*INCEPTION.branches(DEV, dtype), streams=True, compile="inductor", join="tuple")

    def into_nchw(x):
        outs = tup(x.contiguous(memory_format=CL))
        res = torch.empty(x.shape[0], 256, *x.shape[2:], device=x.device, dtype=x.dtype)
        return torch.cat(outs, 1, out=res)

    variants = {
        "reduce-overhead": torch.compile(Seq(INCEPTION.branches(DEV, dtype)), mode="reduce-overhead"),
        "A: NCHW": _capture(cat, x, clone=False),
        "B: channels_last in, out": _capture(lambda x: cat(x.contiguous(memory_format=CL)), x, clone=False),
        "C: B + .contiguous()": _capture(lambda x: cat(x.contiguous(memory_format=CL)).contiguous(), x,
                                         clone=False),
        "D: channels_last in, cat out= NCHW": _capture(into_nchw, x, clone=False),
    }
    with torch.no_grad():
        ref = Seq(INCEPTION.branches(DEV, dtype))(x)
        for name, m in variants.items():
            for _ in range(3):
                out = m(x)
            print(f"  {name:<36} err {(out.float() - ref.float()).abs().max().item():.1e} strides {out.stride()}")
        times = gpu_medians({name: (lambda m=m: m(x)) for name, m in variants.items()})
    for name, t in times.items():
        print(f"b{batch} {str(dtype)[6:]:<8} {name:<36} {t:8.1f} us  RO/this {times['reduce-overhead'] / t:.2f}x")


CONFIGS = {"b64-fp16": (64, torch.float16), "b64-fp32": (64, torch.float32), "b8-fp16": (8, torch.float16),
           "b1-fp16": (1, torch.float16), "b8-fp32": (8, torch.float32)}
for key in sys.argv[1:] or CONFIGS:
    run(*CONFIGS[key])
