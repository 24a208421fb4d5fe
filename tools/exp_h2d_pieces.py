"""Host-to-device case: why four micro-batches gain less than the copy and compute times promise (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_h2d_pieces.py [WIDTH ...]`` on the GPU machine (default widths 32
and 40; the benchmark calibrates the h2d model's width so that its compute takes about as long as the
copy). For each width, GPU time per call (events around groups of calls, medians of rounds, variants
interleaved): the copy and the compute alone on the whole batch; the compute of the four quarters one
after another on one stream; the same quarters while the whole batch is being copied on another
stream (does the copy slow the convolutions?); both with ``cudnn.benchmark`` on; a pipeline written by
hand (each quarter copied on a copy stream, computed on a compute stream after its copy's event) and
``ParallelSequential(chunks=4)`` eager and graphed; and copy-then-compute. The bound of four equal
pieces is the copy plus the last quarter's compute, or the first quarter's copy plus every quarter's
compute, whichever is longer.
"""
import sys

import torch

from parallel_modules import ParallelSequential
from parallel_modules._cases import h2d_model
from _timing import gpu_medians, hand_h2d_pipeline  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")
widths = [int(a) for a in sys.argv[1:]] or [32, 40]
x = torch.randn(64, 3, 224, 224).pin_memory()
xd = x.to(dev)
quarters = list(xd.chunk(4))
host_quarters = list(x.chunk(4))
copy_stream, side = torch.cuda.Stream(), torch.cuda.Stream()


for width in widths:
    torch.manual_seed(0)
    model = h2d_model(width).to(dev).eval()

    def copy():
        return x.to(dev, non_blocking=True)

    def whole():
        return model(xd)

    def pieces():
        return [model(q) for q in quarters]

    def pieces_beside_copy():
        # The whole batch copied on a side stream while the quarters are computed.
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x.to(dev, non_blocking=True)
        out = [model(q) for q in quarters]
        torch.cuda.current_stream().wait_stream(side)
        y.record_stream(torch.cuda.current_stream())
        return out

    by_hand = hand_h2d_pipeline(model, host_quarters, copy_stream)

    def copy_then_compute():
        return model(x.to(dev, non_blocking=True))

    eager4 = ParallelSequential(model, chunks=4)
    graph4 = ParallelSequential(model, chunks=4, cuda_graph=True)
    variants = {"copy alone": copy, "compute alone (whole batch)": whole, "compute: 4 quarters": pieces,
                "compute: 4 quarters beside a copy": pieces_beside_copy, "copy then compute": copy_then_compute,
                "pipeline by hand, 4": by_hand, "ParallelSequential(chunks=4)": lambda: eager4(x),
                "ParallelSequential(chunks=4, cuda_graph)": lambda: graph4(x)}
    with torch.no_grad():
        for bench in (False, True):
            torch.backends.cudnn.benchmark = bench
            for fn in variants.values():
                for _ in range(5):
                    fn()
            med = gpu_medians(variants, rounds=15, per_sample=5)
            q = med["compute: 4 quarters"] / 4
            bound = max(med["copy alone"] + q, med["copy alone"] / 4 + 4 * q)
            print(f"width {width}, cudnn.benchmark={bench} (medians of 15 rounds of 5 calls, GPU us per call)")
            for k, v in med.items():
                print(f"  {k:<44}{v:9.1f}   {med['copy then compute'] / v:5.2f}x")
            print(f"  {'bound of 4 pieces (their own compute)':<44}{bound:9.1f}   {med['copy then compute'] / bound:5.2f}x")
    torch.backends.cudnn.benchmark = False
