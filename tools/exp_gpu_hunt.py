r"""Differential stress test of ``Parallel`` / ``ParallelSequential`` against plain references (dev tool, not shipped).

Run from the repository root:  ``PYTHONPATH=. python3 tools/exp_gpu_hunt.py``

Every scenario builds small models with a fixed seed, calls the library's modules on fresh random
inputs many times and compares each result with a plain sequential computation (the branches called
one after another, ``nn.Sequential`` on the whole batch, an eager deep copy for training). fp32 with
TF32 off: unfused streams and graphs must be bit for bit equal; fused modules allclose(1e-5, 1e-5);
pipelines (other batch sizes, so other kernels) atol 1e-5.

Prints one line per scenario -- ``OK name``, ``FAIL name: reason``, ``SKIP name (why)`` -- and a
final ``N scenarios, K failed``. Exit status 1 if any failed. Scenarios that need CUDA are skipped
without it; the others run on the CPU fallback. Budget: about 3 minutes on an H200.
"""

from __future__ import annotations

import copy
import gc
import sys
import threading
import time
import traceback
import warnings
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn

from parallel_modules import Parallel, ParallelSequential

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
TIME_BUDGET_S = 210.0  # scenarios still to run after this are skipped, so the whole run stays < 4 min
SLEEP = 2_000_000  # GPU cycles (about 1 ms on an H200): long enough that a missing wait reads early

SCENARIOS: list[tuple[str, Callable[[], None], bool]] = []


def scenario(cuda: bool = False) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        SCENARIOS.append((fn.__name__, fn, cuda))
        return fn
    return register


class Fail(AssertionError):
    pass


