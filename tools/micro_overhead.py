"""Where the CPU time of one eager ``Parallel`` call goes (dev tool, not shipped).

Times Parallel(N x Linear(16, 16)) with streams=True/False/"auto" against the
branches called in a loop, the per-call helpers one by one, and prints a
cProfile of the forked call. Run on the GPU machine: ``python3 tools/micro_overhead.py``.
"""
import cProfile
import pstats
import time

import torch
from torch import nn

from parallel_modules import Parallel
from parallel_modules._cases import SequentialBranches
from parallel_modules._graphs import _capture_underway
from parallel_modules._inputs import _input_device, _signature
from parallel_modules._streams import _current_stream, _is_tracing, _pool

dev = torch.device("cuda")
x = torch.randn(8, 16, device=dev)
CALLS = 5000


def per_call(fn) -> float:
    for _ in range(300):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        best.append((time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
    return sorted(best)[2]


with torch.no_grad():
    for name, fn in [("_signature", lambda: _signature((x,), {}, False)),
                     ("_is_tracing", _is_tracing), ("_capture_underway", _capture_underway),
                     ("_input_device", lambda: _input_device((x,), {})),
                     ("_current_stream", lambda: _current_stream(dev)), ("_pool", lambda: _pool(dev)),
                     ("is_current_stream_capturing", torch.cuda.is_current_stream_capturing),
                     ("torch.is_grad_enabled", torch.is_grad_enabled)]:
        print(f"{name:<32}{per_call(fn):7.2f} us")
    for n in (2, 4, 8, 16):
        lins = [nn.Linear(16, 16).to(dev) for _ in range(n)]
        seq = SequentialBranches(lins)
        loop = lambda _x: torch.cat([l(_x) for l in lins], 1)  # noqa: E731
        mods = {"seq module": seq, "loop": loop, "streams=True": Parallel(*lins, streams=True),
                "streams=False": Parallel(*lins, streams=False), "auto": Parallel(*lins)}
        t = {k: per_call(lambda m=m: m(x)) for k, m in mods.items()}
        print(f"N={n:<3}" + "  ".join(f"{k} {v:6.1f}" for k, v in t.items())
              + f"  | fork/join per side branch {(t['streams=True'] - t['seq module']) / (n - 1):5.1f} us"
              + f"  | auto/seq {t['seq module'] / t['auto']:.3f}x")
        if n == 8:
            p = mods["streams=True"]
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(2000):
                p(x)
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
