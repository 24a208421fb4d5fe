r"""Randomized differential fuzzer of ``Parallel`` / ``ParallelSequential`` for CUDA-only bugs (dev tool, not shipped).

Run from the repository root, for a bounded time:

    PYTHONPATH=. python3 tools/exp_gpu_fuzz.py [--device cuda|cpu] [--seconds 150] [--start 0] [--count N] [-v]
    PYTHONPATH=. python3 tools/exp_gpu_fuzz.py --start SEED --count 1 -v     # one failing seed again, in detail

(A seed builds another case on CUDA than on the CPU: CUDA-only options take draws from its random sequence.)

Each seed builds a small random case and compares the library's module, call after call, with the
plain computation on deep copies:

* ``Parallel`` cases (about 3 in 4): a random tree of branches (identical groups for fusion, other
  architectures, lambdas, nested ``Parallel``; vec/seq/int/conv1d/conv2d inputs; tuple/dict outputs),
  every join, ``fuse`` in {False, True, "auto"}, ``streams`` in {True, False, "auto"}, and on CUDA
  ``cuda_graph`` True for about a third of the cases (``static_outputs``, ``direct_grads``,
  ``graph_fallback`` at random), the caller on a non-default stream for some calls, fp32/fp64/bf16/fp16.
  Calls run under grad / no_grad / inference_mode with inputs of several layouts; backward, optimizer
  steps and mutations between calls (freeze, in-place and ``load_state_dict`` changes, submodules
  replaced, branches appended/popped/inserted, hooks, train/eval, shape changes, ``fuse`` changed,
  deep copies, slices, ``.double()``). Graphed cases keep the same input signature for most calls, so
  that graphs are captured and replayed on fresh inputs; mutations are rarer there.
* ``ParallelSequential`` cases: 1-4 batch-independent stages (Linear/Conv/GELU/LayerNorm/eval
  BatchNorm, a ``Parallel`` block as a stage), ``chunks`` 1..4 over uneven batches <= 16,
  ``cuda_graph`` False/True, on CUDA the input sometimes on the host (pinned or pageable); against
  ``nn.Sequential`` of deep copies on the whole batch (outputs, input and parameter gradients).

Comparisons (TF32 off): fp32 unfused -> bit for bit (outputs; fp64 too); anything fused ->
``assert_close(rtol=1e-4, atol=1e-5)`` (another summation order, Triton batched Linear); pipelines
(other batch sizes, so other kernels) rtol=2e-4, atol=5e-5; gradients 10x that, relative to the
model's largest gradient (rounding of a bias that a norm after it cancels); bf16/fp16 loose. Outputs
are checked before the next call (``static_outputs=True`` overwrites them) and not kept. Also checked:
state dicts and buffers after each call, output layouts, outputs changed in place (no aliasing),
``explain()`` not raising.

Documented limits are avoided rather than reported: under ``cuda_graph=True`` no dropout (warm-up and
variant timing draw random numbers), no ``p.data = ...`` (README: not seen by a graph) and no
``bias = None`` (registers nothing; README: "Not seen: what registers nothing below a block's own
children"), no parameter changed in place between forward and backward (a graph's backward reads
parameters in place where eager autograd refuses; not stated in the README), and every call that
records autograd is backpropagated before the next call. Warnings are ignored. A case where the
module and the reference both raise is counted as skipped (so is a call ``fuse=True`` refuses); a
backward that both refuse is expected.
A known failure reproducible on the CPU is left out unless ``--include-known`` (see ``INCLUDE_KNOWN``).
Torch's own: on CUDA no channels-last input to an architecture with an ``AvgPool2d`` (padded) --
torch 2.11's channels-last backward of a padded ``avg_pool2d`` on CUDA is wrong (pytorch/pytorch#188344),
so the plain reference is; a fused group through vmap reaches the NCHW kernel and is right (seed 770293:
its input gradient 0.54 off the fp64 CPU result for the plain modules, 3e-8 for the fused block).

Prints one line per failing seed -- ``FAIL seed=S: Error: reason (at file:line) | config`` -- (``-v``:
the call log and traceback too) and at the end one summary line
``N cases, M failed, K skipped (both raised)  [total Xs, torch VERSION, DEVICE NAME]``. Exit status 0
even with failures. Stops at ``--seconds`` of wall time or ``--count`` cases, whichever comes first.
A CUDA error that leaves the device unusable ends the run early (the summary still prints).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import functools
import gc
import random
import sys
import time
import traceback
import warnings
from collections import OrderedDict

import torch
from torch import nn
from torch.utils import _pytree as pytree

from parallel_modules import Parallel, ParallelSequential

warnings.filterwarnings("ignore")

LOW_PRECISION = (torch.bfloat16, torch.float16)

# Known failures, reproducible on the CPU, left out unless --include-known (so that a GPU run shows what is new):
# a fused group run through torch.vmap (members wrapped to return a tuple/dict) does not refuse a backward after
# a member's weight was changed in place since the forward, where unfused autograd refuses it
# (/tmp/hunt_fuzz/repros/vmapped_inplace_weight_before_backward.py).
INCLUDE_KNOWN = False


class Skip(Exception):
    r"""The module and the reference both raised (or ``fuse=True`` refused): not a failure."""


# ------------------------------------------------------------------------------------- modules
class ScaleShift(nn.Module):  # a custom module: vmapped when fused
    def __init__(self, h):
        super().__init__()
        self.s = nn.Parameter(torch.randn(h))
        self.register_buffer("shift", torch.randn(h))

    def forward(self, x):
        return x * self.s + self.shift


# What a structured branch returns of its tensor ``y``.
STRUCTURES = {"tuple": lambda y: (y, y[..., 0] * 0.5), "dict": lambda y: {"y": y, "s": torch.tanh(y).mean(-1)}}


class Structured(nn.Module):  # a branch returning a tuple or a dict: run through vmap when fused
    def __init__(self, inner, how):
        super().__init__()
        self.inner = inner
        self.how = how

    def forward(self, x):
        return STRUCTURES[self.how](self.inner(x))


class FnModule(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


class RefPar(nn.Module):  # the reference for a nested Parallel
    def __init__(self, branches, join, dim=1):
        super().__init__()
        for i, b in enumerate(branches):
            self.add_module(str(i), b)
        self.join = join
        self.dim = dim

    def forward(self, x):
        return ref_join([m(x) for m in self._modules.values()], self.join, self.dim, list(self._modules))


def ref_join(outs, join, dim, names):
    if join is None or join == "tuple":
        return tuple(outs)
    if join == "dict":
        return dict(zip(names, outs))
    if callable(join):
        return join(outs)
    leaves = [pytree.tree_flatten(o) for o in outs]
    spec = leaves[0][1]
    cols = list(zip(*[l for l, _ in leaves]))
    res = []
    for col in cols:
        col = list(col)
        if join == "cat":
            res.append(torch.cat(col, dim))
        elif join == "stack":
            res.append(torch.stack(col, dim))
        else:
            tot = functools.reduce(torch.add, col)
            res.append(tot / len(col) if join == "mean" else tot)
    return pytree.tree_unflatten(res, spec)


def weighted_join(outs):  # a callable join
    flat = [pytree.tree_flatten(o)[0] for o in outs]
    tot = 0
    for i, leaves in enumerate(flat):
        for l in leaves:
            tot = tot + (i + 1) * l.sum(-1, keepdim=True)
    return tot


ACTS = [lambda: nn.GELU(), lambda: nn.ReLU(), lambda: nn.Tanh(), lambda: nn.SiLU(), lambda: nn.ReLU(inplace=True),
        lambda: nn.LeakyReLU(0.1), lambda: nn.Sigmoid()]


def make_arch(kind, rng, F, H, C, no_dropout=False):
    """Return a zero-arg factory producing a fresh module of one architecture (same structure each call)."""
    a = rng.randrange(100)
    act = rng.choice(ACTS)
    p = rng.choice([0.0, 0.0, 0.3])
    if no_dropout:
        p = 0.0
    M = rng.choice([3, 5, 8])
    bias = rng.random() < 0.8
    if kind in ("vec", "seq"):
        opts = [
            lambda: nn.Linear(F, H, bias=bias),
            lambda: nn.Sequential(nn.Linear(F, M), act(), nn.Dropout(p), nn.Linear(M, H)),
            lambda: nn.Sequential(nn.Linear(F, H), nn.LayerNorm(H), act()),
            lambda: nn.Sequential(nn.LayerNorm(F), nn.Linear(F, H, bias=bias)),
            lambda: nn.Sequential(nn.Linear(F, H), ScaleShift(H)),
            lambda: nn.Sequential(nn.Linear(F, M), act(), nn.Sequential(nn.Linear(M, H), act())),
            lambda: nn.Sequential(nn.Linear(F, H), nn.LayerNorm(H, elementwise_affine=False)),
        ]
        if kind == "vec":
            opts.append(lambda: nn.Sequential(nn.Linear(F, H), nn.BatchNorm1d(H), act()))
            opts.append(lambda: nn.Sequential(nn.BatchNorm1d(F), nn.Linear(F, H)))
        else:
            opts.append(lambda: nn.Sequential(nn.Linear(F, H), nn.Flatten(0, 0)))
    elif kind == "int":
        opts = [
            lambda: nn.Embedding(C, H),
            lambda: nn.Sequential(nn.Embedding(C, F), nn.Linear(F, H)),
            lambda: nn.Embedding(C, H, padding_idx=0),
            lambda: nn.Sequential(nn.Embedding(C, H), nn.LayerNorm(H), act()),
        ]
    else:  # img1d, img2d: the same layers in one or two dimensions
        one = kind == "img1d"
        Conv, Norm = (nn.Conv1d, nn.BatchNorm1d) if one else (nn.Conv2d, nn.BatchNorm2d)
        MaxPool, AvgPool = (nn.MaxPool1d, nn.AvgPool1d) if one else (nn.MaxPool2d, nn.AvgPool2d)
        g = rng.choice([g for g in (1, 2, 3) if F % g == 0 and H % g == 0])
        opts = [
            lambda: Conv(F, H, 3, padding=1, bias=bias),
            lambda: nn.Sequential(Conv(F, H, 3, padding=1), Norm(H), act()),
            lambda: nn.Sequential(Conv(F, H, 3, padding=1), MaxPool(3, 1, 1)),
            lambda: nn.Sequential(AvgPool(3, 1, 1), Conv(F, H, 1)),
            lambda: Conv(F, H, 3, padding=1, groups=g),
            lambda: nn.Sequential(Norm(F), Conv(F, H, 1), act()),
            (lambda: nn.Sequential(Conv(F, M, 1), act(), Conv(M, H, 3, padding="same", groups=1))) if one else
            (lambda: nn.Sequential(Conv(F, M, 1), act(), nn.Dropout(p), Conv(M, H, 3, padding=1))),
        ]
    return opts[a % len(opts)], a % len(opts)


def make_fn(kind, H):
    if kind in ("vec", "seq"):
        return lambda x: x[..., :1].expand(*x.shape[:-1], H) * 0.5
    if kind == "int":
        return lambda x: (x.unsqueeze(-1) * 0.01).expand(*x.shape, H)
    return lambda x: x.mean(1, keepdim=True).expand(x.shape[0], H, *x.shape[2:]) * 1.5


def to_ref(m):
    r"""``m`` with every ``Parallel`` below (or itself) replaced by a plain :class:`RefPar` (in place)."""
    if isinstance(m, Parallel):
        return RefPar([to_ref(b) for b in m._modules.values()], m.join, m.dim)
    for name, c in list(m._modules.items()):
        if c is not None:
            if isinstance(m, nn.Sequential):
                m._modules[name] = to_ref(c)
            else:
                setattr(m, name, to_ref(c))
    return m


def make_input(kind, rng, B, F, C, T, S, dtype, layout, dev):
    r"""A base tensor on ``dev`` (drawn on the CPU, so seeds do not depend on the device) and the view the
    module is called on."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if kind == "int":
        if layout == "nc":
            x = torch.randint(0, C, (T, B), generator=g).to(dev).t()
        else:
            x = torch.randint(0, C, (B, T), generator=g).to(dev)
            if layout == "exp":
                x = x[:, :1].expand(B, T)
        return x, lambda base: base
    shape = {"vec": (B, F), "seq": (B, T, F), "img1d": (B, F, S), "img2d": (B, F, S, S + 1)}[kind]
    base = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(dev)
    view = lambda b: b
    if layout == "nc":
        base = base.transpose(0, -1).contiguous()
        view = lambda b: b.transpose(0, -1)
    elif layout == "exp":
        base = base[:, :1].contiguous()
        view = lambda b: b.expand(b.shape[0], shape[1], *b.shape[2:])
    elif layout == "cl" and kind == "img2d":
        base = base.contiguous(memory_format=torch.channels_last)
    elif layout == "slice":
        base = torch.randn((shape[0] * 2,) + shape[1:], generator=g, dtype=torch.float64).to(dtype).to(dev)
        view = lambda b: b[::2]
    return base, view


