"""ParallelSequential: semantics, container behaviour and errors, on the CPU and on CUDA."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import pickle
import re
import warnings
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from parallel_modules import Parallel, ParallelSequential
from tests._helpers import (EqualByClass, Float32Region, Loop, OwnAutocast, Queries,
                           appending_from_another_thread, assert_same_backward, cpu_and_cuda, half,
                           rewriting_hooks, under_autocast_saving)

# Gradients and whole-batch outputs may come from different kernels (another
# batch size, another summation order), so they are compared within fp32
# tolerance; outputs computed on the same micro-batches are compared exactly.
RTOL, ATOL = 1e-5, 1e-5


def _stages() -> list[nn.Module]:
    return [
        nn.Sequential(nn.Linear(16, 32), nn.GELU()),
        nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.ReLU()),
        nn.Linear(32, 8),
    ]


def _pieces_reference(model: nn.Module, x: torch.Tensor, chunks: int) -> torch.Tensor:
    ref = nn.Sequential(*model)
    return torch.cat([ref(p) for p in x.tensor_split(chunks)])


class Recorder(nn.Module):
    """Identity that records the batch size of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def forward(self, x):
        first = x if isinstance(x, torch.Tensor) else torch.utils._pytree.tree_leaves(x)[0]
        self.sizes.append(first.shape[0])
        return x


class FailOnCall(nn.Module):
    """Raises on its ``n``-th call (0-based) while ``armed``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.calls, self.armed = n, 0, True

    def forward(self, x):
        call, self.calls = self.calls, self.calls + 1
        if self.armed and call == self.n:
            raise KeyError("boom")
        return x


# ----------------------------------------------------------------- construction
def test_no_stages() -> None:
    with pytest.raises(ValueError, match="ParallelSequential: expected at least one stage"):
        ParallelSequential()
    with pytest.raises(ValueError, match="at least one stage"):
        ParallelSequential(OrderedDict())


def test_chunks_takes_integers_of_other_types() -> None:
    # Before: a NumPy integer was refused as not an int, where tensor_split takes it.
    np = pytest.importorskip("numpy")
    model = ParallelSequential(nn.Linear(2, 2), chunks=np.int64(3))
    assert model.chunks == 3 and type(model.chunks) is int
    model.chunks = torch.tensor(2)
    assert model.chunks == 2 and type(model.chunks) is int
    for bad in (torch.tensor(2.5), torch.tensor(True), torch.tensor([3])):
        with pytest.raises(TypeError, match="chunks must be an int >= 1"):
            model.chunks = bad
    assert model.chunks == 2


@pytest.mark.parametrize("chunks", [0, -1, 1.5, True, "2", None])
def test_bad_chunks(chunks) -> None:
    error = ValueError if type(chunks) is int else TypeError  # (an int below 1, or not an int)
    with pytest.raises(error, match=r"ParallelSequential: chunks must be an int >= 1"):
        ParallelSequential(nn.Linear(2, 2), chunks=chunks)
    model = ParallelSequential(nn.Linear(2, 2), chunks=2)
    with pytest.raises(error, match="chunks must be"):
        model.chunks = chunks
    assert model.chunks == 2


def test_chunks_set_to_a_module_or_parameter_is_refused() -> None:
    # (A CPU hunt.) nn.Module.__setattr__ registers a module or parameter before it looks at
    # the property: ``pipe.chunks = nn.Identity()`` became a third stage, named "chunks" (a name
    # the constructor refuses), and chunks stayed 2; a parameter raised torch's KeyError.
    torch.manual_seed(0)
    model = ParallelSequential(nn.Linear(4, 4), nn.Tanh(), chunks=2)
    x = torch.randn(6, 4)
    model(x)
    for bad in (nn.Identity(), nn.Linear(4, 4), nn.Parameter(torch.tensor(3.0))):
        with pytest.raises(TypeError, match="ParallelSequential: chunks must be an int >= 1"):
            model.chunks = bad
        with pytest.raises(TypeError, match="ParallelSequential: chunks must be an int >= 1"):
            ParallelSequential(nn.Linear(4, 4), chunks=bad)
    assert model.chunks == 2 and list(model._modules) == ["0", "1"] and not model._parameters
    assert torch.equal(model(x), torch.cat([model[1](model[0](piece)) for piece in x.tensor_split(2)]))


def test_stage_must_be_module() -> None:
    with pytest.raises(TypeError, match="stage '1' must be an nn.Module, got function"):
        ParallelSequential(nn.Linear(2, 2), lambda x: x)


# ------------------------------------------------------------------ container
def test_container_behaviour() -> None:
    stages = _stages()
    model = ParallelSequential(*stages, chunks=3)
    assert isinstance(model, nn.Sequential)
    assert len(model) == 3
    assert model[0] is stages[0] and model[-1] is stages[2]
    assert list(model) == stages
    part = model[1:]
    assert type(part) is ParallelSequential and part.chunks == 3 and list(part) == stages[1:]
    assert list(part._modules) == ["1", "2"]
    assert "chunks=3" in repr(model)
    extra = nn.ReLU()
    assert model.append(extra) is model and model[3] is extra and len(model) == 4


@pytest.mark.parametrize("combine", ["a + b", "a * 2", "2 * a"])
def test_add_and_mul_keep_the_settings(combine: str) -> None:
    # nn.Sequential's + and * build a plain nn.Sequential: the pipeline's settings would go.
    a = ParallelSequential(nn.Linear(4, 4), nn.ReLU(), chunks=3, max_graphs=2)
    b = nn.Sequential(nn.Linear(4, 4))
    out = eval(combine)
    ref = eval(combine.replace("a", "nn.Sequential(*a)"))
    assert type(out) is ParallelSequential and (out.chunks, out.max_graphs) == (3, 2)
    assert list(out._modules) == list(ref._modules) and list(out) == list(ref)
    x = torch.randn(6, 4)
    torch.testing.assert_close(out(x), ref(x), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError):
        a + 1
    with pytest.raises(ValueError):
        a * 0


def test_state_dict_matches_sequential() -> None:
    stages = _stages()
    model = ParallelSequential(*stages, chunks=2)
    ref = nn.Sequential(*stages)
    assert list(model.state_dict()) == list(ref.state_dict())
    other = nn.Sequential(*_stages())
    model.load_state_dict(other.state_dict())
    x = torch.randn(6, 16)
    torch.testing.assert_close(model(x), other(x), rtol=RTOL, atol=ATOL)


def test_named_stages() -> None:
    model = ParallelSequential(OrderedDict(enc=nn.Linear(4, 8), dec=nn.Linear(8, 2)), chunks=2)
    assert list(model._modules) == ["enc", "dec"]
    assert list(model.state_dict()) == ["enc.weight", "enc.bias", "dec.weight", "dec.bias"]
    assert list(model[1:]._modules) == ["dec"] and model[1:].chunks == 2


def test_pickle_and_deepcopy() -> None:
    model = ParallelSequential(*_stages(), chunks=3)
    x = torch.randn(7, 16)
    out = model(x)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone.chunks == 3
        assert torch.equal(clone(x), out)



@pytest.mark.parametrize("how", ["del", "pop", "append", "insert"])
def test_a_shallow_copy_has_stages_of_its_own(how) -> None:
    # (As a slice has: copy.copy shared the dict of stages, and a change to the copy's was the block's.)
    model = ParallelSequential(*_stages(), chunks=3)
    x = torch.randn(7, 16)
    out = model(x)
    other = copy.copy(model)
    assert other.chunks == 3 and all(a is b for a, b in zip(other, model))
    if how == "del":
        del other[-1]
    elif how == "pop":
        other.pop(-1)
    elif how == "append":
        other.append(nn.ReLU())
    else:
        other.insert(0, nn.Identity())
    assert len(other) == len(model) + (1 if how in ("append", "insert") else -1)
    assert torch.equal(other(x), _pieces_reference(other, x, 3))
    assert torch.equal(model(x), out)


class _AddKeys(nn.Module):
    def forward(self, d):
        return d["a"] * 2 + d["b"]


def test_copies_after_a_checked_call_of_structured_inputs_warn_nothing() -> None:
    # Before (a CPU hunt): the softmax check's record of the first calls, keyed by pytree
    # specs, went into copies and pickles, and deep-copying those specs made torch warn.
    model = ParallelSequential(_AddKeys(), nn.Softmax(-1), chunks=2)
    x = {"a": torch.randn(4, 3), "b": torch.randn(4, 3)}
    out = model(x)
    assert model._softmax_checked  # (what the copies leave out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert torch.equal(clone(x), out)

# ------------------------------------------------------------------ semantics
@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("chunks", [1, 2, 3, 5, 13])
def test_matches_sequential(device: str, chunks: int) -> None:
    model = ParallelSequential(*_stages(), chunks=chunks).to(device)
    x = torch.randn(13, 16, device=device)
    out = model(x)
    assert torch.equal(out, _pieces_reference(model, x, chunks))
    torch.testing.assert_close(out, nn.Sequential(*model)(x), rtol=RTOL, atol=ATOL)


def test_chunks_1_is_sequential_exactly() -> None:
    model = ParallelSequential(*_stages())
    x = torch.randn(13, 16)
    assert torch.equal(model(x), nn.Sequential(*model)(x))


def test_split_is_tensor_split() -> None:
    rec = Recorder()
    model = ParallelSequential(rec, nn.Identity(), chunks=3)
    x = torch.randn(13, 2)
    assert torch.equal(model(x), x)
    assert rec.sizes == [5, 4, 4]


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_structured_inputs_and_outputs(device: str) -> None:
    class Combine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, inputs):  # a tuple passes as one argument, as in nn.Sequential
            (a, b), extra = inputs["pair"], inputs["scale"]
            return {"y": self.lin(a) * extra, "z": (b.sum(1, keepdim=True), b * 2)}

    class Second(nn.Module):
        def forward(self, d):
            return {"y": torch.relu(d["y"]), "z": d["z"]}

    model = ParallelSequential(Combine(), Second(), chunks=3).to(device)
    a, b = torch.randn(10, 4, device=device), torch.randn(10, 5, device=device)
    out = model({"pair": (a, b), "scale": 2.0})
    ref = nn.Sequential(*model)
    pieces = [ref({"pair": (pa, pb), "scale": 2.0}) for pa, pb in zip(a.tensor_split(3), b.tensor_split(3))]
    assert torch.equal(out["y"], torch.cat([p["y"] for p in pieces]))
    assert torch.equal(out["z"][0], torch.cat([p["z"][0] for p in pieces]))
    assert torch.equal(out["z"][1], torch.cat([p["z"][1] for p in pieces]))
    assert out["y"].shape == (10, 3) and out["z"][1].shape == (10, 5)


class _AppendsToItsInput(nn.Module):
    r"""A stage keeping its keys in a list of its input, a cache: ``d["cache"].append(k)``."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(4, 4)

    def forward(self, d: dict) -> dict:
        d["cache"].append(self.k(d["x"]))
        return d


class _WritesKey(nn.Module):
    r"""A stage putting its result into the dict it gets, and returning it."""

    def forward(self, d: dict) -> dict:
        d["y"] = d["x"] * 2
        return d


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_a_stage_changing_a_list_or_dict_of_its_input_is_refused(device: str) -> None:
    # Before (a review): each micro-batch gets lists and dicts of its own (pytree makes them anew
    # around its pieces), so a stage appending to the input's cache, or writing a key into the
    # input's dict, changed only those: the caller's stayed as they were, silently, where
    # nn.Sequential changes them.
    x = torch.randn(6, 4, device=device)
    for stages, make, where, change in (
            ((_AppendsToItsInput(),), lambda: {"x": x, "cache": []}, r"input\['cache'\], a list in the pipeline's input,",
             r"1 items where it came with 0"),
            ((nn.Identity(), _WritesKey()), lambda: {"x": x}, r"the pipeline's input, a dict,",
             r"the keys \['y'\] added")):
        model = ParallelSequential(*stages, chunks=2).to(device)
        s = len(stages) - 1
        given = make()
        with pytest.raises(RuntimeError, match=rf"(?s)stage '{s}' \(index {s}\) changed {where} in place on micro-batch "
                                               rf"0 of 2 \({change}\).*nn.Sequential.*or use chunks=1"):
            model(given)
        assert list(given) == list(make()) and given.get("cache") in (None, [])  # (as it came)
        # With chunks=1 the stage gets the caller's own, as in nn.Sequential.
        given, expected = make(), make()
        model.chunks = 1
        out = model(given)
        assert out is given and nn.Sequential(*stages)(expected) is expected
        assert list(given) == list(expected) and all(
            torch.equal(a, b) for a, b in zip(pytree.tree_leaves(given), pytree.tree_leaves(expected)))
    # A stage that reads the dict and returns something new changes no container.
    out = ParallelSequential(nn.Identity(), _AddKeys(), chunks=3).to(device)({"a": x, "b": x})
    assert torch.equal(out, x * 3)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_parallel_as_stage_and_pipeline_as_branch(device: str) -> None:
    block = Parallel(nn.Linear(32, 8), nn.Sequential(nn.Linear(32, 16), nn.ReLU()), join="cat", dim=1, streams=True)
    model = ParallelSequential(nn.Sequential(nn.Linear(16, 32), nn.GELU()), block, nn.Linear(24, 4), chunks=4)
    model = model.to(device)
    x = torch.randn(11, 16, device=device)
    ref = nn.Sequential(model[0], model[1], model[2])
    assert torch.equal(model(x), torch.cat([ref(p) for p in x.tensor_split(4)]))

    inner = ParallelSequential(nn.Linear(16, 8), nn.ReLU(), chunks=3)
    outer = Parallel(nn.Linear(16, 5), inner, join="cat", dim=1, streams=True).to(device)
    expected = torch.cat(
        [outer[0](x), torch.cat([nn.Sequential(*inner)(p) for p in x.tensor_split(3)])], dim=1
    )
    assert torch.equal(outer(x), expected)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_gradients_match_sequential(device: str) -> None:
    model = ParallelSequential(*_stages(), chunks=3).to(device)
    ref_model = copy.deepcopy(model)
    ref = nn.Sequential(*ref_model)
    for _ in range(3):
        x = torch.randn(13, 16, device=device)
        assert_same_backward(model, ref, x, RTOL, ATOL)
    # autograd.grad as well
    x = torch.randn(13, 16, device=device, requires_grad=True)
    (g,) = torch.autograd.grad(model(x).sum(), x)
    (h,) = torch.autograd.grad(ref(x).sum(), x)
    torch.testing.assert_close(g, h, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------- errors
@pytest.mark.parametrize("device", cpu_and_cuda())
def test_chunks_larger_than_batch(device: str) -> None:
    model = ParallelSequential(*_stages(), chunks=4).to(device)
    with pytest.raises(ValueError, match=r"chunks=4 is larger than the batch size 3.*chunks <= 3"):
        model(torch.randn(3, 16, device=device))
    x = torch.randn(4, 16, device=device)
    assert torch.equal(model(x), _pieces_reference(model, x, 4))


@pytest.mark.parametrize("where,path", [("stage", "1"), ("branch", "1.b"), ("deeper", "1.1")])
def test_a_nested_pipeline_with_chunks_larger_than_its_pieces_is_named(where: str, path: str) -> None:
    # Before: the error read "chunks=4 is larger than the batch size 3 ... (set model.chunks)" for a
    # batch of 6, naming neither the nested pipeline nor that it got the outer one's micro-batches.
    inner = ParallelSequential(nn.Linear(4, 4), chunks=4)
    stage = {"stage": inner, "branch": Parallel(OrderedDict(a=nn.Identity(), b=inner)),
             "deeper": nn.Sequential(nn.ReLU(), inner)}[where]
    model = ParallelSequential(nn.Linear(4, 4), stage, chunks=2)
    with pytest.raises(ValueError, match="chunks=4 is larger than the batch size 3") as caught:
        model(torch.randn(6, 4))
    who = "the stage, a ParallelSequential" if where == "stage" else f"the ParallelSequential '{path}' in it"
    notes = [n for n in caught.value.__notes__ if "raised by" in n]
    assert len(notes) == 1 and f"raised by {who}, which cuts again what it gets of each of this " \
        f"ParallelSequential's 2 micro-batches: lower its chunks (`model.get_submodule('{path}').chunks`" in notes[0]
    model.get_submodule(path).chunks = 3  # (as it says)
    model(torch.randn(6, 4))


def test_a_nested_pipeline_given_the_whole_batch_is_named_for_its_chunks() -> None:
    # Named once, by the nearest pipeline it is nested in; those around that one name their stage.
    inner = ParallelSequential(nn.Linear(4, 4), chunks=8)
    middle = ParallelSequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), inner))
    for model in (middle, ParallelSequential(nn.ReLU(), middle, chunks=2)):
        with pytest.raises(ValueError, match="chunks=8 is larger than the batch size") as caught:
            model(torch.randn(6, 4))
        notes = [n for n in caught.value.__notes__ if "raised by" in n]
        assert len(notes) == 1 and notes[0].startswith("(raised in stage '1' (index 1) of ParallelSequential; raised "
                                                       "by the ParallelSequential '1.1' in it: lower its chunks "
                                                       "(`model.get_submodule('1.1').chunks`")


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_mismatched_batch_sizes(device: str) -> None:
    class Two(nn.Module):
        def forward(self, ab):
            return ab[0] + ab[1].sum(1, keepdim=True)

    model = ParallelSequential(Two(), chunks=2).to(device)
    a, b = torch.randn(4, 3, device=device), torch.randn(5, 2, device=device)
    with pytest.raises(ValueError, match=r"same batch size.*input\[0\]: 4, input\[1\]: 5"):
        model((a, b))
    b = torch.randn(4, 2, device=device)
    assert torch.equal(model((a, b)), a + b.sum(1, keepdim=True))


class _FirstRow(nn.Module):
    def forward(self, x):
        return x[:1]


class _BatchToDim1(nn.Module):
    def forward(self, x):
        return x.transpose(0, 1)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_a_middle_stage_changing_the_batch_size_is_named_not_the_last_stage(device: str) -> None:
    # Before: a middle stage keeping one row of each micro-batch was refused as "cannot
    # concatenate the outputs of the last stage 'dec' (index 2)", and told to "make the last
    # stage return per-sample outputs", which 'dec' does: the rows each stage returned were
    # not kept, and the outputs between stages are gone when the join fails.
    torch.manual_seed(0)
    model = ParallelSequential(OrderedDict(enc=nn.Linear(4, 4), bad=_FirstRow(), dec=nn.Linear(4, 4)),
                               chunks=2).to(device)
    x = torch.randn(4, 4, device=device)
    with pytest.raises(ValueError, match=r"stage 'bad' \(index 1\) returned \[1, 1\] rows along dimension 0 for "
                                         r"micro-batches of \[2, 2\] samples.*last stage 'dec' \(index 2\).*"
                                         r"Make stage 'bad' return per-sample outputs, or use chunks=1"):
        model(x)
    model.chunks = 1  # (the whole batch in one: as nn.Sequential, one row)
    assert torch.equal(model(x), nn.Sequential(*model)(x))


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_the_stage_changing_the_batch_size_is_named_past_a_transpose_and_back(device: str) -> None:
    # The batch moved to dimension 1 and back (a sequence-first layer between) changes the
    # rows twice: the stage named is the one from which the last stage's rows were kept. And
    # a last stage changing them itself is named as the last stage.
    torch.manual_seed(0)
    x = torch.randn(6, 3, device=device)
    model = ParallelSequential(_BatchToDim1(), nn.Identity(), _BatchToDim1(), _FirstRow(), nn.ReLU(),
                               chunks=3).to(device)
    with pytest.raises(ValueError, match=r"stage '3' \(index 3\) returned \[1, 1, 1\] rows along dimension 0 "
                                         r"for micro-batches of \[2, 2, 2\] samples"):
        model(x)
    model = ParallelSequential(_BatchToDim1(), nn.Identity(), _BatchToDim1(), _FirstRow(), chunks=3).to(device)
    with pytest.raises(ValueError, match=r"(?s)outputs of the last stage '3' \(index 3\).*Make the last stage return"):
        model(x)
    model[3] = nn.ReLU()  # (the batch back in place: joined, as nn.Sequential's)
    assert torch.equal(model(x), nn.Sequential(*model)(x))


class _Tripled(nn.Module):
    def forward(self, x):
        return x.repeat(3, 1)


def test_the_stage_changing_the_batch_size_is_named_where_a_later_one_changes_them_again() -> None:
    # (Review of the message above.) A stage after the one named may change the rows again (a
    # repeat, a reshape): the message said every stage after it "returned as many", which they
    # did not; it says none returned one row per sample again, which is what was looked at.
    model = ParallelSequential(nn.Linear(4, 4), _FirstRow(), _Tripled(), nn.Linear(4, 4), chunks=2)
    with pytest.raises(ValueError, match=r"stage '1' \(index 1\) returned \[1, 1\] rows along dimension 0 for "
                                         r"micro-batches of \[2, 2\] samples, where one row per sample is "
                                         r"expected: no stage after it returned one row per sample again"):
        model(torch.randn(4, 4))


def test_a_packed_sequence_is_refused_for_what_it_is() -> None:
    # Before (a CPU hunt): "every tensor of the input must have the same batch size ...
    # input.data: 10, input.batch_sizes: 5. Pass tensors of one batch", which cannot be done.
    class Last(nn.Module):
        def forward(self, out_h):
            return out_h[1][-1]

    torch.manual_seed(0)
    padded, lengths = torch.randn(3, 5, 4), torch.tensor([5, 3, 2])
    packed = nn.utils.rnn.pack_padded_sequence(padded, lengths, batch_first=True)
    model = ParallelSequential(nn.GRU(4, 6, batch_first=True), Last(), chunks=2)
    one = nn.utils.rnn.pack_padded_sequence(padded[:1], lengths[:1], batch_first=True)  # (5 rows, 5 counts)
    for given in (packed, (packed,), one):
        with pytest.raises(ValueError, match=r"holds a PackedSequence, whose data has no batch dimension.*chunks=1"):
            model(given)
    model.chunks = 1
    assert torch.equal(model(packed), nn.Sequential(*model)(packed))


def test_a_packed_sequence_returned_by_the_last_stage_is_refused_for_what_it_is() -> None:
    # A last stage returning a PackedSequence (a recurrent layer given one) was joined as any
    # namedtuple of tensors. Its data and counts hold the sequences' time steps, not one row
    # per sample: usually refused as "not batched like the micro-batches (a reduction over the
    # batch, or a reshape ...)", which says nothing of packing; with sequences of one step and
    # chunks equal to the batch, each piece had one row per sample by chance, and the
    # micro-batches' packed sequences and hidden states came back concatenated along dimension
    # 0, silently: batch_sizes [1, 1, 1, 1] for [4], h_n (4, 1, 6) for (1, 4, 6).
    class Pack(nn.Module):
        def forward(self, padded_lengths):
            padded, lengths = padded_lengths
            return nn.utils.rnn.pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)

    torch.manual_seed(0)
    gru = nn.GRU(4, 6, batch_first=True)
    for lengths, chunks in (([3, 1, 2, 2], 2), ([1, 1, 1, 1], 4)):
        given = (torch.randn(4, 3, 4), torch.tensor(lengths))
        model = ParallelSequential(Pack(), gru, chunks=chunks)
        with pytest.raises(ValueError, match=r"(?s)outputs of the last stage '1'.*or use chunks=1.*returned a "
                                             r"PackedSequence \(leaf 0 of the output\), whose data holds the "
                                             r"sequences' time steps.*pad_packed_sequence"):
            model(given)
        model.chunks = 1
        ref = nn.Sequential(*model)(given)
        assert torch.equal(model(given)[0].data, ref[0].data)
    # Passed between stages, it stays each micro-batch's own: the pipeline runs as before.
    class Unpack(nn.Module):
        def forward(self, out_h):
            return nn.utils.rnn.pad_packed_sequence(out_h[0], batch_first=True, total_length=3)[0]

    model = ParallelSequential(Pack(), gru, Unpack(), chunks=2)
    given = (torch.randn(4, 3, 4), torch.tensor([3, 1, 2, 2]))
    torch.testing.assert_close(model(given), nn.Sequential(*model)(given), rtol=RTOL, atol=ATOL)


