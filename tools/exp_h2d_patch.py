"""Host-to-device case: do compute-bound models pipeline past 1.4x at four pieces? (dev tool, not shipped)

Usage: ``PYTHONPATH=. python3 tools/exp_h2d_patch.py`` on the GPU machine (session 85: worse than the conv net).
``tools/exp_h2d_models.py`` found the benchmark's small conv net and other memory-bound models computing
their four quarters 11-20% slower than the whole batch, which bounds four pieces below 1.4x. Here models
whose work is matrix products (a ViT-style 16x16 patch embedding and a token MLP, fp32, TF32 off) at
several hidden widths, so that the compute is about the copy's: for each, GPU time per call (medians of
rounds of 5 calls, variants interleaved) of the compute on the whole batch and on its quarters, a pipeline
written by hand, ``ParallelSequential(chunks=4)`` eager and graphed, and copy-then-compute.
"""
import torch
from torch import nn

from exp_h2d_models import report  # tools/ is the script's directory (its input, streams and TF32 off)


class Patches(nn.Module):
    # [B, 3, 224, 224] -> [B, 196, 768]: 16x16 patches by a reshape (cuDNN's fp32 16x16 stride-16
    # convolution ran at about 12 TFLOPS here: the products below are the model's work).
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        return x.reshape(b, 3, 14, 16, 14, 16).permute(0, 2, 4, 1, 3, 5).reshape(b, 196, 768)


def patch_mlp(hidden: int, dim: int = 384) -> nn.Module:
    return nn.Sequential(Patches(), nn.Linear(768, dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


if __name__ == "__main__":
    report([(f"patch mlp dim {d} hidden {h}", patch_mlp(h, d)) for d, h in (
        (384, 512), (384, 768), (384, 1024), (384, 1280), (512, 768), (256, 1536))])
