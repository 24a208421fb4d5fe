"""Compiled conv branches against reduce-overhead: where the per-branch graph loses time (dev tool, not shipped).

Per-branch inductor converts an NCHW input to channels_last in every branch (one
``triton_poi_fused_convolution`` of ~24 us per branch at batch 64 fp16 on an H100);
whole-model compilation converts once, and fuses the concatenation into the
branches' last kernels. Variants captured by hand (replay only), timed interleaved:

* A: the library, ``Parallel(cuda_graph=True, compile="inductor")``;
* B: compiled branches on streams, the input converted to channels_last once before the fork;
* C: B, the output made NCHW-contiguous again (what a user of NCHW tensors gets);
* W: the whole block compiled by inductor (one stream), captured in a plain graph.

Usage: ``PYTHONPATH=. python3 tools/exp_channels_last.py [--profile] [b64-fp16 b8-fp32 ...]``
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


def kernels(name, fn, x):
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn(x)
            torch.cuda.synchronize()
    print(f"---- {name}: kernels, 10 calls")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def run(batch, dtype, show_kernels):
    x = torch.randn(batch, 192, 35, 35, device="cuda", dtype=dtype)
    cat = Parallel(*INCEPTION.branches(DEV, dtype), streams=True, compile="inductor")
    library = Parallel(*INCEPTION.branches(DEV, dtype), cuda_graph=True, compile="inductor")
    whole = torch.compile(Seq(INCEPTION.branches(DEV, dtype)))
    variants = {
        "reduce-overhead": torch.compile(Seq(INCEPTION.branches(DEV, dtype)), mode="reduce-overhead"),
        "A: library": library,
        "B: CL in, CL out": _capture(lambda x: cat(x.contiguous(memory_format=CL)), x),
        "C: CL in, NCHW out": _capture(lambda x: cat(x.contiguous(memory_format=CL)).contiguous(), x),
        "W: whole block, our graph": _capture(whole, x),
    }
    with torch.no_grad():
        ref = Seq(INCEPTION.branches(DEV, dtype))(x)
        for name, m in variants.items():
            for _ in range(3):
                out = m(x)
            print(f"  {name:<28} err {(out.float() - ref.float()).abs().max().item():.1e} strides {out.stride()}")
        print("  library chose:", list(library.explain()["schedules"].values()))
        try:  # the block compiled as one, outside any capture: does it compile and run?
            err = (library._compiler.whole(library._forward)(x).float() - ref.float()).abs().max().item()
            print(f"  whole block via the library's compiler: err {err:.1e}")
        except Exception as e:  # noqa: BLE001 - a dev tool: show why
            print(f"  whole block via the library's compiler FAILED: {type(e).__name__}: {str(e)[:600]}")
        times = gpu_medians({name: (lambda m=m: m(x)) for name, m in variants.items()}, rounds=40)
    for name, t in times.items():
        print(f"b{batch} {str(dtype)[6:]:<8} {name:<28} {t:8.1f} us  RO/this {times['reduce-overhead'] / t:.2f}x")
    if show_kernels:
        kernels("whole block inductor", whole, x)
        per_branch = Parallel(*INCEPTION.branches(DEV, dtype), streams=False, compile="inductor")
        kernels("per-branch inductor, NCHW in", per_branch, x)
        kernels("per-branch inductor, CL in", lambda x: per_branch(x.contiguous(memory_format=CL)), x)


CONFIGS = {"b64-fp16": (64, torch.float16), "b64-fp32": (64, torch.float32), "b8-fp16": (8, torch.float16),
           "b1-fp16": (1, torch.float16), "b8-fp32": (8, torch.float32), "b1-fp32": (1, torch.float32)}
args = [a for a in sys.argv[1:] if a != "--profile"]
for key in args or CONFIGS:
    run(*CONFIGS[key], "--profile" in sys.argv)
