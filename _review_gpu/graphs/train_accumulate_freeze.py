"""Training-loop state around graphed backward: accumulation, zero_grad modes, freezing, held .grad.

_hand_out / _GradCopies.reused (_graphs.py) write parameter gradients into .grad
themselves on a plain backward(): one add when every .grad is set, refilled copies
handed out last time when every .grad is None and "nothing holds them" (judged by
sys.getrefcount / storage use counts), fresh copies otherwise. Checked against an
eager twin, with direct_grads False and True: accumulation over two backward() calls
without zero_grad; zero_grad(set_to_none=False); a .grad tensor the user keeps across
zero_grad(set_to_none=True) (must not be refilled in place); freezing a branch after
capture (requires_grad in the key -> new graph; frozen .grad untouched) and unfreezing
(back to the first graph); backward(inputs=[...]) (direct_grads=False only, as documented);
SGD with momentum over all steps.
Expected (correct library): every .grad and final parameter allclose (1e-5) to eager.
"""
import copy
import os
import sys
import warnings

import torch
from torch import nn

NAME = "train_accumulate_freeze"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")


def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def run(direct):
    from parallel_modules import Parallel

    torch.manual_seed(0)
    branches = [nn.Linear(32, 32), nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)), nn.Linear(32, 32)]
    ref = Parallel(*copy.deepcopy(branches)).to(DEV)
    blk = Parallel(*branches, cuda_graph=True, direct_grads=direct).to(DEV)
    opt = torch.optim.SGD(blk.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    names = [n for n, _ in blk.named_parameters()]
    problems = []

    def step(tag, inputs=None):
        x = torch.randn(8, 32, device=DEV)
        g = torch.randn(8, 96, device=DEV)
        for m in (blk, ref):
            loss = (m(x) * g).sum()
            if inputs is None:
                loss.backward()
            else:
                loss.backward(inputs=inputs(m))
        for n, p, q in zip(names, blk.parameters(), ref.parameters()):
            if not same(p.grad, q.grad):
                problems.append(f"{tag}: {n}.grad {'None' if p.grad is None else 'differs'}"
                                f"{'' if q.grad is not None else ' (eager: None)'}")
                return

    step("first")
    step("accumulate")
    opt.step(), opt_ref.step()
    opt.zero_grad(set_to_none=False), opt_ref.zero_grad(set_to_none=False)
    step("after zero_grad(set_to_none=False)")
    opt.step(), opt_ref.step()
    opt.zero_grad(), opt_ref.zero_grad()
    step("refill")
    held = [p.grad for p in blk.parameters()]
    held_values = [h.clone() for h in held]
    opt.step(), opt_ref.step()
    opt.zero_grad(), opt_ref.zero_grad()
    step("while user holds old .grad")
    if not all(torch.equal(h, v) for h, v in zip(held, held_values)):
        problems.append("a .grad tensor kept by the user across zero_grad() was overwritten by a later backward")
    del held
    opt.step(), opt_ref.step()
    opt.zero_grad(), opt_ref.zero_grad()
    blk[0].requires_grad_(False), ref[0].requires_grad_(False)
    step("branch 0 frozen")
    opt.step(), opt_ref.step()
    blk[0].requires_grad_(True), ref[0].requires_grad_(True)
    opt.zero_grad(set_to_none=False), opt_ref.zero_grad(set_to_none=False)
    step("unfrozen")
    step("unfrozen, accumulate")
    opt.step(), opt_ref.step()
    opt.zero_grad(), opt_ref.zero_grad()
    if not direct:  # (with direct_grads, backward(inputs=params) is documented to leave .grad alone)
        step("backward(inputs=branch 1)", inputs=lambda m: list(m[1].parameters()))
    opt.step(), opt_ref.step()
    for n, p, q in zip(names, blk.parameters(), ref.parameters()):
        if not torch.allclose(p, q, rtol=1e-5, atol=1e-6):
            problems.append(f"final parameter {n} differs")
            break
    return problems


def main():
    problems = []
    for direct in (False, True):
        problems += [f"direct_grads={direct}: {p}" for p in run(direct)]
    if problems:
        return False, "; ".join(problems[:4])
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
