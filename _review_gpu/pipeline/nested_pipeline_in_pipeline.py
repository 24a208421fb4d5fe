"""A ParallelSequential (chunks=2) as a stage of a ParallelSequential (chunks=3), with delays in
both: its lanes fork from the outer lane's stream, take events after the outer call's, and must
join back before the outer lane records its event. Output bitwise equal to the stages run
piece by piece; gradients equal within fp32 tolerance. (Not covered by tests/test_pipeline_cuda.py.)
Expected: PASS."""
import torch
from torch import nn

from _common import Sleep, clean, need_cuda, report
from parallel_modules import ParallelSequential

NAME = "nested_pipeline_in_pipeline"
need_cuda(NAME)
torch.manual_seed(0)
inner = ParallelSequential(nn.Sequential(Sleep(), nn.Linear(32, 32)),
                           nn.Sequential(nn.Linear(32, 32), nn.GELU(), Sleep()), chunks=2)
model = ParallelSequential(nn.Linear(16, 32), inner, nn.Sequential(Sleep(), nn.Linear(32, 8)), chunks=3).cuda()
plain_inner = nn.Sequential(*inner)


def reference(x):
    outs = []
    for p in x.tensor_split(3):
        h = model[0](p)
        h = torch.cat([plain_inner(q) for q in h.tensor_split(2)])
        outs.append(model[2](h))
    return torch.cat(outs)


problems = []
for it in range(3):
    for grad in (False, True):
        x = torch.randn(13, 16, device="cuda")
        x1, x2 = x.clone().requires_grad_(grad), x.clone().requires_grad_(grad)
        w = torch.randn(13, 8, device="cuda")
        with torch.set_grad_enabled(grad):
            out = model(x1)
            ref = reference(x2)
        if not torch.equal(out.detach(), ref.detach()):
            problems.append(f"iter {it} grad={grad}: outputs differ, max {(out - ref).abs().max().item():.3g}")
        if grad:
            model.zero_grad()
            g1 = torch.autograd.grad((out * w).sum(), [x1, *model.parameters()])
            g2 = torch.autograd.grad((ref * w).sum(), [x2, *model.parameters()])
            worst = max((a - b).abs().max().item() for a, b in zip(g1, g2))
            if worst > 1e-4:
                problems.append(f"iter {it}: gradients differ by {worst:.3g}")
        why = clean()
        if why:
            problems.append(f"iter {it} grad={grad}: {why}")
report(NAME, problems)