# ---------------------------------------------------------------------------------------- helpers
def _leaves(x: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(x, dict):
        return [leaf for k in x for leaf in _leaves(x[k], f"{path}[{k!r}]")]
    if isinstance(x, (tuple, list)):
        return [leaf for i, v in enumerate(x) for leaf in _leaves(v, f"{path}[{i}]")]
    return [(path, x)]


def _structure(x: Any) -> Any:
    if isinstance(x, dict):
        return ("dict", tuple(x), tuple(_structure(v) for v in x.values()))
    if isinstance(x, (tuple, list)):
        return ("seq", tuple(_structure(v) for v in x))
    return "tensor" if isinstance(x, torch.Tensor) else type(x).__name__


def check(got: Any, ref: Any, what: str, exact: bool = True, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    r"""Raise ``Fail`` unless ``got`` equals ``ref`` (bitwise, or allclose) leaf by leaf."""
    if _structure(got) != _structure(ref):
        raise Fail(f"{what}: structure {_structure(got)} != reference {_structure(ref)}")
    for (path, g), (_, r) in zip(_leaves(got), _leaves(ref)):
        if not isinstance(r, torch.Tensor):
            if g != r:
                raise Fail(f"{what}{path}: {g!r} != {r!r}")
            continue
        if g.shape != r.shape or g.dtype != r.dtype:
            raise Fail(f"{what}{path}: {tuple(g.shape)} {g.dtype} != reference {tuple(r.shape)} {r.dtype}")
        if g.device != r.device:
            raise Fail(f"{what}{path}: on {g.device}, reference on {r.device}")
        ok = torch.equal(g, r) if exact else torch.allclose(g, r, rtol=rtol, atol=atol)
        if not ok:
            d = (g.double() - r.double()).abs()
            d = d[~torch.isnan(d)]
            diff = d.max().item() if d.numel() else float("nan")
            kind = "not bitwise equal" if exact else f"not allclose(rtol={rtol}, atol={atol})"
            raise Fail(f"{what}{path}: {kind}, max abs diff {diff:.3g} (max |reference| {r.abs().max().item():.3g})")


def clone_tree(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(clone_tree(v) for v in x)
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def ref_join(join: Any, outs: list[Any], names: list[str] | None = None, dim: int = 1) -> Any:
    r"""What a plain Python loop would give for ``join`` over the branches' outputs."""
    if join in (None, "tuple"):
        return tuple(outs)
    if join == "dict":
        return dict(zip(names, outs))
    if join == "cat":
        return torch.cat(outs, dim)
    if join == "stack":
        return torch.stack(outs, dim)
    total = outs[0]
    for o in outs[1:]:
        total = total + o
    return total / len(outs) if join == "mean" else total


def mlp(i: int = 32, h: int = 48, o: int = 16, layers: int = 2) -> nn.Sequential:
    mods: list[nn.Module] = []
    d = i
    for _ in range(layers - 1):
        mods += [nn.Linear(d, h), nn.GELU()]
        d = h
    mods.append(nn.Linear(d, o))
    return nn.Sequential(*mods)


def conv_branch(c: int = 8, o: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c, o, 3, padding=1), nn.ReLU(), nn.Conv2d(o, o, 1))


class Sleepy(nn.Module):
    r"""Keeps the current stream busy for ``SLEEP`` cycles, then runs ``inner``: a missing wait shows."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()))
        if first.is_cuda:
            torch.cuda._sleep(SLEEP)
        return self.inner(*args, **kwargs)


class TwoArgs(nn.Module):
    r"""``(x, y, scale=, mask=)`` -> a tensor: multiple tensor arguments and keywords."""

    def __init__(self, d: int = 32, o: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(d, o)
        self.b = nn.Linear(d, o)

    def forward(self, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0, mask: torch.Tensor | None = None):
        out = self.a(x) * scale + torch.tanh(self.b(y))
        return out if mask is None else out * mask


class Pair(nn.Module):
    r"""Returns a tuple (for tuple outputs between pipeline stages / structured branch outputs)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d // 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(self.a(x)), self.b(x)


class Unpair(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d // 2, d)

    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.a(t[0]) + self.b(t[1])


def rand(*shape: int, dtype: torch.dtype = torch.float32, device: Any = None) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=DEV if device is None else device)


def check_calls(blk: Callable, ref: Callable, shape: tuple[int, ...], calls: int, what: str, exact: bool = True) -> None:
    r"""``check`` ``blk`` against ``ref`` on ``calls`` fresh random inputs of ``shape``."""
    for i in range(calls):
        x = rand(*shape)
        check(blk(x), ref(x), f"{what} call {i}", exact=exact)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def plain(branches: list[nn.Module], join: Any, names: list[str] | None = None, dim: int = 1) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        return ref_join(join, [b(*args, **kwargs) for b in branches], names, dim)
    return run


# ---------------------------------------------------------------------------------------- Parallel
JOINS = ["cat", "sum", "mean", "stack", "tuple", "dict"]


def _joined_block(join: str, **settings: Any) -> tuple[Parallel, Callable]:
    names = ["enc", "dec", "aux"]
    branches = [mlp(), mlp(h=24), nn.Sequential(nn.Linear(32, 16), nn.Tanh())]
    if join == "dict" or join == "tuple":
        blk = Parallel(OrderedDict(zip(names, branches)), join=join, **settings)
    else:
        blk = Parallel(*branches, join=join, **settings)
    blk = blk.to(DEV).eval()
    return blk, plain(list(blk), join, names)


@scenario()
def parallel_joins_streams() -> None:
    r"""streams=True/"auto"/False x every named join, fresh inputs and batch sizes every call: bitwise."""
    for streams in (True, "auto", False):
        for join in JOINS:
            blk, ref = _joined_block(join, streams=streams)
            with torch.no_grad():
                for i in range(8):
                    x = rand((4, 4, 7, 4)[i % 4], 32)
                    check(blk(x), ref(x), f"streams={streams!r} join={join} call {i}")
            # with autograd recording: outputs and input gradients bitwise
            x = rand(5, 32).requires_grad_()
            out = blk(x)
            g, = torch.autograd.grad(sum(t.sum() for _, t in _leaves(out)), x)
            x2 = x.detach().requires_grad_()
            g2, = torch.autograd.grad(sum(t.sum() for _, t in _leaves(ref(x2))), x2)
            check(g, g2, f"streams={streams!r} join={join} input grad", exact=False, atol=1e-6, rtol=1e-6)


@scenario(cuda=True)
def parallel_joins_graph() -> None:
    r"""cuda_graph=True x every named join: replays bitwise equal to the branches called in turn."""
    for join in JOINS:
        blk, ref = _joined_block(join, cuda_graph=True)
        with torch.no_grad():
            check_calls(blk, ref, (6, 32), 10, f"join={join}")


@scenario()
def many_branches() -> None:
    r"""1, 2, 9 and 33 branches, streams=True and graphed: bitwise."""
    for n in (1, 2, 9, 33):
        for settings in ({"streams": True}, {"cuda_graph": True}):
            if settings.get("cuda_graph") and not CUDA:
                continue
            blk = Parallel(*[nn.Linear(16, 4) for _ in range(n)], **settings).to(DEV).eval()
            ref = plain(list(blk), "cat")
            with torch.no_grad():
                check_calls(blk, ref, (3, 16), 4, f"n={n} {settings}")


def _nested(outer: dict, inner: dict) -> tuple[Parallel, Callable]:
    inner_blk = Parallel(mlp(), Sleepy(mlp()), join="sum", **inner)
    blk = Parallel(inner_blk, nn.Sequential(mlp(), nn.ReLU()), Parallel(mlp(o=8), mlp(o=8), **inner),
                   join="cat", **outer).to(DEV).eval()
    a, b, c = blk[0], blk[1], blk[2]

    def ref(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([a[0](x) + a[1](x), b(x), torch.cat([c[0](x), c[1](x)], 1)], 1)
    return blk, ref


@scenario()
def nested_parallel() -> None:
    r"""Parallel inside Parallel, every mix of streams and graphs, inference and input gradient."""
    combos = [({"streams": True}, {"streams": True}), ({"streams": "auto"}, {"streams": True}),
              ({"cuda_graph": True}, {"streams": True}), ({"streams": True}, {"cuda_graph": True}),
              ({"cuda_graph": True}, {"cuda_graph": True})]
    for outer, inner in combos:
        if not CUDA and ("cuda_graph" in outer or "cuda_graph" in inner):
            continue
        blk, ref = _nested(outer, inner)
        with torch.no_grad():
            check_calls(blk, ref, (4, 32), 6, f"outer={outer} inner={inner}")


@scenario()
def nested_in_pipeline() -> None:
    r"""A Parallel as a stage of ParallelSequential (chunks 1/2/3, eager and graphed) vs nn.Sequential."""
    for chunks in (1, 2, 3):
        for graph in ((False, True) if CUDA else (False,)):
            torch.manual_seed(chunks)
            stages = [nn.Linear(32, 32), Parallel(mlp(o=16), mlp(o=16), streams=True, join="cat"),
                      nn.GELU(), nn.Linear(32, 8)]
            ref = nn.Sequential(*copy.deepcopy(stages)).to(DEV).eval()
            pipe = ParallelSequential(*stages, chunks=chunks, cuda_graph=graph).to(DEV).eval()
            with torch.no_grad():
                check_calls(pipe, ref, (10, 32), 6, f"chunks={chunks} graph={graph}", exact=False)


@scenario()
def kwargs_and_multiple_args() -> None:
    r"""Branches on (x, y, scale=float, mask=tensor): streams and graphs; floats change every call."""
    modes = [{"streams": True}, {"streams": "auto"}] + ([{"cuda_graph": True, "max_graphs": 3}] if CUDA else [])
    for settings in modes:
        blk = Parallel(TwoArgs(), Sleepy(TwoArgs()), TwoArgs(), join="cat", **settings).to(DEV).eval()
        ref = plain(list(blk), "cat")
        with torch.no_grad():
            for i in range(10):
                x, y, m = rand(4, 32), rand(4, 32), rand(4, 16)
                scale = [0.5, 2.0, -1.0][i % 3]
                if i % 2:
                    check(blk(x, y, scale=scale, mask=m), ref(x, y, scale=scale, mask=m), f"{settings} kw call {i}")
                else:
                    check(blk(x, y, scale), ref(x, y, scale), f"{settings} pos call {i}")
            # aliased arguments: the same tensor twice, then distinct ones, then aliased again
            x = rand(4, 32)
            check(blk(x, x), ref(x, x), f"{settings} aliased args")
            for i in range(3):
                x, y = rand(4, 32), rand(4, 32)
                check(blk(x, y), ref(x, y), f"{settings} after aliased {i}")
                check(blk(y, y), ref(y, y), f"{settings} aliased again {i}")


@scenario(cuda=True)
def caller_stream() -> None:
    r"""Caller inside torch.cuda.stream(s), input produced late on s, outputs read on s (no sync)."""
    modes = [{"streams": True}, {"cuda_graph": True}, {"cuda_graph": True, "fuse": True},
             {"streams": True, "fuse": True}]
    for settings in modes:
        fused = settings.get("fuse", False)
        branches = [mlp() for _ in range(4)] if fused else [mlp(), Sleepy(mlp()), mlp(h=8)]
        blk = Parallel(*branches, join="cat", **settings).to(DEV).eval()
        ref = plain(list(blk), "cat")
        s = torch.cuda.Stream()
        with torch.no_grad(), torch.cuda.stream(s):
            results = []
            for i in range(8):
                x = torch.empty(6, 32, device=DEV)
                torch.cuda._sleep(SLEEP)  # the producer is late: forks must wait for s
                x.normal_()
                out = blk(x)
                results.append((out.sum(dim=1), ref(x).sum(dim=1)))  # read on s, right away
                del out, x
                # other work on s, reusing freed memory
                junk = torch.full((6, 32), float(i), device=DEV)
                del junk
        s.synchronize()
        for i, (got, want) in enumerate(results):
            check(got, want, f"{settings} call {i}", exact=not fused, atol=1e-4, rtol=1e-5)
    # tuple join on a side stream: outputs kept and read after another call
    blk = Parallel(Sleepy(mlp()), mlp(), join=None, streams=True).to(DEV).eval()
    s = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(s):
        x1, x2 = rand(4, 32), rand(4, 32)
        o1 = blk(x1)
        o2 = blk(x2)
        r1 = (blk[0](x1), blk[1](x1))
        r2 = (blk[0](x2), blk[1](x2))
        check(o1, r1, "tuple join kept across calls on s")
        check(o2, r2, "tuple join second call on s")


def _keep_outputs(blk: nn.Module, ref: Callable, what: str, shape: tuple, drop_first: int = 20,
                  kept: int = 5) -> None:
    with torch.no_grad():
        for i in range(drop_first):  # the caller drops outputs: graphs may start lending buffers
            x = rand(*shape)
            out = blk(x)
            check(out, ref(x), f"{what} dropped call {i}")
            del out
        outs, refs = [], []
        for i in range(kept):
            x = rand(*shape)
            outs.append(blk(x))
            refs.append(ref(x))
        for i in range(kept):  # same-address inputs: a graph reading its input in place
            x = rand(*shape)
            outs.append(blk(x))
            refs.append(ref(x))
            del x
        sync()
        for i, (o, r) in enumerate(zip(outs, refs)):
            check(o, r, f"{what} kept output {i} (overwritten?)")


@scenario()
def outputs_kept_across_calls() -> None:
    r"""Outputs kept from several calls must all still equal their references at the end."""
    modes = [{"streams": True}, {"streams": "auto"}]
    if CUDA:
        modes += [{"cuda_graph": True}, {"cuda_graph": True, "streams": False}, {"cuda_graph": True, "fuse": True}]
    for settings in modes:
        for join in ("cat", "tuple", "sum"):
            fused = settings.get("fuse", False)
            branches = [mlp() for _ in range(3)]
            blk = Parallel(*branches, join=join, **settings).to(DEV).eval()
            ref = plain(list(blk), join)
            if fused:
                _keep_outputs_close(blk, ref, f"{settings} join={join}")
            else:
                _keep_outputs(blk, ref, f"{settings} join={join}", (8, 32))


def _keep_outputs_close(blk: nn.Module, ref: Callable, what: str) -> None:
    with torch.no_grad():
        check_calls(blk, ref, (8, 32), 20, f"{what} dropped", exact=False)
        outs, refs = [], []
        for i in range(6):
            x = rand(8, 32)
            outs.append(blk(x))
            refs.append(ref(x))
        for i, (o, r) in enumerate(zip(outs, refs)):
            check(o, r, f"{what} kept output {i}", exact=False)


@scenario(cuda=True)
def static_outputs_semantics() -> None:
    r"""static_outputs=True: each output right after its call is right (earlier ones may be overwritten)."""
    for join in ("cat", "tuple"):
        blk = Parallel(mlp(), mlp(), join=join, cuda_graph=True, static_outputs=True).to(DEV).eval()
        ref = plain(list(blk), join)
        with torch.no_grad():
            last = None
            for i in range(12):
                x = rand(5, 32)
                out = blk(x)
                check(out, ref(x), f"join={join} call {i}")
                last = (out, ref(x))
            sync()
            check(last[0], last[1], f"join={join} last output after sync")
            # a second signature must not disturb the first's buffers' contents as returned now
            y = rand(9, 32)
            check(blk(y), ref(y), f"join={join} second signature")
            x = rand(5, 32)
            check(blk(x), ref(x), f"join={join} back to the first signature")


@scenario(cuda=True)
def graph_feedback_loop() -> None:
    r"""y = blk(y) 30 times (the input is the block's own lent output buffer) vs the same loop eagerly."""
    for settings in ({"cuda_graph": True}, {"cuda_graph": True, "fuse": True}, {"streams": True}):
        fused = settings.get("fuse", False)
        blk = Parallel(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)], join="mean",
                       **settings).to(DEV).eval()
        ref = plain(list(blk), "mean")
        with torch.no_grad():
            for rep in range(2):
                y = r = rand(4, 32)
                for i in range(30):
                    y = blk(y)
                    r = ref(r)
                    if i % 10 == 9:
                        check(y, r, f"{settings} rep {rep} step {i}", exact=not fused, atol=1e-4)
                # the same, keeping every intermediate
                y = r = rand(4, 32)
                ys, rs = [], []
                for i in range(12):
                    y = blk(y)
                    r = ref(r)
                    ys.append(y)
                    rs.append(r)
                check(ys, rs, f"{settings} rep {rep} kept intermediates", exact=not fused, atol=1e-4)


@scenario(cuda=True)
def graph_same_address_other_strides() -> None:
    r"""Inputs at the first call's address but transposed / sliced / in-place refilled: no stale read."""
    blk = Parallel(nn.Linear(32, 8), nn.Linear(32, 8), join="cat", cuda_graph=True).to(DEV).eval()
    ref = plain(list(blk), "cat")
    with torch.no_grad():
        x = rand(32, 32)
        for i in range(20):
            check(blk(x), ref(x), f"in place refill {i}")
            x.normal_()  # same address, new values
        xt = x.t()  # same data_ptr, other strides
        check(blk(xt), ref(xt), "transposed view at the same address")
        check(blk(x), ref(x), "back to the original layout")
        big = rand(64, 32)
        check(blk(big[:32]), ref(big[:32]), "slice sharing an address")
        big[:32].copy_(x)
        big[:32].mul_(-1)
        check(blk(big[:32]), ref(big[:32]), "slice refilled")
        z = x.neg()  # ordinary tensor
        check(blk(z), ref(z), "negated copy")
        # a non-contiguous input of the same shape as contiguous ones
        w = rand(32, 64)[:, ::2]
        check(blk(w), ref(w), "strided input")


@scenario(cuda=True)
def graph_signature_cycling() -> None:
    r"""max_graphs=2 and 4 shapes x 2 dtypes, cycled: evictions and recaptures give right results."""
    blk = Parallel(mlp(), mlp(h=16), Sleepy(mlp()), join="cat", cuda_graph=True, max_graphs=2).to(DEV).eval()
    half = copy.deepcopy(blk).half()
    ref32, ref16 = plain(list(blk), "cat"), plain(list(half), "cat")
    kept = []
    with torch.no_grad():
        for rnd in range(3):
            for b in (2, 5, 8, 3):
                x = rand(b, 32)
                out = blk(x)
                check(out, ref32(x), f"fp32 round {rnd} batch {b}")
                kept.append((out, ref32(x)))
                h = rand(b, 32, dtype=torch.float16)
                check(half(h), ref16(h), f"fp16 round {rnd} batch {b}")
    for i, (o, r) in enumerate(kept):
        check(o, r, f"kept output {i} after evictions")


@scenario(cuda=True)
def graph_mode_toggles() -> None:
    r"""BatchNorm branches, train/eval and requires_grad toggles: outputs, grads and running stats vs eager."""
    def make() -> list[nn.Module]:
        return [nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU()), mlp(), nn.Linear(32, 16)]
    torch.manual_seed(7)
    branches = make()
    ref_branches = copy.deepcopy(branches)
    blk = Parallel(*branches, join="cat", cuda_graph=True, max_graphs=3).to(DEV)
    refs = nn.ModuleList(ref_branches).to(DEV)
    ref = plain(list(refs), "cat")
    plan = [("train", True, False), ("eval", False, False), ("train", True, True), ("eval", True, True),
            ("eval", False, True), ("train", False, False), ("train", True, False), ("eval", True, False)]
    for rep in range(2):
        for j, (mode, grad_on, x_grad) in enumerate(plan):
            getattr(blk, mode)()
            getattr(refs, mode)()
            for k in range(2):
                x = rand(6, 32)
                xr = x.clone()
                if x_grad:
                    x.requires_grad_()
                    xr.requires_grad_()
                what = f"rep {rep} step {j} {mode} grad={grad_on} x_grad={x_grad} call {k}"
                with torch.set_grad_enabled(grad_on):
                    out, want = blk(x), ref(xr)
                check(out, want, what, exact=False, atol=1e-6, rtol=1e-6)
                if out.requires_grad:
                    gy = rand(*out.shape)
                    out.backward(gy)
                    want.backward(gy)
                    if x_grad:
                        check(x.grad, xr.grad, f"{what} input grad", exact=False, atol=1e-6, rtol=1e-6)
            for (n, p), (_, q) in zip(blk.named_parameters(), refs.named_parameters()):
                if p.grad is not None or q.grad is not None:
                    check(p.grad, q.grad, f"rep {rep} step {j} grad of {n}", exact=False, atol=1e-5, rtol=1e-5)
            for (n, b), (_, c) in zip(blk.named_buffers(), refs.named_buffers()):
                check(b, c, f"rep {rep} step {j} buffer {n}", exact=False, atol=1e-6, rtol=1e-6)
            # requires_grad toggles of parameters: freeze the first branch for the next steps, then unfreeze
            blk[0].requires_grad_(j % 3 != 1)
            refs[0].requires_grad_(j % 3 != 1)
            blk.zero_grad()
            refs.zero_grad()