def test_unbatched_input() -> None:
    model = ParallelSequential(nn.Identity(), chunks=2)
    with pytest.raises(ValueError, match="batched along dimension 0; got Tensor"):
        model(torch.tensor(1.0))
    with pytest.raises(ValueError, match="batched along dimension 0.*or use chunks=1"):
        model((1, 2))
    # One unbatched sample, 1-D, is cut along its features, where nn.Sequential takes it whole:
    # the layer's own error says so. (A 1-D batch, token ids, is cut as any batch.)
    linear = ParallelSequential(nn.Linear(8, 4), chunks=2)
    with pytest.raises(RuntimeError, match=r"stage '0' \(index 0\) on micro-batch 0 of 2 .*the input is 1-D, cut "
                                           r"into micro-batches along its only dimension: if it is one unbatched "
                                           r"sample rather than a batch, use chunks=1"):
        linear(torch.randn(8))
    with pytest.raises(RuntimeError) as e:  # (an empty input runs whole: nothing was cut)
        linear(torch.randn(0))
    assert "1-D" not in str(e.value)
    linear.chunks = 1
    x = torch.randn(8)
    assert torch.equal(linear(x), linear[0](x))
    ids = torch.tensor([1, 2, 3])
    embed = ParallelSequential(nn.Embedding(4, 2), chunks=3)
    assert torch.equal(embed(ids), embed[0](ids))


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_outputs_that_cannot_be_concatenated(device: str) -> None:
    class Total(nn.Module):
        def forward(self, x):
            return x.sum()

    class Ragged(nn.Module):
        def forward(self, x):  # width depends on the micro-batch: pieces disagree in dim 1
            return x[:, : x.shape[0]]

    # (Tensors that do not agree: torch.cat's RuntimeError, as Parallel's join raises it.)
    for last, shapes, kind in ((Total(), r"micro-batch 0: Tensor\(\)", ValueError),
                               (Ragged(), r"micro-batch 0: Tensor\(3, 3\).*micro-batch 2: Tensor\(2, 2\)", RuntimeError)):
        model = ParallelSequential(OrderedDict(enc=nn.Linear(8, 8), head=last), chunks=3).to(device)
        with pytest.raises(kind, match=r"(?s)outputs of the last stage 'head' \(index 1\).*" + shapes):
            model(torch.randn(8, 8, device=device))
        model.chunks = 1  # the whole batch at once: nothing to concatenate
        y = torch.randn(8, 8, device=device)
        assert torch.equal(model(y), nn.Sequential(*model)(y))


def test_non_tensor_outputs_pass_on_only_where_they_are_the_inputs_own() -> None:
    # What a stage computes on a micro-batch need not hold for the whole batch: the batch
    # size (3 on each of 2 micro-batches of 6) was returned as if it were the whole's.
    class Sized(nn.Module):
        def forward(self, x):
            return x, x.shape[0]

    model = ParallelSequential(nn.Linear(4, 4), Sized(), chunks=2)
    x = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"(?s)last stage '1'.*non-tensor values \(3, 3\).*not the input's own"):
        model(x)
    model.chunks = 1
    assert model(x)[1] == 6
    # None, and the input's own values passed on through the stages, are the whole batch's.
    class Tagged(nn.Module):
        def forward(self, pair):
            x, tag = pair
            return x * 2, tag, None

    tag = object()
    y, got, none = ParallelSequential(Tagged(), chunks=3)((x, tag))
    assert torch.equal(y, x * 2) and got is tag and none is None


def test_softmax_refusal_speaks_of_running_statistics_only_for_norms() -> None:
    with pytest.raises(RuntimeError) as info:
        ParallelSequential(nn.Softmax(dim=0), chunks=3)(torch.randn(6, 4))
    assert "running statistics" not in str(info.value)
    with pytest.raises(RuntimeError, match="its running statistics"):
        ParallelSequential(nn.BatchNorm1d(4), chunks=3).train()(torch.randn(6, 4))


@pytest.mark.parametrize("name", ["chunks", "cuda_graph", "forward", "training", "a.b", ""])
def test_stage_names_that_cannot_be_attributes_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=f"ParallelSequential: cannot name a stage {name!r}"):
        ParallelSequential(OrderedDict([("enc", nn.Linear(2, 2)), (name, nn.Identity())]))
    with pytest.raises(TypeError, match=r"ParallelSequential: stage names must be strings, got int"):
        ParallelSequential(OrderedDict([(1, nn.Identity())]))


def test_stages_that_are_classes_or_module_lists_are_refused() -> None:
    with pytest.raises(TypeError, match=r"stage '1' is the class ReLU, not a module; pass an instance"):
        ParallelSequential(nn.Linear(2, 2), nn.ReLU)
    with pytest.raises(TypeError, match=r"stage '0' is a ModuleList, which holds modules but cannot be called"):
        ParallelSequential(nn.ModuleList([nn.ReLU()]))


def test_settings_cannot_be_deleted_and_compile_is_fixed() -> None:
    model = ParallelSequential(nn.Linear(2, 2), chunks=2)
    with pytest.raises(AttributeError, match="ParallelSequential: cannot delete the setting 'chunks'"):
        del model.chunks
    with pytest.raises(AttributeError, match="compile= is fixed when the block is built"):
        model.compile = "inductor"
    x = torch.randn(4, 2)
    assert torch.equal(model(x), model[0](x)) and callable(model.compile)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_exception_in_stage_names_stage_and_piece(device: str) -> None:
    fail = FailOnCall(1)
    model = ParallelSequential(OrderedDict(enc=nn.Linear(8, 8), boom=fail, dec=nn.Linear(8, 4)), chunks=3)
    model = model.to(device)
    x = torch.randn(9, 8, device=device)
    caller = torch.cuda.current_stream() if device == "cuda" else None
    with pytest.raises(KeyError) as info:
        model(x)
    notes = "\n".join(getattr(info.value, "__notes__", [])) + str(info.value)
    assert "stage 'boom' (index 1)" in notes and "micro-batch 1 of 3" in notes and "ParallelSequential" in notes
    if device == "cuda":
        from parallel_modules._streams import _pool

        assert torch.cuda.current_stream() == caller
        assert _pool(torch.device("cuda")).offset == 0
    fail.armed = False
    assert torch.equal(model(x), _pieces_reference(model, x, 3))


def test_input_on_other_device_names_stage() -> None:
    model = ParallelSequential(OrderedDict(enc=nn.Identity(), dec=nn.Linear(4, 4, device="meta")), chunks=2)
    with pytest.raises(RuntimeError, match=r"input is on cpu but stage 'dec' \(index 1\) has parameters on meta"):
        model(torch.randn(4, 4))
    model.chunks = 1
    with pytest.raises(RuntimeError, match="stage 'dec'"):
        model(torch.randn(4, 4))


def test_stages_on_different_devices() -> None:
    model = ParallelSequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"), chunks=2)
    with pytest.raises(RuntimeError, match=r"different devices \(stage '0' on cpu, stage '1' on meta\)"):
        model(torch.randn(4, 4))


# --------------------------------------------------------------- batch mixing
@pytest.mark.parametrize("device", cpu_and_cuda())
def test_batchnorm_training_refused_eval_works(device: str) -> None:
    model = ParallelSequential(
        OrderedDict(enc=nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16)), dec=nn.Linear(16, 2)), chunks=2
    ).to(device)
    x = torch.randn(6, 8, device=device)
    with pytest.raises(RuntimeError, match=r"(?s)stage 'enc' .*'enc\.1' \(BatchNorm1d\).*training mode.*\.eval\(\).*chunks=1.*GroupNorm"):
        model(x)
    stats = model[0][1].running_mean.clone()
    assert torch.equal(model[0][1].running_mean, stats)  # refused before running anything
    model.eval()
    assert torch.equal(model(x), _pieces_reference(model, x, 2))
    torch.testing.assert_close(model(x), nn.Sequential(*model)(x), rtol=RTOL, atol=ATOL)
    model.train()
    model.chunks = 1
    assert torch.equal(model(x).detach(), copy.deepcopy(nn.Sequential(*model))(x).detach())


def test_batchnorm_without_running_stats_refused_in_eval() -> None:
    model = ParallelSequential(nn.BatchNorm1d(4, track_running_stats=False), chunks=2).eval()
    with pytest.raises(RuntimeError, match="batch statistics"):
        model(torch.randn(4, 4))


@pytest.mark.parametrize("compile", ["script", "trace"])
def test_torchscript_norms_refused_in_training_eval_works(compile: str) -> None:
    # Before (a CPU hunt): norm layers were found by their Python class, which a TorchScript
    # module is not: a scripted BatchNorm in training ran on each micro-batch alone, its
    # result and running statistics silently those of the micro-batches.
    torch.manual_seed(0)
    x = torch.randn(8, 4, 3) * 3 + 1
    for norm, why in ((nn.BatchNorm1d(4), "normalizes with batch statistics"),
                      (nn.InstanceNorm1d(4, track_running_stats=True), "averages its running statistics")):
        plain = nn.Sequential(nn.Linear(3, 3), norm)
        stage = torch.jit.script(plain) if compile == "script" else torch.jit.trace(plain, (x,))
        model = ParallelSequential(stage, chunks=2)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        name = type(norm).__name__
        with pytest.raises(RuntimeError, match=rf"(?s)'0\.1' \({name}, TorchScript\), which {why}.*\.eval\(\)"):
            model(x)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        if compile == "trace":  # (a trace keeps the mode it was traced in: traced anew in eval)
            stage = torch.jit.trace(plain.eval(), (x,))
            model = ParallelSequential(stage, chunks=2)
        model.eval()
        torch.testing.assert_close(model(x), stage(x), rtol=RTOL, atol=ATOL)
    unstats = torch.jit.script(nn.InstanceNorm1d(4))  # per sample, without running statistics: runs
    assert torch.equal(ParallelSequential(unstats, chunks=2)(x), unstats(x))
    # Known by the name of its class: a module of the user's of that name says so.
    class BatchNorm1d(nn.Module):
        def forward(self, t):
            return t * 2

    mine = torch.jit.script(BatchNorm1d()) if compile == "script" else torch.jit.trace(BatchNorm1d(), (x,))
    with pytest.raises(RuntimeError, match=r"not a norm layer.*get_submodule\('0'\)\.mixes_batch = False"):
        ParallelSequential(mine, chunks=2)(x)
    mine.mixes_batch = False
    assert torch.equal(ParallelSequential(mine, chunks=2)(x), x * 2)


class _AttendThenRecur(nn.Module):
    r"""Self-attention, then a GRU, both batch-first or both batch-second."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=batch_first)
        self.gru = nn.GRU(4, 4, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(self.attn(x, x, x)[0])[0]


def test_torchscript_softmax_along_the_batch_and_batch_second_layers_refused() -> None:
    # Before (a review): both were found by their Python class, which a scripted module is not:
    # a scripted nn.Softmax(dim=0) normalized each micro-batch on its own, and scripted
    # batch-second attention and GRU read each micro-batch's piece of the sequence, silently.
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    for layer in (nn.Softmax(dim=0), nn.LogSoftmax(dim=0), nn.Softmin(dim=0)):
        name = type(layer).__name__
        with pytest.raises(RuntimeError, match=rf"(?s)stage '0' \(index 0\) contains '0' \({name}, TorchScript\), "
                                               rf"which normalizes along dimension 0.*chunks=1"):
            ParallelSequential(torch.jit.script(layer), chunks=2)(x)
    rows = torch.jit.script(nn.Softmax(dim=1))
    assert torch.equal(ParallelSequential(rows, chunks=2)(x), rows(x))

    seq = torch.randn(6, 5, 4)
    stage = torch.jit.script(_AttendThenRecur(batch_first=False))
    model = ParallelSequential(stage, chunks=2)
    with pytest.raises(RuntimeError, match=r"(?s)contains '0\.attn' \(MultiheadAttention, TorchScript\) with "
                                           r"batch_first=False.*get_submodule\('0\.attn'\)\.mixes_batch = False"):
        model(seq)
    model.get_submodule("0.attn").mixes_batch = False  # (the stage moved the batch: said so)
    with pytest.raises(RuntimeError, match=r"contains '0\.gru' \(GRU, TorchScript\) with batch_first=False"):
        model(seq)
    first = torch.jit.script(_AttendThenRecur(batch_first=True))
    torch.testing.assert_close(ParallelSequential(first, chunks=2)(seq), first(seq), rtol=RTOL, atol=ATOL)

    # Known by the name of its class: a module of the user's of that name says so.
    class Softmax(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dim = 0

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return t * 2

    mine = torch.jit.script(Softmax())
    with pytest.raises(RuntimeError, match=r"not a softmax layer.*get_submodule\('0'\)\.mixes_batch = False"):
        ParallelSequential(mine, chunks=2)(x)
    mine.mixes_batch = False
    assert torch.equal(ParallelSequential(mine, chunks=2)(x), x * 2)


def test_sync_batchnorm_and_declared_mixers_refused() -> None:
    class Mixer(nn.Module):
        mixes_batch = True

        def forward(self, x):
            return x - x.mean(0)

    for mixer in (nn.SyncBatchNorm(4), Mixer()):
        model = ParallelSequential(nn.Identity(), mixer, chunks=2)
        with pytest.raises(RuntimeError, match="mixes samples across the batch"):
            model(torch.randn(4, 4))
    model = ParallelSequential(nn.Identity(), Mixer(), chunks=1)
    x = torch.randn(4, 4)
    assert torch.equal(model(x), x - x.mean(0))
    per_sample = ParallelSequential(nn.GroupNorm(2, 4), nn.LayerNorm(3), nn.InstanceNorm1d(4), chunks=2)
    per_sample(torch.randn(4, 4, 3))


@pytest.mark.parametrize("case", ["declared", "no running stats"])
def test_refusal_advice_that_works(case: str) -> None:
    # .eval() changes nothing for these: the message must not advise it.
    class Mixer(nn.Module):
        mixes_batch = True

        def forward(self, x):
            return x - x.mean(0)

    stage = Mixer() if case == "declared" else nn.BatchNorm1d(4, track_running_stats=False)
    model = ParallelSequential(stage, chunks=2)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="chunks=1") as e:
            model(torch.randn(4, 4))
        assert ".eval()" not in str(e.value)
        model.eval()


def test_instance_norm_with_running_stats_refused_in_training() -> None:
    # Per sample, but its running statistics are averaged over each micro-batch in turn.
    norm = nn.InstanceNorm1d(4, track_running_stats=True)
    model = ParallelSequential(nn.Identity(), norm, chunks=2)
    x = torch.randn(4, 4, 3)
    with pytest.raises(RuntimeError, match=r"(?s)InstanceNorm1d.*running statistics.*track_running_stats=False"):
        model(x)
    assert torch.equal(norm.running_mean, torch.zeros(4))  # refused before running anything
    model.eval()
    assert torch.equal(model(x), _pieces_reference(model, x, 2))
    ParallelSequential(nn.InstanceNorm1d(4), chunks=2)(x)  # without running statistics: per sample


def test_batchnorm_deleted_below_a_stage_as_advised_is_not_refused_again() -> None:
    # ``del`` below a stage registers nothing: the refusal looks at the stages again before it is made.
    model = ParallelSequential(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Linear(4, 2), chunks=2)
    x = torch.randn(6, 4)
    with pytest.raises(RuntimeError, match="BatchNorm1d"):
        model(x)
    del model[0][1]
    torch.testing.assert_close(model(x), nn.Sequential(*model)(x), rtol=RTOL, atol=ATOL)


def test_declared_mixers_do_not_replan_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only a refusal looks at the stages again (see the test above): ordinary calls reuse the plan.
    gru = nn.GRU(8, 8)
    gru.mixes_batch = False  # the advice for a batch-second module that its stage feeds batch-second

    class BatchSecond(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = gru

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gru(x.transpose(0, 1))[0].transpose(0, 1)

    model = ParallelSequential(nn.Linear(8, 8), BatchSecond(), chunks=2)
    x = torch.randn(4, 5, 8)
    model(x)
    plans = []
    make_plan = ParallelSequential._make_plan
    monkeypatch.setattr(ParallelSequential, "_make_plan", lambda self: plans.append(1) or make_plan(self))
    for _ in range(3):
        model(x)
    assert plans == []


def test_a_batch_norm_inserted_into_a_sequential_stage_is_refused() -> None:
    # Before: ``nn.Sequential.insert`` of a layer built before the first call registers nothing:
    # the pipeline kept the plan made from the old layers and micro-batched the training
    # BatchNorm, each micro-batch normalized with its own statistics.
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4)
    model = ParallelSequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 2), chunks=2)
    x = torch.randn(6, 4)
    for _ in range(3):
        model(x)
    model[0].insert(1, norm)
    with pytest.raises(RuntimeError, match=r"contains '0\.1' \(BatchNorm1d\).*training mode"):
        model(x)
    norm.eval()
    torch.testing.assert_close(model(x), _pieces_reference(model, x, 2))


class _Stage(nn.Sequential):
    r"""A ``Sequential`` whose own ``insert`` writes its dict of children, calling none of torch's methods."""

    def insert(self, index: int, module: nn.Module) -> "_Stage":
        layers = list(self._modules.values())
        layers.insert(index, module)
        self._modules.clear()
        self._modules.update((str(i), layer) for i, layer in enumerate(layers))
        return self


@pytest.mark.parametrize("how", ["written", "subclass insert"])
def test_a_layer_written_into_a_dict_of_children_is_seen(how: str) -> None:
    # Before: a layer written straight into a ``_modules`` dict registers nothing (as
    # torch.ao.quantization.convert and torch.fx-style passes swap layers, or a container
    # subclass's own ``insert``), nor does building a layer without tensors or one built before
    # the first call: the pipeline kept the plan made from the old layers and micro-batched the
    # softmax over the batch, or the training BatchNorm, silently.
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4)
    model = ParallelSequential(_Stage(nn.Linear(4, 4)), nn.Linear(4, 2), chunks=2)
    x = torch.randn(6, 4)
    for _ in range(3):
        model(x)
    if how == "written":
        model[0]._modules["1"] = nn.Softmax(dim=0)
        refused = r"contains '0\.1' \(Softmax\).*across the batch"
    else:
        model[0].insert(1, norm)
        refused = r"contains '0\.1' \(BatchNorm1d\).*training mode"
    with pytest.raises(RuntimeError, match=refused):
        model(x)
    if how == "written":
        model[0]._modules["1"] = nn.Softmax(dim=1)
    else:
        norm.eval()
    torch.testing.assert_close(model(x), _pieces_reference(model, x, 2))


@pytest.mark.parametrize("anew", [False, True], ids=["own dict", "dict given anew"])
def test_a_stage_written_into_the_pipelines_dict_of_stages_clears_its_graphs(anew, monkeypatch) -> None:
    # Before (reviews of session 78): the tree stopped holding the pipeline to break a reference
    # cycle, and with it the pipeline's own ``_modules`` dict: a stage without tensors written into
    # it (``pipe._modules["1"] = nn.Tanh()``) registers nothing, and the pipeline kept what it had
    # learnt, its CUDA graphs replaying the old stage (see test_pipeline_cuda). Nor was a dict of
    # stages given anew (``pipe._modules = OrderedDict(pipe._modules)``: the same stages, so no
    # member of the tree changed) watched: the tree kept the old one. On the CPU the graph cache is
    # cleared all the same: that is what is watched here.
    model = ParallelSequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), chunks=2)
    x = torch.randn(4, 4)
    if anew:
        model._modules = OrderedDict(model._modules)
    for _ in range(3):  # (the tree taken as settled: later calls walk nothing)
        model(x)
    cleared = []
    clear = type(model._graphs).clear
    monkeypatch.setattr(type(model._graphs), "clear", lambda graphs: (cleared.append(graphs), clear(graphs))[1])
    graphs = model._graphs
    model._modules["1"] = nn.Tanh()
    torch.testing.assert_close(model(x), _pieces_reference(model, x, 2), rtol=0, atol=0)
    assert graphs in cleared


class _EachOf(nn.Module):
    r"""Runs the layers of its ``nn.ModuleDict`` in turn."""

    def __init__(self, **layers: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


@pytest.mark.parametrize("edit", ["pop", "clear"])
def test_a_batch_norm_taken_out_of_a_module_dict_is_no_longer_refused(edit: str) -> None:
    # ``nn.ModuleDict``'s pop and clear register nothing: the plan made with the training
    # BatchNorm went on refusing the stage without it.
    model = ParallelSequential(_EachOf(lin=nn.Linear(4, 4), norm=nn.BatchNorm1d(4)), chunks=2)
    x = torch.randn(6, 4)
    with pytest.raises(RuntimeError, match=r"BatchNorm1d.*training mode"):
        model(x)
    if edit == "pop":
        model[0].layers.pop("norm")
    else:
        model[0].layers.clear()
    torch.testing.assert_close(model(x), _pieces_reference(model, x, 2))


@pytest.mark.parametrize("inner", ["Parallel", "ParallelSequential"])
def test_a_batch_norm_inserted_into_a_block_below_a_stage_is_refused(inner: str) -> None:
    # Before (a CPU hunt): a block's own insert (and del) writes its dict of children, which
    # registers nothing; the block forgot what it had learnt, but a pipeline whose stage it is
    # kept the plan made from the old children, and micro-batched the training BatchNorm
    # (built before the first call, so building it registered nothing either) that a fresh
    # pipeline refuses: each micro-batch normalized with its own statistics, silently.
    torch.manual_seed(0)
    norm = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    block = (Parallel(nn.Linear(4, 4), nn.Linear(4, 4), join="sum") if inner == "Parallel"
             else ParallelSequential(nn.Linear(4, 4)))
    model = ParallelSequential(block, nn.Linear(4, 2), chunks=2)
    x = torch.randn(6, 4)
    model(x)
    block.insert(1, norm)
    with pytest.raises(RuntimeError, match=r"contains '0\.1\.1' \(BatchNorm1d\).*training mode"):
        model(x)
    with pytest.raises(RuntimeError, match=r"contains '0\.1\.1' \(BatchNorm1d\).*training mode"):
        ParallelSequential(*copy.deepcopy(list(model)), chunks=2)(x)  # as a fresh pipeline refuses it
    norm.eval()
    torch.testing.assert_close(model(x), _pieces_reference(model, x, 2))


def test_pieces_copied_to_the_gpu_are_views() -> None:
    # Recording autograd, pieces get memory of their own -- except those the copy lane copies anyway:
    # a clone of a pinned input would be pageable, and its copy synchronous.
    model = ParallelSequential(nn.Linear(4, 4), chunks=2)
    x = torch.randn(4, 4)
    views = [x.data_ptr(), x[2:].data_ptr()]
    assert not {p.data_ptr() for p in model._split(x, model.chunks)} & set(views)
    assert [p.data_ptr() for p in model._split(x, model.chunks, copied=True)] == views


def test_fx_symbolic_trace_with_chunks() -> None:
    # FX traces proxies, which cannot be cut into micro-batches: the graph runs the stages on the whole batch.
    model = nn.Sequential(nn.Identity(), ParallelSequential(*_stages(), chunks=3))
    traced = torch.fx.symbolic_trace(model)
    x = torch.randn(7, 16)
    torch.testing.assert_close(traced(x), model(x), rtol=RTOL, atol=ATOL)


def test_appended_batchnorm_is_seen() -> None:
    model = ParallelSequential(nn.Linear(4, 4), chunks=2)
    model(torch.randn(4, 4))
    model.append(nn.BatchNorm1d(4))
    with pytest.raises(RuntimeError, match="BatchNorm1d"):
        model(torch.randn(4, 4))
    model[1] = nn.LayerNorm(4)
    model(torch.randn(4, 4))
    # Below a stage too: appended into it, then replaced as the error advises.
    model = ParallelSequential(nn.Sequential(nn.Linear(4, 4)), chunks=2)
    model(torch.randn(4, 4))
    model[0].append(nn.BatchNorm1d(4))
    with pytest.raises(RuntimeError, match=r"'0\.1' \(BatchNorm1d\)"):
        model(torch.randn(4, 4))
    model[0][1] = nn.LayerNorm(4)
    model(torch.randn(4, 4))


@pytest.mark.parametrize("module", ["lstm", "gru", "attention", "encoder layer"])
def test_batch_second_modules_refused_with_chunks(module: str) -> None:
    # batch_first=False reads dimension 0 as the sequence: split along it, the micro-batches
    # would cut every sequence, and the result differ silently from the whole batch's.
    def make(batch_first: bool) -> nn.Module:
        if module == "lstm":
            return nn.LSTM(4, 4, batch_first=batch_first)
        if module == "gru":
            return nn.GRU(4, 4, batch_first=batch_first)
        if module == "attention":
            return nn.MultiheadAttention(4, 2, batch_first=batch_first)
        return nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=batch_first)

    class First(nn.Module):  # the first output of a module returning a tuple
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            out = self.inner(x, x, x) if isinstance(self.inner, nn.MultiheadAttention) else self.inner(x)
            return out[0] if isinstance(out, tuple) else out

    torch.manual_seed(0)
    x = torch.randn(6, 5, 4)
    model = ParallelSequential(nn.Identity(), First(make(False)).eval(), chunks=2)
    with pytest.raises(RuntimeError, match=r"stage '1' \(index 1\) contains '1\.inner(\.self_attn)?' .*batch_first=False"):
        model(x)
    for m in model[1].modules():  # "this stage moves the batch to dimension 1 itself": allowed
        if hasattr(m, "batch_first"):
            m.mixes_batch = False
    model(x)
    model = ParallelSequential(nn.Identity(), First(make(True)).eval(), chunks=2)
    with torch.no_grad():
        assert torch.allclose(model(x), nn.Sequential(*model)(x), rtol=RTOL, atol=ATOL)
        # Before (a CPU hunt): a batch-first layer given 2-D inputs reads one unbatched sequence,
        # which micro-batches cut: silently off (0.2 for a GRU), where a last stage returning
        # such a layer's hidden states was refused.
        model = ParallelSequential(First(make(True)).eval(), nn.Linear(4, 2), chunks=2)
        with pytest.raises(RuntimeError, match=r"(?s)stage '0' \(index 0\) contains '0\.inner(\.self_attn)?' "
                                               r"\(\w+, batch_first=True\), given a 2-D input \(3, 4\).*unbatched "
                                               r"sequence.*chunks=1"):
            model(x[:, 0])
        assert torch.allclose(model(x), nn.Sequential(*model)(x), rtol=RTOL, atol=ATOL)  # (and it still works)
        model.chunks = 1
        assert torch.allclose(model(x[:, 0]), nn.Sequential(*model)(x[:, 0]), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("module", ["gru", "attention"])
def test_batch_first_set_to_false_after_the_first_call_is_refused(module: str) -> None:
    # Before (a CPU hunt): which layers mix samples was planned at the first call, a sequence
    # layer by its batch_first then; set to False in place later (which registers nothing), it
    # read each micro-batch as a shorter sequence, silently, where a fresh pipeline refuses it.
    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.GRU(4, 4, batch_first=True) if module == "gru" else nn.MultiheadAttention(
                4, 2, batch_first=True)

        def forward(self, x):
            return (self.inner(x, x, x) if module == "attention" else self.inner(x))[0]

    torch.manual_seed(0)
    model = ParallelSequential(nn.Linear(4, 4), First().eval(), chunks=2)
    x = torch.randn(6, 5, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), nn.Sequential(*model)(x), rtol=RTOL, atol=ATOL)
        model[1].inner.batch_first = False
        with pytest.raises(RuntimeError, match=r"stage '1' \(index 1\) contains '1\.inner' .*batch_first=False"):
            model(x)
        with pytest.raises(RuntimeError, match=r"stage '1' \(index 1\) contains '1\.inner' .*batch_first=False"):
            ParallelSequential(*copy.deepcopy(list(model)), chunks=2)(x)  # as a fresh pipeline refuses it
        model[1].inner.mixes_batch = False  # the advice: "it reads batch-second inputs after all"
        model(x)


