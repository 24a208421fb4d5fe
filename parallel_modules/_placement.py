r"""Branches placed on different CUDA devices: copy the input over, run, bring the outputs back.

A :class:`~parallel_modules.Parallel` whose branches have their parameters on
more than one CUDA device (``Parallel(a.to("cuda:0"), b.to("cuda:1"))``) runs
each branch on its own device, on the input copied there, and gathers the
outputs on the *caller's device* -- the device of the input -- where they are
joined. The result is that of running, one after the other,
``branch(x.to(branch_device)).to(x.device)``.

Which device a branch runs on: the one device of its parameters and buffers.
A branch with none (``nn.ReLU()``, a function) or with several of its own (a
nested multi-device ``Parallel``, the user's own model-parallel code) runs on
the caller's device with the input as given, and places its work itself.
Branches on the caller's device are *local*; they run as in a single-device
``Parallel`` (first on the caller's stream, the others forked onto side
streams). The others are *remote*.

Streams and events for remote branch ``k`` on device ``d`` (caller's device
``c``, caller's stream ``C``, the current stream of ``d`` when the call starts
``D``), all drawn from the pools of :mod:`._streams`::

    C  --fork_c-->  T_k (side stream of c): copy x to d ............ wait S_k --join--> C
    D  --fork_d-->  S_k (side stream of d): wait T_k, branch k, copy out to c  --join--> C, D

* **copy in** -- PyTorch issues a copy between two devices on the *source*
  device's current stream, fenced on both sides by events against the
  destination device's current stream (``copy_device_to_device`` in ATen;
  through NVLink/PCIe peer access where the devices have it, which ATen
  enables on first use, staged otherwise). So while ``x.to(d)`` runs, ``T_k``
  is current on ``c`` and ``S_k`` on ``d``: the copy runs on ``T_k`` after it
  waited on ``fork_c`` (the input is produced), and ``S_k`` waits for the copy
  before the branch starts. The caller's stream is never held up by the copy,
  so local branches start at once.
* **parameters** -- ``S_k`` also waits on ``fork_d``, recorded on ``D``: an
  optimizer step (or any write) the user enqueued on ``d`` before the call
  has finished when the branch reads the parameters.
* **copy out** -- ``y.to(c)`` runs on ``S_k`` (now the source side) right after
  the branch, and ``T_k`` waits for it; nothing waits on ``C``, so a remote
  branch never waits for the local ones either.
* **join** -- ``C`` waits on an event of ``T_k`` and one of ``S_k``, so the join
  and everything after it see finished outputs, and ``D`` waits on the one of
  ``S_k``, so later work on ``d`` (an in-place update of the branch's
  parameters) cannot overtake the branch. Both joins are made whatever
  happened, so an exception in a branch leaves no stream running ahead.

Remote branches are issued first, each whole (copy in, branch, copy out), then
the local ones, so the remote devices are busy while the caller's device works.
While a remote branch runs, its device is the current device and ``S_k`` that
device's current stream, so code in the branch that relies on the current
device (``device="cuda"``, ``torch.cuda.current_stream()``) addresses its own
device; the caller's current device and streams are restored afterwards.

Memory lifetime, without a synchronisation:

* the input ``x`` belongs to ``C``'s pool and is read on ``T_k``; ``C`` waits
  for ``T_k`` before anything it enqueues later (such as reusing ``x``'s
  memory once the caller drops it), so nothing more is needed;
* ``x.to(d)`` and everything the branch allocates belong to ``S_k``'s pool on
  ``d`` and are used on ``S_k`` only (the copy-in that writes the first one
  is fenced against ``S_k`` by ATen's events), so stream order protects them;
* a gathered output is allocated on ``c`` while ``T_k`` is current, so its
  block belongs to ``T_k``'s pool, but the caller uses it on ``C``: it is
  marked with :meth:`torch.Tensor.record_stream` for ``C``, as outputs of
  side streams are in :mod:`._streams`, so the allocator does not hand the
  block to a later allocation on ``T_k`` while ``C`` may still read it.

Autograd: the copies are ``Tensor.to``, which is differentiable, so gradients
flow back across devices. The engine runs each backward op on the stream of
its forward op (the backward of the copy-in on ``S_k``, of the copy-out on
``T_k``) and, for a gradient that crosses devices, follows the "multi-device
stream sync contract" of ``torch/csrc/autograd/input_buffer.cpp``: ATen's
events fence the copy, and the consumer waits on an event of the producer.

Not supported here: CUDA graphs (``cuda_graph=True``, or a capture that
encloses the block): a graph is captured on one device, so such a call is
refused with an error naming the devices; branches on the CPU (or ``meta``)
next to branches on CUDA, which is refused the same way; and a CPU input.
While a compiler traces the model, the branches run one after the other with
plain ``.to()`` copies, which trace to an ordinary graph.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from ._graphs import _CaptureError
from ._inputs import _input_device, _module_devices
from ._streams import (_capture_underway, _changed, _changed_in_place, _current_stream, _graph_state, _is_tracing,
                       _join_backward, _pool, _record_on, _recording, _run_forked, _set_stream, _watched)

if TYPE_CHECKING:
    from .parallel import Parallel

__all__: list[str] = []


class _Unplaced:
    r"""``Parallel._placement`` before the branches' devices have been looked at."""

    def __repr__(self) -> str:
        return "_UNPLACED"

    def __reduce__(self) -> str:
        return "_UNPLACED"  # pickles (and deep-copies) as the singleton