@scenario(cuda=True)
def graph_sees_parameter_updates() -> None:
    r"""Inference and training graphs: after an optimizer step / in-place edit the next call uses new weights."""
    blk = Parallel(mlp(), mlp(), Sleepy(mlp()), join="sum", cuda_graph=True).to(DEV)
    ref = plain(list(blk), "sum")
    opt = torch.optim.SGD(blk.parameters(), lr=0.1)
    for step in range(6):
        blk.eval()
        with torch.no_grad():
            for k in range(3):
                x = rand(4, 32)
                check(blk(x), ref(x), f"step {step} eval call {k}")
        blk.train()
        x = rand(4, 32)
        out = blk(x)
        check(out, ref(x), f"step {step} train forward", exact=False, atol=1e-6, rtol=1e-6)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # an edit in place, outside any optimizer
            blk[1][0].weight.mul_(0.9)
            blk[0][-1].bias.add_(0.01)
    # copy_ of a whole state dict
    blk.eval()
    new = Parallel(mlp(), mlp(), Sleepy(mlp()), join="sum").to(DEV)
    blk.load_state_dict(new.state_dict())
    with torch.no_grad():
        x = rand(4, 32)
        check(blk(x), plain(list(new), "sum")(x), "after load_state_dict")


def _train_compare(blk: Parallel, branches_ref: list[nn.Module], join: str, opt_name: str, what: str,
                   exact_fwd: bool, steps: int = 6, tol: float = 1e-6) -> None:
    refs = nn.ModuleList(branches_ref).to(DEV).train()
    blk.train()
    ref = plain(list(refs), join)

    def make_opt(params: Any) -> torch.optim.Optimizer:
        if opt_name == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return torch.optim.Adam(params, lr=1e-3)

    opt, opt_r = make_opt(blk.parameters()), make_opt(refs.parameters())
    held: list[tuple[torch.Tensor, torch.Tensor]] = []  # gradients kept past zero_grad(): must not change
    w = rand(6, 64 if join == "cat" else 16)

    def fwd_bwd(x: torch.Tensor, tag: str) -> None:
        out, want = blk(x), ref(x.detach().clone().requires_grad_(x.requires_grad))
        check(out, want, f"{what} {tag} forward", exact=exact_fwd, atol=tol, rtol=tol)
        (out * w).sum().backward()
        (want * w).sum().backward()

    for step in range(steps):
        tag = f"step {step}"
        x = rand(6, 32)
        if step % 3 == 2:  # gradient of the input alone, then a normal pass
            xg = x.clone().requires_grad_()
            xr = x.clone().requires_grad_()
            g, = torch.autograd.grad((blk(xg) * w).sum(), xg)
            gr, = torch.autograd.grad((ref(xr) * w).sum(), xr)
            check(g, gr, f"{what} {tag} autograd.grad on input", exact=False, atol=tol, rtol=tol)
        fwd_bwd(x, tag)
        if step % 2 == 1:  # accumulate over a second pass, no zero_grad in between
            fwd_bwd(rand(6, 32), f"{tag} accumulated")
        for (n, p), (_, q) in zip(blk.named_parameters(), refs.named_parameters()):
            check(p.grad, q.grad, f"{what} {tag} grad {n}", exact=False, atol=tol, rtol=1e-5)
        if step in (0, 2):  # (zero_grad below sets .grad to None: the kept tensor is the caller's)
            p0 = list(blk.parameters())[step]
            held.append((p0.grad, p0.grad.detach().clone()))
        opt.step()
        opt_r.step()
        for (n, p), (_, q) in zip(blk.named_parameters(), refs.named_parameters()):
            check(p, q, f"{what} {tag} parameter {n} after {opt_name} step", exact=False, atol=tol, rtol=1e-5)
        none = step % 2 == 0
        opt.zero_grad(set_to_none=none)
        opt_r.zero_grad(set_to_none=none)
    sync()
    for kept, value in held:
        check(kept, value, f"{what} gradient kept past zero_grad (overwritten?)")


