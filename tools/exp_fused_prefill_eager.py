"""Eager fused mlp layers: ways to add the biases and join, written by hand (dev tool).

Usage: ``PYTHONPATH=. python3 tools/exp_fused_prefill_eager.py [N]``. Host microseconds per call (back to
back, then a synchronize; rounds interleaved, median of rounds) of N members' four Linear(256, 256) + GELU
layers on a shared (8, 256) input, cat-joined, each way, and their results' difference from today's.

Found (H100 machine, 2026-11-24): written by hand, the four biases copied in by one kernel and each product
accumulating in place (``prefill4``) cost 7-14% less host time than ``baddbmm`` per layer (98-137 against
116-146 us). Built into the fused program's steps (joint biases including the first layer's, a stacked
``_Prefill``), the per-layer Python it took cost more than the kernels saved: ``Parallel(fuse=True)`` took
0.91-0.95x the time of the version without it (``tools/exp_fused_eager_ab.py``), so it was not kept.
"""
import statistics
import sys

import torch
import torch.nn.functional as F

from _timing import host_us  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
dev = torch.device("cuda")
x = torch.randn(8, 256, device=dev)
W4 = torch.randn(4, n, 256, 256, device=dev) / 16   # every layer's stacked weights
B4 = torch.randn(4, n, 256, device=dev)             # every layer's stacked biases, stored together
Wt = [w.mT for w in W4]
Bs = [b.unsqueeze(1) for b in B4]
W0flat, B0flat = W4[0].flatten(0, 1), B4[0].flatten()
B3 = B4[1:]
gelu = F.gelu


def today(x):  # a copy and a product per layer, the join a transposing copy
    h = gelu(torch.baddbmm(Bs[0], x.expand(n, -1, -1), Wt[0]))
    for i in (1, 2, 3):
        h = gelu(torch.baddbmm(Bs[i], h, Wt[i]))
    return h.movedim(0, 1).flatten(1, 2)


def linear_first(x):  # the first layer one wide product (bias in its epilogue), the rest as today
    rows = x.shape[0]
    h = gelu(F.linear(x, W0flat, B0flat)).view(rows, n, 256).transpose(0, 1)
    for i in (1, 2, 3):
        h = gelu(torch.baddbmm(Bs[i], h, Wt[i]))
    return h.movedim(0, 1).flatten(1, 2)


def prefill4_stacked(x):  # the four biases copied in by one kernel, [4, N, rows, out]; join by a copy
    rows = x.shape[0]
    outs = B4.unsqueeze(2).expand(4, n, rows, 256).clone().unbind(0)
    h = x.expand(n, -1, -1)
    for i in range(4):
        h = gelu(outs[i].baddbmm_(h, Wt[i]))
    return h.movedim(0, 1).flatten(1, 2)


def prefill4_channels(x):  # the same, buffers [4, rows, N, out]: outputs in the channels layout, join free
    rows = x.shape[0]
    outs = B4.unsqueeze(1).expand(4, rows, n, 256).clone().unbind(0)
    h = x.expand(n, -1, -1)
    for i in range(4):
        h = gelu(outs[i].transpose(0, 1).baddbmm_(h, Wt[i]))
    return h.transpose(0, 1).reshape(rows, n * 256)


def linear_prefill3_channels(x):  # first layer wide, the later three biases copied in by one kernel
    rows = x.shape[0]
    outs = B3.unsqueeze(1).expand(3, rows, n, 256).clone().unbind(0)
    h = gelu(F.linear(x, W0flat, B0flat)).view(rows, n, 256).transpose(0, 1)
    for i in (1, 2, 3):
        h = gelu(outs[i - 1].transpose(0, 1).baddbmm_(h, Wt[i]))
    return h.transpose(0, 1).reshape(rows, n * 256)


calls = {"today": today, "linear first": linear_first, "prefill4 stacked": prefill4_stacked,
         "prefill4 channels": prefill4_channels, "linear + prefill3 channels": linear_prefill3_channels}


with torch.no_grad():
    ref = today(x)
    for label, f in calls.items():
        out = f(x)
        assert out.shape == ref.shape, (label, out.shape)
        print(f"{label:<28} max |diff| {(out - ref).abs().max().item():.3g}  contiguous {out.is_contiguous()}")
    samples: dict[str, list[float]] = {k: [] for k in calls}
    for f in calls.values():
        host_us(lambda: f(x), 100)
    for _ in range(25):
        for label, f in calls.items():
            samples[label].append(host_us(lambda: f(x)))
    base = statistics.median(samples["today"])
    for label, s in samples.items():
        m = statistics.median(s)
        print(f"N={n} {label:<28}{m:8.1f} us  (q1 {statistics.quantiles(s)[0]:.1f}, q3 {statistics.quantiles(s)[2]:.1f})  "
              f"{base / m:.2f}x today")
