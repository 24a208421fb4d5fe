"""Python values a graph bakes in, changed after capture, on UNFUSED branches.

(a) A hyperparameter set in place on an unfused branch (nn.LeakyReLU.negative_slope):
    the README's "Not seen" list names this only for *fused* members; with
    cuda_graph=True (fuse=False) it is equally unseen: _CudaGraphs checks parameter and
    buffer slots and hook dicts (_look/_unchanged), never module attributes.
(b) A non-tensor argument keyed by identity (_lookup: extra = _value_key(v), i.e. hash
    and == of the object; a plain class instance hashes by id) whose attribute is
    mutated between calls: the graph replays the old value.
Expected (correct library): outputs equal eager's after the change, or the limitation is
documented for graphed (not only fused) branches.
"""
import os
import sys
import warnings

import torch
from torch import nn

NAME = "baked_python_values"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")


class Cfg:
    def __init__(self, scale: float) -> None:
        self.scale = scale


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x, cfg):
        return self.lin(x) * cfg.scale


def main():
    from parallel_modules import Parallel

    problems = []
    torch.manual_seed(0)
    branches = [nn.Sequential(nn.Linear(32, 32), nn.LeakyReLU(0.1)), nn.Linear(32, 32)]
    blk = Parallel(*[b.to(DEV) for b in branches], cuda_graph=True, fuse=False)
    x = torch.randn(8, 32, device=DEV)
    with torch.no_grad():
        blk(x)
        blk(x)
        blk[0][1].negative_slope = 0.5
        want = torch.cat([b(x) for b in branches], 1)
        got = blk(x)
    if not torch.equal(got, want):
        problems.append("(a) LeakyReLU.negative_slope changed after capture: graph replays the old slope")

    s = [Scaled().to(DEV), Scaled().to(DEV)]
    blk = Parallel(*s, cuda_graph=True)
    cfg = Cfg(1.0)
    with torch.no_grad():
        blk(x, cfg)
        blk(x, cfg)
        cfg.scale = 3.0
        want = torch.cat([m(x, cfg) for m in s], 1)
        got = blk(x, cfg)
    if not torch.equal(got, want):
        problems.append("(b) attribute of a non-tensor argument mutated after capture: graph replays the old value")
    if problems:
        return False, "; ".join(problems)
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