class _PerSample(nn.Module):
    r"""A batch-first GRU run on each sample's own sequence, one at a time (2-D inputs that are not micro-batches)."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 6, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.gru(seq)[1][-1] for seq in x])


def test_a_sequence_layer_run_on_each_sample_is_not_refused() -> None:
    # A review of the unbatched-input refusal, which refused any 2-D input to such a layer.
    torch.manual_seed(0)
    model = ParallelSequential(_PerSample(), chunks=2)
    x = torch.randn(8, 5, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model[0](x))


class _Gru(nn.Module):
    r"""A batch-first ``GRU(4, 4)`` returning its outputs alone."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x)[0]


def test_a_failure_while_hooking_the_sequence_layers_leaves_no_hook_on_them() -> None:
    # The refusal's pre-hooks were registered before its ``try``: one failing (an interrupt
    # between two) left the ones before it on the user's layers, checking every later call.
    torch.manual_seed(0)
    model = ParallelSequential(_Gru(), _Gru(), chunks=2)
    first, second = model[0].gru, model[1].gru

    def failing(*args, **kwargs):
        raise KeyboardInterrupt

    second.register_forward_pre_hook = failing  # (an instance attribute: only this layer's)
    x = torch.randn(6, 5, 4)
    with torch.no_grad():
        with pytest.raises(KeyboardInterrupt):
            model(x)
        assert not first._forward_pre_hooks and not second._forward_pre_hooks
        del second.register_forward_pre_hook
        torch.testing.assert_close(model(x), nn.Sequential(*model)(x), rtol=RTOL, atol=ATOL)


def test_in_place_first_operation_under_autograd() -> None:
    # Micro-batches of one input share its version counter as views: an in-place first
    # operation on one would spoil what it saved for backward on another.
    torch.manual_seed(0)
    stages = [nn.ReLU(inplace=True), nn.Linear(4, 2)]
    a = torch.randn(6, 4, requires_grad=True)
    model = ParallelSequential(*stages, chunks=3)
    model(a * 2).square().sum().backward()
    grad, a.grad = a.grad, None
    nn.Sequential(*stages)(a * 2).square().sum().backward()
    assert torch.allclose(grad, a.grad, rtol=RTOL, atol=ATOL)


class _Doubles(nn.Module):
    r"""Doubles its input in place (not idempotent, as ``nn.ReLU(inplace=True)`` is)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


def test_a_first_stage_writing_an_input_leaf_that_requires_grad_raises_as_in_nn_sequential() -> None:
    # Before (a CPU hunt): each micro-batch of an input was copied while autograd recorded, so a
    # first stage writing its input in place wrote a copy of a leaf that requires grad, where
    # nn.Sequential (and chunks=1) raise. Under torch.utils.checkpoint(use_reentrant=True) that
    # hid wrong gradients: its forward runs without autograd, on the caller's tensor, which the
    # stage writes (as nn.Sequential's does); its recomputation, from a detached leaf of that
    # written tensor, then wrote a copy again, and the gradients were those of another input.
    torch.manual_seed(0)
    stages = [nn.Sequential(_Doubles(), nn.Linear(4, 3)), nn.Linear(3, 2)]
    x = torch.randn(6, 4, requires_grad=True)
    for model in (nn.Sequential(*stages), ParallelSequential(*stages), ParallelSequential(*stages, chunks=3)):
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad is being used in an in-place"):
            model(x)
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad is being used in an in-place"):
            torch.utils.checkpoint.checkpoint(model, x * 1, use_reentrant=True).sum().backward()
    # An input that is no leaf is the caller's to have written, as in nn.Sequential; while autograd
    # records, each micro-batch writes a copy of its own (the caller's is left as it was).
    torch.testing.assert_close(ParallelSequential(*stages, chunks=3)(x * 1), nn.Sequential(*stages)(x * 1))


@pytest.mark.parametrize("view", ["slice", "transposed", "expanded", "parameter"])
def test_a_first_stage_writing_a_view_of_an_input_leaf_that_requires_grad_raises_as_in_nn_sequential(view) -> None:
    # Before (a CPU hunt): only the leaf itself was handed on uncopied, so a view of it (a slice,
    # ``w.t()``, a Parameter's ``.view()``) was copied piece by piece while autograd recorded, and a
    # first stage writing it in place ran where nn.Sequential (and chunks=1) raise.
    torch.manual_seed(0)
    make = {"slice": lambda leaf: leaf[:, :4], "transposed": lambda leaf: leaf.t(),
            "expanded": lambda leaf: leaf[:1, :4].expand(6, 4), "parameter": lambda leaf: leaf.view(6, 4)}[view]
    leaf = (nn.Parameter(torch.randn(24)) if view == "parameter" else
            torch.randn(4, 6, requires_grad=True) if view == "transposed" else torch.randn(6, 5, requires_grad=True))
    stages = [nn.Sequential(_Doubles(), nn.Linear(4, 3)), nn.Linear(3, 2)]
    for model in (nn.Sequential(*stages), ParallelSequential(*stages), ParallelSequential(*stages, chunks=3)):
        with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad is being used in an in"):
            model(make(leaf))
    # Read only, the view's pieces give nn.Sequential's gradients.
    stages[0][0] = nn.Identity()
    grads = []
    for model in (nn.Sequential(*stages), ParallelSequential(*stages, chunks=3)):
        leaf.grad = None
        model(make(leaf)).square().sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("first", ["leaf", "view"])
def test_a_first_stage_writing_an_input_leaf_another_input_tensor_views_raises_as_in_nn_sequential(first) -> None:
    # Before (a CPU hunt): input tensors that are views of one another, ``(w, w[:, :2])``, are copied
    # together while autograd records (so that a write to one shows in the other), and that copy was
    # made of a leaf that requires grad too: a stage writing it ran where nn.Sequential raises.
    torch.manual_seed(0)
    stage = _MaybeWritesOneReadsTheOther()
    pipe = ParallelSequential(stage, chunks=3)
    leaf = torch.randn(6, 4 if first == "leaf" else 5, requires_grad=True)
    make = (lambda: (leaf, leaf[:, :4])) if first == "leaf" else (lambda: (leaf[:, :4], leaf[:, 1:]))
    for model in (nn.Sequential(stage), pipe):
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad is being used in an in-place"):
            model(make())
    # Read only, they give nn.Sequential's gradients.
    stage.writes = False
    grads = []
    for model in (nn.Sequential(stage), pipe):
        leaf.grad = None
        model(make()).square().sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=RTOL, atol=ATOL)


def test_a_stage_writing_a_detached_view_of_an_input_leaf_that_requires_grad_is_refused_saying_why() -> None:
    # ``(leaf.detach(), leaf)``: nn.Sequential writes the leaf's memory through the detached tensor,
    # which autograd allows. While autograd records the pipeline hands the leaf on uncopied (no stage
    # may write it) and copies the other, so a write to that copy would not show in the leaf: refused
    # (before the leaf was kept uncopied, both were copied together). Before: the error blamed "a
    # layout that no one tensor holds with the batch along dimension 0" and said both were copies.
    torch.manual_seed(0)
    stage = _MaybeWritesOneReadsTheOther()
    leaf = torch.randn(6, 4, requires_grad=True)
    nn.Sequential(stage)((leaf.detach(), leaf)).sum().backward()  # (runs)
    with pytest.raises(RuntimeError, match=r"stage '0' \(index 0\) wrote in place on micro-batch 0 of 3 into "
                                           r"input\[0\] and input\[1\] .*input\[1\], a leaf that requires grad "
                                           r"\(or a view of one\), is handed on uncopied.*\.clone\(\) one of them"):
        ParallelSequential(stage, chunks=3)((leaf.detach(), leaf))


def test_errors_name_the_stage_with_one_chunk() -> None:
    model = ParallelSequential(OrderedDict(enc=nn.Linear(4, 4), dec=nn.Linear(5, 2)))
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(6, 4))
    assert "stage 'dec' (index 1) of ParallelSequential" in "\n".join(getattr(info.value, "__notes__", [])) + str(info.value)
    model.dec = nn.Linear(4, 2)
    assert model(torch.randn(6, 4)).shape == (6, 2)


def test_empty_slices_and_empty_batches() -> None:
    model = ParallelSequential(nn.Linear(4, 4), nn.Linear(4, 2), chunks=2)
    empty = model[2:]  # as nn.Sequential's: an empty container, the identity
    assert type(empty) is ParallelSequential and len(empty) == 0 and empty.chunks == 2
    x = torch.randn(4, 4)
    assert torch.equal(empty(x), x)
    assert len(model.pop(slice(2, 2))) == 0 and len(model) == 2
    # An empty batch has no micro-batches to make: it runs whole, as nn.Sequential runs it.
    y = model(torch.randn(0, 4))
    assert y.shape == (0, 2)


def test_none_and_scalars_in_structures() -> None:
    class Scaled(nn.Module):
        def forward(self, inputs):
            x, temperature = inputs
            return x / temperature, None  # a last stage returning (output, None), as attention does

    model = ParallelSequential(Scaled(), chunks=3)
    x, t = torch.randn(6, 4), torch.tensor(2.0)
    out, nothing = model((x, t))  # the 0-dim temperature goes to every micro-batch
    assert nothing is None and torch.equal(out, x / t)


def test_dicts_of_one_keys_in_another_order_concatenate() -> None:
    # Before (a CPU hunt): refused as "different structures", where nn.Sequential returns the
    # dict and Parallel's joins accept the same keys in another order.
    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            y = self.lin(x)
            return {"a": y, "b": 2 * y} if x.shape[0] % 2 else {"b": 2 * y, "a": y}

    torch.manual_seed(0)
    model = ParallelSequential(Heads(), chunks=2)
    x = torch.randn(9, 8)  # micro-batches of 5 and 4 rows: keys a, b then b, a
    out = model(x)
    assert list(out) == ["a", "b"]  # (the first micro-batch's order)
    assert torch.equal(out["a"], torch.cat([model[0].lin(x[:5]), model[0].lin(x[5:])]))
    assert torch.equal(out["b"], 2 * out["a"])
    with pytest.raises(ValueError, match="different structures"):
        ParallelSequential(nn.Identity(), _KeysBySize(), chunks=2)(x)


class _HeadsInANamedTuple(nn.Module):
    r"""Returns ``_Heads(x, {"a": x, "b": 2 * x})``, the dict's keys in the order of the batch's parity
    (the other order where ``flip``)."""

    def __init__(self, flip: bool = False) -> None:
        super().__init__()
        self.flip = flip

    def forward(self, x: torch.Tensor) -> Any:
        return _Heads(x, {"a": x, "b": 2 * x} if (x.shape[0] % 2) != self.flip else {"b": 2 * x, "a": x})


class _Heads(NamedTuple):
    y: torch.Tensor
    aux: dict


def test_dicts_of_one_keys_in_another_order_concatenate_inside_a_namedtuple() -> None:
    # Before (a CPU hunt): refused as "different structures" inside a namedtuple, where the
    # same dicts inside a plain tuple were put in one order and concatenated.
    x = torch.randn(9, 8)  # micro-batches of 5 and 4 rows: keys a, b then b, a
    out = ParallelSequential(_HeadsInANamedTuple(), chunks=2)(x)
    assert type(out) is _Heads and list(out.aux) == ["a", "b"]  # (the first micro-batch's order)
    assert torch.equal(out.y, x) and torch.equal(out.aux["a"], x) and torch.equal(out.aux["b"], 2 * x)
    # Parallel's joins alike, whose branches return the keys in other orders.
    joined = Parallel(_HeadsInANamedTuple(), _HeadsInANamedTuple(flip=True), join="sum")(x)
    assert list(joined.aux) == ["a", "b"] and torch.equal(joined.aux["b"], 4 * x)


class _KeysBySize(nn.Module):
    def forward(self, x):  # other keys for each micro-batch size: no order makes them one structure
        return {"five" if x.shape[0] == 5 else "four": x}


# -------------------------------------------------------------------- tracing
def test_compile_and_export_match_eager() -> None:
    model = ParallelSequential(*_stages(), chunks=3).eval()
    x = torch.randn(13, 16)
    expected = model(x)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), expected)
    exported = torch.export.export(model, (x,))
    assert torch.equal(exported.module()(x), expected)


@pytest.mark.parametrize("how", ["compile", "compile fullgraph", "strict export", "export"])
def test_a_traced_pipeline_names_the_stage_changing_the_batch_size(how: str) -> None:
    # The rows are kept under a compiler too (ints in a list, nothing in the graph), and on the
    # code it runs after a graph break, where the trace's ``tracing`` is stale. (torch.jit.trace
    # keeps none: each size read would be recorded in its graph. It names the last stage.)
    model = ParallelSequential(OrderedDict(enc=nn.Linear(4, 4), bad=_FirstRow(), dec=nn.Linear(4, 4)), chunks=2)
    x = torch.randn(4, 4)
    # (dynamic=False: recompiled with a dynamic batch size, as after another pipeline's compile of
    # another batch size, the stages run on the whole batch, as nn.Sequential, which is not refused.)
    run = {"compile": lambda: torch.compile(model, backend="eager", dynamic=False)(x),
           "compile fullgraph": lambda: torch.compile(model, backend="eager", fullgraph=True, dynamic=False)(x),
           "strict export": lambda: torch.export.export(model, (x,), strict=True),
           "export": lambda: torch.export.export(model, (x,), strict=False)}[how]
    # (Under fullgraph=True, Dynamo's "Observed exception" carrying the library's message, by its
    # repr: quotes escaped where it holds both kinds.)
    with pytest.raises(Exception, match=r"stage \\?'bad\\?' \(index 1\) returned \[1, 1\] rows along dimension 0"):
        run()


# ------------------------------------------------------------- the last lane's concatenation
def test_gather_concatenates_like_cat_or_declines():
    from parallel_modules.pipeline import _Gather

    pieces = [torch.randn(5, 3), torch.randn(4, 3), torch.randn(4, 3)]
    gather = _Gather([5, 4, 4], torch.device("cpu"))
    for m, p in enumerate(pieces):
        assert not gather.complete()
        gather.add(m, p)
    assert gather.complete() and torch.equal(gather.out, torch.cat(pieces))
    # What torch.cat would give differently, or autograd would record: left to the caller's cat.
    wrong = {
        "size along dim 0": [torch.randn(5, 3), torch.randn(3, 3), torch.randn(4, 3)],
        "other dims": [torch.randn(5, 3), torch.randn(4, 2), torch.randn(4, 3)],
        "dtype": [torch.randn(5, 3), torch.randn(4, 3).double(), torch.randn(4, 3)],
        "layout": [torch.randn(3, 5).t(), torch.randn(4, 3), torch.randn(4, 3)],
        "structure": [(torch.randn(5, 3),), (torch.randn(4, 3),), (torch.randn(4, 3),)],
        "autograd": [torch.randn(5, 3, requires_grad=True), torch.randn(4, 3), torch.randn(4, 3)],
        # Contiguous and channels-last at once: torch.cat may give channels-last strides.
        "ambiguous layout": [torch.randn(5, 3, 1, 1), torch.randn(4, 3, 1, 1), torch.randn(4, 3, 1, 1)],
        "sparse": [torch.randn(5, 3).to_sparse(), torch.randn(4, 3).to_sparse(), torch.randn(4, 3).to_sparse()],
        "device": [torch.randn(5, 3), torch.randn(4, 3, device="meta"), torch.randn(4, 3)],
    }
    for what, outputs in wrong.items():
        gather = _Gather([5, 4, 4], torch.device("cpu"))
        for m, o in enumerate(outputs):
            gather.add(m, o)
        assert not gather.complete(), what
    single = _Gather([5], torch.device("cpu"))
    single.add(0, torch.randn(5, 3))
    assert not single.complete()  # one piece: nothing to concatenate


def test_gather_restores_pieces_taken_before_it_gave_up() -> None:
    from parallel_modules.pipeline import _Gather

    pieces = list(torch.randn(13, 4).tensor_split(3))
    gather = _Gather([p.shape[0] for p in pieces], torch.device("cpu"))
    values: list = list(pieces)
    assert gather.add(0, values[0])
    values[0] = None
    assert not gather.add(1, values[1].t().contiguous().t())  # not contiguous: gather gives up
    assert not gather.add(2, values[2]) and not gather.complete()
    gather.restore(values)
    assert all(torch.equal(v, p) for v, p in zip(values, pieces))


def test_gather_leaves_a_later_subclass_piece_and_a_none_output_to_the_concatenation() -> None:
    from parallel_modules.pipeline import _Gather

    class Tagged(torch.Tensor):
        pass

    # torch.cat of a plain piece and a subclass piece gives the subclass; copied into a
    # plain result, the later piece's class would be lost.
    pieces = [torch.randn(2, 3), torch.randn(2, 3).as_subclass(Tagged)]
    gather = _Gather([2, 2], torch.device("cpu"))
    values: list = list(pieces)
    for m in range(2):
        if gather.add(m, values[m]):
            values[m] = None
    assert not gather.complete()
    gather.restore(values)
    assert type(torch.cat(values)) is Tagged and torch.equal(torch.cat(values), torch.cat(pieces))
    # All pieces of the subclass: gathered as torch.cat gathers them.
    gather = _Gather([2, 2], torch.device("cpu"))
    tagged = [torch.randn(2, 3).as_subclass(Tagged) for _ in range(2)]
    assert all(gather.add(m, t) for m, t in enumerate(tagged)) and gather.complete()
    assert type(gather.out) is Tagged and torch.equal(gather.out, torch.cat(tagged))
    # A stage that returns None for a later micro-batch: restore gives back only the pieces
    # taken, so the concatenation sees the None (and refuses it) rather than a slice of the
    # result that was never written.
    gather = _Gather([2, 2], torch.device("cpu"))
    values = [torch.ones(2, 3), None]
    assert gather.add(0, values[0])
    values[0] = None
    assert not gather.add(1, values[1]) and not gather.complete()
    gather.restore(values)
    assert torch.equal(values[0], torch.ones(2, 3)) and values[1] is None


def test_gather_declines_the_first_piece_again_and_gives_it_back_as_itself() -> None:
    from parallel_modules.pipeline import _Gather

    # A last stage returning its parameter gives the same tensor for every micro-batch,
    # which the concatenation returns as it is: not gathered as if batched.
    q = torch.randn(2, 3)
    gather = _Gather([2, 2], torch.device("cpu"))
    values: list = [q, q]
    assert gather.add(0, values[0])
    values[0] = None
    assert not gather.add(1, values[1]) and not gather.complete()
    gather.restore(values)
    assert values[0] is q and values[1] is q


@pytest.mark.parametrize("wrap", [False, True])
def test_the_same_tensor_from_every_micro_batch_is_returned_as_it_is(wrap: bool) -> None:
    # Before: bare, it was concatenated ((6, 5) where nn.Sequential gives (3, 5)), while
    # the same tensor inside a tuple was returned as it is.
    stage = Queries(3, 5)  # (3 rows: as many as a micro-batch of 6 in 2)
    pipe = ParallelSequential(nn.Sequential(stage, _Wrap()) if wrap else stage, chunks=2)
    x = torch.randn(6, 4)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            out = pipe(x)
        got = out[0] if wrap else out
        assert got is stage.q


class _OutBuffer(nn.Module):
    r"""Writes each call's result into one buffer (``out=``) and returns it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.empty(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buf.resize_(x.shape)
        return torch.mul(x, 2, out=self.buf)


