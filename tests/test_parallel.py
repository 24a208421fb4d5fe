"""``Parallel``: semantics, container behaviour, state and autograd.

Every result is compared bit-for-bit (fp32, TF32 off: see ``conftest.py``) with the plain
sequential computation on fresh random inputs. Tests taking ``device`` also run on CUDA,
where ``streams=True`` forks the branches onto side streams.
"""

from __future__ import annotations

import copy
import functools
import io
import numbers
import pickle
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from parallel_modules import Parallel
from tests._helpers import (Float32Region, Loop, OwnAutocast, Steps, appending_from_another_thread,
                           cpu_and_cuda, half, hook_shapes, rewriting_hooks, under_autocast_saving)
from tests._reference import assert_same, join_reference, reference

STREAMS = (True, False, "auto")


def mlp(i: int = 16, o: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, 16), nn.GELU(), nn.Linear(16, o))


def three_branches() -> list[nn.Module]:
    return [mlp(16, 8), nn.Linear(16, 8), nn.Sequential(nn.Linear(16, 8), nn.Tanh())]


def max_join(outs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(outs, 0).amax(0)


def keys(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_children()]


# --------------------------------------------------------------------------- joins
JOINS = [
    ("cat", 1), ("cat", 0), ("cat", -1), ("stack", 0), ("stack", 2), ("sum", 1), ("mean", 1),
    (None, 1), ("tuple", 1), ("dict", 1), (max_join, 1),
]


def _explicit_join(join, dim, outs):
    a, b, c = outs
    if join == "cat":
        return torch.cat([a, b, c], dim)
    if join == "stack":
        return torch.stack([a, b, c], dim)
    if join == "sum":
        return a + b + c
    if join == "mean":
        return (a + b + c) / 3
    if join is None or join == "tuple":
        return (a, b, c)
    if join == "dict":
        return {"0": a, "1": b, "2": c}
    return join([a, b, c])


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("join,dim", JOINS, ids=[f"{getattr(j, '__name__', j)}-{d}" for j, d in JOINS])
def test_join_matches_sequential(device, join, dim):
    branches = three_branches()
    p = Parallel(*branches, join=join, dim=dim, streams=True).to(device)
    for _ in range(2):
        x = torch.randn(4, 16, device=device)
        out = p(x)
        expected = _explicit_join(join, dim, [b(x) for b in branches])
        assert_same(out, expected)


@pytest.mark.parametrize("n", [1, 2, 8, 40])
@pytest.mark.parametrize("join", ["cat", "sum"])
def test_many_branches_match_sequential_on_cpu(n, join):
    # DESIGN.md's reliability item 1 on the CPU fallback too (the CUDA test, in
    # test_parallel_cuda.py, is where 40 branches outnumber a device's 32 side streams):
    # the fallback must give the sequential module's bits for any branch count.
    torch.manual_seed(n)
    p = Parallel(*[mlp() for _ in range(n)], join=join, streams=True)
    for _ in range(2):
        x = torch.randn(4, 16)
        assert_same(p(x), reference(p, x))


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_single_branch(device):
    lin = nn.Linear(16, 8).to(device)
    x = torch.randn(4, 16, device=device)
    assert_same(Parallel(lin, join="cat")(x), lin(x))
    assert_same(Parallel(lin, join="sum")(x), lin(x))
    assert_same(Parallel(lin, join=None)(x), (lin(x),))
    assert_same(Parallel(lin, join="stack", dim=0)(x), lin(x).unsqueeze(0))


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_named_branches(device):
    left, right = nn.Linear(16, 4), mlp(16, 6)
    p = Parallel(OrderedDict([("left", left), ("right", right)]), join="dict", streams=True).to(device)
    assert keys(p) == ["left", "right"]
    assert p.left is left and p.right is right
    assert p[0] is left and p[1] is right and p[-1] is right
    x = torch.randn(3, 16, device=device)
    out = p(x)
    assert type(out) is dict and list(out) == ["left", "right"]
    assert_same(out, {"left": left(x), "right": right(x)})

    cat = Parallel(OrderedDict([("left", left), ("right", right)]), join="cat", streams=True)
    x = torch.randn(3, 16, device=device)
    assert_same(cat(x), torch.cat([left(x), right(x)], 1))


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x, y, *, scale=1.0, bias=None):
        out = self.lin(x) * scale + self.proj(y)
        return out if bias is None else out + bias


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_multiple_args_and_kwargs(device):
    branches = [Mix(), Mix(), Mix()]
    p = Parallel(*branches, join="cat", streams=True).to(device)
    for _ in range(2):
        x = torch.randn(4, 16, device=device)
        y = torch.randn(4, 8, device=device)
        bias = torch.randn(8, device=device)
        assert_same(p(x, y), torch.cat([b(x, y) for b in branches], 1))
        assert_same(p(x, y=y), torch.cat([b(x, y) for b in branches], 1))
        assert_same(p(x, y, scale=0.5), torch.cat([b(x, y, scale=0.5) for b in branches], 1))
        # Only keyword tensors: the device is found among the kwargs.
        assert_same(p(x=x, y=y, bias=bias), torch.cat([b(x, y, bias=bias) for b in branches], 1))


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_non_tensor_first_argument(device):
    p = Parallel(lambda k, x: x * k, lambda k, x: x + k, join="sum", streams=True)
    x = torch.randn(4, 5, device=device)
    assert_same(p(3.0, x), x * 3.0 + (x + 3.0))
    assert_same(p(2.0, x=x), x * 2.0 + (x + 2.0))


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 4), nn.Linear(16, 4), nn.Linear(16, 2)

    def forward(self, x):
        return {"a": self.a(x), "rest": (self.b(x), [self.c(x)])}


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("join", ["cat", "stack", "sum", "mean"])
def test_structured_outputs_join_leaf_by_leaf(device, join):
    branches = [Structured(), Structured(), Structured()]
    p = Parallel(*branches, join=join, dim=1, streams=True).to(device)
    x = torch.randn(5, 16, device=device)
    out = p(x)
    outs = [b(x) for b in branches]
    assert type(out) is dict and type(out["rest"]) is tuple and type(out["rest"][1]) is list
    assert_same(out, join_reference(join, 1, ["0", "1", "2"], outs))
    if join == "cat":  # spelled out once, independently of the reference helper
        assert_same(out["a"], torch.cat([o["a"] for o in outs], 1))
        assert_same(out["rest"][1][0], torch.cat([o["rest"][1][0] for o in outs], 1))
        assert out["rest"][0].shape == (5, 12)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_structured_outputs_tuple_join_keeps_structure(device):
    branches = [Structured(), Structured()]
    p = Parallel(*branches, join=None, streams=True).to(device)
    x = torch.randn(5, 16, device=device)
    assert_same(p(x), tuple(b(x) for b in branches))


# ---------------------------------------------------------------------- container
def test_len_iter_and_indexing():
    bs = [nn.Linear(4, 4) for _ in range(4)]
    p = Parallel(*bs, join="sum")
    assert len(p) == 4
    assert list(p) == bs
    assert keys(p) == ["0", "1", "2", "3"]
    assert p[0] is bs[0] and p[3] is bs[3]
    assert p[-1] is bs[3] and p[-4] is bs[0]
    for bad in (4, -5, 100):
        with pytest.raises(IndexError):
            p[bad]


