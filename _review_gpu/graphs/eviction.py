"""LRU eviction (max_graphs=1) while something from the evicted graph is still in use.

(a) Training: blk(xA), blk(xB), blk(xA2) before one backward, max_graphs=1: each call
    captures and evicts the previous graph (_CudaGraphs._insert pops it; "frees the graph
    and, with it, its pool") while its autograd node still needs the backward graph, the
    saved activations in its pool and its static buffers (allocated on the capture
    stream, whose blocks the next capture may reuse). Also gen/bwd_gen bookkeeping
    across distinct _Graph objects of one signature.
(b) Inference: a lent output (the graph's own buffer) kept by the caller while its graph
    is evicted and two new graphs are captured (torch.cuda.graph empties the cache) and
    other memory is churned: the kept tensor must keep its values.
Expected (correct library): (a) gradients equal eager's; (b) the kept output unchanged.
"""
import copy
import os
import sys
import warnings

import torch
from torch import nn

NAME = "eviction"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")


def branches():
    torch.manual_seed(0)
    return [nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))]


def main():
    from parallel_modules import Parallel

    problems = []
    b = branches()
    ref = Parallel(*copy.deepcopy(b)).to(DEV)
    blk = Parallel(*b, cuda_graph=True, max_graphs=1).to(DEV)
    for it in range(3):
        xa, xb, xa2 = (torch.randn(8, 64, device=DEV), torch.randn(16, 64, device=DEV),
                       torch.randn(8, 64, device=DEV))
        ws = [torch.randn(n, 128, device=DEV) for n in (8, 16, 8)]
        for m in (ref, blk):
            m.zero_grad(set_to_none=True)
            ya, yb, ya2 = m(xa), m(xb), m(xa2)
            junk = [torch.randn(1 << 16, device=DEV) for _ in range(8)]  # churn the allocator
            del junk
            ((ya * ws[0]).sum() + (yb * ws[1]).sum() + (ya2 * ws[2]).sum()).backward()
        for (n, p), q in zip(blk.named_parameters(), ref.parameters()):
            if p.grad is None or not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6):
                problems.append(f"(a) it{it} {n}.grad differs")
                break
    # (b)
    b = branches()
    blk = Parallel(*[m.to(DEV) for m in b], cuda_graph=True, max_graphs=1)
    with torch.no_grad():
        for _ in range(6):
            blk(torch.randn(8, 64, device=DEV))  # outputs dropped at once: lending starts
        lent = any(g.lending.lent for g in blk._graphs._graphs.values())
        xa = torch.randn(8, 64, device=DEV)
        kept = blk(xa)
        want = torch.cat([m(xa) for m in b], 1)
        blk(torch.randn(16, 64, device=DEV))  # evicts the graph that lent `kept`
        blk(torch.randn(4, 64, device=DEV))
        junk = [torch.full((1 << 18,), 7.0, device=DEV) for _ in range(16)]
        del junk
        blk(torch.randn(8, 64, device=DEV))
        if DEV == "cuda":
            torch.cuda.synchronize()
        if not torch.equal(kept, want):
            problems.append(f"(b) output kept across eviction changed (lent={lent})")
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
