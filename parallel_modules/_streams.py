r"""Side streams and the fork/join protocol between them.

Every :class:`~parallel_modules.Parallel` and
:class:`~parallel_modules.ParallelSequential` draws its side streams from one
pool per device, owned by this module. Streams are created lazily, the first
time a device needs them, and reused by every later call and every module
instance, so a model never creates a stream per call.

Stream order, in one place:

* **fork** -- one event is recorded on the caller's *current* stream (not the
  default stream) and every side stream waits on it before it runs anything,
  so each branch sees its input fully produced;
* **join** -- after a side branch has been launched, an event is recorded on
  its stream and the caller's stream waits on it, so everything the caller
  enqueues afterwards (the join itself, the next layer) sees finished outputs;
* **backward** -- the autograd engine runs each backward operation on the
  stream its forward ran on, and hands gradients between streams with events.
  A parameter's gradient, though, is summed into ``.grad`` by its own node
  after the branch's input gradient has been handed on: a reader of ``.grad``
  in the middle of the backward pass (FSDP2's reduce-scatter of an enclosing
  module starts when that module's input gradient is ready) would run ahead
  of it. The engine makes the caller wait for such side streams only at the
  end of ``backward()``; :func:`_join_backward` makes it wait as soon as the
  gradient of the block's input is complete;
  One gradient handed to branches on two streams -- a ``sum`` or ``mean``
  join's, which ``add``'s backward passes to every branch as one tensor --
  must stay referenced until the backward pass ends: the engine sums a
  node's incoming gradients into one of them in place once it holds the last
  reference to it (and frees it once nothing does), on the consumer's
  stream, while the other stream's kernels may still be queued to read it --
  their node ran and let go of it. Seen on the H200 machine: wrong gradients
  for a fused group's parameters beside a side branch, with the side
  branch's backward delayed, and on every call under a CUDA graph. The
  join's nodes hold them (:func:`_hold_join_gradients`);
* **memory** -- a tensor allocated on a side stream and handed to the caller
  is marked with :meth:`torch.Tensor.record_stream`, so the caching allocator
  does not give its block to another side-stream allocation while the
  caller's stream may still read it. Inputs were allocated on the caller's
  stream, which waits for every side stream before it can free them; while
  autograd records, a side branch may save an input and read it again in
  backward, so inputs are marked with ``record_stream`` for the side streams
  then (:func:`_join_backward`). When the caller's stream only reads the outputs in a join that
  consumes them (``cat``, ``sum``...), a cheaper scheme does the same: after
  the join is enqueued, every side stream waits for the caller's stream, and
  only then are the outputs freed -- so any later allocation on a side stream,
  whoever makes it, runs after the join's reads. This holds only for outputs
  nothing else references (a hook may keep one, an autograd node may save
  it): those are checked by reference count and marked with
  ``record_stream`` as before. ``record_stream`` costs an event record when
  the tensor is freed and event queries at later allocations, about 4 us of
  CPU per side branch on the GPU machine; the wait costs about 1 us.

None of this is done while a compiler traces the model (see
:func:`_is_tracing`): the traced graph holds the branches one after the other,
and the compiler is free to schedule them.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.autograd.forward_ad as _forward_ad
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
from torch.fx import _symbolic_trace
from torch.overrides import _get_current_function_mode_stack as _function_mode_stack
from torch.utils._device import DeviceContext as _DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakTensorKeyDictionary

__all__: list[str] = []

# More side streams than this per device bring nothing: in eager mode the GPU
# multiplexes streams onto CUDA_DEVICE_MAX_CONNECTIONS (8 by default) hardware
# queues, and PyTorch's own stream pool holds 32 streams per priority. Beyond
# the cap, branches share streams round-robin, which stays correct (work on one
# stream is ordered) and only limits concurrency.
_MAX_SIDE_STREAMS = 32


# The fork/join protocol runs on every call, so its CPU cost is the library's
# overhead. The public wrappers re-create Python ``Stream`` objects and add
# frames (``torch.cuda.current_stream`` alone took 7 us on the GPU machine's
# CPU); these are the C bindings they call. ``tests/test_streams.py`` fails if
# a torch release removes them, and the public API is used when they are gone.
_get_current = getattr(torch._C, "_cuda_getCurrentStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device  # (CUDA initialised)
_set_current = getattr(torch._C, "_cuda_setStream", None) or (
    lambda stream_id, device_index, device_type: torch.cuda.set_stream(
        torch.cuda.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)))
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
# ``Event.record(stream)`` and ``Stream.wait_event(event)`` are two and three
# Python frames around these; a fork/join calls them twice per side branch.
_record = getattr(getattr(torch._C, "_CudaEventBase", None), "record", None) or torch.cuda.Event.record
_wait = getattr(getattr(torch._C, "_CudaEventBase", None), "wait", None) or torch.cuda.Event.wait
_streams_by_id: dict[tuple, torch.cuda.Stream] = {}
_jit_tracing = getattr(torch._C, "_is_tracing", None) or torch.jit.is_tracing


def _current_stream(device: torch.device) -> torch.cuda.Stream:
    r"""``torch.cuda.current_stream(device)``, with the Python object cached."""
    if _get_current is None:
        return torch.cuda.current_stream(device)
    data = _get_current(device.index if device.index is not None else _current_device())
    stream = _streams_by_id.get(data)
    if stream is None:
        if len(_streams_by_id) > 4096:  # a program creating streams endlessly
            _streams_by_id.clear()
        stream = _streams_by_id[data] = torch.cuda.Stream(stream_id=data[0], device_index=data[1], device_type=data[2])
    return stream


def _set_stream(stream: torch.cuda.Stream) -> None:
    r"""``torch.cuda.set_stream(stream)`` without the Python layers."""
    _set_current(stream.stream_id, stream.device_index, stream.device_type)


def _stream_capturing() -> bool:
    r"""``torch.cuda.is_current_stream_capturing()`` without the Python layer."""
    return _capturing() if _capturing is not None else torch.cuda.is_current_stream_capturing()


def _is_tracing() -> bool:
    r"""Return whether a compiler or tracer is running this forward pass.

    ``torch.compiler.is_compiling()`` is true under ``torch.compile`` and under
    both strict and non-strict ``torch.export`` (documented public API); the
    flag covers ``torch.fx.symbolic_trace`` (read directly: ``is_fx_tracing()``
    logs a deprecation warning), and ``torch.jit.trace`` (its C state, as
    ``torch.jit.is_tracing()`` reads it without the frame): stream switches
    are invisible to TorchScript, but a fused group must stack its members'
    parameters in the traced graph, where an untraced call's stacks would be
    recorded as constants (a saved trace ignoring a later ``load_state_dict``).
    """
    return torch.compiler.is_compiling() or _symbolic_trace._is_fx_tracing_flag or _jit_tracing()


def _size(t: torch.Tensor, dim: int = 0) -> int:
    r"""``t.shape[dim]``, as a plain int under ``torch.jit.trace`` too, for checks of the input.

    The tracer hands sizes out as 0-dim tensors, so that the operations taking
    them generalize to other shapes; one compared in Python becomes a constant
    of the trace, and torch warns ("TracerWarning: Converting a tensor to a
    Python boolean might cause the trace to be incorrect") at every trace of a
    module that only checks the example input with it. Read untraced, the
    check is what it is eagerly, and the trace records nothing of it.
    """
    if torch.compiler.is_compiling() or not _jit_tracing():  # (is_compiling first: see _is_tracing)
        return t.shape[dim]
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        return t.shape[dim]
    finally:
        torch._C._set_tracing_state(state)


def _symbolic(size: Any) -> bool:
    r"""Whether ``size`` is a dynamic size of a compiler's trace, one that may take other values.

    Not ``isinstance(size, torch.SymInt)``, which Dynamo (``torch.compile``, a strict
    ``torch.export``) answers ``False``: it hands the code it traces a ``SymInt`` as an int.
    ``has_static_value`` is answered from the symbol there, and by the ``SymInt`` elsewhere.
    Called only while a compiler traces (see :func:`._joins._guard_or_false` for why).
    """
    from torch.fx.experimental import symbolic_shapes

    static = getattr(symbolic_shapes, "has_static_value", None)  # (absent from older PyTorch releases)
    if static is None:
        return isinstance(size, torch.SymInt)
    return isinstance(size, (int, torch.SymInt)) and not static(size)


# Where autograd needs a call's items on the caller's stream (see _autograd_in_line).
_saved_tensor_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_graph_task = getattr(torch._C, "_current_graph_task_id", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_dispatch_modes = torch._C._len_torch_dispatch_stack  # Python dispatch modes active on this thread
_function_modes = torch._C._is_torch_function_mode_enabled  # Python torch function modes active on this thread


def _result_changing_function_modes() -> bool:
    r"""Whether a torch function mode that may change what a call computes is active on this thread.

    Any but torch's ``DeviceContext`` (``torch.set_default_device``, ``with
    torch.device(...)``: the device of tensors made without one, which the
    inputs' devices key already) and modes of this library's own that only
    look (marked ``_watches_only``). Asked where a replay would skip the
    operations such a mode sees; the stack is walked only while some mode is on.
    """
    return _function_modes() and any(
        not (isinstance(mode, _DeviceContext) or getattr(mode, "_watches_only", False))
        for mode in _function_mode_stack())


def _saved_hooks_recording() -> bool:
    r"""Whether saved-tensor hooks (``torch.utils.checkpoint(use_reentrant=False)``, ``save_on_cpu``) are
    active while autograd records."""
    return _saved_tensor_hooks is not None and torch.is_grad_enabled() and _saved_tensor_hooks(False) is not None


def _checkpoint_recording() -> bool:
    r"""Whether ``torch.utils.checkpoint(use_reentrant=False)`` records this forward pass, which it
    runs again in backward and refuses to find saving other tensors (its saved-tensor hooks, not
    those of ``save_on_cpu``, which recomputes nothing)."""
    if not _saved_hooks_recording():
        return False
    hooks = _saved_tensor_hooks(False)
    return getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


def _in_backward() -> bool:
    r"""Whether this call runs inside a backward pass (a checkpoint's recomputation, a custom ``backward``)."""
    return _graph_task is not None and _graph_task() != -1


def _autograd_in_line() -> bool:
    r"""Whether a fork must run its items one after another on the caller's stream, for autograd.

    ``torch.utils.checkpoint(use_reentrant=False)`` recomputes the forward
    pass in the unpack hook of the first backward operation that needs a
    saved tensor, on that operation's stream: forked from there, the items'
    activations would be made on other streams than the ones their backward
    operations run on (those of the first forward), which read them without
    waiting. Run in line under saved-tensor hooks, and in a backward pass,
    the forward and its recomputation put every operation on the caller's
    stream, and the engine orders the rest. Under ``torch.func`` transforms
    (``vmap``, ``grad``), whose wrapped tensors have no storage for the
    allocator to be told about, the items run in turn as they do eagerly.
    """
    return _saved_hooks_recording() or _in_backward() or _functorch_active()


def _in_line(calls: list[Any], run: Any, join: Callable[[list[Any]], Any] | None, args: tuple, kwargs: dict,
             error: Callable[[Exception, int], Exception] | None) -> Any:
    r"""What :func:`_run_forked` returns, each item run in turn on the caller's stream."""
    outputs: list[Any] = []
    try:
        for i, call in enumerate(calls):
            outputs.append(run(i, call) if run is not None else call(*args, **kwargs))
    except Exception as e:
        if run is None and error is not None:
            raise error(e, len(outputs))
        raise
    return outputs if join is None else join(outputs)


class _ThreadSlots(threading.local):
    r"""Per-thread fork state of a :class:`_DevicePool`; class attributes are the defaults.

    (A default read with ``getattr(local, name, default)`` costs an
    ``AttributeError`` in each new thread's first reads and in every read
    before the first write: 0.4 us, on the path of every call.)
    """

    offset = 0
    high = 0  # the first slot above every slot the running fork and its nested forks took (see offset)
    forks: list[torch.cuda.Event] | None = None
    joins: list[torch.cuda.Event] | None = None
    forked: dict[tuple[int, int, int], "_Slots"] | None = None  # see _DevicePool.slots


class _Slots(NamedTuple):
    r"""What one fork of ``count`` items from slot ``offset`` uses: see :meth:`_DevicePool.slots`."""

    streams: tuple[torch.cuda.Stream, ...]  # of items 1..
    fork: torch.cuda.Event
    joins: tuple[torch.cuda.Event, ...]  # of items 1..


class _DevicePool:
    r"""The side streams of one CUDA device and this thread's fork/join events.

    Events are kept per thread and per stream slot. Per thread, because two
    threads forking at the same moment must not re-record each other's events
    between a record and the waits on it. Per slot, because a ``Parallel``
    nested in a branch takes the slots after its parent's (see ``offset``), so
    it never re-records an event its parent has yet to wait on.
    """

    def __init__(self, device: torch.device, priority: int = 0) -> None:
        self.device = device
        self.priority = priority
        self.streams: list[torch.cuda.Stream] = []
        self.high: list[torch.cuda.Stream] = []  # of the greatest priority, one per slot (see high_stream)
        self.ids: set[int] = set()
        self._lock = threading.Lock()
        self._local = _ThreadSlots()

    def side_streams(self, offset: int, count: int, caller: torch.cuda.Stream | None = None
                     ) -> list[torch.cuda.Stream]:
        r"""The streams of slots ``offset .. offset + count - 1``; never ``caller``.

        ``torch.cuda.Stream()`` hands out streams round-robin from PyTorch's
        pool of 32, which these streams come from too, so a caller's own stream
        can be one of them: a branch forked onto it would run after the
        caller's work instead of beside it. The next slot's stream stands in.
        """
        end = offset + count + 1  # one more, to stand in for the caller's
        if len(self.streams) < min(end, _MAX_SIDE_STREAMS):
            with self._lock:
                while len(self.streams) < min(end, _MAX_SIDE_STREAMS):
                    self.streams.append(torch.cuda.Stream(self.device, priority=self.priority))
                    self.ids.add(self.streams[-1].stream_id)
        n = len(self.streams)
        streams = self.streams[offset:end] if end <= n else [self.streams[i % n] for i in range(offset, end)]
        if caller is not None and caller.stream_id in self.ids and caller in streams:
            streams.remove(caller)
        return streams[:count]

    def high_stream(self, slot: int) -> torch.cuda.Stream:
        r"""A side stream of the greatest priority for slot ``slot``, in place of the slot's own.

        CUDA graphs keep the priority of the stream each kernel was captured on
        (PyTorch instantiates them with ``cudaGraphInstantiateFlagUseNodePriority``):
        when branches contend for the GPU, the one on such a stream is scheduled
        first. The Inception block at batch 1 replays 4-8% faster on the H100
        machine with its longest branch captured there.
        """
        if len(self.high) <= slot:
            greatest = torch.cuda.Stream.priority_range()[1]
            with self._lock:
                while len(self.high) <= slot:
                    self.high.append(torch.cuda.Stream(self.device, priority=greatest))
                    self.ids.add(self.high[-1].stream_id)
        return self.high[slot]

    def events(self, end: int) -> tuple[list[torch.cuda.Event], list[torch.cuda.Event]]:
        r"""This thread's fork and join events, at least ``end`` of each."""
        local = self._local
        forks = local.forks
        if forks is None:
            forks = local.forks = []
            local.joins = []
        while len(forks) < end:
            forks.append(torch.cuda.Event())
            local.joins.append(torch.cuda.Event())
        return forks, local.joins

    def slots(self, offset: int, count: int, caller: torch.cuda.Stream) -> _Slots:
        r"""This thread's side streams and events for a fork of ``count`` items from slot ``offset``.

        :meth:`side_streams` and :meth:`events`, looked up once per thread,
        offset, count and caller and then kept: neither changes once made, and
        on tiny branches the lookups are a measurable part of a fork's cost.
        """
        local = self._local
        cache = local.forked
        if cache is None:
            cache = local.forked = {}
        key = (offset, count, caller.stream_id)
        slots = cache.get(key)
        if slots is None:
            if len(cache) >= 256:  # callers on ever new streams: keep it bounded
                cache.clear()
            forks, joins = self.events(offset + count)
            slots = cache[key] = _Slots(tuple(self.side_streams(offset, count - 1, caller)), forks[offset],
                                        tuple(joins[offset + 1:offset + count]))
        return slots

    @property
    def offset(self) -> int:
        # The first slot this thread's next fork uses: a Parallel nested in a
        # branch forks from that branch's stream and must not reuse the
        # streams (or events) its enclosing block is running on. Nor those of
        # a block nested in an earlier branch of the same fork, which may still
        # be running: each item starts at ``high``, above all of them (two
        # Parallel stages of a pipeline sharing streams ran one after another).
        # Blocks nested one after another in one item take the same slots.
        return self._local.offset

    @offset.setter
    def offset(self, value: int) -> None:
        self._local.offset = value


# Set by ``_graphs`` while this thread warms up or captures a ``cuda_graph=True``
# module (``active``); defined here so that the pool can see it.
class _GraphState(threading.local):
    active = False
    # A pipeline lane is running a stage whose outputs the next lane reads on its own
    # stream, or a fork a side item whose outputs the caller's stream reads, which the
    # next replay on that stream does not wait for: graphs must not lend them.
    crossing = False
    variant: Any = None  # (module, variant) being warmed up or captured: see _graphs._graph_variant
    # Autograd recorded branches on side streams since the last join read this: the join holds the
    # gradient it hands them (see the module docstring, backward; _joins._join_outputs resets it,
    # and Parallel.forward one left by a call that raised before its join).
    forked = False


_graph_state = _GraphState()


def _capture_underway() -> bool:
    r"""Whether this thread is inside a graph capture (ours or the user's) or our warm-up.

    A ``Parallel`` always forks onto side streams then: in a graph, forking is
    what makes branches concurrent, and warm-up must run what capture will.
    """
    return _graph_state.active or _stream_capturing()


_pools: dict[tuple[int, bool], _DevicePool] = {}
_pools_lock = threading.Lock()


def _pool(device: torch.device, capturing: bool | None = None) -> _DevicePool:
    r"""The side streams of ``device``; a second set while a CUDA graph is warmed up or captured.

    Work that another thread enqueues on a stream while it takes part in a
    capture would be absorbed into the graph (or invalidate it), so captures,
    which the graph module serialises, fork onto streams eager calls never use.
    ``torch.cuda.Stream()`` hands out PyTorch's 32 streams of each priority
    round-robin, so past 32 streams in the process (a block of more than 32
    branches, or the user's own streams) eager and capture streams of one
    priority would be the same streams: captures take theirs from another
    priority's streams (:data:`_CAPTURE_PRIORITY`).
    """
    index = device.index if device.index is not None else _current_device()
    # Our warm-up runs on the streams its capture will use, as
    # make_graphed_callables warms up on the capture's side stream: per-stream
    # lazy state (cuBLAS workspaces, cuDNN plans) is then set up before capture.
    key = (index, _capture_underway() if capturing is None else capturing)
    pool = _pools.get(key)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(key)
            if pool is None:
                pool = _pools[key] = _DevicePool(torch.device("cuda", index), _CAPTURE_PRIORITY if key[1] else 0)
    return pool


# The priority of the streams captures run on (the capture stream and its pool's side
# streams): one step above the default, whose streams eager calls and users take. (The
# greatest priority is for the branch a graph favours: see _DevicePool.high_stream.) In
# a graph only the kernels' relative priorities matter.
_CAPTURE_PRIORITY = -1


def _stream_count() -> int:
    r"""Side streams created so far, over all devices (for leak tests)."""
    return sum(len(p.streams) + len(p.high) for p in _pools.values())


# The number of strong references to a storage (see ``_graphs``); without it
# every output is marked with record_stream.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _references(values: list, i: int) -> int:
    r"""Python references to ``values[i]``, the list's own included."""
    return sys.getrefcount(values[i])


# What ``_references`` counts when only the list holds the value: measured, not
# assumed, since interpreters differ in the temporary references a call makes
# (3.14 borrows some). The same function counts both, so both count alike.
_OWN_REFERENCES = _references([torch.empty(0)], 0)


def _hidden_tensors(value: Any, depth: int = 0) -> list[torch.Tensor]:
    r"""The tensors an object that pytree sees as a leaf keeps in its attributes (a dataclass), or
    in its items (a subclass of tuple, list or dict).

    Its attributes' values are looked into as :func:`_tensor_leaves` looks
    into ``value`` (a dataclass holding a list of tensors, or another
    dataclass), a few levels deep; other objects only at the first level (a
    module's ``__dict__``, say, holds its parameters in a dict of its own).
    """
    return [t for _, t in _hidden_attributes(value, depth)]


def _hidden_attributes(value: Any, depth: int = 0, largest: int | None = None) -> list[tuple[str, torch.Tensor]]:
    r""":func:`_hidden_tensors`, each with the name of the attribute of ``value`` that holds it (for errors).

    ``largest``: tuples, lists and dicts of more items held by its attributes
    are not looked into (see :func:`_nested_tensors`).
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        found = [(f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value)]
    elif depth == 0:
        found = list(getattr(value, "__dict__", {}).items())
    else:
        found = []
    if isinstance(value, (tuple, list, dict)):
        # A subclass of one, which pytree keeps whole (a leaf): its items, at any depth (a
        # pipeline splits and joins such containers; their tensors are read on other streams).
        found += [(f"[{k!r}]", v) for k, v in (value.items() if isinstance(value, dict) else enumerate(value))]
    if not found:
        return []
    tensors = []
    for name, v in found:
        if isinstance(v, torch.Tensor):
            tensors.append((name, v))
        elif depth < _HIDDEN_DEPTH and v is not None and not isinstance(v, (int, float, str)):
            nested = _nested_tensors(v, depth + 1, largest)
            if nested:
                tensors.extend((name, t) for t in nested)
    return tensors


def _nested_tensors(value: Any, depth: int, largest: int | None = None) -> list[torch.Tensor]:
    r""":func:`_tensor_leaves` of an attribute's value, plain tuples, lists and dicts walked here.

    A pipeline looks into the objects of every call's input (see
    ``ParallelSequential._split``), a config's attributes among them: pytree's
    flattening cost 7 us for each list or dict on the CPU machine, 0.4 ms a
    call for an object of 60 attributes, which this walk takes 40 us over.
    ``largest``: containers of more items are passed over, the pipeline's
    check being of every call -- a tokenizer's vocabulary and merges (50,000
    each) cost it 50 ms a call -- and such a table holding no batch.
    """
    if largest is not None and isinstance(value, _SIZED) and len(value) > largest:
        return []
    if type(value) in (tuple, list, dict):
        tensors = []
        for v in value.values() if type(value) is dict else value:
            if isinstance(v, torch.Tensor):
                tensors.append(v)
            elif v is not None and not isinstance(v, (int, float, str)):
                tensors.extend(_nested_tensors(v, depth, largest))
        return tensors
    return _tensor_leaves(value, depth)


_SIZED = (tuple, list, dict, collections.deque)


_HIDDEN_DEPTH = 4  # dataclasses within dataclasses looked into; deeper, a structure is the user's own


def _tensor_leaves(value: Any, depth: int = 0) -> list[torch.Tensor]:
    r"""The tensors in ``value``: pytree's leaves, and those kept in the attributes of other leaves."""
    tensors = []
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
        elif leaf is not None and not isinstance(leaf, (int, float, str)):
            tensors.extend(_hidden_tensors(leaf, depth))
    return tensors