class _Constant(nn.Module):
    r"""Returns ``(x, mask)``, one constant buffer."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(rows, 3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.mask


@pytest.mark.parametrize("batch", [10, 9], ids=["even", "uneven"])
@pytest.mark.parametrize("wrap", [False, True])
def test_one_tensor_written_again_for_each_micro_batch_is_refused(batch, wrap) -> None:
    # Before: returned as it is, as a parameter would be: the last micro-batch's rows ((5, 4)
    # where nn.Sequential gives (10, 4)), silently.
    last = nn.Sequential(_OutBuffer(), _Wrap()) if wrap else _OutBuffer()
    model = ParallelSequential(nn.Identity(), last, chunks=2)
    with torch.no_grad(), pytest.raises(
            ValueError, match=r"(?s)cannot concatenate the outputs of the last stage '1'.*every micro-batch returned "
                              r"one tensor object \(leaf 0 of the output, \([45], 4\)\), written again since micro-batch 0.*clone"):
        model(torch.randn(batch, 4))
    x = torch.randn(batch, 4)  # (and the module still works)
    torch.testing.assert_close(ParallelSequential(nn.Identity(), nn.Identity(), chunks=2)(x), x, rtol=0, atol=0)
    # One returned unchanged, whatever its rows, is returned as it is: a parameter, a constant
    # buffer, a parameter swapped in by functional_call.
    rows = ParallelSequential(Queries(5, 4), chunks=2)
    assert rows(torch.randn(10, 4)) is rows[0].q
    constant = ParallelSequential(_Constant(5), chunks=2)
    assert constant(torch.randn(10, 4))[1] is constant[0].mask
    swapped = {k: v.detach().clone() for k, v in rows.named_parameters()}
    assert torch.func.functional_call(rows, swapped, (torch.randn(10, 4),)) is swapped["0.q"]
    # And one written again but not batched -- a running total, the same summed per micro-batch
    # as over the whole batch -- as well (a review of the first draft, which refused it).
    total = ParallelSequential(nn.Identity(), _Total(), chunks=2)
    out, sums = total(torch.ones(10, 4))
    assert out.shape == (10, 4) and sums is total[1].total and sums.item() == 40.0
    # A buffer written in part, whatever its rows (a review of the second draft, which looked
    # for as many rows as a micro-batch), is refused.
    with pytest.raises(ValueError, match=r"leaf 1 of the output, \(16, 4\)\), written again since micro-batch 0"):
        ParallelSequential(nn.Identity(), _PartlyWritten(), chunks=2)(torch.randn(10, 4))


class _PositionsSliced(nn.Module):
    r"""Returns ``(x, pos)`` with a new view of its positional table for each call: ``self.pos[:, :T]``."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 16, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.pos[:, : x.shape[1]]


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("bare", [False, True])
def test_one_view_of_a_buffer_from_every_micro_batch_is_returned_as_nn_sequential_does(device, bare) -> None:
    # Before (a CPU hunt): each micro-batch's new view of the same elements was taken for its
    # rows, and refused as not batched ([1, 1] rows for micro-batches of [2, 2] samples), where
    # nn.Sequential returns the one view.
    stage = _PositionsSliced()
    last = nn.Sequential(stage, _Second()) if bare else stage
    pipe = ParallelSequential(nn.Linear(4, 4), last, chunks=2).to(device)
    ref = nn.Sequential(*pipe)
    x = torch.randn(4, 6, 4, device=device)
    out, expected = pipe(x), ref(x)
    got, want = (out, expected) if bare else (out[1], expected[1])
    assert got.shape == (1, 6, 4) and got.data_ptr() == stage.pos.data_ptr()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Its gradient reaches the table once, as nn.Sequential's does.
    (got * 2).sum().backward()
    torch.testing.assert_close(stage.pos.grad[:, :6], torch.full((1, 6, 4), 2.0, device=device))


class _Second(nn.Module):
    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return t[1]


class _FirstPieceKept(nn.Module):
    r"""Keeps the first input it gets as its workspace, and writes each call's result into it."""

    def __init__(self) -> None:
        super().__init__()
        self.ws: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ws is None:
            self.ws = x
        return torch.mul(x, 2, out=self.ws[:x.shape[0]])


class _ViewOfBuffer(nn.Module):
    r"""Writes each call's result into the first rows of one buffer it keeps, and returns a new view of them."""

    def __init__(self, rows: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("buf", torch.zeros(rows, 3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.buf[:x.shape[0]].copy_(self.lin(x))


class _ViewInDictOfSwappingKeys(_ViewOfBuffer):
    r""":class:`_ViewOfBuffer`'s view and a new tensor, in a dict whose key order is the batch's parity."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        kept, new = super().forward(x), self.lin(x) + 1
        return {"kept": kept, "new": new} if x.shape[0] % 2 else {"new": new, "kept": kept}


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("grad", [False, True])
def test_views_of_one_buffer_written_again_for_each_micro_batch_are_refused(device, grad) -> None:
    # Before (a CPU hunt): a new view for each micro-batch was taken for its own output and
    # concatenated after the next micro-batch had overwritten it: micro-batch 0's rows held
    # micro-batch 1's values, silently.
    model = ParallelSequential(nn.Identity(), _ViewOfBuffer(), chunks=2).to(device)
    x = torch.randn(6, 4, device=device)
    if device == "cuda" and not grad:
        # There the last lane copies each micro-batch's output into the result as it comes,
        # on its stream, before the next micro-batch writes the buffer: right, and kept.
        with torch.no_grad():
            torch.testing.assert_close(model(x), model[1].lin(x), rtol=0, atol=0)
        return
    with torch.set_grad_enabled(grad), torch.no_grad() if not grad else contextlib.nullcontext(), pytest.raises(
            ValueError, match=r"(?s)cannot concatenate the outputs of the last stage '1'.*micro-batch 0's output "
                              r"\(leaf 0, \(3, 3\)\) was written after the stage returned it, by a later "
                              r"micro-batch.*clone"):
        model(x)
    # With chunks=1 it is the plain module's (and the module still works).
    model.chunks = 1
    with torch.no_grad():
        torch.testing.assert_close(model(x), model[1].lin(x), rtol=0, atol=0)
    # Nor when the view comes in a dict whose keys change order between micro-batches (a review:
    # compared leaf by leaf in each one's own order, the view was taken for another's).
    if device == "cpu":
        swapping = ParallelSequential(_ViewInDictOfSwappingKeys(), chunks=2)
        with torch.no_grad(), pytest.raises(ValueError, match="was written after the stage returned it"):
            swapping(torch.arange(36.0).reshape(9, 4))
    # Memory of the input's that a stage keeps and writes again is not (a second review: outputs
    # in the input's memory were all taken for the micro-batches' own).
    if device == "cpu":
        kept = ParallelSequential(_FirstPieceKept(), chunks=2)
        with torch.no_grad(), pytest.raises(ValueError, match="was written after the stage returned it"):
            kept(torch.arange(16.0).reshape(8, 2))
    # Views of the input written in place, each micro-batch's own rows, are each micro-batch's:
    # a transposed input's too, whose pieces' spans of memory interleave (a review: refused).
    for stages in ([nn.ReLU(inplace=True)], [nn.Identity(), nn.ReLU(inplace=True)]):
        relu = ParallelSequential(*stages, chunks=3).to(device)
        with torch.no_grad():
            assert torch.equal(relu(x.clone()), x.relu())
            time_major = torch.randn(5, 6, 3, device=device)
            assert torch.equal(relu(time_major.clone().transpose(0, 1)), time_major.transpose(0, 1).relu())


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_a_stage_handing_on_views_of_one_buffer_is_refused_where_pipelined(device) -> None:
    # The same stage before another: on the CPU the micro-batches run one after another and each
    # is read before the next is written; on CUDA the next stage reads micro-batch m on its
    # stream while this one writes micro-batch m + 1 into the same memory on its own.
    torch.manual_seed(0)
    model = ParallelSequential(_ViewOfBuffer(), nn.Linear(3, 2), chunks=2).to(device)
    x = torch.randn(6, 4, device=device)
    with torch.no_grad():
        expected = model[1](model[0].lin(x))
        if device == "cpu":
            torch.testing.assert_close(model(x), expected)
            return
        with pytest.raises(RuntimeError, match=r"(?s)ParallelSequential: stage '0' \(index 0\) wrote its output for "
                                               r"micro-batch 1 into the memory of its output for micro-batch 0.*clone"):
            model(x)
        model.chunks = 1  # (and the module still works)
        torch.testing.assert_close(model(x), expected)


def test_a_last_stage_folding_another_dimension_into_the_batch_is_refused_saying_so() -> None:
    # Before (a CPU hunt): refused with "expected tensors batched along dimension 0 that agree in
    # every other dimension", which the (15, 8) outputs listed under it seemed to be. (Joined,
    # a fold that puts the batch anywhere but first would interleave the micro-batches' rows.)
    model = ParallelSequential(nn.Sequential(nn.Linear(4, 8), nn.Flatten(0, 1)), chunks=2)
    with pytest.raises(ValueError, match=r"(?s)one row per sample along dimension 0.*\[15, 15\] rows along "
                                         r"dimension 0 for micro-batches of \[3, 3\] samples"):
        model(torch.randn(6, 5, 4))
    model.chunks = 1
    assert model(torch.randn(6, 5, 4)).shape == (30, 8)


class _Transposed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


def test_views_of_pieces_of_a_large_transposed_input_written_in_place_are_each_micro_batch_s() -> None:
    # A third review: past a size cap, views of the pieces (not the pieces themselves) whose
    # spans of memory meet were taken to share memory, and refused; below it, each call built
    # the elements' offsets (0.5-1.5 s a call). The layouts are compared by their strides now.
    x = torch.randn(64, 256, 260).transpose(0, 1)  # (4.3M elements; the batch not outermost)
    model = ParallelSequential(nn.ReLU(inplace=True), _Transposed(), chunks=2)
    with torch.no_grad():
        expected = x.relu().transpose(1, 2)
        assert torch.equal(model(x.clone()), expected)


def test_the_overlap_of_two_layouts_is_exact_and_cheap() -> None:
    # Whether two views of one memory share an element, decided from their layouts (the
    # rewrite refusals above rest on it): against every element's offset on small random
    # layouts, zero strides from expand included, and on large ones (a fourth
    # review: a search without the residue classes took 22 s and 0.9 GiB on the second).
    import itertools
    import random

    from parallel_modules.pipeline import _overlap

    def offsets(t: torch.Tensor) -> set[int]:
        return {t.storage_offset() + sum(i * s for i, s in zip(index, t.stride()))
                for index in itertools.product(*(range(n) for n in t.shape))}

    rng, base = random.Random(0), torch.empty(400)

    def layout() -> torch.Tensor:
        dims = rng.randint(0, 4)
        return base.as_strided([rng.randint(1, 4) for _ in range(dims)],
                               [rng.choice([0, 1, 2, 3, 5, 7, 12, 20]) for _ in range(dims)], rng.randint(0, 60))

    for _ in range(2000):
        a, b = layout(), layout()
        assert _overlap(a, b) == bool(offsets(a) & offsets(b)), (a.shape, a.stride(), b.shape, b.stride())
    flat = torch.zeros(10**7, 2)
    assert _overlap(flat[:, 0], flat.view(-1)) and not _overlap(flat.view(-1)[0::2], flat.view(-1)[1::4])
    pieces = torch.zeros(3, 10**6).t().tensor_split(2)  # (interleaved in memory, no element shared)
    assert not _overlap(pieces[0].t(), pieces[1].t())


def test_a_view_placed_among_anothers_elements_is_cut_from_its_copy_exactly() -> None:
    # Input tensors that are views of one another are cut from a copy of the one holding the
    # others (see _copied_together): against every element's offset on small random layouts
    # (overlapping, zero strides, permuted and sliced ones), a view placed in another (_position)
    # holds only its elements, and is cut from a copy of it (_cut, whatever the copy's layout) as
    # the same elements; and the views of a contiguous, a column-major and a channels_last
    # tensor are all placed.
    import itertools
    import random

    from parallel_modules.pipeline import _cut, _position

    def offsets(t: torch.Tensor) -> list[int]:
        return [t.storage_offset() + sum(i * s for i, s in zip(index, t.stride()))
                for index in itertools.product(*(range(n) for n in t.shape))]

    rng, memory = random.Random(0), torch.arange(400.0)

    def layout() -> torch.Tensor:
        dims = rng.randint(1, 4)
        return memory.as_strided([rng.randint(1, 4) for _ in range(dims)],
                                 [rng.choice([0, 1, 2, 3, 4, 5, 7, 12, 20]) for _ in range(dims)], rng.randint(0, 60))

    def sliced(t: torch.Tensor) -> torch.Tensor:
        t = t.permute(rng.sample(range(t.dim()), t.dim()))
        return t[tuple(slice(a, rng.randint(a + 1, n), rng.randint(1, 2)) for n in t.shape
                       for a in (rng.randint(0, n - 1),))]

    placed = 0
    for _ in range(3000):
        outer = layout() if rng.random() < 0.3 else sliced(memory[:360].view(3, 4, 5, 6).permute(
            rng.sample(range(4), 4)))
        inner = layout() if rng.random() < 0.3 else sliced(outer)
        position = _position(inner, outer)
        if position is not None:
            placed += 1
            assert set(offsets(inner)) <= set(offsets(outer)), (inner.stride(), outer.stride())
            assert torch.equal(_cut(outer.clone(), inner, position), inner), (inner.stride(), outer.stride())
    assert placed > 1000
    for x in (torch.zeros(6, 4, 3, 3), torch.zeros(4, 3, 3, 6).permute(3, 0, 1, 2),
              torch.zeros(6, 4, 3, 3).contiguous(memory_format=torch.channels_last)):
        for whole, part in zip(x.tensor_split(3), x[:, 1:3, :, 1:].tensor_split(3)):
            assert _position(part, whole) is not None


class _PartlyWritten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.zeros(16, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            self.buf[: x.shape[0]] = x * 2
        return x, self.buf


class _Total(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.total.add_(x.sum())
        return x, self.total


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_a_pipeline_runs_under_inference_mode(chunks) -> None:
    # Before (a review of the rewrite check): inference tensors keep no version, and
    # every call of a pipeline of more than one chunk under inference_mode raised.
    torch.manual_seed(0)
    stages = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)]
    x = torch.randn(6, 4)
    with torch.inference_mode():
        torch.testing.assert_close(ParallelSequential(*stages, chunks=chunks)(x), nn.Sequential(*stages)(x))
        torch.testing.assert_close(ParallelSequential(*stages, nn.Sequential(_Wrap()), chunks=chunks)(x)[0],
                                   nn.Sequential(*stages)(x))


class _ScaledSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, d: dict) -> torch.Tensor:
        return d["x"][:, :2] * self.scale + d["view"]  # (mul saves its input for the scale's gradient)


@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("viewed", [False, True])
def test_an_inference_tensor_recorded_by_autograd_raises_as_in_nn_sequential(chunks, viewed) -> None:
    # Before (a CPU hunt over dtypes and shapes): recording autograd, each micro-batch was copied outside
    # inference mode into an ordinary tensor, so with chunks > 1 the pipeline trained on an input made
    # under torch.inference_mode() where nn.Sequential, and chunks=1, raise torch's error.
    torch.manual_seed(0)
    with torch.inference_mode():
        x = torch.randn(6, 4)
    stages = [nn.Linear(4, 4), nn.Linear(4, 2)]
    if viewed:  # (views of one tensor, copied together: see _copied_together)
        stages, x = [_ScaledSum(), nn.Linear(2, 2)], {"x": x, "view": x[:, 1:3]}
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        nn.Sequential(*stages)(x)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        ParallelSequential(*stages, chunks=chunks)(x)


class _Wrap(nn.Module):
    def forward(self, t: torch.Tensor) -> tuple[torch.Tensor]:
        return (t,)


def test_graph_settings_set_later_are_checked_and_reach_the_cache():
    pipe = ParallelSequential(nn.Linear(8, 8), nn.ReLU(), chunks=2)
    with pytest.raises(ValueError, match=r"ParallelSequential: max_graphs must be an int >= 1 .*got -1"):
        pipe.max_graphs = -1
    assert pipe.max_graphs == 8 and pipe._graphs.max_graphs == 8
    for wrong in (True, 2.0, "2", torch.tensor(2.0)):
        with pytest.raises(TypeError, match=rf"ParallelSequential: max_graphs must be an int >= 1 .*got "
                                            rf"{type(wrong).__name__} \({re.escape(repr(wrong))}\)"):
            pipe.max_graphs = wrong
    pipe.max_graphs = torch.tensor(4)  # (an integer as chunks and dim take it: kept as an int)
    assert type(pipe.max_graphs) is int and pipe._graphs.max_graphs == 4
    pipe.max_graphs, pipe.static_outputs, pipe.direct_grads = 3, True, True
    assert (pipe._graphs.max_graphs, pipe._graphs.static_outputs, pipe._graphs.direct_grads) == (3, True, True)
    x = torch.randn(4, 8)
    assert torch.equal(pipe(x), nn.Sequential(*pipe)(x))
    np = pytest.importorskip("numpy")
    pipe.max_graphs = np.int64(5)  # (an integer as chunks takes it: kept as the int it is)
    assert type(pipe.max_graphs) is int and pipe._graphs.max_graphs == 5


# ------------------------------------------------------------------ found by a review
def test_in_place_first_operation_trains_with_an_input_that_needs_no_grad():
    # Views of one input share its version counter: the in-place ReLU of piece 1 would spoil
    # what the Linear saved for piece 0's weight gradient.
    torch.manual_seed(0)
    pipe = ParallelSequential(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8)), chunks=2)
    ref = nn.Sequential(*copy.deepcopy(list(pipe)))
    x = torch.randn(6, 8)
    pipe(x.clone()).square().sum().backward()
    ref(x.clone()).square().sum().backward()
    for a, b in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


class _WithTemperature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.t, self.t


class _PassOn(nn.Module):
    def forward(self, value):
        return value


class _MeanOverBatch(nn.Module):
    def forward(self, x):
        return x.mean(0)


def test_outputs_not_batched_are_returned_or_refused():
    x = torch.randn(6, 3)
    stage = _WithTemperature()
    y, t = ParallelSequential(stage, chunks=3)(x)
    assert t is stage.t and torch.equal(y, x)
    scale = torch.tensor(0.5)
    out, s = ParallelSequential(_PassOn(), chunks=2)((x, scale))
    assert torch.equal(out, x) and s is scale
    with pytest.raises(ValueError, match=r"cannot concatenate the outputs of the last stage '0'(.|\n)*not batched"):
        ParallelSequential(_MeanOverBatch(), chunks=2)(torch.randn(6, 4))


class _Declares(nn.Module):
    mixes_batch = None  # a base class's default: not declared

    def forward(self, x):
        return x - x.mean(0)


def test_mixes_batch_declared_after_the_first_call_and_none():
    x = torch.randn(6, 4)
    pipe = ParallelSequential(nn.Linear(4, 4), nn.Identity(), chunks=2)
    pipe(x)
    pipe[1].mixes_batch = True  # an instance attribute, set later
    with pytest.raises(RuntimeError, match=r"stage '1' .* declares mixes_batch = True"):
        pipe(x)
    pipe[1].mixes_batch = False
    pipe(x)
    for mode in ("train", "eval"):
        mixing = ParallelSequential(_Declares(), chunks=2)
        getattr(mixing, mode)()
        assert mixing(x).shape == (6, 4)  # None: nothing declared, not taken for a BatchNorm


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_input_with_chunks_is_refused_clearly(layout):
    nt = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=layout)
    model = ParallelSequential(nn.Identity(), chunks=2)
    with pytest.raises(ValueError, match=r"ParallelSequential: with chunks=2 .* nested tensor .*chunks=1"):
        model(nt)
    model.chunks = 1
    assert model(nt) is nt


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_input_with_chunks_is_refused_clearly(layout):
    dense = torch.randn(4, 3).relu()
    sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    model = ParallelSequential(nn.Identity(), chunks=2)
    with pytest.raises(ValueError, match=rf"ParallelSequential: with chunks=2 .* sparse_{layout} tensor .*chunks=1"):
        model(sparse)
    torch.testing.assert_close(model(dense), dense)


class SelfAttentionOnly(nn.Module):
    r"""Records whether it was handed one tensor twice, as ``nn.MultiheadAttention`` asks ``query is key``."""

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        query, key = pair
        self.same = getattr(self, "same", []) + [query is key]
        return query + key


@pytest.mark.parametrize("grad", [False, True])
def test_a_tensor_passed_twice_stays_one_object_in_every_micro_batch(grad):
    stage = SelfAttentionOnly()
    x = torch.randn(6, 3, requires_grad=grad)
    out = ParallelSequential(stage, chunks=3)((x, x))
    assert stage.same == [True] * 3
    torch.testing.assert_close(out, 2 * x)


def _pipeline_and_sequential(stage, weight, leaf, inputs, chunks):
    r"""``(output, leaf.grad, weight.grad)`` of ``ParallelSequential(stage, chunks=chunks)``, then of
    ``nn.Sequential(stage)``, each called on ``inputs()`` (made anew from ``leaf``) and backpropagated."""
    results = []
    for model in (nn.Sequential(stage), ParallelSequential(stage, chunks=chunks)):
        leaf.grad, weight.grad = None, None
        out = model(inputs())
        out.square().sum().backward()
        results.append((out.detach(), leaf.grad, weight.grad.clone()))
    return results[1], results[0]


class _WritesOneReadsTheOther(nn.Module):
    r"""Doubles its first input in place, then reads its second, a view of the first."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 3)

    def forward(self, inputs):
        whole, part = inputs
        whole.mul_(2)
        return self.linear(part) + whole.flatten(1).sum(1, keepdim=True)


@pytest.mark.parametrize("how", ["view", "sibling views", "detached view", "input needing no grad", "flattened"])
@pytest.mark.parametrize("chunks", [2, 3])
def test_input_tensors_that_are_views_of_one_another_stay_so_in_every_micro_batch(how, chunks):
    # Recording autograd, each micro-batch is a copy: views of one tensor copied one by one
    # lost their link, and a write through one no longer showed in the other. (Flattened: a
    # view whose dimension crosses two of the tensor's was placed in it by index only, which
    # cannot name its steps, from session 72 until a review of it.)
    torch.manual_seed(0)
    stage = _WritesOneReadsTheOther()
    leaf = torch.randn(6, 4, requires_grad=True)

    def inputs():
        x = leaf * 1 if how != "input needing no grad" else leaf.detach().clone()
        if how == "flattened":
            x = leaf.view(6, 2, 2) * 1  # (not a view: the tensor holding the other is x itself)
        return {"view": (x, x[:, 1:3]), "sibling views": (x[:, :3], x[:, 1:3]),
                "detached view": (x, x.detach()[:, 1:3]), "input needing no grad": (x, x[:, 1:3]),
                "flattened": (x, x.flatten(1)[:, 1:3])}[how]

    (out, grad, weight), (ref, ref_grad, ref_weight) = _pipeline_and_sequential(
        stage, stage.linear.weight, leaf, inputs, chunks)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    if how != "input needing no grad":
        torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(weight, ref_weight, rtol=RTOL, atol=ATOL)


class _WritesOneConvolvesTheOther(nn.Module):
    r"""Doubles its first input, an image batch, in place, then convolves its second, a view of the first."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 1)

    def forward(self, inputs):
        whole, part = inputs
        whole.mul_(2)
        return self.conv(part) + whole.sum((1, 2, 3), keepdim=True)


@pytest.mark.parametrize("layout", ["channels_last", "column-major"])
@pytest.mark.parametrize("how", ["view", "sibling views", "detached view"])
def test_input_tensors_not_contiguous_that_are_views_of_one_another_stay_so_in_every_micro_batch(layout, how):
    # Only a contiguous tensor was taken to hold the others' micro-batches: a channels_last
    # or column-major batch and its view were copied one by one, and a write through one no
    # longer showed in the other (a silently different output and gradients).
    torch.manual_seed(0)
    if layout == "channels_last":
        stage, parameter = _WritesOneConvolvesTheOther(), "conv"
        leaf = torch.randn(6, 4, 3, 3, requires_grad=True)
        laid_out = lambda t: t.contiguous(memory_format=torch.channels_last)  # noqa: E731
    else:
        stage, parameter = _WritesOneReadsTheOther(), "linear"
        leaf = torch.randn(4, 6, requires_grad=True)
        laid_out = lambda t: t.t()  # noqa: E731

    def inputs():
        x = laid_out(leaf * 1)
        return {"view": (x, x[:, 1:3]), "sibling views": (x[:, :3], x[:, 1:3]),
                "detached view": (x, x.detach()[:, 1:3])}[how]

    (out, grad, weight), (ref, ref_grad, ref_weight) = _pipeline_and_sequential(
        stage, getattr(stage, parameter).weight, leaf, inputs, 3)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(weight, ref_weight, rtol=RTOL, atol=ATOL)


class _WritesOneReadsItsFlippedView(nn.Module):
    r"""Doubles its first input in place, then reads its second, a view of the same memory (flipped)."""

    def __init__(self, dtype: torch.dtype, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features, dtype=dtype))

    def forward(self, inputs):
        whole, flipped = inputs
        whole.mul_(2)
        return flipped * (flipped + self.scale) + whole


@pytest.mark.parametrize("how", ["conj", "neg", "conj siblings"])
@pytest.mark.parametrize("flipped_first", [False, True])
def test_input_tensors_that_are_conjugate_or_negative_views_of_one_another_keep_their_values(how, flipped_first):
    # Views of one tensor are cut from one copy of it (see _copied_together); clone() writes
    # what a conjugate or negative view reads, without the flag, and the other view was cut
    # from that copy as it lay: (x, x.conj()) reached the stage as (x, x), the imaginary parts
    # (z.imag, z.conj().imag) as (y, y), and sibling views of x.conj(), cut from a copy of x,
    # as views of x: silently, another output and gradients than nn.Sequential's.
    torch.manual_seed(0)
    stage = _WritesOneReadsItsFlippedView(torch.float32 if how == "neg" else torch.complex64,
                                          2 if how == "conj siblings" else 3)
    leaf = torch.randn(6, 3, dtype=torch.complex64, requires_grad=True)

    def inputs():
        z = leaf * 1
        pair = {"conj": (z, z.conj()), "neg": (z.imag, z.conj().imag),
                "conj siblings": (z.conj()[:, :2], z.conj()[:, 1:])}[how]
        return pair[::-1] if flipped_first else pair

    results = []
    for model in (nn.Sequential(stage), ParallelSequential(stage, chunks=3)):
        leaf.grad, stage.scale.grad = None, None
        out = model(inputs())
        out.abs().square().sum().backward()
        results.append((out.detach(), leaf.grad, stage.scale.grad))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


class _MaybeWritesOneReadsTheOther(nn.Module):
    r"""Doubles its first input in place (where ``writes``), then reads its second."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.writes = True

    def forward(self, inputs):
        first, second = inputs.values() if isinstance(inputs, dict) else inputs
        if self.writes:
            first.mul_(2)
        return self.linear(second) + first


@pytest.mark.parametrize("how", ["shifted", "transposed", "dict"])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("chunks", [2, 3])
def test_input_tensors_sharing_memory_across_micro_batches_are_refused_written_in_place(how, grad, chunks):
    # Tensors sharing elements across micro-batches, (x[:-1], x[1:]): one micro-batch's stage
    # wrote rows another micro-batch read through the other tensor (or, recording autograd,
    # the copies lost the link), and the output silently differed from nn.Sequential's.
    torch.manual_seed(0)
    stage = _MaybeWritesOneReadsTheOther()
    split = {"shifted": lambda x: (x[:-1], x[1:]), "transposed": lambda x: (x[:, :4], x[:, :4].t()),
             "dict": lambda x: {"inputs": x[:-1], "targets": x[1:]}}[how]
    leaf = torch.randn(7 if how != "transposed" else 4, 4, requires_grad=grad)
    pipe = ParallelSequential(stage, chunks=chunks)
    names = r"input\['inputs'\] and input\['targets'\]" if how == "dict" else r"input\[0\] and input\[1\]"
    with torch.set_grad_enabled(grad):
        with pytest.raises(RuntimeError, match=rf"ParallelSequential: stage '0' \(index 0\) wrote in place on "
                                               rf"micro-batch 0 of {chunks} into {names} \(.*\), input tensors that share "
                                               rf"memory across micro-batches.*\.clone\(\).*chunks=1"):
            pipe(split(leaf * 1))
        # The pipeline still works: as nn.Sequential with copies written, or shared tensors only read.
        for writes, make in ((True, lambda x: tuple(t.clone() for t in split(x)) if how != "dict" else
                              {k: t.clone() for k, t in split(x).items()}), (False, split)):
            stage.writes = writes
            results = []
            for model in (nn.Sequential(stage), pipe):
                leaf.grad, stage.linear.weight.grad = None, None
                out = model(make(leaf * 1))
                if grad:
                    out.square().sum().backward()
                results.append((out.detach(), leaf.grad, stage.linear.weight.grad))
            for got, expected in zip(results[1], results[0]):
                torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


class _CountsInPlace(nn.Module):
    r"""Adds 1 in place to the 0-dim counter it is handed with its input (where ``writes``), then scales by it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.writes = True

    def forward(self, inputs):
        x, count = inputs
        if self.writes:
            count.add_(1)
        return self.linear(x) * count


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("chunks", [2, 3])
def test_a_zero_dim_input_tensor_written_in_place_is_refused(device, grad, chunks):
    # Before (a CPU hunt): a 0-dim tensor of the input goes whole to every micro-batch, the
    # same object, so a stage adding to it in place added once per micro-batch, each reading
    # the earlier ones' writes: the output and the caller's counter silently differed from
    # nn.Sequential's, which writes it once for the whole batch. (On CUDA the lanes read it
    # on their streams too; the write shows in its version as soon as the stage issues it.)
    torch.manual_seed(0)
    stage = _CountsInPlace().to(device)
    pipe = ParallelSequential(stage, chunks=chunks)
    x = torch.randn(6, 4, device=device, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        count = torch.zeros((), device=device)
        with pytest.raises(RuntimeError, match=rf"ParallelSequential: stage '0' \(index 0\) wrote in place on "
                                               rf"micro-batch 0 of {chunks} into input\[1\], a 0-dim tensor.*"
                                               rf"every micro-batch.*chunks=1"):
            pipe((x, count))
        assert count.item() == 1  # (written once, by the first micro-batch, as nn.Sequential writes it)
        # The pipeline still works: as nn.Sequential where the counter is only read.
        stage.writes = False
        count = torch.tensor(2.0, device=device)
        torch.testing.assert_close(pipe((x, count)), nn.Sequential(stage)((x, count)), rtol=RTOL, atol=ATOL)


@pytest.mark.xfail(strict=True, raises=pytest.fail.Exception,
                   reason="an inference tensor keeps no version counter to watch for writes")
def test_a_zero_dim_inference_tensor_written_in_place_under_inference_mode_is_refused():
    # What is wrong: the test above, under inference_mode with the counter made there, runs, each
    # micro-batch adding to it again, so the output and the counter silently differ from
    # nn.Sequential's (counter 2 for 1, rows scaled by 1 and 2). Why it is hard: an inference
    # tensor has no version counter, and reading its value after each stage would wait for the
    # GPU; handing each micro-batch a copy would leave the caller's counter unwritten.
    torch.manual_seed(0)
    pipe = ParallelSequential(_CountsInPlace(), chunks=2)
    with torch.inference_mode():
        x, count = torch.randn(6, 4), torch.zeros(())
        with pytest.raises(RuntimeError, match=r"into input\[1\], a 0-dim tensor"):
            pipe((x, count))


def test_stages_set_later_are_checked_as_the_constructor_checks_them():
    s = ParallelSequential(nn.Identity(), nn.Identity())
    for change in (lambda: s.__setitem__(0, None), lambda: s.append(lambda t: t), lambda: s.insert(0, 3)):
        with pytest.raises(TypeError, match=r"ParallelSequential: stage '\d' must be an nn.Module"):
            change()
    assert len(s) == 2
    x = torch.randn(2, 3)
    assert s(x) is x



@pytest.mark.parametrize("layer,shape", [
    (nn.Softmax(dim=-2), (6, 3)), (nn.LogSoftmax(dim=-2), (6, 3)), (nn.Softmin(dim=-3), (6, 3, 5)),
    (nn.Softmax(), (6, 3, 5)), (nn.Softmax2d(), (6, 3, 5)),
], ids=["softmax-2", "logsoftmax-2", "softmin-3", "implicit", "softmax2d"])
def test_softmax_layers_whose_dim_resolves_to_0_are_refused(layer, shape) -> None:
    # Which dim a negative or implicit one is shows on the input: these normalize across
    # the batch, and were run on micro-batches silently.
    model = ParallelSequential(nn.Identity(), nn.Sequential(layer), chunks=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (implicit softmax dims are deprecated)
        with pytest.raises(RuntimeError, match=r"(?s)stage '1' \(index 1\) contains '1.0'.*dimension 0.*chunks=1"):
            model(torch.randn(shape))
        # On an input with one dimension more the same layer reads another dim: run, and
        # checked once per input signature.
        x = torch.randn(*shape, 4)
        torch.testing.assert_close(model(x), layer(x))
        with pytest.raises(RuntimeError, match="dimension 0"):  # and refused again
            model(torch.randn(shape))


def test_an_empty_batch_leaves_the_softmax_check_to_the_next_call() -> None:
    # Before: an empty batch ran whole (no rows to look at), but its signature was taken as
    # checked, and the next batch was normalized across its micro-batches, silently.
    model = ParallelSequential(nn.Linear(4, 4), nn.Softmax(dim=-2), chunks=2)
    assert model(torch.randn(0, 4)).shape == (0, 4)
    with pytest.raises(RuntimeError, match=r"contains '1' \(Softmax\(dim=-2\)\).*dimension 0"):
        model(torch.randn(6, 4))
    model[1] = nn.Softmax(dim=-1)
    x = torch.randn(6, 4)
    torch.testing.assert_close(model(x), nn.Sequential(*model)(x))


class _Squeezed(nn.Module):
    r"""``x.squeeze()`` then ``Softmax()``, rows flattened: on a piece of one sample the batch's dimension is
    dropped, and the softmax reads dim 1 of the 2-D rest; on larger pieces it reads dim 0, the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.sm = nn.Softmax()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sm(x.squeeze()).reshape(-1, x[0].numel())


def test_the_softmax_check_of_pieces_of_one_sample_does_not_stand_for_larger_ones() -> None:
    # Before: the check was kept per input dims alone: a first call of pieces of one sample
    # (batch 2, chunks=2) let batch 8 through unchecked, normalized across each piece of 4.
    model = ParallelSequential(nn.Linear(4, 4), _Squeezed(), chunks=2)
    x = torch.randn(8, 3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (implicit softmax dims are deprecated)
        model(torch.randn(2, 3, 4))
        refused = r"contains '1.sm' \(Softmax\(dim=None\)\).*3-D input.*dimension 0"
        with pytest.raises(RuntimeError, match=refused):
            model(torch.randn(3, 3, 4))  # (pieces of 2 and 1)
        with pytest.raises(RuntimeError, match=refused):
            model(x)


class _EvalProbabilities(nn.Module):
    r"""Logits in training, probabilities along dim -2 in eval: the softmax is reached in eval only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.sm = nn.Linear(4, 3), nn.Softmax(dim=-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y if self.training else self.sm(y)


def test_a_softmax_layer_not_reached_on_a_call_is_checked_when_it_is() -> None:
    # Before: the check of a signature's first call was kept whether the layer ran or not: after
    # one training call, which returns logits, eval normalized across each micro-batch (off by
    # 0.22 against nn.Sequential), silently, where a new pipeline in eval is refused.
    torch.manual_seed(0)
    model = ParallelSequential(nn.Linear(4, 4), _EvalProbabilities(), chunks=2)
    x = torch.randn(6, 4)
    torch.testing.assert_close(model(x), nn.Sequential(*model)(x))
    model.eval()
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"contains '1.sm' \(Softmax\(dim=-2\)\).*dimension 0"):
            model(x)
    model[1].sm.dim = -1  # (fixed as the error says: works)
    torch.testing.assert_close(model(x), nn.Sequential(*model)(x))


class _ScalarMix(nn.Module):
    r"""A learned softmax-weighted mix of two feature sets: a softmax over a parameter, not the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.3, -0.2]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.nn.functional.softmax(self.w, dim=-1)
        return a * x + b * x.tanh()


class _TemperedMix(_ScalarMix):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.nn.functional.softmax(self.w / 0.5, dim=-1)  # (over a tensor made from the parameter)
        return a * x + b * x.tanh()


@pytest.mark.parametrize("mix,batch", [(_ScalarMix, 6), (_TemperedMix, 4)], ids=["parameter", "from-parameter"])
def test_a_functional_softmax_is_not_taken_for_a_softmax_layer_of_the_same_dim(mix, batch) -> None:
    # Before: refused, blaming stage 0's Softmax(dim=-1), whose dim matched that of the
    # functional softmax stage 1 calls on its 1-D parameter, or on a tensor made from it
    # (two mixing weights: as many as a micro-batch's samples at batch 4).
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(4, 4), nn.Softmax(dim=-1)), mix()]
    x = torch.randn(batch, 4)
    torch.testing.assert_close(ParallelSequential(*stages, chunks=2)(x), nn.Sequential(*stages)(x))
    # The layers themselves on a batched 1-D tensor normalize across the batch: still refused, and named.
    with pytest.raises(RuntimeError, match=r"(?s)stage '1' \(index 1\) contains '1.0'.*dimension 0"):
        ParallelSequential(nn.Identity(), nn.Sequential(nn.Softmax(dim=-1)), chunks=2)(torch.randn(6))
    with pytest.raises(RuntimeError, match=r"(?s)stage '0' \(index 0\) contains '0.1'.*dimension 0"):
        ParallelSequential(nn.Sequential(nn.Identity(), nn.Softmax(dim=-1)), chunks=2)(torch.randn(6))


class _OwnSoftmax(nn.Softmax):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (no _stacklevel, as a subclass may write it)
        return torch.nn.functional.softmax(x, self.dim)


def test_a_softmax_layer_with_a_forward_of_its_own_is_still_checked() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)contains '1' \(_OwnSoftmax\(dim=-2\)\).*dimension 0"):
        ParallelSequential(nn.Identity(), _OwnSoftmax(dim=-2), chunks=2)(torch.randn(6, 3))
    x = torch.randn(6, 3)
    torch.testing.assert_close(ParallelSequential(nn.Identity(), _OwnSoftmax(dim=-1), chunks=2)(x), x.softmax(-1))