@scenario()
def training_graph_vs_eager() -> None:
    r"""cuda_graph=True (and direct_grads) training with SGD/Adam vs an eager deep copy of the branches."""
    graphs = [dict(cuda_graph=True), dict(cuda_graph=True, direct_grads=True)] if CUDA else [dict(cuda_graph=True)]
    for settings in graphs + [dict(streams=True)]:
        for opt_name in ("sgd", "adam"):
            torch.manual_seed(11)
            branches = [mlp(), mlp(h=16), mlp(), mlp(layers=3)]
            ref_branches = copy.deepcopy(branches)
            blk = Parallel(*branches, join="cat", **settings).to(DEV)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _train_compare(blk, ref_branches, "cat", opt_name, f"{settings} {opt_name}", exact_fwd=False)


@scenario()
def fused_inference() -> None:
    r"""fuse=True/"auto" (MLP and conv branches; <=16 and >16 rows), eager and graphed vs unfused."""
    for fuse in (True, "auto"):
        for graph in ((False, True) if CUDA else (False,)):
            for rows in (8, 40):
                torch.manual_seed(3)
                branches = [nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(),
                                          nn.Linear(64, 16)) for _ in range(6)]
                blk = Parallel(*branches, join="cat", fuse=fuse, cuda_graph=graph).to(DEV).eval()
                refs = nn.ModuleList(copy.deepcopy(list(blk))).eval()  # same weights, unfused
                rf = plain(list(refs), "cat")
                with torch.no_grad():
                    check_calls(blk, rf, (rows, 32), 6, f"mlp fuse={fuse!r} graph={graph} rows={rows}", exact=False)
                    for join in ("sum", "stack", "tuple"):
                        blk.join = join
                        rf = plain(list(refs), join)
                        x = rand(rows, 32)
                        check(blk(x), rf(x), f"mlp fuse={fuse!r} graph={graph} join={join}", exact=False)
            torch.manual_seed(4)
            blk = Parallel(*[conv_branch() for _ in range(4)], join="cat", fuse=fuse, cuda_graph=graph).to(DEV).eval()
            refs = nn.ModuleList(copy.deepcopy(list(blk))).eval()
            rf = plain(list(refs), "cat")
            with torch.no_grad():
                check_calls(blk, rf, (2, 8, 12, 12), 5, f"conv fuse={fuse!r} graph={graph}", exact=False)


