"""Module state changed after capture that the graphs read by address (or must drop).

Graphs read parameters and buffers in place (kept_alive holds the captured tensors), so
in-place updates must show and replacements must recapture. After capture: (1)
load_state_dict (copies in place, BatchNorm running stats included); (2) in-place
p.mul_() under no_grad and p.data.copy_(); (3) copy.deepcopy of the captured block
(__getstate__ drops _graphs) then the copy's weights changed -- original and copy must
each follow their own weights; (4) .cuda() / .to(same device) / .float() again
(_apply -> _reset); (5) one child (Linear+BatchNorm in train mode) shared by two graphed
blocks, statistics updated by both (warm-up snapshots and restores buffers per block);
(6) a ParallelSequential after load_state_dict. Compared with eager twins bit for bit,
BatchNorm buffers included. Expected (correct library): all equal.
"""
import copy
import os
import sys
import warnings

import torch
from torch import nn

NAME = "lifecycle_state"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")


def make_branches():
    return [nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32)), nn.Sequential(nn.Linear(32, 32), nn.Tanh())]


def main():
    from parallel_modules import Parallel, ParallelSequential

    problems = []

    def check(tag, a, b, ma=None, mb=None):
        if not torch.equal(a, b):
            problems.append(f"{tag}: output differs (max {(a - b).abs().max().item():.3g})")
        if ma is not None:
            for (n, x), y in zip(ma.named_buffers(), mb.buffers()):
                if not torch.equal(x, y):
                    problems.append(f"{tag}: buffer {n} differs")
                    break

    torch.manual_seed(0)
    br = make_branches()
    blk = Parallel(*copy.deepcopy(br), cuda_graph=True).to(DEV)
    ref = Parallel(*copy.deepcopy(br)).to(DEV)

    def call(tag, m=blk, r=ref, n=3):
        with torch.no_grad():
            for _ in range(n):
                x = torch.randn(8, 32, device=DEV)
                check(tag, m(x), r(x), m, r)

    call("initial")
    sd = {k: (torch.randn_like(v) if v.is_floating_point() else v) for k, v in ref.state_dict().items()}
    sd = {k: (v.abs() + 0.5 if "running_var" in k else v) for k, v in sd.items()}
    blk.load_state_dict(sd), ref.load_state_dict(sd)
    call("after load_state_dict")
    with torch.no_grad():
        for p, q in zip(blk.parameters(), ref.parameters()):
            p.mul_(0.5), q.mul_(0.5)
        w = torch.randn_like(blk[1][0].weight)
        blk[1][0].weight.data.copy_(w), ref[1][0].weight.data.copy_(w)
    call("after in-place updates")
    twin_g, twin_r = copy.deepcopy(blk), copy.deepcopy(ref)
    with torch.no_grad():
        for p, q in zip(twin_g.parameters(), twin_r.parameters()):
            p.add_(1.0), q.add_(1.0)
    call("deepcopy: copy", twin_g, twin_r)
    call("deepcopy: original")
    blk.cuda() if DEV == "cuda" else blk.cpu()
    call("after .cuda() again")
    blk.to(DEV), blk.float()
    call("after .to(same device) / .float()")

    torch.manual_seed(1)
    shared_g = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32)).to(DEV)
    shared_r = copy.deepcopy(shared_g)
    side = [nn.Linear(32, 32).to(DEV) for _ in range(2)]
    g1, g2 = Parallel(shared_g, side[0], cuda_graph=True), Parallel(shared_g, side[1], cuda_graph=True)
    r1, r2 = Parallel(shared_r, side[0]), Parallel(shared_r, side[1])
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(8, 32, device=DEV)
            check(f"shared child, block 1 call {i}", g1(x), r1(x), shared_g, shared_r)
            check(f"shared child, block 2 call {i}", g2(x), r2(x), shared_g, shared_r)

    torch.manual_seed(2)
    stages = [nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)]
    pg = ParallelSequential(*copy.deepcopy(stages), cuda_graph=True).to(DEV)
    pr = nn.Sequential(*copy.deepcopy(stages)).to(DEV)
    call("pipeline initial", pg, pr)
    sd = {k: torch.randn_like(v) for k, v in pr.state_dict().items()}
    pg.load_state_dict(sd), pr.load_state_dict(sd)
    call("pipeline after load_state_dict", pg, pr)
    if problems:
        return False, "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
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
