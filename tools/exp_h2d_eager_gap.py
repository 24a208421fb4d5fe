"""Why does the eager pipeline trail the hand-written one on some models? (dev tool, not shipped)

Usage: ``PYTHONPATH=. python3 tools/exp_h2d_eager_gap.py`` on the GPU machine.
``tools/exp_h2d_patch.py`` measured ``ParallelSequential(model, chunks=4)`` eager at 1162 us of GPU time
per call against 978 us for the pipeline written by hand (and 926 us graphed) on a patch MLP, where on the
benchmark's conv net the two are within 1-3%. Host time per call (no sync in the sample) and GPU time per
call of both, and of the pipeline given a device input, to tell host-bound from a GPU-side difference.
"""
import torch

from parallel_modules import ParallelSequential
from parallel_modules._cases import h2d_model
from _timing import gpu_medians, hand_h2d_pipeline, host_medians  # tools/ is the script's directory
from exp_h2d_models import copy_stream, dev, x, xd
from exp_h2d_patch import patch_mlp

with torch.no_grad():
    for name, model in [("patch mlp dim 384 hidden 512", patch_mlp(512, 384)), ("small conv 40", h2d_model(40))]:
        model = model.to(dev).eval()
        eager4 = ParallelSequential(model, chunks=4)
        variants = {"by hand 4": hand_h2d_pipeline(model, list(x.chunk(4)), copy_stream),
                    "ParallelSequential 4": lambda: eager4(x),
                    "ParallelSequential 4, device input": lambda: eager4(xd),
                    "compute 4 quarters": lambda: [model(q) for q in xd.chunk(4)]}
        host = host_medians(variants, rounds=10, per_sample=5, warmup=5)
        gpu = gpu_medians(variants, rounds=12, per_sample=5)
        print(f"{name}: " + "; ".join(f"{k} host {host[k]:.0f} us, gpu {gpu[k]:.0f} us" for k in variants), flush=True)