def is_cuda_dev(dev):
    return dev.type == "cuda"


def sync(dev):
    if is_cuda_dev(dev):
        torch.cuda.synchronize(dev)


@contextlib.contextmanager
def on_stream(stream, dev):
    r"""Run the body with ``stream`` (a non-default CUDA stream, or ``None``: as is) as the current stream, ordered
    after the caller's earlier work; synchronizes the device afterwards, so results can be compared at once."""
    if stream is None:
        yield
        return
    caller = torch.cuda.current_stream(dev)
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        caller.wait_stream(stream)
        torch.cuda.synchronize(dev)


# ------------------------------------------------------------------------------------ checking
class Checker:
    r"""Comparisons shared by both case kinds: ``self.dtype`` and ``self.exact()`` decide the tolerance."""

    dtype = torch.float32
    # Calls a case makes (graphed, not), and how likely a mutation is after each (graphed, not).
    CALLS = ([4, 5, 6, 8], [2, 3, 4, 6])
    P_MUTATE = (0.3, 0.7)

    def __init__(self, seed, dev):
        self.seed = seed
        self.dev = dev
        self.rng = random.Random(seed)  # (every draw of the case: the seed alone decides it)
        torch.manual_seed(seed)

    def exact(self):
        return False

    def run(self, log):
        graphed = 0 if self.cuda_graph else 1
        for step in range(self.rng.choice(self.CALLS[graphed])):
            try:
                self.call(step)
            finally:
                log.append(f"call{step} {self.last}")
            self.resync()
            if self.rng.random() < self.P_MUTATE[graphed]:
                log.append(f"mutate: {self.mutate()}")

    def step_and_zero(self, module):
        r"""After a backward: an optimizer step (often), then ``zero_grad`` (mostly; to None or zeros) on both
        ``module`` and the reference alike."""
        if self.opts is not None and self.rng.random() < 0.7:
            for o in self.opts:
                o.step()
        if self.rng.random() < 0.8:
            to_none = self.rng.random() < 0.5
            module.zero_grad(set_to_none=to_none)
            self.ref.zero_grad(set_to_none=to_none)

    def raised(self, who, err_b, err_r):
        r"""Skip a call both raised for; fail one that only one of them raised for."""
        if err_b is not None and err_r is not None:
            raise Skip(f"both raised: {type(err_b).__name__}: {str(err_b).splitlines()[0][:120]}")
        if err_b is not None:
            raise AssertionError(f"{who} raised, reference did not: {type(err_b).__name__}: {err_b}") from err_b
        if err_r is not None:
            raise AssertionError(f"reference raised, {who} did not: {type(err_r).__name__}: {err_r}")

    @staticmethod
    def none_or_zeros(k, pb, pr, step, who):
        r"""Whether one of two parameters' gradients is ``None`` and the other zeros, made zeros on both (an
        optimizer then steps both alike: with momentum or Adam's count, a step on zeros is not a step
        skipped); fails where the other is not zeros."""
        if (pb.grad is None) == (pr.grad is None):
            return False
        other = pb.grad if pb.grad is not None else pr.grad
        if other.abs().max() != 0:
            raise AssertionError(f"step{step} grad {k}: {who} {pb.grad is None and 'None' or 'tensor'} "
                                 f"vs ref {pr.grad is None and 'None' or 'tensor'}")
        for p_ in (pb, pr):
            if p_.grad is None:
                p_.grad = torch.zeros_like(p_)
        return True

    def tol(self, grad=False):
        if self.dtype in LOW_PRECISION:
            return dict(rtol=3e-2, atol=3e-2)
        if self.exact():
            if grad:
                return dict(rtol=1e-6, atol=1e-7) if self.dtype == torch.float32 else dict(rtol=1e-13, atol=1e-14)
            return dict(rtol=0, atol=0)  # bit for bit
        if self.dtype == torch.float64:
            return dict(rtol=1e-9, atol=1e-10)
        return dict(rtol=1e-4, atol=1e-5)

    def check(self, what, a, b, grad=False, floor=0.0):
        r"""Raise unless ``a`` matches the reference ``b`` leaf by leaf. ``floor``: for gradients, the scale of the
        model's largest gradient, below which differences are rounding (a bias before a norm that removes it
        gets a gradient that is rounding noise alone)."""
        la, sa = pytree.tree_flatten(a)
        lb, sb = pytree.tree_flatten(b)
        if sa != sb:
            raise AssertionError(f"{what}: structure {sa} != {sb}")
        for x, y in zip(la, lb):
            if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                if x is None or y is None or not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
                    raise AssertionError(f"{what}: None vs tensor: {type(x)} {type(y)}")
                if x.device != y.device:
                    raise AssertionError(f"{what}: device {x.device} vs {y.device}")
                t = self.tol(grad)
                if x.is_floating_point() and x.shape == y.shape and t["rtol"] != 0 and (
                        self.dtype in LOW_PRECISION or grad):
                    if x.dtype != y.dtype:
                        raise AssertionError(f"{what}: dtype {x.dtype} vs {y.dtype}")
                    if not y.numel():
                        continue
                    scale = max(y.double().abs().max().item(), floor if grad else 0.0)
                    err = (x.double() - y.double()).abs().max().item()
                    rel = 0.35 if self.dtype in LOW_PRECISION else 10 * t["rtol"]
                    if not err <= rel * scale + 10 * t["atol"]:
                        raise AssertionError(f"{what}: max err {err:.3g} at scale {scale:.3g} ({x.dtype})")
                    continue
                if t["atol"] and y.is_floating_point() and y.numel():
                    # (atol relative to the tensor's largest value, where training made the values large: one
                    # element that cancels to a small value carries the rounding of its large terms)
                    t = dict(t, atol=t["atol"] * max(1.0, y.detach().abs().max().item()))
                torch.testing.assert_close(x, y, **t, msg=lambda m: f"{what}: {m}")
            else:
                assert x == y, f"{what}: {x!r} != {y!r}"