class _Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.t()


class _PerSampleSoftmax(nn.Softmax):
    mixes_batch = False  # (declared by its class)


@pytest.mark.parametrize("declare", ["instance", "class"])
def test_a_softmax_layer_declaring_mixes_batch_false_is_not_refused(declare) -> None:
    # Before: refused all the same, although the README's remedy for a layer refused
    # wrongly is to declare it: this one normalizes per sample, on the transposed batch.
    if declare == "instance":
        softmax = nn.Softmax(dim=-2)
        softmax.mixes_batch = False
    else:
        softmax = _PerSampleSoftmax(dim=-2)
    stages = [_Transpose(), softmax, _Transpose()]
    x = torch.randn(10, 6)
    torch.testing.assert_close(ParallelSequential(*stages, chunks=2)(x), nn.Sequential(*stages)(x), rtol=0, atol=0)
    softmax.mixes_batch = True  # (and declaring it mixes refuses it)
    with pytest.raises(RuntimeError, match="declares mixes_batch = True"):
        ParallelSequential(*stages, chunks=2)(x)


def test_the_first_call_checking_softmax_dims_equals_every_later_call() -> None:
    # Before: the first call of a signature ran under a torch function mode, which turned
    # off nn.MultiheadAttention's fast path (eval) for that call only: it differed from
    # later calls, and from nn.Sequential on each micro-batch, by rounding.
    torch.manual_seed(0)
    encoder = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0)
    head = nn.Sequential(nn.Linear(16, 5), nn.Softmax(dim=-2))  # (over the sequence of a batched input)
    model = ParallelSequential(encoder, head, chunks=2).eval()
    reference = nn.Sequential(encoder, head).eval()
    x = torch.randn(8, 6, 16)
    with torch.no_grad():
        first, second = model(x), model(x)
        expected = torch.cat([reference(c) for c in x.tensor_split(2)])
    assert torch.equal(first, expected) and torch.equal(second, expected)
    # The check itself still runs on the first call of a signature, and names the layer: an
    # unbatched (2-D) input reaches the softmax as (rows, features), normalized across the rows.
    # (The encoder, given it first, is refused first: it reads it as one sequence.)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"contains '0' \(TransformerEncoderLayer, "
                                                            r"batch_first=True\), given a 2-D input"):
        model(torch.randn(8, 16))
    encoder.mixes_batch = encoder.self_attn.mixes_batch = False
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"contains '1.1' \(Softmax\(dim=-2\)\).*dimension 0"):
        model(torch.randn(8, 16))


class _CallsForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.softmax = nn.Softmax(dim=-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.softmax.forward(x)  # (runs no hooks)


def test_the_softmax_check_takes_no_hooks_where_hooks_are_read_or_missed() -> None:
    # Hooks only around a fast-path layer's pipeline (see _SoftmaxDims.inside): the review of
    # the first draft, which always hooked, found a fused Parallel stage refused on every call
    # ("has hooks") and a softmax layer called through .forward() let through.
    torch.manual_seed(0)
    branches = [nn.Sequential(nn.Linear(8, 8), nn.Softmax(dim=-1)) for _ in range(4)]
    model = ParallelSequential(nn.Linear(8, 8), Parallel(*branches, fuse=True), chunks=2)
    x = torch.randn(10, 8)
    for _ in range(2):
        torch.testing.assert_close(model(x), nn.Sequential(*model)(x))
    with pytest.raises(RuntimeError, match=r"contains '1.softmax' \(Softmax\(dim=-2\)\).*dimension 0"):
        ParallelSequential(nn.Identity(), _CallsForward(), chunks=2)(torch.randn(6, 3))


def test_a_softmax_layer_raising_leaves_no_mode_behind() -> None:
    # The check's mode is entered and left by hooks around the layer's forward, even when it raises.
    model = ParallelSequential(nn.Identity(), nn.Softmax(dim=-1), chunks=2)
    depth = torch._C._len_torch_function_stack()
    with pytest.raises(RuntimeError):
        model(torch.randn(6, 3, dtype=torch.int64))  # (softmax is not implemented for integers)
    assert torch._C._len_torch_function_stack() == depth
    assert not model[1]._forward_pre_hooks and not model[1]._forward_hooks
    x = torch.randn(6, 3)
    torch.testing.assert_close(model(x), x.softmax(-1), rtol=0, atol=0)


def test_vmap_runs_a_pipeline_with_a_negative_dim_softmax_on_the_whole_input() -> None:
    # Before: the softmax check ran under torch.func, on one sample at a time, and refused
    # LogSoftmax(dim=-1) on its 1-D input, where nn.Sequential works.
    torch.manual_seed(0)
    stages = [nn.Linear(8, 4), nn.LogSoftmax(dim=-1)]
    x = torch.randn(5, 8)
    torch.testing.assert_close(torch.func.vmap(ParallelSequential(*stages, chunks=2))(x),
                               torch.func.vmap(nn.Sequential(*stages))(x), rtol=0, atol=0)


@pytest.mark.parametrize("make", [
    lambda: nn.LSTM(3, 5, num_layers=2, batch_first=True),
    lambda: nn.LSTM(3, 5, num_layers=2, batch_first=True, bidirectional=True, proj_size=2),
    lambda: nn.GRU(3, 5, batch_first=True),
    lambda: nn.Sequential(nn.Linear(3, 3), nn.RNN(3, 5, num_layers=2, batch_first=True)),
], ids=["lstm", "lstm-bidirectional-proj", "gru", "sequential-rnn"])
@pytest.mark.parametrize("batch,chunks", [(4, 2), (3, 3), (5, 2)])
def test_a_recurrent_last_stage_joins_its_hidden_states_along_their_batch_dim(make, batch, chunks) -> None:
    # Before: h_n and c_n, (layers, batch, hidden), were joined along dimension 0: a wrong
    # shape, silently, where layers x directions equal a micro-batch's samples (2 and 2, 1 and
    # 1), and refused as not batched elsewhere.
    torch.manual_seed(0)
    rnn = make()
    x = torch.randn(batch, 6, 3)
    expected = nn.Sequential(rnn)(x)
    got = ParallelSequential(nn.Identity(), rnn, chunks=chunks)(x)
    torch.testing.assert_close(got, expected)
    # Unbatched, a 2-D input would be cut along its sequence: refused where the layer gets it,
    # and, that check waived, where its hidden states are joined.
    with pytest.raises(RuntimeError, match=r"contains '1(\.1)?' \((LSTM|GRU|RNN), batch_first=True\), given a 2-D"):
        ParallelSequential(nn.Identity(), rnn, chunks=2)(torch.randn(6, 3))
    for m in rnn.modules():
        if isinstance(m, nn.RNNBase):
            m.mixes_batch = False
    with pytest.raises(ValueError, match="(?s)cannot concatenate.*without a batch dimension"):
        ParallelSequential(nn.Identity(), rnn, chunks=2)(torch.randn(6, 3))


@pytest.mark.parametrize("make", [
    lambda: nn.LSTM(3, 5, num_layers=2, batch_first=True),
    lambda: nn.GRU(3, 5, batch_first=True),
    lambda: nn.RNN(3, 5, batch_first=True),
], ids=["lstm", "gru", "rnn"])
@pytest.mark.parametrize("batch,chunks", [(4, 2), (3, 3), (5, 2)])
def test_a_traced_recurrent_last_stage_joins_its_hidden_states_along_their_batch_dim(make, batch, chunks) -> None:
    # Before (a CPU hunt): a recurrent layer made TorchScript by torch.jit.trace is of another
    # class, and its h_n was joined along dimension 0: (4, 2, 5) for (2, 4, 5) at two layers and
    # two samples a micro-batch, (3, 1, 5) for (1, 3, 5) at one and one, silently.
    torch.manual_seed(0)
    x = torch.randn(batch, 6, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the trace's warnings)
        traced = torch.jit.trace(make(), (x,))
    expected = traced(x)
    got = ParallelSequential(nn.Identity(), traced, chunks=chunks)(x)
    torch.testing.assert_close(got, expected)
    got = ParallelSequential(nn.Identity(), nn.Sequential(nn.Identity(), traced), chunks=chunks)(x)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("layers", [2, 1])
def test_a_recurrent_tail_in_a_nested_pipeline_joins_its_hidden_states_along_their_batch_dim(layers) -> None:
    # Before: a last stage that is itself a ParallelSequential ending in an LSTM had h_n and
    # c_n joined along dimension 0: (4, 2, 5) for (2, 4, 5) at two layers, refused at one.
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 5, num_layers=layers, batch_first=True)
    x = torch.randn(4, 3, 4)
    expected = lstm(x)
    for inner_chunks in (1, 2):
        inner = ParallelSequential(nn.Identity(), lstm, chunks=inner_chunks)
        for tail in (inner, nn.Sequential(nn.Identity(), inner)):
            torch.testing.assert_close(ParallelSequential(nn.Identity(), tail, chunks=2)(x), expected)


@pytest.mark.parametrize("style", ["parametrization", "hook"])
def test_a_spectral_norm_in_training_is_refused(style: str) -> None:
    # Before: each micro-batch took one more power-iteration step, reading another weight
    # (output off by 0.07 of 0.37, and the estimate's buffer different from nn.Sequential's).
    torch.manual_seed(0)
    wrap = (torch.nn.utils.parametrizations.spectral_norm if style == "parametrization"
            else torch.nn.utils.spectral_norm)
    stages = [wrap(nn.Linear(16, 16)), nn.LeakyReLU(0.2), nn.Linear(16, 1)]
    reference = copy.deepcopy(nn.Sequential(*stages))
    model = ParallelSequential(*stages, chunks=3)
    x = torch.randn(6, 16)
    with pytest.raises(RuntimeError, match=r"stage '0' \(index 0\) contains '0.*' \((Linear|_SpectralNorm)\), "
                                           r"which updates its spectral norm's power-iteration estimate"):
        model(x)
    model.eval()
    reference.eval()
    torch.testing.assert_close(model(x), reference(x))


def test_a_dynamically_quantized_layer_is_refused() -> None:
    # Before: quantize_dynamic's Linear quantized each micro-batch on a scale of its own (off by
    # 0.41 of 0.64 against the quantized nn.Sequential, with one large sample in the batch).
    pytest.importorskip("torch.ao.nn.quantized.dynamic")
    torch.manual_seed(0)
    layers = [nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)]
    quantize = lambda m: torch.ao.quantization.quantize_dynamic(m, {nn.Linear}, dtype=torch.qint8)  # noqa: E731
    model, reference = quantize(ParallelSequential(*copy.deepcopy(layers), chunks=4)), quantize(nn.Sequential(*layers))
    x = torch.randn(8, 16)
    x[0] *= 100
    with pytest.raises(RuntimeError, match=r"stage '0' \(index 0\) contains '0' \(Linear\), which is dynamically "
                                           r"quantized .*use chunks=1"):
        model(x)
    model.chunks = 1  # (and the block still works)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_a_fake_quantizer_is_refused_unless_declared_idle() -> None:
    # Quantization-aware training: an activation's fake quantizer sets its scale from what it
    # observes, so each micro-batch would be quantized on another scale.
    pytest.importorskip("torch.ao.quantization")
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))  # noqa: E731
    fake = torch.ao.quantization.FakeQuantize
    model, reference = ParallelSequential(*make(), chunks=2), make()
    reference.load_state_dict(model.state_dict())
    for m in (model, reference):
        m.insert(1, fake())
    x = torch.randn(6, 16)
    x[0] *= 50
    with pytest.raises(RuntimeError, match=r"contains '1' \(FakeQuantize\), which sets its quantization scale "
                                           r"from the inputs it observes.*disable_observer"):
        model(x)
    # A QAT layer's weight quantizer keeps a moving average, which each micro-batch would move
    # again once the weight changed: refused too. One of fixed scale (after a sigmoid) is not.
    qat = torch.ao.nn.qat.Linear(16, 16, qconfig=torch.ao.quantization.get_default_qat_qconfig("x86"))
    with pytest.raises(RuntimeError, match=r"contains '0.weight_fake_quant' \(FusedMovingAvgObsFakeQuantize\)"):
        ParallelSequential(qat, nn.ReLU(), chunks=2)(torch.randn(4, 16))
    fixed = torch.ao.quantization.fake_quantize.default_fixed_qparams_range_0to1_fake_quant()
    stages = [nn.Linear(16, 16), nn.Sigmoid(), fixed]
    torch.testing.assert_close(ParallelSequential(*stages, chunks=2)(x), nn.Sequential(*stages)(x), rtol=0, atol=0)
    # Observers disabled, and said so: the same as the whole batch.
    for m in (model, reference):
        m.apply(torch.ao.quantization.disable_observer)
        m[1].scale.fill_(0.05)
    model[1].mixes_batch = False
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_a_calibrating_observer_whose_state_depends_on_the_cut_is_refused() -> None:
    # Post-training quantization's moving-average observers moved once per micro-batch: their
    # scale silently differed from the whole batch's. A MinMaxObserver (the min of the
    # micro-batches' mins is the batch's) is not refused, nor the observer a fake quantizer
    # holds, judged with it (declared idle below).
    pytest.importorskip("torch.ao.quantization")
    observer = torch.ao.quantization.observer
    torch.manual_seed(0)
    x = torch.randn(8, 16) * torch.linspace(0.1, 5, 8)[:, None]
    for make in (observer.MovingAverageMinMaxObserver, observer.HistogramObserver):
        with pytest.raises(RuntimeError, match=rf"contains '1' \({make.__name__}\), which observes"):
            with torch.no_grad():
                ParallelSequential(nn.Linear(16, 16), make(), chunks=4).eval()(x)
    prepared = nn.Sequential(nn.Linear(16, 16))
    prepared.qconfig = torch.ao.quantization.QConfig(activation=observer.MovingAverageMinMaxObserver,
                                                     weight=observer.default_weight_observer)
    torch.ao.quantization.prepare(prepared, inplace=True)
    with pytest.raises(RuntimeError, match=r"contains '0.0.activation_post_process'"):
        ParallelSequential(prepared, chunks=2)(x)
    with pytest.raises(RuntimeError, match=r"contains '1' \(PerChannelMinMaxObserver\), which observes"):
        with torch.no_grad():  # (ranges per channel along dim 0: one per sample of a call)
            ParallelSequential(nn.Linear(16, 16), observer.PerChannelMinMaxObserver(ch_axis=0), chunks=4)(x)
    for stages in ([nn.Linear(16, 16), observer.MinMaxObserver()],
                   [nn.Linear(16, 16), observer.PerChannelMinMaxObserver(ch_axis=1)]):
        model, reference = ParallelSequential(*copy.deepcopy(stages), chunks=4), nn.Sequential(*stages)
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x))
        torch.testing.assert_close(model[1].calculate_qparams(), reference[1].calculate_qparams())
    quantizer = torch.ao.quantization.FakeQuantize()
    quantizer.mixes_batch = False
    ParallelSequential(nn.Linear(16, 16), quantizer, chunks=2)(x)


