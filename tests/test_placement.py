"""``Parallel`` with branches on different devices: what the CPU can check.

Running branches on several GPUs is tested in ``test_placement_cuda.py`` (two GPUs); here:
mixed device types are refused with a clear error, and the module's memory of where its
branches live is formed once and forgotten whenever the branches or their devices change.
"""

from __future__ import annotations

import copy
import pickle
from collections import OrderedDict

import pytest
import torch
from torch import nn

from parallel_modules import Parallel
from parallel_modules._placement import _UNPLACED
from tests._reference import assert_same


def test_cpu_and_meta_branches_refused_naming_both():
    p = Parallel(OrderedDict(host=nn.Linear(4, 4), nowhere=nn.Linear(4, 4, device="meta")))
    for _ in range(2):  # nothing is remembered from a refused call
        with pytest.raises(RuntimeError) as ei:
            p(torch.randn(2, 4))
        msg = str(ei.value)
        assert "Parallel" in msg and "'host'" in msg and "'nowhere'" in msg
        assert "cpu" in msg and "meta" in msg and "CUDA" in msg
    p[1] = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    assert_same(p(x), torch.cat([p[0](x), p[1](x)], 1))


def test_placement_is_looked_at_once_and_forgotten_on_change():
    p = Parallel(nn.Linear(4, 4), nn.Linear(4, 4))
    assert p._placement is _UNPLACED
    p(torch.randn(2, 4))
    assert p._placement is None  # one device: the single-device path, nothing more per call
    p.append(nn.Linear(4, 4))
    assert p._placement is _UNPLACED
    p(torch.randn(2, 4))
    p.to(torch.float64)
    assert p._placement is _UNPLACED


def test_unplaced_marker_survives_pickle_and_deepcopy():
    assert pickle.loads(pickle.dumps(_UNPLACED)) is _UNPLACED
    p = Parallel(nn.Linear(4, 4), nn.Linear(4, 4))
    p(torch.randn(2, 4))
    for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert q._placement is _UNPLACED
        x = torch.randn(3, 4)
        assert_same(q(x), torch.cat([q[0](x), q[1](x)], 1))


def test_a_branch_moved_on_its_own_is_placed_again_after_its_error():
    # ``block.other.to(...)`` runs the branch's _apply, not the block's, and registers nothing.
    p = Parallel(OrderedDict(host=nn.Linear(4, 4), other=nn.Linear(4, 4)))
    x = torch.randn(2, 4)
    p(x)
    p.other.to("meta")
    with pytest.raises(RuntimeError) as ei:  # the branch's own device mismatch, and why
        p(x)
    notes = "\n".join(getattr(ei.value, "__notes__", [])) or str(ei.value)
    assert "'other'" in notes and "moved" in notes and "meta" in notes, notes
    with pytest.raises(RuntimeError, match="different devices.*'host' on cpu.*'other' on meta"):
        p(x)  # placed again: the block's own error, naming both
    p.other.to_empty(device="cpu")
    p.other.reset_parameters()  # (to_empty's memory is uninitialized: a NaN in it failed the comparison)
    assert_same(p(x), torch.cat([p.host(x), p.other(x)], 1))


# ----------------------------------------------------------------------------------------------
# Branches on two CUDA devices, run on the CPU: the streams, events and devices of
# ``_Placement._forked`` replaced by stand-ins, cuda:0 the caller's device, cuda:1 the other.

import contextlib  # noqa: E402
import dataclasses  # noqa: E402

from torch.utils import _pytree as pytree  # noqa: E402

from parallel_modules import _placement, _streams  # noqa: E402
from parallel_modules._placement import _Placement  # noqa: E402

C, D = torch.device("cuda", 0), torch.device("cuda", 1)


class _Event:
    def record(self, stream) -> None:
        pass


class _Stream:
    def wait_event(self, event) -> None:
        pass


class _Pool:
    def __init__(self, device: torch.device) -> None:
        self.device, self.offset = device, 0
        self.streams = [_Stream() for _ in range(8)]
        self.forks, self.joins = [_Event() for _ in range(8)], [_Event() for _ in range(8)]

    def side_streams(self, offset: int, count: int, caller=None) -> list:
        return self.streams[offset:offset + count]

    def events(self, end: int) -> tuple:
        return self.forks, self.joins


