"""Where the CPU time of one eager ``Parallel`` call goes (dev tool, not shipped).

Times Parallel(N x Linear(16, 16)) with streams=True/False/"auto" against the
branches called in a loop, the per-call helpers one by one, and prints a
cProfile of the forked call. Run on the GPU machine: ``python3 tools/micro_overhead.py``.
"""
import statistics

import torch
from torch import nn

from parallel_modules import Parallel
from parallel_modules._cases import SequentialBranches
from parallel_modules import _streams
from parallel_modules._streams import _capture_underway
from _timing import cpu_us, profile as _profile  # tools/ is the script's directory
from parallel_modules._inputs import _input_device, _signature
from parallel_modules._streams import _current_stream, _is_tracing, _pool

dev = torch.device("cuda")
x = torch.randn(8, 16, device=dev)
CALLS = 5000


def per_call(fn) -> float:
    return cpu_us(fn, CALLS, warmup=300, repeats=5, pick=statistics.median)


def profile(label, fn, calls=2000, rows=16):
    print(f"==== {label}: {per_call(fn):.1f} us per call without the profiler")
    _profile(label, fn, calls, rows, warmup=200)


with torch.no_grad():
    for name, fn in [("_signature", lambda: _signature((x,), {}, False)),
                     ("_is_tracing", _is_tracing), ("_capture_underway", _capture_underway),
                     ("_input_device", lambda: _input_device((x,), {})),
                     ("_current_stream", lambda: _current_stream(dev)), ("_pool", lambda: _pool(dev)),
                     ("torch.is_grad_enabled", torch.is_grad_enabled)]:
        print(f"{name:<32}{per_call(fn):7.2f} us")
    import sys
    if "--profile" in sys.argv:
        from parallel_modules._cases import mlp_branches
        torch.manual_seed(0)
        x256 = torch.randn(8, 256, device=dev)
        fused = Parallel(*[b.to(dev) for b in mlp_branches(8)], fuse=True)
        profile("mlp8 fuse=True", lambda: fused(x256))
        tiny2 = Parallel(*[nn.Linear(16, 16).to(dev) for _ in range(2)])
        seq2 = SequentialBranches(list(tiny2))
        print(f"tiny2: Parallel (auto) {per_call(lambda: tiny2(x)):.1f} us, sequential module {per_call(lambda: seq2(x)):.1f} us")
        profile("tiny2 auto", lambda: tiny2(x))
        tiny8 = Parallel(*[nn.Linear(16, 16).to(dev) for _ in range(8)], streams=True)
        profile("tiny8 streams=True", lambda: tiny8(x))
        sys.exit(0)
    for n in (2, 4, 8, 16):
        lins = [nn.Linear(16, 16).to(dev) for _ in range(n)]
        seq = SequentialBranches(lins)
        loop = lambda _x: torch.cat([l(_x) for l in lins], 1)  # noqa: E731
        mods = {"seq module": seq, "loop": loop, "streams=True": Parallel(*lins, streams=True),
                "streams=False": Parallel(*lins, streams=False), "auto": Parallel(*lins)}
        t = {k: per_call(lambda m=m: m(x)) for k, m in mods.items()}
        # The same forked call with every side output marked with record_stream
        # (the scheme joined outputs used before; _streams' docstring, memory).
        use_count, _streams._use_count = _streams._use_count, None
        t["streams=True record_stream"] = per_call(lambda: mods["streams=True"](x))
        _streams._use_count = use_count
        print(f"N={n:<3}" + "  ".join(f"{k} {v:6.1f}" for k, v in t.items())
              + f"  | fork/join per side branch {(t['streams=True'] - t['seq module']) / (n - 1):5.1f} us"
              + f" ({(t['streams=True record_stream'] - t['seq module']) / (n - 1):5.1f} with record_stream)"
              + f"  | auto/seq {t['seq module'] / t['auto']:.3f}x")
        if n == 8:
            p = mods["streams=True"]
            _profile("N=8 streams=True", lambda: p(x), 2000, 18)
