"""Host time of the pieces of a graphed training call's hand-out of gradients (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_handout.py`` on the GPU machine.

mlp8's 64 parameters (32 weights of 256 x 256, 32 biases of 256): the ways of copying the backward
graph's gradient buffers into the copies handed to ``.grad`` (one multi-tensor copy of 64 pairs, one
``cat`` per shape into a flat buffer, one ``copy_`` per shape from a flat buffer), setting 64 ``.grad``
(a loop, ``map``), reading 64 ``requires_grad`` and hook dicts, and 64 reference counts. Variants are
sampled interleaved; medians of microseconds per call.
"""
import operator
import sys

import torch

from _timing import host_medians  # tools/ is the script's directory

dev = torch.device("cuda")
shapes = [(256, 256), (256,)] * 32
params = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in shapes]
sources = [torch.randn(s, device=dev) for s in shapes]
groups = {}
for i, s in enumerate(shapes):
    groups.setdefault(s, []).append(i)
owners = {s: torch.empty((len(ix), *s), device=dev) for s, ix in groups.items()}
views = [None] * len(shapes)
for s, ix in groups.items():
    for i, v in zip(ix, owners[s].unbind(0)):
        views[i] = v
flat_src = {s: torch.cat([sources[i].reshape(1, *s) for i in ix]) for s, ix in groups.items()}
flat_views = {s: [sources[i].view(-1) for i in ix] for s, ix in groups.items()}
owner_flat = {s: owners[s].view(-1) for s in groups}
get_rg = operator.attrgetter("requires_grad")
get_grad = operator.attrgetter("grad")


def foreach_copy():
    torch._foreach_copy_(views, sources)


def cat_out():
    for s in groups:
        torch.cat(flat_views[s], out=owner_flat[s])


def flat_copy():
    for s in groups:
        owners[s].copy_(flat_src[s])


def set_loop():
    for p, g in zip(params, views):
        p.grad = g
    for p in params:
        p.grad = None


def set_map():
    list(map(setattr, params, ["grad"] * 64, views))
    for p in params:
        p.grad = None


def unset_only():
    for p in params:
        p.grad = None


def rg_gen():
    return tuple(p.requires_grad for p in params)


def rg_map():
    return tuple(map(get_rg, params))


def hooks_loop():
    for p in params:
        if p._backward_hooks or p._post_accumulate_grad_hooks:
            return False
    return True


def held_list():
    held = [p.grad for p in params]
    return all(g is None for g in held)


def held_map():
    held = list(map(get_grad, params))
    return held.count(None) == len(held)


def refs_list():
    return [sys.getrefcount(t) for t in views]


def refs_map():
    return list(map(sys.getrefcount, views))


variants = {k: v for k, v in globals().items() if callable(v) and k in (
    "foreach_copy", "cat_out", "flat_copy", "set_loop", "set_map", "unset_only", "rg_gen", "rg_map",
    "hooks_loop", "held_list", "held_map", "refs_list", "refs_map")}
cat_out()
assert all(torch.equal(v, s) for v, s in zip(views, sources))
N = 200
medians = host_medians(variants, rounds=25, per_sample=N, warmup=50)
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: host us per call, medians of 25 x {N} calls")
for k, m in medians.items():
    print(f"{k:<14}{m:8.2f}")
