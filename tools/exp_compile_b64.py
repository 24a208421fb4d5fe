"""Where compiled branches lose to reduce-overhead: Inception block, batch 64, fp16 (dev tool, not shipped).

Each variant is timed by GPU events over back-to-back calls, interleaved, median of samples.
Usage on the GPU machine: ``PYTHONPATH=. python3 tools/exp_compile_b64.py [batch] [fp16|fp32]``
"""
import sys

import torch

from parallel_modules import Parallel
from parallel_modules._cases import CASES, SequentialBranches as Seq
from _timing import gpu_medians  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
DEV, INCEPTION = torch.device("cuda"), CASES["inception"]
dtype = torch.float16 if (sys.argv[2] if len(sys.argv) > 2 else "fp16") == "fp16" else torch.float32


x = torch.randn(batch, 192, 35, 35, device="cuda", dtype=dtype)
x_cl = x.contiguous(memory_format=torch.channels_last)
variants = {
    "reduce-overhead": (torch.compile(Seq(INCEPTION.branches(DEV, dtype)), mode="reduce-overhead"), x),
    "inductor whole, no graph": (torch.compile(Seq(INCEPTION.branches(DEV, dtype))), x),
    "branches+graph": (Parallel(*INCEPTION.branches(DEV, dtype), cuda_graph=True, compile="inductor"), x),
    "branches+graph seq": (Parallel(*INCEPTION.branches(DEV, dtype), cuda_graph=True, compile="inductor",
                                    streams=False), x),
    "branches+graph, channels_last in": (Parallel(*INCEPTION.branches(DEV, dtype), cuda_graph=True,
                                                  compile="inductor"), x_cl),
    "eager branches+graph, channels_last in": (Parallel(*INCEPTION.branches(DEV, dtype), cuda_graph=True), x_cl),
    "eager branches+graph": (Parallel(*INCEPTION.branches(DEV, dtype), cuda_graph=True), x),
}
with torch.no_grad():
    ref = Seq(INCEPTION.branches(DEV, dtype))(x)
    for name, (m, inp) in variants.items():
        for _ in range(5):
            out = m(inp)
        err = (out.float() - ref.float()).abs().max().item()
        print(f"{name:<40} max err {err:.2e}  out strides {out.stride()}", flush=True)
        if hasattr(m, "explain"):
            print("   ", list(m.explain()["schedules"].values()))
    times = gpu_medians({name: (lambda m=m, inp=inp: m(inp)) for name, (m, inp) in variants.items()})
for name, t in times.items():
    print(f"{name:<40} {t:8.1f} us")

# Kernels of the whole-model and the per-branch compilation, without graphs (a graph hides them).
from torch.profiler import ProfilerActivity, profile  # noqa: E402

per_branch = Parallel(*INCEPTION.branches(DEV, dtype), compile="inductor", streams=False)
with torch.no_grad():
    for name, m in (("inductor whole", variants["inductor whole, no graph"][0]), ("inductor per branch", per_branch)):
        for _ in range(3):
            m(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                m(x)
            torch.cuda.synchronize()
        print(f"---- {name}: kernels, 10 calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