@pytest.fixture
def two_devices(monkeypatch):
    pools = {C: _Pool(C), D: _Pool(D)}
    monkeypatch.setattr(_placement, "_pool", lambda d: pools[d])
    monkeypatch.setattr(_placement, "_current_stream", lambda d: _Stream())
    monkeypatch.setattr(_placement, "_set_stream", lambda s: None)
    monkeypatch.setattr(_placement, "_to", lambda v, d: pytree.tree_map_only(torch.Tensor, torch.clone, v))
    monkeypatch.setattr(_placement, "_record_on", lambda o, s: None)
    monkeypatch.setattr(_placement, "_join_backward", lambda i, s: None)
    monkeypatch.setattr(_placement, "_input_device", lambda a, k: C)
    monkeypatch.setattr(_placement, "_capture_underway", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)


def placed(branches: OrderedDict, homes: list, **kwargs) -> Parallel:
    p = Parallel(branches, streams=True, **kwargs)
    p._placement = _Placement(list(branches), homes, "stand-in devices")
    return p


def test_the_one_local_branch_changing_the_input_in_place_is_refused(two_devices):
    # The copy to cuda:1 reads the input on a side stream while the local branch runs.
    p = placed(OrderedDict(local=nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4)), remote=nn.Linear(4, 4)),
               [C, D], join=None)
    with pytest.raises(RuntimeError, match="in place") as ei:
        p(torch.randn(8, 4))
    assert "'local'" in "\n".join(getattr(ei.value, "__notes__", [])) + str(ei.value)
    p.local[0].inplace = False
    assert len(p(torch.randn(8, 4))) == 2  # works after the error


class _Masked(nn.Linear):
    def __init__(self, bump: bool = False) -> None:
        super().__init__(4, 4)
        self.bump = bump

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.bump:
            mask.add_(1)  # a CPU input, which the copy to the branch's device leaves where it is
        return super().forward(x)


def test_a_refused_call_leaves_no_join_gradients_to_hold(two_devices, monkeypatch):
    # The two local branches ran forked (noted for the join, which then holds the gradient a sum
    # hands them: see _streams, backward), then the remote branch's write to an input refused the
    # call: no join ran, and the note made the thread's next join, of a block that never forked,
    # hold its gradients.
    from parallel_modules import _joins

    def forked(calls, device, run, capturing=None, inputs=(), join=None, *rest, args=(), kwargs=None, error=None):
        outputs = [call(*args, **(kwargs or {})) for call in calls]  # as _run_forked returns them, noted
        if torch.is_grad_enabled() and _streams._recording(outputs):
            _streams._graph_state.forked = True
        return outputs

    monkeypatch.setattr(_placement, "_run_forked", forked)
    monkeypatch.setattr(_placement, "_to", lambda v, d: v)  # (CPU tensors stay where they are)
    p = placed(OrderedDict(a=_Masked(), b=_Masked(), remote=_Masked(bump=True)), [C, C, D], join="sum")
    with pytest.raises(RuntimeError, match="in place") as error:
        p(torch.randn(2, 4), mask=torch.zeros(2))
    assert "branch 'remote'" in error.value.__notes__[-1]  # the branch that wrote, not the last local one
    held = []
    monkeypatch.setattr(_joins, "_hold_join_gradients", lambda *a, **k: held.append(a))
    other = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), join="sum")
    other(torch.randn(2, 4)).sum().backward()
    assert held == []


def test_placed_branches_are_compiled_as_asked(two_devices):
    torch._dynamo.reset()
    compiled = []

    def backend(gm, inputs):
        compiled.append(gm)
        return gm.forward

    p = placed(OrderedDict(a=nn.Linear(4, 4), b=nn.Linear(4, 4)), [C, D], compile=backend)
    try:
        p(torch.randn(2, 4))
    finally:
        torch._dynamo.reset()
    assert len(compiled) == 2