@scenario()
def fused_training() -> None:
    r"""fuse=True/"auto" training (eager and graphed, SGD/Adam) vs unfused eager branches."""
    graphs = (False, True) if CUDA else (False,)
    for fuse in (True, "auto"):
        for graph in graphs:
            for opt_name in ("sgd", "adam"):
                torch.manual_seed(5)
                branches = [mlp() for _ in range(4)]
                ref_branches = copy.deepcopy(branches)
                blk = Parallel(*branches, join="cat", fuse=fuse, cuda_graph=graph,
                               direct_grads=graph and opt_name == "adam").to(DEV)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _train_compare(blk, ref_branches, "cat", opt_name, f"fuse={fuse!r} graph={graph} {opt_name}",
                                   exact_fwd=False, steps=5, tol=1e-4)  # (sums of 40-sized gradients)


# ---------------------------------------------------------------------------------------- pipelines
@scenario()
def pipeline_inputs() -> None:
    r"""ParallelSequential chunks 1/2/3/4 (uneven), device / pinned / pageable input, eager and graphed."""
    kinds = ["device"] + (["pinned", "pageable"] if CUDA else [])
    for chunks in (1, 2, 3, 4):
        for graph in ((False, True) if CUDA else (False,)):
            torch.manual_seed(chunks)
            stages = [nn.Sequential(nn.Linear(32, 64), nn.GELU()), nn.Linear(64, 64), Sleepy(nn.Linear(64, 16))]
            ref = nn.Sequential(*copy.deepcopy(stages)).to(DEV).eval()
            pipe = ParallelSequential(*stages, chunks=chunks, cuda_graph=graph).to(DEV).eval()
            kept = []
            with torch.no_grad():
                for kind in kinds:
                    for i in range(5):
                        x = torch.randn(10 + (i % 2), 32)  # 10 and 11 rows: uneven micro-batches
                        if kind == "device":
                            x = x.to(DEV)
                        elif kind == "pinned":
                            x = x.pin_memory()
                        out = pipe(x)
                        want = ref(x.to(DEV))
                        what = f"chunks={chunks} graph={graph} {kind} call {i}"
                        check(out, want, what, exact=False)
                        kept.append((out, want, what))
            sync()
            for out, want, what in kept:
                check(out, want, f"{what} (kept)", exact=False)