_UNPLACED: Any = _Unplaced()


def _place(module: "Parallel") -> "_Placement | None":
    r"""Where ``module``'s branches live: ``None`` when on one device (or none at all).

    Remembered on the module (until ``_reset``: ``.to()``, changed branches),
    except while a compiler traces, which must not see the module mutated.
    Branches spread over CUDA and another device type are refused, naming
    them; nothing is remembered then, so a fixed module works on its next call.
    """
    names, homes, seen = _homes(module)
    placement = None
    if len(seen) > 1:
        where = _where(seen)
        if any(d.type != "cuda" for d in seen):
            owner = type(module).__name__
            raise RuntimeError(
                f"{owner}: branches have parameters on different devices ({where}). Branches may be "
                f"placed on several CUDA devices, one device each, but not on {_kinds(seen)} at once. "
                f"Move them with {owner}.to(device), or move each branch to a CUDA device."
            )
        placement = _Placement(names, homes, where)
    if not _is_tracing():
        module._placement = placement
    return placement


def _homes(module: "Parallel") -> tuple[list[str], list[torch.device | None], dict[torch.device, str]]:
    r"""The branches' names, each branch's one device (``None``: none, or several), and the first branch
    seen on each device."""
    # (A snapshot, names and branches at once -- ``tuple()`` copies the dict under the GIL: another
    # thread appending a branch during the call would change the dict under the loop, or between
    # reading the names and the branches.)
    branches = tuple(module._modules.items())
    homes: list[torch.device | None] = []
    seen: dict[torch.device, str] = {}
    for name, child in branches:
        devices = _module_devices(child)
        for d in devices:
            seen.setdefault(d, name)
        homes.append(next(iter(devices)) if len(devices) == 1 else None)
    return [name for name, _ in branches], homes, seen


def _where(seen: dict[torch.device, str]) -> str:
    return ", ".join(f"branch {n!r} on {d}" for d, n in seen.items())


def _moved(module: "Parallel") -> str | None:
    r"""Where the branches are now, in words, if one moved since ``module`` placed them.

    A branch moved on its own (``block[1].to("cuda:1")``, ``.half()``) runs its
    own ``_apply``, not the block's, and registers nothing, so no call sees it
    (checking every branch's device on every call would cost tiny blocks a
    measurable part of their call). It shows as the branch's error -- a device
    mismatch -- which asks this: then the placement is forgotten, and the next
    call places the branches again.
    """
    placement = module._placement
    if placement is _UNPLACED or _is_tracing():
        return None
    _, homes, seen = _homes(module)
    if (placement.homes == homes) if placement is not None else len(seen) <= 1:
        return None
    module._placement = _UNPLACED
    return _where(seen)


def _kinds(devices: Any) -> str:
    kinds = sorted({d.type for d in devices})
    return " and ".join(kinds) if len(kinds) > 1 else f"several {kinds[0]} devices"


