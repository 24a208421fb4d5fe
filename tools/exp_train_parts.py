"""Where the host time of a graphed ``direct_grads`` training step goes, inside the module's own code (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_train_parts.py [fused]`` on the GPU machine.

mlp8's training step (``zero_grad``, forward, ``square().mean()``, ``backward()``, SGD's ``step``) with
``cuda_graph=True, direct_grads=True``; the module call, ``_Replay.forward``, ``_Replay.backward`` and the
hand-out of the gradients (``_HandOut.__call__``) are wrapped in timers, so each step's ``backward()``
splits into the module's parts and the rest (the engine, the loss's nodes, the thread hand-offs). Against
it, the engine alone on a Function with no leaves. Medians of 500 steps, microseconds.
"""
import statistics
import sys
import time

import torch

from parallel_modules import Parallel
from parallel_modules import _graphs
from parallel_modules._cases import CASES

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
case = CASES["mlp8-train"]
x = case.make_input(8, dev, torch.float32)
model = Parallel(*case.branches(dev, torch.float32), join=case.join, dim=case.dim, cuda_graph=True,
                 direct_grads=True, fuse="fused" in sys.argv)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
spent: dict[str, float] = {}


def timed(name, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] = spent.get(name, 0.0) + (time.perf_counter() - t0) * 1e6
    return wrapper


_graphs._Replay.forward = staticmethod(timed("_Replay.forward", _graphs._Replay.forward))
_graphs._Replay.backward = staticmethod(timed("_Replay.backward", _graphs._Replay.backward))
_graphs._HandOut.__call__ = timed("_HandOut.__call__", _graphs._HandOut.__call__)
# Finer: what those call (each timer costs about half a microsecond itself).
for name in ("_launch", "_after_hand_outs", "_hand_out", "_direct_allowed", "_will_execute_node"):
    setattr(_graphs, name, timed(name, getattr(_graphs, name)))
_graphs._GradCopies.reused = timed("_GradCopies.reused", _graphs._GradCopies.reused)
_graphs._GradCopies._counts = staticmethod(timed("_GradCopies._counts", _graphs._GradCopies._counts))
_graphs._GradCopies.fresh = timed("_GradCopies.fresh", _graphs._GradCopies.fresh)
_graphs._Graph._copy_in = timed("_Graph._copy_in", _graphs._Graph._copy_in)
_graphs._Graph._order = timed("_Graph._order", _graphs._Graph._order)
_graphs._Graph.replay = timed("_Graph.replay", _graphs._Graph.replay)
_graphs._Graph.reclaim = timed("_Graph.reclaim", _graphs._Graph.reclaim)
_graphs._Graph.lend_grads = timed("_Graph.lend_grads", _graphs._Graph.lend_grads)
_graphs._bump_versions = timed("_bump_versions", _graphs._bump_versions)
_graphs._CudaGraphs.__call__ = timed("_CudaGraphs.__call__", _graphs._CudaGraphs.__call__)
_graphs._CudaGraphs._key = timed("_CudaGraphs._key", _graphs._CudaGraphs._key)
_graphs._HandOut.queue = staticmethod(timed("_HandOut.queue", _graphs._HandOut.queue))
torch.Tensor.clone = timed("Tensor.clone", torch.Tensor.clone)
parts: dict[str, list[float]] = {}
for i in range(600):
    spent.clear()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    t1 = time.perf_counter()
    y = model(x)
    t2 = time.perf_counter()
    loss = y.square().mean()
    t3 = time.perf_counter()
    loss.backward()
    t4 = time.perf_counter()
    opt.step()
    t5 = time.perf_counter()
    if i >= 100:
        row = {"zero_grad": t1 - t0, "module call": t2 - t1, "loss": t3 - t2, "backward()": t4 - t3, "step": t5 - t4}
        row = {k: v * 1e6 for k, v in row.items()}
        row.update(spent)
        row["backward() less the module's parts"] = row["backward()"] - spent["_Replay.backward"] - spent["_HandOut.__call__"]
        for k, v in row.items():
            parts.setdefault(k, []).append(v)


class _One(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        return g


x0 = torch.zeros(8, device=dev, requires_grad=True)
alone = []
for i in range(600):
    x0.grad = None
    loss = _One.apply(x0).square().mean()
    t0 = time.perf_counter()
    loss.backward()
    alone.append((time.perf_counter() - t0) * 1e6)
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: mlp8 training step, direct_grads"
      f"{', fused' if 'fused' in sys.argv else ''}, host us (medians of 500 steps)")
for k, v in parts.items():
    print(f"{k:<40}{statistics.median(v):8.1f}")
print(f"{'engine alone: Function(x).square().mean()':<40}{statistics.median(alone[100:]):8.1f}")