@scenario()
def pipeline_tuple_outputs() -> None:
    r"""Stages passing tuples, and a tuple-valued last stage, chunks 1/3, eager and graphed."""
    for chunks in (1, 3):
        for graph in ((False, True) if CUDA else (False,)):
            torch.manual_seed(2)
            stages = [Pair(), Unpair(), Pair()]
            ref = nn.Sequential(*copy.deepcopy(stages)).to(DEV).eval()
            pipe = ParallelSequential(*stages, chunks=chunks, cuda_graph=graph).to(DEV).eval()
            with torch.no_grad():
                for i in range(5):
                    x = rand(9, 32)
                    check(pipe(x), ref(x), f"chunks={chunks} graph={graph} call {i}", exact=False)
                    if CUDA:
                        xc = torch.randn(9, 32).pin_memory()
                        check(pipe(xc), ref(xc.to(DEV)), f"chunks={chunks} graph={graph} pinned call {i}",
                              exact=False)


@scenario()
def pipeline_training() -> None:
    r"""ParallelSequential chunks=3 training (device input) vs nn.Sequential: grads and parameters."""
    for graph in ((False, True) if CUDA else (False,)):
        torch.manual_seed(9)
        stages = [nn.Linear(32, 32), nn.GELU(), Parallel(mlp(), mlp(), streams=True), nn.Linear(32, 4)]
        ref = nn.Sequential(*copy.deepcopy(stages)).to(DEV)
        pipe = ParallelSequential(*stages, chunks=3, cuda_graph=graph).to(DEV)
        opt, opt_r = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(4):
            x = rand(11, 32)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = pipe(x)
            want = ref(x)
            check(out, want, f"graph={graph} step {step} forward", exact=False)
            out.square().sum().backward()
            want.square().sum().backward()
            for (n, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters()):
                check(p.grad, q.grad, f"graph={graph} step {step} grad {n}", exact=False)
            opt.step()
            opt_r.step()
            opt.zero_grad()
            opt_r.zero_grad()