def _record_on(outputs: Any, stream: torch.cuda.Stream) -> None:
    # The caller's stream is about to use tensors whose memory belongs to a
    # side stream's pool: tell the allocator to wait for ``stream`` too.
    if isinstance(outputs, torch.Tensor):
        if outputs.is_cuda:  # (a branch may return a CPU tensor)
            _record_tensor(outputs, stream)
        return
    for leaf in _tensor_leaves(outputs):
        if leaf.is_cuda:
            _record_tensor(leaf, stream)


def _record_tensor(t: torch.Tensor, stream: torch.cuda.Stream) -> None:
    r"""``t.record_stream(stream)``, for sparse and nested tensors too: their dense parts.

    ``record_stream`` has kernels for dense CUDA tensors only; a sparse or
    nested tensor's memory is that of the dense tensors it is made of.
    """
    if _dense(t):
        t.record_stream(stream)
    else:
        for part in _dense_parts(t):
            part.record_stream(stream)
    if _forward_ad._current_level >= 0:
        # Under forward-mode AD a side branch's output carries a tangent, made on the
        # side stream beside it, with memory of its own: the caller reads it as well.
        tangent = _forward_ad.unpack_dual(t).tangent
        if tangent is not None:
            _record_tensor(tangent, stream)


def _dense_parts(t: torch.Tensor) -> list[torch.Tensor]:
    r"""The dense tensors whose memory a sparse or nested tensor ``t`` uses."""
    layout = t.layout
    if layout is torch.sparse_coo:
        return [t._indices(), t._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    if t.is_nested:
        if layout is torch.jagged:
            return [p for p in (t.values(), t.offsets(), t.lengths()) if p is not None]
        # A strided nested tensor's components are views of its one buffer.
        return list(t.unbind())
    return [t]


def _dense(t: torch.Tensor) -> bool:
    return t.layout is torch.strided and not t.is_nested


class _BackwardJoin:
    r"""Gradient hook of a block's input: its consumer's stream waits for the blocks' side streams.

    One per input tensor, however many blocks read it (an encoder output fed to
    every decoder layer): each adds its side streams to ``streams``.
    """

    __slots__ = ("device", "streams")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams: dict[torch.cuda.Stream, None] = {}  # ordered, no repeats

    def __call__(self, grad: torch.Tensor | None) -> None:
        # ``grad`` may be None: an input that is one output of a split gets no
        # gradient when only its siblings are used; its producer still runs.
        if torch.compiler.is_compiling():  # compiled autograd traces hooks: no stream ops in its graph
            return
        # The engine runs the hook on the stream of the node that consumes this
        # gradient (the input's producer), after every block has contributed to
        # it. What those blocks enqueued on their side streams before then --
        # their parameters' ``.grad`` sums included: the engine runs a
        # gradient's accumulation before any node of an earlier operation -- is
        # then ordered before the consumer.
        current = _current_stream(self.device)
        for stream in self.streams:
            if stream != current:
                current.wait_stream(stream)


def _hold_gradients(grad_inputs: tuple, grad_outputs: tuple) -> None:
    r"""Post-hook of a join's node: its gradients stay referenced until the backward pass ends (see the module
    docstring, backward)."""
    if torch.compiler.is_compiling():  # (compiled autograd traces hooks: its graph holds what it needs)
        return
    held = [g for g in grad_inputs if g is not None]
    if held:
        # (Run by the engine once every node of the pass has run, on the thread that ran it.)
        torch.autograd.Variable._execution_engine.queue_callback(held.clear)


def _recorded(outputs: list[Any]) -> bool:
    r"""Whether autograd made a node for any of the branches' ``outputs``: else a join of them
    hands no gradient to two streams' nodes, and nothing need be held."""
    leaves = outputs if all(type(o) is torch.Tensor for o in outputs) else _tensor_leaves(outputs)
    return any(t.grad_fn is not None for t in leaves)


def _hold_join_gradients(result: Any, first: int) -> None:
    r"""Hook the join's own nodes, from its ``result`` back to the branches' outputs, with :func:`_hold_gradients`.

    For a ``sum`` or ``mean`` join, or a join of the user's, of branches that ran
    forked (``_graph_state.forked``): ``add``'s backward hands one gradient to
    both its sides. Held, the gradients outlive their last reader by the rest of
    the backward pass, one join-sized tensor per block: memory a block on one
    stream need not spend, nor a ``cat`` or ``stack``, whose branches get slices
    of their own.

    The join's own nodes are those this thread made while it ran: autograd
    numbers a thread's nodes in order, from ``first``
    (``torch.autograd._get_sequence_nr()`` read before the join) to the number
    it would give the next one once the roots were read. A join reading a tensor
    made before the block (a residual) is not followed into the model, whose
    gradients would all be held; nor a parameter's accumulator, which a weighted
    join reaches (it hands nothing on, and a hook on it would stay for as long
    as something keeps it, DDP's reducer). Numbers are a thread's own: a node
    made on another thread (a tensor the join reads, or a branch returns, made
    there) may be numbered anything, and the upper end keeps that thread's
    whole graph from being held, and hooked again at every call while it lives.
    (Not each node below the node reading it: an operation reading a view whose
    base changed in place since makes its own node first, then the view's anew,
    numbered above it -- the join's nodes below that one would be left unheld.)
    A join of the user's that runs a backward pass itself
    (``torch.autograd.grad(..., create_graph=True)``) makes that pass's nodes
    on autograd's device threads: the join's nodes reached only through them
    are not held.
    """
    leaves = (result,) if isinstance(result, torch.Tensor) else _tensor_leaves(result)
    roots = [t.grad_fn for t in leaves if t.grad_fn is not None]
    # (Read once the roots were: a view's node is made anew when read after its base changed in place.)
    end = torch.autograd._get_sequence_nr()
    todo = roots
    # (Each node held while walked: torch 2.11 makes a new Python object of a node at each
    # ``next_functions`` read, and a set of ids let a later node take a freed one's id and go
    # unhooked -- a weighted sum join's products, whose gradients were then let go early.)
    seen: dict[int, Any] = {}
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or not node.next_functions:
            continue
        if not first <= node._sequence_nr() < end:
            continue
        seen[id(node)] = node
        node.register_hook(_hold_gradients)
        todo.extend(n for n, _ in node.next_functions)


# Each input's hook, while the input lives: kept beside the tensor rather than on it, where
# ``torch.save`` of the tensor would try to pickle the hook's streams.
_joins_of: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _recording(outputs: list[Any]) -> bool:
    r"""Whether autograd recorded any of the items' ``outputs``: else no backward pass reads what
    they saved, and :func:`_join_backward` has nothing to order (frozen branches called with grad
    enabled would pay a ``record_stream`` per input and side stream for nothing)."""
    for o in outputs:
        if o is not None and (not isinstance(o, torch.Tensor) or o.requires_grad):
            return True  # (structured or batched values: taken to record, as they may)
    return False


def _join_backward(inputs: tuple | list, streams: list[torch.cuda.Stream]) -> None:
    r"""Order the backward of ``inputs``' producers after all work on ``streams`` (see module docstring).

    Only inputs made by an operation get the hook, so leaf inputs (a tensor
    created with ``requires_grad=True``) are not covered: a hook on a leaf
    would stay on it for every later call. The engine itself makes the caller
    wait for every side stream at the end of ``backward()``. Not used while a
    graph is captured: a capture may not wait on streams outside it.
    """
    if not torch.is_grad_enabled():
        return
    for value in inputs:
        # (Tensors first: flattening costs microseconds, a fork/join's budget.)
        for leaf in (value,) if isinstance(value, torch.Tensor) else _tensor_leaves(value):
            if not leaf.is_cuda:
                continue
            # A side branch may save the input for its backward, which reads it on the
            # side stream and then lets it go: freed, its memory returns to the caller's
            # stream's pool while that read may still be queued. (In the forward pass
            # the join covers it.) The allocator waits for the side streams' reads.
            for stream in streams:
                _record_tensor(leaf, stream)
            if leaf.grad_fn is not None:
                hook = _joins_of.get(leaf)
                if hook is None:
                    hook = _joins_of[leaf] = _BackwardJoin(leaf.device)
                    leaf.register_hook(hook)
                for stream in streams:
                    hook.streams[stream] = None


def _watched(args: Sequence[Any], kwargs: dict) -> list[torch.Tensor]:
    r"""The tensor inputs whose in-place changes can be seen by their versions, which every
    in-place operation advances: arguments, and tensors inside tuples, lists and dicts of them
    (``block([x])``). Inference tensors keep no version: see :func:`_unversioned`."""
    watched = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            if not value.is_inference():
                watched.append(value)
        elif isinstance(value, (tuple, list, dict)):
            watched.extend(t for t in _tensor_leaves(value) if not t.is_inference())
    return watched


def _unversioned(args: Sequence[Any], kwargs: dict) -> list[torch.Tensor]:
    r"""The inference tensors among the inputs (as :func:`_watched` finds them), whose in-place
    changes no version shows: :class:`_Writes` sees them once per input signature instead."""
    return [t for t in _tensor_leaves((args, kwargs)) if t.is_inference()]


class _Writes(TorchDispatchMode):
    r"""Sees whether any operation run under it writes to the memory of ``tensors``.

    An operation writes where its schema says so (``relu_``'s self, an
    ``out=`` argument), through any view of the memory: the check compares
    storages. Used on a call's first run of a signature whose inputs are
    inference tensors, run one branch after another, to decide whether its
    branches may be forked or fused (see ``Parallel._run_watched``): every
    operation then passes through Python, once.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {p for p in map(_storage_address, tensors) if p}
        self.wrote = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if not self.wrote:
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = kwargs.get(arg.name) if arg.kwarg_only else args[i] if i < len(args) else None
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, torch.Tensor) and _storage_address(t) in self.storages:
                        self.wrote = True
        return func(*args, **kwargs)


def _storage_address(t: torch.Tensor) -> int:
    r"""Where ``t``'s memory starts (0: none, or no storage to speak of: sparse, nested, fake)."""
    if isinstance(t, _FakeTensor):  # (a module built under FakeTensorMode: asking warns, and tells nothing)
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _changed(inputs: list[torch.Tensor], versions: list[int]) -> bool:
    return any(t._version != v for t, v in zip(inputs, versions))


class _ChangedInPlace(RuntimeError):
    r"""A branch changed an input in place while others read it (see :func:`_changed_in_place`)."""


def _changed_in_place() -> RuntimeError:
    return _ChangedInPlace(
        "a branch changed its input in place (an in-place first operation, such as nn.ReLU(inplace=True)), "
        "while the other branches read it on their own CUDA streams at the same time: what they "
        "read depends on timing. Make the branch's first operation out of place (inplace=False, "
        "x = x + 1), or pass streams=False to run the branches one after another."
    )


def _join_and_release(outputs: list[Any], join: Callable[[list[Any]], Any], caller: torch.cuda.Stream,
                      fork: torch.cuda.Event, streams: Sequence[torch.cuda.Stream]) -> Any:
    r"""Join ``outputs`` (item 0 made on ``caller``, the others on ``streams``) on ``caller``'s
    stream, then release the side outputs as the module docstring says (memory).

    Called once every side stream is joined into ``caller`` and no longer waits on ``fork``.
    """
    try:
        result = join(outputs)
    except BaseException:
        for out in outputs[1:]:
            _record_on(out, caller)
        raise
    released = False
    # (Under forward-mode AD an output's tangent has memory of its own, which the
    # count below does not see, and which the join's tangent may alias: recorded.)
    dual = _forward_ad._current_level >= 0
    for i in range(1, len(outputs)):
        # Held elsewhere (a Python reference, a view, a tensor saved for
        # backward sharing its memory): the caller's stream may read it after
        # the join, so the allocator must know.
        # (Sparse and nested tensors have no storage of their own to count: recorded.)
        if (dual or not isinstance(outputs[i], torch.Tensor) or _references(outputs, i) > _OWN_REFERENCES
                or not _dense(outputs[i])
                or _use_count(outputs[i].untyped_storage()._cdata) > 2):  # the tensor's, and this call's
            _record_on(outputs[i], caller)
        else:
            released = True
    if released:
        # The fork event's waits are all enqueued: it can be recorded again.
        _record(fork, caller)
        for side in streams:
            _wait(fork, side)
    return result


def _fork_join(calls: list[Any], device: torch.device, args: tuple, kwargs: dict,
               join: Callable[[list[Any]], Any], error: Callable[[Exception, int], Exception]) -> Any:
    r"""``_run_forked(calls, device, None, False, inputs, join, args=args, kwargs=kwargs, error=error)``
    with as few operations as the protocol allows: an eager call, each item
    called on ``args, kwargs``, the outputs joined on the caller's stream.

    Every call of a block whose schedule forks its branches and joins them
    with a reduction runs this, so its Python is the block's overhead: on tiny
    branches, each operation counts. On the H100 machine, a ``Parallel`` of
    two ``Linear(16, 16)`` took about 10 us less per call through this than
    through the general function (60-70 us calls), whose options each cost
    well under a microsecond alone. The general function runs a fork whose
    streams and events this thread has not looked up yet (its first), and one
    on a device other than the current one (with that device made current for
    the call, as ``Parallel._run`` does, since setting a stream of another
    device makes that device current).
    """
    if _autograd_in_line():
        return _in_line(calls, None, join, args, kwargs, error)
    current = _current_device()
    index = device.index if device.index is not None else current
    data = _get_current(index) if _get_current is not None and _use_count is not None and index == current else None
    pool = _pools.get((index, False))
    caller = _streams_by_id.get(data)
    cache = pool._local.forked if pool is not None else None
    slots = cache.get((pool._local.offset, len(calls), data[0])) if cache is not None and caller is not None else None
    if slots is None:
        inputs = (*args, *kwargs.values()) if torch.is_grad_enabled() else ()
        if index != current:  # (setting a stream of another device makes that device current)
            with torch.cuda.device(index):
                return _run_forked(calls, device, None, False, inputs, join, args=args, kwargs=kwargs, error=error)
        return _run_forked(calls, device, None, False, inputs, join, args=args, kwargs=kwargs, error=error)
    streams, fork, joins = slots
    local = pool._local
    base = local.offset
    # In-place changes of an input by an item: see _run_forked.
    watched = _watched(args, kwargs)
    first = watched[0] if len(watched) == 1 else None
    version = first._version if first is not None else 0
    versions = [a._version for a in watched] if len(watched) > 1 else None
    _record(fork, caller)  # (before the setting below: see _run_forked)
    cached_casts = torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled()
    if cached_casts:  # (see _run_forked)
        torch.set_autocast_cache_enabled(False)
    high = local.high
    local.offset = local.high = base + len(calls) - 1  # (see _run_forked)
    outputs: list[Any] = []
    launched = 0  # side streams launched, and the index of the item running
    crossing = _graph_state.crossing
    try:
        outputs.append(calls[0](*args, **kwargs))
        if first is not None and first._version != version or versions and _changed(watched, versions):
            raise _changed_in_place()
        _graph_state.crossing = True  # (see _run_forked)
        for side in streams:
            _set_current(side.stream_id, side.device_index, side.device_type)
            _wait(fork, side)
            local.offset = local.high
            launched += 1
            try:
                outputs.append(calls[launched](*args, **kwargs))
            finally:
                _record(joins[launched - 1], side)
            if first is not None and first._version != version or versions and _changed(watched, versions):
                raise _changed_in_place()
    except Exception as e:
        raise error(e, launched)
    finally:
        _graph_state.crossing = crossing
        local.offset, local.high = base, max(high, local.high)
        if cached_casts:
            torch.set_autocast_cache_enabled(True)
        _set_current(*data)
        for i in range(launched):
            _wait(joins[i], caller)
    if torch.is_grad_enabled() and _recording(outputs):
        _join_backward((*args, *kwargs.values()), streams)
        _graph_state.forked = True
    return _join_and_release(outputs, join, caller, fork, streams)


def _run_forked(calls: list[Any], device: torch.device, run: Any, capturing: bool | None = None,
                inputs: tuple | list = (), join: Callable[[list[Any]], Any] | None = None, high: int = 0,
                order: Sequence[int] | None = None, args: tuple = (), kwargs: dict | None = None,
                error: Callable[[Exception, int], Exception] | None = None) -> Any:
    r"""Run ``run(i, calls[i])`` for every item, item 0 on the caller's stream.

    Items 1.. run on side streams forked from the caller's current stream and
    joined back into it, in the order described in this module's docstring.
    ``run`` must raise with its own context; whatever happens, every launched
    side stream is joined and the caller's stream is restored before this
    returns or raises. ``run=None`` calls ``calls[i](*args, **kwargs)``
    instead and raises ``error(exception, i)`` for an exception it raises (a
    frame less per item: on tiny branches the fork's cost is its Python).
    ``capturing``: whether a graph capture or its warm-up is underway, when the
    caller knows (see :func:`_pool`). ``inputs``: the values the items read (a
    tuple), for :func:`_join_backward`. ``join``: a function that reads the
    outputs on the caller's stream and returns new tensors (never an output
    itself); its result is returned instead of the outputs, which are then
    released as the module docstring says (memory). ``high``: an item (1..)
    to run on its slot's high-priority stream instead (see
    :meth:`_DevicePool.high_stream`); 0 for none. ``order``: the items in the
    order to launch them, ``order[0]`` on the caller's stream (see
    ``Parallel._graph_variants``); the outputs stay in item order.
    """
    if capturing is None:
        capturing = _capture_underway()
    if not capturing and _autograd_in_line():
        return _in_line(calls, run, join, args, kwargs or {}, error)
    pool = _pool(device, capturing)
    caller = _current_stream(device)
    n = len(calls)
    local = pool._local  # (pool.offset, without the property's frame: this runs on every call)
    base = local.offset
    streams, fork, joins = pool.slots(base, n, caller)
    if high:
        streams = list(streams)
        streams[high - 1] = pool.high_stream(base + high - 1)
    if kwargs is None:
        kwargs = {}
    # The items read the inputs at the same time on their streams: one that changes an
    # input in place (``nn.ReLU(inplace=True)`` first) races with the others. Seen by
    # the inputs' versions after each item.
    watched = _watched(args, kwargs)
    first = watched[0] if len(watched) == 1 else None  # the common case: one int compared per item
    version = first._version if first is not None else 0
    versions = [a._version for a in watched] if len(watched) > 1 else None
    # Autocast caches a parameter's cast copy for the thread, whatever the stream: made
    # by one item on its stream, the copy would be read by another on its own without
    # waiting for the cast. Each item casts for itself during the fork.
    # (The fork recorded first: its failure, before the ``finally`` below, would leave the
    # cache off for the rest of the thread.)
    _record(fork, caller)
    cached_casts = torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled()
    if cached_casts:
        torch.set_autocast_cache_enabled(False)

    # Slot s (0: the caller's stream) runs item ``launch[s]``; outputs stay in item order.
    launch = range(n) if order is None else order
    outputs: list[Any] = [None] * n
    # A block nested in an item takes the slots after these, item 0's too: it
    # must not re-record the fork event before the side streams have waited on it.
    # One nested in a later item takes slots above those of the earlier items'.
    high = local.high
    local.offset = local.high = base + n - 1
    launched = 0
    item = launch[0]
    crossing = _graph_state.crossing
    try:
        outputs[item] = run(item, calls[item]) if run is not None else calls[item](*args, **kwargs)
        if first is not None and first._version != version or versions and _changed(watched, versions):
            raise _changed_in_place()
        # The side items' outputs are read on the caller's stream, which a graphed block's next
        # replay on the same side stream (another call's fork, from another caller) does not
        # wait for: such blocks must not lend them their buffers.
        _graph_state.crossing = True
        for slot in range(1, n):
            side = streams[slot - 1]
            _set_current(side.stream_id, side.device_index, side.device_type)
            _wait(fork, side)
            local.offset = local.high
            launched = slot
            item = launch[slot]
            try:
                outputs[item] = run(item, calls[item]) if run is not None else calls[item](*args, **kwargs)
            finally:
                # Recorded even if the branch raised: the caller must not run
                # ahead of work already enqueued on ``side``.
                _record(joins[slot - 1], side)
            if first is not None and first._version != version or versions and _changed(watched, versions):
                raise _changed_in_place()
    except Exception as e:
        if run is None and error is not None:
            raise error(e, item)
        raise
    finally:
        _graph_state.crossing = crossing
        local.offset, local.high = base, max(high, local.high)
        if cached_casts:
            torch.set_autocast_cache_enabled(True)
        _set_current(caller.stream_id, caller.device_index, caller.device_type)
        # Join: every launched side stream, whatever happened.
        for slot in range(launched):
            _wait(joins[slot], caller)
    if launched and torch.is_grad_enabled() and _recording(outputs):
        _graph_state.forked = True
        if inputs and not capturing:
            _join_backward(inputs, streams)
    if join is None or capturing or _use_count is None or order is not None:
        # (Under capture the side streams must end joined into the caller's:
        # no wait may fork them again after the join. Orders are given under
        # capture; the release below takes item 0 for the caller's stream's.)
        for i in launch[1:]:
            _record_on(outputs[i], caller)
        return outputs if join is None else join(outputs)
    return _join_and_release(outputs, join, caller, fork, streams)