def grad_floor(params):
    r"""The largest gradient of ``params`` (references), as a scale for rounding differences of the others."""
    gs = [p.grad.detach().abs().max().item() for p in params if p.grad is not None and p.grad.numel()]
    return max(gs, default=0.0)


def random_weights(ts, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype).to(t.device) for t in ts]


# ------------------------------------------------------------------------------ Parallel cases
class Case(Checker):
    def __init__(self, seed, dev):
        super().__init__(seed, dev)
        cuda, rng = is_cuda_dev(dev), self.rng
        self.kind = rng.choice(["vec", "vec", "seq", "int", "img1d", "img2d"])
        dtypes = [torch.float32, torch.float32, torch.float32, torch.float64, torch.bfloat16]
        if cuda:
            dtypes.append(torch.float16)
        self.dtype = rng.choice(dtypes)
        self.F = rng.choice([2, 3, 4, 6])
        self.H = rng.choice([3, 4, 6])
        self.C = rng.choice([5, 7])
        self.struct = rng.choice([None] * 6 + ["tuple", "dict"])
        self.fuse = rng.choice([False, True, "auto", "auto"])
        self.streams = rng.choice(["auto", True, False])
        self.cuda_graph = rng.random() < 1 / 3
        self.static_outputs = self.cuda_graph and rng.random() < 0.35
        self.direct_grads = self.cuda_graph and rng.random() < 0.25
        self.graph_fallback = self.cuda_graph and rng.random() < 0.2
        self.side = torch.cuda.Stream(dev) if cuda and rng.random() < 0.4 else None  # caller stream, some calls
        self.graphed = self.cuda_graph and cuda  # the graph limits apply (CPU: runs eagerly)
        arch, aid = make_arch(self.kind, rng, self.F, self.H, self.C, no_dropout=self.graphed)
        self.arch = arch
        self.arch_desc = aid
        n_ident = rng.choice([1, 2, 2, 3, 4, 5])
        branches = [self.wrap(arch()) for _ in range(n_ident)]
        self.distinct = False
        if self.fuse is not True:
            for _ in range(rng.choice([0, 0, 1, 2])):
                self.distinct = True
                r = rng.random()
                if r < 0.15:
                    branches.insert(rng.randrange(len(branches) + 1), self.wrap_fn(make_fn(self.kind, self.H)))
                elif r < 0.3 and self.struct is None:
                    inner = [arch() for _ in range(rng.choice([1, 2, 3]))]
                    branches.insert(rng.randrange(len(branches) + 1),
                                    Parallel(*inner, join=rng.choice(["sum", "mean"]), fuse=rng.choice([False, "auto"]),
                                             streams=rng.choice(["auto", True, False])))
                else:
                    other, _ = make_arch(self.kind, rng, self.F, self.H, self.C, no_dropout=self.graphed)
                    branches.insert(rng.randrange(len(branches) + 1), self.wrap(other()))
        self.out_dim = {"vec": 2, "seq": 3, "int": 3, "img1d": 3, "img2d": 4}[self.kind]
        joins = ["cat", "cat", "stack", "sum", "mean", None, "tuple", "dict", weighted_join]
        self.join = rng.choice(joins)
        nd = self.out_dim if self.struct is None else self.out_dim - 1
        if self.join == "cat":
            self.dim = rng.randrange(-nd, nd)
        elif self.join == "stack":
            self.dim = rng.randrange(-nd - 1, nd + 1)
        else:
            self.dim = 1
        if self.join == "dict":
            self.names = [f"b{i}" for i in range(len(branches))]
        else:
            self.names = [str(i) for i in range(len(branches))]
        if self.dtype != torch.float32:
            branches = [b.to(self.dtype) if isinstance(b, nn.Module) else b for b in branches]
        self.training = rng.random() < 0.5
        refs = [to_ref(copy.deepcopy(b)) if isinstance(b, nn.Module) else FnModule(b) for b in branches]
        self.ref = nn.Module()
        for n_, r in zip(self.names, refs):
            self.ref.add_module(n_, r)
        for b in branches:
            if isinstance(b, nn.Module):
                b.train(self.training)
        try:
            self.block = self.make_block(branches)
        except ValueError as e:
            if self.fuse is True and "fuse=True" in str(e):
                self.fuse = "auto"
                self.block = self.make_block(branches)
            else:
                raise
        self.block.train(self.training)
        self.ref.train(self.training)
        self.fused_once = self.fuse is not False  # (see exact)
        self.block.to(dev)
        self.ref.to(dev)
        self.B = rng.choice([1, 2, 3, 5, 8])
        self.T = rng.choice([1, 3, 4])
        self.S = rng.choice([3, 5])
        self.opt_kind = rng.choice(["sgd", "adam", None])
        self.make_opts()
        self.hooks = []
        self.prev_sig = None
        self.last = None

    def make_block(self, branches):
        kw = dict(join=self.join, dim=self.dim, streams=self.streams, fuse=self.fuse, cuda_graph=self.cuda_graph,
                  static_outputs=self.static_outputs, direct_grads=self.direct_grads,
                  graph_fallback=self.graph_fallback)
        if self.join == "dict":
            return Parallel(OrderedDict(zip(self.names, branches)), **kw)
        return Parallel(*branches, **kw)

    def make_opts(self):
        bp = dict(self.block.named_parameters())
        rp = dict(self.ref.named_parameters())
        assert list(bp) == list(rp), (list(bp), list(rp))
        if not bp or self.opt_kind is None:
            self.opts = None
        elif self.opt_kind == "sgd":
            self.opts = [torch.optim.SGD(list(bp.values()), lr=0.1, momentum=0.9),
                         torch.optim.SGD(list(rp.values()), lr=0.1, momentum=0.9)]
        else:
            self.opts = [torch.optim.Adam(list(bp.values()), lr=0.01, eps=1.0),
                         torch.optim.Adam(list(rp.values()), lr=0.01, eps=1.0)]

    def wrap(self, m):
        return m if self.struct is None else Structured(m, self.struct)

    def wrap_fn(self, f):
        structure = STRUCTURES.get(self.struct)
        return f if structure is None else lambda x: structure(f(x))

    def exact(self):
        # (Not once fused: the members' tensors, slices of a stack, may lie at addresses that a kernel
        # rounds otherwise from the reference's own; see the README.)
        return not self.fused_once and self.block.fuse is False and not any(
            isinstance(m, Parallel) and m.fuse is not False for m in self.block.modules())

    # ------------------------------------------------------------------
    def call(self, step):
        rng = self.rng
        kind = self.kind
        B = self.B
        grad_mode = rng.choice(["grad", "grad", "nograd", "inference"])
        layout = rng.choice(["c", "c", "nc", "exp", "cl", "slice"])
        if layout == "cl" and is_cuda_dev(self.dev) and any(
                isinstance(m, nn.AvgPool2d) and any(nn.modules.utils._pair(m.padding)) for m in self.block.modules()):
            layout = "c"  # (torch's wrong channels-last backward of a padded avg_pool2d: see the docstring)
        xgrad = kind != "int" and rng.random() < 0.4 and self.dtype not in LOW_PRECISION or (
            kind != "int" and rng.random() < 0.2)
        if self.cuda_graph and self.prev_sig is not None and rng.random() < 0.75:
            grad_mode, layout, xgrad = self.prev_sig  # the same signature again: a replay on fresh inputs
        self.prev_sig = (grad_mode, layout, xgrad)
        base, view = make_input(kind, rng, B, self.F, self.C, self.T, self.S, self.dtype, layout, self.dev)
        bb = base.clone(memory_format=torch.preserve_format)
        br = base.clone(memory_format=torch.preserve_format)
        if xgrad and grad_mode == "grad":
            bb.requires_grad_(True)
            br.requires_grad_(True)
        stream = self.side if self.side is not None and rng.random() < 0.5 else None
        s = rng.randrange(2**31)
        ctx = {"grad": torch.enable_grad, "nograd": torch.no_grad, "inference": torch.inference_mode}[grad_mode]
        self.last = (grad_mode, layout, xgrad, tuple(base.shape)) + (("caller stream",) if stream is not None else ())
        err_b = err_r = None
        with ctx():
            torch.manual_seed(s)
            try:
                with on_stream(stream, self.dev):
                    yb = self.block(view(bb))
            except Exception as e:  # noqa
                err_b = e
            torch.manual_seed(s)
            try:
                names = list(self.ref._modules)
                xr = view(br)
                yr = ref_join([m(xr) for m in self.ref._modules.values()], self.block.join, self.block.dim, names)
            except Exception as e:  # noqa
                err_r = e
        if err_b is not None and err_r is None and self.block.fuse is True and "fuse=True" in str(err_b):
            raise Skip("fuse=True refused")
        self.raised("block", err_b, err_r)
        self.check(f"step{step} output", yb, yr)
        lb = [t for t in pytree.tree_flatten(yb)[0] if isinstance(t, torch.Tensor)]
        lr = [t for t in pytree.tree_flatten(yr)[0] if isinstance(t, torch.Tensor)]
        # backward
        if grad_mode == "grad" and any(t.requires_grad for t in lb):
            ws = random_weights(lb, s)
            for i in range(len(lb)):
                if lr[i].requires_grad and not lb[i].requires_grad:
                    raise AssertionError(f"step{step} output leaf {i} requires no grad, ref's does")
            # sometimes leave one output out (never all of them: a graphed call must be backpropagated)
            keep = [i for i in range(len(lb)) if lr[i].requires_grad and not (len(lb) > 1 and rng.random() < 0.2)]
            if not keep:
                keep = [i for i in range(len(lb)) if lr[i].requires_grad][:1]
            with on_stream(stream, self.dev):
                lossb = sum((lb[i].float() * ws[i].float()).sum() for i in keep)
            lossr = sum((lr[i].float() * ws[i].float()).sum() for i in keep)
            if isinstance(lossb, torch.Tensor) and lossb.requires_grad:
                # (Not graphed: a graph's backward reads the parameters in place, as any CUDA graph does.)
                known = self.struct is not None and self.block.fuse is not False and not INCLUDE_KNOWN
                if not self.graphed and rng.random() < 0.15 and not known:
                    names = [k for k, p in self.block.named_parameters() if p.requires_grad and not k.endswith("bias")]
                    if names:
                        k = rng.choice(names)
                        with torch.no_grad():
                            dict(self.block.named_parameters())[k].mul_(1.5)
                            dict(self.ref.named_parameters())[k].mul_(1.5)
                        self.last = self.last + (f"inplace {k} before backward",)
                eb = er = None
                try:
                    with on_stream(stream, self.dev):
                        lossb.backward()
                except RuntimeError as e:
                    eb = e
                try:
                    lossr.backward()
                except RuntimeError as e:
                    er = e
                if (eb is None) != (er is None):
                    raise AssertionError(f"step{step} backward: block {eb!r} ref {er!r}")
                if eb is not None:  # both refused it (a weight changed before backward): as expected
                    self.last = self.last + ("backward refused by both",)
                    self.block.zero_grad(set_to_none=True)  # (each may have accumulated part of it)
                    self.ref.zero_grad(set_to_none=True)
                    return
                self.compare_grads(step)
                if xgrad:
                    floor = max(grad_floor(self.ref.parameters()), grad_floor([br]))
                    self.check(f"step{step} input grad", bb.grad, br.grad, True, floor)
                self.step_and_zero(self.block)
        self.compare_state(step)
        # layouts of the outputs
        for i, (a, b) in enumerate(zip(lb, lr)):
            dense = lambda t: t.is_contiguous() or t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
            if dense(b) and not dense(a):
                raise AssertionError(f"step{step} output leaf {i} layout: block strides {a.stride()} "
                                     f"ref strides {b.stride()} shape {tuple(a.shape)}")
        # in-place changes of the outputs, one after another: no output may alias another
        if rng.random() < 0.5:
            skipped = False
            refused = set()  # outputs both refused to change, for different reasons: not compared
            with torch.no_grad():
                for i, (a, b) in enumerate(zip(lb, lr)):
                    ea = eb = None
                    try:
                        a.mul_(i + 2)
                    except Exception as e:
                        ea = e
                    try:
                        b.mul_(i + 2)
                    except Exception as e:
                        eb = e
                    if ea is not None and eb is None:  # (the block refusing what the reference allows)
                        raise AssertionError(f"step{step} in-place on output {i}: block {ea!r} ref {eb!r}")
                    if eb is not None and ea is None:  # (a graph's outputs are its own dense copies: allowed)
                        skipped = True
                    # (Both refused, for different reasons: an inference tensor is written *before* its
                    # version bump raises, an expanded one is refused before the write. A graph's dense
                    # copy of an expanded output, made in inference mode, is changed while the reference's
                    # expanded one is not: seed 256.)
                    # (Only that output: the others are compared still, an alias of it included.)
                    if ea is not None and eb is not None and str(ea) != str(eb):
                        refused.add(i)
                if not skipped:
                    kept = [i for i in range(len(lb)) if i not in refused]
                    self.check(f"step{step} outputs after in-place", [lb[i] for i in kept], [lr[i] for i in kept])
        self.block.explain()
        if stream is not None:
            sync(self.dev)  # (the outputs, made on the caller's stream, are freed when this returns)
        # (The outputs go out of scope here: static_outputs=True overwrites them at the next call.)

    def compare_grads(self, step):
        bp = dict(self.block.named_parameters())
        rp = dict(self.ref.named_parameters())
        assert list(bp) == list(rp), "param names differ"
        floor = grad_floor(rp.values())
        for k in bp:
            gb, gr = bp[k].grad, rp[k].grad
            # (Zeros against None is documented for some paths: graphs, fused traced code.)
            if self.none_or_zeros(k, bp[k], rp[k], step, "block"):
                continue
            if gb is not None:
                self.check(f"step{step} grad {k}", gb, gr, True, floor)

    def compare_state(self, step):
        sb = self.block.state_dict()
        sr = self.ref.state_dict()
        assert list(sb) == list(sr), f"state_dict keys differ {list(sb)} vs {list(sr)}"
        for k in sb:
            self.check(f"step{step} state {k}", sb[k], sr[k], True)
        rb = dict(self.ref.named_buffers())
        for k, b in self.block.named_buffers():
            self.check(f"step{step} buffer {k}", b, rb[k], True)
        rp = dict(self.ref.named_parameters())
        for k, p in self.block.named_parameters():
            self.check(f"step{step} param {k}", p.detach(), rp[k].detach(), True)

    def resync(self):
        # keep fused rounding differences from compounding
        with torch.no_grad():
            rp = dict(self.ref.named_parameters())
            for k, p in self.block.named_parameters():
                rp[k].copy_(p)
            rb = dict(self.ref.named_buffers())
            for k, b in self.block.named_buffers():
                rb[k].copy_(b)

    def new_module(self, m):
        return m.to(device=self.dev, dtype=self.dtype) if self.dtype != torch.float32 else m.to(self.dev)

    def mutate(self):
        rng = self.rng
        r = rng.randrange(18)
        blk, ref = self.block, self.ref
        numbered = self.join != "dict"
        desc = None
        if r == 0:
            t = rng.random() < 0.5
            blk.train(t)
            ref.train(t)
            desc = f"train({t})"
        elif r == 1:
            names = [k for k, _ in blk.named_parameters()]
            if names:
                k = rng.choice(names)
                dict(blk.named_parameters())[k].requires_grad_(False)
                dict(ref.named_parameters())[k].requires_grad_(False)
                desc = f"freeze {k}"
        elif r == 2:
            names = [k for k, _ in blk.named_parameters()]
            if names:
                k = rng.choice(names)
                f = rng.choice([0.5, 2.0, -1.0])
                how = rng.randrange(2)
                for m in (blk, ref):
                    p = dict(m.named_parameters())[k]
                    if how == 0:
                        p.data.mul_(f)
                    else:
                        with torch.no_grad():
                            p.add_(1)
                desc = f"inplace {k} how{how}"
        elif r == 3:
            # replace a submodule with a fresh one of the same class/shape
            i = rng.randrange(len(blk))
            b = blk[i]
            if isinstance(b, nn.Sequential) and isinstance(b[0], nn.Linear):
                old = b[0]
                new = nn.Linear(old.in_features, old.out_features, bias=old.bias is not None).to(
                    device=old.weight.device, dtype=old.weight.dtype)
                b[0] = new
                list(ref._modules.values())[i][0] = copy.deepcopy(new)
                desc = f"replace {i}[0]"
                self.make_opts()
        elif r == 4 and numbered:
            new = self.wrap(self.new_module(self.arch()))
            new.train(rng.random() < 0.5)
            op = rng.randrange(3)
            if op == 0:
                blk.append(new)
                self._ref_set(list(ref._modules.values()) + [copy.deepcopy(new)])
                desc = "append"
            elif op == 1 and len(blk) > 1:
                i = rng.randrange(-len(blk), len(blk))
                blk.pop(i)
                lst = list(ref._modules.values())
                lst.pop(i)
                self._ref_set(lst)
                desc = f"pop {i}"
            else:
                i = rng.randrange(-len(blk), len(blk) + 1)
                blk.insert(i, new)
                lst = list(ref._modules.values())
                lst.insert(i, copy.deepcopy(new))
                self._ref_set(lst)
                desc = f"insert {i}"
            self.make_opts()
        elif r == 5:
            # load_state_dict one way or the other, after perturbing the source
            if rng.random() < 0.5:
                with torch.no_grad():
                    for p in ref.parameters():
                        p.add_(torch.randn_like(p) * 0.1)
                blk.load_state_dict(ref.state_dict())
                desc = "blk.load(ref)"
            else:
                with torch.no_grad():
                    g = torch.Generator().manual_seed(rng.randrange(1000))
                    for p in blk.parameters():
                        p.add_((torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1).to(p.dtype).to(p.device))
                ref.load_state_dict(blk.state_dict())
                desc = "ref.load(blk)"
        elif r == 6:
            # forward hook on a member (graphed: the hook's tensor ops are captured, the block captures anew)
            if self.hooks:
                for h in self.hooks:
                    h.remove()
                self.hooks = []
                desc = "remove hooks"
            else:
                i = rng.randrange(len(blk))
                if isinstance(blk[i], nn.Module):
                    hook = lambda m, a, o: o * 2 if isinstance(o, torch.Tensor) else o
                    sub = rng.choice(list(blk[i].modules()))
                    path = [n for n, m in blk[i].named_modules() if m is sub][0]
                    rroot = list(ref._modules.values())[i]
                    rsub = rroot.get_submodule(path) if path else rroot
                    if isinstance(rsub, RefPar) != isinstance(sub, Parallel):
                        return None
                    self.hooks = [sub.register_forward_hook(hook), rsub.register_forward_hook(hook)]
                    desc = f"hook {i}.{path}"
        elif r == 7:
            self.B = rng.choice([1, 2, 3, 4, 7])
            self.T = rng.choice([1, 2, 5])
            self.S = rng.choice([3, 4, 6])
            desc = f"shape B={self.B} T={self.T} S={self.S}"
        elif r == 8:
            f = rng.choice([False, True, "auto"])
            if f is True and self.distinct:
                f = "auto"
            try:
                blk.fuse = f
                self.fused_once = self.fused_once or f is not False
                desc = f"fuse={f}"
                self.fuse = f
            except Exception:
                desc = None
        elif r == 9:
            # child eval inside training block
            i = rng.randrange(len(blk))
            if isinstance(blk[i], nn.Module):
                t = rng.random() < 0.5
                blk[i].train(t)
                list(ref._modules.values())[i].train(t)
                desc = f"child {i} train({t})"
        elif r == 10:
            # buffer update outside forward (running stats)
            for (k, b), (_, rb) in zip(blk.named_buffers(), ref.named_buffers()):
                if b.is_floating_point():
                    b.add_(0.5)
                    rb.add_(0.5)
                    desc = f"buffer {k} += .5"
                    break
        elif r == 11 and not self.graphed:
            # a Linear's bias set to None on both sides (registers nothing: a graph does not see it, README)
            pairs = [(m, r_) for (n, m), (_, r_) in zip(blk.named_modules(), ref.named_modules())
                     if isinstance(m, nn.Linear) and m.bias is not None]
            if pairs:
                m, r_ = rng.choice(pairs)
                m.bias = None
                r_.bias = None
                self.make_opts()
                desc = "bias=None"
        elif r == 12 and not self.graphed:
            # p.data = new tensor (new address; a graph does not see it, README)
            names = [k for k, _ in blk.named_parameters()]
            if names:
                k = rng.choice(names)
                for m in (blk, ref):
                    p = dict(m.named_parameters())[k]
                    p.data = p.data.clone() * 1.5
                desc = f"{k}.data = new"
        elif r == 13:
            # buffer re-assigned outside forward
            for (k, b) in list(blk.named_buffers()):
                if b.is_floating_point():
                    mod, _, attr = k.rpartition(".")
                    for m in (blk, ref):
                        sub = m.get_submodule(mod)
                        setattr(sub, attr, getattr(sub, attr) + 0.25)
                    desc = f"buffer {k} reassigned"
                    break
        elif r == 14:
            # load_state_dict(assign=True)
            with torch.no_grad():
                for p in ref.parameters():
                    p.add_(0.05)
            sd = {k: v.clone() for k, v in ref.state_dict().items()}
            blk.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            blk.load_state_dict(sd, assign=True)
            self.make_opts()
            desc = "blk.load(ref, assign=True)"
        elif r == 15:
            self.block = copy.deepcopy(blk)
            self.ref = copy.deepcopy(ref)
            self.make_opts()
            self.hooks = []
            desc = "deepcopy both"
        elif r == 16 and numbered and len(blk) > 1:
            a = rng.randrange(len(blk))
            b = rng.randrange(a + 1, len(blk) + 1)
            try:
                self.block = blk[a:b]
            except ValueError as e:
                if "fuse=True" in str(e):
                    return None
                raise
            self._ref_set(list(ref._modules.values())[a:b])
            self.make_opts()
            desc = f"slice {a}:{b}"
        elif r == 17 and self.dtype == torch.float32:
            blk.double()
            ref.double()
            blk.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            self.dtype = torch.float64
            self.make_opts()
            desc = "double()"
        return desc

    def _ref_set(self, lst):
        ref = nn.Module()
        for i, m in enumerate(lst):
            ref.add_module(str(i), m)
        ref.training = self.ref.training
        self.ref = ref
        self.names = [str(i) for i in range(len(lst))]

    def describe(self):
        graph = (f" cuda_graph=True static_outputs={self.static_outputs} direct_grads={self.direct_grads} "
                 f"graph_fallback={self.graph_fallback}" if self.cuda_graph else "")
        return (f"Parallel kind={self.kind} dtype={str(self.dtype)[6:]} struct={self.struct} fuse={self.fuse} "
                f"streams={self.streams}{graph} join={getattr(self.join, '__name__', self.join)} dim={self.dim} "
                f"n={len(self.block)} arch={self.arch_desc} train={self.training} opt={self.opt_kind} "
                f"caller_stream={self.side is not None}")



