"""Last stage copies its output to the host with non_blocking=True (a pinned, asynchronous D2H copy,
the mirror of the library's own H2D lane). nn.Sequential returns that pinned tensor and the caller
synchronizes before reading it. ParallelSequential(chunks>1) concatenates the pieces ON THE HOST
right away (_Gather.add's copy_ without grad, torch.cat in _concat with grad), before the copies
have run: the result is stale/garbage even after torch.cuda.synchronize().
Expected today: FAIL (the two chunks=4 non_blocking variants); controls (blocking .cpu(), chunks=1) pass."""
import torch
from torch import nn

from _common import SLEEP, clean, need_cuda, report
from parallel_modules import ParallelSequential

NAME = "d2h_nonblocking_last_stage"
need_cuda(NAME)


class ToHost(nn.Module):
    def __init__(self, non_blocking: bool) -> None:
        super().__init__()
        self.non_blocking = non_blocking

    def forward(self, x):
        torch.cuda._sleep(5 * SLEEP)  # the copy is queued behind this on the lane's stream
        return x.to("cpu", non_blocking=self.non_blocking)


torch.manual_seed(0)
lin = nn.Linear(32, 32).cuda()
problems, controls = [], []
for chunks, non_blocking, grad in ((4, True, False), (4, True, True), (4, False, False), (1, True, False)):
    model = ParallelSequential(lin, ToHost(non_blocking), chunks=chunks)
    label = f"chunks={chunks} non_blocking={non_blocking} grad={grad}"
    for _ in range(3):
        x = torch.randn(16, 32, device="cuda")
        with torch.no_grad():
            expected = torch.cat([lin(p).cpu() for p in x.tensor_split(chunks)])
        with torch.set_grad_enabled(grad):
            out = model(x)
        torch.cuda.synchronize()  # what a caller of nn.Sequential does before reading a non_blocking D2H result
        if not torch.equal(out.detach(), expected):
            bad = (out.detach() != expected).any(1).sum().item()
            (controls if not (chunks > 1 and non_blocking) else problems).append(
                f"{label}: {bad}/16 rows wrong after synchronize()")
            break
    why = clean()
    if why:
        problems.append(f"{label}: {why}")
if controls:
    problems.append("CONTROL also wrong: " + "; ".join(controls))
report(NAME, problems)