def test_a_stage_s_hooks_run_once_per_micro_batch_on_its_part() -> None:
    # The README: each stage is called once per micro-batch, so its forward and backward hooks run
    # ``chunks`` times, each on its part of the batch, and a hook keeping an activation keeps the
    # last micro-batch's.
    torch.manual_seed(0)
    first = nn.Linear(3, 3)
    forward, backward, kept = [], [], []
    first.register_forward_hook(lambda m, args, out: forward.append(args[0]) or kept.append(out.detach()))
    first.register_full_backward_hook(lambda m, grad_in, grad_out: backward.append(grad_out[0]))
    second = nn.Linear(3, 1)
    model = ParallelSequential(first, second, chunks=3)
    x, w = torch.randn(6, 3), torch.randn(6, 1)  # (a weight per sample: each part's gradient its own)
    (model(x) * w).sum().backward()
    assert [a.shape[0] for a in forward] == [2, 2, 2]
    assert all(torch.equal(a, p) for a, p in zip(forward, x.tensor_split(3)))
    # (The micro-batches' backward passes in whichever order autograd takes them.)
    expected = [part @ second.weight.detach() for part in w.tensor_split(3)]
    assert len(backward) == 3
    assert all(sum(torch.allclose(g, e) for g in backward) == 1 for e in expected)
    torch.testing.assert_close(kept[-1], nn.functional.linear(x[4:], first.weight, first.bias).detach(),
                               rtol=0, atol=0)


def test_a_stage_s_backward_hooks_keep_another_micro_batch_than_its_forward_hooks() -> None:
    # The README: autograd reaches the micro-batches' backward passes last one first on the CPU,
    # so a gradient kept by a stage's backward hook is micro-batch 0's, while an activation kept by
    # its forward hook is the last one's (Grad-CAM pairing them would mix micro-batches). A hook on
    # the activation tensor, registered by the forward hook, pairs each gradient with its own
    # activation; the pipeline's own hooks run once per call on the whole batch, as nn.Sequential's.
    torch.manual_seed(0)
    model = ParallelSequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1), chunks=3)
    reference = nn.Sequential(*copy.deepcopy(list(model)))
    x, w = torch.randn(7, 3), torch.randn(7, 1)  # (a weight per sample: each part's gradient its own)
    backward, paired = [], []

    def pair(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        i = len(paired)
        paired.append(None)
        out.register_hook(lambda g: paired.__setitem__(i, g))

    model[1].register_full_backward_hook(lambda m, grad_in, grad_out: backward.append(grad_out[0]))
    model[1].register_forward_hook(pair)
    whole = {}
    for name, module in (("model", model), ("reference", reference)):
        module.register_forward_hook(lambda m, args, out, name=name: whole.setdefault(name, []).append(out))
        module.register_full_backward_hook(
            lambda m, grad_in, grad_out, name=name: whole.setdefault(name, []).append(grad_in[0]))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    (model(a) * w).sum().backward()
    (reference(b) * w).sum().backward()
    expected = [part @ model[2].weight.detach() for part in w.tensor_split(3)]
    assert len(backward) == 3
    for g, e in zip(backward, reversed(expected)):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    for g, e in zip(paired, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert len(whole["model"]) == len(whole["reference"]) == 2
    for got, want in zip(whole["model"], whole["reference"]):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("chunks", [1, 3])
def test_hooks_rewriting_inputs_outputs_and_gradients_run_per_micro_batch(device, chunks) -> None:
    # The README: a stage's hooks (and those of the layers inside it) run once per micro-batch, on
    # its part, the pipeline's own once per call on the whole batch. Hooks that rewrite the call's
    # input and output with keywords, and the gradient, give nn.Sequential's result either way
    # (each acts on every sample alone); each is handed what it is handed with the pipeline's
    # micro-batches run through nn.Sequential one after another.
    def model(pipelined: bool, log: list) -> nn.Module:
        torch.manual_seed(0)
        branches = [nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 3)) for _ in range(2)]
        stages = [nn.Linear(4, 6), Parallel(*branches) if pipelined else Loop(branches), nn.Linear(6, 2)]
        m = (ParallelSequential(*stages, chunks=chunks) if pipelined else nn.Sequential(*stages)).to(device)
        for target in (m, m[1], m[1][0][2]):
            rewriting_hooks(m, target, log)
        return m

    log, whole, parts = [], [], []
    pipe, ref, ref_parts = model(True, log), model(False, whole), model(False, parts)
    for _ in range(2):
        log.clear(), whole.clear(), parts.clear()
        x = torch.randn(7, 4, device=device, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        out, expected = pipe(x), ref(xr)
        torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
        out.square().sum().backward()
        expected.square().sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=RTOL, atol=ATOL)
        for a, b in zip(pipe.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=ATOL)
        for part in x.detach().tensor_split(chunks):
            ref_parts(part.requires_grad_()).square().sum().backward()
        # (The micro-batches' backward passes in whichever order autograd takes them.)
        assert [e for e in log if e[1] == ""] == [e for e in whole if e[1] == ""]
        assert sorted(repr(e) for e in log if e[1]) == sorted(repr(e) for e in parts if e[1])
        assert len([e for e in log if e[1]]) == chunks * 2 * 5


def test_always_called_hooks_run_when_a_stage_fails_on_a_micro_batch() -> None:
    # A stage raising on micro-batch 1 of 3: its hook registered with always_call=True runs on
    # micro-batch 0 with its output, then on micro-batch 1 with none, as around nn.Sequential's
    # call that raises (once, on the whole batch); the pipeline's own runs once, with none; the
    # next call works.
    def hooked(module: nn.Module, log: list) -> nn.Module:
        for name, target in (("pipe", module), ("stage", module[1])):
            target.register_forward_hook(
                lambda m, args, out, name=name: log.append((name, None if out is None else out.shape[0])),
                always_call=True)
        return module

    log, ref_log = [], []
    pipe = hooked(ParallelSequential(nn.Linear(4, 4), FailOnCall(1), nn.Linear(4, 2), chunks=3), log)
    ref = hooked(nn.Sequential(*copy.deepcopy(list(pipe)[:1]), FailOnCall(0), *copy.deepcopy(list(pipe)[2:])),
                 ref_log)
    x = torch.randn(6, 4)
    for module in (pipe, ref):
        with pytest.raises(KeyError, match="boom"):
            module(x)
    assert log == [("stage", 2), ("stage", None), ("pipe", None)]
    assert ref_log == [("stage", None), ("pipe", None)]
    log.clear()
    torch.testing.assert_close(pipe(x), ref(x), rtol=RTOL, atol=ATOL)
    assert log == [("stage", 2)] * 3 + [("pipe", 6)]


def test_the_batch_mixing_check_runs_again_after_the_mode_or_chunks_change() -> None:
    # The check is made on every call, not once: a pipeline run in eval mode, or with chunks=1,
    # refuses BatchNorm in training mode once it is switched back, or chunks is raised, and
    # takes it again once the advice is followed.
    model = ParallelSequential(nn.Linear(3, 3), nn.BatchNorm1d(3), chunks=2).eval()
    x = torch.randn(4, 3)
    model(x)
    model.train()
    with pytest.raises(RuntimeError, match=r"stage '1' \(index 1\) contains '1' \(BatchNorm1d\).*training mode"):
        model(x)
    model.chunks = 1
    model(x)
    model.chunks = 2
    with pytest.raises(RuntimeError, match=r"stage '1' \(index 1\) contains '1' \(BatchNorm1d\).*training mode"):
        model(x)
    model[1].eval()  # (the layer alone, as the advice allows)
    model(x)


def test_per_sample_gradients_through_vmap_of_grad() -> None:
    # Before: vmap(grad(...)) sees one sample at a time, and chunks=4 refused a batch of one.
    torch.manual_seed(0)
    layers = [nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)]
    model, reference = ParallelSequential(*copy.deepcopy(layers), chunks=4), nn.Sequential(*layers)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(8, 16), torch.randn(8, 4)

    def per_sample(module):
        def loss(p, xi, yi):
            out = torch.func.functional_call(module, p, (xi.unsqueeze(0),))
            return (out - yi.unsqueeze(0)).square().sum()
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)

    got, expected = per_sample(model), per_sample(reference)
    assert got.keys() == expected.keys()
    for k in got:
        assert got[k].shape[0] == 8
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0)
    # Nor is a stage mixing samples refused there: the whole input runs at once.
    stages = [nn.Linear(16, 16), nn.Softmax(dim=0)]
    mixing, plain = ParallelSequential(*stages, chunks=2), nn.Sequential(*stages)
    x = torch.randn(4, 3, 16)
    torch.testing.assert_close(torch.func.vmap(mixing, in_dims=1, out_dims=1)(x),
                               torch.func.vmap(plain, in_dims=1, out_dims=1)(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="normalizes along dimension 0"):
        mixing(x[:, 0])


class _TiedHead(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.embedding.weight.t()


def test_an_embedding_renormalizing_a_weight_another_layer_reads_is_refused() -> None:
    # Before: the tied head of micro-batch 0 read rows that micro-batch 1's lookup then
    # renormalized (off by up to 8.7 against nn.Sequential; with grad, backward raised).
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 4, max_norm=1.0)
    with torch.no_grad():
        embedding.weight.mul_(5)
    tokens = torch.arange(1, 7)
    with pytest.raises(RuntimeError, match=r"contains '0' \(Embedding\), which renormalizes the rows"):
        ParallelSequential(embedding, _TiedHead(embedding), chunks=2)(tokens)
    # Not tied: each row is renormalized alike whichever micro-batch looks it up first.
    untied = nn.Embedding(10, 4, max_norm=1.0)
    with torch.no_grad():
        untied.weight.mul_(5)
    head = nn.Linear(4, 3)
    reference = nn.Sequential(copy.deepcopy(untied), copy.deepcopy(head))
    torch.testing.assert_close(ParallelSequential(untied, head, chunks=2)(tokens), reference(tokens))
    torch.testing.assert_close(untied.weight, reference[0].weight)
    # Tied within one stage (the head holds the embedding whose weight it reads): before, each
    # stage listed its modules once, so the second holder went unseen (off by 5.25), silently.
    with pytest.raises(RuntimeError, match=r"contains '0.0' \(Embedding\), which renormalizes the rows"):
        ParallelSequential(nn.Sequential(embedding, _TiedHead(embedding)), chunks=2)(tokens)
    # Held twice to look rows up only: the same rows whichever micro-batch renormalizes them first,
    # refused as it may read the weight, and run once declared.
    twice = nn.Embedding(10, 4, max_norm=1.0)
    with torch.no_grad():
        twice.weight.mul_(5)
    reference = nn.Sequential(Parallel(copy.deepcopy(twice), copy.deepcopy(twice), join="sum"))
    model = ParallelSequential(Parallel(twice, twice, join="sum"), chunks=2)
    with pytest.raises(RuntimeError, match=r"(?s)contains '0.0' \(Embedding\).*mixes_batch = False"):
        model(tokens)
    twice.mixes_batch = False
    torch.testing.assert_close(model(tokens), reference(tokens))


def test_stock_layers_mixing_samples_by_their_settings_are_refused() -> None:
    # A softmax along dimension 0 and an embedding scaling its gradient by the frequencies
    # in the batch gave other results per micro-batch, silently.
    x = torch.randn(6, 3)
    with pytest.raises(RuntimeError, match=r"(?s)'0' \(Softmax\).*dimension 0"):
        ParallelSequential(nn.Softmax(dim=0), chunks=3)(x)
    torch.testing.assert_close(ParallelSequential(nn.Softmax(dim=1), chunks=3)(x), x.softmax(1))
    tokens = torch.tensor([[1, 2], [1, 3], [1, 4], [1, 5]])
    emb = nn.Embedding(10, 4, scale_grad_by_freq=True)
    model = ParallelSequential(emb, nn.Flatten(1), chunks=2)
    with pytest.raises(RuntimeError, match=r"(?s)Embedding.*scale_grad_by_freq=False"):
        model(tokens)
    with torch.no_grad():  # nothing to scale: allowed
        torch.testing.assert_close(model(tokens), emb(tokens).flatten(1))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), emb(tokens).flatten(1))


def test_an_embedding_scaling_its_gradient_by_frequency_is_refused_in_eval_mode_too() -> None:
    # F.embedding scales the weight's gradient by each index's frequency in the batch
    # whatever the module's mode: in eval mode (dropout off while fine-tuning, gradients
    # for attribution) the pipeline let it through, and the weight's gradient silently
    # differed from nn.Sequential's on the whole batch (2 for index 1 where it is 1).
    tokens = torch.tensor([[1, 2], [1, 3], [1, 4], [1, 5]])
    emb = nn.Embedding(10, 4, scale_grad_by_freq=True)
    model = ParallelSequential(emb, nn.Flatten(1), chunks=2).eval()
    with pytest.raises(RuntimeError, match=r"(?s)Embedding.*scale_grad_by_freq=False"):
        model(tokens)
    emb.weight.requires_grad_(False)  # nothing to scale: allowed
    torch.testing.assert_close(model(tokens), emb(tokens).flatten(1))
    bag = nn.EmbeddingBag(10, 4, mode="sum", scale_grad_by_freq=True)
    with pytest.raises(RuntimeError, match=r"(?s)EmbeddingBag.*scale_grad_by_freq=False"):
        ParallelSequential(bag, chunks=2).eval()(tokens)


def test_stages_added_with_iadd_are_checked() -> None:
    # Before: nn.Sequential's += added a ModuleList stage unchecked, refused only at the call.
    pipe = ParallelSequential(nn.Linear(4, 4), chunks=2)
    with pytest.raises(TypeError, match=r"stage '1' is a ModuleList, which holds modules but cannot be called"):
        pipe += nn.Sequential(nn.ModuleList([nn.ReLU()]))
    assert len(pipe) == 1
    pipe += nn.Sequential(nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(4, 4)
    torch.testing.assert_close(pipe(x), nn.Sequential(*pipe)(x))


def test_a_pipeline_added_to_itself_doubles() -> None:
    # Before (a CPU hunt): nn.Sequential's += iterated the stages it added to, and raised
    # "dictionary changed size during iteration" with the pipeline half extended.
    torch.manual_seed(0)
    pipe = ParallelSequential(nn.Linear(4, 4), nn.Tanh(), chunks=2)
    pipe += pipe
    assert [type(m) for m in pipe] == [nn.Linear, nn.Tanh] * 2 and pipe[0] is pipe[2]
    x = torch.randn(4, 4)
    torch.testing.assert_close(pipe(x), nn.Sequential(*pipe)(x))


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_stage_moved_by_its_own_to_is_named_and_seen_at_the_next_call(chunks) -> None:
    # Before: every call after the move failed with torch's bare device error, the plan kept.
    pipe = ParallelSequential(nn.Linear(4, 4), nn.Linear(4, 4), chunks=chunks)
    x = torch.randn(6, 4)
    pipe(x)
    pipe[1].to("meta")
    with pytest.raises(RuntimeError) as ei:
        pipe(x)
    assert "a stage was moved since the pipeline's last call" in "".join(ei.value.__notes__)
    assert "stage '1' on meta" in "".join(ei.value.__notes__)
    with pytest.raises(RuntimeError, match=r"stages have parameters on different devices \(stage '0' on cpu, "
                                           r"stage '1' on meta\)"):
        pipe(x)
    pipe[1] = nn.Linear(4, 4)  # fixed
    torch.testing.assert_close(pipe(x), nn.Sequential(*pipe)(x))


def test_extend_with_a_bad_stage_appends_none() -> None:
    # Before: nn.Sequential.extend appended the good stages before the bad one raised.
    pipe = ParallelSequential(nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"ParallelSequential: stage '2' must be an nn.Module"):
        pipe.extend([nn.ReLU(), "x"])
    assert len(pipe) == 1
    pipe.extend(iter([nn.ReLU()]))  # (an iterator: read once)
    x = torch.randn(2, 4)
    assert len(pipe) == 2 and torch.equal(pipe(x), nn.Sequential(*pipe)(x))


def test_indexing_errors_name_the_pipeline_and_what_was_expected() -> None:
    # Before: nn.Sequential's bare "index 10 is out of range" and "'str' object cannot be
    # interpreted as an integer".
    pipe = ParallelSequential(OrderedDict(enc=nn.Linear(4, 4), act=nn.ReLU()))
    for bad in (lambda: pipe[10], lambda: pipe.__setitem__(-3, nn.ReLU()), lambda: pipe.__delitem__(2)):
        with pytest.raises(IndexError, match=r"ParallelSequential: index -?\d+ is out of range for 2 stages\."):
            bad()
    with pytest.raises(TypeError, match=r"stages are indexed by int or slice, got str \('enc'\)\. A named stage "
                                        r"is an attribute: block\.enc\."):
        pipe["enc"]
    with pytest.raises(TypeError, match="cannot assign to a slice of stages"):
        pipe[0:1] = nn.ReLU()
    assert len(pipe) == 2 and pipe[-1] is pipe.act and list(pipe[1:]) == [pipe.act]
    x = torch.randn(3, 4)
    assert torch.equal(pipe(x), pipe.act(pipe.enc(x)))


class _MaskCache(nn.Module):
    r"""No tensor until its first call, which registers a cache (as rotary and mask caches do)."""

    def forward(self, x):
        if not hasattr(self, "cache"):
            self.register_buffer("cache", torch.zeros(1), persistent=False)
        return x + self.cache


def test_a_stage_registering_its_first_buffer_is_not_taken_for_a_move() -> None:
    pipe = ParallelSequential(_MaskCache(), nn.Linear(4, 4), chunks=2)
    with pytest.raises(RuntimeError) as ei:
        pipe(torch.randn(6, 3))  # a shape error of stage 1, in the call that registered stage 0's cache
    assert "was moved" not in "".join(ei.value.__notes__)
    x = torch.randn(6, 4)
    torch.testing.assert_close(pipe(x), nn.Sequential(*pipe)(x))


class _LastHidden(ParallelSequential):
    r"""A pipeline subclass with a forward of its own: the output and the last layer's hidden state, batch-first."""

    def forward(self, x):
        out, (h, _) = super().forward(x)
        return out, h[-1]


def test_a_pipeline_subclass_with_a_forward_of_its_own_is_not_a_recurrent_tail() -> None:
    torch.manual_seed(0)
    inner = _LastHidden(nn.LSTM(4, 5, num_layers=2, batch_first=True))
    x = torch.randn(6, 3, 4)
    out, h = ParallelSequential(nn.Identity(), inner, chunks=2)(x)
    expected = inner(x)
    torch.testing.assert_close(out, expected[0])
    torch.testing.assert_close(h, expected[1])


class _Encoder(nn.Sequential):
    r"""A subclass of ``nn.Sequential`` without a forward of its own: it returns what its last layer does."""


@pytest.mark.parametrize("wrap", ["sequential-subclass", "compiled", "scripted-sequential"])
@pytest.mark.parametrize("layers,batch", [(1, 2), (2, 4)])
def test_a_recurrent_tail_behind_a_sequential_subclass_or_compiled_is_joined_along_dim_1(wrap, layers, batch):
    # Before: only a plain nn.Sequential was looked through: h_n joined along dimension 0,
    # (2, 1, 5) for (1, 2, 5) -- silently, where the layers equal a micro-batch's samples.
    # (A TorchScript one too, until session 72.)
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 5, num_layers=layers, batch_first=True)
    tail = {"sequential-subclass": lambda: _Encoder(nn.Linear(4, 4), lstm),
            "compiled": lambda: torch.compile(lstm, backend="eager"),
            "scripted-sequential": lambda: torch.jit.script(nn.Sequential(nn.Linear(4, 4), lstm))}[wrap]()
    x = torch.randn(batch, 3, 4)
    got, expected = ParallelSequential(nn.Identity(), tail, chunks=2)(x), nn.Sequential(nn.Identity(), tail)(x)
    assert [t.shape for t in pytree.tree_leaves(got)] == [t.shape for t in pytree.tree_leaves(expected)]
    torch.testing.assert_close(got, expected)


def test_a_parallel_of_recurrent_branches_returned_apart_is_refused_as_a_last_stage():
    # Before: each branch's h_n joined along dimension 0, (2, 1, 5) for (1, 2, 5), silently.
    heads = Parallel(nn.GRU(4, 5, batch_first=True), nn.GRU(4, 5, batch_first=True), join="tuple")
    with pytest.raises(ValueError, match="(?s)a Parallel returning its branches' outputs apart.*recurrent"):
        ParallelSequential(nn.Identity(), heads, chunks=2)(torch.randn(2, 3, 4))


@pytest.mark.parametrize("wrap", ["sequential", "pipeline"])
def test_a_parallel_of_recurrent_branches_returned_apart_is_refused_behind_containers(wrap):
    # Before: refused as the last stage itself, but not as the last of an nn.Sequential or of a
    # nested pipeline: h_n came back (4, 1, 3) for (1, 4, 3), silently.
    torch.manual_seed(0)
    heads = Parallel(nn.LSTM(5, 3, batch_first=True), nn.LSTM(5, 3, batch_first=True), join=None)
    tail = nn.Sequential(nn.Identity(), heads) if wrap == "sequential" else ParallelSequential(nn.Identity(), heads)
    with pytest.raises(ValueError, match="(?s)a Parallel returning its branches' outputs apart.*recurrent"):
        ParallelSequential(nn.Identity(), tail, chunks=4)(torch.randn(4, 2, 5))


