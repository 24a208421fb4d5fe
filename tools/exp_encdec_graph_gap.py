"""Why a graphed ``ParallelSequential(chunks=1)`` of encdec replays slower than the same stages captured by hand (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_encdec_graph_gap.py`` on the GPU machine.

Runs 28-34 measured ``graph ParallelSequential chunks=1`` 25-80 us (1.3-4%) over ``graph seq`` on encdec
(batch 8, fp32), where both should be one graph of the same kernels. Side by side in one process: GPU
time per call (CUDA events over groups of 10 calls, medians of rounds, outputs dropped as the benchmark
drops them), whether the module's graph reads its input in place and lends its output, then the kernels
each replays (torch.profiler, CUDA activity, 5 calls), summed by name.
"""
import collections

import torch
from torch import nn

from parallel_modules import ParallelSequential
from parallel_modules._cases import PIPELINES
from parallel_modules.bench import _capture
from _timing import gpu_medians  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")
case = PIPELINES["encdec"]
torch.manual_seed(0)
stages = case.stages(dev, torch.float32)
x = torch.randn(*case.input_shape(8), device=dev)
seq = nn.Sequential(*stages)
variants = {
    "graph seq (by hand)": _capture(seq, x, in_place=True),
    "graph seq (by hand, copying in)": _capture(seq, x),
    "ParallelSequential chunks=1 cuda_graph": ParallelSequential(*stages, chunks=1, cuda_graph=True),
    "ParallelSequential chunks=1 cuda_graph static_outputs": ParallelSequential(*stages, chunks=1, cuda_graph=True,
                                                                                 static_outputs=True),
}
with torch.no_grad():
    ref = seq(x)
    for name, fn in variants.items():
        for _ in range(30):
            out = fn(x)
            diff = (out - ref).abs().max().item()
            del out
        print(f"  {name}: max abs difference from eager {diff:.3g}")
    medians = gpu_medians({name: (lambda fn=fn: fn(x)) for name, fn in variants.items()}, rounds=15, per_sample=10)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: encdec b8 fp32, GPU us per call (medians)")
    for name, us in medians.items():
        print(f"  {name:<56}{us:9.1f}")
    for name in ("ParallelSequential chunks=1 cuda_graph", "ParallelSequential chunks=1 cuda_graph static_outputs"):
        g = variants[name]._graphs._hot[1]
        print(f"  {name}: reader={g.reader is not None} lent={g.lending.lent} kept={g.lending.kept} "
              f"variant={g.variant}")
    for name, fn in variants.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn(x)
            torch.cuda.synchronize()
        kernels = collections.Counter()
        counts = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name[:90]] += e.device_time / 5
                counts[e.name[:90]] += 1
        print(f"---- {name}: {sum(kernels.values()):.1f} us of kernels per call")
        for k, us in kernels.most_common(14):
            print(f"  {us:8.1f} us  x{counts[k] / 5:.0f}  {k}")