class _AutocastCacheProbe(nn.Module):
    def __init__(self, seen: list) -> None:
        super().__init__()
        self.linear, self.seen = nn.Linear(4, 4), seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.is_autocast_cache_enabled())
        return self.linear(x)


class _Refused(_Event, _Stream):
    def record(self, stream) -> None:
        raise RuntimeError("CUDA error: an injected failure")

    def wait_event(self, event) -> None:
        raise RuntimeError("CUDA error: an injected failure")


@pytest.mark.parametrize("where", ["wait", "record"])
def test_a_remote_branchs_stream_failing_leaves_the_callers_streams_current(two_devices, monkeypatch, where):
    # The remote branch's side stream was made current before its wait on the fork, and the
    # caller's streams made current again after the records of its joins: a failure of either
    # (a CUDA error, a KeyboardInterrupt) left a side stream current for the rest of the thread.
    callers = {C: _Stream(), D: _Stream()}
    current = dict(callers)
    monkeypatch.setattr(_placement, "_current_stream", lambda d: callers[d])
    monkeypatch.setattr(_placement, "_set_stream", lambda s: current.__setitem__(s.device, s))
    pools = {d: _placement._pool(d) for d in (C, D)}
    for d, pool in pools.items():
        pool.streams = [_Refused() if where == "wait" and d == D and i == 0 else _Stream() for i in range(8)]
        for s in (*pool.streams, callers[d]):
            s.device = d
    if where == "record":
        pools[C].joins[0] = _Refused()
    p = placed(OrderedDict(a=nn.Linear(4, 4), b=nn.Linear(4, 4)), [C, D])
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="injected"):
        p(x)
    assert current == callers
    assert pools[C].offset == pools[D].offset == 0


def test_autocast_cache_is_off_while_remote_branches_run(two_devices):
    # Two branches on cuda:1 on two side streams: a weight cast by one would be read by the other unwaited.
    seen: list = []
    p = placed(OrderedDict(a=nn.Linear(4, 4), b=_AutocastCacheProbe(seen), c=_AutocastCacheProbe(seen)), [C, D, D],
               join=None)
    torch.set_autocast_enabled("cuda", True)
    try:
        p(torch.randn(2, 4))
        assert torch.is_autocast_cache_enabled()  # put back
    finally:
        torch.set_autocast_enabled("cuda", False)
    assert seen == [False, False]


@dataclasses.dataclass
class _Out:
    y: torch.Tensor
    n: int = 1


class _OnCuda(torch.Tensor):
    r"""A CPU tensor that says it is on CUDA, and logs where ``to`` sends it."""

    moved: list = []
    is_cuda = property(lambda self: True)  # type: ignore[assignment]

    def to(self, device, **kwargs):  # type: ignore[override]
        _OnCuda.moved.append(device)
        return torch.Tensor.clone(self)


def test_tensors_inside_dataclasses_are_moved():
    _OnCuda.moved.clear()
    out = _Out(torch.randn(2).as_subclass(_OnCuda), 3)
    moved = _placement._to({"a": out}, C)
    assert _OnCuda.moved == [C]
    assert isinstance(moved["a"], _Out) and moved["a"].n == 3 and moved["a"].y is not out.y
    assert out.y.__class__ is _OnCuda  # the branch's own object is left as it was


def test_recording_a_single_cpu_output_is_a_no_op(monkeypatch):
    # A remote branch returned a CPU tensor: nothing is recorded (record_stream has no CPU kernel).
    recorded: list = []
    monkeypatch.setattr(_streams, "_record_tensor", lambda t, s: recorded.append((t, s)))
    cpu = torch.randn(2)
    _streams._record_on(cpu, "side")
    _streams._record_on((cpu, {"a": [cpu]}), "side")
    assert recorded == []
    # (The spy is the one called: a tensor that says it is on CUDA is recorded, alone or nested.)
    on_cuda = torch.randn(2).as_subclass(_OnCuda)
    _streams._record_on(on_cuda, "side")
    _streams._record_on((cpu, {"a": [on_cuda]}), "side")
    assert [(t is on_cuda, s) for t, s in recorded] == [(True, "side"), (True, "side")]