@pytest.mark.parametrize("join, dim", [("sum", 0), ("mean", 0), ("cat", -1), ("cat", 2), ("stack", 1), ("stack", 2),
                                       ("stack", -1), ("stack", -3)])
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_a_parallel_of_recurrent_branches_joined_keeps_their_hidden_states_batch(join, dim, cell):
    # Before: a sum, mean, cat or stack of recurrent branches' results as the last stage had its
    # hidden states joined along dimension 0: (4, 1, 3) for (1, 4, 3) in 4 chunks, silently.
    torch.manual_seed(0)
    heads = Parallel(cell(5, 3, batch_first=True), cell(5, 3, batch_first=True), join=join, dim=dim).double()
    x = torch.randn(4, 2, 5, dtype=torch.float64)
    expected = heads(x)
    for chunks in (2, 4):
        got = ParallelSequential(nn.Identity(), nn.Sequential(heads), chunks=chunks)(x)
        assert [t.shape for t in pytree.tree_leaves(got)] == [t.shape for t in pytree.tree_leaves(expected)]
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("inner", ["sum", "stack"])
def test_a_parallel_of_parallels_of_recurrent_branches_keeps_their_hidden_states_batch(inner):
    # A review: the branches were asked whether they are recurrent layers, not whether they
    # return a recurrent layer's result: a sum of sums of LSTMs had h_n joined along dimension 0.
    torch.manual_seed(0)

    def pair():
        return Parallel(nn.LSTM(5, 3, batch_first=True), nn.LSTM(5, 3, batch_first=True), join=inner, dim=-1)

    heads = Parallel(pair(), nn.Sequential(pair()), join="stack", dim=1).double()
    x = torch.randn(4, 2, 5, dtype=torch.float64)
    expected = heads(x)
    got = ParallelSequential(nn.Identity(), heads, chunks=4)(x)
    assert [t.shape for t in pytree.tree_leaves(got)] == [t.shape for t in pytree.tree_leaves(expected)]
    torch.testing.assert_close(got, expected)
    apart = Parallel(Parallel(nn.LSTM(5, 3, batch_first=True), nn.LSTM(5, 3, batch_first=True), join=None),
                     Parallel(nn.LSTM(5, 3, batch_first=True), nn.LSTM(5, 3, batch_first=True), join=None), join="sum")
    with pytest.raises(ValueError, match="(?s)a Parallel returning its branches' outputs apart.*recurrent"):
        ParallelSequential(nn.Identity(), apart, chunks=4)(x.float())


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("dim, where", [(0, "batch-first outputs"), (-3, "batch-first outputs"),
                                        (1, "final hidden states"), (-2, "final hidden states")])
def test_a_parallel_of_recurrent_branches_joined_along_the_batch_is_refused(device, dim, where):
    # A cat along the batch of the output (dim 0) or of the hidden states (dim 1): the whole
    # batch's interleaves the branches' samples, which micro-batches cannot reproduce. The
    # error says which, and the fix (Parallel's default dim=1 is the hidden states' batch).
    heads = Parallel(nn.GRU(5, 3, batch_first=True), nn.GRU(5, 3, batch_first=True), join="cat", dim=dim)
    model = ParallelSequential(nn.Identity(), heads, chunks=2).to(device)
    x = torch.randn(4, 2, 5, device=device)
    for grad in (True, False):  # (without autograd on the GPU the last lane joins as results come)
        with torch.set_grad_enabled(grad), pytest.raises(
                ValueError, match=rf"(?s)cannot concatenate the outputs of the last stage.*joining recurrent "
                                  rf"branches by 'cat' along dimension {dim}, where their {where} hold the batch.*"
                                  rf"Join along the features \(dim=-1\)"):
            model(x)
    heads.dim = -1  # the fix it names
    out, h = model(x)
    plain = [m(x) for m in heads]
    torch.testing.assert_close(out, torch.cat([o for o, _ in plain], -1))
    torch.testing.assert_close(h, torch.cat([hidden for _, hidden in plain], -1))


def test_a_parallel_joining_recurrent_and_other_branches_is_refused_as_a_last_stage():
    class _BatchFirstGRU(nn.GRU):  # (a forward of its own: not taken for a recurrent layer)
        def forward(self, x):
            out, h = super().forward(x)
            return out, h.transpose(0, 1)

    heads = Parallel(nn.GRU(5, 3, batch_first=True), _BatchFirstGRU(5, 3, batch_first=True), join="sum")
    with pytest.raises(ValueError, match="(?s)a Parallel joining by 'sum' branches that differ.*recurrent"):
        ParallelSequential(nn.Identity(), heads, chunks=2)(torch.randn(2, 2, 5))


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("dim", [0, -3])
def test_a_parallel_stacking_along_the_batch_is_refused_as_a_last_stage(device, dim):
    # Before: with micro-batches as large as the branches are many, each micro-batch's (2, 2, 3)
    # stack looked batched and was joined along dimension 0: (4, 2, 3) for the whole batch's
    # (2, 4, 3), silently. (Without autograd on the GPU the last lane joins its results as they
    # come, which the check made as they were joined did not see.)
    heads = Parallel(nn.Linear(3, 3), nn.Linear(3, 3), join="stack", dim=dim).to(device)
    x = torch.randn(4, 3, device=device)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="stacking its branches' outputs along "
                                                                           "dimension"):
            ParallelSequential(heads, chunks=2)(x)
    assert ParallelSequential(heads, chunks=1)(x).shape == (2, 4, 3)  # one micro-batch: nothing to join
    nested = Parallel(Parallel(*heads, join="stack", dim=dim), Parallel(*heads, join="stack", dim=dim), join="sum")
    with pytest.raises(ValueError, match="stacking its branches' outputs along dimension"):  # (reviews: nested)
        ParallelSequential(nn.Sequential(nested), chunks=2)(x)
    with pytest.raises(ValueError, match="stacking its branches' outputs along dimension 0"):
        ParallelSequential(Parallel(Parallel(*heads, join="stack", dim=0), Parallel(*heads, join="stack", dim=0),
                                    join="sum"),
                           chunks=2)(x)
    torch.testing.assert_close(ParallelSequential(Parallel(*heads, join="stack", dim=1), chunks=2)(x),
                               torch.stack([b(x) for b in heads], 1))


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("dim", [0, -3])
def test_a_parallel_stacking_along_the_batch_is_refused_as_a_middle_stage(device, dim):
    # Before: a middle stage's (2, 2, 3) stack for micro-batches of 2 samples passed on with the
    # batch along dimension 1, and the last stage's outputs were joined along the branches:
    # (4, 2, 3) for the whole batch's (2, 4, 3), silently.
    heads = Parallel(nn.Linear(3, 3), nn.Linear(3, 3), join="stack", dim=dim).to(device)
    tail = nn.Linear(3, 3).to(device)
    x = torch.randn(4, 3, device=device)
    pipe = ParallelSequential(heads, tail, chunks=2)
    with pytest.raises(ValueError, match=r"stage '0' \(index 0\) returns the result of a Parallel stacking its "
                                         rf"branches' outputs along dimension {dim}.*\(2, 2, 3\).*dim=1"):
        pipe(x)
    for nested in (nn.Sequential(nn.Identity(), heads),  # behind a container
                   Parallel(heads, copy.deepcopy(heads), join="sum"),  # joined by another Parallel
                   Parallel(heads, copy.deepcopy(heads), join="tuple")):
        with pytest.raises(ValueError, match="stacking its branches' outputs along dimension"):
            ParallelSequential(nested, nn.Identity(), chunks=2)(x)
    # The block still works: as a whole batch's stage, or stacking along another dimension.
    torch.testing.assert_close(ParallelSequential(heads, tail, chunks=1)(x), tail(heads(x)), rtol=0, atol=0)
    heads.dim = 1
    expected = tail(torch.stack([b(x) for b in heads], 1))
    torch.testing.assert_close(pipe(x), expected, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("join", ["tuple", "dict"])
@pytest.mark.parametrize("dim", [-2, 2])
@pytest.mark.parametrize("where", ["middle", "last"])
def test_a_parallel_stacking_beside_a_branch_of_another_rank_is_not_refused(where, dim, join):
    # Before: the stack's dim was resolved on the ranks of every tensor the outer block returned
    # apart, its sibling branch's 2-D output too, on which -2 and 2 are dimension 0: a stack of
    # 2-D outputs along dimension 1 (a (2, 2, 3) result per micro-batch, batch first) was refused.
    torch.manual_seed(0)
    heads = Parallel(nn.Linear(3, 3), nn.Linear(3, 3), join="stack", dim=dim)
    block = Parallel(heads, nn.Linear(3, 3), join=join)
    stages = [block, nn.Identity()] if where == "middle" else [nn.Identity(), block]
    x = torch.randn(4, 3)
    got, expected = ParallelSequential(*stages, chunks=2)(x), nn.Sequential(*stages)(x)
    assert [t.shape for t in pytree.tree_leaves(got)] == [(4, 2, 3) if dim < 0 else (4, 3, 2), (4, 3)]
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # A stack along the batch beside it is still refused.
    heads.dim = -3 if dim < 0 else 0
    with pytest.raises(ValueError, match="stacking its branches' outputs along dimension"):
        ParallelSequential(*stages, chunks=2)(x)


class _EvalProbs(nn.Module):
    r"""Logits in training, probabilities (a softmax whose dim resolves to 0 on 2-D rows) in eval."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.sm = nn.Linear(4, 3), nn.Softmax(dim=-2)

    def forward(self, x):
        y = self.fc(x)
        return y if self.training else self.sm(y)


def test_the_softmax_check_sees_a_stage_switched_to_eval_alone():
    # Before: the check's key held the pipeline's own mode only: a stage switched to eval by
    # itself reached its softmax unchecked (0.227 off the whole batch's result).
    torch.manual_seed(0)
    head = _EvalProbs()
    pipe = ParallelSequential(nn.Linear(4, 4), head, chunks=2)
    x = torch.randn(6, 4)
    pipe(x)
    head.eval()
    with pytest.raises(RuntimeError, match=r"'1.sm' \(Softmax\(dim=-2\)\)"):
        pipe(x)


class _PickedSoftmax(nn.Module):
    r"""Softmax(dim=-2) over ``x["a"]``: 2-D rows are normalized across the batch, 3-D ones are not."""

    def __init__(self) -> None:
        super().__init__()
        self.sm = nn.Softmax(dim=-2)

    def forward(self, d):
        return self.sm(d["a"]).flatten(1)


def test_the_softmax_check_tells_dict_inputs_apart_by_key():
    # Before: the key held the inputs' numbers of dimensions in order, not their keys: {"a": 3-D,
    # "b": 2-D} checked let {"a": 2-D, "b": 3-D} through (0.35 off the whole batch's result).
    pipe = ParallelSequential(_PickedSoftmax(), chunks=2)
    pipe({"a": torch.randn(4, 3, 2), "b": torch.randn(4, 2)})
    with pytest.raises(RuntimeError, match="normalizes along dimension 0"):
        pipe({"b": torch.randn(4, 3, 2), "a": torch.randn(4, 2)})


def test_a_softmax2d_refusal_says_how_to_fix_it():
    with pytest.raises(RuntimeError, match=r"Give it a batched 4-D input, or use nn.Softmax\(dim=1\)"):
        ParallelSequential(nn.Softmax2d(), chunks=2)(torch.randn(4, 3, 5))


class _GatedMix(nn.Module):
    r"""Mixes per-sample features with softmax weights over three learned logits: no batch in the softmax."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.randn(3))
        self.gate = nn.Softmax(dim=dim)

    def forward(self, x):
        a = self.gate(self.logits / 0.5)
        return a[0] * x + a[1] * x.tanh() + a[2] * x.sigmoid()


@pytest.mark.parametrize("dim", [-1, 0])
def test_a_softmax_over_weights_made_from_a_parameter_is_told_how_to_pass(dim: int) -> None:
    # The checks cannot tell three logits from three samples (dim=-1: a micro-batch of 2 has
    # fewer rows; dim=0: refused as written); the error says how to declare such a layer, and
    # declared so, it runs.
    torch.manual_seed(0)
    x = torch.randn(4, 4)
    stages = [nn.Linear(4, 4), _GatedMix(dim)]
    pipe = ParallelSequential(*stages, chunks=2)
    with pytest.raises(RuntimeError, match=r"\(weights computed from a parameter\), say so with "
                                           r"`model.get_submodule\('1.gate'\).mixes_batch = False`"):
        pipe(x)
    pipe.get_submodule("1.gate").mixes_batch = False
    torch.testing.assert_close(pipe(x), nn.Sequential(*stages)(x))


class _BatchFirstGRU(nn.GRU):
    r"""A GRU returning its final hidden states batch-first, as the README asks of a custom last stage."""

    def forward(self, x):
        out, h = super().forward(x)
        return out, h.transpose(0, 1).contiguous()


class _LastLayerLSTM(nn.LSTM):
    r"""An LSTM returning its output and the last layer's final hidden state, (batch, hidden)."""

    def forward(self, x):
        out, (h, _) = super().forward(x)
        return out, h[-1]


@pytest.mark.parametrize("make", [lambda: _BatchFirstGRU(3, 4, num_layers=2, batch_first=True),
                                  lambda: _LastLayerLSTM(3, 4, num_layers=2, batch_first=True)],
                         ids=["gru-batch-first", "lstm-last-layer"])
def test_a_recurrent_subclass_with_a_forward_of_its_own_is_joined_along_dim_0(make) -> None:
    # Before: taken for a stock recurrent tail, its batch-first hidden states were joined along
    # dimension 1: (2, 6, 4) for (6, 2, 4), silently, where the layers equal a micro-batch's
    # samples, and a (batch, hidden) state was refused as "unbatched".
    torch.manual_seed(0)
    rnn = make()
    x = torch.randn(6, 5, 3)
    got, expected = ParallelSequential(rnn, chunks=3)(x), nn.Sequential(rnn)(x)
    assert [t.shape for t in got] == [t.shape for t in expected]
    torch.testing.assert_close(got, expected)


def test_appending_to_a_slice_whose_stages_kept_their_names_is_refused_not_overwriting() -> None:
    # Before: as nn.Sequential's, a slice keeps its stages' names ("1", "2") and append named
    # the new stage "2": it replaced the Linear, silently (extend and += too).
    pipe = ParallelSequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    part = pipe[1:]
    for grow in (lambda: part.append(nn.ReLU()), lambda: part.extend([nn.ReLU(), nn.Tanh()]),
                 lambda: part.__iadd__(nn.Sequential(nn.ReLU()))):
        with pytest.raises(ValueError, match=r"a stage named '2' already exists .*\['1', '2'\]"):
            grow()
        assert list(part._modules) == ["1", "2"] and part[1] is pipe[2]
    with pytest.raises(ValueError, match=r"insert numbers the stages by position .* got \['1', '2'\]"):
        part.insert(1, nn.ReLU())
    assert list(part._modules) == ["1", "2"] and part[1] is pipe[2]
    # Named by their index from 0, a slice grows as before.
    whole = pipe[:2].append(nn.ReLU())
    assert list(whole._modules) == ["0", "1", "2"] and isinstance(whole[2], nn.ReLU)


@pytest.mark.parametrize("idx", [-1, 1])
def test_a_stage_refused_by_setitem_is_named_as_the_one_it_replaces(idx) -> None:
    # Before: named by the index given ("stage '-1'"), though the stage is "dec".
    pipe = ParallelSequential(OrderedDict(enc=nn.Linear(2, 2), dec=nn.Linear(2, 2)), chunks=2)
    with pytest.raises(TypeError, match="stage 'dec' must be an nn.Module"):
        pipe[idx] = torch.relu
    assert isinstance(pipe.dec, nn.Linear) and pipe(torch.randn(4, 2)).shape == (4, 2)
    numbered = ParallelSequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(TypeError, match="stage '1' must be an nn.Module"):
        numbered[idx] = torch.relu


def test_a_stage_refused_by_insert_is_named_by_the_position_it_would_take() -> None:
    pipe = ParallelSequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(TypeError, match="stage '1' must be an nn.Module"):  # (before: '-1')
        pipe.insert(-1, torch.relu)
    assert len(pipe) == 2


@pytest.mark.parametrize("index", [5, -4])
def test_insert_out_of_range_names_the_pipeline_and_the_range(index: int) -> None:
    # Before (a CPU hunt): nn.Sequential's bare "IndexError: Index out of range: 5", naming no module.
    pipe = ParallelSequential(nn.Linear(2, 2), nn.Linear(2, 2), chunks=2)
    with pytest.raises(IndexError, match=rf"ParallelSequential: insert index {index} is out of range for 2 "
                                         r"stages \(expected -2 <= index <= 2\)"):
        pipe.insert(index, nn.ReLU())
    assert len(pipe) == 2 and list(pipe._modules) == ["0", "1"]
    pipe.insert(2, nn.ReLU())  # (the end is in range, as for a list)
    x = torch.randn(4, 2)
    torch.testing.assert_close(pipe(x), nn.Sequential(*pipe)(x), rtol=0, atol=0)



@pytest.mark.parametrize("kept", ["given", "slice", "step", "reordered"])
def test_imul_on_stages_not_numbered_by_position_is_refused_leaving_the_pipeline_as_it_was(kept: str) -> None:
    # Before (a CPU hunt): nn.Sequential's *= copies stage str(i) to str(i + n): on names kept
    # through a slice or given in an OrderedDict it raised a bare KeyError half done
    # (["0", "x"] became ["0", "x", "2"]), replaced a stage (pipe[::2], "0" and "2": stage "2"
    # overwritten by stage "0"), or repeated the stages in another order, silently.
    a, b, c = nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)
    pipe = {"given": lambda: ParallelSequential(OrderedDict([("0", a), ("x", b)]), chunks=2),
            "slice": lambda: ParallelSequential(a, b, c, chunks=2)[1:],
            "step": lambda: ParallelSequential(a, b, c, chunks=2)[::2],
            "reordered": lambda: ParallelSequential(OrderedDict([("1", a), ("0", b)]), chunks=2)}[kept]()
    names, stages = list(pipe._modules), list(pipe)
    x = torch.randn(4, 4)
    out = pipe(x)
    with pytest.raises(ValueError, match=r"ParallelSequential: \*= numbers the stages by position and needs them "
                                         rf"named '0'..'1', got {re.escape(repr(names))}.*pipe \* 2"):
        pipe *= 2
    assert list(pipe._modules) == names and list(pipe) == stages
    torch.testing.assert_close(pipe(x), out, rtol=0, atol=0)
    doubled = pipe * 2  # (the advice: numbered anew)
    assert list(doubled) == stages * 2
    torch.testing.assert_close(doubled(x), nn.Sequential(*stages, *stages)(x))
    pipe *= 1  # (adds nothing: not refused)
    assert list(pipe._modules) == names

def test_extend_with_one_module_says_to_append_it():
    # Before: extend(module) raised "'Linear' object is not iterable", naming neither the pipeline
    # nor the fix.
    pipe = ParallelSequential(nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"ParallelSequential: extend takes an iterable of stages \(another "
                                        r"ParallelSequential, a list\), got Linear\. To add one stage, use "
                                        r"pipe\.append\(module\)"):
        pipe.extend(nn.Linear(4, 4))
    assert len(pipe) == 1  # (left as it was)


# ------------------------------------------------------- containers of the user's classes
class _Pairs(dict):
    r"""A dict of the user's class (a batch of named fields), with a non-tensor attribute."""


class _Rows(list):
    r"""A list of the user's class, which may keep a batched tensor in an attribute."""


class _Fields(tuple):
    pass


class _Named(NamedTuple):
    x: torch.Tensor
    m: torch.Tensor


@dataclasses.dataclass
class _Registered:
    x: torch.Tensor
    m: torch.Tensor


pytree.register_dataclass(_Registered)


@dataclasses.dataclass
class _Unregistered:
    x: torch.Tensor
    m: torch.Tensor


class _Holder:
    r"""An object of the user's own, holding tensors in its attributes."""

    def __init__(self, x: torch.Tensor, m: torch.Tensor) -> None:
        self.x, self.m = x, m


def _make_pairs(x, m):
    pairs = _Pairs(x=x, inner=_Rows([m]))
    pairs.tag = "batch"
    return pairs


def _make_rows(x, m):
    rows = _Rows([x])
    rows.mask = m  # (a batched tensor kept as an attribute: split with the items)
    return rows


# Each kind: how to make one of (x, m), and how to read x and m back.
_KINDS = {
    "dict subclass": (_make_pairs, lambda v: (v["x"], v["inner"][0])),
    "list subclass": (_make_rows, lambda v: (v[0], v.mask)),
    "tuple subclass": (lambda x, m: _Fields((x, _Fields((m,)))), lambda v: (v[0], v[1][0])),
    "namedtuple": (_Named, lambda v: (v.x, v.m)),
    "registered dataclass": (_Registered, lambda v: (v.x, v.m)),
}


