"""AMP training: the graphed backward must compute what eager backward computes.

The recommended AMP pattern runs forward (and loss) under torch.autocast and calls
backward() OUTSIDE it; a region inside forward that disables autocast
(``torch.autocast(enabled=False)``) computes in fp32, and so does its backward.
_graphs._record captures the backward (torch.autograd.grad) while the caller's
autocast context is still active (capture happens inside the forward call), and the
autograd engine propagates autocast TLS into backward: the fp32 island's backward
matmuls would be captured as fp16 matmuls. Expected (correct library): gradients
equal eager's bit for bit (or to fp32 rounding), NOT equal to "eager backward run
inside autocast".
"""
import copy
import os
import sys
import warnings

import torch
from torch import nn

NAME = "amp_backward_fp32_region"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")
LOW = torch.float16 if DEV == "cuda" else torch.bfloat16


class Fp32Island(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(256, 128) / 16)

    def forward(self, x):
        with torch.autocast(DEV, enabled=False):
            return x.float() @ self.w


def main():
    from parallel_modules import Parallel

    torch.manual_seed(0)
    branches = [Fp32Island(), nn.Linear(256, 128)]
    ref = Parallel(*copy.deepcopy(branches), cuda_graph=False).to(DEV)
    inside = Parallel(*copy.deepcopy(branches), cuda_graph=False).to(DEV)  # eager, backward under autocast
    blk = Parallel(*branches, cuda_graph=True).to(DEV)
    problems = []
    for it in range(3):
        x = torch.randn(64, 256, device=DEV)
        gw = torch.randn(64, 256, device=DEV)
        res = {}
        for tag, m in (("graph", blk), ("eager", ref), ("inside", inside)):
            m.zero_grad(set_to_none=True)
            with torch.autocast(DEV, dtype=LOW):
                y = m(x)
                if tag == "inside":
                    (y.float() * gw).sum().backward()
            if tag != "inside":
                (y.float() * gw).sum().backward()  # outside autocast, as the AMP docs recommend
            res[tag] = (y.detach().float(), [p.grad.clone() for p in m.parameters()])
        if not torch.equal(res["graph"][0], res["eager"][0]):
            problems.append(f"it{it}: forward differs (max {(res['graph'][0] - res['eager'][0]).abs().max().item():.3g})")
        names = [n for n, _ in blk.named_parameters()]
        for n, g, e, i in zip(names, res["graph"][1], res["eager"][1], res["inside"][1]):
            if not torch.equal(g, e):
                rel = ((g - e).abs().max() / e.abs().max()).item()
                like_inside = torch.equal(g, i)
                problems.append(f"it{it} {n}.grad differs from eager (rel {rel:.2e}"
                                f"{', equals eager-backward-under-autocast' if like_inside else ''})")
    if problems:
        return False, "; ".join(problems[:4]) + (f" (+{len(problems) - 4} more)" if len(problems) > 4 else "")
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