def test_slice_returns_parallel_with_same_settings_and_keys():
    bs = [nn.Linear(4, 4) for _ in range(4)]
    p = Parallel(*bs, join="stack", dim=0, streams=False)
    sub = p[1:3]
    assert type(sub) is Parallel
    assert list(sub) == bs[1:3]
    # Numbered anew, as an nn.ModuleList of those branches is keyed (and as ``del`` numbers
    # them); before, the keys were kept ("1", "2"), and appending to the slice was refused.
    assert keys(sub) == ["0", "1"]
    assert sub.state_dict().keys() == nn.ModuleList(bs[1:3]).state_dict().keys()
    assert len(sub.append(nn.Linear(4, 4))) == 3
    sub = p[1:3]
    named = Parallel(OrderedDict(a=bs[0], b=bs[1], c=bs[2]))
    assert keys(named[1:]) == ["b", "c"]  # (named branches keep their names)
    assert (sub.join, sub.dim, sub.streams) == (p.join, p.dim, p.streams)
    assert sub.extra_repr() == p.extra_repr()
    x = torch.randn(3, 4)
    assert_same(sub(x), torch.stack([bs[1](x), bs[2](x)], 0))
    rev = p[::-1]
    assert list(rev) == bs[::-1]
    assert_same(rev(x), torch.stack([b(x) for b in bs[::-1]], 0))

    named = Parallel(OrderedDict(a=bs[0], b=bs[1], c=bs[2]), join="dict")
    tail = named[1:]
    assert keys(tail) == ["b", "c"] and tail.join == "dict"
    assert_same(tail(x), {"b": bs[1](x), "c": bs[2](x)})

    class MyParallel(Parallel):
        pass

    assert type(MyParallel(*bs)[:2]) is MyParallel


def test_append_and_extend_return_self():
    a, b, c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    p = Parallel(a, join="cat")
    x = torch.randn(2, 4)
    assert_same(p(x), a(x))  # a first call, so any per-call caches exist before the change
    assert p.append(b) is p
    assert len(p) == 2 and keys(p) == ["0", "1"] and p[1] is b
    assert_same(p(x), torch.cat([a(x), b(x)], 1))
    assert p.append(torch.relu) is p
    assert keys(p) == ["0", "1", "2"] and isinstance(p[2], nn.Module)
    assert_same(p(x), torch.cat([a(x), b(x), torch.relu(x)], 1))
    assert p.extend([c]) is p
    assert p[3] is c
    assert_same(p(x), torch.cat([a(x), b(x), torch.relu(x), c(x)], 1))


@pytest.mark.parametrize("fuse", [False, "auto"])
def test_insert_pop_and_iadd_behave_as_module_lists_do(fuse):
    # Before (a CPU hunt): Parallel had append and extend but not nn.ModuleList's insert,
    # pop and +=.
    torch.manual_seed(0)
    bs = [nn.Linear(4, 4) for _ in range(5)]
    p, ref = Parallel(*bs[:2], fuse=fuse), nn.ModuleList(bs[:2])
    x = torch.randn(2, 4)
    with torch.no_grad():
        p(x), p(x)  # (schedules and fused groups made before the changes)
        for i, (index, module) in enumerate([(1, bs[2]), (-1, bs[3]), (0, bs[4])]):
            assert p.insert(index, module) is p
            ref.insert(index if index >= 0 else index + len(ref), module)
            assert list(p) == list(ref) and list(p.state_dict()) == list(ref.state_dict())
            assert_same(p(x), torch.cat([m(x) for m in ref], 1))
        assert p.pop(key=1) is ref.pop(key=1)  # (by name too, as nn.ModuleList's)
        assert list(p) == list(ref) and keys(p) == ["0", "1", "2", "3"]
        assert_same(p(x), torch.cat([m(x) for m in ref], 1))
        popped = p.pop(slice(0, 2))
        assert isinstance(popped, Parallel) and list(popped) == list(ref[:2]) and list(p) == list(ref[2:])
        more = [nn.Linear(4, 4), nn.Linear(4, 4)]
        p += nn.Sequential(*more)
        assert list(p) == [*ref[2:], *more] and keys(p) == ["0", "1", "2", "3"]
        assert_same(p(x), torch.cat([m(x) for m in p], 1))
    with pytest.raises(IndexError, match=r"insert index 9 is out of range for 4 branches"):
        p.insert(9, nn.Linear(4, 4))
    with pytest.raises(IndexError,
                       match=r"insert index 2 is out of range for 1 branch \(expected -1 <= index <= 1\)\.$"):
        Parallel(nn.Linear(4, 4)).insert(2, nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"cannot be a branch|not a Module|callable"):
        p.insert(0, 3)
    assert len(p) == 4  # (refused, left as it was)
    named = Parallel(OrderedDict(a=bs[0], b=bs[1]), join="dict")
    with pytest.raises(ValueError, match=r"insert numbers the branches by position.*\['a', 'b'\]"):
        named.insert(0, bs[2])
    assert keys(named) == ["a", "b"]
    with pytest.raises(ValueError, match="cannot delete every branch"):
        Parallel(bs[0]).pop(0)


@pytest.mark.parametrize("fuse", [False, "auto"])
def test_add_makes_a_new_block_as_module_lists_do(fuse):
    # Before (a CPU hunt): += worked as on nn.ModuleList, + raised TypeError.
    torch.manual_seed(0)
    bs = [nn.Linear(4, 4) for _ in range(3)]
    p = Parallel(OrderedDict(a=bs[0], b=bs[1]), join="sum", fuse=fuse)
    q = Parallel(bs[2], torch.tanh)
    x = torch.randn(2, 4)
    same = assert_same if fuse is False else torch.testing.assert_close  # (fused: summed in another order)
    with torch.no_grad():
        p(x)  # (a schedule and fused groups made before)
        r = p + q
        assert isinstance(r, Parallel) and r is not p
        assert list(r) == [*p, *q] and r[0] is bs[0] and r[2] is bs[2]  # shared, not copied
        assert list(r.state_dict()) == list(nn.ModuleList([*p, *q]).state_dict())  # numbered anew
        assert r.join == "sum" and r.fuse == fuse  # p's settings
        same(r(x), bs[0](x) + bs[1](x) + bs[2](x) + torch.tanh(x))
        assert list(p._modules) == ["a", "b"] and len(q) == 2  # operands unchanged
        same(p(x), bs[0](x) + bs[1](x))
        same((p + [nn.Identity()])(x), bs[0](x) + bs[1](x) + x)
    with pytest.raises(TypeError, match=r"Parallel: \+ takes an iterable of branches .*got Linear\. To add one "
                                        r"branch, write block \+ \[module\]"):
        p + bs[2]


def test_extend_with_one_module_says_to_append_it():
    # Before: extend(module) and block += module raised "'Linear' object is not iterable", naming
    # neither the block nor the fix (nn.ModuleList.extend says it wants an iterable).
    p, lin = Parallel(nn.Linear(4, 4)), nn.Linear(4, 4)
    for extend in (p.extend, p.__iadd__):
        with pytest.raises(TypeError, match=r"Parallel: extend takes an iterable of branches \(another Parallel, "
                                            r"a list\), got Linear\. To add one branch, use block\.append\(module\)"):
            extend(lin)
    assert len(p) == 1  # (left as it was)


def test_setitem_replaces_branch():
    a, b, c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    p = Parallel(a, b, join="sum")
    x = torch.randn(2, 4)
    assert_same(p(x), a(x) + b(x))
    p[1] = c
    assert p[1] is c and keys(p) == ["0", "1"]
    assert_same(p(x), a(x) + c(x))
    p[-2] = torch.tanh
    assert_same(p(x), torch.tanh(x) + c(x))

    named = Parallel(OrderedDict(u=a, v=b), join="dict")
    named[0] = c
    assert keys(named) == ["u", "v"] and named.u is c
    assert_same(named(x), {"u": c(x), "v": b(x)})


