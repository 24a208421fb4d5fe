"""Does a high-priority stream for the critical branch shorten a multi-stream graph? (dev tool, not shipped)

PyTorch instantiates CUDA graphs with ``cudaGraphInstantiateFlagUseNodePriority``: a
kernel captured on a high-priority stream keeps that priority at replay, so the
longest branch could be scheduled first when branches contend for SMs. Captures the
Inception block by hand with ``Parallel(streams=True)`` inside, one variant per choice
of high-priority side stream, and times the replays interleaved.
Usage: ``PYTHONPATH=. python3 tools/exp_priority.py [b1-fp32 b1-fp16 b8-fp32 ...]``
"""
import sys

import torch

from parallel_modules import Parallel, _streams
from parallel_modules._cases import CASES, SequentialBranches as Seq
from parallel_modules.bench import _capture
from _timing import gpu_medians  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
DEV, INCEPTION = torch.device("cuda"), CASES["inception"]
LOW, HIGH = torch.cuda.Stream.priority_range()  # (least, greatest): numerically LOW > HIGH


def with_side_streams(priorities):
    r"""Make the capture pool's first side streams have ``priorities`` (branch 1, 2, ...)."""
    pool = _streams._pool(DEV, True)
    pool.streams = [torch.cuda.Stream(DEV, priority=p) for p in priorities] + [torch.cuda.Stream(DEV)]
    pool.ids = {s.stream_id for s in pool.streams}


def run(batch, dtype):
    x = torch.randn(batch, 192, 35, 35, device="cuda", dtype=dtype)
    block = Parallel(*INCEPTION.branches(DEV, dtype), streams=True)
    seq = Seq(list(block))
    variants = {"graph seq": _capture(seq, x)}
    n = len(block) - 1
    for name, prio in [("all normal", [LOW] * n), *[(f"branch {k + 1} high", [HIGH if i == k else LOW for i in range(n)])
                                                   for k in range(n)], ("all side high", [HIGH] * n)]:
        with_side_streams(prio)
        variants[name] = _capture(block, x)
    with_side_streams([LOW] * n)
    graphed = Parallel(*INCEPTION.branches(DEV, dtype), cuda_graph=True)
    variants["Parallel(cuda_graph=True)"] = graphed
    with torch.no_grad():
        graphed(x)  # captures
    replay = next(iter(graphed._graphs._graphs.values())).fwd.replay
    variants["its graph's replay() alone"] = lambda x: replay()
    with torch.no_grad():
        ref = seq(x)
        for name, m in variants.items():
            out = m(x)
            assert out is None or torch.equal(out, ref) or dtype != torch.float32, name
        times = gpu_medians({name: (lambda m=m: m(x)) for name, m in variants.items()}, rounds=40)
    for name, t in times.items():
        print(f"b{batch} {str(dtype)[6:]:<8} {name:<26} {t:8.1f} us  graph seq/this {times['graph seq'] / t:.2f}x")


CONFIGS = {"b1-fp32": (1, torch.float32), "b1-fp16": (1, torch.float16), "b8-fp32": (8, torch.float32),
           "b8-fp16": (8, torch.float16)}
for key in sys.argv[1:] or CONFIGS:
    run(*CONFIGS[key])
