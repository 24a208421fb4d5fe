"""Host-side timing helpers shared by the micro-benchmark tools (dev tool, not shipped)."""
import cProfile
import io
import pstats
import time
from typing import Callable

import torch


def cpu_us(fn: Callable[[], object], n: int = 2000, warmup: int = 100, repeats: int = 3,
           pick: Callable[[list[float]], float] = min) -> float:
    r"""Host microseconds per call: ``n`` calls then one sync, ``repeats`` times; ``pick`` of those."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return pick(samples)


def profile(name: str, fn: Callable[[], object], n: int = 2000, top: int = 14, warmup: int = 0) -> None:
    r"""Print the ``top`` functions by own time of a cProfile of ``n`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    print(f"---- cProfile {name} ({n} calls)")
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip() and "function calls" not in line)[:3500])
