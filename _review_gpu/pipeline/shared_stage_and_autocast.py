"""One Linear used by two stages (tied weights, lanes 0 and 2) in training, and the same under
CUDA autocast (the cast cache is per thread, not per stream: the later stage reads the cast the
earlier lane made): gradients equal nn.Sequential within tolerance, autocast outputs bitwise equal
to the stages run piece by piece. Expected: PASS."""
import torch
from torch import nn

from _common import Sleep, clean, need_cuda, report
from parallel_modules import ParallelSequential

NAME = "shared_stage_and_autocast"
need_cuda(NAME)
torch.manual_seed(0)
tied = nn.Linear(32, 32)
model = ParallelSequential(tied, nn.Sequential(Sleep(), nn.GELU()), nn.Sequential(Sleep(), tied), chunks=4).cuda()
plain = nn.Sequential(*model)
problems = []
for it in range(2):
    x = torch.randn(16, 32, device="cuda")
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g1 = torch.autograd.grad(model(x1).square().sum(), [x1, tied.weight, tied.bias])
    g2 = torch.autograd.grad(plain(x2).square().sum(), [x2, tied.weight, tied.bias])
    worst = max((a - b).abs().max().item() / (b.abs().max().item() + 1e-6) for a, b in zip(g1, g2))
    if worst > 1e-4:
        problems.append(f"iter {it}: tied-weight gradients differ (relative {worst:.3g})")
    for dtype in (torch.float16, torch.bfloat16):
        with torch.autocast("cuda", dtype=dtype), torch.no_grad():
            out = model(x)
            ref = torch.cat([plain(p) for p in x.tensor_split(4)])
        if out.dtype != ref.dtype or not torch.equal(out, ref):
            problems.append(f"iter {it} autocast {dtype}: differs from the pieces run in order")
    why = clean()
    if why:
        problems.append(f"iter {it}: {why}")
report(NAME, problems)
