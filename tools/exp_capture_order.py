"""Does the order in which branches are captured change how fast a multi-stream graph replays? (dev tool)

The Inception timeline (notebooks/data/inception_timeline.json) shows the side
branches of a graphed ``Parallel`` starting 15, 34 and 49 us after the first, about
the number of kernels captured before each branch: as if a replay submitted the
graph's kernels in the order they were captured. If so, capturing the longest
branch first, or the branches' layers round-robin, shortens the critical path.
Captures each case by hand, one variant per order, and times replays interleaved;
then prints when each stream's first kernel starts in one replay (profiler).
Usage: ``PYTHONPATH=. python3 tools/exp_capture_order.py [inception-b1 inception-b1-fp16 inception-b8 mlp8 ...]``
"""
import statistics
import sys

import torch
from torch import nn

from parallel_modules import Parallel
from parallel_modules._cases import CASES, SequentialBranches as Seq
from parallel_modules.bench import _capture
from _timing import gpu_medians  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
DEV = torch.device("cuda")
HIGH_STREAM = torch.cuda.Stream(DEV, priority=torch.cuda.Stream.priority_range()[1])
ROUND_ROBIN = "rr" in sys.argv


def steps(m: nn.Module) -> list[nn.Module]:
    if isinstance(m, nn.Sequential):
        return [s for c in m for s in steps(c)]
    return [m]


