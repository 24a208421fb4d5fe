"""The user captures an eager ParallelSequential(chunks=3) in torch.cuda.graph (as for any module;
_capture_underway() is meant to see 'the user's' capture): capture must succeed, replays on new
data must equal the stages run piece by piece, and eager calls afterwards still work.
Expected: PASS."""
import torch
from torch import nn

from _common import clean, need_cuda, report
from parallel_modules import ParallelSequential

NAME = "user_capture_eager_pipeline"
need_cuda(NAME)
torch.manual_seed(0)
model = ParallelSequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8), chunks=3).cuda().eval()
plain = nn.Sequential(*model)
problems = []
static_x = torch.randn(13, 32, device="cuda")
try:
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                model(static_x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_y = model(static_x)
        for it in range(3):
            static_x.copy_(torch.randn(13, 32, device="cuda"))
            g.replay()
            torch.cuda.synchronize()
            ref = torch.cat([plain(p) for p in static_x.tensor_split(3)])
            if not torch.equal(static_y, ref):
                problems.append(f"replay {it}: differs by {(static_y - ref).abs().max().item():.3g}")
                break
        x = torch.randn(13, 32, device="cuda")
        if not torch.equal(model(x), torch.cat([plain(p) for p in x.tensor_split(3)])):
            problems.append("eager call after the capture differs")
except Exception as e:  # noqa: BLE001
    problems.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
why = clean()
if why:
    problems.append(why)
report(NAME, problems)
