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

from parallel_modules import ParallelSequential
from _timing import gpu_medians, hand_h2d_pipeline  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")
x = torch.randn(64, 3, 224, 224).pin_memory()
xd = x.to(dev)
copy_stream = torch.cuda.Stream()


class Patches(nn.Module):
    # [B, 3, 224, 224] -> [B, 196, 768]: 16x16 patches by a reshape (cuDNN's fp32 16x16 stride-16
    # convolution ran at about 12 TFLOPS here: the products below are the model's work).
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        return x.reshape(b, 3, 14, 16, 14, 16).permute(0, 2, 4, 1, 3, 5).reshape(b, 196, 768)


def patch_mlp(hidden: int, dim: int = 384) -> nn.Module:
    return nn.Sequential(Patches(), nn.Linear(768, dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))



def main() -> None:
    candidates = [(f"patch mlp dim {d} hidden {h}", patch_mlp(h, d)) for d, h in (
        (384, 512), (384, 768), (384, 1024), (384, 1280), (512, 768), (256, 1536))]
    with torch.no_grad():
        copy = gpu_medians({"copy": lambda: x.to(dev, non_blocking=True)}, rounds=10, per_sample=5)["copy"]
        print(f"copy alone {copy:.1f} us")
        for name, model in candidates:
            model = model.to(dev).eval()
            eager4 = ParallelSequential(model, chunks=4)
            graph4 = ParallelSequential(model, chunks=4, cuda_graph=True)
            variants = {"compute whole": lambda: model(xd),
                        "compute 4 quarters": lambda: [model(q) for q in xd.chunk(4)],
                        "copy then compute": lambda: model(x.to(dev, non_blocking=True)),
                        "by hand 4": hand_h2d_pipeline(model, list(x.chunk(4)), copy_stream),
                        "ParallelSequential 4": lambda: eager4(x),
                        "ParallelSequential 4 graphed": lambda: graph4(x)}
            for fn in variants.values():
                for _ in range(3):
                    fn()
            out, ref = eager4(x), model(xd)
            med = gpu_medians(variants, rounds=12, per_sample=5)
            base = med["copy then compute"]
            print(f"{name}: max err {(out - ref).abs().max().item():.2e}; "
                  + ", ".join(f"{k} {v:.0f} ({base / v:.2f}x)" for k, v in med.items()), flush=True)


if __name__ == "__main__":
    main()
