r"""``Parallel``: independent branches on one input, run concurrently."""

from __future__ import annotations

import contextlib
import numbers
from collections import OrderedDict
import time
import warnings
from typing import Any, Callable, Hashable, Iterable, Iterator, Literal, NamedTuple, Union, overload

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils import _pytree as pytree

from ._autotune import _ScheduleTuner
from ._children import _Function, _as_branch, _check_name, _check_numbered, _child_key, _insert_index, _listed, _new_like, _state_to_copy  # noqa: F401  (_Function: pickles name it here)
from ._children import _layers_in_turn, _slice_text, _writes_its_input
from ._compile import _COMPILED, _EAGER, _NOT_SCRIPTABLE, _WHOLE, Backend, _compiler
from ._fusion import (_GLOBAL_HOOKS, _difference, _functorch_active, _Fusion, _Group, _Joined, _tensor_attributes,
                      _MembersChanged, _overrides_ops, _UnbatchedNow, _Unfused)
from ._fusion import _lock as _fusion_lock
from ._fusion import _numbered
from ._graphs import _GRAPH_SETTINGS, _any_autocast, _autocast_state, _check_graph_setting, _CudaGraphs, _graph_variant
from ._inputs import (_bounded_add, _check_devices, _grad_and_training, _input_device, _integer, _put_back,
                      _signature, _with_context)
from ._joins import JoinSpec, _check_join, _first_line, _join_outputs, _out_of_memory
from ._placement import _UNPLACED, _moved, _place
from ._streams import (_capture_underway, _changed, _changed_in_place, _ChangedInPlace, _current_device,
                       _checkpoint_recording, _current_stream, _fork_join, _graph_state, _in_backward, _is_tracing,
                       _jit_tracing, _run_forked, _symbolic, _tensor_leaves, _unversioned, _watched, _Writes)
from . import _watch

__all__ = ["Parallel"]

Streams = Union[bool, Literal["auto"]]
Fuse = Union[bool, Literal["auto"]]


def _buffers_kept(roots: list[nn.Module]) -> Callable[[], list[BaseException]] | None:
    r"""A function that puts back the buffers of ``roots`` and of every module below, as they are now.

    For a trial run that must leave no trace: buffers written in place, through
    ``.data`` (re-pointed, viewed anew, grown by ``resize_``), assigned anew
    (``self.n = self.n + 1``), made to require grad, registered or replaced by
    a parameter, and submodules registered, get their tensors, values and
    registrations back, in their order; so do tensor attributes that are no
    buffer, written in place (a count kept in ``self.calls``). (Parameters
    written in place are not put back.) The function returns what it failed to
    put back, having put back the rest; ``None`` where the buffers could not be
    copied (memory).
    """
    kept = []
    try:
        with torch.no_grad():
            for m in {id(m): m for root in roots for m in root.modules()}.values():
                held = _tensor_attributes(m).values()
                tensors = [(b, b.data, b.requires_grad, None if b.is_meta else b.clone())
                           for b in (*m._buffers.values(), *held) if b is not None]
                dicts = [(d, list(d.items())) for d in (m._buffers, m._parameters, m._modules)]
                kept.append((m, dicts, set(getattr(m, "_non_persistent_buffers_set", ())), tensors))
    except (RuntimeError, MemoryError):
        return None

    def restore() -> list[BaseException]:
        failures: list[BaseException] = []
        with torch.no_grad():
            for m, dicts, non_persistent, tensors in kept:
                for now, then in dicts:
                    try:
                        items = list(now.items())
                        if len(items) != len(then) or any(a[0] != b[0] or a[1] is not b[1] for a, b in zip(items, then)):
                            for k, _ in items:  # (TorchScript modules keep theirs behind a wrapper: per key)
                                del now[k]
                            for k, v in then:
                                now[k] = v
                    except Exception as e:
                        failures.append(e)
                persistent = getattr(m, "_non_persistent_buffers_set", None)
                if persistent is not None and persistent != non_persistent:
                    persistent.clear()
                    persistent.update(non_persistent)
                for b, data, requires_grad, values in tensors:
                    if b.is_inference() and not torch.is_inference_mode_enabled():
                        continue  # (not writable here, so not written by the trial either)
                    try:
                        if b.requires_grad != requires_grad and b.is_leaf:
                            b.requires_grad_(requires_grad)
                        b.data = data  # (its own memory, offset, strides, dtype and shape: O(1))
                        if values is None:
                            continue  # (a meta tensor holds no values)
                        try:
                            same = torch.equal(b, values)
                        except (RuntimeError, NotImplementedError):  # (no kernel: sparse)
                            same = False
                        if not same:
                            b.copy_(values)
                    except Exception as e:
                        failures.append(e)
        return failures

    return restore


def _note_failures(error: BaseException, failures: list[BaseException]) -> BaseException:
    r"""``error``, with a note for each failure of :func:`_buffers_kept`'s function to put a buffer back."""
    for failure in failures:
        _with_context(error, f"(and putting back the members' buffers after their trial failed: {failure!r})")
    return error


class _Schedule(NamedTuple):
    r"""How a call runs: groups of identical branches batched or not, units on side streams or not."""

    fused: bool
    forked: bool
    cuda: bool  # False: not a CUDA input, so no stream or capture to think about


class _Reduced(NamedTuple):
    r"""Branch outputs already joined, by the fork that ran them (see ``_streams._run_forked``'s ``join``)."""

    value: Any


# What non-reentrant checkpointing raises to end a recomputation early (private to torch;
# none where it is missing): control flow through the branches, never their failure.
_StopRecomputation = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())

# Joins that read the outputs and return new tensors: a fork may run them itself.
_REDUCING_JOINS = ("cat", "stack", "sum", "mean")
# Beyond any tensor's number of dimensions (torch allows 64 at most in places, fewer in
# others); a ``dim`` outside it would reach torch as an index it cannot convert.
_MAX_DIM = 1 << 16
# Constructor arguments kept as attributes, which a user may change later (see __setattr__).
_SETTINGS = frozenset({"join", "dim", "streams", "fuse"}) | _GRAPH_SETTINGS


def _check_setting(owner: str, name: str, value: Any) -> Any:
    if name == "join":
        return _check_join(owner, value)
    if name == "dim":
        dim = _integer(value)  # (a NumPy integer or a 0-dim integer tensor too, as torch.cat takes them)
        if dim is None:
            raise TypeError(f"{owner}: dim must be an int, got {type(value).__name__} ({value!r}).")
        value = dim
        if not -_MAX_DIM <= value < _MAX_DIM:  # (torch cannot even take it as an index: no message of ours)
            raise ValueError(f"{owner}: dim={value} is out of range for any tensor; pass the dimension of the "
                             f"branch outputs to join along, e.g. dim=1 or dim=-1.")
        return value
    if name in ("streams", "fuse"):
        # Not ``value in (True, False, "auto")``: 1 == True and 0 == False would slip through.
        if not (isinstance(value, bool) or (isinstance(value, str) and value == "auto")):
            error = ValueError if isinstance(value, str) else TypeError
            raise error(f"{owner}: {name} must be True, False or 'auto', got {value!r}.")
        return value
    return _check_graph_setting(owner, name, value)


# Blocks of this many structurally different branches are also captured with each side
# branch in turn on a high-priority stream (see ``_graph_variants``).
_MAX_PRIORITY_VARIANTS = 8
# The spin that holds the stream while ``_longest_first`` queues the branches it
# times (about 0.5 ms on an H100; lengthened where the queueing takes longer).
_SPIN_CYCLES = 1_000_000


class _Priority(NamedTuple):
    r"""A graph variant: the side stream of slot ``index`` (1..) given the greatest priority (see
    ``_streams``); slot ``i`` runs branch ``i``, or ``order[i]`` beside an ``_Order``."""

    index: int


class _Order(NamedTuple):
    r"""A graph variant: the branches captured in this order, ``order[0]`` on the capture stream."""

    order: tuple[int, ...]

# A graph variant of a fused call: the biases of its batched products copied in on
# the capture stream itself, not on a side stream (see ``_fusion._Prefill``).
_INLINE_BIAS = "bias in line"

_CPU = _Schedule(False, False, False)
_CPU_FUSED = _Schedule(True, False, False)
# ``_CPU`` kept by ``fuse="auto"`` because a branch wrote the shared input on the first
# call: the same schedule, told apart by identity so that ``explain()`` can say why.
_CPU_IN_TURN = _Schedule(False, False, False)
# A CUDA signature kept in turn because a branch wrote its inference-tensor input on its
# first call (see Parallel._first_unversioned): told apart likewise.
_CUDA_IN_TURN = _Schedule(False, False, True)


