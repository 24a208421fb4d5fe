"""Global kernel-selection flags changed after capture (beyond TF32, which is keyed).

_CudaGraphs._key includes _tf32() (the fp32 precision settings) "since kernels are chosen
when captured", but not the other process-wide flags that choose kernels and change
results: torch.backends.cuda.matmul.allow_fp16_accumulation,
allow_fp16_reduced_precision_reduction, and the SDPA backend selection
(torch.nn.attention.sdpa_kernel / enable_flash_sdp ...). A graph captured under the old
setting replays the old kernels. Each sub-case first checks that eager results really
change with the flag (else it is skipped as not discriminating). Expected (correct
library): graphed output equals eager's under the new setting, bit for bit.
"""
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

NAME = "key_backend_flags"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")


class Attn(nn.Module):
    def __init__(self, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal

    def forward(self, x):
        b, n, e = x.shape
        q = x.view(b, n, self.heads, e // self.heads).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, q * 0.5, q, is_causal=self.causal)
        return o.transpose(1, 2).reshape(b, n, e)


def check(blk, branches, x, setter, restore, label, problems, skipped):
    def ref():
        return torch.cat([b(x) for b in branches], -1)

    with torch.no_grad():
        blk(x)
        blk(x)
        before = ref()
        try:
            ctx = setter()
        except Exception as e:  # noqa: BLE001
            skipped.append(f"{label} (cannot set: {type(e).__name__})")
            return
        try:
            after = ref()
            got = blk(x).clone()
        finally:
            restore(ctx)
    if torch.equal(before, after):
        skipped.append(f"{label} (eager unchanged)")
        return
    if not torch.equal(got, after):
        stale = torch.equal(got, before)
        problems.append(f"{label}: graphed output differs from eager under the new setting"
                        f"{' (equals the old setting: stale kernels)' if stale else ''}")


def main():
    from parallel_modules import Parallel

    if DEV != "cuda":
        return True, ""
    problems, skipped = [], []
    m = torch.backends.cuda.matmul
    torch.manual_seed(0)

    # fp16 GEMM accumulating in fp16 (cuBLASLt) instead of fp32.
    branches = [nn.Linear(4096, 256, bias=False).half().cuda(), nn.Linear(4096, 256, bias=False).half().cuda()]
    x = torch.randn(64, 4096, device="cuda", dtype=torch.half)
    old = getattr(m, "allow_fp16_accumulation", None)

    def set_acc():
        m.allow_fp16_accumulation = True
        return old

    check(Parallel(*branches, join="cat", dim=-1, cuda_graph=True), branches, x, set_acc,
          lambda o: setattr(m, "allow_fp16_accumulation", bool(o)), "allow_fp16_accumulation", problems, skipped)

    # Split-K reductions in reduced precision forbidden.
    branches = [nn.Linear(16384, 64, bias=False).half().cuda(), nn.Linear(16384, 64, bias=False).half().cuda()]
    x = torch.randn(16, 16384, device="cuda", dtype=torch.half)
    old_r = m.allow_fp16_reduced_precision_reduction

    def set_red():
        m.allow_fp16_reduced_precision_reduction = False
        return old_r

    check(Parallel(*branches, join="cat", dim=-1, cuda_graph=True), branches, x, set_red,
          lambda o: setattr(m, "allow_fp16_reduced_precision_reduction", o), "fp16_reduced_precision_reduction",
          problems, skipped)

    # SDPA backend: flash (default on H100) vs math.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    branches = [Attn(4, False), Attn(4, True)]
    x = torch.randn(2, 256, 256, device="cuda", dtype=torch.half)

    def set_math():
        ctx = sdpa_kernel(SDPBackend.MATH)
        ctx.__enter__()
        return ctx

    check(Parallel(*branches, join="cat", dim=-1, cuda_graph=True), branches, x, set_math,
          lambda c: c.__exit__(None, None, None), "sdpa_kernel(MATH)", problems, skipped)

    if skipped:
        print(f"{NAME}: not discriminating here: {', '.join(skipped)}", file=sys.stderr)
    if problems:
        return False, "; ".join(problems) + (f" [skipped: {', '.join(skipped)}]" if skipped else "")
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
