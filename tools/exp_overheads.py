"""Where per-call time goes, measured several ways in one process (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_overheads.py [forkjoin] [tuner] [graphcall] [kernels] [seqpath] [train [prof] [gc]]``

* ``forkjoin``: host microseconds per call of tinyN (N x Linear(16, 16)) sequential and forked,
  measured back to back (5000 calls) and as the benchmark does (groups of 20 after a
  synchronize, modes interleaved), so the two methods' fork/join figures can be compared;
* ``tuner``: what ``streams="auto"`` measures and keeps on fresh modules warmed up as the
  benchmark warms them up, against the steady-state cost of each schedule;
* ``graphcall``: the pieces of a ``cuda_graph=True`` call (mlp8), alone, and a cProfile;
* ``kernels``: the CUDA kernels of one eager call of the fused and unfused mlp8, and the GPU
  time of each graph's replay;
* ``train``: the host time of each part of an mlp8 training step (zero_grad, forward, backward,
  optimizer step), sequential and graphed, with the graph call's shortcuts undone one at a time
  (``prof``: and a cProfile and a torch.profiler table of the graphed steps; ``gc``: and each
  step with Python's garbage collector off).
"""
import gc
import statistics
import sys
import time

import torch
from torch import nn

from parallel_modules import Parallel
from parallel_modules._cases import CASES, SequentialBranches
from parallel_modules.bench import _capture, _sample
from _timing import cpu_us, gpu_medians, op_table, profile  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")
what = sys.argv[1:] or ["forkjoin", "tuner", "graphcall", "kernels"]


def bench_style(fns: dict, x, reps: int = 40, group: int = 20) -> dict[str, tuple[float, float]]:
    r"""As the benchmark samples: (host us, GPU us) per call, medians of ``reps`` interleaved groups."""
    host: dict[str, list[float]] = {k: [] for k in fns}
    gpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            gpu[k].append(_sample(fn, x, group, True, host[k]))
    return {k: (statistics.median(host[k]) * 1e6, statistics.median(gpu[k]) * 1e6) for k in fns}


def warm(fn, x, n=40):
    for _ in range(n):
        fn(x)
    torch.cuda.synchronize()


if "forkjoin" in what:
    print("==== fork/join: host us per call (back to back | bench style host/GPU)")
    for n in (2, 4, 8):
        case = CASES[f"tiny{n}"]
        br = case.branches(dev, torch.float32)
        x = case.make_input(8, dev, torch.float32)
        mods = {"seq": SequentialBranches(br), "streams": Parallel(*br, streams=True),
                "sequential Parallel": Parallel(*br, streams=False)}
        with torch.no_grad():
            for m in mods.values():
                warm(m, x)
            b2b = {k: cpu_us(lambda m=m: m(x), n=5000, repeats=5, pick=statistics.median) for k, m in mods.items()}
            bs = bench_style(mods, x)
            alone = {k: bench_style({k: m}, x)[k] for k, m in mods.items()}
        for k in mods:
            print(f"tiny{n:<3}{k:<22} b2b {b2b[k]:7.1f} | bench {bs[k][0]:7.1f} / {bs[k][1]:7.1f}"
                  f" | bench, not interleaved {alone[k][0]:7.1f} / {alone[k][1]:7.1f}")
        print(f"tiny{n:<3}fork/join per side branch: b2b {(b2b['streams'] - b2b['seq']) / (n - 1):.1f} us, "
              f"bench {(bs['streams'][0] - bs['seq'][0]) / (n - 1):.1f} us, "
              f"not interleaved {(alone['streams'][0] - alone['seq'][0]) / (n - 1):.1f} us")
        if n == 2:
            # The first call of a group against the rest: per-group fixed costs.
            m = mods["streams"]
            firsts, rest = [], []
            with torch.no_grad():
                for _ in range(200):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    m(x)
                    t1 = time.perf_counter()
                    for _ in range(19):
                        m(x)
                    t2 = time.perf_counter()
                    firsts.append((t1 - t0) * 1e6)
                    rest.append((t2 - t1) / 19 * 1e6)
            print(f"tiny2 streams: first call after a sync {statistics.median(firsts):.1f} us, "
                  f"the next 19 {statistics.median(rest):.1f} us each")
            with torch.no_grad():
                profile("tiny2 streams=True", lambda: m(x), n=3000, top=18, warmup=100)

