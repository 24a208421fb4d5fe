"""Why does the autograd engine spend ~4 us per parameter accumulator handed no gradient? (dev tool)

Hypothesis: ``InputBuffer::device()`` of an accumulator handed ``None`` is the CPU, so the engine
pushes each of them from the CUDA device thread (where the graph replay's backward runs) onto the
CPU ready queue of the thread that called ``backward()``: one cross-thread hand-off per parameter.
If so, routing the parameters through one "gate" node whose gradient is a zero-size *CPU* tensor
runs the gate, and the 64 accumulators after it, on the calling thread: one hand-off in all.

Variants, each ``loss.backward()`` through a Function standing for the graph replay on a (8, 256)
CUDA input, its backward returning a ready gradient for the input:

* ``no params``: the Function takes the input and one zero-size leaf (what ``direct_grads`` leaves);
* ``64 params, None``: it also takes 64 CUDA leaves and hands them ``None`` (the default today);
* ``gate cpu``: the 64 leaves feed a gate Function whose output is a zero-size CPU tensor, which
  the replay Function takes instead, handing it a zero-size CPU gradient; the gate hands ``None`` on;
* ``gate cuda``: the same with a zero-size CUDA token (a control: the hand-offs stay).

Prints host microseconds per ``backward()`` (median of interleaved rounds).
Usage: ``PYTHONPATH=. python3 tools/exp_accumulator_thread.py``

Measured on the H200 machine (2026-11-28, torch 2.11): no params 181 us, 64 params handed ``None``
592 us, gate cpu 668 us, gate cuda 607 us (IQRs 69-241 us). The hypothesis does not hold: the
accumulators cost about 6.5 us each with or without a thread hand-off, so a gate saves nothing.
On the CPU stand-in (all nodes on one thread) they cost 2.4 us each, with a host about as fast.
"""
import statistics
import time

import torch

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N = 64
params = [torch.randn(256, 256, device=dev, requires_grad=True) for _ in range(N)]
x = torch.randn(8, 256, device=dev)
ready = torch.randn(8, 256, device=dev)
leaf = torch.zeros(0, device=dev, requires_grad=True)  # direct_grads' token: one accumulator


class Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *rest):
        # A zero-size input is a gate's token: it gets a zero-size gradient on its own device.
        ctx.grads = [torch.zeros(0, device=r.device) if r.numel() == 0 else None for r in rest]
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return (ready, *ctx.grads)


class Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, device, *ps):
        return torch.zeros(0, device=device)

    @staticmethod
    def backward(ctx, g):
        return (None,) + (None,) * N


def step(kind):
    if kind == "no params":
        out = Replay.apply(x, leaf)
    elif kind == "64 params, None":
        out = Replay.apply(x, *params)
    else:
        token = Gate.apply(torch.device("cpu") if kind == "gate cpu" else dev, *params)
        out = Replay.apply(x, token)
    loss = out.square().mean()
    t0 = time.perf_counter()
    loss.backward()
    return (time.perf_counter() - t0) * 1e6


kinds = ["no params", "64 params, None", "gate cpu", "gate cuda"]
for k in kinds:
    for _ in range(50):
        step(k)
if dev.type == "cuda":
    torch.cuda.synchronize()
times = {k: [] for k in kinds}
for _ in range(40):
    for k in kinds:
        times[k].append(statistics.median(step(k) for _ in range(25)))
if dev.type == "cuda":
    torch.cuda.synchronize()
for k in kinds:
    print(f"{k:<18} backward() {statistics.median(times[k]):8.1f} us host (IQR "
          f"{statistics.quantiles(times[k], n=4)[2] - statistics.quantiles(times[k], n=4)[0]:.1f})")
assert all(p.grad is None for p in params), "no variant hands a parameter a gradient"
