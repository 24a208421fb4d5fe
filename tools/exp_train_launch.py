"""Host cost of launching the forward and backward graphs of a graphed mlp8 training call (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_train_launch.py`` on the GPU machine.

The graphs ``Parallel(cuda_graph=True)`` captures for a training call (unfused: each branch on its own
stream in the forward, and autograd running each branch's backward on that stream; fused), against the
same branches captured by hand on one stream (``torch.cuda.graph`` around the sequential module, then
around ``torch.autograd.grad``). Each graph's ``replay()`` is issued 50 times behind a spin kernel, so the
host's time is the driver's launch alone; medians of 30 rounds, in microseconds per launch.
"""
import statistics

import torch

from parallel_modules import Parallel
from parallel_modules._cases import CASES, SequentialBranches
from _timing import events_us  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
case = CASES["mlp8-train"]
x = case.make_input(8, dev, torch.float32)


def module_graphs(**kw):
    model = Parallel(*case.branches(dev, torch.float32), join=case.join, dim=case.dim, cuda_graph=True, **kw)
    for _ in range(2):
        model(x).square().mean().backward()
    (graph,) = model._graphs._graphs.values()
    graph.fwd.keep = model  # (its buffers and parameters, which the graphs read by address)
    return graph.fwd, graph.bwd


def by_hand():
    seq = SequentialBranches(case.branches(dev, torch.float32), case.join, case.dim)
    params = list(seq.parameters())
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            y = seq(static)
            torch.autograd.grad(y, params, torch.ones_like(y))
    torch.cuda.current_stream().wait_stream(side)
    fwd, bwd, pool = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    with torch.cuda.graph(fwd, pool=pool):
        y = seq(static)
    gy = torch.ones_like(y)
    with torch.cuda.graph(bwd, pool=pool):
        grads = torch.autograd.grad(y, params, gy)
    fwd.keep = (seq, static, y, gy, grads)
    return fwd, bwd


graphs = {}
for label, make in (("Parallel streams", lambda: module_graphs()), ("Parallel fused", lambda: module_graphs(fuse=True)),
                    ("by hand, one stream", by_hand)):
    fwd, bwd = make()
    graphs[f"{label}: forward"] = fwd
    graphs[f"{label}: backward"] = bwd
torch.cuda.synchronize()
samples = {k: [] for k in graphs}
for _ in range(30):
    for k, g in graphs.items():
        samples[k].append(events_us(g.replay, 50, spin_cycles=int(5e7))[1])
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: host us per replay() of mlp8's training graphs")
for k, v in samples.items():
    print(f"{k:<36}{statistics.median(v):8.2f}")
