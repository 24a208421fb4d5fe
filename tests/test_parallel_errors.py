"""``Parallel`` on bad input: a clear error naming the module and branch, nothing corrupted.

After every error the module (or the fixed module) must give the right result on the next
good call.
"""

from __future__ import annotations

import copy
import re
import traceback
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

from parallel_modules import Parallel, ParallelSequential
from tests._helpers import cpu_and_cuda
from tests._reference import assert_close, assert_same


def full_text(error: BaseException) -> str:
    r"""Everything a user sees for ``error``: message, notes (3.11+) and chained causes."""
    return "".join(traceback.format_exception(error))


class Take(nn.Module):
    r"""The first ``n`` columns: its output shape follows the input's, so joins can fail or not."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.n = n

    def forward(self, x):
        return x[:, : self.n]


def _fixed_module_works(**settings) -> None:
    r"""After a refused construction, the corrected one works."""
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    x = torch.randn(2, 4)
    assert_same(Parallel(a, b, **settings)(x), torch.cat([a(x), b(x)], 1))


# -------------------------------------------------------------------- construction
def test_no_branches():
    for make in (lambda: Parallel(), lambda: Parallel(OrderedDict())):
        with pytest.raises(ValueError) as ei:
            make()
        msg = str(ei.value)
        assert "Parallel" in msg and "at least one branch" in msg
    _fixed_module_works()


@pytest.mark.parametrize("bad", [3, "relu", None, torch.zeros(2)], ids=["int", "str", "None", "tensor"])
def test_branch_not_module_or_callable(bad):
    with pytest.raises(TypeError) as ei:
        Parallel(nn.Linear(2, 2), bad)
    msg = str(ei.value)
    assert "Parallel" in msg and "'1'" in msg and ("got None" if bad is None else type(bad).__name__) in msg

    with pytest.raises(TypeError) as ei:
        Parallel(OrderedDict(good=nn.Linear(2, 2), broken=bad))
    assert "'broken'" in str(ei.value)

    # Replacing or adding a bad branch on a working module leaves it unchanged.
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    p = Parallel(a, b, join="sum")
    got = "None" if bad is None else type(bad).__name__
    with pytest.raises(TypeError, match=rf"Parallel: branch '1' must be an nn.Module or a callable, got {got}"):
        p[1] = bad
    with pytest.raises(TypeError, match=rf"Parallel: branch '2' must be an nn.Module or a callable, got {got}"):
        p.append(bad)
    assert list(p) == [a, b]
    x = torch.randn(3, 2)
    assert_same(p(x), a(x) + b(x))


@pytest.mark.parametrize("join", ["concat", "add", "", 5], ids=["concat", "add", "empty", "int"])
def test_unknown_join(join):
    with pytest.raises(ValueError if isinstance(join, str) else TypeError) as ei:
        Parallel(nn.Linear(2, 2), join=join)
    msg = str(ei.value)
    assert "Parallel" in msg and repr(join) in msg
    for known in ("'cat'", "'stack'", "'sum'", "'mean'", "'tuple'", "'dict'"):
        assert known in msg
    _fixed_module_works(join="cat")


@pytest.mark.parametrize("streams", ["yes", "True", 1, 0, None, "AUTO"])
def test_bad_streams_value(streams):
    with pytest.raises(ValueError if isinstance(streams, str) else TypeError) as ei:
        Parallel(nn.Linear(2, 2), streams=streams)
    msg = str(ei.value)
    assert "streams" in msg and repr(streams) in msg
    _fixed_module_works(streams=True)
    _fixed_module_works(streams="auto")


def test_bad_dim():
    with pytest.raises(TypeError) as ei:
        Parallel(nn.Linear(2, 2), dim="1")
    assert "dim" in str(ei.value)
    _fixed_module_works(dim=1)


# ----------------------------------------------------------------------- joins
@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("join,dim", [("cat", 0), ("stack", 0), ("sum", 1), ("mean", 1), ("cat", 5)])
def test_join_failure_lists_branches_and_shapes(device, join, dim):
    p = Parallel(OrderedDict(full=nn.Identity(), head=Take(3)), join=join, dim=dim, streams=True)
    # Of the type torch raises for the same outputs: IndexError for a dim out of range,
    # RuntimeError for shapes that do not match.
    with pytest.raises(IndexError if dim == 5 else RuntimeError) as ei:
        p(torch.randn(2, 4, device=device))
    msg = str(ei.value)
    assert "Parallel" in msg and f"join={join!r}" in msg
    assert "'full'" in msg and "'head'" in msg
    assert "(2, 4)" in msg and "(2, 3)" in msg
    assert (f"(dim={dim})" in msg) == (join in ("cat", "stack"))  # sum and mean take no dim
    if dim == 5:  # says what is wrong: not the shapes, the dim (outputs of 2 dimensions)
        assert "dim is out of range for branch outputs of 2 dimensions (valid: -2 to 1)" in msg
        assert "to match" not in msg

    # The module is fine: with an input whose branch outputs do join, the right result.
    x = torch.randn(2, 3, 1, 1, 1, 1, device=device) if dim == 5 else torch.randn(2, 3, device=device)
    a, b = x, x[:, :3]
    expected = {
        "cat": lambda: torch.cat([a, b], dim), "stack": lambda: torch.stack([a, b], dim),
        "sum": lambda: a + b, "mean": lambda: (a + b) / 2,
    }[join]()
    assert_same(p(x), expected)


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("join", ["cat", "stack", "sum", "mean"])
def test_outputs_of_different_structure(device, join):
    p = Parallel(
        OrderedDict(
            maybe_pair=lambda x, pair=False: (x, x * 2) if pair else x,
            single=lambda x, pair=False: x * 3,
        ),
        join=join, streams=True,
    )
    x = torch.randn(2, 4, device=device)
    with pytest.raises(ValueError) as ei:
        p(x, pair=True)
    msg = str(ei.value)
    assert "Parallel" in msg and "'maybe_pair'" in msg and "'single'" in msg and "structure" in msg
    expected = {"cat": lambda: torch.cat([x, x * 3], 1), "stack": lambda: torch.stack([x, x * 3], 1),
                "sum": lambda: x + x * 3, "mean": lambda: (x + x * 3) / 2}[join]()
    assert_same(p(x), expected)


def test_structured_outputs_differing_in_keys_or_length():
    p = Parallel(lambda x: {"a": x}, lambda x: {"b": x}, join="sum")
    with pytest.raises(ValueError, match="structure"):
        p(torch.randn(2, 2))
    x = torch.randn(2, 2)
    p[1] = lambda x: {"a": x * 2}  # fixed
    assert_same(p(x), {"a": x + x * 2})
    p = Parallel(lambda x: (x, x), lambda x: (x,), join="cat")
    with pytest.raises(ValueError, match="structure"):
        p(torch.randn(2, 2))
    p[1] = lambda x: (x * 2, x * 3)  # fixed
    assert_same(p(x), (torch.cat([x, x * 2], 1), torch.cat([x, x * 3], 1)))


# ------------------------------------------------------------ errors in branches
class Boom(Exception):
    pass


class Flaky(nn.Module):
    r"""A linear layer that raises ``Boom`` after its GPU work while ``fail`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fail = False

    def forward(self, x):
        y = self.lin(x)
        if self.fail:
            raise Boom("flaky branch failed")
        return y


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("streams", [True, False])
@pytest.mark.parametrize("where", [0, 1, 3])
def test_exception_in_branch_keeps_type_and_names_branch(device, streams, where):
    names = ["alpha", "beta", "gamma", "delta"]
    branches = OrderedDict((n, Flaky()) for n in names)
    p = Parallel(branches, join="cat", streams=streams).to(device)
    x = torch.randn(4, 8, device=device)
    p(x)
    branches[names[where]].fail = True
    with pytest.raises(Boom) as ei:
        p(x)
    text = full_text(ei.value)
    assert "flaky branch failed" in text
    assert f"branch {names[where]!r}" in text and f"index {where}" in text and "Parallel" in text
    for other in names:
        if other != names[where]:
            assert f"branch {other!r}" not in text

    branches[names[where]].fail = False
    x = torch.randn(4, 8, device=device)
    assert_same(p(x), torch.cat([b(x) for b in branches.values()], 1))


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_builtin_error_in_branch_names_branch(device):
    p = Parallel(nn.Linear(8, 8), nn.Linear(5, 8), streams=True).to(device)
    with pytest.raises(RuntimeError) as ei:
        p(torch.randn(2, 8, device=device))
    text = full_text(ei.value)
    assert "branch '1'" in text and "index 1" in text
    p[1] = nn.Linear(8, 8).to(device)  # fixed
    x = torch.randn(2, 8, device=device)
    assert_same(p(x), torch.cat([p[0](x), p[1](x)], 1))


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_exception_in_nested_branch_names_both_levels(device):
    deep = Flaky()
    inner = Parallel(OrderedDict(shallow=Flaky(), deep=deep), join="sum", streams=True)
    outer = Parallel(OrderedDict(first=Flaky(), outer=inner), join="cat", streams=True).to(device)
    deep.fail = True
    with pytest.raises(Boom) as ei:
        outer(torch.randn(2, 8, device=device))
    text = full_text(ei.value)
    assert "branch 'deep'" in text and "branch 'outer'" in text
    deep.fail = False
    x = torch.randn(2, 8, device=device)
    expected = torch.cat([outer.first(x), inner.shallow(x) + deep(x)], 1)
    assert_same(outer(x), expected)


# -------------------------------------------------------------------- devices
def test_input_on_other_device_than_parameters():
    good = Parallel(OrderedDict(a=nn.Linear(4, 4), b=nn.Linear(4, 4)))
    weights = {k: v.clone() for k, v in good.state_dict().items()}
    p = Parallel(OrderedDict(a=nn.Linear(4, 4), b=nn.Linear(4, 4))).to("meta")
    for _ in range(2):  # a failed check is not remembered as passed
        with pytest.raises(RuntimeError) as ei:
            p(torch.randn(2, 4))
        msg = str(ei.value)
        assert "Parallel" in msg and ("branch 'a'" in msg or "branch 'b'" in msg)
        assert "meta" in msg and "cpu" in msg

    p.to_empty(device="cpu")  # fixed: materialised on the CPU and loaded
    p.load_state_dict(weights)
    x = torch.randn(2, 4)
    assert_same(p(x), torch.cat([good.a(x), good.b(x)], 1))


def test_parameters_on_cpu_input_on_meta():
    p = Parallel(OrderedDict(a=nn.Linear(4, 4), b=nn.Linear(4, 4)), join="sum")
    with pytest.raises(RuntimeError) as ei:
        p(torch.randn(2, 4, device="meta"))
    msg = str(ei.value)
    assert "branch 'a'" in msg or "branch 'b'" in msg
    assert "meta" in msg and "cpu" in msg
    x = torch.randn(2, 4)
    assert_same(p(x), p.a(x) + p.b(x))


def test_branches_on_different_devices():
    p = Parallel(OrderedDict(on_cpu=nn.Linear(4, 4), on_meta=nn.Linear(4, 4, device="meta")))
    for _ in range(2):
        with pytest.raises(RuntimeError) as ei:
            p(torch.randn(2, 4))
        msg = str(ei.value)
        assert "'on_cpu'" in msg and "'on_meta'" in msg and "cpu" in msg and "meta" in msg
    p[1] = nn.Linear(4, 4)  # fixed
    x = torch.randn(2, 4)
    assert_same(p(x), torch.cat([p[0](x), p[1](x)], 1))


@pytest.mark.cuda
def test_cuda_input_cpu_parameters():
    p = Parallel(OrderedDict(a=nn.Linear(4, 4), b=nn.Linear(4, 4)), streams=True)
    with pytest.raises(RuntimeError) as ei:
        p(torch.randn(2, 4, device="cuda"))
    msg = str(ei.value)
    assert ("branch 'a'" in msg or "branch 'b'" in msg) and "cuda" in msg and "cpu" in msg
    p.cuda()  # fixed
    x = torch.randn(2, 4, device="cuda")
    assert_same(p(x), torch.cat([p.a(x), p.b(x)], 1))


@pytest.mark.cuda
def test_cuda_and_cpu_branches_mixed():
    p = Parallel(OrderedDict(gpu=nn.Linear(4, 4).cuda(), host=nn.Linear(4, 4)), streams=True)
    with pytest.raises(RuntimeError) as ei:
        p(torch.randn(2, 4, device="cuda"))
    msg = str(ei.value)
    assert "'gpu'" in msg and "'host'" in msg
    p.cuda()
    x = torch.randn(2, 4, device="cuda")
    assert_same(p(x), torch.cat([p.gpu(x), p.host(x)], 1))


# ----------------------------------------------------------------------------------------------
# Joins: edge cases, and errors that are not mismatches.

class _SumJoin(nn.Module):
    r"""A join written as a module without state: called with the list of outputs."""

    def forward(self, outputs: list) -> torch.Tensor:
        return sum(outputs)


def test_a_module_join_is_called_not_registered_as_a_branch():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    p = Parallel(a, b, join=_SumJoin())
    assert len(p) == 2 and list(p.state_dict()) == list(nn.ModuleList([a, b]).state_dict())
    x = torch.randn(2, 4)
    assert_same(p(x), a(x) + b(x))
    p.join = _SumJoin()  # set later: the same
    assert len(p) == 2 and list(p._modules) == ["0", "1"]



class _ModalJoin(nn.Module):
    r"""A join that behaves by its mode: the sum in training, the first output in eval."""

    def forward(self, outputs: list) -> torch.Tensor:
        return sum(outputs) if self.training else outputs[0]


def test_a_module_join_keeps_its_own_mode():
    # Called, not registered: the block's eval() and train() do not reach it.
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    join = _ModalJoin()
    p = Parallel(a, b, join=join)
    x = torch.randn(2, 4)
    p.eval()
    assert join.training and not a.training
    assert_same(p(x), a(x) + b(x))
    join.eval()
    p.train()
    assert not join.training
    assert_same(p(x), a(x))


def test_a_module_join_with_parameters_is_refused():
    with pytest.raises(ValueError, match=r"Parallel: join=Linear\(...\) has parameters.*nn.Sequential"):
        Parallel(nn.Identity(), nn.Identity(), join=nn.Linear(4, 4))


def test_none_leaves_of_structured_outputs_are_passed_on():
    # nn.MultiheadAttention(need_weights=False) returns (out, None).
    torch.manual_seed(0)
    m1, m2 = (nn.MultiheadAttention(8, 2, batch_first=True) for _ in range(2))
    q = torch.randn(2, 3, 8)
    out = Parallel(m1, m2, join="sum")(q, q, q, need_weights=False)
    assert_same(out[0], m1(q, q, q, need_weights=False)[0] + m2(q, q, q, need_weights=False)[0])
    assert out[1] is None



class _Tagged(nn.Module):
    def __init__(self, tag: object) -> None:
        super().__init__()
        self.linear, self.tag = nn.Linear(4, 4), tag

    def forward(self, x: torch.Tensor) -> tuple:
        return self.linear(x), {"tag": self.tag}


@pytest.mark.parametrize("join", ["cat", "stack", "sum", "mean"])
def test_a_non_tensor_leaf_every_branch_returns_alike_is_passed_on(join):
    # Equal, not only the same object: each branch holds a string of its own.
    a, b = _Tagged("".join(["he", "ad"])), _Tagged("".join(["hea", "d"]))
    assert a.tag is not b.tag
    out = Parallel(a, b, join=join, dim=1)(torch.randn(2, 4))
    assert out[1] == {"tag": "head"} and out[1]["tag"] is a.tag


def test_a_leaf_that_is_a_tensor_in_one_branch_only_is_named():
    p = Parallel(OrderedDict(a=lambda t: (t, None), b=lambda t: (t, t)), join="sum")
    with pytest.raises(TypeError, match=r"outputs at \[1\] .*branch 'a': None, branch 'b': Tensor"):
        p(torch.randn(2, 2))


def test_dicts_with_the_same_keys_in_another_order_are_joined():
    p = Parallel(lambda t: {"x": t, "y": 2 * t}, lambda t: {"y": 3 * t, "x": t}, join="sum")
    x = torch.randn(2, 2)
    out = p(x)
    assert list(out) == ["x", "y"]
    assert_same(out["x"], x + x)
    assert_same(out["y"], 2 * x + 3 * x)


def test_a_fused_shared_output_with_a_bad_dim_gets_the_named_error():
    p = Parallel(nn.ReLU(), nn.ReLU(), fuse=True, dim=2)
    with pytest.raises(IndexError, match=r"(?s)Parallel: join='cat' \(dim=2\).*out of range.*branch '0'"):
        p(torch.randn(2, 4))
    p.dim = 1
    x = torch.randn(2, 4)
    assert_same(p(x), torch.cat([x.relu(), x.relu()], 1))


def test_a_join_error_on_nested_outputs_describes_them():
    nt = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])
    with pytest.raises((IndexError, RuntimeError), match=r"NestedTensor\[\(2, 4\), \(3, 4\)\]"):
        Parallel(nn.Identity(), nn.Identity(), join="stack", dim=7)(nt)


def test_an_error_in_a_callable_join_names_the_block():
    def join(outputs):
        raise KeyError("bad join")

    with pytest.raises(KeyError) as ei:
        Parallel(nn.Identity(), nn.Identity(), join=join)(torch.randn(2, 2))
    assert "the join 'test_an_error_in_a_callable_join_names_the_block.<locals>.join' of Parallel" in full_text(
        ei.value)


def test_out_of_memory_in_the_join_keeps_its_type(monkeypatch):
    # Not reported as a shape mismatch: a caller may catch OutOfMemoryError and retry smaller.
    def cat(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    p = Parallel(nn.Identity(), nn.Identity())
    monkeypatch.setattr(torch, "cat", cat)
    with pytest.raises(torch.OutOfMemoryError) as ei:
        p(torch.randn(2, 2))
    assert "Parallel" in full_text(ei.value)
    monkeypatch.undo()
    x = torch.randn(2, 2)
    assert_same(p(x), torch.cat([x, x], 1))


def test_a_cpu_allocation_failure_is_not_called_a_mismatch():
    big = lambda t: torch.zeros(1).expand(2 ** 42)  # noqa: E731  (equal shapes; the cat cannot allocate)
    with pytest.raises(RuntimeError, match="allocate") as ei:
        Parallel(big, big, join="cat", dim=0)(torch.zeros(1))
    assert not isinstance(ei.value, ValueError)


def test_settings_that_are_not_bools_are_refused():
    with pytest.raises(TypeError, match=r"Parallel: cuda_graph must be True or False, got str \('no'\)"):
        Parallel(nn.Identity(), cuda_graph="no")  # (bool("no") is True)
    with pytest.raises(TypeError, match=r"Parallel: compile_fallback must be True or False, got str \('no'\)"):
        Parallel(nn.Identity(), compile="eager", compile_fallback="no")
    with pytest.raises(ValueError, match="Parallel: compile_fallback=True was given without compile="):
        Parallel(nn.Identity(), compile_fallback=True)
    with pytest.raises(TypeError, match=r"Parallel: compile_options must be a dict .*got str \('x'\)"):
        Parallel(nn.Identity(), compile_options="x")
    with pytest.raises(TypeError, match="Parallel: dim must be an int, got bool"):
        Parallel(nn.Identity(), dim=True)


def test_sparse_csr_inputs_are_keyed_by_layout():
    x = torch.randn(2, 4)
    p = Parallel(lambda t: t * 2, lambda t: t * 3, join="sum")
    assert_same(p(x.to_sparse_csr()).to_dense(), x * 2 + x * 3)


def test_mkldnn_inputs_are_keyed_by_layout():
    # Before: the signature read ``_nnz()`` of every tensor that is not strided, which an
    # MKL-DNN tensor (no strides, no stored-value count) refuses: every call raised
    # NotImplementedError before any branch ran, where the branches called by hand work.
    if not torch.backends.mkldnn.is_available():
        pytest.skip("PyTorch built without MKL-DNN")
    x = torch.randn(2, 4)
    p = Parallel(lambda t: t.to_dense() * 2, lambda t: t.to_dense() * 3, fuse="auto")
    for _ in range(2):
        assert_same(p(x.to_mkldnn()), torch.cat([x * 2, x * 3], 1))
    assert list(p.explain()["schedules"]) == ["Tensor(2, 4) float32 on cpu _mkldnn, training"]
    q = Parallel(lambda t: t[0].to_dense(), lambda t: t[0].to_dense() + 1, join="sum")
    assert_same(q([x.to_mkldnn()]), x + (x + 1))  # (a list of one: the general path)


def test_signatures_tell_apart_values_that_compare_equal():
    from parallel_modules._inputs import _signature

    np = pytest.importorskip("numpy")
    x = torch.randn(2)
    key = lambda v: _signature((x, v), {}, False)  # noqa: E731
    assert key(0.0) != key(-0.0)  # 1 / s differs
    assert key(float("nan")) == key(float("nan"))  # a fresh NaN finds its key again
    assert key(2j) != key(3j) and key(np.int64(2)) != key(np.int64(3))
    assert key(1) != key(True) != key(1.0)
    # numpy's float32 is no float, but compares as one (and complex parts as floats): before,
    # keyed by value, -0.0 shared 0.0's key and a NaN never found its own again.
    for kind in (np.float32, np.float16, np.float64, np.complex64, complex):
        assert key(kind(0.0)) != key(kind(-0.0)), kind
        assert key(kind(float("nan"))) == key(kind(float("nan"))), kind
        assert key(kind(1.5)) != key(kind(2.5)) and key(kind(1.5)) == key(kind(1.5)), kind
    assert key(complex(0.0, 0.0)) != key(complex(0.0, -0.0))
    assert key(np.float32(0.5)) != key(0.5) != key(np.float64(0.5))
    fraction = pytest.importorskip("fractions").Fraction
    assert key(fraction(1, 3)) != key(fraction(1, 3) + fraction(1, 10**30))  # (one float for both)
    # A schedule's key (floats=False) takes no inexact number by value: a timestep as numpy's float32
    # changing every call would otherwise be a new signature at every call, never scheduled.
    when = lambda v: _signature((x, v), {}, False, floats=False)  # noqa: E731
    assert when(np.float32(0.1)) == when(np.float32(0.2)) and when(0.1j) == when(0.2j)
    assert when(np.int64(1)) != when(np.int64(2))


def test_a_sparse_input_is_not_keyed_as_a_dense_one_with_the_same_strides():
    # Before: one tensor took the signature's fast path, which left out the layout, and a
    # sparse COO matrix (strides (0, 0)) was keyed as an expanded dense one: a schedule, graph
    # or engine made for either would have served the other.
    from parallel_modules._inputs import _signature

    sparse = torch.randn(3, 4).to_sparse()
    dense = torch.tensor(1.0).expand(3, 4)
    assert _signature((sparse,), {}, True) != _signature((dense,), {}, True)
    assert _signature((sparse,), {}, True) == _signature((sparse,), {}, True)


@pytest.mark.parametrize("container", [list, tuple, dict])
def test_branches_passed_in_one_list_or_dict_are_refused_with_the_fix(container):
    # Before: "must be an nn.Module or a callable ... Wrap it in a module", where the branches
    # were meant to be passed one by one.
    branches = [nn.Linear(2, 2), nn.Linear(2, 2)]
    given = dict(a=branches[0], b=branches[1]) if container is dict else container(branches)
    with pytest.raises(TypeError, match=rf"Parallel: branch '0' is a {container.__name__} of 2, not a module\. "
                                        r"Pass the branches as separate arguments, Parallel\(\*branches\), or "
                                        r"named in an OrderedDict"):
        Parallel(given)
    with pytest.raises(TypeError, match=rf"ParallelSequential: stage '0' is a {container.__name__} of 2"):
        ParallelSequential(given)


def test_a_setting_passed_by_position_is_refused_with_its_keyword():
    # Before: "branch '2' must be an nn.Module or a callable, got str ('sum')" -- the join was
    # meant, passed by position; every setting is keyword-only.
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"Parallel: branch '2' is the str 'sum', not a module\. Settings are keyword-only: "
                                        r"Parallel\(\.\.\., join='sum'\)"):
        Parallel(a, b, "sum")
    with pytest.raises(TypeError, match=r"branch '1' is the int 0, not a module.*Parallel\(\.\.\., dim=0\)"):
        Parallel(a, 0)
    with pytest.raises(TypeError, match=r"ParallelSequential: stage '1' is the int 4, not a module.*"
                                        r"ParallelSequential\(\.\.\., chunks=4\)"):
        ParallelSequential(a, 4)
    with pytest.raises(TypeError, match=r"branch '1' must be an nn.Module or a callable, got str \('foo'\)"):
        Parallel(a, "foo")  # (no setting of that value)
    block = Parallel(a, b)
    with pytest.raises(TypeError, match=r"branch '2' must be an nn.Module or a callable, got str \('sum'\)"):
        block.append("sum")  # (not a constructor's argument: no setting meant)
    assert len(block) == 2
    with pytest.raises(TypeError, match=r"branch 'b' must be an nn.Module or a callable, got int \(2\)"):
        Parallel(OrderedDict(a=a, b=2))  # (named: no setting meant)
    with pytest.raises(TypeError, match=r"stage 'b' must be an nn.Module, got int \(2\)"):
        ParallelSequential(OrderedDict(a=a, b=2))


def test_a_tensor_passed_as_a_child_is_shown_by_shape_not_data():
    # Before: the message held the tensor's repr, 13 lines of numbers for a (100, 100)
    # weight passed where a module was meant, and no shape.
    a, weight = nn.Linear(2, 2), torch.randn(100, 100)
    with pytest.raises(TypeError) as ei:
        Parallel(a, weight)
    assert str(ei.value) == ("Parallel: branch '1' must be an nn.Module or a callable, got Tensor(100, 100) "
                             "float32 on cpu. Wrap it in a module or pass a function.")
    with pytest.raises(TypeError) as ei:
        ParallelSequential(a, weight)
    assert str(ei.value) == ("ParallelSequential: stage '1' must be an nn.Module, got Tensor(100, 100) float32 "
                             "on cpu. Wrap functions in a module.")
    block, x = Parallel(a, join="sum"), torch.randn(3, 2)
    before = block(x)
    with pytest.raises(TypeError, match=r"got Tensor\(100, 100\) float32 on cpu\. Wrap"):
        block.append(weight)
    assert len(block) == 1
    assert_same(block(x), before)


@pytest.mark.parametrize("cls", [Parallel, ParallelSequential])
def test_insert_with_its_arguments_swapped_shows_the_index_and_the_call(cls):
    # Before: "insert takes an int index, got Linear", unlike its siblings, which show the value
    # and how to fix it; the index and the module swapped is the likely mistake.
    a, x = nn.Linear(2, 2), torch.randn(3, 2)
    block = cls(a)
    before = block(x)
    with pytest.raises(TypeError) as ei:
        block.insert(nn.Linear(2, 2), 0)
    assert str(ei.value) == (f"{cls.__name__}: insert takes an int index, got Linear (Linear(in_features=2, "
                             "out_features=2, bias=True)); call it as insert(index, module).")
    assert list(block) == [a]
    assert_same(block(x), before)


# --------------------------------------------------- found by a review of errors
@pytest.mark.parametrize("join", ["cat", "stack", "sum", "mean"])
def test_named_joins_of_no_tensor_at_all_are_refused(join):
    # A forward that forgot its ``return``: the Nones were passed on as the result.
    p = Parallel(OrderedDict(a=lambda x: None, b=lambda x: None), join=join)
    with pytest.raises(TypeError, match=r"(?s)Parallel: join=.* joins tensors, but no branch returned one.*'a'"):
        p(torch.randn(2, 2))
    # Passed on beside tensors, as before.
    p = Parallel(lambda x: (x, None), lambda x: (x * 2, None), join=join)
    out, none = p(torch.randn(2, 2))
    assert none is None and isinstance(out, torch.Tensor)


def test_a_fused_group_failing_on_bad_input_gives_the_branch_error_alone():
    mlp = lambda: nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))  # noqa: E731
    p = Parallel(mlp(), mlp(), fuse=True)
    with pytest.raises(RuntimeError) as ei:
        p(torch.randn(5, 6))
    # The members' own error, naming the branch; not chained to the batched attempt's.
    assert ei.value.__context__ is None and ei.value.__cause__ is None
    assert "branch '0'" in full_text(ei.value) and "baddbmm" not in full_text(ei.value)
    x = torch.randn(5, 4)
    torch.testing.assert_close(p(x), torch.cat([p[0](x), p[1](x)], 1))


class _Exhausted(nn.Module):
    r"""A layer that raises StopIteration while ``stop`` is set (``next()`` of an empty iterator)."""

    stop = False

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if _Exhausted.stop:
            raise StopIteration("no more items")
        return self.lin(x)


@pytest.mark.parametrize("fuse", [True, "auto"])
def test_a_fused_member_raising_stop_iteration_keeps_its_type_and_names_the_branch(fuse):
    # The members run one by one after the batched attempt failed: a StopIteration of theirs came
    # out of a generator as "RuntimeError: generator raised StopIteration", naming no branch.
    p = Parallel(_Exhausted(), _Exhausted(), fuse=fuse)
    x = torch.randn(3, 4)
    p(x), p(x)  # (fuse="auto" runs a signature's first call in turn: the second runs fused)
    _Exhausted.stop = True
    try:
        with pytest.raises(StopIteration) as ei:
            p(x)
    finally:
        _Exhausted.stop = False
    assert "branch '0'" in full_text(ei.value) and "no more items" in full_text(ei.value)
    torch.testing.assert_close(p(x), torch.cat([p[0](x), p[1](x)], 1))


def test_a_dim_beyond_any_tensor_is_refused_when_set():
    with pytest.raises(ValueError, match=r"Parallel: dim=9223372036854775808 is out of range for any tensor"):
        Parallel(nn.Identity(), dim=2**63)
    p = Parallel(nn.Identity(), nn.Identity())
    with pytest.raises(ValueError, match="out of range"):
        p.dim = -2**70
    x = torch.randn(2, 2)
    assert_same(p(x), torch.cat([x, x], 1))


def test_classes_and_module_lists_are_refused_as_branches():
    with pytest.raises(TypeError, match=r"Parallel: branch '0' is the class Linear, not a module; pass an instance"):
        Parallel(nn.Linear, nn.ReLU)
    with pytest.raises(TypeError, match=r"Parallel: branch '0' is a ModuleDict, which holds modules"):
        Parallel(nn.ModuleDict({"a": nn.ReLU()}))
    p = Parallel(nn.Identity())
    with pytest.raises(TypeError, match="branch '1' is the class ReLU"):
        p.append(nn.ReLU)
    assert len(p) == 1


def test_module_list_and_dict_subclasses_with_a_forward_are_branches_and_stages():
    from parallel_modules import ParallelSequential

    class Chain(nn.ModuleList):
        def forward(self, x):
            for m in self:
                x = m(x)
            return x

    class Heads(nn.ModuleDict):
        def forward(self, x):
            return sum(m(x) for m in self.values())

    chain, heads = Chain([nn.Linear(4, 4), nn.ReLU()]), Heads({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    x = torch.randn(2, 4)
    assert_same(Parallel(chain, heads)(x), torch.cat([chain(x), heads(x)], 1))
    assert_same(ParallelSequential(chain, heads)(x), heads(chain(x)))


@pytest.mark.parametrize("name", ["join", "fuse", "append", "training", "a.b", ""])
def test_branch_names_that_cannot_be_attributes_are_refused(name):
    with pytest.raises(ValueError, match=f"Parallel: cannot name a branch {name!r}"):
        Parallel(OrderedDict([("a", nn.Identity()), (name, nn.Identity())]))
    with pytest.raises(TypeError, match=r"Parallel: branch names must be strings, got int \(1\)"):
        Parallel(OrderedDict([(1, nn.Identity())]))


def test_indexing_by_name_says_how_to_reach_a_named_branch():
    p = Parallel(OrderedDict(a=nn.Identity(), b=nn.ReLU()))
    for index in ("a", None, 1.0):
        with pytest.raises(TypeError, match=r"Parallel: branches are indexed by int or slice, got"):
            p[index]
    with pytest.raises(TypeError, match=r"A named branch is an attribute: block.a"):
        del p["a"]
    assert isinstance(p[1], nn.ReLU) and p.a is p[0] and len(p) == 2
    numbered = Parallel(nn.Identity(), nn.ReLU())
    with pytest.raises(TypeError, match=r"A named branch is an attribute: getattr\(block, '0'\)"):
        numbered["0"]


def test_assigning_to_a_slice_of_branches_says_how():
    # Before: "branches are indexed by int or slice, got slice".
    p = Parallel(nn.Identity(), nn.ReLU())
    with pytest.raises(TypeError, match=r"Parallel: cannot assign to a slice of branches \(slice\(0, 1, None\)\), "
                                        r"as nn.Sequential cannot; assign them one at a time: block\[i\] = module"):
        p[0:1] = [nn.Tanh()]
    assert isinstance(p[0], nn.Identity) and len(p) == 2


def test_extend_onto_a_name_already_taken_leaves_the_block_as_it_was():
    # Before: the first new branch ("2") was appended, then "3" raised, a partly extended block.
    p = Parallel(OrderedDict((k, nn.Linear(4, 4)) for k in ("1", "3")))  # (as kept by a deletion of named branches)
    with pytest.raises(ValueError, match=r"Parallel: a branch named '3' already exists \(\[.*\]\); extend names the new "
                                         r"branches by their index\. Build a new block, Parallel\(\*block, \*modules\)"):
        p.extend([nn.Linear(4, 4), nn.Linear(4, 4)])
    assert list(p._modules) == ["1", "3"]
    x = torch.randn(2, 4)
    assert_same(p(x), torch.cat([p[0](x), p[1](x)], 1))


def test_a_slice_selecting_no_branch_names_the_slice():
    # Before: the constructor's "expected at least one branch, got none. Pass modules, e.g.
    # Parallel(nn.Linear(8, 8), ...)", which named no slice.
    a, b, c = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 3)
    p = Parallel(a, b, c, join="sum")
    for idx, text in ((slice(5, None), r"\[5:\]"), (slice(0, 0), r"\[0:0\]"), (slice(0, 3, -1), r"\[0:3:-1\]")):
        with pytest.raises(ValueError, match=rf"Parallel: the slice {text} selects none of the 3 branches, and a "
                                             r"Parallel needs at least one\. Choose a slice that keeps one"):
            p[idx]
    assert list(p) == [a, b, c]
    x = torch.randn(2, 4)
    assert_same(p(x), a(x) + b(x) + c(x))
    assert list(p[1:]) == [b, c]


def test_append_onto_a_name_already_taken_says_why_and_how():
    # Before: "a branch named '2' already exists; use an OrderedDict.", which append cannot take.
    a, b, c = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 3)
    p = Parallel(a, b, c)
    delattr(p, "1")  # (names kept: "0", "2")
    with pytest.raises(ValueError, match=r"Parallel: a branch named '2' already exists \(\['0', '2'\]\); append "
                                         r"names the new branch by its index, '2'\. Build a new block, "
                                         r"Parallel\(\*block, module\), or name the branches in an OrderedDict"):
        p.append(nn.Identity())
    assert list(p._modules) == ["0", "2"]
    x = torch.randn(2, 4)
    assert_same(p(x), torch.cat([a(x), c(x)], 1))
    assert_same(Parallel(*p, nn.Identity())(x), torch.cat([a(x), c(x), x], 1))


def test_extend_with_a_bad_module_appends_none():
    p = Parallel(nn.Identity(), nn.Identity())
    with pytest.raises(TypeError, match="branch '3' must be an nn.Module or a callable, got None\."):
        p.extend([nn.ReLU(), None])
    assert len(p) == 2
    x = torch.randn(2, 2)
    assert_same(p(x), torch.cat([x, x], 1))


def test_settings_cannot_be_deleted_and_compile_is_fixed():
    p = Parallel(nn.Identity(), nn.Identity())
    with pytest.raises(AttributeError, match="Parallel: cannot delete the setting 'join'"):
        del p.join
    for name, value in (("compile", "inductor"), ("compile_options", {}), ("compile_fallback", True)):
        with pytest.raises(AttributeError, match=f"Parallel: {name}= is fixed when the block is built"):
            setattr(p, name, value)
    x = torch.randn(2, 2)
    assert_same(p(x), torch.cat([x, x], 1))
    assert callable(p.compile)  # (nn.Module.compile, not hidden)


# ------------------------------------------------- found by a cross-feature fuzz
@pytest.mark.parametrize("groups", [1, 2])
def test_fuse_auto_on_the_cpu_keeps_a_branch_changing_the_input_in_place_in_order(groups):
    # Before: the identical branches 0 and 2 ran fused, both before branch 1's ReLU, where
    # in turn branch 2 reads the changed input (max error 0.64); with the writers fused
    # as a second group, every branch in a group, the first call was not watched.
    torch.manual_seed(0)
    writer = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4))
    branches = [nn.Linear(4, 4), writer, nn.Linear(4, 4)] + ([copy.deepcopy(writer)] if groups == 2 else [])
    block = Parallel(*[copy.deepcopy(b) for b in branches], fuse="auto")
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 4)
            got = block(x.clone())
            xr = x.clone()
            assert_same(got, torch.cat([b(xr) for b in branches], 1))
        with torch.inference_mode():  # inference tensors keep no version: seen by their writes
            block = Parallel(*[copy.deepcopy(b) for b in branches], fuse="auto")
            x = torch.randn(2, 4)
            xr = x.clone()
            assert_same(block(x.clone()), torch.cat([b(xr) for b in branches], 1))


class _RefusesNaN(nn.Module):
    r"""Changes its input in place, after raising on one that holds a NaN."""

    def forward(self, x):
        if torch.isnan(x).any():
            raise ValueError("NaN in the input")
        return x.mul_(2)


def test_fuse_auto_watches_again_after_a_first_call_that_raised():
    # Before: the signature's first call, which runs in turn to watch for writes to the
    # input, raised in a branch after the fused plan was remembered; every later call ran
    # fused, the writer's change seen by one member and not the other (max error 1.44).
    torch.manual_seed(0)
    branches = [nn.Linear(8, 4), nn.Sequential(_RefusesNaN(), nn.Linear(8, 4)), nn.Linear(8, 4)]
    block = Parallel(*[copy.deepcopy(b) for b in branches], fuse="auto")
    bad = torch.randn(3, 8)
    bad[0, 0] = float("nan")
    with torch.no_grad():
        with pytest.raises(ValueError, match="NaN in the input"):
            block(bad)
        for _ in range(2):
            x = torch.randn(3, 8)
            got = block(x.clone())
            xr = x.clone()
            assert_same(got, torch.cat([b(xr) for b in branches], 1))
    assert list(block.explain()["schedules"].values()) == [
        "unfused, sequential (a branch changed its input in place on the first call: the branches run one after "
        "another)"]


def test_a_callable_appended_to_an_eval_block_takes_its_mode():
    f = lambda x: x * 1.5  # noqa: E731
    block = Parallel(f, f, join="sum", fuse=True).eval()
    block.append(f)
    block.extend([f])
    block[0] = f
    x = torch.randn(2, 4)
    assert_same(block(x), x * 1.5 * 4)
    assert not any(b.training for b in block)


def _private_state(block: nn.Module, x: torch.Tensor) -> set[str]:
    r"""The private attributes ``block`` has after calls in each mode and a dtype change."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (cuda_graph=True on the CPU: runs eagerly, and says so)
        for _ in range(2):
            block(x)
        block.eval()(x)
        block.to(torch.float64)(x.double())
        block.max_graphs = 4  # (a setting changed: its revision, see _watch._change_setting)
        block(x.double())
    if isinstance(block, Parallel):
        block.explain()
    return {name for name in vars(block) if name.startswith("_")} - set(vars(nn.Module()))


@pytest.mark.parametrize("settings", [{}, {"fuse": True}, {"fuse": "auto"}, {"cuda_graph": True},
                                      {"compile": "eager"}, {"join": "sum", "streams": True}])
def test_branch_names_of_the_private_state_are_refused(settings):
    # Before: a branch named "_plans" or "_tuner" failed with torch's own error naming neither
    # the module nor the branch, and one named "_fusion" was replaced by None at construction.
    x = torch.randn(4, 8)
    names = _private_state(Parallel(nn.Linear(8, 4), nn.Linear(8, 4), **settings), x)
    assert names <= Parallel._internal, names - Parallel._internal  # (a new one: add it to _internal)
    assert {"_plans", "_revision"} <= names
    for name in sorted(names):
        with pytest.raises(ValueError, match=f"Parallel: cannot name a branch {name!r}: Parallel has an attribute"):
            Parallel(OrderedDict([("a", nn.Linear(8, 4)), (name, nn.Linear(8, 4))]))


@pytest.mark.parametrize("settings", [{}, {"chunks": 2}, {"cuda_graph": True, "chunks": 2},
                                      {"compile": "eager", "chunks": 2}])
def test_stage_names_of_the_private_state_are_refused(settings):
    # Before: a stage named "_plan" or "_compiler" was replaced by None at construction.
    from parallel_modules import ParallelSequential

    x = torch.randn(4, 8)
    names = _private_state(ParallelSequential(nn.Linear(8, 8), nn.Softmax(-1), **settings), x)
    assert names <= ParallelSequential._internal, names - ParallelSequential._internal
    assert {"_plan", "_revision"} <= names
    for name in sorted(names):
        with pytest.raises(ValueError, match=f"ParallelSequential: cannot name a stage {name!r}"):
            ParallelSequential(OrderedDict([("enc", nn.Linear(8, 8)), (name, nn.Linear(8, 2))]), chunks=2)


def test_non_tensor_output_leaves_that_differ_are_named_with_their_values():
    # Before: "branch '0': int, branch '1': int" (no values), and a NumPy leaf escaped as a bare
    # "truth value of an array is ambiguous" naming neither the block nor a branch.
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"outputs at \[1\] .* branch '0': int \(3\), branch '1': int \(4\)"):
        Parallel(lambda x: (x, 3), lambda x: (x, 4))(x)
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match=r"^Parallel: join='cat' .* branch '0': ndarray \(array\(\[1, 2\]\)\)"):
        Parallel(lambda x: (x, np.array([1, 2])), lambda x: (x, np.array([1, 2])))(x)
    out = Parallel(lambda x: (x, "tag"), lambda x: (x * 2, "tag"))(x)  # the same value: passed on
    torch.testing.assert_close(out[0], torch.cat([x, x * 2], 1))
    assert out[1] == "tag"


class _ToMeta(nn.Module):
    def forward(self, x):
        return x.to("meta")


@pytest.mark.parametrize("join", ["cat", "stack", "sum", "mean"])
def test_outputs_on_different_devices_are_called_that_not_a_shape_mismatch(join):
    # torch checks devices before shapes: equal shapes on two devices are no shape mismatch.
    p = Parallel(OrderedDict(here=nn.Identity(), there=_ToMeta()), join=join)
    for _ in range(2):
        with pytest.raises(RuntimeError) as ei:
            p(torch.randn(2, 3))
        msg = str(ei.value)
        assert "expects all outputs on one device" in msg and "branch 'there': Tensor(2, 3) float32 on meta" in msg
        assert "to match" not in msg and "broadcast" not in msg and "shapes to be equal" not in msg
    p.there = nn.Identity()  # fixed
    x = torch.randn(2, 3)
    assert_same(p(x), torch.cat([x, x], 1) if join == "cat" else
                torch.stack([x, x], 1) if join == "stack" else x + x if join == "sum" else (x + x) / 2)


def test_a_sum_with_a_0d_cpu_output_is_not_called_a_device_mismatch():
    # (a 0-d CPU tensor adds to a tensor of any device, as a number: a failing sum is about shapes)
    p = Parallel(lambda x: x.to("meta"), lambda x: torch.ones(2, 5, device="meta"), lambda x: torch.tensor(1.0),
                 join="sum")
    with pytest.raises(RuntimeError, match="expects shapes that broadcast together"):
        p(torch.randn(2, 3))


def test_0d_outputs_of_cat_are_called_that_with_stack_suggested():
    p = Parallel(OrderedDict(a=lambda x: x.sum(), b=lambda x: x.mean()))
    with pytest.raises(RuntimeError) as ei:
        p(torch.randn(2, 3))
    msg = str(ei.value)
    assert "at least one dimension" in msg and "join='stack'" in msg and "branch 'a': Tensor() float32" in msg
    p.join, x = "stack", torch.randn(2, 3)
    p.dim = 0
    assert_same(p(x), torch.stack([x.sum(), x.mean()]))


def test_a_device_mismatch_in_one_leaf_of_structured_outputs_is_diagnosed_on_that_leaf():
    p = Parallel(lambda x: (x, x), lambda x: (x, x.to("meta")))
    with pytest.raises(RuntimeError, match="expects all outputs on one device"):
        p(torch.randn(2, 3))
    q = Parallel(lambda x: (x, x.to("meta")), lambda x: (x[:, :1].t(), x.to("meta")), dim=0)
    with pytest.raises(RuntimeError, match="expects all dimensions except dim=0 to match"):
        q(torch.randn(2, 3))


class _Lookup(nn.Module):
    def forward(self, x):
        return x * {"a": 1}["b"]  # KeyError('b')


class _Bare(nn.Module):
    def forward(self, x):
        raise OSError(2, "No such file or directory")


class _Python310:
    version_info = (3, 10, 0)


@pytest.mark.parametrize("python", ["3.10", "current"])
def test_branch_errors_keep_their_args_and_get_the_branch_named(python, monkeypatch):
    # Before, on 3.10: a KeyError's key became "b\n(raised in branch ...)", and an exception
    # whose first argument is not a message (OSError's errno) was left without the branch named.
    import parallel_modules._inputs as inputs

    if python == "3.10":
        monkeypatch.setattr(inputs, "sys", _Python310())
    with pytest.raises(KeyError) as ei:
        Parallel(nn.Identity(), _Lookup())(torch.randn(2, 2))
    assert ei.value.args == ("b",) and "branch '1' (index 1) of Parallel" in "".join(ei.value.__notes__)
    with pytest.raises(OSError) as ei:
        Parallel(nn.Identity(), _Bare())(torch.randn(2, 2))
    assert ei.value.errno == 2 and ei.value.args == (2, "No such file or directory")
    assert "branch '1' (index 1) of Parallel" in "".join(ei.value.__notes__)
    with pytest.raises(ValueError) as ei:  # a message of its own: 3.10 shows no notes, so it is appended there
        Parallel(nn.Identity(), lambda x: int("x"))(torch.randn(2, 2))
    assert ("branch '1' (index 1) of Parallel" in str(ei.value)) == (python == "3.10")


def test_nested_blocks_at_the_same_index_each_add_their_note():
    # (A review caught a dedupe by the note's text, which dropped the outer of two equal notes.)
    def bad(x):
        raise RuntimeError("bad")

    with pytest.raises(RuntimeError) as ei:
        Parallel(nn.Identity(), Parallel(nn.Identity(), bad))(torch.randn(2, 2))
    assert ei.value.__notes__.count("(raised in branch '1' (index 1) of Parallel)") == 2


@pytest.mark.parametrize("python", ["3.10", "current"])
def test_an_exception_that_takes_no_note_goes_on_as_raised(python, monkeypatch):
    import dataclasses

    import parallel_modules._inputs as inputs

    @dataclasses.dataclass(frozen=True)
    class SolverFailed(Exception):
        code: int

    def fail(x):
        raise SolverFailed(7)

    if python == "3.10":
        monkeypatch.setattr(inputs, "sys", _Python310())
    with pytest.raises(SolverFailed) as ei:
        Parallel(nn.Identity(), fail)(torch.randn(2, 2))
    assert ei.value.code == 7
def test_a_sparse_output_beside_a_dense_one_is_called_a_layout_mismatch():
    # Before: both listed as "Tensor(5, 4) float32 on cpu", blamed on the dimensions, with
    # torch's 60-line table of kernels pasted into the message, as a RuntimeError.
    p = Parallel(OrderedDict(dense=nn.Identity(), sparse=lambda x: x.to_sparse()))
    with pytest.raises(NotImplementedError) as ei:
        p(torch.randn(5, 4))
    msg = str(ei.value)
    assert "expects outputs of one layout" in msg and "branch 'sparse': Tensor(5, 4) float32 sparse_coo on cpu" in msg
    assert len(msg.splitlines()) < 8 and isinstance(ei.value.__cause__, NotImplementedError)
    p.sparse = nn.Identity()
    x = torch.randn(5, 4)
    assert_same(p(x), torch.cat([x, x], 1))


def test_outputs_of_different_ranks_are_called_that_not_a_dim_out_of_range():
    # Before: "dim is out of range ... (valid: -2 to 1, -3 to 2)", a range holding the dim given.
    p = Parallel(nn.Identity(), lambda x: x.unsqueeze(-1), dim=2)
    with pytest.raises(IndexError) as ei:
        p(torch.randn(5, 4))
    msg = str(ei.value)
    assert "one number of dimensions (here 2 and 3)" in msg and "out of range" not in msg.split("(IndexError")[0]


def test_named_tuples_of_different_types_are_told_apart_in_the_listing():
    from collections import namedtuple

    a, b = namedtuple("A", "x y"), namedtuple("B", "x y")
    with pytest.raises(ValueError) as ei:
        Parallel(lambda x: a(x, x), lambda x: b(x, x))(torch.randn(2, 3))
    assert "A(Tensor(2, 3)" in str(ei.value) and "B(Tensor(2, 3)" in str(ei.value)


def test_a_join_taking_one_argument_per_branch_is_told_it_gets_one_list():
    p = Parallel(nn.Linear(4, 3), nn.Linear(4, 3), join=lambda a, b: a * b)
    with pytest.raises(TypeError) as ei:
        p(torch.randn(5, 4))
    assert "called with one argument: the list of the outputs of branches ['0', '1']" in full_text(ei.value)
    p.join = lambda outputs: outputs[0] * outputs[1]  # fixed
    x = torch.randn(5, 4)
    assert_same(p(x), p[0](x) * p[1](x))


def test_the_advice_for_a_join_with_parameters_works_when_followed():
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    with pytest.raises(ValueError) as ei:
        Parallel(a, b, join=nn.Linear(6, 3))
    assert "nn.Sequential(Parallel(..., join='cat'), Linear(...))" in str(ei.value)
    head = nn.Linear(6, 3)
    x = torch.randn(5, 4)
    assert_same(nn.Sequential(Parallel(a, b, join="cat"), head)(x), head(torch.cat([a(x), b(x)], 1)))


def test_a_type_error_subclass_from_a_join_keeps_its_type():
    class UnsupportedOp(TypeError):
        pass

    class Picky(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.stack:
                raise UnsupportedOp("stack is not supported")
            return super().__torch_function__(func, types, args, kwargs or {})

    # (Before a review's fix: a RuntimeError, which ``except TypeError`` missed.)
    with pytest.raises(TypeError) as ei:
        Parallel(nn.Identity(), nn.Identity(), join="stack")(torch.randn(2, 2).as_subclass(Picky))
    assert isinstance(ei.value.__cause__, UnsupportedOp)


def test_a_sum_is_diagnosed_by_its_first_failing_addition():
    # Shapes fail before the meta output is reached: not a device mismatch.
    p = Parallel(nn.Identity(), lambda x: x[:, :1].expand(2, 5).clone(), lambda x: x.to("meta"), join="sum")
    with pytest.raises(RuntimeError, match="expects shapes that broadcast together"):
        p(torch.randn(2, 3))
    q = Parallel(nn.Identity(), lambda x: x.to("meta"), lambda x: x[:, :1].expand(2, 5).clone(), join="sum")
    with pytest.raises(RuntimeError, match="expects all outputs on one device"):
        q(torch.randn(2, 3))


@pytest.mark.parametrize("inner_streams", [True, "auto"])
def test_a_refused_fork_of_a_nested_block_is_noted_by_that_block_alone(inner_streams):
    # (Reviews: the outer block also took the inner fork's refusal for its own, noted it and
    # kept its own branches in order for good -- an inner streams=True block left it unmarked.)
    from parallel_modules._streams import _changed_in_place

    def inner_fork_refused(x):
        raise _changed_in_place()  # (as the inner block's fork raises it, on a GPU)

    outer = Parallel(nn.Linear(2, 2), Parallel(nn.Identity(), inner_fork_refused, streams=inner_streams),
                     nn.Linear(2, 2), fuse="auto")
    with torch.no_grad(), pytest.raises(RuntimeError) as ei:
        outer(torch.randn(3, 2))
    notes = [n for n in ei.value.__notes__ if "streams='auto' had forked it" in n]
    assert len(notes) == (1 if inner_streams == "auto" else 0)
    assert all("of Parallel; streams" in n for n in notes) and not outer._in_order


class _CountsThenRaises(nn.Module):
    r"""Counts its calls in a buffer, then raises ``self.raises`` when it is set."""

    raises: type[BaseException] | None = None

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        if self.raises is not None:
            raise self.raises("injected")
        return self.lin(x)


@pytest.mark.parametrize("fuse", ["auto", True])
def test_a_keyboard_interrupt_in_a_fused_group_leaves_no_batched_buffer_writes(fuse, monkeypatch):
    # Before (a fault-injection hunt): only an Exception put back what the batched attempt wrote
    # into every member's buffers; a KeyboardInterrupt left each member counting a call ([2, 2, 2]).
    block = Parallel(*[_CountsThenRaises() for _ in range(3)], join="sum", fuse=fuse).eval()
    x = torch.randn(2, 4)
    block(x)
    monkeypatch.setattr(_CountsThenRaises, "raises", KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        block(x)
    assert [int(b.calls) for b in block] == [1, 1, 1]
    monkeypatch.setattr(_CountsThenRaises, "raises", None)
    torch.testing.assert_close(block(x), sum(b.lin(x) for b in block))  # (fused: summed in another order)
    assert [int(b.calls) for b in block] == [2, 2, 2]


def test_only_allocation_failures_count_as_out_of_memory():
    from parallel_modules._joins import _out_of_memory

    assert _out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert _out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory"))
    assert _out_of_memory(MemoryError())
    # A user's error of another type that happens to say so is theirs (a fused group's failure under
    # fuse=True then raises as any other, not as an allocation failure retried unfused).
    assert not _out_of_memory(ValueError("the cache server is out of memory"))


def test_a_signature_reads_numbers_as_they_were_passed():
    # The readable form of a key (explain()'s schedules and graphs) shows each number keyed by its
    # bits as the value it was: -0.0 apart from 0.0, numpy's by name, complex numbers whole.
    from parallel_modules._inputs import _signature
    from parallel_modules.parallel import _describe_signature

    np = pytest.importorskip("numpy")
    x = torch.randn(2)
    text = lambda v: _describe_signature(_signature((x, v), {}, True))  # noqa: E731
    assert "-0.0" in text(-0.0) and "-0.0" not in text(0.0)
    assert "float32(-0.0)" in text(np.float32(-0.0)) and "float32(nan)" in text(np.float32("nan"))
    assert "(1-0j)" in text(complex(1.0, -0.0)) and "complex64((2+3j))" in text(np.complex64(2 + 3j))
    assert "int64(7)" in text(np.int64(7))


@pytest.mark.parametrize("join", ["cat", "sum"])
def test_a_join_failing_on_one_leaf_of_structured_outputs_names_where_it_lies(join):
    # Before: "dim is out of range for branch outputs of 1 dimensions", next to a listing of
    # whole structures whose first tensors have 2: which of their tensors failed went unsaid.
    p = Parallel(lambda x: {"y": (x, None), "z": [x.sum(0)]}, lambda x: {"y": (x, None), "z": [x[0, :2]]},
                 join=join)
    error = IndexError if join == "cat" else RuntimeError
    where = r"1 dimensions at \['z'\]\[0\] \(valid" if join == "cat" else r"outputs at \['z'\]\[0\]; it expects"
    with pytest.raises(error, match=where):
        p(torch.randn(2, 3))
    p[1] = lambda x: {"y": (x, None), "z": [x.sum(0)]}
    p.dim = 0
    out = p(x := torch.randn(2, 3))
    assert_same(out["z"][0], torch.cat([x.sum(0)] * 2) if join == "cat" else x.sum(0) + x.sum(0))


@pytest.mark.parametrize("join", ["cat", "stack", "sum", "mean"])
def test_a_first_branch_returning_a_number_where_another_returns_a_tensor_names_the_leaf(join):
    # Before: "joins tensors, but no branch returned one", listing branch 'b''s tensor under it --
    # only the first branch's outputs were looked at.
    p = Parallel(OrderedDict(a=lambda x: 2, b=lambda x: x), join=join)
    with pytest.raises(TypeError) as ei:
        p(torch.randn(2, 2))
    # (A TypeError, as where no branch returned a tensor; outputs that are single leaves are not listed
    # again below the line that names them.)
    assert str(ei.value) == (f"Parallel: join={join!r} joins tensors, but the branch outputs are not a tensor in "
                             "every branch, nor the same value in all: branch 'a': int (2), branch 'b': Tensor(2, 2) "
                             "float32 on cpu. Return a tensor from every branch (or the same non-tensor value), "
                             "or pass join=None to receive the outputs as a tuple.")
    p[0] = lambda x: x + 1  # (still usable)
    x = torch.randn(2, 2)
    expected = {"cat": torch.cat([x + 1, x], 1), "stack": torch.stack([x + 1, x], 1), "sum": (x + 1) + x,
                "mean": ((x + 1) + x) / 2}[join]
    assert torch.equal(p(x), expected)


def test_a_non_tensor_leaf_of_structured_outputs_is_named_by_its_path():
    # Before: a ValueError naming "leaf 2 of the outputs", a number the user had to count out of
    # the flattened structure.
    p = Parallel(lambda x: {"a": x, "b": (x, x)}, lambda x: {"a": x, "b": (x, "s")})
    x = torch.randn(2, 4)
    with pytest.raises(TypeError, match=r"(?s)join='cat' joins tensors, but the outputs at \['b'\]\[1\] are not a "
                                        r"tensor in every branch.*branch '1': str \('s'\)\.\n  branch '0': \{'a'"):
        p(x)
    p[1] = lambda x: {"a": x, "b": (x, x + 1)}  # (still usable)
    out = p(x)
    assert_same(out["b"][1], torch.cat([x, x + 1], 1))


@pytest.mark.parametrize("how", ["append", "extend", "iadd", "insert", "setitem", "held"])
def test_a_block_added_below_itself_is_refused_and_keeps_working(how):
    # Before: torch registered the cycle; every later call, repr and state_dict raised RecursionError
    # (the call's with a note naming the branch a thousand times), the block unusable for good.
    block = Parallel(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    expected = torch.cat([block[0](x), block[1](x)], 1)
    add = {"append": lambda: block.append(block), "extend": lambda: block.extend([block]),
           "iadd": lambda: block.__iadd__([block]), "insert": lambda: block.insert(0, block),
           "setitem": lambda: block.__setitem__(-1, block),
           "held": lambda: block.append(nn.Sequential(nn.ReLU(), block))}[how]
    where = r"a module holding the block \(at '1'\)" if how == "held" else "the block itself"
    with pytest.raises(TypeError, match=rf"Parallel: branch '\d' is {where}; a block cannot be its own branch"):
        add()
    assert len(block) == 2 and list(block.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert torch.equal(block(x), expected)
    block += block  # (its own branches, once more: no cycle)
    assert len(block) == 4


@pytest.mark.parametrize("how", ["append", "extend", "iadd", "insert", "setitem"])
def test_a_pipeline_added_below_itself_is_refused_and_keeps_working(how):
    pipe = ParallelSequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    expected = pipe[1](pipe[0](x))
    add = {"append": lambda: pipe.append(pipe), "extend": lambda: pipe.extend([pipe]),
           "iadd": lambda: pipe.__iadd__(nn.Sequential(pipe)), "insert": lambda: pipe.insert(0, pipe),
           "setitem": lambda: pipe.__setitem__(-1, nn.Sequential(pipe))}[how]
    # (`+=` adds a Sequential's stages: the pipeline itself.)
    where = r"a module holding the block \(at '0'\)" if how == "setitem" else "the block itself"
    with pytest.raises(TypeError, match=rf"ParallelSequential: stage '\d' is {where}; a block cannot be its own stage"):
        add()
    assert len(pipe) == 2 and torch.equal(pipe(x), expected)



def _exported_call_works(block: Parallel) -> None:
    r"""After a failed export, the block gives the sequential result: eagerly, and exported."""
    x = torch.randn(5, 4)
    with torch.no_grad():
        expected = torch.cat([branch(x) for branch in block], 1)
        # (A group fused for good runs batched kernels, which may round otherwise, as the
        # CPU's BLAS decides: bit for bit on some CPUs, not on others.)
        (assert_close if block.fuse is True else assert_same)(block(x), expected)
        # (Exported, a fused group runs its traced batched kernels, which may round otherwise.)
        assert_close(torch.export.export(block, (x,), strict=False).module()(x), expected)


def test_an_error_under_non_strict_export_names_the_branch() -> None:
    # Non-strict torch.export runs the block's Python as it is (torch.compiler.is_compiling() is
    # true there, but no Dynamo traces the note): the error names the branch as an eager call's does.
    block = Parallel(OrderedDict(a=nn.Linear(4, 3), b=nn.Linear(5, 3)))
    with pytest.raises(RuntimeError) as info:
        torch.export.export(block, (torch.randn(5, 4),), strict=False)
    assert "(raised in branch 'b' (index 1) of Parallel)" in getattr(info.value, "__notes__", [])
    block.b = nn.Linear(4, 3)
    _exported_call_works(block)


@pytest.mark.parametrize("fuse", [True, "auto"])
def test_a_fused_group_failing_under_non_strict_export_is_named(fuse) -> None:
    # Traced, a fused group runs batched and cannot run its members again one by one, as an
    # eager call does to name the one at fault: the batched kernels' error (on stacked shapes)
    # names the group's branches, and how to see which one fails.
    block = Parallel(OrderedDict(a=nn.Linear(4, 3), b=nn.Linear(4, 3)), fuse=fuse)
    with pytest.raises(RuntimeError) as info:
        torch.export.export(block, (torch.randn(5, 7),), strict=False)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "branches ['a', 'b'] of Parallel" in notes and "fuse=False" in notes
    _exported_call_works(block)


def test_an_error_under_non_strict_export_names_the_stage() -> None:
    # As a branch's (see above): non-strict torch.export runs the stages' Python as it is.
    pipeline = ParallelSequential(OrderedDict(s0=nn.Linear(4, 4), s1=nn.Linear(5, 4)), chunks=2)
    with pytest.raises(RuntimeError) as info:
        torch.export.export(pipeline, (torch.randn(8, 4),), strict=False)
    assert "(raised in stage 's1' (index 1) on micro-batch 0 of 2 of ParallelSequential)" in getattr(
        info.value, "__notes__", [])
    pipeline.s1 = nn.Linear(4, 4)
    x = torch.randn(8, 4)
    with torch.no_grad():
        assert_close(pipeline(x), pipeline.s1(pipeline.s0(x)))


class _Heads(Parallel):
    r"""A user's block whose own ``__init__`` takes other arguments than Parallel's."""

    def __init__(self, n: int, width: int = 4) -> None:
        super().__init__(*[nn.Linear(width, width) for _ in range(n)], join="stack")


class _Pipe(ParallelSequential):
    r"""The same, of a pipeline."""

    def __init__(self, width: int) -> None:
        super().__init__(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), chunks=2)


@pytest.mark.parametrize("how", ["block[:2]", "block.pop(slice(1, None))", "block + nn.Sequential(nn.Identity())",
                                 "block * 2", "2 * block"])
def test_a_subclass_whose_init_takes_other_arguments_is_told_how_to_slice_and_add(how):
    # Before (a CPU hunt): "Heads.__init__() got an unexpected keyword argument 'join'" (or
    # "too many positional arguments"), naming neither the operation nor the fix.
    for block, base, kind in ((_Heads(3), "Parallel", "branches"), (_Pipe(4), "ParallelSequential", "stages")):
        if "*" in how and base == "Parallel":
            continue  # (nn.ModuleList has no *, nor has Parallel)
        cls, before = type(block).__name__, list(block)
        with pytest.raises(TypeError, match=rf"{cls}: .* builds a new {cls} of the {kind} with the settings of this "
                                            rf"one \(.*\), as {base}.__init__ takes them, but {cls}.__init__ does "
                                            rf"not \(.*\)\. Let {cls}.__init__ take them .*{base}\(\*{kind}\)"):
            eval(how)
        assert list(block) == before  # (pop: refused before anything was deleted)



class _Widths(Parallel):
    r"""A user's block whose ``__init__`` binds the branches and settings, but takes its first for a width."""

    def __init__(self, width: int, *branches: nn.Module, **settings) -> None:
        super().__init__(*[nn.Linear(width, width) for _ in range(2)], *branches, **settings)


class _PipeWidths(ParallelSequential):
    def __init__(self, width: int, **settings) -> None:
        super().__init__(nn.Linear(width, width), nn.Linear(width, width), **settings)


def test_a_subclass_whose_init_fails_on_the_branches_names_the_operation_and_the_fix():
    # Its signature binds the call, so it is not refused beforehand: its own error, raised in
    # nn.Linear's constructor ("empty(): argument 'size' ..."), named neither the slice nor the fix.
    for block, base, kind in ((_Widths(4), "Parallel", "branches"), (_PipeWidths(4), "ParallelSequential", "stages")):
        cls = type(block).__name__
        with pytest.raises(TypeError) as info:
            block[:1]
        assert "empty()" in str(info.value)  # (torch's own error, its type and message kept)
        assert re.search(rf"raised by {cls}\.__init__, which a slice, \w+\[:1\], called with the {kind} by position"
                         rf".* as {base}\.__init__ takes them: {cls}\.__init__ takes them, but not as {base}\.__init__ "
                         rf"does\. Let it take the {kind} by position and the settings by keyword .*{base}\(\*{kind}\)",
                         info.value.__notes__[-1])


def test_a_slice_of_a_subclass_names_the_slice_and_the_base_of_this_package():
    # The slice as written, in both blocks' messages (the pipeline's said only "a slice"), and
    # the base is this package's class even when the subclass's module name begins with its name
    # (a user's package "parallel_modules_ext" was named as the base before).
    ext = type("_PipeExt", (_Pipe,), {"__module__": "parallel_modules_ext.layers"})
    for block, base, name in ((_Heads(3), "Parallel", "block"), (ext(4), "ParallelSequential", "pipe")):
        with pytest.raises(TypeError, match=rf"a slice, {name}\[1::2\], builds a new .* as {base}\.__init__"):
            block[1::2]


def test_a_slice_of_a_subclass_names_the_base_of_this_package_when_it_is_vendored(monkeypatch):
    # Vendored as a subpackage (``vendor.parallel_modules``), the base's module is
    # ``vendor.parallel_modules.parallel``: a test of its first dotted part against the package's
    # name found no base, and the refusal raised StopIteration in place of its TypeError.
    from parallel_modules import _children

    monkeypatch.setattr(_children, "__package__", "vendor.parallel_modules")
    for cls in (Parallel, ParallelSequential):
        monkeypatch.setattr(cls, "__module__", f"vendor.parallel_modules.{cls.__module__.rpartition('.')[2]}")
    for block, base in ((_Heads(3), "Parallel"), (_Pipe(4), "ParallelSequential")):
        with pytest.raises(TypeError, match=rf"a slice, .* as {base}\.__init__ takes them"):
            block[1::2]