class Parallel(nn.Module):
    r"""Runs independent branches on the same input concurrently and joins their outputs.

    ``Parallel(a, b, c, join="cat", dim=1)(x)`` computes
    ``torch.cat([a(x), b(x), c(x)], dim=1)``, with the same result, but on a
    CUDA device each branch after the first runs on a side stream of its own,
    so branches that each leave the GPU partly idle overlap. The first branch
    runs on the caller's current stream; side streams fork from it with an
    event and are joined back into it before the outputs are combined, so the
    module can be used inside ``torch.cuda.stream(s)`` and inside CUDA graph
    capture like any other module.

    On the CPU, or while ``torch.compile``/``torch.export`` trace the model,
    branches run one after the other with identical results (groups fused
    with ``fuse`` run batched there too, equal up to rounding).

    Branches are registered like :class:`torch.nn.Sequential`'s children:
    ``"0"``, ``"1"``, ... or the names of an ``OrderedDict``, so the state dict
    has the same keys as an :class:`torch.nn.ModuleList` (or
    :class:`torch.nn.ModuleDict`) of the same branches.

    Args:
        *branches: modules (or callables) to run, or a single ``OrderedDict``
            mapping names to them. Each receives the same ``*args, **kwargs``
            and may return a tensor or a (nested) tuple/list/dict of tensors.
        join: how to combine the outputs, in branch order: ``"cat"`` along
            ``dim``, ``"stack"`` along ``dim``, ``"sum"``, ``"mean"``,
            ``None`` or ``"tuple"`` for a tuple, ``"dict"`` for a dict keyed
            by branch name, or a callable taking the list of outputs (a
            module without parameters or buffers too, called but not
            registered: the block's ``.eval()`` does not reach it). Named
            joins apply leaf by leaf to structured outputs. Default: ``"cat"``.
        dim: dimension for ``"cat"`` and ``"stack"``. Default: ``1``.
        streams: ``True`` to always fork onto side streams, ``False`` to run
            branches one after another on the caller's stream, ``"auto"`` to
            time both on the first calls of each input signature and keep the
            faster one (as ``torch.backends.cudnn.benchmark`` does); while
            autograd records (a parameter or an input requires grad),
            ``"auto"`` runs sequentially (the backward cannot be timed in
            advance); while ``cuda_graph=True`` captures, ``"auto"`` forks.
            Default: ``"auto"``.
        cuda_graph: ``True`` to capture the whole forward pass -- and, when
            autograd records and an input or a parameter requires grad, the
            backward pass -- in a CUDA graph per input signature, and replay
            it on later calls with that signature (see the warning below).
            Inputs not on CUDA run eagerly, with a one-time warning. Default:
            ``False``.
        max_graphs: graphs kept per module, least recently used freed first;
            a warning tells when signatures change faster than this holds.
            Default: ``8``.
        static_outputs: return the graph's own output buffers instead of
            fresh copies, saving one copy per output; they are overwritten by
            the module's next call, so use or copy them before it. In
            training, changing one in place before backward is refused where
            the backward reads it (an output of ``ReLU``), as eager autograd
            refuses it. Default: ``False``.
        graph_fallback: when a signature cannot be captured, warn once and
            run it eagerly from then on instead of raising. Default: ``False``.
        direct_grads: with ``cuda_graph=True`` in training, take the
            parameters out of autograd's graph. Without it they are inputs
            of the replay's autograd node as in any graph, and a plain
            ``loss.backward()`` with nothing listening on them has the
            backward replay hand their gradients to ``.grad`` itself (set,
            or summed into what is there, when the backward pass ends, on
            the stream that called it) and their accumulators none;
            the engine still visits one accumulator per parameter, whose host
            time is a large part of a CPU-bound graphed training step. With
            it, the engine visits none: ``loss.backward()`` fills their
            ``.grad`` as usual, ``torch.autograd.grad`` and
            ``backward(inputs=...)`` leave it alone, and asking either for the
            parameters' own gradients fails as for tensors the loss does not
            use. Calls made while a parameter has a hook
            (:meth:`~torch.Tensor.register_hook`,
            :meth:`~torch.Tensor.register_post_accumulate_grad_hook`) or a
            :mod:`torch.distributed` process group exists (DDP and FSDP hook
            the accumulators) go through autograd as without it. After
            ``zero_grad()``, the gradients' memory stays with the graph, which
            refills it at the next backward unless something still holds the
            old gradients. Default: ``False``.
        fuse: ``True`` to run structurally identical branches (same module
            types, hyper-parameters, parameter shapes, dtypes and device, no
            hooks, and the same train/eval mode for layers whose output depends
            on it: dropout above rate 0 and norms, not ``Linear`` or activations) as one
            batched computation per layer, their parameters stacked; an error
            names the branch that differs. Dropout with a rate above 0 and
            BatchNorm fuse only in evaluation mode (in training, dropout draws
            random masks and BatchNorm updates its statistics). ``"auto"`` fuses each
            identical group and times fused against unfused (eagerly, or by
            capturing both with ``cuda_graph=True``), keeping the faster (on
            the CPU it fuses without timing) -- except with
            :func:`torch.use_deterministic_algorithms` on, where it keeps the
            branches unfused, since fused results may differ from them in the
            last bits and timing may choose differently between runs. ``False``
            never fuses. ``explain()`` says what was fused and why the rest was
            not. Captured in a CUDA graph for inference on at most 16 rows, a
            group of ``Linear`` layers and activations runs each layer, bias
            and activation as one Triton kernel (float32 accumulation) where
            Triton is available. Groups are found when the branches are set
            (construction, ``append``, ``.to()``), and again once a submodule,
            parameter or buffer below is replaced or registered, a hook added
            or a train/eval mode changed. A group runs its first member's
            layers for every member: a hyper-parameter changed in place later
            (``conv.padding = 0``, ``norm.eps = 1e-3``) is seen once ``fuse``
            is set again (``block.fuse = block.fuse``), and Python side effects
            of a member's ``forward`` (a call counter) happen once per call.
            Fused parameters are views of one stacked tensor per layer: saving
            one branch's ``state_dict`` saves every member's values (clone them
            first to save one). Default: ``False``.
        compile: compile each branch on its own, at its first call, and run
            the compiled code under this module's streams and CUDA graph:
            ``"inductor"`` (or another :func:`torch.compile` backend name or
            callable), or ``"tensorrt"`` (``torch_tensorrt.compile(branch,
            ir="dynamo", inputs=<the call's tensors>)``, inference only, one
            engine per input signature). The state dict does not change.
            Branches fused with ``fuse`` run batched instead. With
            ``cuda_graph=True``, an inference signature is also captured with
            the branches as they are, and, with a :func:`torch.compile`
            backend, the block compiled as a whole (the branches one after
            another, on one stream, with the compiler's fusion across them);
            the fastest replay is kept. See the README's "Compilers" section.
            Default: ``None``.
        compile_options: keyword arguments for :func:`torch.compile`
            (``dynamic`` defaults to ``False``: one compilation per input
            signature; modes with CUDA graphs are refused, ``cuda_graph=True``
            captures the compiled branches instead), or for
            ``torch_tensorrt.compile``. Default: ``None``.
        compile_fallback: when a branch fails to compile, warn once and run it
            eagerly from then on instead of raising.
            ``compile``, ``compile_options`` and ``compile_fallback`` are fixed
            once the module is built: setting one raises ``AttributeError``.
            Default: ``False``.

    Example::

        >>> block = Parallel(
        ...     nn.Conv2d(192, 64, 1),
        ...     nn.Sequential(nn.Conv2d(192, 48, 1), nn.Conv2d(48, 64, 5, padding=2)),
        ...     join="cat", dim=1,
        ... )
        >>> block(torch.randn(8, 192, 35, 35)).shape
        torch.Size([8, 128, 35, 35])

    .. warning::
        With ``cuda_graph=True`` the first call of each input signature (shapes,
        strides, dtypes, device, ``requires_grad``, grad mode, train/eval,
        autocast, non-tensor arguments) runs the module 3 times to warm up on a
        side stream (and, for inference, each branch a few more times, alone, on
        copies of the inputs, to time it), captures it, and returns the graph's
        first replay on its inputs; buffers such as BatchNorm statistics are restored after the
        warm-up, so they see one update per call, as in eager mode. Captured
        code must follow the CUDA graph rules:

        * shapes static per signature; no host synchronisation (``.item()``,
          ``.cpu()``, ``.tolist()``, ``.nonzero()``, ``print`` of a CUDA tensor,
          ``torch.cuda.synchronize()``); no Python control flow on tensor
          values; Python side effects happen only during warm-up and capture.
          Breaking a rule raises a ``RuntimeError`` naming the branch (or,
          with ``graph_fallback=True``, warns once and runs eagerly).
        * inputs are copied into static buffers on each call, except where an
          inference signature's input lies where the first call's lay: a
          second graph then reads it in place (not made where the module
          writes its input, and ``explain()`` marks it "(input read in
          place)"; see the README's "CUDA graphs"). Changes the module makes
          to its inputs in place (as autograd's version counter sees them)
          are copied back into the caller's tensors after each replay, as
          an eager call makes them;
          parameters and buffers are read in place, so optimizer steps between
          calls work. ``module.to()``, ``.cuda()``, ``.half()`` and changing
          the branches drop the graphs, which are captured again. A branch
          moved on its own (``block[0].half()``) or a parameter given new
          memory (``p.data = ...``) is not seen: the graphs keep the memory
          they were captured with alive and replay it -- call
          ``block.to(device)`` afterwards to capture anew.
        * outputs are never overwritten while you hold them. They are clones
          of the graph's buffers, except where the module sees every output
          released before the next call (as when it sits inside a larger
          model): it then returns the buffers themselves, checking before each
          replay, by reference count, that no output nor view of one is still
          alive -- if one is, that call runs eagerly and the module clones
          from then on. Like the caching allocator without
          :meth:`~torch.Tensor.record_stream`, this knows only the caller's
          stream: make the caller's stream wait for any other stream that
          reads an output before you drop it.
        * random operations (dropout) draw new numbers at each replay.
        * in training, run ``backward`` through one call before the next call
          with the same signature; double backward is not supported.

    .. note::
        A branch must not depend on another branch's side effects: they may run
        in any order on the GPU. A branch that changes the shared input in place
        (``nn.ReLU(inplace=True)`` first) is refused when the branches fork, naming
        it. Outputs produced on side streams are safe to
        keep, free or use on the caller's stream (they are marked with
        :meth:`torch.Tensor.record_stream`).

    .. note::
        Branches may live on different GPUs, e.g.
        ``Parallel(a.to("cuda:0"), b.to("cuda:1"))``: each branch runs on the
        device of its parameters, on a copy of the input made there on a side
        stream of that device, and its outputs are copied back to the input's
        device before the join (``streams=False``: one device after the other).
        Gradients flow back through the copies. Branches without parameters run
        on the input's device. Refused: ``cuda_graph=True`` with such branches
        (graph each device's branches in a ``Parallel`` of its own instead), and
        CPU branches next to CUDA ones.
    """

    _modules: dict[str, nn.Module]  # type: ignore[assignment]
    # The private state of an instance: no branch may take these names (see _check_name).
    _internal = frozenset({"_compiler", "_fusion", "_graph_moves", "_graphs", "_groupings", "_param_moves",
                           "_placed", "_in_order", "_placement", "_plans", "_reproducible", "_revision",
                           "_saw_write", "_serial", "_tree", "_tuner", "_unwritten", "_watched_fused"})

    @overload
    def __init__(self, *branches: nn.Module | Callable[..., Any], join: JoinSpec = "cat", dim: int = 1,
                 streams: Streams = "auto", cuda_graph: bool = False, max_graphs: int = 8,
                 static_outputs: bool = False, graph_fallback: bool = False, direct_grads: bool = False,
                 fuse: Fuse = False, compile: Backend | None = None,
                 compile_options: dict[str, Any] | None = None, compile_fallback: bool = False) -> None: ...

    @overload
    def __init__(self, branches: OrderedDict[str, nn.Module | Callable[..., Any]], /, *, join: JoinSpec = "cat",
                 dim: int = 1, streams: Streams = "auto", cuda_graph: bool = False, max_graphs: int = 8,
                 static_outputs: bool = False, graph_fallback: bool = False, direct_grads: bool = False,
                 fuse: Fuse = False, compile: Backend | None = None,
                 compile_options: dict[str, Any] | None = None, compile_fallback: bool = False) -> None: ...

    def __init__(self, *branches: Any, join: JoinSpec = "cat", dim: int = 1, streams: Streams = "auto",
                 cuda_graph: bool = False, max_graphs: int = 8, static_outputs: bool = False,
                 graph_fallback: bool = False, direct_grads: bool = False, fuse: Fuse = False,
                 compile: Backend | None = None, compile_options: dict[str, Any] | None = None,
                 compile_fallback: bool = False) -> None:
        super().__init__()
        self._modules = {}
        owner = type(self).__name__
        named = len(branches) == 1 and isinstance(branches[0], OrderedDict)
        if named:
            items = list(branches[0].items())
        else:
            items = [(str(i), b) for i, b in enumerate(branches)]
        if not items:
            raise ValueError(
                f"{owner}: expected at least one branch, got none. "
                f"Pass modules, e.g. {owner}(nn.Linear(8, 8), nn.Linear(8, 8))."
            )
        for name, _ in items:
            _check_name(type(self), "branch", name, _SETTINGS)
        # (Each setting is checked by __setattr__.)
        self.join = join
        self.dim = dim
        self.streams = streams
        self.fuse = fuse
        self.cuda_graph = cuda_graph
        self.max_graphs = max_graphs
        self.static_outputs = static_outputs
        self.graph_fallback = graph_fallback
        self.direct_grads = direct_grads  # the graph cache is made by _reset, below
        self._compiler = _compiler(owner, "branch", compile, compile_options, compile_fallback)
        for name, branch in items:
            # (``constructing``: given by position, where a setting may have been meant.)
            self.add_module(name, _as_branch(owner, name, branch, constructing=not named))
        self._param_moves = self._graph_moves = 0
        self._serial = _numbered(self)  # (see _fusion._differs)
        # fuse=True: say now, not at the first call, which branch keeps them from fusing.
        self._reset(strict=True)

    # ------------------------------------------------------------------ state
    def __setattr__(self, name: str, value: Any) -> None:
        # A setting changed after construction (``block.join = "sum"``) is checked as the
        # constructor checks it, and what was learnt under the old value goes: a graph
        # captured with the old join would replay it.
        _watch._check_attribute(self, name, _SETTINGS)
        if name == "_modules":
            # Children given anew (renumbered by ``del block[i]``, assigned by the user): what
            # was learnt of the old ones goes, here and in the blocks enclosing this one.
            _watch._children_changed()
        if name in _SETTINGS:
            value = _check_setting(type(self).__name__, name, value)
            if "_tree" in self.__dict__:  # (constructed)
                _watch._change_setting(self, name, value, lambda: self._reset(strict=name == "fuse"))
                return
            # Kept as a plain attribute: a join that is a module is called, never
            # registered (it would become a branch, and enter the state dict).
            self.__dict__[name] = value
            return
        super().__setattr__(name, value)

    def _reset(self, strict: bool = False) -> None:
        r"""Forget everything learnt about calls: after the branches, their
        devices or dtypes change, devices are checked, schedules tuned and CUDA
        graphs captured anew."""
        # (The graphs cleared outside the fusion lock, before and after: a capture holds its
        # graphs' lock and may take the fusion lock, to group or stack, so the two are only
        # ever taken in that order. Cleared after, a graph a capture was making meanwhile of
        # the old groups goes too.)
        graphs = self.__dict__.get("_graphs")
        if graphs is not None:
            graphs.clear()
        with _fusion_lock:  # (another thread's call may be grouping: its groups must not land after these)
            self._forget(strict)
        if graphs is not None:
            graphs.clear()

    def _forget(self, strict: bool) -> None:
        # The tree as it is before the groups are made of it: a change that lands
        # while they are made is seen at the next call.
        # (Not comparing the dicts of children below at every call, as a pipeline does: see _watch.)
        tree = _watch._Tree(self)
        self._tuner = _ScheduleTuner()
        self._plans: dict[Hashable, _Schedule] = {}
        # Signatures planned unfused while "auto" kept the groups so for deterministic
        # algorithms: planned anew once those are off (see _replan_reproducible).
        self._reproducible: dict[Hashable, None] = {}
        # Signatures with inference-tensor inputs whose first call saw no branch write to them.
        self._unwritten: dict[Hashable, None] = {}
        # The same, for fuse=True: signatures whose first call was watched (see _first_inference_fused).
        self._watched_fused: dict[Hashable, None] = {}
        # A branch wrote the shared input on a call after "auto" had forked or fused out of
        # branch order: schedules keep the branches in order (see _keep_in_order).
        self._in_order = False
        # An eager call saw a branch change the shared input in place: compilers trace no
        # fused group (see _traced_fusion).
        self._saw_write = False
        self._fusion: _Fusion | None = None
        # The groups last found for each combination of the members' train/eval modes (see _new_fusion).
        self._groupings: dict[tuple[bool, ...], list[list[int]]] = {}
        self._placement: Any = _UNPLACED  # which device each branch runs on: _placement.py
        if self.__dict__.get("_graphs") is None:  # constructed, unpickled or deep-copied: graphs never are copied
            self._graphs = _CudaGraphs(self, self.max_graphs, self.static_outputs, self.graph_fallback,
                                       direct_grads=self.direct_grads)
        if self.fuse is not False:
            self._prepare_fusion(strict)
        self._tree = tree
        self._placed = _watch._placement(self)  # (see _apply)

    def _prepare_fusion(self, strict: bool) -> None:
        r"""Find the groups of identical branches and stack their parameters.

        Done when the branches are set (construction, ``append``, ``.to()``),
        not at the first call: stacking moves the parameters to new memory, and
        CUDA graphs captured after that -- ours, or the user's of the same
        branches -- must read the new memory.
        """
        try:
            self._fusion = self._new_fusion()
        except ValueError:
            if strict:
                raise
            # fuse=True and the branches no longer all match: the next call says so.

    def _grouped(self) -> _Fusion:
        r"""The branches grouped as they are now, nothing stacked (raises for ``fuse=True`` if they differ)."""
        return _Fusion(type(self).__name__, list(self._modules), list(self._modules.values()),
                       required=self.fuse is True, serial=self._serial)

    def _new_fusion(self) -> _Fusion:
        r"""Group the branches as they are now; outside tracing, stack the groups' parameters."""
        fusion = self._grouped()
        # Found inside functional_call, from the tensors it swapped in (tied or unlike as they may
        # be; nothing stacked then): found again at the first call outside (see _fusion_for).
        fusion.while_swapped = not _is_tracing() and _watch._swapped_in(self.modules())
        if not _is_tracing():
            if any([group.bind() for group in fusion.groups]):
                self._param_moves += 1
            self._forget_fused_plans_if_regrouped(fusion)
        return fusion

    def _forget_fused_plans_if_regrouped(self, fusion: _Fusion) -> None:
        r"""Plan anew the signatures planned fused, where ``fusion`` groups the branches otherwise than the
        groups last found in the same train/eval modes of the members did.

        Plans are kept per mode (the signature holds it), and the groups are
        found anew as the modes switch (``train()``, ``eval()``): a plan chosen
        with the groups of its mode holds again when they come back alike. A
        hook registered on a member meanwhile (in training, where its dropout
        kept it out of every group, so that nothing regrouped then) leaves that
        member out of the groups found at ``eval()``: the evaluation plans chosen
        with it fused must be chosen anew, their first call watched for a branch
        now out of the groups that writes the shared input (see
        :meth:`_planned_fusion`).
        """
        modes = tuple([mode for _, mode in fusion.modes])
        grouping = _grouping(fusion)
        before = self.__dict__.get("_groupings")
        if before is None:
            return
        if modes in before and before[modes] != grouping:
            self._forget_plans(lambda plan: plan.fused)
        before[modes] = grouping

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # .to(), .cuda(), .half() ... move parameters: re-check devices, stack anew, compile again.
        module = super()._apply(fn, recurse)
        _watch._reset_if_moved(self)
        return module

    def __getstate__(self) -> dict:
        state = _state_to_copy(self)
        state.pop("_tuner", None)
        state.pop("_plans", None)
        state.pop("_reproducible", None)
        state.pop("_graphs", None)
        state.pop("_fusion", None)
        state.pop("_groupings", None)
        state.pop("_tree", None)
        state.pop("_placed", None)
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("_compiler", None)  # pickled before compile= existed
        state.setdefault("direct_grads", False)  # pickled before direct_grads= existed
        super().__setstate__(state)
        self._serial = _numbered(self)  # (a copy's own: see _fusion._differs)
        self._reset()

    # -------------------------------------------------------------- container
    def _settings(self) -> dict[str, Any]:
        return {"join": self.join, "dim": self.dim, "streams": self.streams, "cuda_graph": self.cuda_graph,
                "max_graphs": self.max_graphs, "static_outputs": self.static_outputs,
                "graph_fallback": self.graph_fallback, "direct_grads": self.direct_grads, "fuse": self.fuse,
                **(self._compiler.settings() if self._compiler else {})}

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def _key(self, idx: int, slices: bool = True) -> str:
        return _child_key(type(self).__name__, list(self._modules), idx, "branch", slices)

    @overload
    def __getitem__(self, idx: slice) -> Parallel: ...

    @overload
    def __getitem__(self, idx: int) -> nn.Module: ...

    def __getitem__(self, idx: int | slice) -> nn.Module | Parallel:
        if isinstance(idx, slice):
            items = list(self._modules.items())
            chosen = items[idx]
            if not chosen:
                # (nn.ModuleList would return an empty one; a block needs a branch, and the
                # constructor's "got none" would name no slice.)
                raise ValueError(
                    f"{type(self).__name__}: the slice [{_slice_text(idx)}] selects none of the {len(items)} "
                    f"branches, and a {type(self).__name__} needs at least one. Choose a slice that keeps "
                    f"one (e.g. block[:1]), or check len(block) first."
                )
            if all(k == str(i) for i, (k, _) in enumerate(items)):
                # Numbered anew, as nn.ModuleList's slices are (and ``del block[i]`` numbers
                # them): keys "0", "1", ... as a ModuleList of those branches has, and room
                # to append. Named branches keep their names.
                chosen = [(str(i), m) for i, (_, m) in enumerate(chosen)]
            return _new_like(self, f"a slice, block[{_slice_text(idx)}],", "branch", OrderedDict(chosen), **self._settings())
        return self._modules[self._key(idx)]

    def __setitem__(self, idx: int, module: nn.Module | Callable[..., Any]) -> None:
        key = self._key(idx, slices=False)
        self.add_module(key, _own_mode(self, _as_branch(type(self).__name__, key, module, container=self), module))
        self._reset()

    def __delitem__(self, idx: int | slice) -> None:
        keys = list(self._modules)[idx] if isinstance(idx, slice) else [self._key(idx)]
        if len(keys) == len(self._modules):
            raise ValueError(f"{type(self).__name__}: cannot delete every branch; at least one must remain.")
        numbered = all(k == str(i) for i, k in enumerate(self._modules))
        for k in keys:
            del self._modules[k]
        if numbered:  # keep "0", "1", ... contiguous, as nn.Sequential does
            self._modules = OrderedDict((str(i), m) for i, m in enumerate(self._modules.values()))
        _watch._children_changed()
        self._reset()

    def __delattr__(self, name: str) -> None:
        # ``del block.name`` of a branch registers nothing (see _watch): forget what
        # was learnt about the branches, as ``__delitem__`` does (a fused group or a
        # graph would go on running the deleted branch).
        _watch._check_attribute(self, name, _SETTINGS, deleting=True)
        branch = name in self._modules
        if branch and len(self._modules) == 1:
            raise ValueError(f"{type(self).__name__}: cannot delete every branch; at least one must remain.")
        super().__delattr__(name)
        if branch:
            _watch._children_changed()
            self._reset()

    def append(self, module: nn.Module | Callable[..., Any]) -> Parallel:
        r"""Append a branch at the end; returns ``self``.

        Args:
            module: the branch, a module or a callable (as the class's
                ``*branches``).
        """
        key = str(len(self._modules))
        if key in self._modules:
            # (Names kept by an OrderedDict or ``del block.name``: "0", "2".)
            owner = type(self).__name__
            raise ValueError(f"{owner}: a branch named {key!r} already exists ({list(self._modules)}); append "
                             f"names the new branch by its index, {key!r}. Build a new block, "
                             f"{owner}(*block, module), or name the branches in an OrderedDict.")
        self.add_module(key, _own_mode(self, _as_branch(type(self).__name__, key, module, container=self), module))
        self._reset()
        return self

    def extend(self, modules: Iterable[nn.Module | Callable[..., Any]]) -> Parallel:
        r"""Append every module of an iterable; returns ``self``.

        Args:
            modules: the branches to append, in order.
        """
        owner, n = type(self).__name__, len(self._modules)
        # All checked before any is appended: a bad one leaves the block as it was.
        branches = [_own_mode(self, _as_branch(owner, str(n + i), m, container=self), m)
                    for i, m in enumerate(_listed(owner, "extend", "branch", modules))]
        taken = [str(n + i) for i in range(len(branches)) if str(n + i) in self._modules]
        if taken:  # (names kept by a slice of named branches or `del block.name`: "1", "3")
            raise ValueError(f"{owner}: a branch named {taken[0]!r} already exists ({list(self._modules)}); "
                             f"extend names the new branches by their index. Build a new block, "
                             f"{owner}(*block, *modules), or name the branches in an OrderedDict.")
        for m in branches:
            self.append(m)
        return self

    def __iadd__(self, modules: Iterable[nn.Module | Callable[..., Any]]) -> Parallel:
        return self.extend(modules)

    def __add__(self, other: Iterable[nn.Module | Callable[..., Any]]) -> Parallel:
        r"""A new block with this one's settings and the branches of both, numbered anew.

        As :class:`nn.ModuleList`'s ``+``: the branches are shared, not copied, and
        neither operand changes.
        """
        others = _listed(type(self).__name__, "+", "branch", other)
        return _new_like(self, "+", "branch", *self._modules.values(), *others, **self._settings())

    def insert(self, index: int, module: nn.Module | Callable[..., Any]) -> Parallel:
        r"""Insert a branch before position ``index`` (as :meth:`nn.ModuleList.insert`); returns ``self``.

        The branches after it move up by one, so they must be named by their
        position, ``"0"``, ``"1"``, ... (not names given in an ``OrderedDict``
        or kept through a slice of named branches).

        Args:
            index: the position the branch takes, from ``-len(self)`` to
                ``len(self)``.
            module: the branch, a module or a callable.
        """
        owner, n = type(self).__name__, len(self._modules)
        index = _insert_index(owner, index, n, "branch", "branches")
        _check_numbered(owner, list(self._modules), "branches", "insert", "given in an OrderedDict, or kept through "
                        "a slice or a deletion of named branches", "Build a new one with the branches in the order "
                        "you want.")
        index = index + n if index < 0 else index
        branch = _own_mode(self, _as_branch(owner, str(index), module, container=self), module)
        branches = list(self._modules.values())
        branches.insert(index, branch)
        self._modules = OrderedDict((str(i), m) for i, m in enumerate(branches))
        _watch._children_changed()
        self._reset()
        return self

    @overload
    def pop(self, key: slice) -> Parallel: ...

    @overload
    def pop(self, key: int) -> nn.Module: ...

    def pop(self, key: int | slice) -> nn.Module | Parallel:
        r"""Remove the branch at ``key`` and return it, as :meth:`nn.ModuleList.pop`; a slice returns
        the branches it removes as a block with this one's settings.

        Args:
            key: the position of the branch, or a slice of positions.
        """
        value = self[key]
        del self[key]
        return value

    def extra_repr(self) -> str:
        join = getattr(self.join, "__qualname__", None) or repr(self.join)
        text = f"join={join}, dim={self.dim}, streams={self.streams!r}"
        if self.fuse is not False:
            text += f", fuse={self.fuse!r}"
        if self.cuda_graph:
            text += (f", cuda_graph=True, max_graphs={self.max_graphs}, static_outputs={self.static_outputs}, "
                     f"graph_fallback={self.graph_fallback}")
            if self.direct_grads:
                text += ", direct_grads=True"
        if self._compiler is not None:
            text += ", " + self._compiler.extra_repr()
        return text

    # ---------------------------------------------------------------- fusion
    def explain(self) -> dict[str, Any]:
        r"""Describe how the next call runs the branches: which are fused, and each input signature's schedule.

        It describes the branches as they are now: after a change to them (a
        layer replaced, a hook registered on one) it gives the groups the next
        call will find, and only the schedules that call keeps.

        Returns:
            A dict with the keys

            * ``"fused"``: the groups (lists of branch names) of identical
              branches that may run as one batched computation (``fuse=True``
              or ``"auto"``).
            * ``"unfused"``: every other branch's name, mapped to why it is not
              fused.
            * ``"schedules"``: for each input signature seen so far, the
              schedule in use: ``"fused"`` or ``"unfused"``, and ``"streams"``
              or ``"sequential"``, as ``"auto"`` chose them or as forced; then
              the CPU and GPU time per call ``"auto"`` measured for each
              schedule it timed or, where timing did not decide, why
              ``"auto"`` keeps the groups unfused or the branches in order.
              A CUDA graph reads ``"CUDA graph, ..."`` with the variant it
              replays: the order its branches are launched in, a branch on a
              high-priority stream, with ``compile=`` ``"compiled branches"``,
              ``"eager branches"`` or ``"the block compiled as one, one
              stream"`` (whichever replayed fastest), and ``"(input read in
              place)"`` where it also reads inputs found where the first
              call's lay without copying them in. Each graph is an entry of
              its own, named by what sets it apart from the others of its
              input signature (autocast or another default dtype, inference
              mode, submodules in another mode, frozen parameters, other
              kernel settings, inputs at another alignment).
            * ``"fallback"``, if the latest eager call that ran a group fused
              fell back to its members unfused for that call alone (under
              autocast, or an attention layer in ``eval()`` with grad
              enabled): each such group's tuple of names, mapped to why.
              Calls that run the group unfused by their schedule do not
              change it.
            * ``"not compiled as one"``, if the block could not be compiled (or
              captured) as one program: why.
            * ``"compile fallback"``, with ``compile_fallback=True``: each
              branch that runs eagerly on the input signatures it failed to
              compile for, mapped to why.

        Example::

            >>> block = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2), fuse="auto")
            >>> _ = block(torch.randn(2, 4))
            >>> info = block.explain()
            >>> info["fused"], info["unfused"]
            ([['0', '1']], {'2': 'no other branch is identical to it'})
            >>> info["schedules"]  # on the CPU: fused without timing, the branches in turn
            {'Tensor(2, 4) float32 on cpu, training': 'fused, sequential'}
        """
        fusion = held = self._fusion
        # What the next calls will find (as ``forward``, ``_fusion_for`` and the groups look): the
        # branches changed since they were grouped -- every schedule is then chosen anew -- or
        # a hook registered on a member, a member's mode switched, a member's tensor set to
        # None: grouped anew, not stacked here.
        changed = self._tree.changed(self)
        if self.fuse is not False and (changed or fusion is None or not fusion.current()
                                       or any([group.changed() for group in fusion.groups])):
            try:
                fusion = self._grouped()
            except ValueError:
                fusion = None
        if self.fuse is False:
            fused, unfused = [], {name: "fuse=False" for name in self._modules}
        elif fusion is None:  # fuse=True, and a change to the branches left them not all identical
            fused, unfused = [], {name: "fuse=True, but the branches are no longer all identical; the next "
                                        "call raises and says how" for name in self._modules}
        else:
            report = fusion.report()
            fused, unfused = report["fused"], report["unfused"]
        # (Plans of the old groups fused are chosen anew at the next call: see _fusion_for.)
        regrouped = fusion is not held and (fusion is None or held is None or _grouping(fusion) != _grouping(held))
        # Why the groups run unfused where no timing chose it, for the signatures of one dense
        # tensor, the calls groups may run (see _fusion_for): for now (hooks registered for the
        # whole process, deterministic algorithms), or for good (a write to the shared input).
        now = ""
        if fused and _held_by_hooks():
            now = " (while module hooks are registered for the whole process: FlopCounterMode, ModuleTracker)"
        elif fused and self._auto_unfused():
            now = " (fuse='auto' keeps identical branches unfused while deterministic algorithms are on)"
        replanned = self._reproducible and not torch.are_deterministic_algorithms_enabled()
        wrote = " (a branch changed its input in place on {}: the branches run one after another)"

        def describe(key: Hashable, plan: _Schedule) -> str:
            why = ""
            if plan is _CPU_IN_TURN or plan is _CUDA_IN_TURN:
                why = wrote.format("the first call")
            elif (self._in_order and plan.cuda and not (plan.forked or plan.fused) and self.streams == "auto"
                  and not (fused and _one_tensor(key) and now)):
                # (Forked, or timed to fork, before the write: its costs may show streams the cheaper.)
                why = wrote.format("an earlier call")
            elif fused and _one_tensor(key):
                if now:
                    why, plan = now, plan._replace(fused=False)
                elif not plan.fused and self._in_order and self.fuse == "auto":
                    why = wrote.format("an earlier call")
                elif replanned and key in self._reproducible:
                    why = " (chosen while deterministic algorithms were on: chosen anew at its next call)"
            return _describe_schedule(plan) + why + _describe_costs(self._tuner.costs.get(key))

        # (A copy: calls in other threads add schedules as this describes them; one C call.)
        # (A block regrouped from no groups chooses every schedule anew: see _regrouped.)
        schedules = {_describe_signature(k): describe(k, p) for k, p in self._plans.copy().items()
                     if not changed and not (regrouped and (p.fused or held is not None and not held.groups))}
        if self.cuda_graph and not changed:
            fused_graphs = self.fuse is True or (self.fuse == "auto" and bool(fused))
            for k, (variant, reads) in self._graphs.schedules().items():
                # Each graph by all its key holds (see _CudaGraphs._key: the signature first, the autocast
                # dtype fifth; then modes, which parameters require grad, kernel settings ...), so that
                # graphs of one input signature do not overwrite each other here. Under autocast it reads as
                # the schedule of its signature and autocast does, which the graph replaces for those calls.
                signature = k[0] if k[4] is None else _UnderAutocast(k[0], k[4])
                described = _describe_signature(signature) + self._graphs.describe(k)
                if variant is not None and _WHOLE in variant:
                    schedules[described] = "CUDA graph, the block compiled as one, one stream"
                    continue
                how = [v for v in variant or () if v in ("fused", "unfused")] or [
                    "fused" if fused_graphs else "unfused"]
                how += [f"{v} branches" for v in variant or () if v in (_COMPILED, _EAGER)]
                how += ["biases copied in line" for v in variant or () if v == _INLINE_BIAS]
                names = list(self._modules)
                order = next((v.order for v in variant or () if isinstance(v, _Order)), range(len(names)))
                read = " (input read in place)" if reads else ""
                schedules[described] = f"CUDA graph{read}, {', '.join(how)}, " + (
                    "streams" if self.streams is not False else "sequential") + "".join(
                    f", branch {names[order[v.index]]!r} on a high-priority stream"
                    for v in variant or () if isinstance(v, _Priority)) + "".join(
                    f", launched in the order {[names[i] for i in v.order]}"
                    for v in variant or () if isinstance(v, _Order))
        info = {"fused": fused, "unfused": unfused, "schedules": schedules}
        if fusion is held and fusion is not None:
            last = {tuple(fusion.names[i] for i in g.indices): g.unbatched
                    for g in fusion.groups if g.unbatched is not None}
            if last:
                info["fallback"] = last
        if self._compiler is not None and self._compiler.whole_failure is not None:
            info["not compiled as one"] = self._compiler.whole_failure
        fallen_back = self._compiler.fallen_back(self._modules) if self._compiler is not None else None
        if fallen_back:
            info["compile fallback"] = fallen_back
        return info

    def _fusion_for(self, args: tuple, kwargs: dict, thorough: bool = False, regroup: bool = True,
                    held: bool | None = None) -> _Fusion | None:
        r"""The fused groups that apply to this call, or ``None`` (fusion off, nothing to fuse, not one
        dense tensor).

        ``thorough``: a schedule is being chosen or a graph captured, which
        may also look at what costs too much to look at on every call.
        ``regroup``: find groups out of date anew; else ``None`` for them.
        ``held``: :func:`_held_by_hooks`, where the caller has read it.
        """
        if (kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) or args[0].layout is not torch.strided
                or args[0].is_nested or type(args[0]) is not torch.Tensor and _overrides_ops(type(args[0]))):
            # (Sparse and nested inputs run unfused for the call: the batched steps view and
            # expand their input, which those layouts refuse; failing there, "auto" would
            # unfuse the group for every later call, and fuse=True refuse the call. So do
            # subclasses with a __torch_function__ of their own: batched, it would see other
            # operations than the members', and vmap drops the class.)
            return None
        if _held_by_hooks() if held is None else held:
            return None
        fusion = self._fusion
        if fusion is None or self._out_of_date(fusion, thorough):
            if not regroup:
                return None
            regrouped = False
            with _fusion_lock:  # (looked at again once held: another thread may have grouped)
                fusion = old = self._fusion
                if fusion is None or self._out_of_date(fusion, thorough):
                    fusion = self._fusion = self._new_fusion()
                    regrouped = old is not None and _grouping(old) != _grouping(fusion)
            if regrouped:
                # (A hook registered on a member, a member's mode switched: the schedules
                # chosen with the old groups fused are chosen anew, with these.)
                self._forget_plans(lambda plan: plan.fused)
        return fusion if fusion.groups else None

    def _planned_fusion(self, key: Hashable, plan: _Schedule, args: tuple,
                        kwargs: dict) -> tuple[_Fusion | None, _Schedule | None]:
        r"""The fused groups for a call of signature ``key`` planned fused (``plan``), and that plan, or ``None``
        where the groups were found anew for this call.

        A hook registered on a member, or a member's mode switched, since the
        plan was chosen regroups the branches (:meth:`_fusion_for`), which
        forgets the plans chosen with the old groups fused: this call is then
        the first of its signature, planned anew and watched, as any first call
        is, for a branch now out of the groups that writes the shared input (a
        pre-hook doing so, as the one just registered may). Run with the plan
        it had looked up, the new groups ran out of branch order unwatched, and
        such a call was refused.
        """
        fusion = self._fusion_for(args, kwargs)
        return fusion, (plan if self._plans.get(key) is plan else None)

    def _out_of_date(self, fusion: _Fusion, thorough: bool = False) -> bool:
        r"""Whether ``fusion``'s groups must be found anew (see :meth:`_Fusion.current`); ``thorough``: also
        whether a member's ``forward`` was replaced (see :meth:`_Fusion.forward_replaced`).

        Groups found inside ``torch.func.functional_call``, from the tensors it
        swapped in (see :meth:`_new_fusion`), hold for calls inside one; a trace
        takes them as out of date (it runs the branches unfused), as it cannot
        look for the call.
        """
        return (not fusion.current() or (thorough and fusion.forward_replaced())
                or fusion.while_swapped and (_is_tracing() or not _watch._swapped_in(self.modules())))

    def _traced_fusion(self, args: tuple, kwargs: dict) -> _Fusion | None:
        r"""The fused groups a compiler traces: those eager calls run, where they are current.

        Groups out of date (a mode switched or a hook registered below the block
        since they were found) are not found again inside a trace: a compiler
        cannot trace the comparison of the members' layers, and under
        ``torch.export``'s fake parameters nothing could be stacked. Their
        branches are traced unfused, with the unfused results; ``train()`` and
        ``eval()`` of the block itself find the groups at once.
        """
        if self.fuse is False or self._auto_unfused():
            return None
        held = self._fusion
        if held is not None and held.compiled:
            # A module compiled on its own (``torch.compile(layer)``) never fuses, and the groups'
            # lists hold its branch too: a trace reaching the layer it wraps from them as well as
            # from the block made Dynamo raise an internal AssertionError ("already tracked for
            # mutation") at the first compiled call. Traced unfused, as groups out of date are.
            # (Told by the groups, found eagerly: Dynamo traces such a module as the one it wraps.)
            return None
        if self._saw_write:  # (set too where the block was kept in order: see _keep_in_order)
            # An eager call saw a branch change the shared input in place, which members run
            # together on one input would not all see; compiled code cannot look at each call:
            # traced unfused, as groups out of date are (fuse=True too, whose eager calls refuse
            # such writes; the branch may have been replaced since, which only an eager call
            # sees). (Read here, the compiler guards on it: a write seen later compiles anew.)
            return None
        fusion = self._fusion_for(args, kwargs, regroup=False)
        if fusion is not None and not fusion.grouped_from(self._modules.values()):
            # The branches themselves replaced, added or removed since grouping in a way that
            # calls none of the block's own methods (``setattr(block, "0", m)``, ``add_module``,
            # a write into ``_modules``): eagerly the count of registrations shows it, which a
            # compiler must not read; traced, the groups would run the old members' layers, and
            # the units the old branches. Traced unfused, as groups out of date are.
            return None
        if self.fuse == "auto" and fusion is not None and _out_of_order(fusion.units):
            # Eagerly, such groups run fused only while the calls show no branch writing the
            # shared input (``_run_units_watched``); compiled code would not look.
            return None
        # (A group _run traces unfused runs its members at its place: in branch order, as the
        # units are here -- out of order only under "auto", above; fuse=True makes one group.)
        return fusion

    def _auto_unfused(self) -> bool:
        r"""Whether ``fuse="auto"`` keeps the branches unfused: with deterministic algorithms asked for.

        Fused and unfused results may differ in the last bits, and which one
        timing keeps may differ between runs. (Forking changes no result:
        streams stay tuned.)
        """
        return self.fuse == "auto" and torch.are_deterministic_algorithms_enabled()

    def __prepare_scriptable__(self) -> Parallel:
        raise TypeError(_NOT_SCRIPTABLE.format(name=type(self).__name__))

    def train(self, mode: bool = True) -> Parallel:
        r"""Set the block and its branches to training or evaluation mode; returns ``self``.

        As :meth:`torch.nn.Module.train`. Which branches are fused depends on
        their modes (BatchNorm, and dropout above rate 0, fuse only in
        evaluation), so the groups are found here, before a compiler may trace
        the next call.

        Args:
            mode: ``True`` for training mode, ``False`` for evaluation mode.
                Default: ``True``.
        """
        super().train(mode)
        fusion = self.__dict__.get("_fusion")
        if self.fuse is not False and not _is_tracing() and (fusion is None or not fusion.current()):
            # (Schedules are per mode: those of the new one come.) With fuse=True and
            # branches that no longer fuse in this mode (dropout in training), the next
            # call says so, as after a branch is replaced: ``train()`` itself must not
            # raise, leaving the modules after this one in the old mode.
            with _fusion_lock:
                self._fusion = None
                self._prepare_fusion(strict=False)
        return self

    def _regrouped(self) -> bool:
        r"""Whether branches that no group held when schedules were chosen may now be grouped.

        A signature whose branches all ran unfused (hooks on them, BatchNorm in
        training) keeps that schedule, and its calls never ask for the groups
        again; once the hooks are gone or the branches switched to ``eval()``,
        the groups are found anew and every schedule is chosen again.
        """
        fusion = self._fusion
        if fusion is None or fusion.groups or not self._out_of_date(fusion):
            return False
        with _fusion_lock:
            if self._fusion is not fusion:  # (another thread found them)
                return True
            self._fusion = self._new_fusion()
            self._tuner, self._plans, self._reproducible = _ScheduleTuner(), {}, {}
        return True

    def _graph_variants(self, args: tuple, kwargs: dict, first_only: bool = False) -> list[tuple[Any, ...] | None]:
        r"""For ``cuda_graph=True``: the ways to capture this call; the graph code keeps the fastest.

        Each is a tuple of ``"fused"``/``"unfused"`` (``fuse="auto"``) and
        ``_COMPILED``/``_EAGER`` (``compile=``), then, with a torch.compile
        backend, ``(_WHOLE,)``: the block compiled as one program (see
        ``_compile``); or, for different branches run as they are, an
        ``_Order`` or a ``_Priority``. ``first_only``: only the first will be
        captured (training). Called on the capture stream before warm-up, so
        it may run the branches (buffers are restored after capture).
        """
        fusion = self._fusion_for(args, kwargs) if self.fuse is not False else None
        fuses = ["fused", "unfused"] if self.fuse == "auto" and fusion is not None else [""]
        reproducible = torch.are_deterministic_algorithms_enabled()
        if reproducible and fuses != [""]:
            fuses = ["unfused"]  # see _auto_unfused
        # Fused groups run batched, never compiled: with every branch in one, both ways are the same.
        all_fused = fusion is not None and all(isinstance(u, _Group) for u in fusion.units)
        variants = []
        for f in fuses:
            fused = f == "fused" or (not f and self.fuse is True and fusion is not None)
            compiles = [_COMPILED, _EAGER] if self._compiler is not None and not (fused and all_fused) else [""]
            if reproducible and len(compiles) == 2:
                compiles = [_COMPILED]
            variants += [tuple(v for v in (f, c) if v) or None for c in compiles]
            if fused and compiles == [""] and not first_only and self._copies_biases(fusion, args, kwargs):
                variants.append(tuple(v for v in (f, _INLINE_BIAS) if v))
        if self._compiler is not None and self._compiler.compiles_whole and not reproducible:
            variants.append((_WHOLE,))
        n = len(self._modules)
        if (variants == [None] and self.streams is not False and not first_only
                and 2 <= n <= _MAX_PRIORITY_VARIANTS and not _all_identical(list(self._modules.values()))):
            # Branches of different lengths contending for the GPU: the block may finish
            # sooner when the longest runs first. A replay does not start every stream
            # of the graph at once: on the H100 machine each side branch began 7-15 us
            # after the one launched before it (tools/exp_capture_order.py), so the
            # branches are also captured longest first (the Inception block at batch 1,
            # fp32: 82 us against 91 in branch order). Which branch is longest depends
            # on the shapes and the GPU, so each branch is timed alone first, and each
            # side branch is also tried on a high-priority stream; the fastest replay
            # is kept, as cudnn.benchmark keeps the fastest algorithm.
            longest = self._longest_first(args, kwargs)
            if longest != tuple(range(n)):
                variants.append((_Order(longest),))
            variants += [(_Priority(i),) for i in range(1, n)]
        return variants

    def _cat_joined(self, fusion: _Fusion) -> bool:
        r"""Whether one group runs every branch and a cat along dimension 1 joins them (see ``_Group.run``)."""
        return len(fusion.units) == 1 and type(self.join) is str and self.join == "cat" and self.dim in (1, -1)

    def _copies_biases(self, fusion: _Fusion, args: tuple, kwargs: dict) -> bool:
        r"""Whether a capture of this fused call copies biases into batched products (see ``_fusion._Prefill``)."""
        group = fusion.units[0]
        return (not kwargs and self._cat_joined(fusion) and isinstance(group, _Group)
                and group.copies_biases(args[0]))

    def _longest_first(self, args: tuple, kwargs: dict, reps: int = 2) -> tuple[int, ...]:
        r"""The branches by GPU time alone on this call, longest first (ties in branch order).

        Each branch is called once (lazy initialisation, ``cudnn.benchmark``),
        then ``reps`` times between two events on the current stream, all
        queued behind a spin kernel: the events then time the GPU's work, as a
        replay runs it, and not how fast the host launches it (a one-kernel
        branch and a four-kernel one take the host alike). The branches read
        copies of the inputs, which one may change in place. Not on one CUDA
        device (branches on several devices, or a CPU input, which the first
        warm-up call then refuses or runs): branch order.
        """
        branches = self._branches()
        device = _input_device(args, kwargs)
        placement = self._placement
        if placement is _UNPLACED:
            placement = _place(self)
        if device is None or device.type != "cuda" or placement is not None:
            return tuple(range(len(branches)))
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
        stream = torch.cuda.current_stream(device)
        with torch.no_grad():
            for i in range(len(branches)):
                self._call(i, args, kwargs, branches)
            cycles = _SPIN_CYCLES
            for _ in range(3):
                spin, spun = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                marks = []
                spin.record(stream)
                queued = time.perf_counter()
                torch.cuda._sleep(cycles)
                spun.record(stream)
                for i in range(len(branches)):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    for _ in range(reps):
                        self._call(i, args, kwargs, branches)
                    end.record(stream)
                    marks.append((start, end))
                queued = time.perf_counter() - queued
                stream.synchronize()
                if queued * 1e3 < spin.elapsed_time(spun):
                    break  # everything was queued before the spin ended
                cycles *= 4
        times = [start.elapsed_time(end) for start, end in marks]
        return tuple(sorted(range(len(times)), key=lambda i: -times[i]))

    def _run_group(self, fusion: _Fusion, group: _Group, args: tuple, kwargs: dict, eager: bool = False) -> list[Any]:
        r"""The group's batched value. ``eager``: the caller saw no tracer and no capture (see :meth:`_Group.run`)."""
        kept = None
        written: list[tuple[torch.Tensor, int, torch.Tensor | None]] | None = None  # (see below)
        attributes_written: list[tuple[torch.Tensor, int, torch.Tensor | None]] | None = None
        x_copy: torch.Tensor | None = None  # (see below)
        tracing = not eager and _is_tracing()
        x = args[0]
        # (Whether the batched attempt wrote the members' input before failing: see below. A parameter
        # passed as the input too, which keeps its version as a tensor does: written under no_grad.)
        version = (x._version if not tracing and type(x) in (torch.Tensor, nn.Parameter) and not x.is_inference()
                   else None)
        try:
            # (None: tensors swapped in for this call, left unbound -- the call stacks them.)
            moved = group.bind() if not tracing else False
            if moved:  # a parameter was replaced: stacked anew
                self._param_moves += 1
            # Tensors swapped in without registration (torch.func.functional_call), or
            # functorch transforms, which need the members' tensors as they are: stacked
            # for this call (its layers write those stacks, not the bound ones: nothing
            # of those to judge or keep below).
            restack = not tracing and (moved is None or group.swapped() or _functorch_active())
            # (``tracing`` first: a compiler would guard on ``group.ran``, which an eager call sets.)
            # Layers that ran batched before one failed may have updated buffers (an
            # InstanceNorm's running statistics): put back before the members run unfused.
            # In eval mode stock norms update none; a module of the user's holding buffers
            # may (a count of its calls, test-time statistics), and a later layer fail on
            # some calls only: kept while such a group is judged, and for good if its first
            # eager call in eval wrote them (not otherwise: a constant table or mask would
            # be copied on every call). (Judged by value: a layer vmapped writes its
            # buffers' stacks without moving their versions.)
            judging = False
            if (not tracing and not restack and not self.training and group.wrote_buffers is None
                    and not (x.is_cuda and _capture_underway())):
                judging = _writes_buffers(group)
                if not judging:  # (stock norms' alone, or none: nothing to judge)
                    group.wrote_buffers = False
            if (not tracing and not restack and group.buffers
                    and (self.training or not group.ran or group.wrote_buffers or judging)):
                kept = [(b, b.clone()) for b in group.buffer_stacks()]
            # A layer of the user's, run through vmap, may write the members' parameters in
            # place (a weight clamped or decayed in its ``forward``): a batched attempt that
            # fails after such a write, the members then called in turn, would write them
            # twice. Their versions tell; the group's first batched attempt, where vmap
            # finds what it cannot batch, keeps copies to put back (no copy on later calls).
            if not tracing and not restack and group.vmapped:
                # (Not within a capture, whose replays would copy them again: its warm-up ran first.)
                first = not group.ran and group.unbatched is None and not (x.is_cuda and _capture_underway())
                # (So its first member's tensor attributes, which such a layer reads for every member.)
                with torch.no_grad():
                    written = [(t, t._version, t.clone() if first else None) for t in group.parameter_stacks()]
                    attributes_written = [(t, t._version, t.clone() if first else None)
                                          for t in group.attribute_tensors()]
                # Such a layer may also write the shared input in place where vmap can (``x.mul_(2)``
                # on the input it reads unbatched): it then runs once for all, and fuse=True refuses
                # the call (see _run_units_watched). So that the refused call leaves the caller's
                # input as it was, as a stock layer's write (refused before it runs) and a trial's
                # (on copies, see _refused_trial) do, the first attempt keeps a copy to put back:
                # one made while autograd records, so that put back the input's history is its own.
                if first and self.fuse is True and version is not None:
                    x_copy = x.clone()
            # A cat along dim 1 of every branch reads the group's channels layout as it is.
            out = group.run(args[0], self._cat_joined(fusion), eager,
                            eager or _INLINE_BIAS not in (_graph_variant(self) or ()), restack)
            wrote_input = x_copy is not None and x._version != version and not _clamps_its_input(group)
            if not tracing and not wrote_input:
                group.ran = True
                group.unbatched = None
                if judging and kept is not None:
                    group.wrote_buffers = any([not torch.equal(b, saved) for b, saved in kept])
            if not wrote_input:
                return out
        except Exception as e:
            if isinstance(e, _StopRecomputation):  # (checkpoint's early stop: control flow, not a failure)
                raise
            if not isinstance(e, _UnbatchedNow) and _is_tracing():
                # A trace records one program: it cannot run the members again one by one to find
                # the one at fault, as an eager call does. The error, raised by the batched kernels
                # (on stacked shapes the user never wrote), names the group instead.
                raise _with_context(e, f"(raised in branches {group.names} of {type(self).__name__}, traced batched "
                                       f"as one fused group; pass fuse=False to trace each branch on its own "
                                       f"and see which one fails)")
            _put_back_buffers(group, kept)
            failure = e
        except BaseException:
            # (KeyboardInterrupt, SystemExit: the call ends here, without what the batched
            # attempt wrote into every member's buffers at once.)
            _put_back_buffers(group, kept)
            raise
        else:
            # The batched run wrote the shared input (the members ran once for all, on the input as
            # it was): refused, as _run_units_watched would, with the input put back. (Its buffers
            # and parameters too, as after a failed attempt; not marked as run, so that its next call
            # keeps a copy again.)
            _put_back_input(x, x_copy)  # type: ignore[arg-type]
            _put_back_buffers(group, kept)
            _put_back_parameters(written)
            _put_back_parameters(attributes_written)
            raise _with_context(self._refused_write(group.indices), "(the input is as it was)")
        names = [list(self._modules)[i] for i in group.indices]
        for what, tensors in (("their parameters", written), ("their tensor attributes", attributes_written)):
            if not _put_back_parameters(tensors):
                # Written, with no copy to put back: called in turn now, the members would write them again.
                raise self._refused_retry(fusion, group, names, failure, what, "change them again") from failure
        if version is not None and x._version != version and not _clamps_its_input(group):
            # Called in turn now, the members would read what the batched attempt wrote.
            # (Not where they only clamp it first, which each of them in turn would do
            # again to the same effect: run so, the member at fault names the input's error.)
            error = self._refused_retry(fusion, group, names, failure, "their input", "read the changed input")
            if x_copy is not None:  # (the refused call leaves the caller's input as it was, as below)
                _put_back_input(x, x_copy)
                error = _with_context(error, "(the input is as it was)")
            raise error from failure
        # Run the members as ordinary branches: if they fail too, the input is at
        # fault, and their error names the branch. (Outside the handler: that error
        # is the user's to read, not chained to the batched attempt's internals.)
        passing = isinstance(failure, _UnbatchedNow) or _out_of_memory(failure)
        if isinstance(failure, _MembersChanged) and not tracing:
            # A member's parameter or buffer changed since the groups were found in a way
            # that registers nothing (set to None, deleted, given another shape or dtype
            # through ``.data``): the block takes its tree as changed, and at its next call
            # forgets what it learnt and groups its branches anew, as after a layer
            # replaced. With "auto" this call runs them unfused. (Grouping compares what the
            # stacking checks, the members' tensors as they are: the groups found anew hold.
            # Not for tensors swapped in for one call, torch.func.functional_call's, which the
            # block's next call would not find: this call alone runs unfused.)
            if not _watch._swapped_in(self.modules()):
                self._tree.forget()
            if self.fuse is True:
                raise RuntimeError(
                    f"{type(self).__name__}: fuse=True, but {failure} (since the branches were grouped). Make "
                    "them identical again, or pass fuse='auto' to fuse the identical ones, or fuse=False."
                ) from None
            passing = True
        if self.fuse is True and not passing and not tracing:
            raise self._refused_trial(group, names, x, kwargs, version is not None, failure)
        # (A list, not a generator: a member raising StopIteration -- ``next(...)`` of an empty
        # iterator -- would reach the caller as "RuntimeError: generator raised StopIteration",
        # its type lost and its branch unnamed, where unfused it is raised as it is.)
        outputs = _Unfused([self._call(i, args, kwargs) for i in group.indices])
        if version is not None and x._version != version and not _clamps_its_input(group):
            self._saw_write = True  # (run in turn, the members wrote the shared input: see _traced_fusion)
        if passing:
            if not tracing:
                why = str(failure).strip().splitlines()  # (an allocation failure's message runs on)
                group.unbatched = (why[0] if isinstance(failure, _UnbatchedNow) and why else
                                   f"{type(failure).__name__}: {why[0] if why else ''}")
            # (This call only: the group is not at fault. Batched, the members' activations
            # are held at once, one after another each in turn: a large batch may fit only
            # unfused, and an allocation failure of the members too raises as it is.)
            return outputs
        if self.fuse is True:  # (traced: the members ran on the input, as the traced program runs them)
            raise self._batched_failed(names, failure) from failure
        fusion.disable(group, failure)
        # Signatures planned with the group fused are planned anew at their next call, with the
        # groups left (and explain() says what runs).
        self._forget_plans(lambda plan: plan.fused)
        warnings.warn(f"{type(self).__name__}: branches {names} are identical but cannot run batched "
                      f"({type(failure).__name__}: {failure}); they run unfused from now on (see .explain()).",
                      UserWarning, stacklevel=4)
        return outputs

    def _batched_failed(self, names: list[str], failure: Exception) -> RuntimeError:
        r"""The error of ``fuse=True`` where the group of branches ``names`` failed batched (``failure``)
        and each of them runs on its own."""
        return RuntimeError(
            f"{type(self).__name__}: fuse=True, but branches {names} failed to run batched, while "
            f"each runs on its own: {type(failure).__name__}: {failure}\nPass fuse='auto' to run such "
            "branches unfused, or fuse=False."
        )

    def _refused_trial(self, group: _Group, names: list[str], x: torch.Tensor, kwargs: dict, versioned: bool,
                       failure: Exception) -> BaseException:
        r"""With ``fuse=True``, the error for a group that failed batched (``failure``): the members' own
        error where one fails on its own (the input is at fault, and the error names the branch), a
        refused write where one changes the input in place, else :meth:`_batched_failed`'s.

        A trial that leaves no trace: the members' buffers are put back, and each member reads a
        copy of ``x``, the call's one tensor. (On the caller's tensor, a member writing it in place --
        a layer of the user's, which vmap could not run on the input it expands -- wrote it once per
        member, and a call repeated on it with ``fuse="auto"``, as the error advises, computed on
        the changed values.) ``versioned``: whether ``x`` keeps a version by which a write shows.
        """
        restore = _buffers_kept([self._modules[name] for name in names])
        wrote = False
        try:
            for i in group.indices:
                # (An inference tensor's copy made outside inference mode is an ordinary tensor, which
                # autograd may save: the members would pass on it where on ``x`` they fail, and the
                # error would claim they run on their own. The copy is one like ``x``.)
                with torch.inference_mode(True) if x.is_inference() else contextlib.nullcontext():
                    copied = x.clone()
                # (Made under inference mode, a copy of a tensor that keeps a version keeps none.)
                before = copied._version if versioned and not copied.is_inference() else None
                self._call(i, (copied,), kwargs)
                wrote = wrote or before is not None and copied._version != before
        except BaseException as e:
            # (Not chained to the batched attempt's internals: the member's error is the user's to read.)
            return _note_failures(e, restore() if restore is not None else [])
        failures = restore() if restore is not None else []
        if wrote:
            error = _with_context(self._refused_write(group.indices), (
                f"(seen as the members ran one after another, each on a copy of the input, after running them "
                f"batched failed: {type(failure).__name__}: {_first_line(failure)}; the input is as it was)"))
        else:
            error = self._batched_failed(names, failure)
        error.__cause__ = failure  # (as ``raise error from failure``)
        return _note_failures(error, failures)

    def _forget_plans(self, which: Callable[[_Schedule], bool]) -> None:
        r"""Plan anew, at their next call, the signatures whose schedule is ``which``."""
        for key in [k for k, plan in self._plans.copy().items() if which(plan)]:
            self._plans.pop(key, None)
            self._tuner.forget(key)

    def _keep_in_order(self) -> None:
        r"""Run every signature planned forked or fused one branch after another from now on.

        A branch wrote the shared input on a call after ``"auto"`` had chosen
        such a schedule, as the first calls wrote nothing: it may write again
        on any later call (on some inputs only, say), which the next calls
        need not show, nor a signature first seen later. Setting ``streams``
        or ``fuse`` again times them anew.
        """
        self._in_order = self._saw_write = True
        for key, plan in self._plans.copy().items():
            if plan.forked or plan.fused:
                self._plans[key] = plan._replace(forked=False, fused=False)
                self._tuner.forget(key)

    def _fork_refused(self, error: BaseException) -> str:
        r"""For a fork refused as a branch changed the shared input in place (``_ChangedInPlace``)
        under ``streams="auto"``, which forked the signature because its first calls wrote nothing:
        the schedules kept in branch order, and a word on it to add to the error.

        Only where the fork was this block's, from a schedule it chose (not a
        nested block's, nor a graph's or a placement's, which fork by rule).
        """
        if not isinstance(error, _ChangedInPlace) or getattr(error, "handled", False):
            return ""
        error.handled = True  # (by the innermost block, whose fork it was: those around it pass it on)
        if self.streams != "auto" or self.cuda_graph or self._placement is not None:
            return ""
        self._keep_in_order()
        return ("; streams='auto' had forked it, as the first calls of its input signature wrote nothing: "
                "from the next call on, the block runs its branches one after another (set streams='auto' "
                "again to time them anew)")

    # ---------------------------------------------------------------- forward
    def _branch_error(self, error: Exception, index: int) -> Exception:
        name = list(self._modules)[index]
        refused = self._fork_refused(error)  # (and, for a fork this block chose, the branches kept in order)
        context = f"(raised in branch {name!r} (index {index}) of {type(self).__name__}{refused})"
        moved = _moved(self)
        if moved is not None:
            context += (f"; a branch was moved since the block's last call, by a .to() of its own (now: {moved}): "
                        f"the next call runs each branch on its device. (Moving the whole block with "
                        f"{type(self).__name__}.to(...) is seen at once.)")
        return _with_context(error, context)

    def _branches(self) -> list[Any]:
        r"""The callable to run for each branch: the branch, or its compiled form (``compile=``)."""
        compiler = self._compiler
        # (Tracing first: a compiler tracing the block compiles the branches
        # itself, and need not read the thread's capture state.)
        if compiler is None or _is_tracing() or _EAGER in (_graph_variant(self) or ()):
            return list(self._modules.values())
        return compiler.calls(self._modules)

    def _refused_retry(self, fusion: _Fusion, group: _Group, names: list[str], failure: Exception, what: str,
                       then: str) -> RuntimeError:
        r"""The error refusing a call whose group changed ``what`` in place while running batched, then failed:
        its members, called one after another now, would ``then``. Under ``fuse="auto"`` the group runs
        unfused from the next call on."""
        if self.fuse is not True:
            fusion.disable(group, failure)
            self._forget_plans(lambda plan: plan.fused)
        return RuntimeError(
            f"{type(self).__name__}: branches {names} changed {what} in place while running batched, then "
            f"failed to ({type(failure).__name__}: {failure}): called one after another now, they would {then}, "
            f"so this call is refused. "
            + ("Pass fuse='auto' or fuse=False to run them unfused." if self.fuse is True else
               "From the next call on they run unfused (see .explain()).")
        )

    def _call(self, index: int, args: tuple, kwargs: dict, branches: list[Any] | None = None) -> Any:
        try:
            return (self._branches() if branches is None else branches)[index](*args, **kwargs)
        except Exception as e:
            raise self._branch_error(e, index)

    def _run(self, args: tuple, kwargs: dict, device: torch.device | None = None,
             fusion: _Fusion | None = None, capturing: bool | None = None) -> Any:
        r"""Run the branches: one after another, or forked onto ``device``'s side streams.

        With ``fusion``, each group of identical branches runs as one unit.
        ``capturing``: whether a graph capture or warm-up is underway, if known.
        Returns the outputs in branch order, or ``_Reduced`` when the fork joined them.
        """
        if fusion is None and (device is None or len(self._modules) == 1):
            outputs: list[Any] = []
            try:
                for call in self._branches():
                    outputs.append(call(*args, **kwargs))
            except Exception as e:
                raise self._branch_error(e, len(outputs))
            return outputs

        run: Any = None  # _run_forked calls each branch on args, kwargs (and names it in an error)
        tracing = fusion is not None and _is_tracing()
        if fusion is None:
            calls: list[Any] = self._branches()
        else:
            branches = self._branches()

            def run(i: int, unit: Any) -> Any:
                if isinstance(unit, _Group):
                    if tracing and _traced_unfused(unit, args[0]):
                        return _Unfused([self._call(j, args, kwargs, branches) for j in unit.indices])
                    return self._run_group(fusion, unit, args, kwargs)
                return self._call(unit, args, kwargs, branches)

            calls = list(fusion.units)
        if device is None or len(calls) == 1:
            # (Under capture the graph module looks for writes; a traced graph has none to watch.)
            watch = fusion is not None and not capturing and not tracing
            functorch = watch and _functorch_active()
            if functorch and len(calls) > 1 and self.fuse == "auto":
                # The inputs are torch.func's wrappers, whose versions do not move: no write
                # could be seen. In branch order instead.
                return self._run(args, kwargs, None, None)
            if functorch and self.fuse is True:
                self._refuse_writers(calls, "under torch.func transforms, whose wrapped inputs keep no version")
            if watch and not functorch:
                outputs = self._run_units_watched(calls, run, args, kwargs)
            else:
                outputs = [run(i, c) for i, c in enumerate(calls)]  # (fused: one unit, or no device)
        else:
            # Joined by the fork when it can: side outputs are then freed without record_stream.
            join = self._combine if fusion is None and self.join in _REDUCING_JOINS else None
            variant = _graph_variant(self) if capturing else None
            high = next((v.index for v in variant or () if isinstance(v, _Priority)), 0)
            order = next((v.order for v in variant or () if isinstance(v, _Order)), None)
            inputs = (*args, *kwargs.values()) if torch.is_grad_enabled() else ()
            try:
                if device.index is not None and device.index != _current_device():
                    with torch.cuda.device(device):
                        outputs = _run_forked(calls, device, run, capturing, inputs, join, high, order, args,
                                              kwargs, self._branch_error)
                elif join is not None and capturing is False:
                    return _Reduced(_fork_join(calls, device, args, kwargs, join, self._branch_error))
                else:
                    outputs = _run_forked(calls, device, run, capturing, inputs, join, high, order, args, kwargs,
                                          self._branch_error)
            except _ChangedInPlace as e:
                if run is not None:  # (fused units: not through _branch_error, which names a branch)
                    raise _with_context(e, f"(raised in {type(self).__name__}{self._fork_refused(e)})")
                raise
            if join is not None:
                return _Reduced(outputs)
        return outputs if fusion is None else fusion.scatter(calls, outputs)

    def _run_units_watched(self, units: list[Any], run: Callable[[int, Any], Any], args: tuple,
                           kwargs: dict) -> list[Any]:
        r"""``run`` each of the fused ``units`` in turn, refusing a call in which one changed an input in place.

        ``fuse="auto"`` runs a group's members together, on one input, and
        before or after the branches between them: a branch writing to the
        shared input would be seen by some of the branches after it and not
        others (by all its group's members, or none). The first call of a
        signature runs the branches in order and keeps such a block unfused
        (``_outputs``); a branch that writes on later calls only (switched to
        ``inplace=True``, or writing on some inputs), or on a first call under
        checkpointing (:meth:`_checkpointed`), is seen here, by the inputs'
        versions, as a fork sees it. That call's result is not the sequential
        one: refused, and the block kept in branch order from then on
        (:meth:`_keep_in_order`). Neither that nor a watched first call is
        remembered after a reset by another thread while the units ran
        (``block.fuse = ...``, a branch replaced): it was of the old settings
        or branches, and the new ones' first call is watched again.
        """
        tuner = self._tuner  # (a reset by another thread meanwhile makes a new one)
        watched = _watched(args, kwargs)
        seen = self._first_inference_fused(units, args, kwargs)
        first = watched[0] if len(watched) == 1 else None  # the common case: one int compared per unit
        version = first._version if first is not None else 0
        versions = [t._version for t in watched] if len(watched) > 1 else None
        # (fuse=True on inference tensors, a signature's first call: copies to put back should a unit's
        # write be refused, as :meth:`_run_group` keeps one of a tensor that keeps a version.)
        kept = [(t, t.clone()) for t in seen[1]] if seen is not None else None
        outputs = []
        for i, unit in enumerate(units):
            if seen is None:
                outputs.append(run(i, unit))
                written = False
            else:
                writes = _Writes(seen[1])
                with writes:
                    outputs.append(run(i, unit))
                written = writes.wrote
            if written or first is not None and first._version != version or versions and _changed(watched, versions):
                # Out of order only if a branch that ran before should have seen the write, or
                # one still to run should not (a write by the last branch is harmless), or a
                # group ran its members together (not one after another: _run_group's fallback).
                wrote = _unit_indices(unit)
                if ((len(wrote) == 1 or type(outputs[-1]) is _Unfused or _clamps_its_input(unit))
                        and all(j < wrote[0] for u in units[:i] for j in _unit_indices(u))
                        and all(j > wrote[-1] for u in units[i + 1:] for j in _unit_indices(u))):
                    version = first._version if first is not None else 0
                    versions = [t._version for t in watched] if versions else None
                    continue
                if kept is not None:  # (the call refused leaves the inputs as they were)
                    with torch.inference_mode():
                        for t, saved in kept:
                            t.copy_(saved)
                raise self._refused_write(wrote, learnt=self._tuner is tuner)
        if seen is not None and self._tuner is tuner:
            _bounded_add(self._watched_fused, seen[0])
        return outputs

    def _first_inference_fused(self, units: list[Any], args: tuple, kwargs: dict) -> tuple[Hashable, list] | None:
        r"""For ``fuse=True`` on inference tensors: the signature and those tensors, on its first call.

        Inference tensors keep no version by which a write shows. Members
        beginning with a stock layer that writes the shared input are refused
        before they run; on the first call of such a signature (as
        ``fuse="auto"``'s first call in turn, see :meth:`_first_unversioned`)
        every unit runs under :class:`._streams._Writes`, which sees the others;
        ``None`` on later calls, and for other inputs. (A module of the user's
        that writes on later calls only is not seen.)
        """
        x = args[0] if len(args) == 1 and not kwargs else None
        if self.fuse is not True or isinstance(x, torch.Tensor) and not x.is_inference():
            return None
        unversioned = _unversioned(args, kwargs)
        if not unversioned:
            return None
        # (On every call: a layer's inplace may be set after the first.)
        self._refuse_writers(units, "the input is an inference tensor, which keeps no version")
        key = _signature(args, kwargs, self.training, floats=False)
        return None if key in self._watched_fused else (key, unversioned)

    def _refuse_writers(self, units: list[Any], why: str | None = None) -> None:
        r"""Refuse, before they run, fused groups whose members begin with a stock layer writing the shared
        input (:func:`_writes_shared_input`), where no version shows the write (``why``), or, without ``why``,
        before the write it would show (a signature's first call, with ``fuse=True``)."""
        for unit in units:
            if isinstance(unit, _Group) and _writes_shared_input(unit):
                note = (f"(seen from its layers before it ran: {why} by which a write shows)" if why is not None
                        else "(seen from its layers before it ran, which leaves the input as it was)")
                raise _with_context(self._refused_write(unit.indices, before=True), note)

    def _refused_write(self, wrote: list[int], before: bool = False, learnt: bool = True) -> RuntimeError:
        r"""The error of a fused call in which the branches ``wrote`` (one, or a group's members) changed
        the shared input in place out of branch order; with ``fuse="auto"`` the block is kept in order
        from then on. ``before``: refused before they ran, from their layers (``fuse=True``).
        ``learnt=False``: the block was reset by another thread while they ran, and neither the write
        nor the order is remembered (the branches or settings it was seen with are gone)."""
        if learnt:
            self._saw_write = True
        names = list(self._modules)
        which = [names[j] for j in wrote]
        how = ("runs fused groups out of branch order" if len(which) == 1 else
               "runs the members of a fused group together, on one input")
        if self.fuse is True:
            return RuntimeError(
                f"{type(self).__name__}: fuse=True {how}, and "
                f"{'branch' if len(which) == 1 else 'one of branches'} {which[0] if len(which) == 1 else which!r} "
                f"{'begins with a layer changing' if before else 'changed'} the shared input in place: the "
                f"branches after it {'would not' if before else 'did not'} all see the change, so the "
                f"result would differ from calling them one after another, and this call is refused. Make the "
                f"branch's first operation out of place (inplace=False, x = x + 1), or pass fuse='auto' (which "
                f"then keeps such branches in order) or fuse=False."
            )
        if learnt:
            self._keep_in_order()
            then = ("From the next call on, the block runs its branches one after another (set fuse='auto' "
                    "again to time them anew).")
        else:
            then = ("Its branches or settings were changed by another thread while they ran: the next calls "
                    "are planned anew, and watched again.")
        return RuntimeError(
            f"{type(self).__name__}: fuse='auto' {how}, and "
            f"{'branch' if len(which) == 1 else 'one of branches'} {which[0] if len(which) == 1 else which!r} "
            f"changed the shared input in place on this call, which the block had not seen it do on the first "
            f"call of this input signature: the branches after it did not all see the change, so the result "
            f"would differ from calling them one after another. {then} To keep them fused, make "
            f"the branch's first operation out of place (inplace=False, x = x + 1)."
        )

    def _combine(self, outputs: list[Any]) -> Any:
        # (The common case, without _join_outputs' frame. Types first: a compiler can neither
        # compare a builtin join such as ``sum`` with a string nor trace torch.cat raising for
        # structured outputs.)
        if (type(self.join) is str and self.join == "cat" and outputs and isinstance(outputs[0], torch.Tensor)
                and not torch.compiler.is_compiling()):  # (which cannot catch what torch.cat raises: see _joins)
            _graph_state.forked = False  # (a cat hands each branch a slice of its own: nothing to hold)
            try:
                return torch.cat(outputs, self.dim)
            except Exception:
                pass  # structured outputs, or a mismatch: _join_outputs joins leaf by leaf or names it
        return _join_outputs(type(self).__name__, self.join, self.dim, self._modules, outputs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        r"""Run every branch on ``*args, **kwargs`` and join the outputs."""
        tracing = _is_tracing()  # (first: a compiler must not read, and guard on, the count of changes)
        if not tracing:
            # A fork's note for its join (``_graph_state.forked``) is read by that join, in
            # the same call, with no block's forward in between; one still set here was left
            # by a call that raised between the two, and would make this call's join hold its
            # gradients for the rest of the backward pass (see _streams, backward). Reset
            # here rather than on every error path: one store, on every eager call.
            _graph_state.forked = False
            if self._tree.seen != _watch._changes:
                changed = self._tree.changed(self)
                if changed is _watch._WHILE_SWAPPED:  # (see there: made anew at a call outside)
                    placement = _place(self)  # (branches on several devices: each on its own)
                    return self._joined(placement.run(self, args, kwargs) if placement is not None
                                        else self._run(args, kwargs, None, None))
                if changed:
                    # A submodule, parameter or buffer below was replaced or added since the
                    # groups, schedules and graphs were made (see _watch): make them anew.
                    # (Not for tensors swapped in by functional_call: see _Tree.changed.)
                    self._reset()
        if self.cuda_graph:
            if not tracing and self._param_moves != self._graph_moves:  # (tracing first: see above)
                # Fusion moved parameters to new memory: graphs read the old.
                self._graphs.clear()
                self._graph_moves = self._param_moves
            return self._graphs(self._forward, args, kwargs)
        if not tracing and self._placement is None:  # (read only eagerly: a compiler would guard on it)
            # The common cases, inline: a signature whose schedule is decided,
            # sequential (what "auto" keeps for branches too small to gain from
            # streams) or fused. On tiny branches each Python frame saved is a
            # measurable part of the call, which must stay within a few percent
            # of calling the branches by hand. (``_run``'s sequential loop and
            # ``_combine``'s cat are its twins.)
            key = _signature(args, kwargs, self.training, floats=False)
            if _any_autocast():  # (one C call while autocast is off, as it mostly is)
                key = _under_autocast(key)
            plan = self._plans.get(key)
            if plan is not None and self._compiler is None and not (plan.cuda and _capture_underway()):
                if plan.forked and self.streams == "auto" and torch.is_grad_enabled() or plan.fused and (
                        self._auto_unfused()) or self._reproducible and not plan.fused and (
                        not torch.are_deterministic_algorithms_enabled()):
                    # (``_outputs`` sees whether the plan still holds.)
                    return self._joined(self._outputs(args, kwargs, (key, plan)))
                fusion = self._fusion
                if not plan.fused and fusion is not None and not fusion.groups and self._regrouped():
                    return self._joined(self._outputs(args, kwargs, (key, None)))
                if plan.fused:
                    fusion = self._fusion_for(args, kwargs)
                    if self._plans.get(key) is not plan:  # regrouped: planned anew (see _planned_fusion)
                        return self._joined(self._outputs(args, kwargs))
                if plan.forked and not plan.fused and self.join in _REDUCING_JOINS:
                    # Unfused branches forked and joined by a reduction: the fork
                    # joins them, without ``_run``'s options (6 us of a 70 us call
                    # of two tiny branches on the H100 machine).
                    return _fork_join(list(self._modules.values()), _input_device(args, kwargs), args, kwargs,
                                      self._combine, self._branch_error)
                if plan.forked:
                    # Decided to fork: ``_outputs``' own decided case, without its frame.
                    return self._joined(self._run(args, kwargs, _input_device(args, kwargs),
                                                  fusion if plan.fused else None, False))
                if not plan.fused:
                    outputs: list[Any] = []
                    try:
                        # (A tuple: another thread's append would change the dict under the loop.)
                        for branch in tuple(self._modules.values()):
                            outputs.append(branch(*args, **kwargs))
                    except Exception as e:
                        raise self._branch_error(e, len(outputs))
                    if self.join == "cat":
                        try:
                            return torch.cat(outputs, self.dim)
                        except Exception:
                            pass  # structured outputs, or a mismatch: _combine joins leaf by leaf or names it
                    return self._combine(outputs)
                # Every branch in one fused group: the group runs and its batched
                # value is joined, without the general path's frames and closures
                # (``_outputs``, ``_run``) and without asking again whether a
                # compiler traces or a graph is captured: an eager fused call is
                # CPU-bound, and those cost 2-4 us of a 125-165 us call (mlp8) on
                # the H100 machine (``tools/exp_fused_eager.py``).
                units = None if fusion is None else fusion.units  # (a failing group changes fusion.units)
                if units is not None and len(units) == 1 and isinstance(units[0], _Group):
                    # Members writing the input are refused (see _run_units_watched).
                    # The common case, one tensor, watched here: one int compared.
                    x = args[0] if len(args) == 1 and not kwargs else None
                    if type(x) is not torch.Tensor or x.is_inference():
                        return self._joined(self._run(args, kwargs, None, fusion, False))
                    version, tuner = x._version if x is not None else 0, self._tuner
                    out = self._run_group(fusion, units[0], args, kwargs, eager=True)
                    if (x is not None and x._version != version and type(out) is not _Unfused
                            and not _clamps_its_input(units[0])):
                        # (Unfused: the members ran in turn, as called one after another. Not kept
                        # in order after a reset by another thread meanwhile: see _run_units_watched.)
                        raise self._refused_write(units[0].indices, learnt=self._tuner is tuner)
                    return self._joined(fusion.scatter(units, [out]))
                # Mixed groups (or none left): what ``_outputs`` runs for this plan,
                # with the groups already found.
                return self._joined(self._run(args, kwargs, None, fusion, False))
            return self._joined(self._outputs(args, kwargs, (key, plan)))
        return self._forward(*args, **kwargs)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._joined(self._outputs(args, kwargs))

    def _joined(self, outputs: Any) -> Any:
        r"""The join of what ``_outputs`` returned (a list, already joined, or a fused group's value)."""
        if type(outputs) is _Reduced:
            return outputs.value
        if isinstance(outputs, _Joined):  # one group of identical branches ran them all
            joined = outputs.join(self.join, self.dim) if isinstance(self.join, str) else None
            if joined is not None:
                return joined
            outputs = outputs.split()
        return self._combine(outputs)

    def _outputs(self, args: tuple, kwargs: dict, looked_up: tuple[Hashable, Any] | None = None) -> Any:
        r"""Run the branches as this call's schedule says. ``looked_up``: the call's signature and
        its plan, where ``forward`` found them (the branches on one device, and no tracer)."""
        if looked_up is None:
            # (A compiler's trace looks for itself: read, the placement an eager call remembers
            # since would fail the compiler's guard on it, and compile the block again.)
            placement = self._placement if not _is_tracing() else _UNPLACED
            if placement is not None:  # branches on several devices, or not looked at yet
                placement = _place(self) if placement is _UNPLACED else placement
                if placement is not None:
                    return placement.run(self, args, kwargs)
            if _is_tracing():
                # Compilers see the branches (or fused groups) one after the other and schedule them.
                return self._run(args, kwargs, None, self._traced_fusion(args, kwargs))
            # One dict lookup per call decides everything: the schedule chosen for
            # this signature, or none yet (tuning).
            key = _signature(args, kwargs, self.training, floats=False)
            if _any_autocast():
                key = _under_autocast(key)
            plan = self._plans.get(key)
        else:
            key, plan = looked_up
        if self._reproducible and not torch.are_deterministic_algorithms_enabled():
            self._replan_reproducible()
            plan = self._plans.get(key)
        if plan is not None and (not plan.fused and self._regrouped() or plan.fused and self._auto_unfused()):
            # (Deterministic algorithms asked for since "auto" fused: see _auto_unfused.)
            self._plans.pop(key, None)
            plan = None
        fusion: _Fusion | None = None
        if plan is not None and plan.fused and not (plan.cuda and _capture_underway()):
            fusion, plan = self._planned_fusion(key, plan, args, kwargs)
        if plan is not None and not (plan.cuda and _capture_underway()):
            # A decided schedule (those that do not fork usually run inline in ``forward``).
            tuner = self._tuner  # (a reset by another thread meanwhile: see below)
            outputs = self._run(args, kwargs, _input_device(args, kwargs) if plan.forked else None,
                                fusion, False)
            if (plan.forked and self.streams == "auto" and torch.is_grad_enabled() and _records(outputs)
                    and self._tuner is tuner):
                # "auto" forked this signature with nothing to train, and a parameter has been
                # unfrozen since (``requires_grad_()`` registers nothing; inputs' requires_grad
                # is in the signature): chosen again at the next call, which does not fork in
                # training (see _candidates). Seen on the outputs: walking the parameters on
                # every call cost 98 us of a call with 804 of them on the H100 machine.
                # Kept as it is, without the fork: the outputs may also record through a
                # tensor that is neither a parameter nor an input (a closure, a weight tied
                # from outside), which _candidates cannot see, and tuning again would
                # choose to fork again, call after call. (Not after a reset by another thread
                # while the branches ran: the plan was of the old settings or branches.)
                self._remember(key, plan._replace(forked=False))
            return outputs
        # What was learnt before this call's settings and branches: a reset by another thread while
        # this first call runs (``block.fuse = False``, a branch replaced) makes a new tuner, and a
        # schedule chosen here for the old state must not land among the new state's.
        tuner = self._tuner
        held = self.fuse is not False and _held_by_hooks()  # (read once: another thread may enter or leave)
        grouped = self._fusion  # (read once: another thread's train() may set it to None)
        if plan is None and held and (self.fuse is True or grouped is not None and bool(grouped.groups)):
            # Module hooks registered for the whole process hold the groups back for now (see
            # _held_by_hooks): this call runs the branches in turn, and the signature is planned
            # at its first call once they are gone -- planned now, it would stay unfused (and
            # fuse=True, with branches that no longer match, would not say so).
            self._checked_device(args, kwargs)
            return self._run(args, kwargs)
        fusion = None if self.fuse is False else self._fusion_for(args, kwargs, thorough=True, held=held)
        # torch.utils.checkpoint recomputes the forward pass in backward and refuses a
        # recomputation that saves other tensors than the forward did: a call it may
        # recompute runs the schedule of the next call too (see _checkpointed).
        checkpointed = plan is None and (_checkpoint_recording() or _in_backward())
        if plan is None and self.fuse is True and fusion is not None:
            # fuse=True refuses members that begin with a stock layer writing the shared input
            # (nn.ELU(inplace=True) first) before a signature's first call runs them. Seen after,
            # by the input's version, the refused call had already changed the caller's input
            # (the batched layer writes it once for every member), and the fix the error advises,
            # fuse="auto" or fuse=False, called again on that input, computed the branches on the
            # changed values, silently. (A layer switched to inplace=True after a signature's
            # first call is seen by the version, after the write: looking at the layers on
            # every call costs about 3 us.)
            self._refuse_writers(fusion.units)
        if plan is None:
            # A fused group runs its members together, and before or after the other branches
            # (or groups), as forks run branches side by side: one of those changing the
            # shared input in place would be seen by some members and not others. (Checkpointed,
            # the fused call watches for such writes instead: see _run_units_watched.)
            reordered = self.fuse == "auto" and fusion is not None and not checkpointed
            if (self.streams is not False or reordered) and key not in self._unwritten:
                device = _input_device(args, kwargs) if _unversioned(args, kwargs) else None
                if device is not None and device.type == "cuda" and not _capture_underway():
                    return self._first_unversioned(key, args, kwargs, fusion, tuner)
            plan = self._plan(key, args, kwargs, fusion, watch_first=reordered, tuner=tuner)
            if plan is _CPU_FUSED and reordered:  # the first call runs in turn and looks
                # (Remembered once it has looked: other threads' calls of the signature
                # meanwhile look too, rather than run fused what may write its input. One
                # that fails sees nothing, and the next call looks again.)
                outputs, wrote = self._run_watched(args, kwargs, None)
                if self._tuner is not tuner:
                    # Reset while the branches ran: what this call saw was of the old branches
                    # or settings (remembered, ``fuse=False`` set meanwhile would regroup and
                    # run fused at the next call). The next call looks again.
                    return outputs
                if wrote:
                    self._saw_write = True
                    self._remember(key, _CPU_IN_TURN)
                elif key not in self._plans:
                    self._remember(key, _CPU_FUSED)
                return outputs
        if plan is not None and not plan.cuda:
            return self._run(args, kwargs, None, fusion if plan.fused else None)
        device = _input_device(args, kwargs)
        if _capture_underway():
            # Warm-up or capture of a CUDA graph (``cuda_graph=True`` here or in
            # an enclosing block, or the user's own capture): launches cost
            # nothing at replay, so fuse what is allowed to fuse, and fork unless
            # told not to -- forking is what makes branches concurrent in a graph.
            if fusion is not None and "unfused" in (_graph_variant(self) or ()):
                fusion = None
            return self._run(args, kwargs, device if self.streams is not False else None, fusion, True)
        if plan is not None:
            return self._run(args, kwargs, device if plan.forked else None, fusion if plan.fused else None, False)
        # (``tuner`` is the one the call began with, not read again: a reset by another thread
        # since then, while the groups were found, leaves this call's choice unremembered.)
        candidates = self._candidates(fusion, args, kwargs)
        if checkpointed and len(candidates) > 1:
            return self._checkpointed(key, args, kwargs, device, fusion, candidates, tuner)
        watched = _watched(args, kwargs)
        versions = [a._version for a in watched]
        # Each schedule is timed with its join: the user pays for it, and it is not
        # the same work for each (on the H100 machine, the ``cat`` of two unfused
        # tiny branches cost 20 us of a 60 us call, where a fused group's join is
        # a view; timed without it, "auto" kept the unfused branches, 1.6x slower,
        # in 5 fresh blocks of 10).
        try:
            out, decided = tuner.run(
                key, _current_stream(device), candidates,
                lambda s: _Reduced(self._joined(
                    self._run(args, kwargs, device if s.forked else None, fusion if s.fused else None, False))),
            )
        except Exception:
            if _changed(watched, versions):
                # A trial forked or fused out of branch order was refused for a branch writing
                # the input (see _run): the trials go no further, the signature stays in order.
                tuner.forget(key)
                in_order = [c for c in candidates if not c.forked]
                if self._tuner is tuner and in_order:  # (unfused first: fuse=True has only fused)
                    self._remember(key, min(in_order, key=lambda c: c.fused))
            raise
        if _changed(watched, versions):
            # A branch changed the input in place: forked, the others would race
            # with it (a fork refuses it, so "auto" would fail every other call
            # while tuning); one after another it is well defined.
            decided = next((c for c in candidates if not c.forked), decided)
            tuner.forget(key)
        if decided is not None and self._tuner is tuner:  # (not if a setting changed meanwhile: reset)
            self._remember(key, decided)
        return out

    def _checkpointed(self, key: Hashable, args: tuple, kwargs: dict, device: torch.device | None,
                      fusion: _Fusion | None, candidates: list[_Schedule], tuner: _ScheduleTuner) -> Any:
        r"""The first call of a signature under ``torch.utils.checkpoint`` or in backward: the most fused of
        ``candidates``, forked only if none runs in order, kept for the signature without timing.

        ``torch.utils.checkpoint(use_reentrant=False)`` runs the forward pass
        under saved-tensor hooks and runs it again in backward, where it refuses
        a recomputation that saves other tensors: the trials of "auto", one
        schedule per call, would run a fused group in one and its members in the
        other, and a block only ever called checkpointed would never be decided.
        Kept, the forward and its recomputation run one schedule (forks run in
        line there anyway, see ``_streams._autograd_in_line``). Under
        ``fuse="auto"`` the fused call watches for a branch changing the input
        in place (see :meth:`_run_units_watched`), where an unhooked first call
        runs the branches in order and looks. ``tuner``: the one the call began
        with; after a reset by another thread the choice is not remembered.
        """
        s = max(candidates, key=lambda c: (c.fused, not c.forked))
        if self._tuner is tuner:
            self._remember(key, s)
        return self._run(args, kwargs, device if s.forked else None, fusion if s.fused else None, False)

    def _run_watched(self, args: tuple, kwargs: dict, fusion: _Fusion | None) -> tuple[Any, bool]:
        r"""The branches run in turn (``fusion``'s groups batched), and whether any changed an input in
        place: seen by the inputs' versions, and, for inference tensors, which keep none, by
        :class:`_Writes`."""
        watched, unversioned = _watched(args, kwargs), _unversioned(args, kwargs)
        versions = [t._version for t in watched]
        watch = _Writes(unversioned)
        # (With compile=, the children as they are: the watch sees each operation in Python,
        # which compiled code would not show it, and must not be compiled into that code.)
        saved = _graph_state.variant
        if unversioned and self._compiler is not None:
            _graph_state.variant = (self, (_EAGER,))  # (see _branches)
        try:
            with watch if unversioned else contextlib.nullcontext():
                outputs = self._run(args, kwargs, None, fusion, False)
        finally:
            _graph_state.variant = saved
        return outputs, watch.wrote or _changed(watched, versions)

    def _first_unversioned(self, key: Hashable, args: tuple, kwargs: dict, fusion: _Fusion | None,
                           tuner: _ScheduleTuner) -> Any:
        r"""The first call of a signature whose inputs include inference tensors: the branches run one
        after another, watched for writes to those tensors.

        Inference tensors (made under ``torch.inference_mode()``) keep no
        version, by which a fork sees a branch change its input in place
        (``nn.ReLU(inplace=True)`` first) while the others read it on their
        streams, and ``fuse="auto"`` a branch change it before a fused group
        that comes after it in the block runs. A branch that writes to them
        here keeps the signature sequential (``"auto"``) or is refused (``streams=True``), as such a
        branch is where versions show it; otherwise the signature's calls
        are scheduled as any other's. (Once per signature: a branch that
        writes to its input on some calls only is not seen.) ``tuner``: the
        one the call began with; what it saw is not remembered after a reset
        by another thread meanwhile (``block.fuse = False``), being of the old
        settings or branches.
        """
        fused = fusion if self.fuse is True else None
        outputs, wrote = self._run_watched(args, kwargs, fused)
        if self._tuner is not tuner:
            return outputs  # (the next call watches again)
        if not wrote:
            _bounded_add(self._unwritten, key)
        elif self.streams is True:
            refused = _changed_in_place()
            refused.handled = True  # (see _fork_refused)
            raise _with_context(refused, f"(seen by {type(self).__name__} on its first call with this input "
                                         f"signature, whose inference tensors keep no version to check on "
                                         f"each call)")
        else:
            self._remember(key, _Schedule(True, False, True) if fused is not None else _CUDA_IN_TURN)
        return outputs

    def _fuse_choices(self, fusion: _Fusion | None) -> list[bool]:
        r"""Whether to run ``fusion``'s groups fused: ``[False, True]`` where ``fuse="auto"`` may time both.

        ``"auto"`` keeps the branches unfused with deterministic algorithms
        asked for (:meth:`_auto_unfused`) and once a write out of order was
        seen (:meth:`_keep_in_order`); ``fuse=True`` always fuses.
        """
        if fusion is None or self.fuse is False:
            return [False]
        if self.fuse is True:
            return [True]
        return [False] if self._auto_unfused() or self._in_order else [False, True]

    def _candidates(self, fusion: _Fusion | None, args: tuple, kwargs: dict) -> list[_Schedule]:
        r"""The schedules worth trying for a CUDA call; the plain sequential one first."""
        fuses = self._fuse_choices(fusion)
        forks = [False, True] if self.streams == "auto" else [bool(self.streams)]
        if self._in_order and self.streams == "auto":  # (see _keep_in_order)
            forks = [False]
        if len(forks) == 2 and torch.is_grad_enabled() and (
                any(p.requires_grad for p in self.parameters())
                or any(t.requires_grad for t in _tensor_leaves((args, kwargs)))):
            # Training (this block's parameters, or what came before it): the backward of
            # forked branches runs on their streams too, and the tuner times only the
            # forward, so it cannot see what forking costs there (under DDP on 2 H200s it
            # chose to fork: 0.85x the plain step). Fork in training only when told to,
            # with streams=True.
            forks = [False]
        units = len(fusion.units) if fusion is not None else len(self._modules)
        candidates = []
        for fused in fuses:
            for forked in forks:
                # One unit (all branches fused, or a single branch) has nothing to fork.
                s = _Schedule(fused, forked and (len(self._modules) if not fused else units) > 1, True)
                if s not in candidates:
                    candidates.append(s)
        return candidates

    def _remember(self, key: Hashable, plan: _Schedule) -> None:
        if not plan.fused and self._auto_unfused() and self._fusion is not None and self._fusion.groups:
            _bounded_add(self._reproducible, key)
        _bounded_add(self._plans, key, plan)

    def _replan_reproducible(self) -> None:
        r"""Plan anew the signatures planned unfused while deterministic algorithms were asked for.

        ``"auto"`` keeps the groups unfused while they are (:meth:`_auto_unfused`),
        without timing; turned off, the groups may run fused again, as for a
        signature first seen then. (Its fused plans were dropped as they were
        turned on.)
        """
        for key in list(self._reproducible):  # (a copy: another thread may plan meanwhile)
            self._reproducible.pop(key, None)
            self._plans.pop(key, None)
            self._tuner.forget(key)

    def _checked_device(self, args: tuple, kwargs: dict) -> torch.device | None:
        r"""The device of the call's tensors, once the branches' parameters are seen to live there."""
        device = _input_device(args, kwargs)
        if device is not None:
            # (One snapshot for names and branches, copied under the GIL: another thread may append a
            # branch meanwhile.)
            branches = tuple(self._modules.items())
            _check_devices(type(self).__name__, [n for n, _ in branches], [b for _, b in branches], device)
        return device

    def _plan(self, key: Hashable, args: tuple, kwargs: dict, fusion: _Fusion | None,
              watch_first: bool = False, tuner: _ScheduleTuner | None = None) -> _Schedule | None:
        r"""First call with this signature: check devices, choose how to schedule (``None``: tune).

        ``watch_first``: a fused CPU plan is the caller's to remember, once a call in turn saw
        whether a branch writes its input. ``tuner``: the one the call began with; a plan
        chosen from the groups of before a reset is not remembered (see ``_outputs``)."""
        device = self._checked_device(args, kwargs)
        if device is None or device.type != "cuda":
            # No streams on the CPU; fusion ("auto" too) always pays there: fewer, larger operations.
            plan: _Schedule | None = _CPU_FUSED if self._fuse_choices(fusion)[-1] else _CPU
        else:
            candidates = self._candidates(fusion, args, kwargs)
            plan = candidates[0] if len(candidates) == 1 else None
        if (plan is not None and not (watch_first and plan is _CPU_FUSED)
                and (tuner is None or self._tuner is tuner)):
            self._remember(key, plan)
        return plan


def _put_back_buffers(group: _Group, kept: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
    r"""Write back the copies ``kept`` of ``group``'s buffer stacks before a batched attempt, and point the
    members at their slices of every stack that put back to its old shape (see :meth:`_Group.follow_resized`):
    the two go together wherever an attempt is undone, or the members keep the attempt's layout.
    """
    _put_back(kept)
    group.follow_resized()


def _put_back_input(x: torch.Tensor, copy: torch.Tensor) -> None:
    r"""Write ``copy``, kept before a fused group's batched attempt wrote the shared input ``x``, back into it.

    A ``copy_`` that autograd records, where ``x`` requires grad: its gradient flows to
    the copy's source, the history ``x`` had before the write. Not where autograd refuses
    an in-place write, which the layer then made under ``no_grad``: a leaf, or a view of
    one (a slice of a weight passed as the input).
    """
    leaf = x.is_leaf or x._base is not None and x._base.is_leaf
    with torch.no_grad() if leaf else contextlib.nullcontext():
        x.copy_(copy)


def _grouping(fusion: _Fusion) -> list[list[int]]:
    r"""Which branches ``fusion`` runs as one, group by group."""
    return [group.indices for group in fusion.groups]


def _out_of_order(units: list[Any]) -> bool:
    r"""Whether running ``units`` in turn runs a branch before one of a lower index."""
    order = [i for unit in units for i in _unit_indices(unit)]
    return order != sorted(order)


def _unit_indices(unit: Any) -> list[int]:
    r"""The branches a fused call's unit runs: a group's members, or the one branch."""
    return unit.indices if isinstance(unit, _Group) else [unit]


def _traced_unfused(group: _Group, x: torch.Tensor) -> bool:
    r"""Whether a trace runs ``group``'s members one after another, not fused, on the shared input ``x``.

    A trace cannot watch the input's version nor write back into the members'
    buffers what a batched layer wrote into their stacks: members whose layers
    show a write to the shared input (:func:`_writes_shared_input`) or that may
    write buffers (:func:`_writes_buffers`) are traced unfused. So is every
    group under ``torch.jit.trace``, where ``torch.func.functional_call`` --
    which runs the layers fusion hands to vmap (a GroupNorm, a module of the
    user's) -- refuses to run; and a group with such layers on an input of a
    dynamic size, which torch's batching rules do not all take: ``F.linear``
    with a bias on a 3-D input asks the batched tensor for ``sizes()`` and
    fails, a layer norm specializes them (torch 2.11 and 2.13).
    """
    return (not torch.compiler.is_compiling() and _jit_tracing() or _writes_shared_input(group)
            or _writes_buffers(group) or group.vmapped and any([_symbolic(n) for n in x.shape]))


def _writes_shared_input(group: _Group) -> bool:
    r"""Whether a group's members begin with a layer writing the shared input in place, as their layers
    tell (:func:`._children._writes_its_input`: ``nn.ELU(inplace=True)`` first), other than to clamp it
    (:func:`_clamps_its_input`), which run together they may."""
    return _writes_its_input(group.template) and not _clamps_its_input(group)


def _writes_buffers(group: _Group) -> bool:
    r"""Whether a group's members may write their buffers: held by a layer in training, or by other than a
    norm with torch's own ``forward`` (a subclass's may update its statistics in eval: test-time adaptation)."""
    for qual in group.buffers:
        owners = group.entries[qual].owners
        if any(o.training for o in owners) or type(owners[0]).forward not in _STOCK_NORM_FORWARDS:
            return True
    return False


_STOCK_NORM_FORWARDS = frozenset({nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward,
                                  nn.modules.instancenorm._InstanceNorm.forward})


# Layers writing their input in place to a clamp of it: one clamp after another is a clamp.
_CLAMPS = (nn.ReLU, nn.ReLU6, nn.Hardtanh)


def _clamps_its_input(unit: Any) -> bool:
    r"""Whether ``unit`` is a group whose members write their input only to clamp it, once or many times alike.

    Members that begin with in-place clamps (``nn.ReLU(inplace=True)`` before a
    ``Linear`` or a convolution, whose output is new) leave the shared input as
    one of them would, called in turn, and read what each would have read: run
    together, the group changes no result. Any other write is refused (see
    :meth:`Parallel._run_units_watched`).
    """
    if not isinstance(unit, _Group):
        return False
    layers = list(_layers_in_turn(unit.template))  # (as _writes_its_input reads them)
    k = 0
    while k < len(layers) and type(layers[k]) in _CLAMPS and layers[k].inplace:
        k += 1
    return 0 < k < len(layers) and type(layers[k]) in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _own_mode(block: nn.Module, branch: nn.Module, given: Any) -> nn.Module:
    r"""``branch``, in ``block``'s train/eval mode where the block made it (a callable's holder)."""
    return branch.train(block.training) if branch is not given else branch


def _records(outputs: Any) -> bool:
    r"""Whether autograd records on any tensor of a call's ``outputs``, as ``_run`` returns them."""
    if type(outputs) is _Reduced:
        outputs = outputs.value
    elif isinstance(outputs, _Joined):
        outputs = getattr(outputs.value, "t", outputs.value)
    if isinstance(outputs, list):
        outputs = list(outputs)  # (``_Unfused``, a list pytree does not flatten)
    return any(t.requires_grad for t in _tensor_leaves(outputs))


def _all_identical(branches: list[nn.Module]) -> bool:
    r"""Whether every branch is structurally identical to the first (nothing to put first)."""
    return all(_difference(branches[0], b) is None for b in branches[1:])


class _UnderAutocast(NamedTuple):
    r"""The schedule key of a call under CUDA autocast (see :func:`_under_autocast`)."""

    signature: Hashable
    dtype: torch.dtype


def _under_autocast(signature: Hashable) -> Hashable:
    r"""The key a call's schedule is chosen and kept for, from its input ``signature``: with the dtype
    CUDA autocast casts to, if it is on.

    Under ``torch.autocast("cuda", torch.bfloat16)`` the branches run other kernels, on other
    dtypes: a schedule timed in float32 was not timed for them (and the reverse). Keyed as the
    graphs key it (``_graphs._autocast_state``): the tuner times CUDA calls only. Called where
    ``_graphs._any_autocast()`` says some autocast is on: a plain key otherwise costs nothing.
    """
    dtype = _autocast_state()
    return signature if dtype is None else _UnderAutocast(signature, dtype)


def _one_tensor(key: Hashable) -> bool:
    r"""Whether the signature ``key`` (see ``_inputs._signature``) is of a call of one dense tensor, the calls
    fused groups run (see :meth:`Parallel._fusion_for`): a plain one, or a subclass's without a
    ``__torch_function__`` of its own (a parameter's, a ``__torch_dispatch__`` wrapper's)."""
    if type(key) is _UnderAutocast:
        key = key.signature
    if isinstance(key[0], torch.Size):
        return True
    leaves = key[3:]
    return (key[0] == _ONE_ARGUMENT and len(leaves) == 1 and isinstance(leaves[0], tuple)
            and isinstance(leaves[0][0], torch.Size)
            and all(isinstance(n, int) for n in leaves[0][1])  # (strides: not a sparse layout's (layout, nnz))
            and (len(leaves[0]) == 5 or not _overrides_ops(leaves[0][5])))  # (a subclass's: see _fusion_for)


_ONE_ARGUMENT = pytree.tree_structure(((0,), {}))  # (args, kwargs) of a call of one positional argument


def _held_by_hooks() -> bool:
    r"""Whether fused groups run unfused on this call, for module hooks registered for the whole process.

    FlopCounterMode and ModuleTracker register them for as long as they are
    entered: they must see each branch called. The groups, found as if the
    hooks were not there, run batched again once they are gone. Not for a call
    that ``torch.utils.checkpoint`` records or recomputes, which must run the
    same way both times, whichever of the two the hooks see.
    """
    # (A compiler's trace does not ask: it runs the checkpointed forward as traced, both times.)
    return any(_GLOBAL_HOOKS) and (_is_tracing() or not _checkpoint_recording())


def _put_back_parameters(written: list[tuple[torch.Tensor, int, torch.Tensor | None]] | None) -> bool:
    r"""Write back each parameter stack (or tensor attribute) that changed since its version was read, from its
    copy (``written``: a stack, its version then and its copy or ``None``); ``False`` where one changed with no
    copy to write.

    (Only those that changed: a copy into a stack autograd saved for another graph's backward would
    make that backward refuse it.)
    """
    if not written:
        # (No grad-mode switch for nothing: a traced group unbatched, whose stacks are never read
        # here, would leave an empty no_grad region in the program -- an output-less
        # wrap_with_set_grad_enabled that torch.export.load refuses, "missing val field".)
        return True
    restored = True
    with torch.no_grad():
        for stack, version, saved in written:
            if stack._version != version:
                if saved is None:
                    restored = False
                else:
                    stack.copy_(saved)
    return restored


def _describe_schedule(plan: _Schedule) -> str:
    return ("fused" if plan.fused else "unfused") + ", " + ("streams" if plan.forked else "sequential")


def _describe_costs(costs: dict[Hashable, Any] | None) -> str:
    # What "auto" measured per call for each schedule it tried, where it chose (see _autotune).
    if not costs:
        return ""
    return " (timed per call: " + "; ".join(
        f"{_describe_schedule(s)}: CPU {t.cpu * 1e6:.1f} us, GPU {t.gpu * 1e6:.1f} us" for s, t in costs.items()) + ")"


def _describe_signature(key: Hashable) -> str:
    r"""A readable form of an input signature (see ``_inputs._signature``).

    Everything the key holds is shown, so that two signatures never read alike:
    strides where a tensor is not contiguous, ``requires_grad``, the values of
    numbers and dtypes, the types of other arguments, where each was passed
    (``f(x, y)`` or ``f(x, y=y)``), training and no-grad calls, and a schedule's autocast
    (see :func:`_under_autocast`).
    """
    if type(key) is _UnderAutocast:
        return f"{_describe_signature(key.signature)}, autocast to {str(key.dtype).replace('torch.', '')}"
    grad, training = _grad_and_training(key)
    if isinstance(key[0], torch.Size):
        parts = [_describe_leaf(key[:5])]
    else:
        args, kwargs = pytree.tree_unflatten([_describe_leaf(item) for item in key[3:]], key[0])
        parts = [_describe_arg(a) for a in args] + [f"{k}={_describe_arg(v)}" for k, v in kwargs.items()]
    return ", ".join(parts) + (", training" if training is True else "") + ("" if grad else ", no grad")


def _describe_arg(value: Any) -> str:
    r"""One argument of a signature: its leaves' descriptions in its containers."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe_arg(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe_arg(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    return repr(value)


def _describe_leaf(item: Any) -> str:
    r"""One input leaf's part of a signature (see ``_inputs._signature``), readable."""
    if isinstance(item, tuple) and len(item) in (5, 6) and isinstance(item[0], torch.Size):
        shape, stride, dtype, device, requires_grad = item[:5]
        kind = item[5].__name__ if len(item) == 6 else "Tensor"  # (a subclass: see _signature)
        text = f"{kind}{tuple(shape)} {str(dtype).replace('torch.', '')} on {device}"
        if isinstance(stride, tuple) and stride and isinstance(stride[0], torch.layout):  # (layout, nnz) or (layout,)
            text += f" {str(stride[0]).replace('torch.', '')}" + (
                f" with {stride[1]} stored values" if len(stride) > 1 else "")
        elif stride != torch.empty(shape, device="meta").stride():  # (contiguous strides, no memory)
            text += f" strides {tuple(stride)}"
        return text + (" requires_grad" if requires_grad else "")
    if isinstance(item, tuple) and item and isinstance(item[0], str) and item[0] == "nested":
        return f"nested Tensor{list(map(tuple, item[2]))} {str(item[3]).replace('torch.', '')} on {item[4]}"
    if (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], type)
            and issubclass(item[0], numbers.Number) and isinstance(item[1], (str, tuple))):
        # (A float, numpy's or a complex number, keyed by its exact bits: see _value_key.)
        value = (str(float.fromhex(item[1])) if isinstance(item[1], str)
                 else str(complex(*map(float.fromhex, item[1]))))
        return value if item[0] in (float, complex) else f"{item[0].__name__}({value})"
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], type):
        # A number, string, dtype or device, as keyed: by type and value. A string quoted, as
        # "cpu" and "float16" are keyed apart from the device and the dtype; a number of another
        # type than Python's named with it (an IntEnum, numpy's), as keyed apart from ``1``.
        kind, value = item
        if kind is str:
            return repr(value)
        if kind in (int, bool, complex, type(None)) or isinstance(
                value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(value).replace("torch.", "")
        return f"{kind.__name__}({value})"
    if isinstance(item, type):
        return item.__name__
    return repr(item)