class _Carries(nn.Module):
    r"""Reads x and m from a container of one kind and returns one of that kind, its rows as its input's."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.make, self.read = _KINDS[kind]
        self.lin = nn.Linear(4, 4)
        self.seen: list[Any] = []

    def forward(self, v):
        self.seen.append(v)
        x, m = self.read(v)
        return self.make(self.lin(x) * m, m + 1)


def _same(a: Any, b: Any, read: Callable[[Any], tuple]) -> bool:
    return type(a) is type(b) and all(torch.equal(p, q) for p, q in zip(read(a), read(b), strict=True))


@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("kind", list(_KINDS))
def test_containers_of_the_users_classes_are_split_and_joined_in_their_class(kind: str, chunks: int) -> None:
    # Before: a subclass of dict, list or tuple, which pytree keeps whole, was refused as the input
    # ("must be a tensor, or a tuple/list/dict of tensors"), given whole to every micro-batch
    # inside one, and refused as the last stage's output. Now taken apart as its base class and
    # rebuilt in its own (instance attributes too); namedtuples and registered classes as before.
    make, read = _KINDS[kind]
    model = ParallelSequential(_Carries(kind), _Carries(kind), chunks=chunks)
    x, m = torch.randn(7, 4), torch.randn(7, 4)
    out = model(make(x, m))
    pieces = [nn.Sequential(*model)(make(px, pm)) for px, pm in zip(x.tensor_split(chunks), m.tensor_split(chunks))]
    expected = make(*(torch.cat(column) for column in zip(*(read(p) for p in pieces))))
    assert _same(out, expected, read)
    for stage in model:  # (between the stages too, each micro-batch its own rows, in the class)
        got = stage.seen[:chunks]
        assert [type(v) for v in got] == [type(expected)] * chunks
        assert [read(v)[1].shape[0] for v in got] == [len(p) for p in x.tensor_split(chunks)]
    if kind == "dict subclass":
        assert out.tag == "batch" and type(out["inner"]) is _Rows
    # Inside a structure, as one argument of several.
    pair = ParallelSequential(nn.Identity(), chunks=chunks)((x, make(x, m)))
    assert torch.equal(pair[0], x) and _same(pair[1], make(x, m), read)


def test_a_stage_changing_a_dict_subclass_of_its_input_is_refused() -> None:
    # As for a dict (see above): each micro-batch gets one of its own, rebuilt.
    with pytest.raises(RuntimeError, match=r"stage '1' \(index 1\) changed the pipeline's input, a _Pairs, in place"):
        ParallelSequential(nn.Identity(), _WritesKey(), chunks=2)(_Pairs(x=torch.randn(4, 2)))


class _KeywordsOnly(dict):
    r"""A dict subclass whose constructor takes its fields by name: it cannot be rebuilt from its items."""

    def __init__(self, *, x: torch.Tensor) -> None:
        super().__init__(x=x)


class _Prepends(list):
    r"""A list subclass whose constructor adds an item."""

    def __init__(self, items=()) -> None:
        super().__init__([None, *items])


def _prepends_holding(x: torch.Tensor) -> _Prepends:
    value = _Prepends()
    value[:] = [x]  # (holds x alone, which its constructor would not rebuild)
    return value


@pytest.mark.parametrize("make, why", [
    (lambda x: _KeywordsOnly(x=x), r"which raised TypeError: .*argument"),
    (_prepends_holding, r"which returned _Prepends\[NoneType, Tensor\(2, 3\).*not those items in that order"),
], ids=["raises", "changes its items"])
def test_a_subclass_that_cannot_be_rebuilt_from_its_items_is_refused(make, why) -> None:
    value = make(torch.randn(4, 3))
    name = type(value).__name__
    with pytest.raises(TypeError, match=rf"(?s)ParallelSequential: cannot split the input into micro-batches with "
                                        rf"chunks=2: {name}, a subclass of \w+ that torch.utils._pytree does not know.*"
                                        rf"calling {name}\(items\).*{why}.*register_pytree_node.*chunks=1"):
        ParallelSequential(nn.Identity(), chunks=2)(value)
    assert ParallelSequential(nn.Identity(), chunks=1)(value) is value


@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("cls", [_Unregistered, _Holder], ids=["dataclass", "object"])
def test_objects_holding_batched_tensors_that_pytree_cannot_split_are_refused(cls, chunks: int) -> None:
    # Before: given whole to every micro-batch, so a stage reading its rows computed on the whole
    # batch's: here, silently, on the first rows of the batch for every micro-batch.
    class FirstRows(nn.Module):
        def forward(self, pair):
            x, held = pair
            return x + held.m[: len(x)]

    x, m = torch.randn(6, 4), torch.randn(6, 4)
    model = ParallelSequential(FirstRows(), chunks=chunks)
    how = r"register_dataclass\(_Unregistered\)" if cls is _Unregistered else r"register_pytree_node\(_Holder, \.\.\.\)"
    with pytest.raises(ValueError, match=rf"(?s)ParallelSequential: with chunks={chunks} .*input\[1\], an object of "
                                         rf"class {cls.__name__}, .*holds tensors batched along dimension 0 \(\.x: "
                                         rf"Tensor\(6, 4\).*for a batch of 6\).*{how}.*tuple/list/dict, or use chunks=1"):
        model((x, cls(x, m)))
    model.chunks = 1
    assert torch.equal(model((x, cls(x, m))), x + m)
    # The whole input such an object: refused as before, saying how to make it one that splits.
    with pytest.raises(ValueError, match=rf"(?s)got {cls.__name__} \(its tensors inside an object of class "
                                         rf"{cls.__name__}\).*{how}"):
        ParallelSequential(nn.Identity(), chunks=chunks)(cls(x, m))


def test_objects_holding_no_batch_still_go_whole_to_every_micro_batch() -> None:
    # A config, a lookup table (no row per sample), a module: the same object in every micro-batch, as before.
    class Config:
        def __init__(self) -> None:
            self.scale, self.name, self.table = 2.0, "cfg", torch.randn(5, 4)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[Any] = []

        def forward(self, d):
            self.seen.append((d["config"], d["head"]))
            return d["head"](d["x"]) * d["config"].scale + d["config"].table[0]

    stage, config, head = Scaled(), Config(), nn.Linear(6, 4)  # (its weight: 4 rows, as the batch)
    x = torch.randn(4, 6)
    out = ParallelSequential(stage, chunks=2)({"x": x, "config": config, "head": head})
    torch.testing.assert_close(out, head(x) * 2.0 + config.table[0], rtol=RTOL, atol=ATOL)
    assert stage.seen == [(config, head)] * 2


def test_an_objects_large_tables_are_not_walked_at_every_call(monkeypatch) -> None:
    # Before: the check of the input's objects for batched tensors walked every item of their
    # containers at every call -- a tokenizer's vocabulary and merges, 50 ms a call for 50,000
    # each -- where a table holds no batch. A batch held in a small dict is still refused.
    from parallel_modules import _streams

    class Tokenizer:
        def __init__(self) -> None:
            self.vocab = {f"w{i}": i for i in range(5000)}
            self.merges = [(f"a{i}", f"b{i}") for i in range(5000)]
            self.special = {"pad": torch.zeros(3)}  # (looked into: a small table)

    walked = []
    nested = _streams._nested_tensors
    monkeypatch.setattr(_streams, "_nested_tensors", lambda *a, **k: walked.append(a[0]) or nested(*a, **k))
    x, tokenizer = torch.randn(4, 3), Tokenizer()
    out = ParallelSequential(nn.Identity(), chunks=2)((x, tokenizer))
    assert torch.equal(out[0], x) and out[1] is tokenizer
    assert len(walked) < 10, f"{len(walked)} containers walked"
    tokenizer.special["batch"] = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"input\[1\], an object of class .*Tokenizer.*\.special: Tensor\(4, 3\)"):
        ParallelSequential(nn.Identity(), chunks=2)((x, tokenizer))


@pytest.mark.parametrize("cls", [_Unregistered, _Holder], ids=["dataclass", "object"])
def test_objects_holding_tensors_returned_by_the_last_stage_say_how_to_join_them(cls) -> None:
    # Before: refused, but with "non-tensor values ... not the input's own", which said nothing of
    # registering the class.
    class Makes(nn.Module):
        def forward(self, x):
            return cls(x * 2, x + 1)

    how = r"register_dataclass\(_Unregistered\)" if cls is _Unregistered else r"register_pytree_node\(_Holder, \.\.\.\)"
    with pytest.raises(ValueError, match=rf"(?s)cannot concatenate the outputs of the last stage '0'.*micro-batch 0: "
                                         rf"{cls.__name__}.*returned objects of class {cls.__name__} holding tensors.*"
                                         rf"{how}"):
        ParallelSequential(Makes(), chunks=2)(torch.randn(4, 3))
    # Registered, it is joined as any structure.
    out = ParallelSequential(_Carries("registered dataclass"), chunks=2)(_Registered(torch.randn(4, 4), torch.randn(4, 4)))
    assert type(out) is _Registered and out.x.shape == (4, 4)


class _DoublesOneAddsTheOther(nn.Module):
    r"""Doubles its first input in place, then adds its second, which shares elements with it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, inputs):
        first, second = inputs
        first.mul_(2)
        return self.linear(first + second)


@pytest.mark.parametrize("how", ["shifted in time", "permuted", "rows of time and batch", "some of the rows"])
@pytest.mark.parametrize("chunks", [2, 3])
def test_input_views_whose_batch_is_not_their_base_s_first_dimension_stay_linked_in_every_micro_batch(how, chunks):
    # Views of a tensor whose batch is not its base's dimension 0 (a sequence-first h
    # transposed, (x[:, :-1], x[:, 1:])): neither held the other, nor did the base, so each
    # was copied on its own, and a write through one no longer showed in the other (a
    # silently different output and gradients). They are cut from a copy of the span of the
    # base's memory they cover, with the batch first (see _batch_first).
    torch.manual_seed(0)
    stage = _DoublesOneAddsTheOther()
    leaf = torch.randn(5, 6, 3, requires_grad=True)  # (time or features, batch, 3)
    results = []
    for model in (nn.Sequential(stage), ParallelSequential(stage, chunks=chunks)):
        leaf.grad, stage.linear.weight.grad = None, None
        if how == "shifted in time":
            x = (leaf * 1).transpose(0, 1)  # (batch, time, 3)
            inputs = (x[:, :-1], x[:, 1:])
        elif how == "rows of time and batch":  # (the base's dimension 0 steps through time and batch)
            x = (leaf.flatten(0, 1) * 1).view(5, 6, 3).transpose(0, 1)  # (a base of 30 rows)
            inputs = (x[:, :-1], x[:, 1:])
        elif how == "some of the rows":  # (the base holds rows past time * batch)
            x = (torch.cat([leaf.flatten(0, 1), leaf[0, :1]]) * 1)[:30].view(5, 6, 3).transpose(0, 1)
            inputs = (x[:, :-1], x[:, 1:])
        else:
            x = (leaf * 1).permute(1, 2, 0)  # (batch, 3, 5): sibling views crossing in two dimensions
            inputs = (x[:, :, 1:4].transpose(1, 2), x[:, :, 2:5].transpose(1, 2))
        out = model(inputs)
        out.square().sum().backward()
        results.append((out.detach(), leaf.grad, stage.linear.weight.grad.clone()))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_a_batch_first_holder_copies_only_the_span_its_views_cover() -> None:
    # The holder built over a base whose batch is not its dimension 0 (see _batch_first) is cut
    # to the members' span: views of a few columns of a long sequence copy those, not all of it.
    from parallel_modules.pipeline import _batch_first, _copied_together

    base = torch.randn(100, 6, 3)  # (time, batch, 3)
    x = base.transpose(0, 1)
    members = [x[:, 10:13], x[:, 11:14]]
    holder = _batch_first(base, members)
    assert holder.shape == (6, 4, 3) and torch.equal(holder, x[:, 10:14])
    (_, first), (_, second) = _copied_together([members], 2)
    assert [p.shape for p in first] == [(3, 3, 3)] * 2 and first[0].untyped_storage().nbytes() == 3 * 4 * 3 * 4
    first[1].mul_(2)  # (the copies share their elements: a write through one shows in the other)
    torch.testing.assert_close(second[1][:, :2], 2 * x[3:, 11:13])


def test_input_views_of_an_expanded_base_are_split_as_nn_sequential_reads_them() -> None:
    # Views of an expanded tensor (a zero stride), one of them of its detached copy, whose base
    # is then the expanded tensor: building the holder with their batch first (see
    # _batch_first) divided offsets by the base's strides, and raised ZeroDivisionError for a
    # stage that only reads them.
    leaf = torch.randn(9, 2, 1, requires_grad=True)
    x = leaf.expand(9, 2, 2)
    inputs = (x[2:], x[:-2].detach()[:, :2])
    expected = nn.Sequential(nn.Flatten())(torch.cat(inputs, 1))
    got = ParallelSequential(_Concatenates(), chunks=3)(inputs)
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    torch.testing.assert_close(leaf.grad, torch.full_like(leaf, 2.0).index_fill_(0, torch.tensor([0, 1]), 0.0))


class _Concatenates(nn.Module):
    r"""Concatenates its inputs' flattened rows: reads them only."""

    def forward(self, inputs):
        return torch.cat([t.flatten(1) for t in inputs], 1)


class _DoublesOneAddsTheOtherAsFloats(_DoublesOneAddsTheOther):
    r"""Doubles its first input in place, then adds its second, which shares elements with it, read as floats."""

    def forward(self, inputs):
        first, second = inputs
        return super().forward((first, second.view(torch.float32)))


@pytest.mark.parametrize("chunks", [2, 3])
def test_input_views_no_one_tensor_holds_are_refused_written_in_place_while_autograd_records(chunks):
    # Views sharing elements in the same micro-batches that no one tensor holds (here one of
    # them read as another dtype) are copied one by one while autograd records: a write
    # through one did not show in the other, and the result silently differed from
    # nn.Sequential's. The write is refused; without autograd, the pieces views of the caller's memory, it runs.
    torch.manual_seed(0)
    stage = _DoublesOneAddsTheOtherAsFloats()
    leaf = torch.randn(6, 5, 3, requires_grad=True)
    pipe = ParallelSequential(stage, chunks=chunks)
    split = lambda x: (x[:, :-1], x.view(torch.int32)[:, 1:])  # noqa: E731
    with pytest.raises(RuntimeError, match=rf"ParallelSequential: stage '0' \(index 0\) wrote in place on micro-batch "
                                           rf"0 of {chunks} into input\[0\] and input\[1\] \(.*\), input tensors that share "
                                           rf"memory in a layout that no one tensor holds.*\.clone\(\).*chunks=1"):
        pipe(split(leaf * 1))
    with torch.no_grad():
        torch.testing.assert_close(pipe(split(leaf * 1)), nn.Sequential(stage)(split(leaf * 1)), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("how", ["setitem", "modules", "setattr"])
def test_a_stage_replaced_by_one_that_compares_equal_runs_the_new_one(how) -> None:
    # (A CPU hunt found per-branch compilation keeping the old child here: see test_compile.) The
    # plan's tuple of stages is compared by ``!=``, which calls a stage's own ``__eq__``; the plan
    # must still be made anew, by the block's watch of its children, however the stage is replaced.
    torch.manual_seed(0)
    model = ParallelSequential(nn.Linear(4, 4), EqualByClass(4, 4), chunks=2)
    x = torch.randn(4, 4)
    with torch.no_grad():
        model(x)
        new = EqualByClass(4, 4)
        if how == "setitem":
            model[1] = new
        elif how == "modules":
            model._modules["1"] = new
        else:
            setattr(model, "1", new)
        expected = torch.cat([new(model[0](piece)) for piece in x.tensor_split(2)])  # (the same pieces)
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_a_stage_appended_by_another_thread_during_a_call_is_not_run_by_that_call():
    # chunks=1 iterated the pipeline's live dict of stages: another thread's append in the
    # middle of a call raised "dictionary changed size during iteration". The call runs the
    # stages it started with; the next call runs the new one too.
    torch.manual_seed(0)
    stages = [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)]
    pipe = ParallelSequential(*stages)
    x = torch.randn(3, 8)
    added = nn.Linear(4, 2)
    stages[0].register_forward_hook(appending_from_another_thread(pipe, added, 3))
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), nn.Sequential(*stages)(x))
        torch.testing.assert_close(pipe(x), nn.Sequential(*stages, added)(x))


def test_the_softmax_check_sees_a_hook_added_after_the_first_call():
    # Before: the check's key held the input's dims and the modules' modes, not their hooks: a
    # forward hook added to stage 0 after the first call, making its output 3-D, had Softmax()
    # resolve its dim to 0 unchecked (the batch normalized per micro-batch, off nn.Sequential's),
    # where a new pipeline with the hook is refused.
    torch.manual_seed(0)
    pipe = ParallelSequential(nn.Linear(4, 4), nn.Softmax(dim=-2), chunks=2)
    x = torch.randn(6, 3, 4)  # (Softmax(dim=-2) on 3-D: dim 1, within each sample)
    torch.testing.assert_close(pipe(x), nn.Sequential(*pipe)(x))
    handle = pipe[0].register_forward_hook(lambda m, args, out: out.flatten(1))  # (2-D: dim -2 is 0)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"stage '1' \(index 1\) contains '1' \(Softmax\(dim=-2\)\)"):
            pipe(x)
    handle.remove()  # (as it was: works again, and equals nn.Sequential)
    torch.testing.assert_close(pipe(x), nn.Sequential(*pipe)(x))


def test_the_unbatched_sequence_check_sees_a_pre_hook_added_after_the_first_call():
    # Before: as for the softmax check, a pre-hook added to the recurrent stage after the first
    # call, handing it each micro-batch's first step (a 2-D input: one unbatched sequence, cut by
    # the micro-batches), went unchecked.
    torch.manual_seed(0)
    pipe = ParallelSequential(nn.Linear(4, 4), _Gru(), chunks=2)
    x = torch.randn(6, 5, 4)
    torch.testing.assert_close(pipe(x), nn.Sequential(*pipe)(x))
    pipe[1].gru.register_forward_pre_hook(lambda m, args: (args[0][:, 0],))
    with pytest.raises(RuntimeError, match=r"contains '1.gru' \(GRU, batch_first=True\), given a 2-D input"):
        pipe(x)


@pytest.mark.parametrize("stage", [lambda: nn.Softmax(dim=-1), lambda: _Gru()])
def test_the_first_call_checks_remember_a_bounded_number_of_keys(monkeypatch, stage):
    # Before (a CPU hunt for unbounded growth): the softmax and unbatched-sequence checks kept
    # every key they had seen, in a set without bound, and their keys hold the ids of forward
    # hooks, never reused: a hook added and removed around each call (an activation logger)
    # grew it by one at every call, for the life of the pipeline.
    from parallel_modules import _inputs
    monkeypatch.setattr(_inputs, "_MAX_PLANS", 8)
    pipe = ParallelSequential(nn.Linear(4, 4), stage(), chunks=2)
    x = torch.randn(4, 3, 4)
    for _ in range(20):
        handle = pipe[0].register_forward_hook(lambda m, args, out: None)
        pipe(x)
        handle.remove()
    assert len(pipe._softmax_checked) == 8
    torch.testing.assert_close(pipe(x), nn.Sequential(*pipe)(x))  # (checked again, as before)


class _PickX(nn.Module):
    def forward(self, d):
        return d["x"]


def test_chunks_set_by_another_thread_during_a_call_cuts_no_input_the_checks_did_not_see():
    # Before: a call read ``chunks`` again and again: set from 1 to 2 by another thread after the
    # call had skipped the check of batch-mixing modules (chunks=1) but before it cut the input,
    # a BatchNorm in training ran on micro-batches, silently, a result of neither setting (off
    # nn.Sequential's by 0.7). The interleaving is forced here where the call takes its stages.
    torch.manual_seed(0)
    pipe = ParallelSequential(_PickX(), nn.Linear(4, 4), nn.BatchNorm1d(4), chunks=1)
    reference = copy.deepcopy(nn.Sequential(*pipe))
    x = torch.randn(8, 4)
    stages = pipe._stages

    def set_meanwhile():
        pipe.chunks = 2
        return stages()

    pipe._stages = set_meanwhile
    torch.testing.assert_close(pipe({"x": x}), reference({"x": x}))  # (as with chunks=1)
    del pipe._stages
    torch.testing.assert_close(pipe[2].running_mean, reference[2].running_mean)
    with pytest.raises(RuntimeError, match=r"stage '2' \(index 2\) contains '2' \(BatchNorm1d\)"):
        pipe({"x": x})  # (the later call: chunks=2)


class _SettingChunks(nn.Module):
    r"""Sets its pipeline's ``chunks`` to 4 while a call of it runs (as another thread could), then ``then(x)``."""

    def __init__(self, then: Callable[[Any], Any]) -> None:
        super().__init__()
        self.then = then
        self.pipe: list[ParallelSequential] = []  # (a list: not registered as a child)

    def forward(self, x: Any) -> Any:
        self.pipe[0].chunks = 4
        return self.then(x)


class _BatchNormSettingChunks(nn.BatchNorm1d):
    pipe: list[ParallelSequential] = []

    @property
    def mixes_batch(self) -> None:  # (read by the check of batch-mixing modules, which it then refuses)
        type(self).pipe[0].chunks = 4
        return None


def _written_in_place(d: dict) -> torch.Tensor:
    d["seen"] = True
    return d["x"]


@pytest.mark.parametrize("case", ["mixing", "softmax", "held", "shared"])
def test_errors_name_the_chunks_the_call_used_when_set_during_it(case: str) -> None:
    # Before: the errors read ``chunks`` anew, and named 4, set (as by another thread) during a call
    # cut into 2 micro-batches, which the call had read once; the number named must be the call's.
    x = torch.randn(8, 3)
    if case == "mixing":
        norm = _BatchNormSettingChunks(3)
        pipe = ParallelSequential(nn.Linear(3, 3), norm, chunks=2)
        _BatchNormSettingChunks.pipe = [pipe]
        expected, input = r"\(_BatchNormSettingChunks\), which normalizes .* so with chunks=2 each", x
    elif case == "softmax":
        setting = _SettingChunks(lambda v: v.unsqueeze(1))
        pipe = ParallelSequential(setting, nn.Softmax(), chunks=2)
        setting.pipe.append(pipe)
        expected, input = r"across the batch, so with chunks=2 the result", x
    elif case == "held":
        setting = _SettingChunks(_written_in_place)
        pipe = ParallelSequential(setting, chunks=2)
        setting.pipe.append(pipe)
        expected, input = r"left as they came: with chunks=2 each micro-batch", {"x": x}
    else:
        setting = _SettingChunks(lambda v: v[0].add_(1))
        pipe = ParallelSequential(setting, chunks=2)
        setting.pipe.append(pipe)
        expected, input = r"\(as \(x\[:-1\], x\[1:\]\) do\): with chunks=2, one", (x[:-1], x[1:])
    with pytest.raises(RuntimeError, match=rf"(?s){expected}"):
        with torch.no_grad():
            pipe(input)


def test_dropout_in_training_draws_its_masks_micro_batch_by_micro_batch() -> None:
    # What the docs promise for random stages: with chunks=1 the masks nn.Sequential draws for the
    # same seed; with more, each stage draws for one micro-batch at a time, in the order the CPU
    # runs them (every stage on micro-batch 0, then on 1, ...), so not nn.Sequential's masks.
    stages = [nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5)]
    x = torch.randn(6, 8)
    ref = nn.Sequential(*stages)
    torch.manual_seed(0)
    expected = ref(x)
    torch.manual_seed(0)
    assert torch.equal(ParallelSequential(*stages)(x), expected)
    model = ParallelSequential(*stages, chunks=3)
    torch.manual_seed(0)
    pieces = _pieces_reference(model, x, 3)
    torch.manual_seed(0)
    out = model(x)
    assert torch.equal(out, pieces) and not torch.equal(out, expected)


# ------------------------------------------------------------ mixed precision and saved tensors
def _mixed_precision_pipeline(device: str) -> ParallelSequential:
    torch.manual_seed(0)
    return ParallelSequential(
        nn.Sequential(nn.Linear(16, 32), nn.GELU()),
        Parallel(*[nn.Sequential(nn.Linear(32, 16), nn.GELU()) for _ in range(2)], fuse=True),  # (fused: 32 wide)
        Parallel(OwnAutocast(32, 16), nn.Linear(32, 16), join="sum"),
        Float32Region(16, 8),
        chunks=3,
    ).to(device)


def _pipeline_grads(model: nn.Module, x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out.float().square().sum(), [x, *model.parameters()])


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_autocast_around_a_pipeline_gives_the_dtypes_values_and_gradients_of_its_stages(device):
    # Micro-batches run on each stage's stream under the caller's autocast; calls alternate
    # with and without it, so that nothing chosen under one carries over to the other.
    model = _mixed_precision_pipeline(device)
    plain = nn.Sequential(*model)
    for on in (True, False, True, False):
        x = torch.randn(7, 16, device=device, requires_grad=True)
        with torch.autocast(device, dtype=half(device), enabled=on):
            out = model(x)
            pieces = torch.cat([plain(p) for p in x.tensor_split(3)])
            whole = plain(x)
        assert out.dtype == pieces.dtype == whole.dtype == torch.float32  # (the head's)
        assert torch.equal(out, pieces)  # (the same operations on the same micro-batches)
        tol = dict(rtol=2e-2, atol=2e-2) if on else dict(rtol=RTOL, atol=ATOL)  # (other batch sizes' kernels)
        torch.testing.assert_close(out, whole, **tol)
        for g, e in zip(_pipeline_grads(model, x, out), _pipeline_grads(model, x, pieces)):
            torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL)
        # A half-precision input as autocast leaves it (the stage before the head casts none).
        with torch.autocast(device, dtype=half(device), enabled=on):
            reduced = model[:3](x.detach())
        assert reduced.dtype == (half(device) if on else torch.float32)


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("amp", [False, True])
def test_saved_tensor_hooks_see_a_pipeline_save_each_micro_batch_once(device, amp):
    # A pipeline saves what its stages save on each micro-batch, once, and its backward
    # unpacks each once, none in the forward.
    model = _mixed_precision_pipeline(device)
    plain = nn.Sequential(*model)
    counts = []
    for pipelined in (True, False):
        x = torch.randn(7, 16, device=device, requires_grad=True)
        packed, unpacked = [], []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t,
                                                      lambda t: unpacked.append(1) or t):
            with torch.autocast(device, dtype=half(device), enabled=amp):
                out = model(x) if pipelined else torch.cat([plain(p) for p in x.tensor_split(3)])
            before = len(unpacked)
            _pipeline_grads(model, x, out)
        counts.append((len(packed), before, len(unpacked)))
    assert counts[0] == counts[1] and counts[0][1] == 0 and counts[0][0] == counts[0][2], counts


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("how", ["checkpoint", "checkpoint-reentrant", "save_on_cpu", "save_on_cpu-pinned"])
def test_checkpoint_and_save_on_cpu_around_a_pipeline_under_autocast_give_its_stages_gradients(device, how):
    model = _mixed_precision_pipeline(device)
    plain = nn.Sequential(*model)

    def pieces(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([plain(p) for p in x.tensor_split(3)])

    def run(module, x):
        return under_autocast_saving(how, device, module, x)

    for _ in range(2):
        x = torch.randn(7, 16, device=device, requires_grad=True)
        out, expected = run(model, x), run(pieces, x)
        assert torch.equal(out, expected)
        grads = []
        for y in (out, expected):  # (a reentrant checkpoint refuses torch.autograd.grad: into .grad)
            model.zero_grad(set_to_none=True)
            x.grad = None
            y.square().sum().backward()
            grads.append([x.grad, *(p.grad for p in model.parameters())])
        for g, e in zip(*grads):
            torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL)