def test_delitem_renumbers():
    bs = [nn.Linear(4, 4) for _ in range(5)]
    p = Parallel(*bs, join=None)
    x = torch.randn(2, 4)
    p(x)
    del p[1]
    assert keys(p) == ["0", "1", "2", "3"] and list(p) == [bs[0], bs[2], bs[3], bs[4]]
    assert_same(p(x), tuple(b(x) for b in (bs[0], bs[2], bs[3], bs[4])))
    del p[-1]
    assert keys(p) == ["0", "1", "2"] and list(p) == [bs[0], bs[2], bs[3]]
    del p[0:2]
    assert keys(p) == ["0"] and list(p) == [bs[3]]
    assert_same(p(x), (bs[3](x),))
    assert list(p.state_dict()) == list(nn.ModuleList([bs[3]]).state_dict())
    with pytest.raises(ValueError, match=r"Parallel: cannot delete every branch; at least one must remain"):
        del p[0]  # the last branch cannot go
    assert list(p) == [bs[3]]
    assert_same(p(x), (bs[3](x),))

    named = Parallel(OrderedDict(a=bs[0], b=bs[1], c=bs[2]), join="dict")
    del named[1]
    assert keys(named) == ["a", "c"]  # names are kept, not renumbered
    assert_same(named(x), {"a": bs[0](x), "c": bs[2](x)})


def test_extra_repr_shows_settings():
    p = Parallel(nn.Linear(4, 4), nn.ReLU(), join="stack", dim=2, streams=False)
    text = p.extra_repr()
    assert "stack" in text and "dim=2" in text and "streams=False" in text
    r = repr(p)
    assert text in r and "(0): Linear" in r and "(1): ReLU" in r
    assert "streams='auto'" in Parallel(nn.ReLU()).extra_repr()
    assert "max_join" in Parallel(nn.ReLU(), join=max_join).extra_repr()
    assert "tuple" in Parallel(nn.ReLU(), join=None).extra_repr()
    named = repr(Parallel(OrderedDict(first=nn.ReLU(), second=nn.Tanh())))
    assert "(first): ReLU" in named and "(second): Tanh" in named


# -------------------------------------------------------------------------- state
@pytest.mark.parametrize("device", cpu_and_cuda())
def test_state_dict_keys_match_module_list(device):
    branches = [mlp(), nn.BatchNorm1d(16), nn.Linear(16, 8)]
    p = Parallel(*branches, streams=True).to(device)
    p(torch.randn(4, 16, device=device))  # after a call: no streams, events or plans leak into state
    sd = p.state_dict()
    expected = nn.ModuleList(branches).state_dict()
    assert list(sd) == list(expected)
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    for k in sd:
        assert_same(sd[k], expected[k])
    assert len(list(p.parameters())) == len(list(nn.ModuleList(branches).parameters()))
    assert len(list(p.buffers())) == len(list(nn.ModuleList(branches).buffers()))

    named = OrderedDict(enc=mlp(), norm=nn.BatchNorm1d(16))
    pn = Parallel(named, streams=True).to(device)
    pn(torch.randn(4, 16, device=device))
    assert list(pn.state_dict()) == list(nn.ModuleDict(named).state_dict())


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_load_state_dict_round_trip(device):
    torch.manual_seed(0)
    p1 = Parallel(mlp(), nn.Linear(16, 8), streams=True).to(device)
    torch.manual_seed(1)
    p2 = Parallel(mlp(), nn.Linear(16, 8), streams=True).to(device)
    x = torch.randn(4, 16, device=device)
    assert not torch.equal(p1(x), p2(x))
    result = p2.load_state_dict(p1.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(4, 16, device=device)
    assert_same(p2(x), p1(x))

    # The keys are a ModuleList's: a ModuleList checkpoint loads strictly.
    torch.manual_seed(2)
    ml = nn.ModuleList([mlp(), nn.Linear(16, 8)]).to(device)
    p2.load_state_dict(ml.state_dict())
    assert_same(p2(x), torch.cat([ml[0](x), ml[1](x)], 1))

    buf = io.BytesIO()
    torch.save(p1.state_dict(), buf)
    buf.seek(0)
    p2.load_state_dict(torch.load(buf, weights_only=True))
    assert_same(p2(x), p1(x))


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_callable_branches(device):
    double = lambda t: t * 2  # noqa: E731
    clamp = functools.partial(torch.clamp, min=-0.5, max=0.5)
    p = Parallel(torch.relu, double, clamp, nn.Identity(), join="cat", streams=True)
    assert all(isinstance(b, nn.Module) for b in p)
    assert p.state_dict() == {}
    assert "relu" in repr(p)
    x = torch.randn(3, 4, device=device)
    assert_same(p(x), torch.cat([torch.relu(x), x * 2, torch.clamp(x, -0.5, 0.5), x], 1))


def test_a_callable_branch_is_held_but_the_modules_it_calls_are_not_registered():
    # README: the holder is block[i] (listed, counted), block[i].fn the callable; the modules the
    # callable calls are its owner's to register: the block's parameters, state dict, .to() and
    # .eval() do not reach them.
    called = nn.Linear(4, 4)
    p = Parallel(called.forward, torch.relu, nn.Linear(4, 4), join="cat")
    assert len(p) == 3 and p[0].fn == called.forward and p[1].fn is torch.relu
    assert [name for name, _ in p.named_modules()] == ["", "0", "1", "2"]
    assert list(p.state_dict()) == ["2.weight", "2.bias"]
    assert not any(q is called.weight for q in p.parameters())
    p.eval()
    assert called.training and not p[2].training
    p.to(torch.float64)
    assert called.weight.dtype == torch.float32 and p[2].weight.dtype == torch.float64


def _nested(streams):
    inner_sum = Parallel(nn.Linear(16, 8), mlp(16, 8), join="sum", streams=streams)
    stacked = Parallel(nn.Linear(16, 4), nn.Linear(16, 4), join="stack", dim=1, streams=streams)
    return Parallel(
        inner_sum,
        nn.Sequential(nn.Linear(16, 16), stacked, nn.Flatten()),
        nn.Linear(16, 8),
        Parallel(nn.Sequential(Parallel(nn.Linear(16, 2), nn.Linear(16, 2), streams=streams), nn.ReLU()),
                 nn.Linear(16, 4), join="cat", streams=streams),
        join="cat", streams=streams,
    )


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("streams", STREAMS)
def test_nested_parallel(device, streams):
    p = _nested(streams).to(device)
    for _ in range(3):
        x = torch.randn(4, 16, device=device)
        out = p(x)
        assert out.shape == (4, 8 + 8 + 8 + 8)
        # Spelled out by hand, without the reference helper:
        a = p[0][0](x) + p[0][1](x)
        h = p[1][0](x)
        b = torch.stack([p[1][1][0](h), p[1][1][1](h)], 1).flatten(1)
        c = p[2](x)
        inner = p[3][0][0]
        d = torch.cat([torch.relu(torch.cat([inner[0](x), inner[1](x)], 1)), p[3][1](x)], 1)
        assert_same(out, torch.cat([a, b, c, d], 1))
        assert_same(out, reference(p, x))
    # State-dict keys of the nested structure: those of ModuleLists nested the same way.
    twin = nn.ModuleList([
        nn.ModuleList(list(p[0])),
        nn.Sequential(p[1][0], nn.ModuleList(list(p[1][1])), p[1][2]),
        p[2],
        nn.ModuleList([nn.Sequential(nn.ModuleList(list(p[3][0][0])), p[3][0][1]), p[3][1]]),
    ])
    assert list(p.state_dict()) == list(twin.state_dict())


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_deepcopy_and_pickle(device):
    p = Parallel(OrderedDict(a=mlp(), b=nn.Linear(16, 8)), join="dict", dim=1, streams=True).to(device)
    x = torch.randn(4, 16, device=device)
    out = p(x)  # populate per-call state (plans, tuner) before copying

    q = copy.deepcopy(p)
    assert type(q) is Parallel and keys(q) == ["a", "b"]
    assert q.extra_repr() == p.extra_repr()
    assert q.a is not p.a
    assert_same(q(x), out)
    with torch.no_grad():
        q.a[0].weight.add_(1.0)
    assert not torch.equal(q(x)["a"], out["a"])
    assert_same(p(x), out)  # the original is untouched

    for r in (pickle.loads(pickle.dumps(p)), _torch_roundtrip(p)):
        assert type(r) is Parallel and keys(r) == ["a", "b"] and r.extra_repr() == p.extra_repr()
        assert_same(r(x), out)
        x2 = torch.randn(4, 16, device=device)
        assert_same(r(x2), p(x2))



@pytest.mark.parametrize("fuse", [False, True, "auto"])
@pytest.mark.parametrize("how", ["del", "pop", "delattr", "append", "insert"])
def test_a_shallow_copy_has_branches_of_its_own(fuse, how):
    # Before (a CPU hunt): copy.copy shared the block's dict of branches, and a branch deleted
    # from the copy left the block's fused group running it, unseen: 9 columns from 2 branches.
    torch.manual_seed(0)
    branch = lambda: nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 3))
    p = Parallel(*[branch() for _ in range(3)], fuse=fuse)
    x = torch.randn(5, 8)
    out = p(x)
    q = copy.copy(p)
    assert type(q) is Parallel and q.extra_repr() == p.extra_repr() and all(a is b for a, b in zip(q, p))
    if how == "del":
        del q[0]
    elif how == "pop":
        q.pop(0)
    elif how == "delattr":
        delattr(q, "0")
    elif how == "append":
        q.append(branch())
    else:
        q.insert(0, branch())
    assert len(q) == (2 if how in ("del", "pop", "delattr") else 4)
    torch.testing.assert_close(q(x), torch.cat([b(x) for b in q], 1))
    assert len(p) == 3 and list(p._modules) == ["0", "1", "2"]
    torch.testing.assert_close(p(x), out)

