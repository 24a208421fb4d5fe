"""Training a graphed block with nn.Embedding(sparse=True) (sparse COO weight gradient).

The backward capture post-processes gradients with _in_layout (_graphs.py), which for a
gradient whose strides differ from the parameter's does torch.empty_like(t).copy_(g):
for a sparse COO gradient that raises ("copy_() between dense and sparse Tensors is not
implemented", checked on CPU), reported as a misleading "CUDA graph capture of the
backward pass failed ... must not synchronise with the host". _GradCopies / _hand_out
also assume dense gradients. Eager training works. Expected (correct library): gradients
equal eager's, or the signature runs eagerly with a clear message.
"""
import copy
import os
import sys
import warnings

import torch
from torch import nn

NAME = "sparse_embedding_grad"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")


def main():
    from parallel_modules import Parallel

    torch.manual_seed(0)
    branches = [nn.Sequential(nn.Embedding(1000, 16, sparse=True), nn.Flatten()),
                nn.Sequential(nn.Embedding(1000, 16), nn.Flatten())]
    ref = Parallel(*copy.deepcopy(branches)).to(DEV)
    blk = Parallel(*branches, cuda_graph=True).to(DEV)
    for it in range(3):
        idx = torch.randint(0, 1000, (8, 4), device=DEV)
        g = torch.randn(8, 128, device=DEV)
        for m in (ref, blk):
            m.zero_grad(set_to_none=True)
        (ref(idx) * g).sum().backward()
        try:
            (blk(idx) * g).sum().backward()
        except Exception as e:  # noqa: BLE001
            msg = str(e).strip().splitlines()
            return False, f"it{it}: {type(e).__name__}: {' / '.join(m_[:150] for m_ in msg[:3])}"
        for (n, p), q in zip(blk.named_parameters(), ref.parameters()):
            gp = p.grad.to_dense() if p.grad is not None and p.grad.is_sparse else p.grad
            gq = q.grad.to_dense() if q.grad.is_sparse else q.grad
            if gp is None or not torch.allclose(gp, gq, atol=1e-6):
                return False, f"it{it}: {n}.grad differs"
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
