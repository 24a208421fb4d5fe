"""The host cost of ``Parallel``'s decided sequential call against the plain module, piece by piece (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_seqpath.py`` on the GPU machine. Times tiny2 (2 x
Linear(16, 16), batch 8, cat join) as ``SequentialBranches`` and as ``Parallel`` (streams="auto",
decided sequential), then each check the inline path makes per call. Per call: the minimum over
25 repeats of the thread's CPU time of 5000 calls, so the host's drift hits little.
"""
import time
import timeit

import torch
from torch import nn

from parallel_modules import Parallel
from parallel_modules._cases import SequentialBranches
from parallel_modules._inputs import _signature
from parallel_modules import _streams as S

dev = torch.device("cuda")
x = torch.randn(8, 16, device=dev)
lins = [nn.Linear(16, 16).to(dev) for _ in range(2)]
seq, par = SequentialBranches(lins), Parallel(*lins)


def t(name, fn):
    m = min(timeit.repeat(fn, timer=time.thread_time, number=5000, repeat=25)) / 5000 * 1e6
    torch.cuda.synchronize()
    print(f"{name:<44}{m:8.3f} us")
    return m


with torch.no_grad():
    for _ in range(50):
        par(x)
    print("plan:", par.explain().get("schedules"))
    a = t("SequentialBranches", lambda: seq(x))
    b = t("Parallel (decided sequential)", lambda: par(x))
    print(f"ratio {a / b:.3f}, gap {b - a:.2f} us")
    t("_signature", lambda: _signature((x,), {}, False))
    t("_is_tracing", S._is_tracing)
    t("torch.compiler.is_compiling", torch.compiler.is_compiling)
    t("_capture_underway", S._capture_underway)
    t("torch._C._cuda_isCurrentStreamCapturing", torch._C._cuda_isCurrentStreamCapturing)
    t("torch._C._cuda_getCurrentStream(0)", lambda: torch._C._cuda_getCurrentStream(0))
    t("x.device", lambda: x.device)
    t("empty lambda", lambda: None)

# The same two modules as the benchmark builds them (every mode of the case on the same
# branches), timed by the benchmark's samples (GPU time of 20 calls after a synchronize,
# interleaved) and by the thread's CPU time as above.
import statistics  # noqa: E402

from parallel_modules._cases import CASES  # noqa: E402
from parallel_modules.bench import _modes, _sample  # noqa: E402

case = CASES["tiny2"]
xb = case.make_input(8, dev, torch.float32)
with torch.no_grad():
    modes = _modes(case, dev, torch.float32, xb, False)
    for fn in modes.values():
        for _ in range(40):
            fn(xb)
    for only in (None, ("eager seq", "eager Parallel")):
        chosen = {k: v for k, v in modes.items() if only is None or k in only}
        samples = {k: [] for k in chosen}
        for _ in range(40):
            for k, fn in chosen.items():
                samples[k].append(_sample(fn, xb, 20, True))
        med = {k: statistics.median(s) * 1e6 for k, s in samples.items()}
        print(f"benchmark samples, {'all modes' if only is None else 'two modes'} interleaved: "
              f"eager seq {med['eager seq']:.1f} us, eager Parallel {med['eager Parallel']:.1f} us, "
              f"ratio {med['eager seq'] / med['eager Parallel']:.3f}")
    a = t("benchmark's eager seq, thread time", lambda: modes["eager seq"](xb))
    b = t("benchmark's eager Parallel, thread time", lambda: modes["eager Parallel"](xb))
    print(f"ratio {a / b:.3f}")
