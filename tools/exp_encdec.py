"""Encoder/decoder pipeline: does anything let micro-batches gain on the H100 (dev tool, not shipped).

Times in one process, interleaved, the ``encdec`` case (batch 8, 3x256x256, fp32, TF32 off):
each stage alone at every piece size (graphed by hand, so kernels and not the host set the time),
what overlapping could reach, and the sequential model against ``ParallelSequential`` with 2, 4
and 8 chunks, eager and graphed. Usage: ``PYTHONPATH=. python3 tools/exp_encdec.py [bench]
[cl]``: ``bench`` turns ``torch.backends.cudnn.benchmark`` on (every variant alike), ``cl``
runs in channels_last (the stages and the input converted).
"""
import sys

import torch
from torch import nn

from parallel_modules import ParallelSequential
from parallel_modules._cases import PIPELINES
from parallel_modules.bench import _capture
from _timing import gpu_medians  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.backends.cudnn.benchmark = "bench" in sys.argv
fmt = torch.channels_last if "cl" in sys.argv else torch.contiguous_format
dev = torch.device("cuda")
case = PIPELINES["encdec"]
enc, dec = (s.to(memory_format=fmt) for s in case.stages(dev, torch.float32))
x = case.make_input(8, dev, torch.float32).contiguous(memory_format=fmt)
seq = nn.Sequential(enc, dec)
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cudnn.benchmark={torch.backends.cudnn.benchmark}, "
      f"format={'channels_last' if fmt is torch.channels_last else 'NCHW'}")

with torch.no_grad():
    mid = enc(x)
    alone = {}
    for b in (8, 4, 2, 1):
        alone[f"encoder b{b}"] = (_capture(enc, x[:b].clone()), x[:b])
        alone[f"decoder b{b}"] = (_capture(dec, mid[:b].clone()), mid[:b])
    t = gpu_medians({k: (lambda f=f, v=v: f(v)) for k, (f, v) in alone.items()}, rounds=20, per_sample=5)
    print("each stage graphed alone, GPU us per call (and per sample of the batch x 8):")
    for k, v in t.items():
        b = int(k.split("b")[-1])
        print(f"  {k:<14}{v:9.1f}   x{8 // b}: {v * 8 / b:9.1f}")
    for c in (2, 4, 8):
        e, d = t[f"encoder b{8 // c}"], t[f"decoder b{8 // c}"]
        print(f"  chunks={c}: serial pieces {c * (e + d):8.1f}, perfect overlap {e + d + (c - 1) * max(e, d):8.1f}"
              f" (whole batch {t['encoder b8'] + t['decoder b8']:.1f})")

    variants = {"eager seq": seq, "graph seq": _capture(seq, x)}
    for c in (2, 4, 8):
        variants[f"eager chunks={c}"] = ParallelSequential(enc, dec, chunks=c)
        variants[f"graph chunks={c}"] = ParallelSequential(enc, dec, chunks=c, cuda_graph=True)
    ref = seq(x)
    for k, f in variants.items():
        torch.testing.assert_close(f(x), ref, rtol=1e-4, atol=1e-4)
    t = gpu_medians({k: (lambda f=f: f(x)) for k, f in variants.items()}, rounds=30, per_sample=5)
    print("GPU us per call (speed-up over eager seq | over graph seq):")
    for k, v in t.items():
        print(f"  {k:<18}{v:9.1f}  {t['eager seq'] / v:6.3f}x  {t['graph seq'] / v:6.3f}x")