def capture(branches, x, order, round_robin, streams, high=None):
    r"""Capture the branches forked from one stream; ``order`` of capture, layers round-robin or not."""
    static_x = x.clone()
    plan = [steps(b) for b in branches]

    def body():
        cap = torch.cuda.current_stream()
        h = [static_x] * len(branches)
        mine = {k: (cap if slot == 0 else streams[slot - 1]) for slot, k in enumerate(order)}
        if high is not None:
            mine[high] = HIGH_STREAM
        for k in order:
            if mine[k] is not cap:
                mine[k].wait_stream(cap)
        if round_robin:
            for j in range(max(map(len, plan))):
                for k in order:
                    if j < len(plan[k]):
                        with torch.cuda.stream(mine[k]):
                            h[k] = plan[k][j](h[k])
        else:
            for k in order:
                with torch.cuda.stream(mine[k]):
                    for s in plan[k]:
                        h[k] = s(h[k])
        for k in order:
            if mine[k] is not cap:
                cap.wait_stream(mine[k])
        return torch.cat(h, 1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        out = body()

    def replay(inp):
        static_x.copy_(inp)
        g.replay()
        return out
    return replay


def starts(fn, x, reps=5):
    r"""Median start of each stream's first kernel, us after the replay's first kernel."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn(x)
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "Memcpy" not in e.name and "memcpy" not in e.name),
                     key=lambda e: e.time_range.start)
    # split into replays at gaps > 50 us
    calls, cur = [], []
    for e in kernels:
        if cur and e.time_range.start - max(c.time_range.end for c in cur) > 50:
            calls.append(cur)
            cur = []
        cur.append(e)
    calls.append(cur)
    firsts, ends = {}, []
    for c in calls[1:]:
        t0 = c[0].time_range.start
        seen = {}
        for e in c:
            seen.setdefault(e.device_resource_id, e.time_range.start - t0)
        for i, (s, t) in enumerate(sorted(seen.items(), key=lambda kv: kv[1])):
            firsts.setdefault(i, []).append(t)
        ends.append(max(e.time_range.end for e in c) - t0)
    return [round(statistics.median(v), 1) for v in firsts.values()], round(statistics.median(ends), 1)


def run(case, batch, dtype, orders):
    torch.manual_seed(0)
    c = CASES[case]
    branches = [b.to(DEV, dtype).eval() for b in c.build()]
    x = torch.randn(c.input_shape(batch), device=DEV, dtype=dtype)
    seq = Seq(branches)
    streams = [torch.cuda.Stream() for _ in branches[1:]]
    variants = {"graph seq": _capture(seq, x)}
    for name, order in orders.items():
        if isinstance(order, tuple):  # (order, branch on a high-priority stream)
            variants[name] = capture(branches, x, order[0], False, streams, order[1])
            continue
        for rr in (False, True) if ROUND_ROBIN else (False,):
            variants[f"{name}{' round-robin' if rr else ''}"] = capture(branches, x, order, rr, streams)
    graphed = Parallel(*branches, cuda_graph=True)
    variants["Parallel(cuda_graph=True)"] = graphed
    with torch.no_grad():
        ref = seq(x)
        for name, m in variants.items():
            assert torch.equal(m(x), ref) or dtype != torch.float32, name
        times = gpu_medians({name: (lambda m=m: m(x)) for name, m in variants.items()}, rounds=40)
        for name, t in times.items():
            first, end = starts(variants[name], x) if name != "graph seq" else ([], 0)
            print(f"{case} b{batch} {str(dtype)[6:]:<8} {name:<34} {t:8.1f} us  seq/this {times['graph seq'] / t:.2f}x"
                  f"  stream starts {first} end {end}")


def module_variants(batch, dtype):
    r"""``Parallel(cuda_graph=True)`` made to capture one variant each, timed interleaved, and what it keeps."""
    from parallel_modules.parallel import _Order, _Priority
    torch.manual_seed(0)
    branches = [b.to(DEV, dtype).eval() for b in CASES["inception"].build()]
    x = torch.randn(CASES["inception"].input_shape(batch), device=DEV, dtype=dtype)
    seq = Seq(branches)
    calls = {"graph seq": _capture(seq, x)}
    for v in [None, (_Order((2, 1, 0, 3)),), (_Order((2, 1, 3, 0)),), (_Priority(2),), (_Priority(1),)]:
        m = Parallel(*branches, cuda_graph=True).eval()
        m._graph_variants = lambda a, k, f, v=v: [v]
        calls[str(v)] = m
    for k in range(3):
        calls[f"Parallel as shipped {k}"] = Parallel(*branches, cuda_graph=True).eval()
    with torch.no_grad():
        for m in calls.values():
            for _ in range(3):
                m(x)
        t = gpu_medians({k: (lambda m=m: m(x)) for k, m in calls.items()}, rounds=60)
    for k, v in t.items():
        print(f"module b{batch} {str(dtype)[6:]:<8} {k:<34} {v:8.1f} us  seq/this {t['graph seq'] / v:.2f}x")
    for k in range(3):
        m = calls[f"Parallel as shipped {k}"]
        print(f"  shipped {k} kept:", list(m.explain()["schedules"].values()), "timed order:",
              m._longest_first((x,), {}))


def fastest_check(batch, dtype):
    r"""Why ``_fastest`` keeps a variant that module calls time slower: the same graphs timed three ways."""
    from parallel_modules import _graphs
    from parallel_modules.parallel import _Order, _Priority
    torch.manual_seed(0)
    branches = [b.to(DEV, dtype).eval() for b in CASES["inception"].build()]
    x = torch.randn(CASES["inception"].input_shape(batch), device=DEV, dtype=dtype)
    mods = {}
    for v in [None, (_Order((2, 1, 3, 0)),), (_Priority(2),)]:
        m = Parallel(*branches, cuda_graph=True).eval()
        m._graph_variants = lambda a, k, f, v=v: [v]
        with torch.no_grad():
            m(x)
        mods[str(v)] = m
    graphs = {k: next(iter(m._graphs._graphs.values())) for k, m in mods.items()}
    for sname, stream in [("a side stream", torch.cuda.Stream()), ("the default stream", torch.cuda.current_stream())]:
        for pair in [("None", "(_Order(order=(2, 1, 3, 0)),)"), ("(_Order(order=(2, 1, 3, 0)),)", "(_Priority(index=2),)")]:
            picks = [_graphs._fastest([graphs[pair[0]], graphs[pair[1]]], stream) for _ in range(4)]
            print(f"_fastest({pair[0]}, {pair[1]}) on {sname} -> {[k for p in picks for k, g in graphs.items() if g is p]}")
    with torch.no_grad():
        one = {k: gpu_medians({k: (lambda g=g: g.fwd.replay())}, rounds=60, per_sample=1)[k] for k, g in graphs.items()}
        single = gpu_medians({k: (lambda g=g: g.fwd.replay()) for k, g in graphs.items()}, rounds=60, per_sample=1)
        ten = gpu_medians({k: (lambda g=g: g.fwd.replay()) for k, g in graphs.items()}, rounds=60, per_sample=10)
        calls = gpu_medians({k: (lambda m=m: m(x)) for k, m in mods.items()}, rounds=60, per_sample=10)
        calls1 = gpu_medians({k: (lambda m=m: m(x)) for k, m in mods.items()}, rounds=60, per_sample=1)
    for k in graphs:
        print(f"b{batch} {str(dtype)[6:]} {k:<34} replay 1/sample {single[k]:6.1f} (not interleaved {one[k]:6.1f}),"
              f" 10/sample {ten[k]:6.1f}; module call 10/sample {calls[k]:6.1f}, 1/sample {calls1[k]:6.1f}")


def prefill_check(case):
    r"""A fused graph with each product's bias copied in on a side stream (two streams) or in line (one)."""
    from parallel_modules import _fusion
    torch.manual_seed(0)
    branches = [b.to(DEV).eval() for b in CASES[case].build()]
    x = torch.randn(CASES[case].input_shape(8), device=DEV)
    calls = {}
    init = _fusion._Prefill.__init__

    def inline(self, x, side=True):
        self.caller = self.side = None  # no stream: the copy in line
    with torch.no_grad():
        for label, patch in [("fused, bias copies on a side stream", None), ("fused, one stream", inline)]:
            if patch:
                _fusion._Prefill.__init__ = patch
            m = Parallel(*branches, cuda_graph=True, fuse=True).eval()
            m(x)
            _fusion._Prefill.__init__ = init
            calls[label] = m
        shipped = calls["fused as shipped"] = Parallel(*branches, cuda_graph=True, fuse=True).eval()
        shipped(x)
        print(case, "fused as shipped keeps:", list(shipped.explain()["schedules"].values()))
        calls["streams"] = Parallel(*branches, cuda_graph=True).eval()
        # After fuse=True moved the parameters into its stacks: graphs read them by address.
        calls["floor (branch 0)"] = _capture(branches[0], x)
        calls["graph seq"] = _capture(Seq(branches), x)
        for m in calls.values():
            for _ in range(3):
                m(x)
        t = gpu_medians({k: (lambda m=m: m(x)) for k, m in calls.items()}, rounds=60)
        from _timing import cpu_us
        for k, m in calls.items():
            print(f"{case} {k:<40} GPU {t[k]:6.1f} us  host {cpu_us(lambda m=m: m(x), n=2000):6.1f} us"
                  f"  x floor {t[k] / t['floor (branch 0)']:.2f}")


if "prefill" in sys.argv:
    for c in ("mlp8", "mlp16"):
        prefill_check(c)
    sys.exit()

if "fastest" in sys.argv:
    for b, dt in [(1, torch.float32), (8, torch.float32)]:
        fastest_check(b, dt)
    sys.exit()

if "module" in sys.argv:
    for b, dt in [(1, torch.float32), (1, torch.float16), (8, torch.float32)]:
        module_variants(b, dt)
    sys.exit()

N = lambda n: list(range(n))  # noqa: E731
INC = {"natural": [0, 1, 2, 3], "longest first": [2, 1, 3, 0], "2 first, then natural": [2, 0, 1, 3],
       "1 first": [1, 0, 2, 3], "3 first": [3, 0, 1, 2],
       "natural, 2 high": ([0, 1, 2, 3], 2), "natural, 1 high": ([0, 1, 2, 3], 1),
       "2 first on a high side stream": ([2, 0, 1, 3], 2), "2 first, then 0 on a high side": ([2, 0, 1, 3], 0)}
CONFIGS = {
    "inception-b1": ("inception", 1, torch.float32, INC),
    "inception-b1-fp16": ("inception", 1, torch.float16, INC),
    "inception-b8": ("inception", 8, torch.float32, INC),
    "mlp8": ("mlp8", 8, torch.float32, {"natural": N(8)}),
    "mlp16": ("mlp16", 8, torch.float32, {"natural": N(16)}),
    "tiny8": ("tiny8", 8, torch.float32, {"natural": N(8)}),
}
for key in [a for a in sys.argv[1:] if a != "rr"] or CONFIGS:
    run(*CONFIGS[key])
