"""Forward/backward hooks with Python side effects on a branch's layer (feature taps, grad monitors).

_CudaGraphs._look records the hook dicts below the owner and only recaptures when they
change; the hooks themselves run during the 3 warm-up calls and the capture and are
"baked into the graphs" -- on replays their Python code never runs. A hook that appends
activations (feature extraction, Grad-CAM, activation statistics) or counts backward
calls silently stops (and ran 4 extra times at capture). The README's "Changes after the
first call" / "CUDA graphs" bullets mention hooks registered or removed, not that hooks
stop running. Expected (correct library): the hook runs once per call with that call's
values (or the block refuses / runs eagerly while hooks with side effects exist).
"""
import copy
import os
import sys
import warnings

import torch
from torch import nn

NAME = "child_hook_side_effects"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")


def make(graph, branches):
    from parallel_modules import Parallel

    return Parallel(*copy.deepcopy(branches), cuda_graph=graph).to(DEV)


def main():
    torch.manual_seed(0)
    branches = [nn.Sequential(nn.Linear(32, 32), nn.ReLU()), nn.Linear(32, 32)]
    problems = []
    # Forward hook collecting a layer's activations, inference.
    for graph in (True, False):
        blk = make(graph, branches)
        seen = []
        blk[0][0].register_forward_hook(lambda m, i, o, seen=seen: seen.append(o.detach().clone()))
        torch.manual_seed(1)
        xs = [torch.randn(8, 32, device=DEV) for _ in range(5)]
        with torch.no_grad():
            for x in xs:
                blk(x)
            n = len(seen)
            snapshot = [s.clone() for s in seen]
            expect = [blk[0][0](x) for x in xs]
        if graph:
            ok = n == len(xs) and all(torch.equal(s, e) for s, e in zip(snapshot, expect))
            if not ok:
                match = sum(any(torch.equal(s, e) for s in snapshot) for e in expect)
                problems.append(f"forward hook ran {n} times for {len(xs)} calls; {match}/{len(xs)} calls' "
                                f"activations were recorded")
        elif n != len(xs):
            return False, f"harness: eager forward hook ran {n} times for {len(xs)} calls"
    # Full backward hook on a layer: record the output gradient of each backward pass.
    # (6 passes: warm-up and capture alone run the hook 4 times in the first call.)
    recorded = {}
    for graph in (True, False):
        blk = make(graph, branches)
        calls = recorded[graph] = []
        blk[1].register_full_backward_hook(lambda m, gi, go, calls=calls: calls.append(go[0].detach().clone()))
        torch.manual_seed(2)
        for _ in range(6):
            x = torch.randn(8, 32, device=DEV)
            blk(x).square().sum().backward()
        recorded[graph] = [c.clone() for c in calls]
    if len(recorded[False]) != 6:
        return False, f"harness: eager backward hook ran {len(recorded[False])} times"
    got, want = recorded[True], recorded[False]
    if len(got) != len(want) or not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want)):
        match = sum(any(torch.allclose(a, b, atol=1e-6) for a in got) for b in want)
        problems.append(f"full backward hook ran {len(got)} times for 6 backward passes; {match}/6 passes' "
                        f"gradients were recorded")
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
