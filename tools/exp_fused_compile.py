"""Fused MLP branches compiled by inductor, replayed in a CUDA graph: fewer kernels than the floor? (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_fused_compile.py [N]`` on the GPU machine (N MLP branches,
default 8; fp32, TF32 off, batch 8).

The fused graph launches one batched product, one bias copy and one GELU per layer (11 kernels for
N = 8), where one branch alone launches 8 (``addmm`` adds its bias in cuBLAS's epilogue). Inductor
fuses the bias and the GELU into one pointwise kernel after each product; with max-autotune it may
also generate the products as Triton templates with the bias and GELU in their epilogue (4
kernels). This times, interleaved in one process: the floor (one branch captured alone), the
library's graphed streams and fused calls, the same fused computation written by hand (stacked
parameters) eager and compiled both ways, each captured by hand, and the library's
``compile="inductor"`` on a fused block; and counts the kernels of one replay of each.
"""
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from parallel_modules import Parallel
from parallel_modules._cases import CASES
from parallel_modules.bench import _capture
from _timing import cpu_us, gpu_medians, mlp_stacks, profile as cprofile  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
case = CASES[f"mlp{n}"]
dev, dt = torch.device("cuda"), torch.float32
# The fused computation by hand: stacked copies of the parameters, W [n, out, in] and B [n, out] per layer.
branches, x, ref_mod, ref, W, B = mlp_stacks(n)
depth = len(W)


def fused(x: torch.Tensor) -> torch.Tensor:
    h = F.gelu(F.linear(x, W[0].flatten(0, 1), B[0].flatten()))  # [batch, n * out]
    h = h.view(x.shape[0], n, -1).transpose(0, 1)  # [n, batch, out]
    for k in range(1, depth):
        h = F.gelu(torch.baddbmm(B[k].unsqueeze(1), h, W[k].mT))
    return h.transpose(0, 1).flatten(1)  # the cat join along dim 1


Bj = torch.stack(B[1:])  # the biases of layers 2.. in one tensor [depth - 1, n, out]


def fused_fills(x: torch.Tensor, joint: bool) -> torch.Tensor:
    r"""As the library's graph layouts: each product written onto its bias, in the cat join's layout.

    ``joint``: the biases of layers 2.. copied into all their output buffers by one kernel.
    """
    h = F.gelu(F.linear(x, W[0].flatten(0, 1), B[0].flatten()))  # [batch, n * out]
    b = x.shape[0]
    if joint:
        bufs = x.new_empty((depth - 1, b, n, W[1].shape[1]))
        bufs.copy_(Bj.unsqueeze(1).expand(-1, b, -1, -1))
    for k in range(1, depth):
        if joint:
            out = bufs[k - 1].transpose(0, 1)
        else:
            out = x.new_empty((b, n, W[k].shape[1])).transpose(0, 1)
            out.copy_(B[k].unsqueeze(1).expand(n, b, -1))
        out.baddbmm_(h.view(b, n, -1).transpose(0, 1), W[k].mT)
        h = F.gelu(out.transpose(0, 1).flatten(1))
    return h


