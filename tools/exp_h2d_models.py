"""Host-to-device case: which models' quarters compute as fast as their whole batch? (dev tool, not shipped)

Usage: ``PYTHONPATH=. python3 tools/exp_h2d_models.py`` on the GPU machine.
Four pieces can hide all but a quarter of the copy only if the four quarters compute in about the time of
the whole batch. The benchmark's small conv net (``_cases.h2d_model``: two stride-2 3x3 convolutions)
does not: its quarters take 11-14% longer. For each candidate model, GPU time per call (medians of
rounds of 5 calls, variants interleaved): the compute on the whole batch and on its four quarters, a
pipeline written by hand (``_timing.hand_h2d_pipeline``), ``ParallelSequential(chunks=4)`` eager and
graphed, and copy-then-compute.
"""
import torch
from torch import nn

from parallel_modules import ParallelSequential
from parallel_modules._cases import h2d_model
from _timing import gpu_medians, hand_h2d_pipeline  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")
x = torch.randn(64, 3, 224, 224).pin_memory()
xd = x.to(dev)
copy_stream = torch.cuda.Stream()


def stem(width: int) -> nn.Module:
    # A patchify stem (ConvNeXt's 4x4, stride 4) and a pointwise MLP block on its 56x56 map.
    return nn.Sequential(nn.Conv2d(3, 96, 4, 4), nn.Conv2d(96, width, 1), nn.GELU(), nn.Conv2d(width, 96, 1))


def deeper(width: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1), nn.ReLU(), nn.Conv2d(32, 64, 3, 2, 1), nn.ReLU(),
                         nn.Conv2d(64, width, 3, 2, 1), nn.ReLU())


def report(candidates: list[tuple[str, nn.Module]]) -> None:
    r"""For each ``(name, model)``: GPU time per call of the variants above, and the pipeline's largest error."""
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
    report([("small conv 40", h2d_model(40))] + [(f"stem {w}", stem(w)) for w in (192, 256, 320, 384)]
           + [(f"deeper {w}", deeper(w)) for w in (128, 256)])
