"""A setting of a NESTED block changed after the enclosing graphed block captured it.

README ("Changes after the first call"): a block's own settings set later (block.join =
"sum", ...) are seen and its CUDA graphs made anew. _watch._change_setting resets only
that block (pops *its* _graphs); nothing is registered, so the enclosing graphed block
(whose graph recorded the inner block eagerly) sees no change: its _tree is unchanged,
_CudaGraphs._unchanged checks only parameter/buffer slots and hook dicts, and
Parallel.forward compares only its *own* _param_moves. (c) inner.join "sum" -> "mean":
the outer graph keeps summing. (d) inner.fuse False -> True stacks the inner branches'
parameters into new memory (_Group.bind: t.data = stacked[i]; checked on CPU: data_ptr
moves, _watch._changes does not): the outer graph keeps reading the old memory (kept
alive), so later in-place updates -- optimizer steps -- never reach it.
Expected (correct library): outer output equals eager after each change.
"""
import os
import sys
import warnings

import torch
from torch import nn

NAME = "nested_block_setting"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")


def main():
    from parallel_modules import Parallel

    problems = []
    torch.manual_seed(0)
    inner = Parallel(nn.Linear(32, 32), nn.Linear(32, 32), join="sum").to(DEV)
    side = nn.Linear(32, 32).to(DEV)
    outer = Parallel(inner, side, cuda_graph=True)
    x = torch.randn(8, 32, device=DEV)

    def want():
        return torch.cat([inner(x), side(x)], 1)

    with torch.no_grad():
        outer(x)
        outer(x)
        inner.join = "mean"
        w = want()
        got = outer(x)
        if not torch.equal(got, w):
            problems.append("(c) inner.join changed: outer graph replays the old join")
        inner.join = "sum"
        outer(x)
        outer(x)
        inner.fuse = True
        with torch.no_grad():
            for p in inner.parameters():
                p.mul_(0.5)  # an optimizer step after the change
        w = want()
        got = outer(x)
        if not torch.equal(got, w):
            problems.append("(d) inner.fuse set and weights updated: outer graph reads the pre-fusion memory")
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