def kernels(fn, show: bool = False) -> int:
    r"""GPU kernels (and memcpy/memset) of one call, from the profiler (10 calls); ``show``: list the last call's."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_call = round(len(events) / 10)
    if show:
        last = sorted(events, key=lambda e: e.time_range.start)[-per_call:]
        t0 = last[0].time_range.start
        for e in last:
            print(f"   +{e.time_range.start - t0:7.2f} us  {e.device_time:6.2f} us  {e.name[:90]}")
    return per_call


calls = {}
only = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] != "all" else None  # variants, by number
show = sys.argv[3].split(",") if len(sys.argv) > 3 else None  # variants whose kernels to list, by name


def add(name: str, make, want: torch.Tensor) -> None:
    r"""Build variant ``name`` (``make()`` returns the call), check it, count its kernels."""
    if only is not None and str(len(calls)) not in only and len(calls) > 0:
        calls[name] = None
        return
    fn = make()
    out = fn()
    torch.cuda.synchronize()
    err = (out - want).abs().max().item() if out.shape == want.shape else float("nan")  # the floor: one branch
    calls[name] = fn
    print(f"{name:<52} max abs err vs sequential {err:.2e}   kernels/call {kernels(fn)}", flush=True)
    if show is not None and name in show:
        kernels(fn, True)


hand_graphs = {}  # CUDA graphs captured by hand, by by_hand's name
built = {}  # the library's modules, by what they are


def by_hand(fn, name: str = ""):
    g = _capture(fn, x)
    hand_graphs[name] = g.graph
    return lambda: g(x)


def library(**kw):
    m = Parallel(*case.branches(dev, dt), **kw).eval()  # (the same seed: the same parameters as ``branches``)
    return m, (lambda: m(x))


with torch.no_grad():
    add("floor (one branch)", lambda: by_hand(branches[0]), ref)
    add("graph seq", lambda: by_hand(ref_mod), ref)
    add("graph Parallel streams", lambda: library(streams=True, cuda_graph=True)[1], ref)
    def fused_lib():
        built["fused"], fn = library(fuse=True, cuda_graph=True)
        return fn
    add("graph Parallel fused", fused_lib, ref)

    def fused_lib_in_line():
        # The variant with the biases copied in line, whatever _fastest would keep.
        from parallel_modules import _graphs
        fastest = _graphs._fastest
        _graphs._fastest = lambda graphs, stream, *a, **k: next(
            (g for g in graphs if g.variant and "bias in line" in g.variant), graphs[0])
        try:
            built["in line"], fn = library(fuse=True, cuda_graph=True)
            fn()
        finally:
            _graphs._fastest = fastest
        return fn
    add("graph Parallel fused, biases in line", fused_lib_in_line, ref)
    add("hand fused, graphed", lambda: by_hand(fused, "fused"), ref)
    add("hand fused, a fill per layer, graphed", lambda: by_hand(lambda x: fused_fills(x, False), "fills"), ref)
    add("hand fused, one joint fill, graphed", lambda: by_hand(lambda x: fused_fills(x, True), "joint"), ref)
    add("inductor fused, graphed", lambda: by_hand(torch.compile(fused, dynamic=False)), ref)
    add("inductor max-autotune fused, graphed",
        lambda: by_hand(torch.compile(fused, dynamic=False, mode="max-autotune-no-cudagraphs")), ref)
    mods = []
    for name, opts in (("graph Parallel fused compile=inductor", {}),
                       ("graph Parallel fused compile=inductor max-autotune",
                        {"mode": "max-autotune-no-cudagraphs"})):
        def make(opts=opts):
            m, fn = library(fuse=True, cuda_graph=True, compile="inductor", compile_options=opts)
            mods.append(m)
            return fn
        add(name, make, ref)
    calls = {k: v for k, v in calls.items() if v is not None}
    for what, m in built.items():
        (g,) = m._graphs._graphs.values()
        calls[f"  graph Parallel {what}: replay() alone"] = g.fwd.replay
    for k in ("fused", "fills", "joint"):
        if k in hand_graphs:
            calls[f"  hand {k}: replay() alone"] = hand_graphs[k].replay

    for m in [*built.values(), *mods]:
        info = m.explain()
        print(info.get("schedules"), info.get("not compiled as one", ""))
    if "host" in sys.argv[4:]:
        print("host us per call, back to back:")
        for name, fn in calls.items():
            print(f"   {name:<52}{cpu_us(fn, n=3000):8.2f} us")
        m = built.get("in line")
        if m is not None:
            (g,) = m._graphs._graphs.values()
            static = g.inputs[0]
            from parallel_modules._graphs import _launch
            for name, fn in {"module call": lambda: m(x), "forward": lambda: m.forward(x),
                             "_CudaGraphs.__call__": lambda: m._graphs(m._forward, (x,), {}),
                             "_Graph.replay": lambda: g.replay([x], False),
                             "copy_ + _launch": lambda: (static.copy_(x), _launch(g.fwd)),
                             "_launch": lambda: _launch(g.fwd)}.items():
                print(f"   in line: {name:<43}{cpu_us(fn, n=3000):8.2f} us")
            cprofile("in line module call", lambda: m(x), n=3000, top=20, warmup=100)
    med = gpu_medians(calls, rounds=40, per_sample=10)
    floor = med["floor (one branch)"]
    for name, t in med.items():
        print(f"{name:<52}{t:8.1f} us   {t / floor:5.2f}x floor   "
              f"{med['graph Parallel streams'] / t:5.2f}x over graphed streams")
