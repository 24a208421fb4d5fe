"""Host-to-device case: do unequal micro-batches beat four equal ones? (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_h2d_splits.py [WIDTH ...]`` on the GPU machine (default 40 and
32). A copy-then-compute pipeline takes at least max(the whole copy + the last piece's compute, the
first piece's copy + every piece's compute): with four equal pieces, a quarter of one or the other
is exposed. Smaller first and last pieces shrink both exposed ends, at the cost of less efficient
small batches. For each split, a pipeline written by hand (each piece copied on a copy stream, computed
on the caller's stream after its copy's event, then ``cat``), GPU time per call (events around groups
of calls, medians of rounds, variants interleaved), against copy-then-compute.
"""
import sys

import torch

from parallel_modules._cases import h2d_model
from _timing import gpu_medians, hand_h2d_pipeline  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")
widths = [int(a) for a in sys.argv[1:]] or [40, 32]
x = torch.randn(64, 3, 224, 224).pin_memory()
copy_stream = torch.cuda.Stream()
SPLITS = [(16, 16, 16, 16), (8, 24, 24, 8), (10, 22, 22, 10), (12, 20, 20, 12), (8, 20, 20, 16),
          (6, 18, 24, 16), (12, 18, 18, 16), (4, 20, 24, 16)]


for width in widths:
    torch.manual_seed(0)
    model = h2d_model(width).to(dev).eval()
    variants = {"copy then compute": lambda: model(x.to(dev, non_blocking=True))}
    for s in SPLITS:
        variants["by hand " + "/".join(map(str, s))] = hand_h2d_pipeline(model, list(x.split(list(s))), copy_stream)
    with torch.no_grad():
        ref = variants["copy then compute"]()
        for k, fn in variants.items():
            torch.testing.assert_close(fn(), ref, rtol=1e-4, atol=1e-5)  # (a piece's batch may pick other kernels)
            for _ in range(3):
                fn()
        med = gpu_medians(variants, rounds=15, per_sample=5)
    print(f"width {width} (medians of 15 rounds of 5 calls, GPU us per call; {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__})")
    for k, v in med.items():
        print(f"  {k:<28}{v:9.1f}   {med['copy then compute'] / v:5.2f}x")