# --------------------------------------------------------------------- ParallelSequential cases
def make_stage(kind, rng, w, S):
    r"""A random batch-independent stage taking ``w`` features (channels) and the features it returns."""
    h = rng.choice([3, 4, 6, 8])
    r = rng.randrange(8)
    if kind in ("vec", "seq"):
        if r == 0:
            return nn.Linear(w, h), h
        if r == 1:
            return rng.choice([nn.GELU(), nn.ReLU(), nn.Tanh()]), w
        if r == 2:
            return nn.LayerNorm(w), w
        if r == 3 and kind == "vec":
            return nn.BatchNorm1d(w), w
        if r == 4:
            return nn.Sequential(nn.Linear(w, h), nn.GELU(), nn.Linear(h, h)), h
        if r in (5, 6):
            n = rng.choice([1, 2, 3, 4])
            one = rng.choice([lambda: nn.Linear(w, h),
                              lambda: nn.Sequential(nn.Linear(w, h), nn.ReLU(), nn.Linear(h, h)),
                              lambda: nn.Sequential(nn.Linear(w, h), nn.SiLU())])
            join = rng.choice(["sum", "mean", "cat"])
            return Parallel(*[one() for _ in range(n)], join=join, dim=-1, fuse=rng.choice([False, True, "auto"]),
                            streams=rng.choice(["auto", True, False])), (h * n if join == "cat" else h)
        return nn.Sequential(nn.Linear(w, h), nn.LayerNorm(h)), h
    # img2d: (B, C, S, S)
    if r == 0:
        return nn.Conv2d(w, h, 3, padding=1), h
    if r == 1:
        return rng.choice([nn.GELU(), nn.ReLU(), nn.MaxPool2d(3, 1, 1)]), w
    if r == 2:
        return nn.BatchNorm2d(w), w
    if r == 3:
        return nn.LayerNorm([S, S]), w
    if r == 4:
        return nn.Sequential(nn.Conv2d(w, h, 1), nn.GELU(), nn.Conv2d(h, h, 3, padding=1)), h
    if r in (5, 6):
        n = rng.choice([1, 2, 3])
        one = rng.choice([lambda: nn.Conv2d(w, h, 3, padding=1), lambda: nn.Sequential(nn.Conv2d(w, h, 1), nn.ReLU())])
        join = rng.choice(["sum", "cat"])
        return Parallel(*[one() for _ in range(n)], join=join, dim=1, fuse=rng.choice([False, True, "auto"]),
                        streams=rng.choice(["auto", True, False])), (h * n if join == "cat" else h)
    return nn.Sequential(nn.Conv2d(w, h, 1), nn.BatchNorm2d(h), nn.ReLU()), h


