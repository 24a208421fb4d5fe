"""A pinned CPU input (copy lane issued whole, ahead of the stages) and a stage that raises on
micro-batch 1 of 3: the error names the stage and the micro-batch, every lane is joined, the
caller's stream and the pool are restored, and the next call is correct. (The CUDA test of this
uses a CUDA input only.) Expected: PASS."""
import torch
from torch import nn

from _common import Sleep, clean, need_cuda, report
from parallel_modules import ParallelSequential

NAME = "host_pinned_stage_error_recovers"
need_cuda(NAME)


class Boom(nn.Module):
    armed = True

    def forward(self, x):
        if self.armed and x.shape[0] == 4:  # pieces of 13 in 3: 5, 4, 4
            raise KeyError("boom")
        return x


torch.manual_seed(0)
boom = Boom()
model = ParallelSequential(nn.Sequential(Sleep(), nn.Linear(32, 32)), nn.Sequential(Sleep(), boom), nn.Linear(32, 8),
                           chunks=3).cuda()
problems = []
for pinned in (True, False):
    boom.armed = True
    x = torch.randn(13, 32)
    x = x.pin_memory() if pinned else x
    try:
        with torch.no_grad():
            model(x)
        problems.append(f"pinned={pinned}: no error")
    except KeyError as e:
        notes = "\n".join(getattr(e, "__notes__", [])) + str(e)  # (3.10: appended to the message)
        if "stage '1' (index 1) on micro-batch 1 of 3" not in notes:
            problems.append(f"pinned={pinned}: note does not name the stage/micro-batch: {notes!r}")
    why = clean()
    if why:
        problems.append(f"pinned={pinned}: {why}")
    boom.armed = False
    with torch.no_grad():
        out = model(x)
        ref = torch.cat([nn.Sequential(*model)(p) for p in x.cuda().tensor_split(3)])
    if not torch.equal(out, ref):
        problems.append(f"pinned={pinned}: wrong result after the error")
report(NAME, problems)
