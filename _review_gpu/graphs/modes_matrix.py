"""Modes switched between calls of one input shape: each must pick (or capture) the right graph.

_CudaGraphs._key keys: grad mode (in _signature), inference mode, cuda autocast
enabled+dtype, owner.training, each non-_MODE_FREE child's training flag, requires_grad
of every parameter (only while grad is on), TF32. A block with BatchNorm (statistics
updated in train mode, restored after warm-up) and a Linear/GELU branch is called through
a sequence of contexts -- fp32, autocast fp16, autocast bf16, fp32 again, inference_mode,
enable_grad, child BN.eval(), owner eval(), back to train, a branch frozen under grad,
unfrozen -- and compared with an eager twin after every call: output bits, dtype,
requires_grad, and the BatchNorm buffers. Expected (correct library): all equal.
"""
import contextlib
import copy
import os
import sys
import warnings

import torch
from torch import nn

NAME = "modes_matrix"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")


def main():
    from parallel_modules import Parallel

    torch.manual_seed(0)
    branches = [nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU()),
                nn.Sequential(nn.Linear(32, 32), nn.GELU()), nn.Linear(32, 32)]
    ref = Parallel(*copy.deepcopy(branches)).to(DEV)
    blk = Parallel(*branches, cuda_graph=True).to(DEV)
    low = [torch.float16, torch.bfloat16] if DEV == "cuda" else [torch.bfloat16]

    def both(fn):
        fn(blk), fn(ref)

    plan = [("fp32 no_grad", torch.no_grad, None)]
    plan += [(f"autocast {d}", (lambda d=d: _stack(torch.no_grad(), torch.autocast(DEV, dtype=d))), None) for d in low]
    plan += [("fp32 no_grad again", torch.no_grad, None),
             ("inference_mode", torch.inference_mode, None),
             ("enable_grad", torch.enable_grad, None),
             ("child BN eval (no_grad)", torch.no_grad, lambda m: m[0][1].eval()),
             ("child BN eval (grad)", torch.enable_grad, None),
             ("owner eval", torch.no_grad, lambda m: m.eval()),
             ("owner train", torch.no_grad, lambda m: m.train()),
             ("branch 2 frozen (grad)", torch.enable_grad, lambda m: m[2].requires_grad_(False)),
             ("branch 2 frozen (autocast, grad)", lambda: torch.autocast(DEV, dtype=low[0]), None),
             ("unfrozen (grad)", torch.enable_grad, lambda m: m[2].requires_grad_(True)),
             ("fp32 no_grad last", torch.no_grad, None)]
    problems = []
    for label, ctx, change in plan:
        if change is not None:
            both(change)
        for rep in range(2):
            x = torch.randn(16, 32, device=DEV)
            with ctx():
                yg = blk(x)
                ye = ref(x)
            tag = f"{label}#{rep}"
            if yg.dtype != ye.dtype or yg.requires_grad != ye.requires_grad:
                problems.append(f"{tag}: {yg.dtype}/rg={yg.requires_grad} vs eager {ye.dtype}/rg={ye.requires_grad}")
            elif not torch.equal(yg.detach(), ye.detach()):
                problems.append(f"{tag}: output differs (max {(yg.detach() - ye.detach()).float().abs().max().item():.3g})")
            for (n, b), c in zip(blk.named_buffers(), ref.buffers()):
                if not torch.equal(b, c):
                    problems.append(f"{tag}: buffer {n} differs")
                    break
    if problems:
        return False, "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
    return True, ""


@contextlib.contextmanager
def _stack(*cms):
    with contextlib.ExitStack() as st:
        for c in cms:
            st.enter_context(c)
        yield


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
