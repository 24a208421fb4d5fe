"""ParallelSequential, CPU input that requires grad, frozen stages, chunks=2, cuda_graph=True.

Input-gradient use of a frozen model (saliency maps, adversarial examples) fed from the
host. pipeline._stage_graphs only sends calls to eager when a *parameter* requires grad
(pipeline.py: `if torch.is_grad_enabled() and any(p.requires_grad ...)`); with frozen
stages it graphs every stage per micro-batch. The micro-batches' chunks require grad, so
each stage captures a *training* graph (_CudaGraphs._lookup: needs_grad from the input),
and micro-batches of one size replay the same training graph one after the other before
any backward: _Replay.backward then refuses ("backward of a CUDA-graphed call after a
later call with the same input signature") or would read overwritten activations.
Expected (correct library): output and x.grad equal the eager pipeline / nn.Sequential.
"""
import copy
import os
import sys
import warnings

import torch
from torch import nn

NAME = "pipeline_host_input_grad"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")


def step(model, base, g):
    x = base.clone().requires_grad_()
    y = model(x)
    (y * g).sum().backward()
    return y.detach(), x.grad


def main():
    from parallel_modules import ParallelSequential

    torch.manual_seed(0)
    stages = [nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)]
    for s in stages:
        s.requires_grad_(False)
    seq = nn.Sequential(*copy.deepcopy(stages)).to(DEV)
    eager = ParallelSequential(*copy.deepcopy(stages), chunks=2, cuda_graph=False).to(DEV)
    graphed = ParallelSequential(*stages, chunks=2, cuda_graph=True).to(DEV)
    for it in range(3):
        base = torch.randn(16, 64)  # host input
        g = torch.randn(16, 32, device=DEV)
        xr = base.clone().requires_grad_()
        yr = seq(xr.to(DEV))
        (yr * g).sum().backward()
        try:
            ye, ge = step(eager, base, g)
        except Exception as e:  # noqa: BLE001
            return False, f"harness: eager pipeline raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if ge is None:
            return False, "harness: eager pipeline leaves x.grad None"
        if not (torch.allclose(ye, yr.detach(), atol=1e-5) and torch.allclose(ge, xr.grad, atol=1e-5)):
            return False, "harness: eager pipeline differs from nn.Sequential"
        try:
            yg, gg = step(graphed, base, g)
        except Exception as e:  # noqa: BLE001
            msg = str(e).strip().splitlines()
            return False, f"it{it}: graphed pipeline raised {type(e).__name__}: {msg[0][:220] if msg else ''}"
        if gg is None:
            return False, f"it{it}: x.grad is None"
        if not torch.allclose(yg, yr.detach(), atol=1e-5, rtol=1e-5):
            return False, f"it{it}: output differs (max {(yg - yr.detach()).abs().max().item():.3g})"
        if not torch.allclose(gg, xr.grad, atol=1e-5, rtol=1e-5):
            return False, f"it{it}: x.grad differs (max {(gg - xr.grad).abs().max().item():.3g})"
    return True, ""


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if DEV == "cuda" and not torch.cuda.is_available():
        print(f"FAIL {NAME}: no CUDA device")
        sys.exit(0)
    try:
        ok, detail = main()
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()
        ok, detail = False, f"exception {type(e).__name__}: {msg[0][:300] if msg else ''}"
    print(f"PASS {NAME}" if ok else f"FAIL {NAME}: {detail}")