# ---------------------------------------------------------------------------------------- concurrency
@scenario(cuda=True)
def interleaved_graphed_modules() -> None:
    r"""Two graphed modules called interleaved, chained (b(a(x))), outputs kept."""
    a = Parallel(mlp(o=16), mlp(o=16), join="cat", cuda_graph=True).to(DEV).eval()
    b = Parallel(nn.Linear(32, 32), Sleepy(nn.Linear(32, 32)), join="sum", cuda_graph=True).to(DEV).eval()
    ra, rb = plain(list(a), "cat"), plain(list(b), "sum")
    kept = []
    with torch.no_grad():
        for i in range(40):
            x, y = rand(4, 32), rand(4, 32)
            oa = a(x)
            ob = b(y)
            oc = b(oa)
            od = a(ob)
            check((oa, ob, oc, od), (ra(x), rb(y), rb(ra(x)), ra(rb(y))), f"call {i}")
            if i >= 30:
                kept.append(((oa, ob, oc, od), (ra(x), rb(y), rb(ra(x)), ra(rb(y)))))
    sync()
    for i, (o, r) in enumerate(kept):
        check(o, r, f"kept {i}")


def _threaded(blk: nn.Module, ref: Callable, what: str, own_streams: bool, calls: int = 25) -> None:
    r"""4 threads call ``blk`` at once; each checks every output right away (and drops it, so graphs may
    lend their buffers) and keeps every 5th one, checked again after all threads are done."""
    inputs = [[rand(4 + t, 32) for _ in range(calls)] for t in range(4)]  # made before: no draws in threads
    with torch.no_grad():
        refs = [[ref(x) for x in xs] for xs in inputs]
    sync()
    kept: list[list[tuple[int, Any]]] = [[] for _ in range(4)]
    bad: list[str] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work(t: int) -> None:
        try:
            stream = torch.cuda.Stream() if own_streams else torch.cuda.current_stream()
            barrier.wait()
            with torch.no_grad(), torch.cuda.stream(stream):
                for i, (x, r) in enumerate(zip(inputs[t], refs[t])):
                    out = blk(x)
                    if not torch.equal(out, r):  # read on the thread's stream, right away
                        bad.append(f"thread {t} call {i}: max abs diff {(out - r).abs().max().item():.3g}")
                    if i % 5 == 0:
                        kept[t].append((i, out))
                    del out
            stream.synchronize()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    if bad:
        raise Fail(f"{what}: {len(bad)} wrong outputs, first {bad[0]}")
    sync()
    for t in range(4):
        for i, out in kept[t]:
            check(out, refs[t][i], f"{what} thread {t} kept output of call {i}")


@scenario(cuda=True)
def threads_concurrent_calls() -> None:
    r"""One module called from 4 Python threads at once (own streams, and the default stream)."""
    for settings in ({"cuda_graph": True}, {"streams": True}, {"streams": "auto"}):
        for own in (True, False):
            torch.manual_seed(13)
            blk = Parallel(mlp(), Sleepy(mlp()), mlp(h=8), join="cat", **settings).to(DEV).eval()
            _threaded(blk, plain(list(blk), "cat"), f"{settings} own_streams={own}", own)


