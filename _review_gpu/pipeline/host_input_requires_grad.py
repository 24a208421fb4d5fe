"""A CPU input that requires grad, copied to the GPU by the copy lane (pageable: staged into pinned
memory piece by piece; pinned: the copy lane issued whole first). Its .grad must equal the one of
the same input moved to the GPU first; outputs bitwise equal. (tests cover parameter gradients only.)
Expected: PASS."""
import torch
from torch import nn

from _common import Sleep, clean, need_cuda, report
from parallel_modules import ParallelSequential

NAME = "host_input_requires_grad"
need_cuda(NAME)
torch.manual_seed(0)
model = ParallelSequential(nn.Sequential(Sleep(), nn.Linear(32, 32)), nn.GELU(), nn.Linear(32, 8), chunks=3).cuda()
problems = []
for pinned in (False, True):
    for it in range(2):
        base = torch.randn(13, 32)
        w = torch.randn(13, 8, device="cuda")
        xh = (base.pin_memory() if pinned else base.clone()).requires_grad_()
        out = model(xh)
        (out * w).sum().backward()
        xd = base.cuda().requires_grad_()
        ref = model(xd)
        (ref * w).sum().backward()
        torch.cuda.synchronize()
        label = f"pinned={pinned} iter {it}"
        if not torch.equal(out.detach(), ref.detach()):
            problems.append(f"{label}: outputs differ")
        if xh.grad is None:
            problems.append(f"{label}: the CPU input got no gradient")
        elif not torch.allclose(xh.grad, xd.grad.cpu(), rtol=1e-5, atol=1e-5):
            problems.append(f"{label}: input gradient differs by {(xh.grad - xd.grad.cpu()).abs().max().item():.3g}")
        why = clean()
        if why:
            problems.append(f"{label}: {why}")
report(NAME, problems)