def _torch_roundtrip(module):
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# ----------------------------------------------------------------------- autograd
def _pairs(p, ref):
    pp, rp = list(p.named_parameters()), list(ref.named_parameters())
    assert [n for n, _ in pp] == [n for n, _ in rp]
    return [(a, b) for (_, a), (_, b) in zip(pp, rp)]


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("join", ["cat", "sum", "stack"])
def test_backward_matches_sequential(device, join):
    branches = three_branches()
    ref = nn.ModuleList(copy.deepcopy(branches)).to(device)
    p = Parallel(*branches, join=join, dim=1, streams=True).to(device)
    opt_p = torch.optim.SGD(p.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(4, 16, device=device, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        out = p(x)
        expected = join_reference(join, 1, [], [b(xr) for b in ref])
        assert_same(out, expected)
        w = torch.randn_like(out)
        (out * w).sum().backward()
        (expected * w).sum().backward()
        assert_same(x.grad, xr.grad)  # the input is shared by every branch
        for a, b in _pairs(p, ref):
            assert_same(a.grad, b.grad)
        opt_p.step()
        opt_r.step()
        opt_p.zero_grad()
        opt_r.zero_grad()
        for a, b in _pairs(p, ref):
            assert_same(a, b)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_autograd_grad_matches_sequential(device):
    branches = three_branches()
    ref = nn.ModuleList(copy.deepcopy(branches)).to(device)
    p = Parallel(*branches, join="cat", streams=True).to(device)
    for _ in range(3):
        x = torch.randn(4, 16, device=device, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        out = p(x)
        expected = torch.cat([b(xr) for b in ref], 1)
        w = torch.randn_like(out)
        got = torch.autograd.grad((out * w).sum(), [x, *p.parameters()])
        want = torch.autograd.grad((expected * w).sum(), [xr, *ref.parameters()])
        assert len(got) == len(want)
        for g, e in zip(got, want):
            assert_same(g, e)
        with torch.no_grad():  # an SGD step, so the next iteration sees new weights
            for (a, b), g, e in zip(_pairs(p, ref), got[1:], want[1:]):
                a.sub_(0.1 * g)
                b.sub_(0.1 * e)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_dropout_branches_draw_like_sequential(device):
    # Random branches draw in branch order, as the sequential code does.
    p = Parallel(nn.Dropout(0.5), nn.Dropout(0.3), nn.Identity(), join=None, streams=True)
    x = torch.randn(64, 32, device=device)
    torch.manual_seed(123)
    out = p(x)
    torch.manual_seed(123)
    expected = (nn.functional.dropout(x, 0.5), nn.functional.dropout(x, 0.3), x)
    assert_same(out, expected)
    p.eval()
    assert all(not b.training for b in p)
    assert_same(p(x), (x, x, x))


# ------------------------------------------------------------------- module hooks
@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("where", ["block", "branch", "layer"])
def test_hooks_rewriting_inputs_outputs_and_gradients_run_as_on_the_plain_module(device, where):
    # Hooks with keywords rewriting a call's arguments and its output, a backward pre-hook
    # rewriting the gradient, and one always called: on the block itself, on a branch or on a
    # layer inside one, each runs as often, handed the same, as on the branches called in a loop.
    # (Forked on CUDA: hooks of branches on side streams run there.)
    torch.manual_seed(0)
    branches = three_branches()
    ref = Loop(copy.deepcopy(branches)).to(device)
    p = Parallel(*branches, streams=True).to(device)
    logs = []
    for module in (p, ref):
        target = {"block": module, "branch": module[0], "layer": module[0][2]}[where]
        logs.append([])
        rewriting_hooks(module, target, logs[-1])
    for _ in range(2):
        x = torch.randn(4, 16, device=device, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        out, expected = p(x), ref(xr)
        assert_same(out, expected)
        w = torch.randn_like(out)
        (out * w).sum().backward()
        (expected * w).sum().backward()
        assert_same(x.grad, xr.grad)
        for a, b in _pairs(p, ref):
            assert_same(a.grad, b.grad)
    assert logs[0] == logs[1] and len(logs[0]) == 2 * 5


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [True, False])
def test_hooks_on_a_graphed_block_itself_run_at_every_call(grad):
    # README: with cuda_graph=True the block's own hooks run around its graphs -- at every call,
    # replays included, rewriting the input the graph copies in, its output and its gradient as
    # on the plain module (those of the modules below run only while capturing).
    torch.manual_seed(0)
    branches = three_branches()
    ref = Loop(copy.deepcopy(branches)).cuda()
    p = Parallel(*branches, cuda_graph=True).cuda()
    logs = [], []
    for module, log in zip((p, ref), logs):
        rewriting_hooks(module, module, log)
    for _ in range(4):  # (captured at a call, replayed at the later ones)
        x = torch.randn(4, 16, device="cuda", requires_grad=grad)
        xr = x.detach().clone().requires_grad_(grad)
        with torch.enable_grad() if grad else torch.no_grad():
            out, expected = p(x), ref(xr)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        if grad:
            (out * 2).sum().backward()
            (expected * 2).sum().backward()
            torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
            for a, b in _pairs(p, ref):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    assert logs[0] == logs[1] and len(logs[0]) == 4 * (5 if grad else 3)


@pytest.mark.parametrize("join", ["cat", "sum", "stack"])
def test_always_called_hooks_run_when_the_join_refuses_and_the_block_works_after(join):
    # The join's own error, raised from the block's forward: hooks registered with
    # always_call=True run as around the plain module's torch.cat failing (handed no output),
    # the block's, a branch's and those registered for the whole process; the next call works.
    outer = {"cat": lambda outs: torch.cat(outs, 1), "sum": sum, "stack": lambda outs: torch.stack(outs, 1)}[join]

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.add_module("0", nn.Flatten())
            self.add_module("1", nn.Identity())

        def forward(self, x):
            return outer([branch(x) for branch in self._modules.values()])

    p, ref = Parallel(nn.Flatten(), nn.Identity(), join=join), Plain()
    logs = [], []
    for module, log in zip((p, ref), logs):
        for name, target in (("block", module), ("branch", module[0] if module is p else module._modules["0"])):
            target.register_forward_hook(lambda m, a, out, log=log, name=name: log.append((name, hook_shapes(out))),
                                         always_call=True)
    global_log = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, a, out: global_log.append((type(m).__name__, hook_shapes(out))), always_call=True)
    try:
        for module in (p, ref):
            with pytest.raises(RuntimeError):
                module(torch.randn(2, 3, 4))  # a 2-D and a 3-D output: no join takes them
    finally:
        handle.remove()
    assert logs[0] == logs[1] == [("branch", (2, 12)), ("block", None)]
    assert global_log[:3] == [("Flatten", (2, 12)), ("Identity", (2, 3, 4)), ("Parallel", None)]
    assert [kind for kind, _ in global_log[3:]] == ["Flatten", "Identity", "Plain"]
    x = torch.randn(2, 4)
    assert_same(p(x), ref(x))
    assert logs[0][-2:] == logs[1][-2:] == [("branch", (2, 4)), ("block", tuple(ref(x).shape))]


def test_state_dict_hooks_run_as_on_the_plain_module():
    # The state dict's hooks, on the block, a branch and a layer inside one: those adding a key
    # and changing a value, and a load post-hook clearing what it does not expect.
    torch.manual_seed(0)
    branches = three_branches()
    results = []
    for module in (Parallel(*copy.deepcopy(branches)), Loop(copy.deepcopy(branches))):
        log = []
        module(torch.randn(2, 16))
        module.register_state_dict_pre_hook(lambda m, prefix, keep_vars, log=log: log.append(("pre", prefix)))

        def extra(m, state, prefix, local, log=log):
            log.append(("post", prefix))
            state[prefix + "extra"] = torch.ones(1)

        module[0]._register_state_dict_hook(extra)
        module[2][0]._register_state_dict_hook(lambda m, state, prefix, local: state[prefix + "weight"].mul_(0))
        module.register_load_state_dict_post_hook(
            lambda m, keys, log=log: log.append(("load", list(keys.unexpected_keys))) or keys.unexpected_keys.clear())
        state = module.state_dict()
        module.load_state_dict({k: v + 1 for k, v in state.items()})
        results.append((log, list(state), module(torch.ones(2, 16))))
    (log, keys, out), (ref_log, ref_keys, expected) = results
    assert log == ref_log == [("pre", ""), ("post", "0."), ("load", ["0.extra"])]
    assert keys == ref_keys and "0.extra" in keys
    assert_same(out, expected)


# ------------------------------------------------------------ execution settings
@pytest.mark.parametrize("device", cpu_and_cuda())
def test_streams_settings_give_identical_results(device):
    branches = [mlp(16, 8) for _ in range(4)]
    mods = {s: Parallel(*branches, join="cat", streams=s).to(device) for s in STREAMS}
    with torch.no_grad():
        for _ in range(16):  # past the "auto" tuner's trial calls
            x = torch.randn(8, 16, device=device)
            expected = torch.cat([b(x) for b in branches], 1)
            for s, m in mods.items():
                assert_same(m(x), expected)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_parallel_inside_sequential(device):
    model = nn.Sequential(
        nn.Linear(16, 16), nn.ReLU(),
        Parallel(nn.Linear(16, 8), mlp(16, 8), join="cat"),
        nn.Linear(16, 4),
    ).to(device)
    params = list(model.parameters())
    for _ in range(3):
        x = torch.randn(6, 16, device=device, requires_grad=True)
        h = torch.relu(model[0](x))
        expected = model[3](torch.cat([model[2][0](h), model[2][1](h)], 1))
        out = model(x)
        assert_same(out, expected)
        w = torch.randn_like(out)
        got = torch.autograd.grad((out * w).sum(), [x, *params])
        want = torch.autograd.grad((expected * w).sum(), [x, *params])
        for g, e in zip(got, want):
            assert_same(g, e)


@pytest.mark.parametrize("fuse", [False, "auto"])
def test_a_buffer_assigned_anew_in_forward_keeps_what_the_block_learnt(fuse):
    # Before: assigning a buffer runs torch's registration hooks, which the block took for a
    # changed tree: its schedules, groups and graphs were made anew at every call (3.8x the
    # branches' own time on the CPU, 9x with fuse="auto").
    import warnings

    from parallel_modules import ParallelSequential

    torch.manual_seed(0)
    block = Parallel(Steps(), Steps(), fuse=fuse)
    a, b = torch.randn(4, 8), torch.randn(5, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (fuse="auto": the group cannot run batched, and says so once)
        # (fuse="auto": the first call of each signature runs in order, the group fails fused at
        # the third, and both signatures are planned anew, unfused, at their next calls.)
        for x in (a, b, a, b, a):
            assert torch.equal(block(x), torch.cat([m.lin(x) for m in block], 1))
        assert len(block.explain()["schedules"]) == 2  # both signatures' schedules kept
        assert [int(m.steps) for m in block] == [5, 5]
        # A buffer replaced by one of another shape changes the tree: made anew.
        block[0].steps = torch.zeros(2)
        block(a)
        assert len(block.explain()["schedules"]) == 1
        pipe = ParallelSequential(Steps(), nn.Linear(8, 8), chunks=2)
        pipe(a)
        plan = pipe._plan
        pipe(a)
        assert pipe._plan is plan and int(pipe[0].steps) == 4  # (one call per micro-batch)


class _StepsWithLazyHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.LazyLinear(8)  # (never run: its parameters stay uninitialized)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        return self.lin(x)


@pytest.mark.parametrize("make", [_StepsWithLazyHead, lambda: _EmptyPick()], ids=["lazy-head", "empty-buffer"])
def test_buffers_without_memory_of_their_own_are_assigned_anew_without_trouble(make):
    # Before (a review of this session's tie check): a tree holding an uninitialized lazy
    # parameter raised ValueError at the next call after a buffer was assigned, and a buffer of
    # no elements (every one at address 0) counted as tied: everything was made anew each call.
    import warnings

    block = Parallel(make(), make())
    a, b = torch.randn(4, 8), torch.randn(5, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (lazy modules are experimental, and say so)
        for x in (a, b, a):
            assert block(x).shape == (x.shape[0], 16)
    assert len(block.explain()["schedules"]) == 2


class _EmptyPick(nn.Module):
    r"""Keeps the rows of its input above 10 in a buffer: none, here."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("picked", torch.zeros(0, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.picked = x[x.sum(1) > 10].detach()[:0]
        return self.lin(x)


def test_dtype_change_is_followed():
    branches = three_branches()
    p = Parallel(*branches, join="cat")
    p(torch.randn(2, 16))
    p.double()
    x = torch.randn(2, 16, dtype=torch.float64)
    out = p(x)
    assert out.dtype == torch.float64
    assert_same(out, torch.cat([b(x) for b in branches], 1))


def test_auto_streams_never_fork_while_training():
    # The tuner times forward calls only; the backward of forked branches runs on
    # their streams too, so "auto" must not fork while autograd records.
    p = Parallel(*three_branches(), streams="auto")
    x = torch.randn(2, 4)
    assert {c.forked for c in p._candidates(None, (x,), {})} == {False}
    with torch.no_grad():
        assert {c.forked for c in p._candidates(None, (x,), {})} == {False, True}
    for q in p.parameters():
        q.requires_grad_(False)
    assert {c.forked for c in p._candidates(None, (x,), {})} == {False, True}
    # Frozen, inside a model that trains what comes before it: its input records, and
    # the backward would run forked too (what the README promises: no fork while autograd records).
    h = x.clone().requires_grad_()
    assert {c.forked for c in p._candidates(None, (h,), {})} == {False}
    assert {c.forked for c in p._candidates(None, ([h],), {"y": None})} == {False}
    with torch.no_grad():
        assert {c.forked for c in p._candidates(None, (h,), {})} == {False, True}
    assert {c.forked for c in Parallel(*three_branches(), streams=True)._candidates(None, (h,), {})} == {True}


# ------------------------------------------------------ settings changed after the first call
@pytest.mark.parametrize("fuse", [False, True])
def test_settings_changed_after_calls_are_used(fuse):
    torch.manual_seed(0)
    p = Parallel(*[nn.Linear(8, 8) for _ in range(3)], fuse=fuse)
    x = torch.randn(4, 8)
    with torch.no_grad():
        p(x)
        for join, dim in [("sum", 1), ("stack", 0), ("cat", 0), ("mean", 1), (None, 1), ("stack", -1), ("dict", 1)]:
            p.join, p.dim = join, dim
            torch.testing.assert_close(p(x), reference(p, x))
        p.fuse = not fuse
        torch.testing.assert_close(p(x), reference(p, x))


def test_bad_settings_set_later_are_refused_and_change_nothing():
    p = Parallel(nn.Linear(8, 8), nn.Linear(8, 4))
    x = torch.randn(4, 8)
    expected = p(x)
    with pytest.raises(ValueError, match=r"Parallel: unknown join 'avg'"):
        p.join = "avg"
    with pytest.raises(TypeError, match=r"Parallel: dim must be an int, got str"):
        p.dim = "1"
    with pytest.raises(TypeError, match=r"Parallel: streams must be True, False or 'auto', got 1"):
        p.streams = 1
    with pytest.raises(ValueError, match=r"Parallel: streams must be True, False or 'auto', got 'yes'"):
        p.streams = "yes"
    with pytest.raises(ValueError, match=r"Parallel: max_graphs must be an int >= 1 .*got 0"):
        p.max_graphs = 0
    with pytest.raises(ValueError, match=r"branch '1' differs from branch '0'"):
        p.fuse = True
    assert (p.join, p.dim, p.streams, p.max_graphs, p.fuse) == ("cat", 1, "auto", 8, False)
    assert_same(p(x), expected)
    # Graph settings reach the graph cache.
    with pytest.raises(TypeError, match=r"Parallel: static_outputs must be True or False, got str \('False'\)"):
        p.static_outputs = "False"  # (bool("False") is True)
    p.max_graphs, p.static_outputs, p.graph_fallback = 2, True, True
    assert (p._graphs.max_graphs, p._graphs.static_outputs, p._graphs.fallback) == (2, True, True)
    assert p.static_outputs is True
    assert "max_graphs" not in repr(p)  # (shown with cuda_graph=True only)
    p.cuda_graph = True
    assert "max_graphs=2, static_outputs=True, graph_fallback=True" in repr(p)


def test_dim_takes_an_integer_of_another_type_as_torch_cat_does():
    # Before (a CPU hunt): a NumPy integer was refused as "dim must be an int".
    class Integer:  # (as numpy.int64: an integer through __index__, registered as one)
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            return self.value

    numbers.Integral.register(Integer)

    p = Parallel(nn.Linear(8, 8), nn.Linear(8, 4), dim=Integer(-1))
    x = torch.randn(4, 8)
    assert p.dim == -1 and type(p.dim) is int
    assert_same(p(x), reference(p, x))
    p.dim = Integer(1)
    assert p.dim == 1 and type(p.dim) is int
    assert_same(p(x), reference(p, x))
    for wrong in (1.0, torch.tensor(True), torch.tensor([1]), torch.tensor(1.0),  # (torch.cat refuses these too)
                  torch.tensor(1, device="meta")):  # (no value to take: refused as the others, not by torch)
        with pytest.raises(TypeError, match=r"Parallel: dim must be an int, got (float|Tensor)"):
            p.dim = wrong
    assert p.dim == 1
    p.dim = torch.tensor(-1)  # (as torch.cat takes it, and chunks and max_graphs do: kept as an int)
    assert p.dim == -1 and type(p.dim) is int
    assert_same(p(x), reference(p, x))


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, device="meta")

    def forward(self, scale, x):
        return self.lin(x) * scale


def test_a_0_dim_cpu_tensor_first_does_not_set_the_device():
    # PyTorch lets 0-dim CPU tensors join tensors of any device ("meta" stands in for CUDA).
    scale, x = torch.tensor(0.5), torch.randn(2, 4, device="meta")
    out = Parallel(_Scaled(), _Scaled())(scale, x)
    assert out.shape == (2, 8) and out.device.type == "meta"


@pytest.mark.parametrize("fuse", [False, "auto"])
def test_built_and_called_under_fake_tensor_mode_without_asking_for_addresses(fuse, monkeypatch):
    # Shapes only, as a model's memory is sized before it is made: a block built under
    # FakeTensorMode has fake parameters, whose data pointers torch warns about being asked
    # for ("will error", once a process: hence the spies); the blocks asked for them to tell
    # where parameters lie.
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from parallel_modules import ParallelSequential

    asked = []
    for cls, fake in ((FakeTensor, lambda t: True), (torch.UntypedStorage, lambda s: s.device.type == "meta")):
        def spy(self, _original=cls.data_ptr, _fake=fake):
            if _fake(self):
                asked.append(type(self).__name__)
            return _original(self)
        monkeypatch.setattr(cls, "data_ptr", spy)
    with FakeTensorMode():
        p = Parallel(*[nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(2)], fuse=fuse)
        assert p(torch.randn(3, 4)).shape == (3, 8)
        pipe = ParallelSequential(nn.Linear(4, 4), p, chunks=3)
        x = torch.randn(6, 4, requires_grad=True)
        pipe(x).sum().backward()
        assert x.grad.shape == (6, 4) and pipe[0].weight.grad.shape == (4, 4)
        p.train(False)
        assert pipe(torch.randn(6, 4)).shape == (6, 8)
        # (The pipeline's checks of outputs lying in its input's memory ask this, on paths these
        # calls do not take: a fake tensor has no address to give.)
        from parallel_modules.pipeline import _strided_address
        assert _strided_address(x) is None
    assert not asked


def test_explain_keeps_signatures_apart_that_differ_only_in_strides_grad_or_values():
    class Scale(nn.Module):
        def forward(self, x, factor=1.0):
            return x * factor

    p = Parallel(Scale(), Scale())
    x = torch.randn(4, 4)
    p(x)
    p(x.t())
    p(x.clone().requires_grad_())
    with torch.no_grad():
        p(x)
    p(x, 2.0)
    p(x, 3.0)
    p(x, 2)
    keys = list(p.explain()["schedules"])
    # Floats by type (a value changing at every call would make every call a new schedule,
    # never tuned); other numbers by value and type.
    assert len(keys) == len(p._plans) == 6, keys
    assert "Tensor(4, 4) float32 on cpu strides (1, 4), training" in keys
    assert any("requires_grad" in k for k in keys) and any(k.endswith("no grad") for k in keys)
    assert "Tensor(4, 4) float32 on cpu, float, training" in keys and "Tensor(4, 4) float32 on cpu, 2, training" in keys


def test_explain_keeps_positional_and_keyword_signatures_apart():
    # Before: f(x, y) and f(x, y=y) are two plans, but read alike in explain(), one hiding the other.
    class Add(nn.Module):
        def forward(self, x, y=None, *, z=None):
            return x + (0 if y is None else y) + (0 if z is None else z)

    p = Parallel(Add(), Add())
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    p(x, y)
    p(x, y=y)
    p(x, z=y)
    p(x, [y][0])
    keys = list(p.explain()["schedules"])
    assert len(keys) == len(p._plans) == 3, keys
    t = "Tensor(2, 4) float32 on cpu"
    assert keys == [f"{t}, {t}, training", f"{t}, y={t}, training", f"{t}, z={t}, training"]


class _Tagged(torch.Tensor):
    r"""A tensor subclass that operations propagate (``torch.Tensor.__torch_function__``)."""


def test_a_tensor_subclass_input_has_a_signature_of_its_own():
    # Code may run differently for a subclass and returns its type: a schedule (or a
    # CUDA graph, see test_graphs) made for plain tensors is not reused for it.
    p = Parallel(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    assert type(p(x)) is torch.Tensor
    out = p(x.as_subclass(_Tagged))
    assert type(out) is _Tagged
    torch.testing.assert_close(out.as_subclass(torch.Tensor), p(x), rtol=0, atol=0)
    keys = list(p.explain()["schedules"])
    assert len(keys) == 2 and any(k.startswith("_Tagged(2, 4)") for k in keys), keys


def test_explain_while_another_thread_adds_signatures():
    # explain() reads the schedules while calls in other threads add to them.
    import sys
    import threading

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        p = Parallel(nn.Linear(4, 4), nn.Linear(4, 4))
        errors: list[BaseException] = []
        done = threading.Event()

        def calls():
            try:
                with torch.no_grad():
                    for rows in range(1, 1000):  # (fewer than the 1024 schedules kept)
                        p(torch.randn(rows, 4))
            except BaseException as e:
                errors.append(e)
            finally:
                done.set()

        thread = threading.Thread(target=calls)
        thread.start()
        try:
            while not done.is_set():
                p.explain()
        except BaseException as e:
            errors.append(e)
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert len(p.explain()["schedules"]) == len(p._plans) == 999


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensor_inputs(layout):
    # A strided nested tensor has no single shape: its signature is its components' shapes.
    torch.manual_seed(0)
    p = Parallel(nn.Linear(4, 2), nn.Linear(4, 3), join=None)
    nt = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=layout)
    for out, branch in zip(p(nt), p):
        expected = branch(nt)
        assert out.is_nested
        for a, b in zip(out.unbind(), expected.unbind()):
            assert torch.equal(a, b)
    assert "nested Tensor[(2, 4), (3, 4)]" in next(iter(p.explain()["schedules"]))


def test_lazy_branches_and_stages_build_move_copy_and_run():
    # Uninitialized parameters have no memory (``data_ptr`` raises) until the first call.
    from parallel_modules import ParallelSequential

    torch.manual_seed(0)
    for make in (lambda: Parallel(nn.LazyLinear(4), nn.LazyLinear(4)),
                 lambda: ParallelSequential(nn.LazyLinear(4), nn.ReLU())):
        block = make()
        twin, pickled = copy.deepcopy(block), pickle.loads(pickle.dumps(block))
        block.double()
        x = torch.randn(2, 3, dtype=torch.float64)
        out = block(x)
        assert out.dtype == torch.float64
        assert_same(out, torch.cat([m(x) for m in block], 1) if isinstance(block, Parallel) else block[1](block[0](x)))
        assert twin(x.float()).shape == pickled(x.float()).shape == out.shape


def test_fuse_true_on_uninitialized_lazy_branches_says_so_and_fuses_once_they_are():
    # Before: refused for "hooks, which a batched call would not run once per branch" -- the
    # lazy layer's own initializing hook, which the user never registered.
    torch.manual_seed(0)
    branches = [nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 3)) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (lazy modules are experimental, and say so)
        with pytest.raises(ValueError, match=r"'0' \(LazyLinear\) has uninitialized lazy parameters; call the "
                                             r"block once"):
            Parallel(*branches, fuse=True)
        block = Parallel(*branches)
        x = torch.randn(2, 4)
        block(x)
    block.fuse = True
    assert block.explain()["fused"] == [["0", "1", "2"]]
    torch.testing.assert_close(block(x), torch.cat([b(x) for b in branches], 1))


def test_a_layer_replaced_while_another_thread_calls_is_seen():
    # torch runs the registration hooks (which count changes) before it stores the module:
    # before, a call from another thread in between walked the old tree and took the new count
    # as seen, and the block kept running the replaced layer for good (fused: off by 2.3).
    # The gap is a few bytecodes wide; a hook of the test's own makes that call inside it.
    import threading

    torch.manual_seed(0)
    block = Parallel(*[nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.1), nn.Linear(16, 4)) for _ in range(4)],
                     fuse="auto")
    x = torch.randn(3, 8)
    new = nn.LeakyReLU(3.0)

    def call_in_the_gap(module, name, submodule):
        if submodule is new:
            thread = threading.Thread(target=lambda: block(x))
            thread.start()
            thread.join()

    with torch.no_grad():
        block(x)
        handle = nn.modules.module.register_module_module_registration_hook(call_in_the_gap)
        try:
            block[1][1] = new
        finally:
            handle.remove()
        torch.testing.assert_close(block(x), torch.cat([b(x) for b in block], 1))


def test_fuse_turned_off_during_another_threads_first_call_is_kept():
    # Before: the first call of a signature under fuse="auto" runs in turn, looking for writes
    # to the input, and then remembers the fused schedule; set to fuse=False meanwhile, the
    # block took it into the schedules made anew for fuse=False, and every later call grouped
    # the branches again and ran them fused.
    import threading

    inside, go = threading.Event(), threading.Event()

    class Gate(nn.Module):  # unlike the others: runs unfused, first, and holds the call there
        def forward(self, x):
            if threading.current_thread() is not threading.main_thread():
                inside.set()
                assert go.wait(10)
            return x[:, :4] * 2

    torch.manual_seed(0)
    block = Parallel(Gate(), *[nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)) for _ in range(3)],
                     fuse="auto").eval()
    x = torch.randn(6, 8)
    outputs = []

    def first_call():
        with torch.no_grad():
            outputs.append(block(x))

    thread = threading.Thread(target=first_call)
    thread.start()
    try:
        assert inside.wait(10)
        block.fuse = False
    finally:
        go.set()
        thread.join(10)
    assert not thread.is_alive() and len(outputs) == 1
    with torch.no_grad():
        expected = torch.cat([b(x) for b in block], 1)
        torch.testing.assert_close(outputs[0], expected)
        torch.testing.assert_close(block(x), expected)
    assert block.explain()["fused"] == []
    assert block._fusion is None
    assert list(block.explain()["schedules"].values()) == ["unfused, sequential"]


def test_a_branch_appended_by_another_thread_during_a_call_is_not_run_by_that_call():
    # The unfused loop iterated the block's live dict of branches: another thread's append in
    # the middle of a call raised "dictionary changed size during iteration". The call runs
    # the branches it started with; the next call sees the new one.
    torch.manual_seed(0)
    branches = [nn.Linear(8, 4) for _ in range(3)]
    block = Parallel(*branches, join="cat")
    x = torch.randn(3, 8)
    added = nn.Linear(8, 4)
    with torch.no_grad():
        block(x)  # (the first call of a signature makes its plan; the later ones take the loop)
        handle = branches[0].register_forward_hook(appending_from_another_thread(block, added, 3))
        torch.testing.assert_close(block(x), torch.cat([b(x) for b in branches], 1))
        handle.remove()
        torch.testing.assert_close(block(x), torch.cat([b(x) for b in (*branches, added)], 1))


class _AppendingWhenLookedAt(nn.Linear):
    r"""A Linear whose ``look``-th ``parameters()`` call after ``arm(block)`` appends ``added`` to ``block``
    from another thread and waits for it: an append landing while a call walks the branches."""

    def __init__(self, look: int, added: nn.Module) -> None:
        super().__init__(8, 4)
        self.look, self.looks, self.added = look, 0, [added]  # (a list: not registered as a child)
        self.block: list[nn.Module] = []

    def arm(self, block: nn.Module) -> None:
        self.block.append(block)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        if self.block:
            self.looks += 1
            if self.looks == self.look:
                thread = threading.Thread(target=self.block[0].append, args=(self.added[0],))
                thread.start()
                thread.join()
        return super().parameters(recurse)


@pytest.mark.parametrize("look", [1, 2], ids=["placing the branches", "checking their devices"])
@pytest.mark.parametrize("fuse", [False, "auto"])
def test_a_branch_appended_by_another_thread_while_a_first_call_looks_at_the_devices_does_not_raise(look, fuse):
    # A signature's first call walks the live dict of branches to place them (their devices) and
    # to check the input's device against theirs; another thread's append in the middle raised
    # "dictionary changed size during iteration". The call runs the branches it started with or
    # the new ones, as a call before or after the append would; the next call sees the new one.
    torch.manual_seed(0)
    added = nn.Linear(8, 4)
    first = _AppendingWhenLookedAt(look, added)
    block = Parallel(first, nn.Linear(8, 4), nn.Linear(8, 4), fuse=fuse)
    first.arm(block)
    x = torch.randn(3, 8)
    with torch.no_grad():
        out = block(x)
        ran = out.shape[1] // 4
        assert ran in (3, 4)
        torch.testing.assert_close(out, torch.cat([b(x) for b in list(block)[:ran]], 1))
        assert len(block) == 4
        torch.testing.assert_close(block(x), torch.cat([b(x) for b in block], 1))


class _Scores(nn.Module):
    r"""Logits next to what is not differentiable: their argmax and a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.lin(x)
        return logits, logits.argmax(-1, keepdim=True), logits > 0


@pytest.mark.parametrize("fuse", [False, True, "auto"])
def test_jacrev_and_batched_grads_match_sequential_with_integer_outputs(fuse):
    # jacrev and is_grads_batched run the backward under vmap, through the fused group's own
    # autograd Functions too; integer leaves beside the logits must pass through untouched.
    torch.manual_seed(0)
    branches = [_Scores() for _ in range(3)]
    ref = copy.deepcopy(branches)
    block = Parallel(*branches, join="cat", fuse=fuse)

    def reference(x):
        outs = [m(x) for m in ref]
        return tuple(torch.cat([o[k] for o in outs], 1) for k in range(3))

    x = torch.randn(5, 6)
    out, expected = block(x), reference(x)
    torch.testing.assert_close(out[1:], expected[1:])
    assert not out[1].requires_grad and out[1].dtype == torch.int64
    torch.testing.assert_close(torch.func.jacrev(lambda t: block(t)[0])(x),
                               torch.func.jacrev(lambda t: reference(t)[0])(x))
    xg = x.clone().requires_grad_()
    cotangents = torch.randn(3, *out[0].shape)
    got = torch.autograd.grad(block(xg)[0], [xg, *block.parameters()], cotangents, is_grads_batched=True)
    want = torch.autograd.grad(reference(xg)[0], [xg, *nn.ModuleList(ref).parameters()], cotangents,
                               is_grads_batched=True)
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------ mixed precision and saved tensors
def _mixed_precision_block(device: str, streams, join) -> Parallel:
    torch.manual_seed(0)
    nested = Parallel(mlp(), nn.Linear(16, 8), join="sum", streams=streams)
    return Parallel(mlp(), Float32Region(16, 8), OwnAutocast(16, 8), nested, join=join, streams=streams).to(device)


def _not_a_leaf(device: str) -> torch.Tensor:
    r"""An input requiring grad that is not a leaf, as a layer's output is.

    Autocast caches its cast of a leaf that requires grad for the thread (meant for
    parameters): branches called in turn share one cast of such an input and sum their
    gradients for it in half precision, where forked branches, which cast for
    themselves (see README), sum them in float32.
    """
    return torch.randn(6, 16, device=device, requires_grad=True) * 1


def _grads(module: nn.Module, x: torch.Tensor, out) -> tuple[torch.Tensor, ...]:
    loss = sum(o.float().square().sum() for o in (out if isinstance(out, tuple) else (out,)))
    return torch.autograd.grad(loss, [x, *module.parameters()])


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("streams", STREAMS)
@pytest.mark.parametrize("join", [None, "cat"])
def test_autocast_around_a_block_gives_the_plain_branches_dtypes_values_and_gradients(device, streams, join):
    # Branches under the caller's autocast, one leaving it for float32, one entering its own,
    # and a nested block. Calls alternate with and without it: a schedule or a cast chosen under
    # one must not carry over to the other (CUDA: "auto" keys its schedules by the autocast).
    block = _mixed_precision_block(device, streams, join)
    for on in (True, False, True, False, True):
        x = _not_a_leaf(device)
        with torch.autocast(device, dtype=half(device), enabled=on):
            out, expected = block(x), reference(block, x)
        assert_same(out, expected)  # (dtypes included: half, float32, half, half for the branches)
        if join is None:
            assert [o.dtype for o in out] == [half(device) if on else torch.float32, torch.float32,
                                              half(device), half(device) if on else torch.float32]
        # (The input's gradient sums the branches' in the order their backward ran.)
        for g, e in zip(_grads(block, x, out), _grads(block, x, expected)):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("streams", STREAMS)
@pytest.mark.parametrize("amp", [False, True])
def test_saved_tensor_hooks_see_a_block_save_and_unpack_what_its_branches_do(device, streams, amp):
    # Unfused, the block saves what its branches save, once each, and its backward unpacks
    # each once: no more (a saved value read in the forward ran the unpack hook there, which
    # under checkpoint(use_reentrant=False) recomputes the whole forward), no fewer.
    block = _mixed_precision_block(device, streams, None)
    counts = []
    for module in (block, None):
        x = _not_a_leaf(device)
        packed, unpacked = [], []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t,
                                                      lambda t: unpacked.append(1) or t):
            with torch.autocast(device, dtype=half(device), enabled=amp):
                out = block(x) if module is block else reference(block, x)
            before = len(unpacked)
            _grads(block, x, out)
        counts.append((len(packed), before, len(unpacked)))
    assert counts[0] == counts[1] and counts[0][1] == 0 and counts[0][0] == counts[0][2], counts


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("streams", STREAMS)
@pytest.mark.parametrize("how", ["checkpoint", "checkpoint-reentrant", "save_on_cpu", "save_on_cpu-pinned"])
def test_checkpoint_and_save_on_cpu_around_a_block_under_autocast_give_the_plain_gradients(device, streams, how):
    block = _mixed_precision_block(device, streams, "cat")

    def run(module, x):
        return under_autocast_saving(how, device, module, x)

    for _ in range(2):
        w = torch.randn(6, 16, device=device, requires_grad=True)
        outs, grads = [], []
        for module in (block, functools.partial(reference, block)):
            block.zero_grad(set_to_none=True)
            w.grad = None
            outs.append(run(module, w * 1))  # (see _not_a_leaf)
            outs[-1].float().square().sum().backward()  # (a reentrant checkpoint refuses torch.autograd.grad)
            grads.append([w.grad, *(p.grad for p in block.parameters())])
        assert_same(*outs)
        # (A reentrant checkpoint hands the forward a detached input, a leaf: see _not_a_leaf.)
        loose = how == "checkpoint-reentrant" and device == "cuda" and streams is not False
        torch.testing.assert_close(grads[0][0], grads[1][0], **(dict(rtol=1e-2, atol=1e-2) if loose else {}))
        for g, e in zip(grads[0][1:], grads[1][1:]):
            torch.testing.assert_close(g, e)
