"""Exercise ParallelSequential on CUDA for the CUDA Stream Sanitizer; exits 0 when clean.

Run as ``TORCH_CUDA_SANITIZER=1 python tests/_sanitizer_pipeline.py`` from the
repository root (``tests/test_pipeline_cuda.py`` does so in a subprocess). The
sanitizer raises on the first unsynchronized access between streams, which
makes this script exit non-zero with "CSAN" in its stderr.

``--broken`` disables every stream-to-event wait of the pipeline first, a deliberately wrong
variant the sanitizer must catch: it proves the harness can fail.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from parallel_modules import ParallelSequential


def main(broken: bool) -> int:
    if broken:
        from parallel_modules import pipeline

        pipeline._wait = lambda event, stream: None  # the pipeline's every stream-to-event wait
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = ParallelSequential(
        nn.Sequential(nn.Linear(32, 64), nn.GELU()),
        nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
        nn.Linear(64, 8),
        chunks=3,
    ).cuda()
    ref = nn.Sequential(*model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for kind in ("device", "pageable", "pinned", "device"):
        x = torch.randn(13, 32)
        if kind == "pinned":
            x = x.pin_memory()
        elif kind == "device":
            x = x.cuda().requires_grad_()
        out = model(x)
        expected = torch.cat([ref(p) for p in x.cuda().tensor_split(3)])
        if not torch.equal(out, expected):
            print(f"mismatch for a {kind} input", file=sys.stderr)
            return 1
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        del out, expected
    # Inference: the last lane concatenates the pieces itself (pinned: copies issued first).
    with torch.no_grad():
        for kind in ("pageable", "pinned", "device"):
            x = torch.randn(7, 32)
            x = x.pin_memory() if kind == "pinned" else x.cuda() if kind == "device" else x
            out = model(x)
            if not torch.equal(out, torch.cat([ref(p) for p in x.cuda().tensor_split(3)])):
                print(f"mismatch for a {kind} input without autograd", file=sys.stderr)
                return 1
    torch.cuda.synchronize()
    print("ok", out.shape)
    return 0


if __name__ == "__main__":
    sys.exit(main("--broken" in sys.argv[1:]))
