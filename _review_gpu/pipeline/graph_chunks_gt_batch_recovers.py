"""cuda_graph=True, chunks=4: after a captured signature, a batch of 3 must raise the pipeline's own
ValueError ("chunks=4 is larger than the batch size 3"), not a capture error or a fallback warning,
leave no capture/stream state behind, and the next good call must replay correctly.
Expected: PASS."""
import warnings

import torch
from torch import nn

from _common import clean, need_cuda, report
from parallel_modules import ParallelSequential

NAME = "graph_chunks_gt_batch_recovers"
need_cuda(NAME)
torch.manual_seed(0)
problems = []
for fallback in (False, True):
    for grad in (False, True):
        model = ParallelSequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4), chunks=4, cuda_graph=True,
                                   graph_fallback=fallback).cuda()
        plain = nn.Sequential(*model)
        label = f"fallback={fallback} grad={grad}"
        with torch.set_grad_enabled(grad):
            model(torch.randn(8, 16, device="cuda"))  # captured
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    model(torch.randn(3, 16, device="cuda"))
                    problems.append(f"{label}: batch 3 with chunks=4 was not refused")
                except ValueError as e:
                    if "chunks=4 is larger than the batch size 3" not in str(e):
                        problems.append(f"{label}: unexpected ValueError {str(e)[:100]!r}")
                except Exception as e:  # noqa: BLE001
                    problems.append(f"{label}: {type(e).__name__} instead of ValueError: {str(e)[:120]!r}")
            if any("graph_fallback" in str(w.message) for w in caught):
                problems.append(f"{label}: the input error was turned into a graph fallback warning")
            why = clean()
            if why:
                problems.append(f"{label}: {why}")
            for _ in range(2):
                x = torch.randn(8, 16, device="cuda")
                out = model(x)
                ref = torch.cat([plain(p) for p in x.tensor_split(4)])
                if not torch.allclose(out.detach(), ref.detach(), rtol=1e-5, atol=1e-5):
                    problems.append(f"{label}: wrong result after the error")
                    break
report(NAME, problems)
