"""Host-to-device case: do uneven pieces (a small first one) shorten the pipeline? (dev tool, not shipped)

Usage: ``PYTHONPATH=. python3 tools/exp_h2d_taper.py [WIDTH ...]`` on the GPU machine (default 32 40 44).
A pipeline of four pieces whose compute outlasts the copy ends no sooner than the first piece's copy
plus every piece's compute: a smaller first piece starts the compute sooner, at the price of a less
efficient small batch. For each split of the batch of 64 (``torch.split`` sizes), a pipeline written
by hand (``_timing.hand_h2d_pipeline``: each piece copied on a copy stream, computed on the caller's
stream after its copy's event) against copy-then-compute; GPU time per call, medians of rounds of 5
calls, variants interleaved.
"""
import sys

import torch

from parallel_modules._cases import h2d_model
from _timing import gpu_medians, hand_h2d_pipeline  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")
widths = [int(a) for a in sys.argv[1:]] or [32, 40, 44]
x = torch.randn(64, 3, 224, 224).pin_memory()
xd = x.to(dev)
copy_stream = torch.cuda.Stream()
splits = [(16, 16, 16, 16), (8, 24, 24, 8), (8, 20, 20, 16), (8, 18, 19, 19), (6, 18, 20, 20), (4, 20, 20, 20),
          (10, 18, 18, 18), (12, 18, 18, 16), (8,) * 8, (4, 12, 16, 16, 16)]

for width in widths:
    torch.manual_seed(0)
    model = h2d_model(width).to(dev).eval()
    variants = {"copy alone": lambda: x.to(dev, non_blocking=True), "compute alone": lambda: model(xd),
                "copy then compute": lambda: model(x.to(dev, non_blocking=True))}
    for s in splits:
        variants[f"by hand {s}"] = hand_h2d_pipeline(model, list(x.split(list(s))), copy_stream)
        variants[f"compute of pieces {s}"] = (lambda s=s: [model(p) for p in xd.split(list(s))])
    with torch.no_grad():
        ref = model(xd)
        for s in splits:
            got = variants[f"by hand {s}"]()
            torch.testing.assert_close(got, ref)  # (another batch size may pick another kernel)
        for fn in variants.values():
            for _ in range(3):
                fn()
        med = gpu_medians(variants, rounds=15, per_sample=5)
    base = med["copy then compute"]
    print(f"width {width} (GPU us per call, medians of 15 rounds of 5 calls; ratio: copy-then-compute / this)")
    for k, v in med.items():
        print(f"  {k:<44}{v:9.1f}   {base / v:5.2f}x")