if "tuner" in what:
    print("==== streams='auto': what the tuner measured and kept, fresh modules, bench-style warm-up")
    for name, batch, dtype in [("inception", 8, torch.float32), ("inception", 1, torch.float32),
                               ("inception", 8, torch.float16), ("conv4", 8, torch.float32)]:
        case = CASES[name]
        br = case.branches(dev, dtype)
        x = case.make_input(batch, dev, dtype)
        with torch.no_grad():
            seq = SequentialBranches(br)
            forced = {"seq": seq, "streams=False": Parallel(*br, streams=False),
                      "streams=True": Parallel(*br, streams=True)}
            for m in forced.values():
                warm(m, x)
            for trial in range(4):
                p = Parallel(*br)
                warm(p, x)
                (desc,) = p.explain()["schedules"].values()
                print(f"{name} b{batch} {str(dtype)[6:]} trial {trial}: {desc}")
            steady = bench_style({**forced, "auto (last)": p}, x, reps=30)
        print("  steady state host/GPU us: " + ", ".join(f"{k} {h:.1f}/{g:.1f}" for k, (h, g) in steady.items()))

if "graphcall" in what:
    print("==== graphed mlp8 call: pieces, host us per call")
    case = CASES["mlp8"]
    br = case.branches(dev, torch.float32)
    x = case.make_input(8, dev, torch.float32)
    from parallel_modules import _streams
    ident = nn.Identity()
    with torch.no_grad():
        # First: fuse=True stacks the branches' parameters into new memory, which graphs read by address.
        mods = {"graph streams": Parallel(*br, cuda_graph=True),
                "graph fused": Parallel(*br, cuda_graph=True, fuse=True)}
        for m in mods.values():
            warm(m, x)
        # Captured by hand as the benchmark's baselines are: copy the input in, replay.
        hand = {"floor (branch 0)": _capture(br[0], x), "graph seq": _capture(SequentialBranches(br), x)}
        for label, fn in hand.items():
            print(f"{label:<14}{'copy-in + replay':<24}{cpu_us(lambda fn=fn: fn(x), n=3000):8.2f} us"
                  f"   replay() alone {cpu_us(fn.graph.replay, n=3000):8.2f} us")
        for label, m in mods.items():
            (graph,) = m._graphs._graphs.values()
            static = graph.inputs[0]
            pieces = {
                "module call": lambda m=m: m(x),
                "_CudaGraphs.__call__": lambda m=m: m._graphs(m._forward, (x,), {}),
                "_Graph.replay": lambda g=graph: g.replay([x], False),
                "fwd.replay()": graph.fwd.replay,
                "static.copy_(x)": lambda s=static: s.copy_(x),
                "torch._foreach_copy_": lambda s=static: torch._foreach_copy_([s], [x]),
                "aten.copy_.default": lambda s=static: torch.ops.aten.copy_.default(s, x),
                "lending.outputs": lambda g=graph: g.lending.outputs(g.outputs),
                "lending.held": lambda g=graph: g.lending.held(),
                "outputs detached": lambda g=graph: [o.detach() for o in g.outputs],
                "_key": lambda m=m: m._graphs._key(m, (x,), {}, ()),
                "_capture_underway": _streams._capture_underway,
                "_is_tracing": _streams._is_tracing,
                "_current_stream": lambda: _streams._current_stream(dev),
                "Module.__call__ of Identity": lambda: ident(x),
            }
            for k, fn in pieces.items():
                print(f"{label:<14}{k:<24}{cpu_us(fn, n=3000):8.2f} us")
            profile(f"{label} call", lambda m=m: m(x), n=3000, top=16, warmup=100)
        gpu = gpu_medians({**{k: (lambda m=m: m(x)) for k, m in mods.items()},
                           **{k: (lambda fn=fn: fn(x)) for k, fn in hand.items()}})
        print("GPU us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in gpu.items()))

if "kernels" in what:
    print("==== kernels of one eager mlp8 call (fused and unfused), GPU us each")
    from torch.profiler import ProfilerActivity, profile as tprofile
    case = CASES["mlp8"]
    br = case.branches(dev, torch.float32)
    x = case.make_input(8, dev, torch.float32)
    from parallel_modules import _fusion
    fused = Parallel(*br, fuse=True)
    with torch.no_grad():
        for label, m in {"fused": fused, "fused, graph layouts": fused, "one branch": br[0]}.items():
            # The layouts a capture takes, run eagerly so that the profiler sees each kernel.
            _fusion._kernels_cost_more = (lambda x: True) if "graph" in label else (lambda x: False)
            warm(m, x)
            print(f"-- {label}: {cpu_us(lambda m=m: m(x), n=2000):.1f} us of CPU per eager call")
            with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                m(x)
                torch.cuda.synchronize()
            evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            print(f"-- {label}: {len(evs)} kernels/copies")
            for e in evs:
                print(f"   {e.device_time:7.2f} us  {e.name[:110]}")

if "seqpath" in what:
    # What the planned sequential path costs beyond calling the branches, sampled as the benchmark
    # samples, with each of its checks stubbed out in turn (diagnostic variants, not correct modules),
    # each against the sequential module in the same interleaved samples.
    from parallel_modules import parallel as par_mod
    from parallel_modules._streams import _graph_state
    print("==== sequential schedule: Parallel(streams=False) minus the sequential module, us per call")
    real = (par_mod._capture_underway, par_mod._is_tracing)
    variants = {"as shipped": real,
                "no stream-capture query": (lambda: _graph_state.active, real[1]),
                "no capture query, no tracing check": (lambda: _graph_state.active, lambda: False)}
    for n in (2, 4):
        case = CASES[f"tiny{n}"]
        br = case.branches(dev, torch.float32)
        x = case.make_input(8, dev, torch.float32)
        seq, par = SequentialBranches(br), Parallel(*br, streams=False)
        with torch.no_grad():
            warm(seq, x), warm(par, x)
            for label, (capture, tracing) in variants.items():
                par_mod._capture_underway, par_mod._is_tracing = capture, tracing
                try:
                    res = bench_style({"seq": seq, "par": par}, x, reps=100)
                    b2b = [cpu_us(lambda m=m: m(x), n=5000, repeats=5, pick=statistics.median) for m in (seq, par)]
                finally:
                    par_mod._capture_underway, par_mod._is_tracing = real
                print(f"tiny{n:<3}{label:<36} bench: seq {res['seq'][0]:6.1f} overhead {res['par'][0] - res['seq'][0]:5.1f}"
                      f"   b2b: seq {b2b[0]:6.1f} overhead {b2b[1] - b2b[0]:5.1f}")
    print(f"_cuda_isCurrentStreamCapturing() alone: {cpu_us(torch._C._cuda_isCurrentStreamCapturing, n=5000):.2f} us")

if "train" in what:
    # Where a training step's host time goes (mlp8, batch 8): each part of the bench's step timed
    # alone, for the sequential module and the graphed Parallel, the latter also with each of
    # the graph call's shortcuts undone (diagnostic variants), then a cProfile of whole steps.
    print("==== training step parts, host us (mlp8, batch 8, fp32)")
    from parallel_modules import _graphs
    case = CASES["mlp8-train"]
    x = case.make_input(8, dev, torch.float32)
    undo = {
        "foreach_mul grad copies": (_graphs._Graph, "fresh_grads",
                                    lambda self: torch._foreach_mul([g for g in self.grad_inputs if g is not None], 1.0)),
        "Function.apply": (_graphs, "_apply", None),
    }
    variants = [("eager seq", None, None), ("graph Parallel", dict(cuda_graph=True), None),
                *[("graph Parallel", dict(cuda_graph=True), u) for u in undo],
                ("graph Parallel fused", dict(cuda_graph=True, fuse=True), None)]
    if "gc" in what:  # Python's cyclic garbage collector off while timing
        variants += [("eager seq", None, "gc"), ("graph Parallel", dict(cuda_graph=True), "gc"),
                     ("graph Parallel fused", dict(cuda_graph=True, fuse=True), "gc")]
    for label, kw, u in variants:
        br = case.branches(dev, torch.float32)
        model = case.model(SequentialBranches(br, case.join, case.dim) if kw is None else
                           Parallel(*br, join=case.join, dim=case.dim, **kw), dev, torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        state: dict = {}
        saved = None if u in (None, "gc") else getattr(undo[u][0], undo[u][1])

        def zero(): opt.zero_grad(set_to_none=True)
        def fwd(): state["loss"] = model(x).square().mean()
        def bwd(): state["loss"].backward()
        def step(): opt.step()
        def whole(): zero(); fwd(); bwd(); step()
        if u == "gc":
            gc.disable()
        elif u is not None:
            setattr(undo[u][0], undo[u][1], undo[u][2])
        try:
            for _ in range(50):
                whole()
            torch.cuda.synchronize()
            parts = {k: [] for k in ("zero_grad", "forward+loss", "backward", "opt.step", "whole")}
            for _ in range(300):
                t0 = time.perf_counter(); zero(); t1 = time.perf_counter(); fwd(); t2 = time.perf_counter()
                bwd(); t3 = time.perf_counter(); step(); t4 = time.perf_counter()
                for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                    parts[k].append(v * 1e6)
            torch.cuda.synchronize()
            gpu = gpu_medians({"step": whole}, rounds=20, per_sample=10)["step"]
            name = label + ("" if u is None else " (gc off)" if u == "gc" else f" (undone: {u})")
            print(f"{name:<52}" + "  ".join(f"{k} {statistics.median(v):7.1f}" for k, v in parts.items())
                  + f"   bench-style GPU/step {gpu:7.1f}")
            if kw is not None and u is None and "prof" in what:
                profile(f"{label} step", whole, n=500, top=22)
                op_table(whole, calls=20, rows=18)
        finally:
            if u == "gc":
                gc.enable()
            elif u is not None:
                setattr(undo[u][0], undo[u][1], saved)