# ---------------------------------------------------------------------------------------- memory
def _memory(blk: nn.Module, what: str, calls: int = 500, slack_mb: float = 4.0) -> None:
    with torch.no_grad():
        for _ in range(40):
            # (Held across the next call, as below: a graphed block that finds a lent output
            # still held runs that call eagerly, and cuBLAS allocates the caller's stream its
            # workspace, 32 MiB on this GPU, once.)
            out = blk(rand(8, 32))
        del out
        sync()
        gc.collect()
        before = torch.cuda.memory_allocated()
        for _ in range(calls):
            out = blk(rand(8, 32))
        del out
        sync()
        gc.collect()
        after = torch.cuda.memory_allocated()
    grown = (after - before) / 2**20
    if grown > slack_mb:
        raise Fail(f"{what}: memory_allocated grew by {grown:.1f} MiB over {calls} calls")


@scenario(cuda=True)
def memory_flat() -> None:
    r"""500 calls of a graphed and of a streams Parallel: memory_allocated stays flat."""
    for settings in ({"cuda_graph": True}, {"streams": True}, {"cuda_graph": True, "fuse": True},
                     {"streams": True, "fuse": True}):
        blk = Parallel(*[mlp() for _ in range(4)], join="cat", **settings).to(DEV).eval()
        _memory(blk, str(settings))
    # keeping outputs for a while, then dropping them: memory comes back
    blk = Parallel(*[mlp() for _ in range(4)], join="tuple", cuda_graph=True).to(DEV).eval()
    with torch.no_grad():
        for _ in range(40):
            blk(rand(8, 32))
        # Once before measuring: calls that find lent outputs still held run eagerly, on the
        # side streams, and cuBLAS allocates each its workspace (32 MiB on this GPU) once.
        kept = [blk(rand(8, 32)) for _ in range(50)]
        del kept
        sync()
        gc.collect()
        before = torch.cuda.memory_allocated()
        kept = [blk(rand(8, 32)) for _ in range(50)]
        del kept
        for _ in range(50):
            blk(rand(8, 32))
        sync()
        gc.collect()
        grown = (torch.cuda.memory_allocated() - before) / 2**20
    if grown > 4.0:
        raise Fail(f"tuple join, kept then dropped: memory grew by {grown:.1f} MiB")
    # training graph, 200 steps
    blk = Parallel(*[mlp() for _ in range(4)], join="cat", cuda_graph=True).to(DEV).train()
    opt = torch.optim.SGD(blk.parameters(), lr=1e-3)
    for i in range(230):
        if i == 30:
            sync()
            before = torch.cuda.memory_allocated()
        blk(rand(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    sync()
    gc.collect()
    grown = (torch.cuda.memory_allocated() - before) / 2**20
    if grown > 4.0:
        raise Fail(f"training graph: memory grew by {grown:.1f} MiB over 200 steps")


@scenario()
def inference_mode_inputs() -> None:
    r"""Inputs made under torch.inference_mode(), streams and graphs (versionless tensors)."""
    modes = [{"streams": True}, {"streams": "auto"}] + ([{"cuda_graph": True}] if CUDA else [])
    for settings in modes:
        blk = Parallel(mlp(), Sleepy(mlp()), mlp(), join="cat", **settings).to(DEV).eval()
        ref = plain(list(blk), "cat")
        with torch.inference_mode():
            check_calls(blk, ref, (4, 32), 8, f"{settings}")


# ---------------------------------------------------------------------------------------- driver
def main() -> int:
    start = time.perf_counter()
    failed = 0
    for name, fn, needs_cuda in SCENARIOS:
        if needs_cuda and not CUDA:
            print(f"SKIP {name} (no CUDA)", flush=True)
            continue
        if time.perf_counter() - start > TIME_BUDGET_S:
            print(f"SKIP {name} (time budget of {TIME_BUDGET_S:.0f} s spent)", flush=True)
            continue
        torch.manual_seed(1234)
        t0 = time.perf_counter()
        caught: list[warnings.WarningMessage] = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn()
            sync()
            note = ""
            msgs = sorted({str(w.message).splitlines()[0][:90] for w in caught})
            if msgs:
                note = f"  ({len(msgs)} distinct warnings; first: {msgs[0]})"
            print(f"OK {name}  [{time.perf_counter() - t0:.1f}s]{note}", flush=True)
        except Fail as e:
            failed += 1
            print(f"FAIL {name}: {e}  [{time.perf_counter() - t0:.1f}s]", flush=True)
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            failed += 1
            first = (str(e).strip().splitlines() or [""])[0][:300]
            where = traceback.extract_tb(e.__traceback__)[-1]
            print(f"FAIL {name}: {type(e).__name__}: {first} (at {where.filename.split('/')[-1]}:{where.lineno})"
                  f"  [{time.perf_counter() - t0:.1f}s]", flush=True)
            try:
                sync()
            except BaseException as e2:  # noqa: BLE001
                print(f"    (device unusable after it: {type(e2).__name__}: {str(e2).splitlines()[0][:200]})")
        gc.collect()
    ran = len(SCENARIOS)
    print(f"{ran} scenarios, {failed} failed  [total {time.perf_counter() - start:.1f}s, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name() if CUDA else 'CPU'}]", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
