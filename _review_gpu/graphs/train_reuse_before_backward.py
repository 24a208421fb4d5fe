"""Training: one graphed block used several times before one backward (weight sharing).

A training graph keeps one set of activations per signature (_Replay.forward bumps
graph.gen; _Replay.backward refuses when ctx.gen != graph.gen, and refuses a second
backward through the same call). Ordinary autograd patterns therefore raise where eager
works: (a) a block applied repeatedly, h = blk(blk(blk(x))) (iterative refinement,
recurrent use; calls 2 and 3 share a signature), (b) a Siamese / contrastive pair
blk(x1), blk(x2) before one loss, (c) two losses backpropagated with retain_graph=True.
Neither README nor DESIGN lists this limit (only the runtime error message does).
Expected (correct library): gradients equal eager's (e.g. run the conflicting call
eagerly, as _Lending does for held outputs).
"""
import copy
import os
import sys
import warnings

import torch
from torch import nn

NAME = "train_reuse_before_backward"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")


def case_repeat(m, x, g):
    (m(m(m(x))) * g).sum().backward()


def case_siamese(m, x, g):
    z1, z2 = m(x), m(x.flip(0) * 0.5)
    ((z1 * z2) * g).sum().backward()


def case_retain(m, x, g):
    y = m(x)
    (y * g).sum().backward(retain_graph=True)
    (y.square()).sum().backward()


def main():
    from parallel_modules import Parallel

    problems = []
    for name, case in (("repeat", case_repeat), ("siamese", case_siamese), ("retain_graph", case_retain)):
        torch.manual_seed(0)
        branches = [nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 64), nn.Tanh())]
        ref = Parallel(*copy.deepcopy(branches), join="sum").to(DEV)
        blk = Parallel(*branches, join="sum", cuda_graph=True).to(DEV)
        try:
            for it in range(3):
                x = torch.randn(16, 64, device=DEV)
                g = torch.randn(16, 64, device=DEV)
                for m in (ref, blk):
                    m.zero_grad(set_to_none=True)
                    case(m, x, g)
                for (n, p), q in zip(blk.named_parameters(), ref.parameters()):
                    if p.grad is None or not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6):
                        raise AssertionError(f"it{it} {n}.grad differs")
        except Exception as e:  # noqa: BLE001
            msg = str(e).strip().splitlines()
            problems.append(f"{name}: {type(e).__name__}: {msg[0][:140] if msg else ''}")
    if problems:
        return False, " | ".join(problems)
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