def batchnorms_eval(m):
    r"""Put every BatchNorm below ``m`` in eval mode (a pipeline refuses BatchNorm in training with chunks > 1)."""
    for sub in m.modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm):
            sub.eval()


class PipeCase(Checker):
    CALLS = ([4, 5, 6, 7], [2, 3, 4, 5])
    P_MUTATE = (0.25, 0.5)

    def __init__(self, seed, dev):
        super().__init__(seed, dev)
        cuda, rng = is_cuda_dev(dev), self.rng
        self.kind = rng.choice(["vec", "vec", "seq", "img2d"])
        self.dtype = rng.choice([torch.float32] * 4 + [torch.float64, torch.bfloat16])
        self.F = rng.choice([2, 3, 4, 6])
        self.S = rng.choice([3, 4, 5])
        self.T = rng.choice([1, 3, 4])
        stages = []
        w = self.F
        for _ in range(rng.choice([1, 2, 2, 3, 4])):
            st, w = make_stage(self.kind, rng, w, self.S)
            stages.append(st)
        for st in stages:  # running statistics that are not the identity
            for m in st.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.running_mean.uniform_(-0.5, 0.5)
                    m.running_var.uniform_(0.5, 2.0)
        self.chunks = rng.randint(1, 4)
        self.B = rng.randint(self.chunks, 16)
        self.cuda_graph = rng.random() < 1 / 3
        self.static_outputs = self.cuda_graph and rng.random() < 0.35
        self.direct_grads = self.cuda_graph and rng.random() < 0.25
        self.graph_fallback = self.cuda_graph and rng.random() < 0.2
        self.side = torch.cuda.Stream(dev) if cuda and rng.random() < 0.3 else None
        self.host_inputs = cuda and rng.random() < 0.5  # some calls' inputs on the CPU (pinned or pageable)
        self.training = rng.random() < 0.5
        if self.dtype != torch.float32:
            stages = [s.to(self.dtype) for s in stages]
        self.ref = nn.Sequential(*[to_ref(copy.deepcopy(s)) for s in stages])
        self.pipe = ParallelSequential(*stages, chunks=self.chunks, cuda_graph=self.cuda_graph,
                                       static_outputs=self.static_outputs, direct_grads=self.direct_grads,
                                       graph_fallback=self.graph_fallback)
        self.set_mode(self.training)
        self.pipe.to(dev)
        self.ref.to(dev)
        self.opt_kind = rng.choice(["sgd", "sgd", None])
        self.make_opts()
        self.prev_sig = None
        self.last = None
        self.n_stages = len(stages)

    def set_mode(self, t):
        self.pipe.train(t)
        self.ref.train(t)
        batchnorms_eval(self.pipe)
        batchnorms_eval(self.ref)

    def exact(self):
        return False  # micro-batches of other sizes run other kernels

    def tol(self, grad=False):
        # (Other batch sizes may take other cuDNN/cuBLAS algorithms, stacked over up to 4 stages with norms.)
        if self.dtype == torch.float32:
            return dict(rtol=2e-4, atol=5e-5)
        return super().tol(grad)

    def make_opts(self):
        bp = list(self.pipe.parameters())
        rp = list(self.ref.parameters())
        assert len(bp) == len(rp)
        self.opts = None
        if bp and self.opt_kind == "sgd":
            self.opts = [torch.optim.SGD(bp, lr=0.01, momentum=0.9), torch.optim.SGD(rp, lr=0.01, momentum=0.9)]

    def describe(self):
        graph = (f" cuda_graph=True static_outputs={self.static_outputs} direct_grads={self.direct_grads} "
                 f"graph_fallback={self.graph_fallback}" if self.cuda_graph else "")
        stages = ",".join(type(s).__name__ for s in self.pipe)
        return (f"ParallelSequential kind={self.kind} dtype={str(self.dtype)[6:]} stages=[{stages}] "
                f"chunks={self.chunks} B={self.B}{graph} train={self.training} opt={self.opt_kind} "
                f"host_inputs={self.host_inputs} caller_stream={self.side is not None}")

    def make_x(self):
        g = torch.Generator().manual_seed(self.rng.randrange(2**31))
        shape = {"vec": (self.B, self.F), "seq": (self.B, self.T, self.F), "img2d": (self.B, self.F, self.S, self.S)}
        return torch.randn(shape[self.kind], generator=g, dtype=torch.float64).to(self.dtype)

    def call(self, step):
        rng = self.rng
        grad_mode = rng.choice(["grad", "grad", "nograd", "inference"])
        where = rng.choice(["dev", "dev", "pinned", "pageable"]) if self.host_inputs else "dev"
        xgrad = rng.random() < 0.3 and self.dtype not in LOW_PRECISION
        if self.cuda_graph and self.prev_sig is not None and rng.random() < 0.75:
            grad_mode, where, xgrad = self.prev_sig
        self.prev_sig = (grad_mode, where, xgrad)
        xcpu = self.make_x()
        if where == "dev":
            xb = xcpu.to(self.dev)
        elif where == "pinned":
            xb = xcpu.pin_memory()  # (only reached on CUDA: host_inputs)
        else:
            xb = xcpu.clone()
        xb = xb.detach()
        xr = xb.detach().clone()  # the reference's own leaf (same device as the block's input)
        xgrad = xgrad and grad_mode == "grad"
        if xgrad:
            xb.requires_grad_(True)
            xr.requires_grad_(True)
        stream = self.side if self.side is not None and rng.random() < 0.5 else None
        self.last = (grad_mode, where, xgrad, tuple(xb.shape), f"chunks={self.pipe.chunks}") + (
            ("caller stream",) if stream is not None else ())
        ctx = {"grad": torch.enable_grad, "nograd": torch.no_grad, "inference": torch.inference_mode}[grad_mode]
        err_b = err_r = None
        with ctx():
            try:
                with on_stream(stream, self.dev):
                    yb = self.pipe(xb)
            except Exception as e:  # noqa
                err_b = e
            # (A pipeline holding no tensors has no device of its own: a host input stays there.)
            homeless = not any(True for _ in self.pipe.parameters()) and not any(True for _ in self.pipe.buffers())
            try:
                yr = self.ref(xr if homeless else xr.to(self.dev))
            except Exception as e:  # noqa
                err_r = e
        self.raised("pipeline", err_b, err_r)
        if yb.device != yr.device:
            raise AssertionError(f"step{step} output on {yb.device}, reference on {yr.device}")
        self.check(f"step{step} output", yb, yr)
        if grad_mode == "grad" and yr.requires_grad:
            if not yb.requires_grad:
                raise AssertionError(f"step{step} output requires no grad, reference's does")
            wt = random_weights([yr], rng.randrange(2**31))[0]
            with on_stream(stream, self.dev):
                (yb.float() * wt.float()).sum().backward()
            (yr.float() * wt.float()).sum().backward()
            floor = grad_floor(self.ref.parameters())
            for (k, pb), pr in zip(self.pipe.named_parameters(), self.ref.parameters()):
                if self.none_or_zeros(k, pb, pr, step, "pipeline"):
                    continue
                if pb.grad is not None:
                    self.check(f"step{step} grad {k}", pb.grad, pr.grad, True, floor)
            if xgrad:
                if xb.grad is None or xb.grad.device != xb.device:
                    raise AssertionError(f"step{step} input grad {None if xb.grad is None else xb.grad.device} "
                                         f"for an input on {xb.device}")
                self.check(f"step{step} input grad", xb.grad, xr.grad, True, floor)
            self.step_and_zero(self.pipe)
        for (k, b), rb in zip(self.pipe.named_buffers(), self.ref.buffers()):
            self.check(f"step{step} buffer {k}", b, rb, True)
        if stream is not None:
            sync(self.dev)
        # (yb goes out of scope here: static_outputs=True overwrites it at the next call.)

    def resync(self):
        with torch.no_grad():
            for pb, pr in zip(self.pipe.parameters(), self.ref.parameters()):
                pr.copy_(pb)

    def mutate(self):
        rng = self.rng
        r = rng.randrange(4)
        if r == 0:
            self.B = rng.randint(self.pipe.chunks, 16)
            return f"B={self.B}"
        if r == 1:
            c = rng.randint(1, min(4, self.B))
            self.pipe.chunks = c
            return f"chunks={c}"
        if r == 2:
            t = rng.random() < 0.5
            self.set_mode(t)
            return f"train({t})"
        with torch.no_grad():
            for pb in self.pipe.parameters():
                pb.mul_(0.9)
        self.resync()
        return "params *= 0.9"



