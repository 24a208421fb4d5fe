"""A TorchDispatchMode active around a call of a block already captured (FlopCounterMode).

_CudaGraphs.__call__ runs eagerly under compilers, functorch transforms, saved-tensor
hooks, backward and forward-mode AD, but not under an active Python dispatch mode
(FlopCounterMode for MFU, DebugMode, user TorchDispatchModes); the replay launches the
graph and the mode sees only the copy-in and the output clone. FlopCounterMode reports
no matmul FLOPs for the block. Expected (correct library): the same FLOP count as the
eager block (run eagerly while a dispatch mode is active, as for functorch).
"""
import os
import sys
import warnings

import torch
from torch import nn

NAME = "key_dispatch_mode"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")


def main():
    from torch.utils.flop_counter import FlopCounterMode

    from parallel_modules import Parallel

    torch.manual_seed(0)
    branches = [nn.Linear(256, 256).to(DEV), nn.Sequential(nn.Linear(256, 256), nn.ReLU()).to(DEV)]
    blk = Parallel(*branches, cuda_graph=True)
    ref = Parallel(*branches, cuda_graph=False)
    x = torch.randn(64, 256, device=DEV)
    with torch.no_grad():
        blk(x)
        blk(x)  # captured and replayed
        with FlopCounterMode(display=False) as fe:
            ref(x)
        with FlopCounterMode(display=False) as fg:
            y = blk(x)
        ok_values = torch.equal(y, torch.cat([b(x) for b in branches], 1))
    want, got = fe.get_total_flops(), fg.get_total_flops()
    if want == 0:
        return False, "harness: eager FLOP count is 0"
    if got != want or not ok_values:
        return False, f"FlopCounterMode counted {got} FLOPs for the graphed block, {want} for eager (values ok: {ok_values})"
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