def _to(value: Any, device: torch.device) -> Any:
    r"""``value`` with its CUDA tensors on other devices copied to ``device``.

    CPU tensors stay where they are, as they would for a single-device module.
    ``non_blocking`` only matters for host memory; copies between devices are
    always asynchronous to the host and ordered by the streams described in
    this module's docstring.
    """

    def move(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.to(device, non_blocking=True) if t.is_cuda and t.device != device else t
        if dataclasses.is_dataclass(t) and not isinstance(t, type):
            # An unregistered dataclass is a pytree leaf: its tensors are moved here (a copy of
            # it holds them; the branch's own object is left as it was).
            moved = copy.copy(t)
            for f in dataclasses.fields(t):
                object.__setattr__(moved, f.name, pytree.tree_map(move, getattr(t, f.name)))
            return moved
        return t

    if isinstance(value, torch.Tensor):
        return move(value)
    return pytree.tree_map(move, value)


class _Placement:
    r"""The branches' devices, and how a call runs them (see the module docstring).

    Args:
        names: the branch names, in order.
        homes: each branch's device, ``None`` for a branch that runs on the
            caller's device (no parameters, or several devices of its own).
        where: the placement in words, for error messages.
    """

    def __init__(self, names: list[str], homes: list[torch.device | None], where: str) -> None:
        self.names = names
        self.homes = homes
        self.where = where

    def run(self, module: "Parallel", args: tuple, kwargs: dict) -> list[Any]:
        r"""The outputs of every branch, on the input's device, in branch order."""
        owner = type(module).__name__
        device = _input_device(args, kwargs)
        if device is None or device.type != "cuda":
            got = f"on {device}" if device is not None else "not a tensor"
            raise RuntimeError(
                f"{owner}: branches live on several CUDA devices ({self.where}), but the input is {got}. "
                f"Pass a CUDA tensor: each branch receives a copy on its own device and the outputs are "
                f"gathered on the input's device."
            )
        if _is_tracing():
            return self._one_by_one(module, device, args, kwargs)
        if _capture_underway():
            # (With cuda_graph=True, this is the block's own warm-up: a capture error, so that
            # graph_fallback=True runs the signature eagerly -- below, with no capture underway.)
            why = "cuda_graph=True" if module.cuda_graph else "a CUDA graph capture encloses it"
            raise (_CaptureError if module.cuda_graph else RuntimeError)(
                f"{owner}: {why}, but its branches live on several CUDA devices ({self.where}); a CUDA "
                f"graph is captured on one device, so multi-device placement cannot be graphed. Use "
                f"cuda_graph=False for this block, or graph each device's part on its own, e.g. "
                f"{owner}(Parallel(..., cuda_graph=True).to('cuda:0'), Parallel(..., cuda_graph=True)"
                f".to('cuda:1'))" + (", or pass graph_fallback=True to run it eagerly with a warning."
                                     if module.cuda_graph else ".")
            )
        # The branches of the input's device run with it current, forked or not (code in a
        # branch that allocates on "cuda" addresses the input's device). Making a stream
        # current also makes its device current (torch._C._cuda_setStream): the device
        # context puts the caller's current device back at the end.
        with torch.cuda.device(device):
            if module.streams is False:
                return self._one_by_one(module, device, args, kwargs)
            return self._forked(module, device, args, kwargs)

    # ------------------------------------------------------------ one by one
    def _one_by_one(self, module: "Parallel", device: torch.device, args: tuple, kwargs: dict) -> list[Any]:
        r"""Each branch on its device, one after the other, on the current streams.

        What a compiler traces (plain ``.to()`` copies, no stream operations)
        and what ``streams=False`` runs: ATen orders each copy against the
        current streams of both devices.
        """
        tracing = _is_tracing()
        outputs: list[Any] = []
        for i, (home, branch) in enumerate(zip(self.homes, module._branches())):
            target = device if home is None else home
            try:
                if target == device:
                    outputs.append(branch(*args, **kwargs))
                    continue
                a, k = _to((args, kwargs), target)
                if tracing:
                    out = branch(*a, **k)
                else:
                    with torch.cuda.device(target):
                        out = branch(*a, **k)
                outputs.append(_to(out, device))
            except Exception as e:
                raise module._branch_error(e, i)
        return outputs

    # ---------------------------------------------------------------- forked
    def _forked(self, module: "Parallel", device: torch.device, args: tuple, kwargs: dict) -> list[Any]:
        branches = module._branches()
        remote = [i for i, h in enumerate(self.homes) if h is not None and h != device]
        local = [i for i, h in enumerate(self.homes) if h is None or h == device]
        outputs: list[Any] = [None] * len(branches)
        if not remote:
            self._run_local(module, device, branches, local, args, kwargs, outputs)
            return outputs

        # Streams and events from every pool this call uses: the slots from
        # each pool's offset on, and the offsets moved past them while branches
        # run, so that a Parallel nested in a branch takes other streams and
        # never re-records one of these events before it has been waited on.
        pool_c = _pool(device)
        caller = _current_stream(device)
        base_c = pool_c.offset
        lanes = pool_c.side_streams(base_c, len(remote), caller)  # T_k: the copy lane of each remote branch
        forks_c, joins_c = pool_c.events(base_c + len(remote))
        fork_c = forks_c[base_c]
        members: dict[torch.device, list[int]] = {}
        for i in remote:
            members.setdefault(self.homes[i], []).append(i)  # type: ignore[arg-type]
        pools = []  # (pool, base) of each remote device, to restore
        work: dict[int, tuple] = {}  # branch -> (home, lane, its join, side stream, its join, fork_d, D)
        for home, group in members.items():
            pool_d = _pool(home)
            base_d = pool_d.offset
            current_d = _current_stream(home)
            sides = pool_d.side_streams(base_d, len(group), current_d)
            forks_d, joins_d = pool_d.events(base_d + len(group))
            pools.append((pool_d, base_d))
            for s, i in enumerate(group):
                j = remote.index(i)
                work[i] = (home, lanes[j], joins_c[base_c + j], sides[s], joins_d[base_d + s], forks_d[base_d],
                           current_d)

        fork_c.record(caller)
        for home, group in members.items():
            _, _, _, _, _, fork_d, current_d = work[group[0]]
            fork_d.record(current_d)
        pool_c.offset = base_c + len(remote)
        for pool_d, base_d in pools:
            pool_d.offset = base_d + len(members[pool_d.device])
        # The remote copies read the input on the lanes while the local branches run on
        # the caller's stream: one that changes the input in place would race with them.
        # (Watched from before the remote branches, which are named if one changed it.)
        watched = _watched(args, kwargs)
        versions = [a._version for a in watched]
        # Autocast caches a parameter's cast copy per thread, not per stream: two
        # branches sharing a weight on one device would read the copy on one side
        # stream while another writes it (see _streams._run_forked).
        cached_casts = torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled()
        if cached_casts:
            torch.set_autocast_cache_enabled(False)
        launched: list[int] = []
        try:
            for i in remote:
                home, lane, lane_done, side, side_done, fork_d, current_d = work[i]
                # (The waits first: a wait that fails, after a stream was made current, would
                # leave it current for the thread, which the ``finally`` below does not undo.)
                lane.wait_event(fork_c)
                side.wait_event(fork_d)
                _set_stream(lane)  # current on the caller's device: where ATen copies from it
                _set_stream(side)  # current on the branch's device
                torch.cuda.set_device(home)  # code in the branch sees its own device as current
                launched.append(i)
                try:
                    a, k = _to((args, kwargs), home)  # copied on the lane; the branch waits for it
                    out = branches[i](*a, **k)
                    outputs[i] = _to(out, device)  # copied on the branch's stream; the lane waits for it
                except Exception as e:
                    raise module._branch_error(e, i)
                finally:
                    # The caller's streams current again before the records, which can
                    # raise. Recorded whatever happened: the joins below must cover all
                    # work already enqueued on both streams.
                    _set_stream(caller)
                    _set_stream(current_d)
                    lane_done.record(lane)
                    side_done.record(side)
                if watched and _changed(watched, versions):  # (an input left where it was: a CPU one)
                    raise module._branch_error(_changed_in_place(), i)
            # Local branches last: the remote ones are already queued on their
            # devices and overlap whatever runs here.
            self._run_local(module, device, branches, local, args, kwargs, outputs)
            if local and _changed(watched, versions):
                # (No join follows: the note _run_forked made for the local branches is
                # reset by the thread's next Parallel.forward.)
                raise module._branch_error(_changed_in_place(), local[-1])
        finally:
            if cached_casts:
                torch.set_autocast_cache_enabled(True)
            pool_c.offset = base_c
            for pool_d, base_d in pools:
                pool_d.offset = base_d
            for i in launched:
                _, _, lane_done, _, side_done, _, current_d = work[i]
                caller.wait_event(lane_done)
                caller.wait_event(side_done)
                current_d.wait_event(side_done)
        for i in remote:
            _record_on(outputs[i], caller)
        # Remote parameters' gradients are summed on the remote streams. (Never
        # under a capture: placement refuses it above.)
        _join_backward((*args, *kwargs.values()), [s for i in launched for s in (work[i][1], work[i][3])])
        if torch.is_grad_enabled() and _recording(outputs):
            # The remote outputs' copies read the join's gradient on the lanes, beside the local
            # branches on the caller's stream: the join holds it (see _streams, backward), as after
            # any fork -- with one local branch or none, _run_forked did not note one.
            _graph_state.forked = True
        return outputs

    def _run_local(self, module: "Parallel", device: torch.device, branches: list[Any], local: list[int],
                   args: tuple, kwargs: dict, outputs: list[Any]) -> None:
        r"""The branches of the caller's device: forked as in a single-device ``Parallel``."""
        if not local:
            return

        calls = [branches[i] for i in local]
        torch.cuda.set_device(device)  # restored by run()
        if len(calls) == 1:
            try:
                results = [calls[0](*args, **kwargs)]
            except Exception as e:
                raise module._branch_error(e, local[0])
        else:
            results = _run_forked(calls, device, None, None, (*args, *kwargs.values()), args=args, kwargs=kwargs,
                                  error=lambda e, k: module._branch_error(e, local[k]))
        for i, out in zip(local, results):
            outputs[i] = out