# -------------------------------------------------------------------------------------- driver
def make_case(seed, dev):
    # About one case in four is a pipeline (decided by the seed alone).
    return PipeCase(seed, dev) if random.Random(seed * 7919 + 17).random() < 0.25 else Case(seed, dev)


def run_case(seed, dev):
    r"""``"ok"`` or ``"skip"``; raises on a failure (with ``.log`` and ``.config`` attached)."""
    log = []
    config = f"seed={seed}"
    try:
        c = make_case(seed, dev)
        config = c.describe()
        c.run(log)
        sync(dev)
        return "ok"
    except Skip:
        return "skip"
    except Exception as e:
        e.log = log
        e.config = config
        raise
    finally:
        del log


def cuda_broken(e, dev):
    r"""Whether the error left the CUDA context unusable (a sticky error): later cases would all fail."""
    text = f"{type(e).__name__}: {e}"
    if any(s in text for s in ("illegal memory access", "device-side assert", "unspecified launch failure",
                               "misaligned address", "illegal instruction", "CUBLAS_STATUS_EXECUTION_FAILED")):
        return text
    try:
        torch.cuda.synchronize(dev)
        torch.ones(1, device=dev).add_(1).item()
    except Exception as e2:  # noqa: BLE001
        return f"{type(e2).__name__}: {e2}"
    return None


