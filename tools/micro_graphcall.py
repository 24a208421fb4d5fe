"""Where the CPU time of a graphed / fused call goes (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/micro_graphcall.py [CASE]``: per variant, the host time per call
(many calls, then one sync) and the top functions of a cProfile of 2000 calls. With a case name
(default mlp8, at its first batch size), only the inference calls.
"""
import sys

import torch

from parallel_modules import Parallel, ParallelSequential
from parallel_modules._cases import CASES, PIPELINES, SequentialBranches
from _timing import cpu_us, profile  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")


case = CASES[sys.argv[1] if len(sys.argv) > 1 else "mlp8"]
br = case.branches(dev, torch.float32)
x = case.make_input(case.batches[0], dev, torch.float32)
variants = {}
with torch.no_grad():
    variants["eager seq"] = SequentialBranches(br)
    variants["eager fused"] = Parallel(*br, fuse="auto")
    variants["graph Parallel"] = Parallel(*br, cuda_graph=True)
    variants["graph fused"] = Parallel(*br, cuda_graph=True, fuse="auto")
    g = variants["graph fused"]
    for v in variants.values():
        for _ in range(40):
            v(x)
    graph = next(iter(g._graphs._graphs.values()))
    pieces = {"graph fused: _Graph.replay": lambda: graph.replay([x], False),
              "graph fused: fwd.replay() only": lambda: graph.fwd.replay(),
              "graph fused: copy_in only": lambda: graph._copy_in([x])}
    for name, fn in {**{k: (lambda v=v: v(x)) for k, v in variants.items()}, **pieces}.items():
        print(f"{name:<36}{cpu_us(fn):9.2f} us CPU/call")
    profile("graph fused", lambda: g(x))
    profile("eager fused", lambda: variants["eager fused"](x), n=500)
if len(sys.argv) > 1:
    sys.exit(0)

# Training step, graphed.
tcase = CASES["mlp8-train"]
for fuse in (False, True):
    model = Parallel(*tcase.branches(dev, torch.float32), cuda_graph=True, fuse=fuse)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    print(f"train step graph fuse={fuse}: {cpu_us(step, 300):9.2f} us CPU/call")
    profile(f"train step graph fuse={fuse}", step, n=300, top=18)

# Host-to-device pipeline: GPU activity per stream for one call.
pcase = PIPELINES["h2d"]
stages = pcase.stages(dev, torch.float32)
xh = pcase.make_input(64, dev, torch.float32)
with torch.no_grad():
    for chunks in (1, 4):
        model = ParallelSequential(*stages, chunks=chunks)
        for _ in range(10):
            model(xh)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                model(xh)
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        t0 = min(e.time_range.start for e in events)
        print(f"---- h2d chunks={chunks}: GPU events (us from first), last call")
        for e in sorted(events, key=lambda e: e.time_range.start)[-(4 * chunks + 4):]:
            print(f"  {e.time_range.start - t0:9.1f} {e.time_range.end - t0:9.1f}  dev{e.device_index} "
                  f"{e.name[:60]}")
        cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::copy_")]
        print("  CPU aten::copy_ durations (us):", [round(e.time_range.elapsed_us(), 1) for e in cpu[-8:]])