def main():
    ap = argparse.ArgumentParser(description="Randomized differential fuzzer of Parallel / ParallelSequential.")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="default: cuda if available, else cpu")
    ap.add_argument("--seconds", type=float, default=150.0, help="wall-time budget (default 150)")
    ap.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--count", type=int, default=None, help="at most this many cases (default: until --seconds)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each failure's call log and traceback")
    ap.add_argument("--include-known", action="store_true",
                    help="also try what fails for a known, CPU-reproducible reason (see INCLUDE_KNOWN in the source)")
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device available", file=sys.stderr)
        return 2
    global INCLUDE_KNOWN
    INCLUDE_KNOWN = args.include_known
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        dev = torch.device("cuda", torch.cuda.current_device())  # (an index: the streams and syncs name it)
        name = torch.cuda.get_device_name(dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
        name = "CPU"

    t0 = time.perf_counter()
    n = failed = skipped = 0
    seed = args.start
    aborted = None
    interrupted = False
    while (args.count is None or n < args.count) and time.perf_counter() - t0 < args.seconds and not interrupted:
        # A hung case (a deadlock between streams, a graph waiting forever) prints every thread's stack.
        faulthandler.dump_traceback_later(max(120.0, args.seconds), exit=True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = run_case(seed, dev)
            if res == "skip":
                skipped += 1
        except KeyboardInterrupt:
            print(f"STOP interrupted in seed {seed} (not counted)", flush=True)
            interrupted = True
            n -= 1
        except Exception as e:  # noqa: BLE001
            failed += 1
            first = " | ".join(str(e).strip().splitlines()[:3])[:400]
            where = traceback.extract_tb(e.__traceback__)[-1]
            print(f"FAIL seed={seed}: {type(e).__name__}: {first} (at {where.filename.split('/')[-1]}:{where.lineno})"
                  f" | {getattr(e, 'config', '')}", flush=True)
            if args.verbose:
                print("    " + "\n    ".join(getattr(e, "log", [])))
                traceback.print_exception(type(e), e, e.__traceback__, file=sys.stdout)
                sys.stdout.flush()
            if device == "cuda":
                broken = cuda_broken(e, dev)
                if broken:
                    aborted = f"device unusable after seed {seed}: {(broken.splitlines() or [''])[0][:200]}"
        finally:
            faulthandler.cancel_dump_traceback_later()
        n += 1
        seed += 1
        if aborted:
            print(f"STOP {aborted}", flush=True)
            break
        if n % 25 == 0:
            gc.collect()  # graphs and their memory pools go with their modules
    print(f"{n} cases, {failed} failed, {skipped} skipped (both raised)  "
          f"[total {time.perf_counter() - t0:.1f}s, torch {torch.__version__}, {name}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
