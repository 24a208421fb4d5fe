r"""``ParallelSequential``: stages pipelined over micro-batches, each on its own stream.

How one call runs on a CUDA device (``chunks`` = M pieces, S stages)::

    caller  --fork-->  [copy]  stage 0   stage 1  ...  stage S-1  --join-->  cat
                       lane 0  lane 1    lane 2        lane L-1

Every *lane* (the optional host-to-device copy, then each stage) runs on a side
stream of its own from the library's pool, so lanes working on different
pieces overlap. Lane ``l`` starts piece ``m`` after waiting on the event lane
``l-1`` recorded when it finished piece ``m``; a stream runs its work in
issue order, so each lane also handles its pieces in order. The last lane
copies each output into its place in the concatenated result as soon as it is
made (or, for outputs that are not plain tensors, the caller concatenates them
afterwards), and the caller's stream waits on the last event of the last lane,
which, through that chain of events, follows every piece of every lane.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import importlib
import itertools
import threading
import weakref
from collections import OrderedDict, deque
from typing import Any, Callable, Hashable, Iterable, Iterator, NamedTuple, Sequence, overload

import torch
from torch import nn
from torch.fx import _symbolic_trace
from torch.overrides import TorchFunctionMode
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.utils import _pytree as pytree

from ._children import (_check_name, _check_numbered, _check_stage, _child_key, _in_turn, _insert_index, _listed,
                        _new_like, _scripted_in_turn, _slice_text, _state_to_copy, _uncompiled, _writes_its_input)
from ._compile import _COMPILED, _EAGER, _NOT_SCRIPTABLE, _WHOLE, Backend, _compiler
from ._joins import _describe, _in_order_of, _out_of_memory
from ._inputs import (_BY_VALUE, _bounded_add, _dynamo_compiling, _integer, _leaf_device, _module_devices,
                      _with_context)
from ._graphs import _GRAPH_SETTINGS, _check_graph_setting, _CudaGraphs, _graph_variant
from . import _watch
from ._fusion import _FAST_PATHS  # (also turned off by any torch function mode: see _Plan.scoped)
from .parallel import Parallel
# (The C-level stream and event calls of ``_streams``: a call records and waits on events
# twice per piece and lane, where the Python wrappers cost microseconds each.)
from ._streams import (_FakeTensor, _capture_underway, _current_stream, _functorch_active, _graph_state,
                       _hidden_attributes, _is_tracing, _jit_tracing, _join_backward, _pool, _record, _record_on, _size,
                       _set_stream, _symbolic, _wait)

__all__ = ["ParallelSequential"]

_UNKNOWN: Any = object()  # the placement has not been looked at yet
_MIXED: Any = object()  # stages have parameters on more than one device


# Constructor arguments kept as attributes, which a user may change later.
_PIPELINE_SETTINGS = _GRAPH_SETTINGS | {"chunks"}
# How stages come by names other than their positions, which insert and *= need (see _check_numbered).
_NAMED_STAGES = "kept through a slice, or given in an OrderedDict"


class _Plan(NamedTuple):
    r"""What a call needs to know about the stages, cached until they change."""

    stages: tuple[nn.Module, ...]
    names: tuple[str, ...]
    home: Any  # the one device of every parameter/buffer, None (none at all) or _MIXED
    placement: dict[torch.device, int]  # each device -> first stage index living there
    devices: tuple[frozenset[torch.device], ...]  # each stage's (see ParallelSequential._stage_error)
    # Modules that mix samples by their type (BatchNorm, batch-second layers) or a
    # class attribute ``mixes_batch``: (stage index, qualified name, module).
    mixers: tuple[tuple[int, str, nn.Module], ...]
    # Every other module, whose instance may declare ``mixes_batch`` at any time.
    others: tuple[tuple[int, str, nn.Module], ...]
    # The embeddings whose weight another module of the stages reads (tied). (The modules,
    # not their ids: a compiler guards on every id() it traces, which would compile a
    # pipeline again for each instance of it -- regional compilation, one per block.)
    tied: tuple[nn.Module, ...]
    # Whether the softmax check is kept inside the softmax layers (see _SoftmaxDims.inside).
    scoped: bool
    # The batch-first sequence layers among ``others`` (see _unbatched_refused), where
    # nothing in the stages reads hooks.
    sequences: tuple[tuple[int, str, nn.Module], ...] = ()
    # The batch-first sequence layers among ``others``, hooks or not: ``batch_first`` set to
    # False since (which registers nothing) makes one a batch-second mixer (see _mixing_error).
    batch_first: tuple[tuple[int, str, nn.Module], ...] = ()


# This thread's CUDA events, per device (an event may only be recorded on
# streams of the device it was created for), and the first one free: a
# ParallelSequential nested in a stage takes the events after its parent's,
# so it never re-records one its parent has yet to wait on.
class _Events(threading.local):
    # Class attributes: the defaults each thread sees before it writes its own.
    events: dict[int, list[torch.cuda.Event]] | None = None
    cursor = 0


_local = _Events()


def _take_events(device: torch.device, count: int) -> tuple[list[torch.cuda.Event], int]:
    table = _local.events
    if table is None:
        table = _local.events = {}
    events = table.setdefault(device.index, [])
    start = _local.cursor
    while len(events) < start + count:
        events.append(torch.cuda.Event())
    _local.cursor = start + count
    return events, start


# Tell the caching allocator that ``stream`` reads ``value``'s CUDA tensors. A
# tensor allocated on one lane's stream and read on another's would otherwise
# return to its own stream's pool as soon as Python drops it, and the next
# piece of that lane could overwrite it while the reader is still queued. With
# ``record_stream`` the block is reused only after ``stream`` has passed this point.
_mark = _record_on


# TorchScript modules (``torch.jit.script``, ``torch.jit.trace``) are of another class than
# the one they were made from, whose name they keep: the norm layers among them, by that name.
_NORMS_BY_NAME = {cls.__name__: cls for cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
                                               nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)}


def _norm_class(m: nn.Module) -> type | None:
    r"""The norm layer class ``m`` is (``_NormBase``'s), or was made from as a TorchScript module; else ``None``."""
    if isinstance(m, _NormBase):
        return type(m)
    if isinstance(m, torch.jit.ScriptModule):
        return _NORMS_BY_NAME.get(getattr(m, "original_name", None))
    return None


def _layer_name(m: nn.Module) -> str:
    r"""``m``'s class name, for a TorchScript module the one it was made from."""
    if isinstance(m, torch.jit.ScriptModule) and getattr(m, "original_name", None):
        return f"{m.original_name}, TorchScript"
    return type(m).__name__


# Stock layers that mix samples across the batch depending on their settings: a softmax
# along dimension 0, an embedding scaling its gradient by frequencies in the batch.
_SOFTMAXES = (nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softmax2d)
_ACROSS_DIM_0 = (*_SOFTMAXES, nn.Embedding, nn.EmbeddingBag)
# The names a TorchScript module made from a stock softmax layer keeps (see _NORMS_BY_NAME).
_SOFTMAX_NAMES = frozenset(cls.__name__ for cls in _SOFTMAXES)


def _made_from(m: nn.Module, names: frozenset[str]) -> bool:
    r"""Whether ``m`` is a TorchScript module made from a class of one of ``names`` (see :func:`_norm_class`)."""
    return isinstance(m, torch.jit.ScriptModule) and getattr(m, "original_name", None) in names


def _scripted_softmax(m: nn.Module) -> bool:
    r"""Whether ``m`` is a stock softmax layer compiled with ``torch.jit.script``, which keeps its ``dim``.

    TorchScript runs no torch function mode and takes no hooks, so its dim is
    judged as written only (0: across the batch); one written negative or
    ``None``, which resolves on the input, is not seen (see :class:`_SoftmaxDims`).
    A ``torch.jit.trace``'d one keeps no ``dim``: not seen either.
    """
    return _made_from(m, _SOFTMAX_NAMES) and (m.original_name == "Softmax2d" or hasattr(m, "dim"))


# Layers that quantize their input with a scale taken from the whole input at every call
# (``torch.ao.quantization.quantize_dynamic``'s), and QAT's fake quantizers, whose observers
# set the scale from the inputs they see: a micro-batch would be quantized on another scale.
# (Looked up softly: torch.ao.quantization is deprecated, for torchao.)
try:
    from torch.ao.nn.quantized import dynamic as _dynamic
    from torch.ao.quantization import FakeQuantizeBase as _FakeQuantize
    from torch.ao.quantization.observer import FixedQParamsObserver as _FixedQParams
    from torch.ao.quantization.observer import (HistogramObserver, MovingAverageMinMaxObserver,
                                                MovingAveragePerChannelMinMaxObserver, PerChannelMinMaxObserver)
except ImportError:  # pragma: no cover - a torch without them
    _DYNAMIC_QUANTIZED, _FakeQuantize, _FixedQParams, _BATCH_OBSERVERS, _PerChannel = (), (), (), (), ()
else:
    # Post-training calibration's observers (``torch.ao.quantization.prepare``) whose state
    # depends on how the batch is cut: a moving average moves once per call, a histogram is
    # binned anew on each call's range. (Not MinMaxObserver's: a min of the micro-batches'
    # mins is the batch's; but a per-channel one along dim 0, the batch's, keeps one range per
    # sample of a call: see _batch_observer.) One inside a fake quantizer is judged with it, by
    # the quantizer.
    _BATCH_OBSERVERS = (MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver, HistogramObserver)
    _PerChannel = PerChannelMinMaxObserver
    _DYNAMIC_QUANTIZED = tuple(c for c in vars(_dynamic).values() if isinstance(c, type) and issubclass(c, nn.Module))


def _quantizes_on_the_batch(m: nn.Module, owned: frozenset[int] | set[int] = frozenset()) -> bool:
    # (A weight's fake quantizer too: the default QAT one keeps a moving average of what it
    # observes, which each micro-batch would move again once the weight changes. Not one
    # of fixed scale, after a sigmoid or softmax. ``owned``: ids of the observers of fake
    # quantizers, judged with them.)
    return isinstance(m, _DYNAMIC_QUANTIZED) or isinstance(m, _FakeQuantize) and not isinstance(
        getattr(m, "activation_post_process", None), _FixedQParams) or _batch_observer(m) and id(m) not in owned


def _batch_observer(m: nn.Module) -> bool:
    r"""Whether ``m`` is a calibration observer whose state depends on how the batch is cut."""
    return isinstance(m, _BATCH_OBSERVERS) or isinstance(m, _PerChannel) and getattr(m, "ch_axis", None) == 0


def _observers_of_fake_quantizers(stage: nn.Module) -> set[int]:
    r"""The ids of the observers that fake quantizers below ``stage`` hold (see :func:`_quantizes_on_the_batch`)."""
    return {id(q.activation_post_process) for q in stage.modules()
            if isinstance(q, _FakeQuantize) and isinstance(getattr(q, "activation_post_process", None), nn.Module)}


_SpectralNorm = getattr(torch.nn.utils.parametrizations, "_SpectralNorm", ())
_SpectralNormHook = getattr(importlib.import_module("torch.nn.utils.spectral_norm"), "SpectralNorm", ())


def _spectral_norm(m: nn.Module) -> bool:
    r"""Whether ``m`` runs a power iteration of a spectral norm at each call in training mode.

    ``parametrizations.spectral_norm`` (the parametrization is a submodule) and
    the older ``utils.spectral_norm`` (a forward pre-hook): each micro-batch
    would take one more step of the estimate, and read another weight.
    """
    return isinstance(m, _SpectralNorm) or (
        bool(m._forward_pre_hooks) and any(isinstance(h, _SpectralNormHook) for h in m._forward_pre_hooks.values()))


def _read_elsewhere(m: nn.Module, modules: Sequence[nn.Module]) -> bool:
    r"""Whether embedding ``m``'s weight is read by another of ``modules`` (tied, or ``m`` held twice).

    ``modules``: every module of the pipeline, itself included, each once
    (``modules()``), whatever number of stages list it; each of its slots
    holding ``m`` counts (a head keeping the embedding whose weight it reads,
    in the same stage).
    """
    held = sum(c is m for x in modules for c in x._modules.values())
    return held > 1 or any(x is not m and any(p is m.weight for p in x._parameters.values()) for x in modules)


def _softmax_dim(m: nn.Module) -> int | None:
    r"""The dim a stock softmax layer normalizes along as written: ``None`` or negative ones depend on its input."""
    return -3 if isinstance(m, nn.Softmax2d) or getattr(m, "original_name", None) == "Softmax2d" else m.dim


class _SoftmaxDims(TorchFunctionMode):
    r"""Refuses, in a call of a pipeline, a softmax layer whose dim resolves to 0 on its input.

    ``Softmax(dim=-2)`` on rows of features, or ``Softmax()`` (dim chosen from the
    input's number of dimensions) on a 3-D input, normalizes across the batch,
    which micro-batches would cut. Which it is shows only once the layer sees its
    input: in the first call of each input signature this mode is active inside
    those layers' forwards (:meth:`inside`), where it looks at every softmax of
    the functional API they call, and through the whole of every trace of a
    compiler, or call of compiled stages (dynamo and ``torch.export`` run the
    mode's check on the traced shapes; nothing of it enters the graph). Only on
    tensors that may hold the batch along dimension 0: not a parameter (a
    softmax over learned mixing weights), nor one with fewer rows than a
    micro-batch has samples (``smallest``; ``None`` while a compiler traces a
    dynamic batch size: then those whose dimension 0 is symbolic, which only
    sizes derived from the batch are -- comparing sizes would add guards that
    break the dynamic dimension). And only the calls the stock layers make
    (``_stacklevel=5``, where the functional API's own default is 3), unless a
    listed layer's class has a ``forward`` of its own: a softmax of the
    functional API elsewhere in a stage (over a vector of mixing weights
    computed from a parameter) is not one of the layers', whatever its dim.
    """

    _FUNCTIONS = frozenset((torch.nn.functional.softmax, torch.nn.functional.log_softmax,
                            torch.nn.functional.softmin))
    # (It changes no result: a graphed block called inside it may replay; see _streams.)
    _watches_only = True
    _STOCK_FORWARDS = frozenset(c.forward for c in _SOFTMAXES)

    def __init__(self, owner: ParallelSequential, plan: _Plan, layers: list[tuple[int, str, nn.Module]],
                 smallest: int | None, chunks: int) -> None:
        super().__init__()
        self.owner, self.plan, self.layers, self.smallest = owner, plan, layers, smallest
        self.chunks = chunks  # the call's (``owner.chunks`` may be set meanwhile: see ``_eager``)
        self.entered: list[nn.Module] = []  # the layers whose forward runs now, under inside()

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        r"""This mode, active only inside the listed layers' own forwards, this thread's calls of them.

        Entered and left by hooks on those layers: an active mode anywhere else
        in the call would turn off torch's fast paths (``nn.MultiheadAttention``'s
        in eval asks ``has_torch_function``), and the checked first call of a
        signature would differ by rounding from every later call. Only where
        such layers are (``_Plan.scoped``): a layer called through its
        ``.forward()`` runs no hooks, and is not checked there (elsewhere, the
        mode over the whole call sees it).
        """
        thread = threading.get_ident()
        entered = self.entered

        def enter(m: nn.Module, args: Any) -> None:
            if threading.get_ident() == thread:
                self.__enter__()
                entered.append(m)

        # (Run last among the layer's pre-hooks and first among its forward hooks, which run
        # even when the forward raises: the mode covers the layer's forward alone.)
        def leave(m: nn.Module, args: Any, output: Any) -> None:
            if threading.get_ident() == thread and entered and entered[-1] is m:
                entered.pop()
                self.__exit__(None, None, None)

        handles = []
        try:
            for m in {id(m): m for _, _, m in self.layers}.values():
                handles.append(m.register_forward_pre_hook(enter))
                handles.append(m.register_forward_hook(leave, prepend=True, always_call=True))
            yield
        finally:
            for h in handles:
                h.remove()
            while entered:  # (a hook's removal cannot leave the mode on this thread's stack)
                entered.pop()
                self.__exit__(None, None, None)

    def _batched(self, t: torch.Tensor) -> bool:
        r"""Whether ``t`` may hold the batch along dimension 0 (see the class)."""
        if isinstance(t, nn.Parameter) or not t.dim():
            return False
        rows = t.shape[0]
        return _symbolic(rows) if self.smallest is None else rows >= self.smallest

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in self._FUNCTIONS and args and isinstance(args[0], torch.Tensor) and self._batched(args[0]):
            written = kwargs.get("dim", args[1] if len(args) > 1 else None)
            ndim = args[0].dim()
            dim = (0 if ndim in (0, 1, 3) else 1) if written is None else written % max(ndim, 1)
            stock = kwargs.get("_stacklevel") == 5
            layers = [(i, q, m) for i, q, m in self.layers if _softmax_dim(m) == written
                      and (stock or type(m).forward not in self._STOCK_FORWARDS)
                      and (not self.entered or m is self.entered[-1])]
            if dim == 0 and layers:
                i, qual, m = layers[0]
                raise RuntimeError(
                    f"{type(self.owner).__name__}: stage {self.plan.names[i]!r} (index {i}) contains {qual!r} "
                    f"({type(m).__name__}({'' if isinstance(m, nn.Softmax2d) else f'dim={m.dim}'})), which on its "
                    f"{ndim}-D input normalizes along dimension 0, across the batch, so "
                    f"with chunks={self.chunks} the result would differ from running the whole batch. "
                    + ("Give it a batched 4-D input, or use nn.Softmax(dim=1) for the channels, or use "
                       "chunks=1; if what it " if isinstance(m, nn.Softmax2d) else
                       "Give it the non-negative dim it should normalize along, or use chunks=1; if what it ")
                    + "normalizes holds no batch (weights computed from a parameter), say so with "
                    f"`model.get_submodule({qual!r}).mixes_batch = False`.")
        return func(*args, **kwargs)


# ---------------------------------------------------------------- structures
# pytree takes apart tuples, lists and dicts of their exact classes (and OrderedDict,
# defaultdict, deque), namedtuples and the classes registered with it, but keeps any other
# subclass of tuple, list, dict or deque whole, as one leaf: split as such, every micro-batch would
# get the whole batch's tensors in it. The pipeline takes such a container apart as its base
# class (its items, then its instance attributes) and rebuilds it in its own class for each
# micro-batch and for the joined output, by calling the class on the items, as
# ``torch.nn.DataParallel``'s scatter and gather do. Only while the pipeline flattens a value
# (:func:`_flatten`): pytree itself, and so compilers and the caller, see it as before.


def _unregistered(leaf: Any) -> bool:
    r"""Whether a pytree leaf is a container pytree keeps whole (see above): not a namedtuple, which
    pytree takes apart unless told not to (a ``PackedSequence``), nor a ``torch.Size``, a shape."""
    return isinstance(leaf, (list, dict, deque)) or (isinstance(leaf, tuple) and type(leaf) is not torch.Size
                                                     and not pytree.is_namedtuple_instance(leaf))


def _any_unregistered(leaves: list[Any]) -> bool:
    # (A loop, isinstance first: a pipeline's calls of structured inputs flatten them several
    # times, where ``any(map(_unregistered, leaves))`` cost twice as much, 0.7 us for two tensors.)
    for leaf in leaves:
        if isinstance(leaf, _CONTAINERS) and _unregistered(leaf):
            return _looks_inside()
    return False


# Dynamo before torch 2.13 cannot read an object's ``__dict__`` (2.11 fails the trace at any use
# of it): while it compiles, a pipeline neither takes subclasses of containers apart, whose
# instance attributes it could not carry over, nor looks for tensors in objects' attributes --
# as before it did either: such containers are one value, and objects go whole to every
# micro-batch. (Eager calls, and other tracers, do both.)
_DYNAMO_READS_ATTRIBUTES = torch.__version__ >= (2, 13)


def _looks_inside() -> bool:
    r"""Whether this call may read objects' attributes (see above)."""
    return _DYNAMO_READS_ATTRIBUTES or not torch.compiler.is_compiling()


_CONTAINERS = (tuple, list, dict, deque)


class _AsBase:
    r"""A container pytree keeps whole, standing for it while :func:`_flatten` takes it apart: a node
    of pytree's (registered below) whose unflattening rebuilds the container itself."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _as_base_children(node: _AsBase) -> tuple[list[Any], Any]:
    v = node.value
    mapping = isinstance(v, dict)
    items = list(v.values()) if mapping else list(v)
    # (Instance attributes too: a batched mask kept on a list of tensors is split with them.)
    attributes = getattr(v, "__dict__", None) or {}
    return ([_exposed(c) for c in itertools.chain(items, attributes.values())],
            (type(v), tuple(v) if mapping else len(items), tuple(attributes)))


def _as_base_keyed(node: _AsBase) -> tuple[list[tuple[Any, Any]], Any]:
    children, context = _as_base_children(node)
    keys, names = context[1], context[2]
    paths = ([pytree.MappingKey(k) for k in keys] if isinstance(keys, tuple) else
             [pytree.SequenceKey(i) for i in range(keys)]) + [pytree.GetAttrKey(a) for a in names]
    return list(zip(paths, children)), context


def _rebuilt(children: list[Any], context: Any) -> Any:
    r"""The container :func:`_as_base_children` took apart, rebuilt in its class from ``children``."""
    cls, keys, names = context
    count = len(children) - len(names)
    items = children[:count]
    mapping = isinstance(keys, tuple)
    base = next(b.__name__ for b in (dict, list, deque, tuple) if issubclass(cls, b))
    try:
        value = cls(zip(keys, items)) if mapping else cls(items)
    except Exception as e:  # (a constructor of other arguments: said below, with the way out)
        why: str | None = f"which raised {type(e).__name__}: {e}"
    else:
        # (Checked: a constructor may well sort, convert or add items.)
        expected = list(itertools.chain.from_iterable(zip(keys, items))) if mapping else items
        held = (list(itertools.chain.from_iterable(value.items())) if mapping else list(value)
                ) if type(value) is cls else []
        why = None if len(held) == len(expected) and all(h is e for h, e in zip(held, expected)) else (
            f"which returned {_describe(value)}, not those items in that order")
    if why is not None:
        raise TypeError(
            f"{cls.__qualname__}, a subclass of {base} that torch.utils._pytree does not know, is taken apart "
            f"into micro-batches as a {base} and rebuilt for each by calling {cls.__name__}(items), as "
            f"torch.nn.DataParallel does, {why}. Register {cls.__name__} with "
            f"torch.utils._pytree.register_pytree_node to say how it is taken apart and rebuilt, or use chunks=1")
    for name, attribute in zip(names, children[count:]):
        value.__dict__[name] = attribute
    return value


pytree.register_pytree_node(_AsBase, _as_base_children, _rebuilt, flatten_with_keys_fn=_as_base_keyed,
                            serialized_type_name=f"{__name__}._AsBase")


# The pytree leaves of an input that go to every micro-batch whole, unlooked at (see ParallelSequential._split).
_PASSED_WHOLE = (torch.Tensor, *_BY_VALUE, nn.Module, type)
# The most items of a tuple, list or dict in an input's object that _split looks into for batched tensors
# (a batch's few tensors, a BatchEncoding's dict): a larger one is a table (a tokenizer's vocabulary).
_BATCH_HOLDERS = 256


def _register_hint(others: list[tuple[Any, ...]]) -> str:
    r"""How to let the pipeline take apart the class of the first of ``others`` (``(index, pytree leaf, ...)``),
    for errors."""
    if not others:
        return ""
    cls = type(others[0][1])
    how = (f"torch.utils._pytree.register_dataclass({cls.__name__})" if dataclasses.is_dataclass(cls) else
           f"torch.utils._pytree.register_pytree_node({cls.__name__}, ...)")
    return f" (register {cls.__qualname__} with {how}, so that it is taken apart and rebuilt for each micro-batch)"


def _exposed(value: Any) -> Any:
    r"""``value`` with the containers pytree keeps whole in it as :class:`_AsBase` nodes; itself where there are none."""
    if isinstance(value, torch.Tensor):
        return value
    leaves, spec = pytree.tree_flatten(value)
    return _marked(leaves, spec) if _any_unregistered(leaves) else value


def _marked(leaves: list[Any], spec: pytree.TreeSpec) -> Any:
    r"""The value of ``leaves`` and ``spec``, each container among the leaves that pytree keeps whole an :class:`_AsBase`."""
    return pytree.tree_unflatten([_AsBase(v) if _unregistered(v) else v for v in leaves], spec)


def _leaves(value: Any) -> list[Any]:
    r"""``_flatten(value)[0]``, without the spec: ``pytree.tree_leaves``, which makes none, where pytree keeps
    no container whole (a pipeline's calls on a dict of tensors read the leaves of their pieces several times)."""
    leaves = pytree.tree_leaves(value)
    return _flatten(value)[0] if _any_unregistered(leaves) else leaves


def _packed(value: Any) -> bool:
    r"""Whether ``value`` is a ``PackedSequence``: a leaf where the pipeline splits or joins, not a namedtuple of
    tensors, since its data and counts hold the sequences' time steps, not one row per sample."""
    return isinstance(value, nn.utils.rnn.PackedSequence)


def _flatten(value: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], pytree.TreeSpec]:
    r"""``pytree.tree_flatten(value)``, taking apart the containers pytree keeps whole too (see above):
    ``pytree.tree_unflatten`` of the spec rebuilds them."""
    leaves, spec = pytree.tree_flatten(value, is_leaf=is_leaf)
    if _any_unregistered(leaves):
        leaves, spec = pytree.tree_flatten(_marked(leaves, spec), is_leaf=is_leaf)
    return leaves, spec


class _Shared(NamedTuple):
    r"""Input tensors that share elements across micro-batches (see :func:`_across`), or a 0-dim one that every
    micro-batch gets whole, watched for writes."""

    # Where they are in the input: "input[0] and input[1]"; for a 0-dim tensor, what finds it (see _leaf_names).
    names: str | Callable[[], list[str]]
    versions: list[list[tuple[torch.Tensor, int]]]  # per micro-batch: each one's piece and its version at the split
    across: bool = True  # False: in the same micro-batches, but copied one by one (see _copied_together)
    whole: bool = False  # one 0-dim tensor, the same object in every micro-batch (see ParallelSequential._split)
    uncopied: str = ""  # where ``across`` is False: those of them handed on uncopied, leaves that require grad


def _leaf_names(value: Any, indices: Iterable[int]) -> list[str]:
    r"""Where leaves ``indices`` of ``value`` (an input, flattened by :func:`_flatten`) are in it: ``input[1]``."""
    paths = pytree.tree_flatten_with_path(_exposed(value))[0]
    return [f"input{pytree.keystr(paths[i][0])}" for i in indices]


class _Returned(NamedTuple):
    r"""A value's tensors (its pytree leaves) and their versions, as a stage returned it (see :func:`_returned`)."""

    leaves: list[Any]
    versions: list[int | None]
    spec: Any  # the value's structure; ``None`` for a tensor


def _returned(output: Any) -> _Returned:
    r"""``output``'s leaves and the version of each, as a stage returned it (see ``ParallelSequential._concat``).

    ``None`` for a leaf that is no tensor, or an inference tensor, which keeps no version.
    """
    leaves, spec = ([output], None) if isinstance(output, torch.Tensor) else _flatten(output)
    return _Returned(leaves, [t._version if isinstance(t, torch.Tensor) and not t.is_inference() else None
                              for t in leaves], spec)


def _aligned(other: _Returned, template: _Returned) -> list[Any] | None:
    r"""``other``'s leaves in the order of ``template``'s: by position where their structures are the
    same, after putting its dicts' keys in ``template``'s order where only that differs (see
    ``ParallelSequential._concat``); ``None`` where the structures differ otherwise."""
    if other.spec == template.spec:
        return other.leaves
    if other.spec is None or template.spec is None:
        return None
    value = _in_order_of(pytree.tree_unflatten(other.leaves, other.spec),
                         pytree.tree_unflatten(template.leaves, template.spec))
    leaves, spec = _flatten(value)
    return leaves if spec == template.spec else None


def _rewritten(returned: _Returned) -> list[int]:
    r"""The leaves of ``returned`` written in place since (their versions moved)."""
    return [i for i, (t, v) in enumerate(zip(returned.leaves, returned.versions)) if v is not None and t._version != v]


def _refuse_rewritten(returned: list[_Returned], pieces: list[Any]) -> None:
    r"""Raise where a micro-batch's output was written after the micro-batch returned it (see
    ``ParallelSequential._concat``; ``returned``: :func:`_returned` of each output as returned).

    A stage that writes its output into a buffer it keeps and returns a view
    of it (``self.buf[:n]``, an ``out=`` argument) returns a new view for each
    micro-batch, all over the same memory: the next micro-batch overwrites
    what the last returned before the outputs are joined. Views share their
    base's version counter, so the write shows. Where the later output holds
    other elements of that memory, or each is its own micro-batch's piece of
    the input (``nn.ReLU(inplace=True)`` as the only stage), it is another
    micro-batch's own. (A tensor every micro-batch returned alike is judged
    in ``_concat``.)
    """
    for m, r in enumerate(returned):
        rewritten = _rewritten(r)
        if not rewritten:
            continue
        # (Leaf i of each, in this one's order: dicts of the same keys may come in another order.
        # Structures that differ otherwise are refused by _concat.)
        flat = [_aligned(other, r) for other in returned]
        for i in rewritten:
            t = r.leaves[i]
            if all(other is not None and other[i] is t for other in flat):
                continue
            if any(flat[k] is not None and _overwrites(flat[k][i], pieces[k], t, pieces[m])
                   for k in range(m + 1, len(flat))):
                raise TypeError(
                    f"micro-batch {m}'s output (leaf {i}, {tuple(t.shape)}) was written after the stage returned "
                    f"it, by a later micro-batch: the stage (or a stage before it, whose output it passes on "
                    f"as it is) returns a view of memory it writes again at every call (a buffer it keeps, an "
                    f"out= argument), so the micro-batches' outputs overwrite one "
                    f"another. Return a new tensor from each call (e.g. .clone() it)")


def _writes_refused(t: torch.Tensor) -> bool:
    r"""Whether autograd refuses to write ``t`` in place: a leaf that requires grad, or a view of one
    (``leaf[:, :4]``, ``weight.t()``), as its ``check_inplace`` finds them."""
    return t.requires_grad and (t.is_leaf or t._base is not None and t._base.is_leaf)


def _strided_address(t: Any) -> int | None:
    r"""Where ``t``'s memory starts, for callers that read its elements' places from its offset and
    strides; ``None`` where it has no plain strided memory (not a tensor, another layout, a nested
    tensor, a fake tensor, a wrapper subclass).

    Unlike :func:`._streams._storage_address`, which gives ``0`` both for no memory and for memory
    at 0 (an empty or meta tensor's), ``None`` stands apart from ``0`` here; and a nested tensor,
    whose strides do not say where its elements lie, has none.
    """
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_nested or isinstance(t, _FakeTensor):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _one_view(column: Sequence[Any], sizes: list[int | None]) -> bool:
    r"""Whether ``column``, a leaf of every micro-batch's output, is one view of the same elements each
    time (``self.pos[:, :n]``, ``self.mask[:n, :n]``: a new view object of a buffer from each call) and
    not batched like the micro-batches: one tensor, as ``nn.Sequential`` returns it, not pieces to join.

    Views of one memory with as many rows as every micro-batch has samples (``self.q.expand(n, -1)``, or
    one row with ``chunks`` equal to the batch) are left to be concatenated: they may be batched. Not
    for tensors without plain memory, nor meta or fake ones (every one's memory is at 0), nor while a
    compiler traces, whose tensors keep no addresses.
    """
    first = column[0]
    # (Tracing asked before the shapes are compared: torch.jit.trace's sizes are tensors, whose
    # comparison in Python it warns of as a constant of the trace.)
    if (not isinstance(first, torch.Tensor) or type(first) not in (torch.Tensor, nn.Parameter) or _is_tracing()
            or any(not isinstance(t, torch.Tensor) or t.shape != first.shape for t in column[1:])
            or first.dim() and all(first.shape[0] == n for n in sizes) or first.is_meta):
        return False
    where = _strided_address(first)
    return bool(where) and all(
        type(t) is type(first) and t.dtype == first.dtype and _strided_address(t) == where
        and t.storage_offset() == first.storage_offset() and t.stride() == first.stride() for t in column[1:])


def _overwrites(later: Any, later_piece: Any, earlier: Any, earlier_piece: Any) -> bool:
    r"""Whether ``later``, a later micro-batch's output (of the input piece ``later_piece``), lies in
    memory of ``earlier``'s, an earlier one's: not where each is its own piece of the input."""
    return (not (_is_piece(earlier, earlier_piece) and _is_piece(later, later_piece))
            and _overlap(earlier, later))


def _is_piece(t: Any, piece: Any) -> bool:
    r"""Whether ``t`` is (a view of exactly) a tensor of the micro-batch ``piece`` of the input."""
    if not isinstance(t, torch.Tensor):
        return False
    where = _strided_address(t)
    return where is not None and any(
        isinstance(p, torch.Tensor) and _strided_address(p) == where and p.storage_offset() == t.storage_offset()
        and p.shape == t.shape and p.stride() == t.stride() for p in _leaves(piece))


def _shared(leaves: list[Any]) -> list[list[torch.Tensor]]:
    r"""The input tensors among ``leaves`` in sets linked by shared elements (see :func:`_sharing`); only sets of
    more than one. Tensors of memories of their own, the common case, cost one look at where it starts."""
    groups: dict[tuple[torch.device, int], dict[int, torch.Tensor]] = {}
    for t in leaves:
        # (Not meta tensors: every one's memory is at 0.)
        if isinstance(t, torch.Tensor) and type(t) is torch.Tensor and t.dim() and t.numel() and not t.is_meta:
            where = _strided_address(t)
            if where is not None:
                groups.setdefault((t.device, where), {})[id(t)] = t  # (a tensor passed twice, once)
    return [members for group in groups.values() if len(group) > 1 for members in _sharing(list(group.values()))]


def _across(members: list[torch.Tensor], chunks: int) -> bool:
    r"""Whether two of ``members`` share an element in different micro-batches (``(x[:-1], x[1:])``).

    Micro-batching takes a sample's rows to be its own: written by a stage on
    its micro-batch, they are read by no other. Here a micro-batch's stage
    would write what another micro-batch reads through the other tensor (or
    has read already), where nn.Sequential runs each stage on the whole batch
    once: no copy can give nn.Sequential's result (see ``ParallelSequential._split``).
    """
    cut = [t.tensor_split(chunks) for t in members]
    return any(_overlap(p, q) for a, b in itertools.combinations(cut, 2)
               for i, p in enumerate(a) for j, q in enumerate(b) if i != j)


def _copied_together(sets: list[list[torch.Tensor]], chunks: int) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    r"""The micro-batches of input tensors that share elements (``sets``, see :func:`_shared`), as copies that
    share them too: (tensor, pieces).

    While autograd records, each micro-batch of a tensor is a copy of its own
    (see ``ParallelSequential._split``). Copied one by one, tensors that are
    views of one tensor's elements (``(x, x[:, :2])``, ``{"x": x, "flat":
    x.flatten(1)}``) would lose their link: a stage writing one in place
    (``a.relu_()``) would leave the other as it was, where in nn.Sequential it
    sees the write. Here each micro-batch of one tensor that holds them all
    (one of them, the tensor they are views of, or that tensor's memory they
    span with their batch first: see :func:`_batch_first`), its elements
    holding theirs, is copied, and theirs are cut from that copy with their own sizes
    and strides. Autograd carries their gradients to it, so those that record
    autograd must be views of the tensor it is or is a view of; one taken
    without autograd (``x.detach()[:, :2]``) is cut from a detached copy.
    Tensors of one memory that share no element (``q, k = qk.chunk(2, -1)``)
    and any others are left to be copied one by one: a write to one cannot
    show in another. (Among those, tensors that share elements across
    micro-batches, which no holder holds, are watched for writes instead: see
    :func:`_across`.)
    """
    copies: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    for members in sets:
        bases = {id(t._base): t._base for t in members if t._base is not None}
        # Last, the members' span of their base's memory with the batch first (built only where
        # the others fail): views of a tensor whose batch is not its base's dimension 0,
        # ``(x[:, :-1], x[:, 1:])`` of ``x = h.transpose(0, 1)``, which neither they nor the base hold.
        batch_first = (h for h in map(_batch_first, bases.values(), itertools.repeat(members)) if h is not None)
        for holder in itertools.chain(sorted(members, key=lambda t: -t.numel()), bases.values(), batch_first):
            if _holds(holder, members, chunks):
                cut = holder.tensor_split(chunks)
                pieces = [p.clone() for p in cut]
                for t in members:
                    copies.append((t, pieces if t is holder else [
                        _read_as(_cut(c if t.requires_grad else c.detach(), p, _position(p, h)),  # type: ignore[arg-type]
                                 t, holder)
                        for c, p, h in zip(pieces, t.tensor_split(chunks), cut)]))
                break
    return copies


def _batch_first(base: torch.Tensor, members: list[torch.Tensor]) -> torch.Tensor | None:
    r"""A view of ``base``'s memory that may hold ``members`` (see :func:`_holds`), views of it, with their batch
    along its dimension 0: ``base`` with the dimension that steps through the members' batch (or the part of
    one that does) moved first, cut to the span of the members' elements along the others (so that no more
    than needed is copied); ``None`` where no dimension of ``base`` steps through their batch, or where
    ``base``'s elements are not each named by one index (see :func:`_position`)."""
    batch, stride = members[0].shape[0], members[0].stride(0)
    if any(t.shape[0] != batch or (batch > 1 and t.stride(0) != stride) for t in members):
        return None
    if batch == 1:
        found = [(d, 1, 1) for d, n in enumerate(base.shape) if n == 1]
    else:
        # (A dimension of the base may step through the batch with others: ``h[:T * B].view(T, B,
        # D)`` of a base ``h`` of T * B rows or more, whose dimension of rows is split into T and
        # B, the rows past T * B left out.)
        found = [(d, n // (stride // st * batch), stride // st)
                 for d, (n, st) in enumerate(zip(base.shape, base.stride()))
                 if 0 < st <= stride and stride % st == 0 and n >= stride // st * batch]
    if not found:
        return None
    d, outer, inner = found[0]
    if outer == inner == 1:
        holder = base.movedim(d, 0)
    else:
        st = base.stride(d)
        holder = base.as_strided((*base.shape[:d], outer, batch, inner, *base.shape[d + 1:]),
                                 (*base.stride()[:d], st * inner * batch, st * inner, st, *base.stride()[d + 1:]),
                                 base.storage_offset()).movedim(d + 1, 0)
    dims = _dims(holder)
    if dims and not dims[-1][0]:
        return None  # (an expanded base, x.expand(...).detach(): one element has many indices)
    # Each member's first and last elements bound its others' indices in every dimension of the
    # holder: the steps between them are sums of the holder's strides, none negative. (Where
    # the holder's elements are not each named by one index, _holds refuses it below.)
    ends = []
    for t in members:
        first = t.storage_offset() - holder.storage_offset()
        bounds = [_index(offset, dims, holder.dim()) for offset in (first, first + _extent(t))]
        if any(i is None or not all(0 <= j < n for j, n in zip(i, holder.shape)) for i in bounds) or bounds[0][0]:
            return None
        ends.append(bounds)
    for d in range(1, holder.dim()):
        low = min(start[d] for start, _ in ends)
        holder = holder.narrow(d, low, max(end[d] for _, end in ends) + 1 - low)
    return holder


def _sharing(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    r"""``tensors`` (of one memory) in sets linked by shared elements; only sets of more than one."""
    sets = [[t] for t in tensors]
    merged = True
    while merged:
        merged = False
        for i, j in itertools.combinations(range(len(sets)), 2):
            if any(_overlap(a, b) for a in sets[i] for b in sets[j]):
                sets[i] += sets.pop(j)
                merged = True
                break
    return [s for s in sets if len(s) > 1]


def _holds(holder: torch.Tensor, members: list[torch.Tensor], chunks: int) -> bool:
    r"""Whether each micro-batch of ``members`` is cut from a copy of ``holder``'s (see :func:`_copied_together`)."""
    if not holder.dim() or any(t.dtype != holder.dtype for t in members):
        return False
    root = holder if holder._base is None else holder._base
    if any(t.requires_grad and not (holder.requires_grad and t._base is root) for t in members if t is not holder):
        return False  # (their gradients would not reach them through the holder's copy)
    # Each micro-batch of every member must lie in the holder's, element for element. (Not only where
    # the holder is contiguous: a channels_last or column-major batch and its views, (x, x[:, :3]),
    # were copied one by one, and a write through one no longer showed in the other.)
    held = holder.tensor_split(chunks)
    return all(_position(p, h) is not None for t in members if t is not holder
               for p, h in zip(t.tensor_split(chunks), held))


def _position(inner: torch.Tensor, outer: torch.Tensor) -> int | tuple[list[int], list[list[int]]] | None:
    r"""Where ``inner``, of ``outer``'s memory, lies among ``outer``'s elements, for :func:`_cut`; ``None``
    where some element of ``inner`` is not one of ``outer``'s (or that is not shown: see below).

    Where ``outer`` fills its memory (non-overlapping and dense, as a contiguous or channels_last
    tensor and its micro-batches are), ``inner``'s offset from ``outer``'s first element: a copy of
    ``outer`` keeps its strides (``torch.preserve_format``), and ``inner`` is cut from it with its own,
    however they walk ``outer``'s dimensions (``x.flatten(1)`` of ``x``, one of its dimensions
    crossing two of ``x``'s). Otherwise the index of its first element in ``outer``, and for each of
    its dimensions the step that dimension takes there, with which ``inner`` is cut from a copy of
    ``outer`` whatever the copy's layout. ``outer``'s dimensions, largest stride first, give each of
    its elements one index where each stride steps past all the elements of the smaller ones (as any
    layout permuted or sliced from a contiguous one does; others are taken as not holding ``inner``).
    """
    dims = _dims(outer)
    reach, dense = 1, True
    for stride, d in reversed(dims):
        if stride < reach:
            return None  # (elements one index does not name: overlapping, or interleaved)
        dense = dense and stride == reach
        reach += stride * (outer.shape[d] - 1)
    first = inner.storage_offset() - outer.storage_offset()
    if dense:
        # (Strides are never negative: the first and last elements bound the others.)
        last = first + _extent(inner)
        return first if 0 <= first and last < outer.numel() else None

    start = _index(first, dims, outer.dim())
    if start is None or min(start) < 0:
        return None
    steps, last_index = [], start
    for size, stride in zip(inner.shape, inner.stride()):
        step = _index(stride, dims, outer.dim()) if size > 1 else [0] * outer.dim()
        if step is None:
            return None
        steps.append(step)
        last_index = [i + (size - 1) * s for i, s in zip(last_index, step)]
    return (start, steps) if all(i < n for i, n in zip(last_index, outer.shape)) else None


def _dims(t: torch.Tensor) -> list[tuple[int, int]]:
    r"""``t``'s (stride, dimension) pairs, for its dimensions of more than one element, largest stride first."""
    return sorted(((st, d) for d, (n, st) in enumerate(zip(t.shape, t.stride())) if n > 1), reverse=True)


def _extent(t: torch.Tensor) -> int:
    r"""How many elements of memory past ``t``'s first its last lies (strides are never negative)."""
    return sum(max(n - 1, 0) * st for n, st in zip(t.shape, t.stride()))


def _index(offset: int, dims: list[tuple[int, int]], rank: int) -> list[int] | None:
    r"""The index of the element ``offset`` past the first of a tensor of ``rank`` dimensions whose
    :func:`_dims` are ``dims``; ``None`` where no element lies there."""
    found = [0] * rank
    for stride, d in dims:
        found[d], offset = divmod(offset, stride)
    return found if offset == 0 else None


def _cut(copy: torch.Tensor, inner: torch.Tensor, position: int | tuple[list[int], list[list[int]]]) -> torch.Tensor:
    r"""``inner``'s elements in ``copy``, a copy (from offset 0) of the tensor ``position`` places it in (see
    :func:`_position`): one made by ``clone()``, which keeps the strides of a tensor that fills its memory."""
    if isinstance(position, int):
        return copy.as_strided(inner.shape, inner.stride(), position)
    start, steps = position
    return copy.as_strided(inner.shape, [sum(s * st for s, st in zip(step, copy.stride())) for step in steps],
                           sum(i * st for i, st in zip(start, copy.stride())))


def _read_as(cut: torch.Tensor, member: torch.Tensor, holder: torch.Tensor) -> torch.Tensor:
    r"""``cut``, ``member``'s elements in a copy of ``holder``'s, read as ``member`` reads their memory.

    A conjugate or negative view (``x.conj()``, ``z.conj().imag``) reads its
    memory flipped, and ``clone()`` writes what a tensor reads, with no flag
    of its own: cut alike from the copy, ``(x, x.conj())`` gave the second
    ``x``'s values. Where ``member``'s flag differs from ``holder``'s, the
    cut is flipped by a view of its own (still of the copy: a stage's write
    through either shows in the other, as in nn.Sequential).
    """
    if member.is_conj() != holder.is_conj():
        cut = cut.conj()
    if member.is_neg() != holder.is_neg():
        cut = torch._neg_view(cut)
    return cut


def _overlap(a: Any, b: Any) -> bool:
    r"""Whether tensors ``a`` and ``b`` share memory: an element of one storage that both reach.

    Run only where a version moved (a write). Spans that meet are tested
    exactly (pieces of a transposed tensor interleave without sharing any
    element), from their layouts alone (see :func:`_layouts_meet`).
    """
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or not a.numel() or not b.numel():
        return False
    where = _strided_address(a)
    if where is None or where != _strided_address(b):
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        start = t.storage_offset() * t.element_size()
        return start, start + (sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    if not (a0 < b1 and b0 < a1):
        return False
    if a.element_size() != b.element_size():
        return True  # (views of one memory as two dtypes: taken to share)
    # Element i of ``a`` and j of ``b`` lie at one offset where the offsets' difference
    # is sum(j_d * stride_d) over b's dims minus sum(i_d * stride_d) over a's.
    steps: dict[int, list[int]] = {}
    for shape, strides, sign in ((a.shape, a.stride(), -1), (b.shape, b.stride(), 1)):
        for n, stride in zip(shape, strides):
            if n > 1 and stride:
                low, high = steps.setdefault(stride, [0, 0])
                steps[stride] = [low + min(0, sign * (n - 1)), high + max(0, sign * (n - 1))]
    dims = tuple(sorted(((st, lo, hi) for st, (lo, hi) in steps.items()), reverse=True))
    return _layouts_meet(a.storage_offset() - b.storage_offset(), dims)


@functools.lru_cache(maxsize=1024)
def _layouts_meet(difference: int, dims: tuple[tuple[int, int, int], ...], budget: int = 4096) -> bool:
    r"""Whether ``difference == sum(k * stride)`` for some ``lo <= k <= hi`` per ``(stride, lo, hi)`` of
    ``dims`` (largest stride first): whether two layouts reach one element (see :func:`_overlap`).

    A depth-first search from the largest stride down, each level trying only
    the multiples that the smaller strides can still make up: within the
    range they reach, and in the one residue class modulo their greatest
    common divisor that can (views of one tensor take a step or two; two
    layouts of different parities none). Past ``budget`` multiples tried the
    layouts are taken to meet. The same layouts come back at every call of
    a pipeline: answers are kept (ints only).
    """
    n = len(dims)
    if not n:
        return difference == 0
    # Below each level: the least and greatest sums the smaller strides reach, and their gcd.
    low, high, divisor = [0] * (n + 1), [0] * (n + 1), [0] * (n + 1)
    for level in range(n - 1, -1, -1):
        stride, lo, hi = dims[level]
        low[level], high[level] = low[level + 1] + stride * lo, high[level + 1] + stride * hi
        divisor[level] = math.gcd(divisor[level + 1], stride)
    if difference % divisor[0] or not low[0] <= difference <= high[0]:
        return False

    def multiples(level: int, rest: int) -> Iterator[int]:
        stride, lo, hi = dims[level]
        first = max(lo, -((high[level + 1] - rest) // stride))  # ceil((rest - high) / stride)
        last = min(hi, (rest - low[level + 1]) // stride)
        below = divisor[level + 1]
        if not below:
            return iter(range(last, first - 1, -1))
        common = math.gcd(stride, below)
        if rest % common:
            return iter(())
        step = below // common  # k * stride = rest (mod below): k in one class modulo step
        k0 = (rest // common) * pow(stride // common, -1, step) % step if step > 1 else 0
        last -= (last - k0) % step
        return iter(range(last, first - 1, -step))

    stack = [(0, difference, multiples(0, difference))]
    while stack:
        level, rest, ks = stack[-1]
        k = next(ks, None)
        if k is None:
            stack.pop()
            continue
        budget -= 1
        if budget < 0:
            return True
        left = rest - k * dims[level][0]
        if level + 1 == n:
            if left == 0:
                return True
        else:
            stack.append((level + 1, left, multiples(level + 1, left)))
    return False


def _signature_dims(input: Any) -> Hashable:
    r"""The numbers of dimensions of ``input``'s tensors, and its structure (which key holds which): what
    decides which dim a softmax layer reads."""
    if isinstance(input, torch.Tensor):
        return (input.dim(),)
    leaves, spec = _flatten(input)
    return spec, tuple(t.dim() if isinstance(t, torch.Tensor) else None for t in leaves)


def _symbolic_batch(input: Any) -> bool:
    r"""Whether a compiler traces ``input`` with a dynamic batch size (a ``SymInt`` dimension 0)."""
    return _symbolic(_batch_size(input))


def _batch_size(piece: Any) -> int | None:
    r"""The number of samples in a micro-batch: dimension 0 of its first batched tensor (an int under
    ``torch.jit.trace`` too, for the checks that read it: see :func:`_size`)."""
    if isinstance(piece, torch.Tensor):
        return _size(piece)
    return next((_size(t) for t in _leaves(piece) if isinstance(t, torch.Tensor) and t.dim()), None)


# The containers of the input that a stage could change in place, rebuilt for each micro-batch (by
# pytree, or, for their subclasses, see _flatten). Tuples cannot be changed.
_CHANGEABLE = (dict, list, deque)


class _Held(NamedTuple):
    r"""A list or dict of a micro-batch of the input, and what it held when the first stage got it."""

    path: tuple[Any, ...]  # the keys and indices that lead to it from the input
    container: Any
    keys: list[Any] | None  # a dict's keys, in order; ``None`` for a list or deque
    values: list[Any]


def _containers(value: Any) -> list[_Held]:
    r"""The lists, dicts and deques in ``value`` (a micro-batch of the input), with what each holds now."""
    found: list[_Held] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, _CHANGEABLE):
            if isinstance(v, dict):
                found.append(_Held(path, v, list(v), list(v.values())))
                stack.extend((path + (k,), item) for k, item in v.items())
            else:
                found.append(_Held(path, v, None, list(v)))
                stack.extend((path + (i,), item) for i, item in enumerate(v))
        elif isinstance(v, tuple):  # (a namedtuple too: it holds containers that can change)
            stack.extend((path + (i,), item) for i, item in enumerate(v))
    return found


def _change(held: _Held) -> str | None:
    r"""How ``held.container`` changed since (keys or items added, removed or replaced); ``None``: it did not."""
    c = held.container
    now = list(c) if held.keys is not None else None
    values = list(c.values()) if held.keys is not None else list(c)
    if (len(values) == len(held.values) and all(a is b for a, b in zip(values, held.values))
            and (now is None or all(a is b for a, b in zip(now, held.keys or ())))):
        return None
    if held.keys is not None and now is not None:
        added = [k for k in now if k not in held.keys]
        removed = [k for k in held.keys if k not in now]
        replaced = [k for k, v in c.items() if k in held.keys and v is not held.values[held.keys.index(k)]]
        what = [f"the keys {keys!r} {label}" for label, keys in (("added", added), ("removed", removed),
                                                                  ("given new values", replaced)) if keys]
        return ", ".join(what) or "its keys reordered"
    if len(values) != len(held.values):
        return f"{len(values)} items where it came with {len(held.values)}"
    return f"the items {[i for i, (a, b) in enumerate(zip(values, held.values)) if a is not b]} replaced"


def _where(path: tuple[Any, ...]) -> str:
    r"""``path`` as the expression that reads it from the input: ``input['cache'][0]``."""
    return "input" + "".join(f"[{key!r}]" for key in path)


# Sequence layers: batch-first, they read a 3-D input as a batch and a 2-D one as one unbatched
# sequence; batch-second (``batch_first=False``), dimension 0 as the sequence.
_SEQUENCE_LAYERS = (nn.RNNBase, nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
                    nn.Transformer)
# The names TorchScript modules made from them keep (see _NORMS_BY_NAME): a scripted one keeps
# ``batch_first`` too (a traced one does not, and is not seen).
_SEQUENCE_NAMES = frozenset(cls.__name__ for cls in (nn.RNN, nn.LSTM, nn.GRU, *_SEQUENCE_LAYERS[1:]))


@contextlib.contextmanager
def _unbatched_refused(owner: ParallelSequential, plan: _Plan, layers: list[tuple[int, str, nn.Module]],
                       batch: int, chunks: int) -> Iterator[None]:
    r"""Refuse, while active (a pipeline's first call of an input signature), a sequence layer given an unbatched input.

    A batch-first layer (``batch_first=False`` ones are refused whatever they
    get: see ``_mixing_error``) reads a 2-D input as one sequence, its rows the
    steps: micro-batches along dimension 0 would cut the sequence. Seen only
    when the layer gets its input, by a pre-hook on this thread's calls; only
    an input with a micro-batch's rows (of the ``batch`` samples), which is
    one: a stage may well call the layer on each sample's own sequence.
    """
    thread = threading.get_ident()
    rows = {batch // chunks + (batch % chunks > 0), batch // chunks}
    where = {id(m): (i, qual) for i, qual, m in layers}

    def check(m: nn.Module, args: tuple, kwargs: dict) -> None:
        if threading.get_ident() != thread:
            return
        first = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(first, torch.Tensor) and first.dim() == 2 and first.shape[0] in rows:
            i, qual = where[id(m)]
            raise RuntimeError(
                f"{type(owner).__name__}: stage {plan.names[i]!r} (index {i}) contains {qual!r} "
                f"({type(m).__name__}, batch_first=True), given a 2-D input {tuple(first.shape)} (of a "
                f"micro-batch): it reads one unbatched sequence, its rows the steps, which chunks={chunks} "
                f"cuts along dimension 0 into shorter sequences, and the result would differ from running the "
                f"whole batch. Give it batched 3-D inputs (batch, sequence, features), or use chunks=1; if the "
                f"stage runs it on "
                f"each sample's own sequence, say so with `model.get_submodule({qual!r}).mixes_batch = False`.")

    handles = []
    try:
        # (Registered inside the ``try``: one failing, or an interrupt between two, must not leave
        # the hooks already on the user's layers.)
        for m in {id(m): m for _, _, m in layers}.values():
            handles.append(m.register_forward_pre_hook(check, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def _batch_second(m: nn.Module) -> bool:
    r"""Whether ``m`` takes its batch along dimension 1 (``batch_first=False``): split along dimension 0, its input is split along its sequence."""
    return (isinstance(m, _SEQUENCE_LAYERS) or _made_from(m, _SEQUENCE_NAMES)) and not getattr(m, "batch_first", True)


def _returning(stage: nn.Module) -> nn.Module:
    r"""The module whose result ``stage`` returns: itself, or the last of the ``nn.Sequential``
    containers it ends in (a nested pipeline too, or one made a TorchScript module; a compiled
    module returns what the module it compiled does)."""
    while True:
        stage = _uncompiled(stage)
        if not ((_in_turn(stage) or _scripted_in_turn(stage)) and len(stage._modules)):
            return stage
        # (Through ``_modules``: indexing a TorchScript container returns the module it was
        # made from, not the TorchScript module that runs.)
        stage = list(stage._modules.values())[-1]


def _stock_parallel(m: nn.Module) -> Parallel | None:
    r"""The ``Parallel`` whose result ``m`` returns (see :func:`_returning`), unless its class has a forward of
    its own."""
    m = _returning(m)
    return m if isinstance(m, Parallel) and type(m).forward is Parallel.forward else None


def _parts(m: Parallel, output: Any) -> list[Any]:
    r"""What of ``output``, ``m``'s result, each branch returned: its own item where ``m`` returns them apart
    (``"tuple"``, ``"dict"``), else the whole (``"sum"``, ``"mean"``, ``"cat"``, ``"stack"`` join each leaf
    with the others' in its place)."""
    names = list(m._modules)
    if m.join == "tuple" and isinstance(output, tuple) and len(output) == len(names):
        return list(output)
    if m.join == "dict" and isinstance(output, dict) and list(output) == names:
        return [output[name] for name in names]
    return [output] * len(names)


def _stacked_on_batch(m: Parallel, output: Any, stacked: int = 0) -> Parallel | None:
    r"""The ``Parallel`` in ``m``'s result stacking branches along dimension 0, where the batch is, or ``None``.

    ``m`` itself, or one whose result one of its branches returns, which every
    join but a callable's passes on (``"sum"``, ``"mean"``, ``"cat"`` keep the
    batch where the branch put it, a ``"stack"`` shifts it by one, and a join
    returning the outputs apart keeps each); ``output``: what ``m`` returned,
    on whose tensors' ranks a negative ``dim`` resolves (each branch's own,
    where ``m`` returns them apart: another's rank would resolve it wrongly),
    less the ``"stack"`` joins above it (``stacked``).
    """
    join, dim = m.join, m.dim
    if join is not None and not isinstance(join, str):
        return None  # (a callable: whatever it makes of the branches' outputs)
    if join == "stack":
        if any(r > stacked and dim % (r - stacked) == 0
               for r in (t.dim() for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor))):
            return m
        stacked += 1
    for branch, part in zip(m, _parts(m, output)):
        inner = _stock_parallel(branch)
        found = inner is not None and _stacked_on_batch(inner, part, stacked)
        if found:
            return found
    return None


_RECURRENT_FORWARDS = frozenset((nn.RNN.forward, nn.LSTM.forward, nn.GRU.forward))
# The names a TorchScript module made from a stock recurrent layer keeps (see _NORMS_BY_NAME).
_RECURRENT_NAMES = frozenset(cls.__name__ for cls in (nn.RNN, nn.LSTM, nn.GRU))


def _layout(m: nn.Module) -> tuple[int, int] | None:
    r"""``(rank, dim)`` of the final hidden states ``m`` returns as a recurrent layer does (``None``: it does not):
    where those of a last stage returning ``(output, h_n)`` or ``(output, (h_n, c_n))`` hold the batch.

    ``(3, 1)`` for a recurrent layer, and for a ``Parallel`` of branches that
    return them alike (recurrent layers, ``Parallel`` blocks of them) joined by
    ``"sum"``, ``"mean"`` or ``"cat"``, which keep each leaf's dimensions; a
    ``"stack"`` adds one, before or after the batch's. Such a ``Parallel``
    returning its branches' results apart, or joining them with branches that
    return them otherwise, is refused: its leaves hold the batch in different
    places. (One stacking its branches along dimension 0, where the batch
    is, was refused as the stage returned it: see ``_refuse_stacked``. A
    callable join returns what it makes of them: hidden states, batch-first,
    as any custom last stage's.)
    """
    m = _returning(m)
    if isinstance(m, nn.RNNBase):
        # (Not a subclass with a forward of its own, which may return anything: a recurrent
        # layer's too, whose hidden states the README asks to return batch-first.)
        return (3, 1) if type(m).forward in _RECURRENT_FORWARDS else None
    if isinstance(m, torch.jit.ScriptModule):
        # One made from a recurrent layer (torch.jit.trace: it is of another class, and keeps the
        # layer's name) returns the layer's results: hidden states batched along dimension 1,
        # whatever batch_first was. (Joined along 0 they were wrong, silently where the layers
        # equal a micro-batch's samples: chunks equal to the batch, one layer.)
        return (3, 1) if getattr(m, "original_name", None) in _RECURRENT_NAMES else None
    if not (isinstance(m, Parallel) and type(m).forward is Parallel.forward):
        return None
    join, dim = m.join, m.dim
    apart = join in (None, "tuple", "dict")
    if not apart and not isinstance(join, str):
        return None
    layouts = [_layout(b) for b in m]
    if all(layout is None for layout in layouts):
        return None
    if apart or len(set(layouts)) > 1:
        what = "returning its branches' outputs apart" if apart else f"joining by {join!r} branches that differ"
        raise TypeError(f"the last stage is a Parallel {what}, some ending in a recurrent layer, whose hidden "
                        f"states hold the batch along dimension 1: joined along dimension 0 they would be wrong "
                        f"(end each such branch in a module returning them batch-first, h.transpose(0, 1))")
    rank, batch = layouts[0]
    if join == "cat" and (rank, batch) == (3, 1) and dim % rank in (0, 1):
        # (Refused below too, as rows not batched like the micro-batches: said here as the fix it needs.)
        what = "batch-first outputs" if dim % rank == 0 else "final hidden states"
        raise TypeError(f"the last stage is a Parallel joining recurrent branches by 'cat' along dimension {dim}, "
                        f"where their {what} hold the batch: the whole batch's result has one branch's samples "
                        f"after another's, which micro-batches joined cannot give. Join along the features "
                        f"(dim=-1)")
    if join != "stack":
        return rank, batch
    return rank + 1, batch + (dim % (rank + 1) <= batch)  # (the new dimension before the batch's, or after)


class ParallelSequential(nn.Sequential):
    r"""A :class:`torch.nn.Sequential` whose stages run as a pipeline over micro-batches.

    ``ParallelSequential(encoder, decoder, chunks=4)(x)`` splits ``x`` along
    dimension 0 into 4 micro-batches, runs each through ``encoder`` then
    ``decoder``, and concatenates the outputs along dimension 0, giving the
    result of ``decoder(encoder(x))`` for stages that treat samples
    independently. On a CUDA device every stage runs on a side stream of its
    own and starts a micro-batch as soon as the previous stage has finished
    it (an event per micro-batch and stage), so while the decoder works on
    micro-batch ``m`` the encoder already computes ``m + 1``. Side streams fork
    from the caller's current stream and join back into it before the output
    is returned (the last stage's stream writes each micro-batch's output into
    the concatenated result as it finishes), so the module works inside
    ``torch.cuda.stream(s)`` like any other.

    Micro-batches follow :func:`torch.tensor_split`: exactly ``chunks`` pieces
    whose sizes differ by at most one, larger pieces first (a batch of 13 in
    3 chunks gives 5, 4, 4). Inputs may be a tensor or a (nested) tuple, list
    or dict of tensors that all share the batch size along dimension 0 (or
    a namedtuple, a class registered with :mod:`torch.utils._pytree`, or a
    subclass of tuple, list or dict, rebuilt in its class for each piece;
    non-tensor leaves are passed to every piece as they are, but an object
    holding tensors batched along dimension 0 that pytree cannot take apart
    is refused; each piece gets lists and dicts of its own, which a stage may
    not change in place). As in
    :class:`torch.nn.Sequential`, each stage receives the previous stage's
    output as its single argument. A last stage ending in a recurrent layer
    (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``, alone or last in an
    ``nn.Sequential`` or a nested ``ParallelSequential``) returns its final hidden states as that layer does:
    joined along their batch dimension, 1.

    A CPU input to a module whose parameters live on a CUDA device is copied
    micro-batch by micro-batch on a copy stream, through pinned memory and
    non-blocking, so the copy of micro-batch ``m + 1`` overlaps the compute of
    micro-batch ``m``; the result equals moving the whole input first.

    With ``chunks=1`` the module is an ordinary :class:`torch.nn.Sequential`
    and costs the same. On the CPU, or while ``torch.compile``/
    ``torch.export`` trace the model, micro-batches run one after the other,
    with the results of the stages applied to each micro-batch (equal to the
    whole batch's up to rounding: a smaller batch may pick another kernel, or
    sum in another order). Stages drawing random numbers (dropout in training)
    draw them for one micro-batch at a time, so their masks are not the ones
    :class:`torch.nn.Sequential` draws for the same seed, though from the same
    distribution; ``chunks=1`` draws those. Indexing, slicing (which keeps ``chunks``),
    ``append`` and the state dict are those of :class:`torch.nn.Sequential`,
    except that appending where the next index names a stage kept (a slice
    keeps its stages' names) raises, where ``nn.Sequential`` replaces that
    stage.

    Args:
        *stages: modules to run in order, or a single ``OrderedDict`` mapping
            names to them.
        chunks: number of micro-batches per call, at least 1 and at most the
            batch size. Default: ``1``.
        cuda_graph: capture the whole forward pass (all stages, all
            micro-batches, every stream) once per input signature and replay
            it; as :class:`~parallel_modules.Parallel`'s ``cuda_graph``, whose
            capture rules apply. A CPU input to stages on a CUDA device is
            copied eagerly (the copies read new host memory every call), and
            each stage's work on a micro-batch is replayed from a graph of
            that stage; calls that record autograd then run eagerly.
            Default: ``False``.
        max_graphs: graphs kept, least recently used freed first. Default: ``8``.
        static_outputs: return the graph's own output buffers (overwritten by
            the next call) instead of fresh tensors. Default: ``False``.
        graph_fallback: when a signature cannot be captured, warn once and run
            it eagerly instead of raising. Default: ``False``.
        direct_grads: with ``cuda_graph=True`` in training, take the
            parameters out of autograd's graph, the backward replay handing
            their gradients to ``.grad`` itself; as
            :class:`~parallel_modules.Parallel`'s ``direct_grads``. Default:
            ``False``.
        compile: compile each stage on its own, at its first call (micro-batch
            shapes included), and run it under this module's streams and graph;
            as :class:`~parallel_modules.Parallel`'s ``compile``. Default: ``None``.
        compile_options: as :class:`~parallel_modules.Parallel`'s. Default: ``None``.
        compile_fallback: warn once and run a stage that fails to compile
            eagerly instead of raising.
            ``compile``, ``compile_options`` and ``compile_fallback`` are fixed
            once the module is built: setting one raises ``AttributeError``.
            Default: ``False``.

    Example::

        >>> encoder = nn.Sequential(nn.Conv2d(3, 64, 3, stride=2, padding=1), nn.ReLU())
        >>> decoder = nn.Sequential(nn.ConvTranspose2d(64, 10, 2, stride=2))
        >>> model = ParallelSequential(encoder, decoder, chunks=4).cuda().eval()  # needs a CUDA GPU
        >>> images = torch.randn(8, 3, 256, 256).pin_memory()
        >>> model(images).shape  # copied and computed in 4 overlapping micro-batches
        torch.Size([8, 10, 256, 256])

    .. warning::
        With ``cuda_graph=True`` the rules of :class:`~parallel_modules.Parallel`'s
        capture apply to every stage: shapes static per input signature (the
        micro-batch shapes included, so a batch of another size is another
        signature), no host synchronisation (``.item()``, ``.cpu()``,
        ``torch.cuda.synchronize()``) and no Python control flow on tensor
        values. Breaking a rule raises a ``RuntimeError`` naming the stage (or,
        with ``graph_fallback=True``, warns once and runs eagerly). Outputs you
        hold are never overwritten, as :class:`~parallel_modules.Parallel`'s:
        they are clones, or the graph's own buffers once the module sees every
        output released before the next call; with ``static_outputs=True``
        they are always the buffers, which the next call overwrites.

    .. note::
        Micro-batching changes the result of modules that mix samples across
        the batch, such as BatchNorm in training mode (each micro-batch would be
        normalized with its own statistics). With ``chunks > 1`` the module
        refuses to run such stages and says which module is at fault: call
        ``.eval()`` on it, use ``chunks=1``, or use a per-sample normalization
        such as :class:`torch.nn.GroupNorm` or :class:`torch.nn.LayerNorm`.
        It also refuses modules that change their weights at each call (a
        spectral norm in training mode, an embedding with ``max_norm`` whose
        weight another layer also reads), a softmax along the batch, and
        layers that take the batch along dimension 1. Custom modules declare
        that they mix samples with a class or instance attribute
        ``mixes_batch = True``.

    .. note::
        A pinned CPU input is read by non-blocking copies ordered after the
        caller's earlier work, exactly as by ``x.to(device, non_blocking=True)``:
        the call returns before they have run, so do not modify the input in
        place until the caller's stream has passed this call (freeing it is
        safe). A pageable input is staged into pinned memory first and may be
        changed as soon as the call returns. Outputs made on side streams are
        safe to keep, free or use on the caller's stream (they are marked with
        :meth:`torch.Tensor.record_stream`).
    """

    # The private state of an instance: no stage may take these names (see _check_name).
    _internal = frozenset({"_chunks", "_compiler", "_graphs", "_home", "_per_stage", "_placed", "_plan",
                           "_revision", "_softmax_checked", "_tree"})

    @overload
    def __init__(self, *stages: nn.Module, chunks: int = 1, cuda_graph: bool = False, max_graphs: int = 8,
                 static_outputs: bool = False, graph_fallback: bool = False, direct_grads: bool = False,
                 compile: Backend | None = None, compile_options: dict[str, Any] | None = None,
                 compile_fallback: bool = False) -> None: ...

    @overload
    def __init__(self, stages: OrderedDict[str, nn.Module], /, *, chunks: int = 1, cuda_graph: bool = False,
                 max_graphs: int = 8, static_outputs: bool = False, graph_fallback: bool = False,
                 direct_grads: bool = False, compile: Backend | None = None,
                 compile_options: dict[str, Any] | None = None, compile_fallback: bool = False) -> None: ...

    def __init__(self, *stages: Any, chunks: int = 1, cuda_graph: bool = False, max_graphs: int = 8,
                 static_outputs: bool = False, graph_fallback: bool = False, direct_grads: bool = False,
                 compile: Backend | None = None, compile_options: dict[str, Any] | None = None,
                 compile_fallback: bool = False) -> None:
        owner = type(self).__name__
        named = len(stages) == 1 and isinstance(stages[0], OrderedDict)
        if named:
            items = list(stages[0].items())
        else:
            items = [(str(i), s) for i, s in enumerate(stages)]
        if not items:
            raise ValueError(
                f"{owner}: expected at least one stage, got none. "
                f"Pass modules, e.g. {owner}(encoder, decoder, chunks=4)."
            )
        for name, stage in items:
            _check_name(type(self), "stage", name, _PIPELINE_SETTINGS)
            _check_stage(owner, name, stage, constructing=not named)  # (by position: a setting meant?)
        super().__init__(OrderedDict(items))
        self.chunks = chunks
        # (Each setting is checked by __setattr__.)
        self.cuda_graph = cuda_graph
        self.max_graphs = max_graphs
        self.static_outputs = static_outputs
        self.graph_fallback = graph_fallback
        self.direct_grads = direct_grads  # the graph cache is made by _reset, below
        self._compiler = _compiler(owner, "stage", compile, compile_options, compile_fallback)
        self._reset()

    # ------------------------------------------------------------------ state
    @property
    def chunks(self) -> int:
        r"""Number of micro-batches each call is split into; settable (``pipe.chunks = 2``).

        An int >= 1 (a ``TypeError`` or ``ValueError`` otherwise), at most the
        batch size, which each call checks. A new value drops the CUDA graphs
        captured with the old one.
        """
        return self._chunks

    @chunks.setter
    def chunks(self, value: int) -> None:
        count = _integer(value)  # (a NumPy integer or a 0-dim integer tensor too, as tensor_split takes them)
        if count is None or count < 1:
            raise (TypeError if count is None else ValueError)(
                f"{type(self).__name__}: chunks must be an int >= 1 (the number of micro-batches "
                f"each call is split into), got {value!r}" + (f" (a {type(value).__name__})." if count is None else ".")
            )
        value = count
        graphs = self.__dict__.get("_graphs")
        if graphs is not None and value != self.__dict__.get("_chunks"):
            graphs.clear()  # captured for the old number of micro-batches
        self._chunks = value

    def __setattr__(self, name: str, value: Any) -> None:
        # A graph setting changed after construction is checked as the constructor
        # checks it, and the graphs captured under the old value go.
        _watch._check_attribute(self, name, _PIPELINE_SETTINGS)
        if name == "_modules":  # (see Parallel.__setattr__)
            _watch._children_changed()
        if name in _GRAPH_SETTINGS:
            value = _check_graph_setting(type(self).__name__, name, value)
            if "_tree" in self.__dict__:  # (constructed)
                _watch._change_setting(self, name, value, self._reset)
                return
        if name == "chunks":
            # Straight to the property's setter, which checks it: nn.Module.__setattr__ registers
            # a module or parameter before it looks at properties (``pipe.chunks = nn.Identity()``
            # became a stage named "chunks", silently, with chunks unchanged).
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)
        if name == "_modules" and "_tree" in self.__dict__:
            # The tree watches the dict of stages it was built with: given a new one holding the
            # same stages (``pipe._modules = OrderedDict(pipe._modules)``), its walk finds nothing
            # changed and a stage written into the new dict later would go unseen.
            self._reset()

    def _reset(self) -> None:
        r"""Forget what was learnt about the stages (placement, batch-mixing modules)."""
        self._plan: _Plan | None = None
        self._home: Any = _UNKNOWN
        # Input dims and modes seen by softmax layers (see _SoftmaxDims; and whether pieces of one
        # sample, see _checked) and by sequence layers (see _unbatched_refused), the oldest dropped
        # beyond _MAX_PLANS: the modes hold the ids of forward hooks, never reused, and a hook added
        # and removed around every call (a profiler's, an activation logger's) makes a new key at
        # each call.
        self._softmax_checked: dict[Hashable, None] = {}
        # Each stage's graphs for host inputs (``_stage_graphs``), by stage name.
        self._per_stage: dict[str, _CudaGraphs] = {}
        graphs = self.__dict__.get("_graphs")
        if graphs is not None:
            graphs.clear()
        else:  # constructed, unpickled or deep-copied: graphs never are copied
            self._graphs = _CudaGraphs(self, self.max_graphs, self.static_outputs, self.graph_fallback,
                                       direct_grads=self.direct_grads)
        self._tree = _watch._Tree(self, children=True)
        self._placed = _watch._placement(self)  # (see _apply)

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # .to(), .cuda(), .half() ... may move parameters: look at them anew, compile again.
        module = super()._apply(fn, recurse)
        _watch._reset_if_moved(self)
        return module

    # Stages are checked as the constructor checks them. (``append``, ``extend`` and
    # ``__setitem__`` register the stage, which ``forward`` notices; ``insert`` writes
    # ``_modules`` directly and ``__delitem__`` deletes, which registers nothing.)
    def __setitem__(self, idx: int, module: nn.Module) -> None:
        # (Named as the stage it replaces, "dec" or "1", not as the index given: -1.)
        key = _child_key(type(self).__name__, list(self._modules), idx, "stage", slices=False)
        _check_stage(type(self).__name__, key, module, container=self)
        super().__setitem__(idx, module)

    def _check_free(self, count: int) -> None:
        r"""Refuses appending ``count`` stages named by their index where a stage of such a name is kept.

        A slice keeps its stages' names, as ``nn.Sequential``'s does (``pipe[1:]``:
        ``"1"``, ``"2"``), and nn.Sequential's ``append`` then replaced stage ``"2"``
        with the new one, silently.
        """
        taken = [str(len(self) + i) for i in range(count) if str(len(self) + i) in self._modules]
        if taken:
            raise ValueError(f"{type(self).__name__}: a stage named {taken[0]!r} already exists (the stages keep "
                             f"their names through a slice or a `del pipe.name`: {list(self._modules)}), and appending "
                             f"names stages by their index. Build a new one, "
                             f"{type(self).__name__}(*pipe, new_stage), or name them with an OrderedDict.")

    def append(self, module: nn.Module) -> ParallelSequential:
        r"""Append a stage at the end, named by its index; returns ``self``.

        As :meth:`nn.Sequential.append`, except where a stage of that name is kept
        (through a slice or ``del pipe.name``): ``nn.Sequential`` replaces it, this
        raises. The stage is checked as the constructor checks stages.

        Args:
            module: the stage.
        """
        _check_stage(type(self).__name__, str(len(self)), module, container=self)
        self._check_free(1)
        return super().append(module)

    def extend(self, sequential: Iterable[nn.Module]) -> ParallelSequential:
        r"""Append every module of an iterable, as :meth:`append` does; returns ``self``.

        Every stage is checked before any is appended, so a refused one leaves the
        pipeline as it was.

        Args:
            sequential: the stages to append, in order (any iterable of modules,
                as for :meth:`nn.Sequential.extend`).
        """
        # All checked before any is appended (nn.Sequential appends one by one): a bad one
        # leaves the pipeline as it was.
        stages = _listed(type(self).__name__, "extend", "stage", sequential)
        for i, module in enumerate(stages):
            _check_stage(type(self).__name__, str(len(self) + i), module, container=self)
        self._check_free(len(stages))
        return super().extend(stages)

    def __iadd__(self, other: nn.Sequential) -> ParallelSequential:
        if isinstance(other, nn.Sequential):  # (what nn.Sequential adds: its stages, one by one)
            for i, module in enumerate(other):
                _check_stage(type(self).__name__, str(len(self) + i), module, container=self)
            self._check_free(len(other))
            # (Listed first: ``pipe += pipe`` would add to the stages it iterates, half done.)
            other = nn.Sequential(*other)
        return super().__iadd__(other)

    def insert(self, index: int, module: nn.Module) -> ParallelSequential:
        r"""Insert a stage before position ``index`` (as :meth:`nn.Sequential.insert`); returns ``self``.

        The stages after it move up by one, so they must be named by their
        position, ``"0"``, ``"1"``, ... (not names given in an ``OrderedDict``
        or kept through a slice).

        Args:
            index: the position the stage takes, from ``-len(self)`` to
                ``len(self)``.
            module: the stage.
        """
        # (Named by the position it would take, as the inserted stage is: -1 of 2 stages is "1".)
        owner, n = type(self).__name__, len(self)
        index = _insert_index(owner, index, n, "stage", "stages")  # (nn.Sequential's own check names no module)
        position = index + n if index < 0 else index
        _check_stage(type(self).__name__, str(position), module, container=self)
        # (nn.Sequential's insert moves stages "0".."n-1" up by one: on names kept through a
        # slice, or given, it replaced or dropped a stage, or failed half done.)
        _check_numbered(owner, list(self._modules), "stages", "insert", _NAMED_STAGES,
                        f"Build a new one, {owner}(*stages), or name the stages with an OrderedDict.")
        super().insert(index, module)
        _watch._children_changed()
        self._reset()
        return self

    def __imul__(self, other: int) -> ParallelSequential:
        if isinstance(other, int) and other > 1:  # (anything else: nn.Sequential's errors, or nothing added)
            # (nn.Sequential's *= copies stage str(i) to str(i + n): on names kept through a slice,
            # or given, it failed half done, replaced a stage, or repeated them in another order.)
            _check_numbered(type(self).__name__, list(self._modules), "stages", "*=", _NAMED_STAGES,
                            f"Build a new one, pipe * {other}, which numbers them anew.")
        return super().__imul__(other)

    def __delitem__(self, idx: int | slice) -> None:
        if not isinstance(idx, slice):
            _child_key(type(self).__name__, list(self._modules), idx, "stage")
        super().__delitem__(idx)
        _watch._children_changed()
        self._reset()

    def __delattr__(self, name: str) -> None:
        # ``del pipe.name`` of a stage registers nothing (see _watch): as ``__delitem__``.
        _watch._check_attribute(self, name, _PIPELINE_SETTINGS, deleting=True)
        stage = name in self._modules
        super().__delattr__(name)
        if stage:
            _watch._children_changed()
            self._reset()

    def __getstate__(self) -> dict:
        state = _state_to_copy(self)
        state.pop("_plan", None)
        state.pop("_home", None)
        state.pop("_graphs", None)
        state.pop("_per_stage", None)
        state.pop("_tree", None)
        state.pop("_placed", None)
        # (Keys by the modules' ids, stale in a copy, and by pytree specs, which torch warns
        # of deep-copying: the copy checks its first calls again.)
        state.pop("_softmax_checked", None)
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("_compiler", None)  # pickled before compile= existed
        state.setdefault("direct_grads", False)  # pickled before direct_grads= existed
        super().__setstate__(state)
        self._reset()

    def _make_plan(self) -> _Plan:
        stages = tuple(self._modules.values())
        names = tuple(self._modules)
        placement: dict[torch.device, int] = {}
        devices = tuple(frozenset(_module_devices(stage)) for stage in stages)
        mixers, others = [], []
        for i, (name, stage) in enumerate(zip(names, stages)):
            for d in devices[i]:
                placement.setdefault(d, i)
            owned = _observers_of_fake_quantizers(stage) if _FakeQuantize else set()
            for qual, m in stage.named_modules(prefix=name):
                if (_norm_class(m) is not None or hasattr(type(m), "mixes_batch") or _batch_second(m)
                        or isinstance(m, _ACROSS_DIM_0) or _scripted_softmax(m) or _spectral_norm(m)
                        or _quantizes_on_the_batch(m, owned)):
                    mixers.append((i, qual, m))
                else:
                    others.append((i, qual, m))
        home = next(iter(placement)) if len(placement) == 1 else (_MIXED if placement else None)
        # (Here, not at each call: a weight tied or untied later changes the tree, which makes
        # the plan anew.)
        modules = [m for _, _, m in (*mixers, *others)]
        embeddings = [m for _, _, m in mixers if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
        everything = list(self.modules()) if embeddings else []
        tied = tuple(m for m in embeddings if _read_elsewhere(m, everything))
        # Hooks where a mode over the whole call would change a result (fast paths), and
        # where nothing below reads hooks: blocks of this library (fusion, graphs) and
        # compiled modules (dynamo would trace them) take hooks for the user's own.
        hooks_read = any(isinstance(m, (Parallel, ParallelSequential)) or isinstance(getattr(m, "_orig_mod", None),
                                                                                     nn.Module) for m in modules)
        scoped = any(isinstance(m, _FAST_PATHS) for m in modules) and not hooks_read
        batch_first = tuple(item for item in others
                            if isinstance(item[2], _SEQUENCE_LAYERS) or _made_from(item[2], _SEQUENCE_NAMES))
        # (Not TorchScript modules, which take no hooks.)
        sequences = () if hooks_read else tuple(item for item in batch_first
                                                 if not isinstance(item[2], torch.jit.ScriptModule))
        return _Plan(stages, names, home, placement, devices, tuple(mixers), tuple(others), tied, scoped, sequences,
                     batch_first)

    def _get_plan(self) -> _Plan:
        # (A compiler's trace makes its own: it would record the assignments as side effects
        # of forward, and guard on the reads, which the next eager call's plan fails.)
        tracing = _is_tracing()
        plan = None if tracing else self._plan
        # Stages added, replaced or removed (append, insert, [i] = m, del ...)
        # show up as a different tuple of children.
        if plan is None or plan.stages != tuple(self._modules.values()):
            plan = self._make_plan()
            if not tracing:
                self._plan, self._home = plan, plan.home
        return plan

    # -------------------------------------------------------------- container
    def _settings(self) -> dict[str, Any]:
        return {"chunks": self._chunks, "cuda_graph": self.cuda_graph, "max_graphs": self.max_graphs,
                "static_outputs": self.static_outputs, "graph_fallback": self.graph_fallback,
                "direct_grads": self.direct_grads,
                **(self._compiler.settings() if self._compiler else {})}

    def _like(self, items: list[tuple[str, nn.Module]], operation: str) -> ParallelSequential:
        r"""A new container of ``items`` with this one's settings (``chunks``, ``cuda_graph``, ...)."""
        if not items:  # as nn.Sequential's: an empty container, the identity
            empty = _new_like(self, operation, "stage", nn.Identity(), **self._settings())
            del empty[0]
            return empty
        return _new_like(self, operation, "stage", OrderedDict(items), **self._settings())

    @overload
    def __getitem__(self, idx: slice) -> ParallelSequential: ...  # type: ignore[override]

    @overload
    def __getitem__(self, idx: int) -> nn.Module: ...

    def __getitem__(self, idx: int | slice) -> nn.Module | ParallelSequential:  # type: ignore[override]
        if isinstance(idx, slice):
            return self._like(list(self._modules.items())[idx], f"a slice, pipe[{_slice_text(idx)}],")
        return self._modules[_child_key(type(self).__name__, list(self._modules), idx, "stage")]

    @overload
    def pop(self, key: slice) -> ParallelSequential: ...

    @overload
    def pop(self, key: int) -> nn.Module: ...

    def pop(self, key: int | slice) -> nn.Module | ParallelSequential:
        r"""Remove the stage at ``key`` and return it, as :meth:`nn.Sequential.pop`; a slice returns
        the stages it removes as a pipeline with this one's settings.

        Args:
            key: the position of the stage, or a slice of positions.
        """
        # (Only typed here: nn.Sequential's says Module, which a slice's result is not only.)
        return super().pop(key)

    # ``+`` and ``*`` as nn.Sequential's (which would return a plain nn.Sequential), with the
    # left operand's settings.
    def __add__(self, other: nn.Sequential) -> ParallelSequential:  # type: ignore[override]
        return self._like(list(super().__add__(other)._modules.items()), "+")

    def __mul__(self, other: int) -> ParallelSequential:  # type: ignore[override]
        return self._like(list(super().__mul__(other)._modules.items()), "*")

    def __rmul__(self, other: int) -> ParallelSequential:  # type: ignore[override]
        return self.__mul__(other)

    def __prepare_scriptable__(self) -> ParallelSequential:
        raise TypeError(_NOT_SCRIPTABLE.format(name=type(self).__name__))

    def extra_repr(self) -> str:
        settings = self._settings() if self.cuda_graph else {"chunks": self._chunks}
        if not self.direct_grads:  # shown only when opted in, as ``Parallel`` shows it
            settings.pop("direct_grads", None)
        text = ", ".join(f"{k}={v!r}" for k, v in settings.items() if not k.startswith("compile"))
        return text + (", " + self._compiler.extra_repr() if self._compiler is not None else "")

    # ---------------------------------------------------------------- checks
    def _refuse_mixing(self, plan: _Plan, chunks: int) -> None:
        error = self._mixing_error(plan, chunks)
        if error is not None:
            # Looked at again before refusing: a module deleted or inserted below a stage
            # (``del stage[1]``, ``nn.Sequential.insert``) registers nothing, and the call
            # that follows the advice must not be refused for what is gone.
            self._plan = None
            error = self._mixing_error(self._get_plan(), chunks)
            if error is not None:
                raise error

    def _mixing_error(self, plan: _Plan, chunks: int) -> RuntimeError | None:
        r"""The error refusing a stage that mixes samples across the batch, or ``None``; ``chunks``: the call's."""
        # (An instance attribute set after the plan was made registers nothing: read on every call.
        # So is a sequence layer's ``batch_first``, set to False since: its input split along
        # dimension 0 is then split along its sequence.)
        declaring = [(i, qual, m) for i, qual, m in plan.others if m.__dict__.get("mixes_batch") is not None]
        declaring += [(i, qual, m) for i, qual, m in plan.batch_first if _batch_second(m)]
        for i, qual, m in (*plan.mixers, *declaring):
            declared = getattr(m, "mixes_batch", None)
            norm = _norm_class(m)
            if declared is not None:
                mixes, why = bool(declared), "declares mixes_batch = True: it mixes samples across the batch"
                fix = ("use chunks=1, or, if it does not mix samples after all, say so with "
                       f"`model.get_submodule({qual!r}).mixes_batch = False`.")
            elif _batch_second(m):
                return RuntimeError(
                    f"{type(self).__name__}: stage {plan.names[i]!r} (index {i}) contains {qual!r} "
                    f"({_layer_name(m)}) with batch_first=False, which reads its input as (sequence, "
                    f"batch, ...); with chunks={chunks} the input is split along dimension 0, "
                    "which for it is the sequence, and the result would differ from running the whole "
                    "batch. Construct it with batch_first=True and feed it batch-first inputs, or use "
                    "chunks=1; if the stage itself moves the batch to dimension 1 before it, say so "
                    f"with `model.get_submodule({qual!r}).mixes_batch = False`."
                )
            elif isinstance(m, _SOFTMAXES) or _scripted_softmax(m):  # (dims None or negative: see _SoftmaxDims)
                mixes, why = _softmax_dim(m) == 0, "normalizes along dimension 0, across the batch"
                fix = ("normalize along another dimension, or use chunks=1; if what it normalizes holds no "
                       "batch (weights computed from a parameter), say so with "
                       f"`model.get_submodule({qual!r}).mixes_batch = False`.")
            elif isinstance(m, _DYNAMIC_QUANTIZED):
                mixes = True
                why = ("is dynamically quantized (quantize_dynamic): it quantizes its input with a scale taken "
                       "from the whole input at every call")
                fix = ("use chunks=1 (or pipeline the float model, and quantize it statically: a fixed scale "
                       "treats every sample alike).")
            elif _batch_observer(m) and not isinstance(m, _FakeQuantize):
                mixes = True  # (one of a fake quantizer's is not listed: see _make_plan)
                why = ("observes the range of its inputs for post-training quantization, in state that "
                       "depends on how the batch is cut (a moving average moved once per call, a histogram "
                       "binned on each call's range, ranges per channel along dim 0, the batch's)")
                fix = ("use chunks=1 while calibrating; once calibrated, convert the model first "
                       "(torch.ao.quantization.convert), or, if its statistics no longer matter, say so with "
                       f"`model.get_submodule({qual!r}).mixes_batch = False`.")
            elif _quantizes_on_the_batch(m):
                # (Whether its observer runs is a tensor, maybe on the GPU: not read at every call.)
                mixes, why = True, "sets its quantization scale from the inputs it observes"
                fix = ("use chunks=1 while its observer runs (quantization-aware training); once disabled "
                       "(torch.ao.quantization.disable_observer), say so with "
                       f"`model.get_submodule({qual!r}).mixes_batch = False`, or convert the model first "
                       "(torch.ao.quantization.convert).")
            elif _spectral_norm(m):
                mixes = m.training
                why = "updates its spectral norm's power-iteration estimate at every call in training mode"
                fix = "call .eval() on it if you are not training it, or use chunks=1."
            elif (isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None
                  and any(t is m for t in plan.tied)):
                # Renormalized rows are the same whichever micro-batch looks them up
                # first, unless another layer reads the weight itself (a tied output
                # head) between two micro-batches' lookups.
                mixes = True
                why = ("renormalizes the rows each call looks up (max_norm) in its weight, which another "
                       "layer also reads, or may (it holds the embedding too): that layer would read it "
                       "renormalized for some micro-batches only")
                fix = ("use chunks=1, or renormalize the weight yourself before the call (max_norm=None); if "
                       "the other holders only look rows up, never reading the weight itself, say so with "
                       f"`model.get_submodule({qual!r}).mixes_batch = False`.")
            elif isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                # (In eval mode too: F.embedding scales the gradient whatever the module's mode,
                # wherever autograd records for the weight.)
                mixes = m.scale_grad_by_freq and m.weight.requires_grad and torch.is_grad_enabled()
                why = ("scales its gradient by each index's frequency in the batch (scale_grad_by_freq=True) "
                       "while autograd records for its weight (in eval mode too)")
                fix = ("use chunks=1 to take its gradient, run the call under torch.no_grad(), freeze its weight "
                       "(requires_grad_(False)), or construct it with scale_grad_by_freq=False.")
            elif norm is None:
                continue  # (a class attribute mixes_batch = None: not declared)
            elif not issubclass(norm, _BatchNorm):  # instance norms: per sample, but running statistics
                mixes = m.training and getattr(m, "running_mean", None) is not None
                why = "averages its running statistics over the batch in training mode"
                fix = ("call .eval() on it if you are not training it, use chunks=1, or construct it "
                       "with track_running_stats=False.")
            else:  # batch statistics in training mode, or always without running stats
                stats = getattr(m, "running_mean", None) is not None or getattr(m, "running_var", None) is not None
                mixes = m.training or not stats
                why = ("normalizes with batch statistics" + (" in training mode" if m.training else "")
                       + ": it mixes samples across the batch")
                fix = ("call .eval() on it if you are not training it, use chunks=1, or replace it with "
                       "a per-sample normalization such as nn.GroupNorm or nn.LayerNorm." if stats else
                       "use chunks=1, or replace it with a per-sample normalization such as nn.GroupNorm "
                       "or nn.LayerNorm (without running statistics it uses batch statistics in eval "
                       "mode too).")
            if mixes and isinstance(m, torch.jit.ScriptModule) and declared is None:
                # (Known by the name of the class it was made from: maybe a module of the user's.)
                fix += (f" If it is not a {'norm' if norm is not None else 'softmax'} layer, but a module of a "
                        "class of that name, say so with "
                        f"`model.get_submodule({qual!r}).mixes_batch = False`.")
            if mixes:
                return RuntimeError(
                    f"{type(self).__name__}: stage {plan.names[i]!r} (index {i}) contains {qual!r} "
                    f"({_layer_name(m)}), which {why}, so with "
                    f"chunks={chunks} each micro-batch would be treated on its own and the "
                    f"result{' (and its running statistics)' if norm is not None else ''} would "
                    f"differ from running the whole batch. "
                    f"To fix it, {fix}"
                )
        return None

    def _placement_error(self, plan: _Plan, device: torch.device | None) -> RuntimeError:
        owner = type(self).__name__
        if plan.home is _MIXED:
            where = ", ".join(f"stage {plan.names[i]!r} on {d}" for d, i in plan.placement.items())
            return RuntimeError(
                f"{owner}: stages have parameters on different devices ({where}); all stages must "
                f"live on one device. Move them with {owner}.to(device)."
            )
        i = plan.placement[plan.home]
        return RuntimeError(
            f"{owner}: the input is on {device} but stage {plan.names[i]!r} (index {i}) has "
            f"parameters on {plan.home}. Move the input with x.to({str(plan.home)!r}) or the "
            f"module with .to({str(device)!r})."
        )

    def _split(self, input: Any, chunks: int, copied: bool = False, watched: list[_Shared] | None = None,
               whole: bool = False) -> list[Any]:
        r"""``input`` as ``chunks`` micro-batches along dimension 0 (``torch.tensor_split``).

        ``copied``: the pieces are copied to the GPU before any stage reads them.
        ``watched``: receives the input's tensors that share elements across
        micro-batches, whose writes :meth:`_call` refuses.
        ``whole``: the input as one piece, checked as for cutting and copied where the
        pieces would be (a compiler's dynamic batch, see :meth:`_forward`).
        """
        owner = type(self).__name__
        if isinstance(input, torch.Tensor):
            leaves, spec = [input], None
        else:
            # (A PackedSequence kept whole, as a leaf: see below. Subclasses of tuple, list and dict
            # taken apart too: see _flatten.)
            leaves, spec = _flatten(input, is_leaf=_packed)
            if any(map(_packed, leaves)):
                # (Its tensors are time steps' rows and their counts, not samples; refused whatever
                # their sizes: one sequence has as many rows of data as counts.)
                raise ValueError(
                    f"{owner}: with chunks={chunks} the input is split into micro-batches along dimension 0, "
                    f"but it holds a PackedSequence, whose data has no batch dimension to split. Use "
                    f"chunks=1 for such inputs, or pass the padded batch (nn.utils.rnn.pad_packed_sequence) "
                    f"and pack it inside the first stage."
                )
        # (0-dim tensors in a structure, a temperature say, go to every piece as they are.)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0]
        # Other objects go to every micro-batch whole, as numbers and strings do (a config); those
        # holding tensors are looked at below. (Not a module: its parameters hold no samples.)
        others = [] if spec is None else [
            (i, v, held) for i, v in enumerate(leaves) if not isinstance(v, _PASSED_WHOLE) and _looks_inside()
            for held in (_hidden_attributes(v, largest=_BATCH_HOLDERS),) if held]
        if not tensors:
            hiding = f" (its tensors inside an object of class {type(others[0][1]).__qualname__})" if others else ""
            raise ValueError(
                f"{owner}: with chunks={chunks} the input must be a tensor, or a tuple/list/dict of "
                f"tensors (or of classes registered with torch.utils._pytree), batched along dimension 0; "
                f"got {_describe(input)}{hiding}. Pass such an input{_register_hint(others)}, or use "
                f"chunks=1 to hand the input to the first stage as it is."
            )
        unsliceable = [t for t in tensors if t.is_nested or t.layout != torch.strided]
        if unsliceable:
            t = unsliceable[0]
            kind = "a nested tensor" if t.is_nested else f"a {str(t.layout).replace('torch.', '')} tensor"
            raise ValueError(
                f"{owner}: with chunks={chunks} the input is split into micro-batches along dimension 0, "
                f"but it holds {kind} ({_describe(t)}), which cannot be sliced into views along it. "
                f"Use chunks=1 for such inputs, or make them dense (.to_dense(), or pad nested ones)."
            )
        # (Plain ints under torch.jit.trace too, which records the split, tensor_split, for any
        # batch size: the checks below concern the example input only. See _size.)
        batch = _size(tensors[0])
        if any(_size(t) != batch for t in tensors[1:]):
            paths = pytree.tree_flatten_with_path(input)[0]
            listing = ", ".join(
                f"input{pytree.keystr(p)}: {t.shape[0]}" for p, t in paths if isinstance(t, torch.Tensor) and t.dim()
            )
            raise ValueError(
                f"{owner}: every tensor of the input must have the same batch size along dimension 0 "
                f"to be split into micro-batches, got {listing}. Pass tensors of one batch, or use "
                "chunks=1."
            )
        for i, v, held in others:
            # One that holds tensors batched like the input (a dataclass pytree does not know, a
            # transformers BatchEncoding) would hand each micro-batch the whole batch's rows: the
            # stage would compute on, or return, them where nn.Sequential gives it its own rows.
            # (Tensors of other sizes in it, a table or weights, hold no samples: passed whole.)
            found = next(((name, t) for name, t in held if t.dim() and _size(t) == batch), None)
            if found is not None:
                where = _leaf_names(input, [i])[0]
                raise ValueError(
                    f"{owner}: with chunks={chunks} the input is split into micro-batches along dimension 0, "
                    f"but {where}, an object of class {type(v).__qualname__}, which torch.utils._pytree "
                    f"cannot take apart, holds tensors batched along dimension 0 (.{found[0]}: {_describe(found[1])} "
                    f"for a batch of {batch}): every micro-batch would get it whole, with the whole batch's "
                    f"rows. Let the pipeline split it{_register_hint(others)}, pass its tensors in a "
                    f"tuple/list/dict, or use chunks=1."
                )
        if batch == 0:  # nothing to split: one (empty) micro-batch, as nn.Sequential runs it
            return [input]
        # (A dynamic batch: the compiler guards on ``batch >= chunks``, and a torch.export Dim that
        # allows fewer is refused as the program is made.)
        if chunks > batch:
            error = ValueError(
                f"{owner}: chunks={chunks} is larger than the batch size {batch}; every micro-batch "
                f"needs at least one sample. Use chunks <= {batch} (set model.chunks), a larger "
                "batch, or drop_last=True in the DataLoader for a short last batch."
            )
            if not _dynamo_compiling():  # (which cannot trace setting an exception's attribute)
                # Which pipeline, for one it is nested in to name: see _nested_short.
                error._short_pipeline = self  # type: ignore[attr-defined]
            raise error
        # Recording autograd, each piece gets memory of its own: views of one input share
        # its version counter, so an in-place first operation (ReLU(inplace=True)) on one
        # piece would spoil what was saved for backward on another (by that operation, or
        # by a Linear after it for its weight's gradient, whether or not the input
        # requires grad). Not for pieces copied to the GPU, whose copies are theirs: a clone
        # of a pinned input is pageable, which would make each copy synchronous. While a
        # compiler traces, only where the first stage shows such a write (see
        # _writes_its_input): the graph is otherwise the plain model's. (Traced graphs have
        # the conflict too: AOTAutograd traces the backward of the views, and refused to
        # compile the pipeline; an exported program's backward raised.) Under torch.jit.trace
        # there too, with or without autograd: its check of the trace traces again without
        # autograd, and would find the graphs differ if the copies came with it only (views
        # kept in both, the traced program's backward failed: "modified by an inplace
        # operation"); a trace runs in either mode later anyway. A stage that changes its input
        # in place then leaves the caller's tensor as it was (without autograd, eagerly, it
        # changes it, as in nn.Sequential).
        # (``len() > 0``: dynamo in torch 2.11 cannot trace ``bool`` of a dict.)
        tracing = _is_tracing()
        if not tracing:
            own = torch.is_grad_enabled() and not copied
        else:  # (torch.fx.symbolic_trace: neither, its graph the plain model's)
            own = not copied and (torch.is_grad_enabled() if torch.compiler.is_compiling() else _jit_tracing()) and (
                len(self._modules) > 0 and _writes_its_input(next(iter(self._modules.values()))))

        if whole:  # (one piece: the input, or where the pieces would be copies, a copy of it)
            if not own:
                return [input]
            chunks = 1

        # Not inference tensors, which no stage can write outside inference mode (nor autograd
        # record them): copied here, outside it, they became ordinary tensors, and the pipeline
        # ran where nn.Sequential, and chunks=1, raise torch's "cannot be saved for backward".
        # (Asked eagerly only: Dynamo cannot trace ``is_inference()``. Compiled, the pieces are still
        # copied where the first stage writes its input: an inference tensor given to the compiled
        # pipeline runs where a compiled nn.Sequential raises.)
        # Nor the caller's leaf that requires grad, or a view of one (``w.t()``), which no stage may write
        # in place (autograd raises, as in nn.Sequential): copied, a stage wrote it where nn.Sequential
        # raises, which hid wrong gradients under torch.utils.checkpoint(use_reentrant=True): its forward
        # runs without autograd on the caller's tensor (written there, as by nn.Sequential), and its
        # recomputation, from a detached leaf of that written tensor, wrote a copy again. (A graph's
        # static copy of an input is a leaf standing for the caller's tensor, which may be a layer's
        # output: copied, as that would be.)
        def kept(t: torch.Tensor) -> bool:
            r"""Whether ``t``'s pieces are handed on uncopied, where autograd records (see above)."""
            return t.is_inference() or _writes_refused(t) and not (t.is_cuda and _capture_underway())

        def split(t: torch.Tensor) -> list[torch.Tensor]:
            pieces = t.tensor_split(chunks)
            cloned = own and (tracing or not kept(t))
            return [p.clone() for p in pieces] if cloned else list(pieces)

        if spec is None:
            return split(input)
        # A tensor passed twice, ``(x, x)``, is split once: its pieces stay one object
        # (``nn.MultiheadAttention`` takes ``query is key`` for self-attention's packed path).
        # Tensors that are views of one another, ``(x, x[:, :2])``, are copied together, so
        # that a stage writing one in place changes the other, as in nn.Sequential.
        # Found by ``is``, not by ``id()``: a compiler guards on every id() it traces, here
        # the input tensors' own, and compiled the pipeline again for each new input.
        # Tensors that share elements across micro-batches, ``(x[:-1], x[1:])``, cannot be
        # micro-batched where a stage writes one in place: one micro-batch's stages would
        # write what another reads through the other (has read, or reads later), a result no
        # copy reproduces, where nn.Sequential writes once, the whole batch (see _across). They
        # are watched, and a write refused (see _call); only read, as shifted inputs and targets
        # are, they run as before, uncopied. (Not while a compiler traces: its tensors keep no
        # versions; nor for pieces copied to the GPU, which are what the stages write.) Without
        # autograd, only where a tensor is a view: tensors of memories of their own, the common
        # case, then cost a look at their ``_base`` each (60 ns, where _shared takes 0.8 us a
        # tensor); two tensors that are not views (x, x.detach()) share memory laid out alike, in
        # the same rows.
        sets = _shared(leaves) if not tracing and not copied and (
            own or any(t._base is not None for t in tensors)) else []
        # (Not where one is kept uncopied: a copy of the set would be written where autograd refuses to write
        # that one. Split one by one, each is kept or copied as it would be alone, and watched below.)
        done = _copied_together([m for m in sets if not any(map(kept, m))], chunks) if own else []
        together = {id(t) for t, _ in done}  # (cut from one holder's pieces: never across micro-batches)

        def pieces(t: torch.Tensor) -> list[torch.Tensor]:
            for seen, split_once in done:
                if seen is t:
                    return split_once
            done.append((t, split(t)))
            return done[-1][1]

        columns = [pieces(t) if isinstance(t, torch.Tensor) and t.dim() else (t,) * chunks for t in leaves]
        if watched is not None:
            for members in sets:
                # (Inference tensors keep no version to watch.) Tensors sharing elements only in
                # the same micro-batches that no holder holds (see _copied_together) are copied
                # one by one while autograd records: a write through one would not show in the
                # other, as it does in nn.Sequential, so they are watched too.
                if id(members[0]) in together or any(t.is_inference() for t in members):
                    continue
                across = _across(members, chunks)
                if not (across or own):
                    continue
                at = [next(i for i, v in enumerate(leaves) if v is t) for t in members]
                names = _leaf_names(input, sorted(at))
                uncopied = [n for i, n in zip(sorted(at), names) if own and kept(leaves[i])]
                # (Views of one tensor share its version: without autograd, a write through any
                # view of the caller's tensor shows; with it, each piece is a copy of its own.)
                watched.append(_Shared(", ".join(names[:-1]) + f" and {names[-1]}",
                                       [[(columns[i][m], columns[i][m]._version) for i in at] for m in range(chunks)],
                                       across, uncopied=" and ".join(uncopied)))
        if watched is not None and not tracing and not copied:
            # A 0-dim tensor goes to every micro-batch whole, the same object: a stage writing it in
            # place (a counter, ``count.add_(1)``) would write it once per micro-batch, each reading
            # the earlier ones' writes, where nn.Sequential writes it once for the whole batch. Watched,
            # and a write refused (see _call). (Named only then: finding its path flattens the input
            # again, 20 us. Not inference tensors, which keep no version; nor pieces copied to the GPU,
            # where each micro-batch gets a copy of its own, written once.)
            for i, t in enumerate(leaves):
                if isinstance(t, torch.Tensor) and not t.dim() and not t.is_inference():
                    watched.append(_Shared(functools.partial(_leaf_names, input, [i]), [[(t, t._version)]] * chunks,
                                           whole=True))
        try:
            return [pytree.tree_unflatten([c[m] for c in columns], spec) for m in range(chunks)]
        except TypeError as e:  # (a subclass of a container that cannot be rebuilt: see _rebuilt)
            raise TypeError(f"{owner}: cannot split the input into micro-batches with chunks={chunks}: {e}") from e

    def _concat(self, outputs: list[Any], pieces: list[Any], returned: list[_Returned] | None = None,
                rows: list[list[torch.Size | None]] | None = None) -> Any:
        r"""Join the micro-batch outputs of the last stage along dimension 0.

        A tensor every micro-batch returned alike (a parameter, a 0-dim input
        passed on), or a view of the same elements not batched like them (see
        :func:`_one_view`), is returned as it is, unless it was written again since the
        first micro-batch returned it (``returned``: each micro-batch's output's
        leaves and versions as it returned them, see :func:`_returned`), as an ``out=``
        buffer is, which holds what the last micro-batch wrote (a 0-dim total
        summed over the micro-batches is the whole batch's: returned). Nor is
        a micro-batch's own tensor that a later micro-batch's output overlaps
        and that was written since it returned it: a view of a buffer the stage
        writes again for each micro-batch (see :func:`_refuse_rewritten`).
        Other tensors must be batched like the
        micro-batches themselves: a value reduced over the batch (``x.mean(0)``)
        cannot be joined into the whole batch's. (Where such a value happens to
        have as many rows as every micro-batch has samples, it looks batched and
        is concatenated: stages must be batch-independent, see the class.)
        A last stage ending in a recurrent layer returns ``(output, h_n)`` or
        ``(output, (h_n, c_n))``, whose final hidden states hold the batch along
        dimension 1 (``batch_first`` or not): joined along it.
        Non-tensor leaves pass on only where they are ``None`` or the input's
        own, the same object from every micro-batch: anything else a stage
        computed on a micro-batch (``x.shape[0]``) need not be the whole batch's.
        Where they cannot be joined, the stage whose rows they kept is named
        (``rows``: see :meth:`_row_changer`).
        """
        if len(outputs) == 1:
            return outputs[0]
        sizes = [_batch_size(p) for p in pieces]

        def shared(t: torch.Tensor, i: int) -> torch.Tensor:
            r"""``t``, leaf ``i`` of every micro-batch's output, unless written for each (see above)."""
            seen = returned[0].versions if returned is not None else ()
            if i < len(seen) and seen[i] is not None and t._version != seen[i] and t.dim():
                raise TypeError(
                    f"every micro-batch returned one tensor object (leaf {i} of the output, {tuple(t.shape)}), "
                    f"written again since micro-batch 0 returned it (an out= argument, a buffer updated in place "
                    f"and returned): it holds what the last micro-batch wrote, not the whole batch's values. "
                    f"Return a new tensor from each call (e.g. .clone() it)")
            return t

        def batched(column: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
            if any(t.dim() <= dim or _size(t, dim) != n for t, n in zip(column, sizes)):
                rows = ", ".join(str(_size(t, dim)) if t.dim() > dim else f"{t.dim()}-D" for t in column)
                raise TypeError(f"tensors not batched like the micro-batches: [{rows}] rows along dimension {dim} "
                                f"for micro-batches of {sizes} samples, where one row per sample is expected (a "
                                f"reduction over the batch, or a reshape folding another dimension into the "
                                f"batch's, cannot be joined into the whole batch's)")
            return torch.cat(list(column), dim)

        try:
            if returned is not None:
                _refuse_rewritten(returned, pieces)
            stages = list(self._modules.values())
            layout = _layout(stages[-1]) if stages else None
            if layout is not None and all(
                    type(o) is tuple and len(o) == 2 and isinstance(o[0], torch.Tensor) for o in outputs):
                rank, dim = layout
                hidden = [o[1] for o in outputs]
                if all(isinstance(h, torch.Tensor) and h.dim() == rank for h in hidden):
                    return batched([o[0] for o in outputs]), batched(hidden, dim)
                if all(type(h) is tuple and len(h) == 2 and all(isinstance(t, torch.Tensor) and t.dim() == rank
                                                                 for t in h) for h in hidden):
                    return batched([o[0] for o in outputs]), tuple(batched(c, dim) for c in zip(*hidden))
                raise TypeError("the recurrent layer ending the last stage returned hidden states without a "
                                "batch dimension: its input was unbatched (2-D), which micro-batches cut along "
                                "its sequence")
            if all(isinstance(o, torch.Tensor) for o in outputs):
                first = outputs[0]
                if all(o is first for o in outputs[1:]) or _one_view(outputs, sizes):
                    return shared(first, 0)  # the same tensor from every micro-batch, as in a structure below
                return batched(outputs)
            # (Dicts of the same keys in another order are the same structure, as for nn.Sequential.)
            flat = [_flatten(_in_order_of(o, outputs[0]) if i else o, is_leaf=_packed) for i, o in enumerate(outputs)]
            spec = flat[0][1]
            if any(s != spec for _, s in flat):
                raise TypeError("the micro-batches returned different structures")
            # (The input's own non-tensor values, found by ``is``, not by ``id()``: a compiler
            # guards on every id() it traces, and compiled the pipeline again for each new
            # object in the input, a config made per call.)
            given = [v for v in _leaves(pieces[0]) if not isinstance(v, torch.Tensor)]
            joined = []
            for i, column in enumerate(zip(*(leaves for leaves, _ in flat))):
                first = column[0]
                if any(map(_packed, column)):
                    # (Joined as a namedtuple of tensors, the pieces' time steps would follow one another,
                    # where packing the whole batch interleaves them: silently so where every sequence
                    # has one step and every micro-batch one sample.)
                    raise TypeError(f"the last stage returned a PackedSequence (leaf {i} of the output), whose "
                                    f"data holds the sequences' time steps, not one row per sample: the "
                                    f"micro-batches' packed sequences cannot be joined into the whole batch's. "
                                    f"Unpack it in the last stage (nn.utils.rnn.pad_packed_sequence) and return "
                                    f"the padded batch")
                if isinstance(first, torch.Tensor) and (all(t is first for t in column[1:])
                                                        or _one_view(column, sizes)):
                    joined.append(shared(first, i))  # the same tensor (or view of it) from every micro-batch
                elif all(isinstance(t, torch.Tensor) for t in column):
                    joined.append(batched(column))
                elif (first is None or any(v is first for v in given)) and all(v is first for v in column[1:]):
                    joined.append(first)  # None, or a value of the input's passed on
                elif not any(isinstance(t, torch.Tensor) for t in column):
                    hiding = [(m, v) for m, v in enumerate(column) if _looks_inside() and _hidden_attributes(v)]
                    if hiding:
                        # (Each micro-batch's holds its own rows: joined, they would be the batch's.)
                        raise TypeError(f"the micro-batches returned objects of class "
                                        f"{type(hiding[0][1]).__qualname__} holding tensors, which "
                                        f"torch.utils._pytree cannot take apart to join them: let the pipeline "
                                        f"concatenate them{_register_hint(hiding)}, "
                                        f"or return the tensors in a tuple/list/dict")
                    # A value computed from a micro-batch (its size, a statistic) need not be the
                    # whole batch's, even where every micro-batch computed the same.
                    raise TypeError(f"the micro-batches returned non-tensor values "
                                    f"({', '.join(repr(v) for v in column)}), which are not the input's "
                                    f"own: what a stage computed on a micro-batch need not hold for the "
                                    f"whole batch (return such values as tensors batched along dimension "
                                    f"0, or pass them in with the input)")
                else:
                    raise TypeError("the micro-batches returned tensors and non-tensors at one place")
            return pytree.tree_unflatten(joined, spec)
        except (RuntimeError, TypeError, IndexError, ValueError) as e:
            if _out_of_memory(e):
                raise
            names = list(self._modules)
            changer = self._row_changer(rows, sizes, len(names))
            if changer is not None:
                s, got = changer
                raise ValueError(
                    f"{type(self).__name__}: stage {names[s]!r} (index {s}) returned {got} rows along dimension 0 "
                    f"for micro-batches of {sizes} samples, where one row per sample is expected: no stage after it "
                    f"returned one row per sample again, and the outputs of the last stage {names[-1]!r} "
                    f"(index {len(names) - 1}) cannot be concatenated into the whole batch's (a reduction over the batch, or a slice or "
                    f"reshape along its dimension, cannot be). Make stage {names[s]!r} return per-sample outputs, "
                    f"or use chunks=1. ({type(e).__name__}: {e})") from e
            listing = "\n".join(f"  micro-batch {m}: {_describe(o)}" for m, o in enumerate(outputs))
            # (the type Parallel's join raises: torch.cat's RuntimeError for tensors that do not agree)
            raise (RuntimeError if isinstance(e, RuntimeError) else ValueError)(
                f"{type(self).__name__}: cannot concatenate the outputs of the last stage "
                f"{names[-1]!r} (index {len(names) - 1}) along dimension 0 over {len(outputs)} "
                f"micro-batches; expected tensors (or one structure of tensors) with one row per "
                f"sample along dimension 0 that agree in every other dimension, got:\n{listing}\n"
                f"Make the last stage return per-sample outputs, or use chunks=1. "
                f"({type(e).__name__}: {e})"
            ) from e

    @staticmethod
    def _row_changer(rows: list[list[torch.Size | None]] | None, sizes: list[int | None],
                     count: int) -> tuple[int, list[int | None]] | None:
        r"""Which stage before the last made the last stage's outputs other than one row per sample, and the
        rows it returned for each micro-batch; ``None`` where the last stage did, or where its outputs are no
        tensors or have one row per sample.

        ``rows``: for each micro-batch, its ``count`` stages' outputs' shapes, ``None``
        for an output that is no tensor (a structure is not taken apart: what is kept
        for every stage and micro-batch is one shape, read here);
        ``sizes``: the micro-batches' samples. Named: the stage from which every output
        had other rows than samples, not the first to have other rows, as one moving
        the batch to dimension 1 has (``x.transpose(0, 1)`` around a sequence-first
        layer, and another moving it back).
        """
        # (Each output's size along dimension 0, ``None`` for one 0-dim.)
        firsts = [[shape[0] if shape else None for shape in kept] for kept in rows or ()]
        for kept, n in zip(firsts, sizes):
            if n is None or len(kept) != count or kept[-1] is None or kept[-1] == n:
                continue
            s = count - 1
            while s and kept[s - 1] is not None and kept[s - 1] != n:
                s -= 1
            if s < count - 1:
                return s, [r[s] for r in firsts]
            return None  # (the last stage's own: the message naming it says so)
        return None

    # ---------------------------------------------------------------- forward
    def forward(self, input: Any) -> Any:
        r"""Run the stages on ``input``, micro-batch by micro-batch, and concatenate the outputs."""
        # (Tracing first: a compiler must not read, and guard on, the count of changes.)
        if not _is_tracing() and (self._tree.seen != _watch._changes or self._tree.children != self._tree.copies):
            changed = self._tree.changed(self)
            if changed is _watch._WHILE_SWAPPED:  # (see there: the plan made anew at a call outside)
                homes = _module_devices(self)
                device = _device(input)
                if len(homes) == 1 and device is not None and device.type == "cpu":
                    (home,) = homes
                    if home.type == "cuda":  # (a host input, copied in as _forward copies it)
                        input = _to_device(input, home, non_blocking=False)
                return self._in_order(self._stages(), input)
            if changed:
                # A stage or a submodule below it replaced or added (see _watch): its plan
                # (batch-mixing modules, devices) and its graphs are made anew.
                self._reset()
        if self.cuda_graph and not self._host_input(input):
            return self._graphs(self._eager, (input,), {})
        return self._eager(input)

    def _host_input(self, input: Any) -> bool:
        r"""Whether ``input`` is on the CPU and the stages on one CUDA device (it is then copied in here)."""
        device = _device(input)
        if device is None or device.type != "cpu":
            return False
        home = self._get_plan().home
        return isinstance(home, torch.device) and home.type == "cuda"

    def _stage_graphs(self, plan: _Plan, input: Any) -> list[_CudaGraphs] | None:
        r"""For ``cuda_graph=True`` and a host input: each stage's graphs, replayed micro-batch by micro-batch.

        The whole call cannot be one graph: its copies read the caller's host
        memory, a new address every call. Each stage's work on one micro-batch
        can, and replaying it costs the CPU a few microseconds where launching
        its kernels one by one costs tens per kernel -- on a CPU-bound
        pipeline, the difference between the copies overlapping the compute
        and the copy engine waiting for the CPU. Micro-batches of one size
        share a graph (the last, smaller one has its own). Calls that record
        autograd run eagerly: every micro-batch's forward would overwrite the
        activations the previous one's backward needs.
        """
        if torch.is_grad_enabled() and (any(p.requires_grad for p in self.parameters()) or any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in _leaves(input))
                or any(b.requires_grad for b in self.buffers())):  # (requires_grad_() on a buffer)
            self._graphs._warn_once(
                "host-training", f"{type(self).__name__}: cuda_graph=True with a CPU input graphs each "
                f"stage per micro-batch, which training cannot use (each micro-batch's forward would "
                f"overwrite the activations the previous one's backward needs): calls that record "
                f"autograd run eagerly. Move the input to the GPU first to graph the whole call.")
            return None
        graphs = []
        last = len(plan.stages) - 1
        for s, (name, stage) in enumerate(zip(plan.names, plan.stages)):
            cache = self._per_stage.get(name)
            if cache is None or cache._owner() is not stage or cache.lend != (s == last):
                # Outputs are lent by the last stage only: the others' are read by
                # the next lane, on another stream, while their own lane may
                # already replay the next micro-batch into the same buffers.
                cache = _CudaGraphs(stage, self.max_graphs, False, self.graph_fallback, lend=s == last,
                                    calls_owner=True)
                cache.name = f"{type(self).__name__} stage {name!r}"
                self._per_stage[name] = cache
            graphs.append(cache)
        return graphs

    def _stages(self) -> Any:
        r"""The callable to run for each stage: the stage, or its compiled form (``compile=``)."""
        compiler = self._compiler
        if compiler is None or _is_tracing() or _EAGER in (_graph_variant(self) or ()):
            # (A tuple: another thread's append would change the dict under the caller's loop.)
            return tuple(self._modules.values())
        return compiler.calls(self._modules)

    def _graph_variants(self, args: tuple, kwargs: dict, first_only: bool = False) -> list[tuple[str, ...] | None]:
        r"""For ``cuda_graph=True``: the ways to capture this call; the fastest is kept.

        Compiled stages or eager ones, and with a torch.compile backend the
        whole module compiled as one program (micro-batches one after another).
        """
        compiler = self._compiler
        if compiler is None:
            return [None]
        return [(_COMPILED,), (_EAGER,)] + ([(_WHOLE,)] if compiler.compiles_whole else [])

    def _eager(self, input: Any) -> Any:
        # Read once: another thread setting ``chunks`` during the call must not have the input
        # cut into more micro-batches than the checks of batch-mixing modules were made for.
        chunks = self._chunks
        if chunks == 1:
            # The plain Sequential, as cheap as nn.Sequential: one attribute
            # read and one device comparison more.
            home = self._home if not _is_tracing() else self._get_plan().home  # (see _get_plan)
            # (``isinstance(home, torch.device)`` first: dynamo cannot compare a
            # device with the _UNKNOWN/_MIXED sentinels, and fullgraph=True fails.)
            if home is None or (isinstance(home, torch.device) and isinstance(input, torch.Tensor)
                                and input.device == home):
                return self._in_order(self._stages(), input)
        if chunks > 1:
            plan = self._get_plan()
            # (A declared ``mixes_batch`` decides, as in _mixing_error.)
            sequences = [(i, q, m) for i, q, m in plan.sequences if getattr(m, "mixes_batch", None) is None]
            if sequences and not _is_tracing() and not _functorch_active():
                # (Eagerly: a compiler would trace the hooks as side effects. Stages compiled with
                # compile= run uncompiled for it, as for the softmax check: see _checked.)
                modes = self._modes()
                key = ("sequences", _signature_dims(input), modes, tuple(id(m) for _, _, m in sequences))
                if key not in self._softmax_checked:
                    batch = _batch_size(input) or 0
                    # (The modes and hooks as found before the check's own hooks go on the layers.)
                    with _unbatched_refused(self, plan, sequences, batch, chunks):
                        output = self._checked(plan, input, chunks, uncompiled=self._compiler is not None,
                                               modes=modes)
                    if batch:  # (an empty batch: the next call of the signature checks)
                        _bounded_add(self._softmax_checked, key)
                    return output
            return self._checked(plan, input, chunks)
        return self._forward(input, chunks)

    def _modes(self) -> tuple[Any, ...]:
        r"""The train/eval mode of the pipeline and of every module below it, and their forward hooks, found
        as they are now (a module put in by writing a container's dict registers nothing, and nor does a
        hook), without ``modules()``'s names and repeats (which cost 75 us a call on a 12-layer transformer
        encoder): what decides the path a stage takes to its layers, and the inputs they get.

        Hooks by their handles' ids, which are never reused: one removed and another added differs."""
        hooks = nn.modules.module
        modes: list[Any] = [self.training, tuple(hooks._global_forward_pre_hooks),
                            tuple(hooks._global_forward_hooks)]
        seen = {id(self)}
        stack = list(self._modules.values())
        while stack:
            m = stack.pop()
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                modes.append(m.training)
                if m._forward_pre_hooks or m._forward_hooks:
                    modes.append((tuple(m._forward_pre_hooks), tuple(m._forward_hooks)))
                stack.extend(m._modules.values())
        return tuple(modes)

    def _checked(self, plan: _Plan, input: Any, chunks: int, uncompiled: bool = False,
                 modes: tuple[Any, ...] | None = None) -> Any:
        r"""``_forward(input)`` in micro-batches, the first call of an input signature under the softmax check.

        ``uncompiled``: the stages as they are, not their compiled forms (under another check's hooks);
        ``modes``: :meth:`_modes` as found before that check's hooks went on."""
        layers = [(i, q, m) for i, q, m in plan.mixers if isinstance(m, _SOFTMAXES)
                  and (_softmax_dim(m) is None or _softmax_dim(m) < 0) and getattr(m, "mixes_batch", None) is None]
        if layers:
            # (The mode too: a stage may take another path in eval, logits in training and
            # probabilities in eval.)
            # (Every module's mode: a stage switched to eval alone may reach a layer it skipped.
            # And their hooks: one added since may hand a layer an input of other dims.)
            # (Not while tracing, which checks at every trace: a compiler guards on each id()
            # it traces, and would compile the pipeline again for every instance of it.)
            # (And whether the micro-batches hold one sample, more, or either: a stage's ``x.squeeze()``
            # drops the batch's dimension of a piece of one, and a layer reads the dims anew --
            # ``Softmax()`` normalizing along dim 1 on pieces of one sample, and along dim 0, across
            # the batch, on larger pieces. Dims depend on a size only where it is 1: not keyed by
            # the batch size itself, which would check each new one, a checked call costing 60%
            # more eagerly, and stages compiled with compile= running uncompiled in it.)
            tracing = _is_tracing()
            batch = _batch_size(input)
            batch = None if tracing and batch is not None and _symbolic(batch) else batch or 0  # (a dynamic batch size)
            key = None if tracing else (_signature_dims(input), min(batch // chunks, 2), min(-(-batch // chunks), 2),
                                        self._modes() if modes is None else modes,
                                        tuple((id(m), _softmax_dim(m)) for _, _, m in layers))
            # (Under torch.func transforms the stages run on the whole input: see _forward.)
            if tracing or key not in self._softmax_checked and not _functorch_active():
                smallest = None if batch is None else max(batch // chunks, 1)
                check = _SoftmaxDims(self, plan, layers, smallest, chunks)
                # A compiler traces the mode (which puts nothing in its graph) and would trace
                # hooks as side effects. Stages compiled with compile= run uncompiled under it:
                # compiled code guards on the mode, and would compile again for the next call.
                with check.inside() if plan.scoped and not tracing and self._compiler is None else check:
                    output = self._forward(input, chunks,
                                           uncompiled=uncompiled or not tracing and self._compiler is not None)
                # (each trace checks: a tracer would record the add as a side effect. An empty
                # batch has no rows for the check to see: the next call of the signature checks.)
                if not tracing and batch:
                    _bounded_add(self._softmax_checked, key)
                return output
        return self._forward(input, chunks, uncompiled=uncompiled)

    def _in_order(self, calls: Any, input: Any) -> Any:
        r"""The stages one after another on the whole ``input``: ``nn.Sequential.forward``, naming the failing stage."""
        s = 0
        try:
            for module in calls:
                input = module(input)
                s += 1
        except Exception as e:
            name = list(self._modules)[s]
            raise self._stage_error(e, f"(raised in stage {name!r} (index {s}) of {type(self).__name__}"
                                       f"{self._nested_short(e, name, 1)})")
        return input

    def _nested_short(self, error: Exception, name: str, count: int) -> str:
        r"""For ``error`` raised by a pipeline in stage ``name`` given fewer samples than its chunks (see
        :meth:`_split`), which one, by its path in this pipeline: its message's ``model.chunks`` is not this
        one's, nor is its batch this one's where ``count`` (this call's micro-batches) is more than 1."""
        inner = None if _dynamo_compiling() else getattr(error, "_short_pipeline", None)  # (see _split)
        if inner is None:
            return ""
        # (Named once, by the nearest pipeline it is nested in: the ones around that name their stage.)
        del error._short_pipeline  # type: ignore[attr-defined]
        stage = self._modules.get(name)  # (removed by another thread meanwhile: the user's error, unnamed)
        path = None if stage is None else next(
            (f"{name}.{q}" if q else name for q, m in stage.named_modules() if m is inner), None)
        if path is None:  # (not one of the stage's modules: held by an attribute, say)
            return ""
        owner, kind = type(self).__name__, type(inner).__name__
        who = f"the stage, a {kind}" if path == name else f"the {kind} {path!r} in it"
        fix = f"lower its chunks (`model.get_submodule({path!r}).chunks`, `model` this {owner})"
        if count == 1:
            return f"; raised by {who}: {fix}"
        return (f"; raised by {who}, which cuts again what it gets of each of this {owner}'s {count} "
                f"micro-batches: {fix} or this one's")

    def _stage_error(self, error: Exception, context: str) -> Exception:
        r"""``error``, raised in a stage, with ``context`` and, where a stage was moved by a ``.to()`` of
        its own since the plan was made (which registers nothing: see ``_watch``), that too; the plan
        is then forgotten, so that the next call looks at the stages' devices anew."""
        plan = self._plan
        if plan is not None and not _is_tracing():
            now = [frozenset(_module_devices(stage)) for stage in plan.stages]
            # (A stage without tensors that registers one in its first call -- a cache of
            # rotary embeddings or masks -- moved nothing.)
            if any(before and devices != before for before, devices in zip(plan.devices, now)):
                self._plan, self._home = None, _UNKNOWN
                where = ", ".join(f"stage {name!r} on {', '.join(sorted(map(str, devices)))}"
                                  for name, devices in zip(plan.names, now) if devices)
                context += (f"; a stage was moved since the pipeline's last call, by a .to() of its own (now: "
                            f"{where}): the next call looks at the stages' devices anew. (Moving the whole "
                            f"pipeline with {type(self).__name__}.to(...) is seen at once.)")
        return _with_context(error, context)

    def _forward(self, input: Any, chunks: int, uncompiled: bool = False) -> Any:
        r"""The stages on ``input``, in ``chunks`` micro-batches (``_chunks`` as the call read it once, see
        ``_eager``); ``uncompiled``: not their compiled forms."""
        plan = self._get_plan()
        tracing = _is_tracing()
        # (Not asked of a compiler, which would record the question in its graph.)
        transformed = not tracing and _functorch_active()
        if chunks > 1 and not transformed:  # (which runs the whole input: see below)
            self._refuse_mixing(plan, chunks)
        device = _device(input)
        copy_to = None
        if device is not None and plan.home is not None and device != plan.home:
            if plan.home is not _MIXED and device.type == "cpu" and plan.home.type == "cuda":
                copy_to = plan.home
            else:
                # A child moved on its own (stage.to(...)) is not seen by the
                # cache: look again before blaming the input.
                self._plan = None
                plan = self._get_plan()
                if plan.home is not None and device != plan.home:
                    raise self._placement_error(plan, device)
        calls = self._modules.values() if uncompiled else self._stages()
        # (Not for a call run uncompiled, see _eager: the graphs captured would be kept for the
        # compiled stages' calls.)
        graphs = (self._stage_graphs(plan, input) if copy_to is not None and self.cuda_graph and not tracing
                  and not uncompiled else None)
        if graphs is not None:
            calls = [lambda v, c=cache, f=stage: c(f, (v,), {}) for stage, cache in zip(calls, graphs)]
        proxies = _symbolic_trace._is_fx_tracing_flag and _proxies(input)
        symbolic = chunks > 1 and tracing and not proxies and _symbolic_batch(input)
        if symbolic:  # (as if cut: the program refuses what eager calls refuse, a batch below chunks, and copies)
            (input,) = self._split(input, chunks, whole=True)
        if chunks == 1 or proxies or symbolic or transformed:
            # (Under torch.func transforms -- vmap(grad(...)) for per-sample gradients sees
            # one sample at a time -- the stages run on the whole input: the same result,
            # where micro-batches would gain nothing and a batch of one could not be cut.
            # torch.fx.symbolic_trace traces proxies, which cannot be cut into micro-batches:
            # its graph runs the stages on the whole batch, as the CPU path would up to rounding.
            # torch.export sets the same flag, but traces tensors. So does a trace with a
            # dynamic batch size: cut into pieces, its program would hold only for batches of
            # one remainder modulo ``chunks``, and the compiler schedules the stages anyway.)
            if copy_to is not None:
                # As ``x.to(device, non_blocking=pinned)``: a page-locked input is copied
                # on the caller's stream, which orders the stages after it, while the CPU
                # goes on to launch them (a blocking copy kept the CPU idle for the whole
                # copy: 8% slower than copy-then-compute on a 38 MB batch). A pageable one
                # is copied synchronously, as ``.to(device)`` does.
                # (Not while a compiler traces: is_pinned() breaks the traced graph.)
                pinned = not tracing and _pinned(input)
                input = _to_device(input, copy_to, non_blocking=pinned, pinned=pinned)
            return self._in_order(calls, input)

        watched: list[_Shared] = []
        pieces = self._split(input, chunks, copied=copy_to is not None, watched=watched)
        # The blocks whose results the stages return, whose first micro-batch's output _call
        # looks at (see _refuse_stacked).
        stages = list(zip(plan.names, calls, map(_stock_parallel, plan.stages)))
        # The lists and dicts each micro-batch's first stage gets, which pytree made anew for
        # it: a stage changing one in place (``d["k"] = v``, ``d["cache"].append(k)``) would
        # change only its micro-batch's, where nn.Sequential changes the caller's. Refused (see
        # _call). Not while a compiler traces (its graph holds no Python containers), nor for a
        # single piece, which is the input itself (an empty batch).
        held: list[list[_Held] | None] | None = None
        if not tracing and not isinstance(input, torch.Tensor) and pieces[0] is not input and _containers(input):
            held = [None] * len(pieces)
        # The shapes each stage returns for each micro-batch, which name the stage that dropped
        # some where the last stage's outputs cannot be joined (see _row_changer). (Not under
        # torch.jit.trace, which would record each size read in its graph; asked only outside a
        # compiler, which cannot trace the question, and again where ``tracing``: the code a compiler
        # runs eagerly after a graph break keeps it as it was traced.)
        rows: list[list[torch.Size | None]] | None = (
            None if tracing and not torch.compiler.is_compiling() and _jit_tracing() else [[] for _ in pieces])
        if tracing or (copy_to is None and (device is None or device.type != "cuda")):
            # Compilers see the micro-batches one after the other (no stream
            # ops in the graph) and schedule them; the CPU runs them in order.
            # (A pipeline recomputed by torch.utils.checkpoint(use_reentrant=False)
            # is not run in line, as a Parallel is: the recomputation starts on
            # the last lane's stream, where the pipeline joins, and the earlier
            # lanes keep their streams; see _streams._autograd_in_line.)
            if copy_to is not None:
                pieces = [_to_device(p, copy_to, non_blocking=False) for p in pieces]
            outputs = []
            returned = None if tracing else []  # (a trace's tensors keep no versions to compare)
            for m, value in enumerate(pieces):
                for s, (name, stage, block) in enumerate(stages):
                    value = self._call(s, name, stage, m, len(pieces), value, held, block, watched, rows)
                if returned is not None:
                    returned.append(_returned(value))
                outputs.append(value)
            return self._concat(outputs, pieces, returned, rows)

        target = copy_to if copy_to is not None else device
        assert target is not None
        ahead = copy_to is not None and _pinned(input)  # the copy lane issued whole, first
        seen: list[_Returned] = []  # each micro-batch's output's versions (see _concat)
        if target.index is not None and target.index != torch.cuda.current_device():
            with torch.cuda.device(target):
                outputs = self._pipeline(stages, input, pieces, target, copy_to is not None, ahead, seen, held,
                                         watched, rows)
        else:
            outputs = self._pipeline(stages, input, pieces, target, copy_to is not None, ahead, seen, held, watched,
                                     rows)
        if isinstance(outputs, _Gather):
            return outputs.out
        if not all(isinstance(o, torch.Tensor) and o.is_cuda for o in outputs) and any(
                isinstance(t, torch.Tensor) and not t.is_cuda for o in outputs for t in _leaves(o)):
            # A last stage that copied its output to the host without blocking
            # (``x.to("cpu", non_blocking=True)``): the host would concatenate pieces the
            # lanes' copies have yet to write. The caller's stream has joined every lane.
            torch.cuda.current_stream(target).synchronize()
        return self._concat(outputs, pieces, seen if len(seen) == len(outputs) else None, rows)

    def _handed(self, before: _Returned | None, value: Any, s: int, m: int, pieces: list[Any]) -> _Returned:
        r"""Refuse stage ``s``'s output for piece ``m`` where it overwrote its output for piece ``m - 1``
        (``before``: that output's tensors and their versions then), which the next stage may still
        be reading on its own stream; return ``value``'s tensors and versions.

        A stage that writes into a buffer it keeps and returns (a view of) it
        works one micro-batch at a time, but not pipelined: the next stage
        reads the buffer while this one writes the next piece into it. (Its
        outputs' versions show the write: views share their base's. Pieces of
        the input, ``pieces``, written in place are each their own.)
        """
        now = _returned(value)
        if before is not None:
            for i in _rewritten(before):
                t = before.leaves[i]
                if any(_overwrites(u, pieces[m], t, pieces[m - 1]) for u in now.leaves):
                    name = list(self._modules)[s]
                    raise RuntimeError(
                        f"{type(self).__name__}: stage {name!r} (index {s}) wrote its output for micro-batch "
                        f"{m} into the memory of its output for micro-batch {m - 1} ({tuple(t.shape)}), "
                        f"which the next stage reads on its own CUDA stream at the same time: the stage "
                        f"returns memory it keeps and writes again at every call (a buffer, an out= "
                        f"argument). Return a new tensor from each call (e.g. .clone() it), or use chunks=1.")
        return now

    def _call(self, s: int, name: str, stage: nn.Module, m: int, count: int, value: Any,
              held: list[list[_Held] | None] | None = None, block: Parallel | None = None,
              watched: list[_Shared] | None = None, rows: list[list[torch.Size | None]] | None = None) -> Any:
        r"""Stage ``s`` on micro-batch ``m``; ``held``: each micro-batch's lists and dicts, refused changed (see
        _forward); ``block``: the ``Parallel`` whose result the stage returns, if any (see :meth:`_refuse_stacked`);
        ``watched``: input tensors sharing elements across micro-batches, refused written (see :meth:`_split`);
        ``rows``: each micro-batch's stages' outputs' shapes, appended to (see :meth:`_row_changer`).
        ``count``: the number of micro-batches, the call's ``chunks`` wherever ``held`` or ``watched`` are
        kept (only for pieces cut by ``tensor_split(chunks)``), which the errors name (``self.chunks`` may
        have been set since the call read it)."""
        if held is not None and s == 0:
            # (Those the first stage gets: on a host input, the copy's, which are the micro-batch's own too.)
            held[m] = _containers(value)
        try:
            output = stage(value)
        except Exception as e:
            context = f"(raised in stage {name!r} (index {s}) on micro-batch {m} of {count} of {type(self).__name__}"
            if s == 0 and count > 1 and isinstance(e, RuntimeError) and isinstance(value, torch.Tensor) \
                    and value.dim() == 1:
                # (A 1-D batch -- token ids for an embedding -- is cut so too, rightly; one unbatched
                # sample is not. Shape errors are RuntimeErrors; an id out of range, an IndexError, is not.)
                context += ("; the input is 1-D, cut into micro-batches along its only dimension: if it is one "
                            "unbatched sample rather than a batch, use chunks=1")
            raise self._stage_error(e, context + self._nested_short(e, name, count) + ")")
        if rows is not None:
            # (Its shape kept, read only where the join fails: the outputs between stages are gone
            # by then. Not its size along dimension 0, asking its dimensions first: 2.6 against
            # 1.8 us added to an eager call of 8 stages by 4 micro-batches, on a CPU host.)
            rows[m].append(output.shape if isinstance(output, torch.Tensor) else None)
        if held is not None:
            for h in held[m] or ():
                change = _change(h)
                if change is not None:
                    kind = type(h.container).__name__
                    what = (f"{_where(h.path)}, a {kind} in the pipeline's input," if h.path else
                            f"the pipeline's input, a {kind},")
                    raise RuntimeError(
                        f"{type(self).__name__}: stage {name!r} (index {s}) changed {what} in place on "
                        f"micro-batch {m} of {count} ({change}), where the "
                        f"input's lists and dicts are expected left as they came: with chunks={count} each "
                        f"micro-batch gets a {kind} of its own (holding its part of the input's tensors), so "
                        f"yours would not see the change, where nn.Sequential makes it in yours, once, for the "
                        f"whole batch. Return what the stage computes instead of writing it into its input "
                        f"(e.g. `return {{**d, 'k': v}}`, `cache + [k]`), or use chunks=1.")
        for shared in watched or ():
            # (Read on the host, in issue order: on the CUDA path too, a write shows in the
            # version as soon as the stage has issued it.)
            if any(t._version != v for t, v in shared.versions[m]):
                if shared.whole:
                    assert callable(shared.names)
                    raise RuntimeError(
                        f"{type(self).__name__}: stage {name!r} (index {s}) wrote in place on micro-batch {m} of "
                        f"{count} into {shared.names()[0]}, a 0-dim tensor (or into another view of its memory, whose "
                        f"writes its version counter counts too), which every micro-batch gets whole, the same "
                        f"object: with chunks={count} each micro-batch's stages would write it again after reading "
                        f"the earlier micro-batches' writes, so the result would not be nn.Sequential's, which "
                        f"writes it once for the whole batch. Write into a copy inside the stage (out-of-place "
                        f"operations), or use chunks=1.")
                why = (
                    "input tensors that share memory across micro-batches (as (x[:-1], x[1:]) do): with "
                    f"chunks={count}, one micro-batch's stages write elements that another micro-batch "
                    "reads through the other tensor, before or after the write, so the result would not be "
                    "nn.Sequential's, which writes them once for the whole batch (and without autograd the input "
                    "tensors are now written in part)" if shared.across else
                    f"input tensors that share memory, of which {shared.uncopied}, a leaf that requires grad (or a "
                    f"view of one), is handed on uncopied, as autograd refuses to write it in place, and the others "
                    f"copied while autograd records: the write does not show in {shared.uncopied}, as it does in "
                    f"nn.Sequential" if shared.uncopied else
                    "input tensors that share memory in a layout that no one tensor holds with the batch along "
                    f"dimension 0: with chunks={count}, while autograd records, each micro-batch of them "
                    "is a copy of its own, so the write does not show in the other tensor, as it does in "
                    "nn.Sequential")
                raise RuntimeError(
                    f"{type(self).__name__}: stage {name!r} (index {s}) wrote in place on micro-batch {m} of "
                    f"{count} into {shared.names} (or, without autograd, into another view of their memory, "
                    f"whose writes their version counter counts too), {why}. Pass tensors that share no memory "
                    f"(e.g. .clone() one of them), write into a copy inside the stage (out-of-place operations), "
                    f"or use chunks=1.")
        if block is not None and m == 0:
            self._refuse_stacked(s, name, block, output)
        return output

    def _refuse_stacked(self, s: int, name: str, block: Parallel, output: Any) -> None:
        r"""Refuses stage ``s`` returning a ``Parallel`` (``block``) stacking branches along the batch's dimension.

        Its ``output`` (the first micro-batch's) then holds the batch along
        dimension 1, and so does every later stage's: the micro-batches' results
        joined along dimension 0 would be joined along the branches, silently
        where the branches are as many as a micro-batch's samples ((4, 2, 3) for
        the whole batch's (2, 4, 3)). (Here, as the stage returns it, for the
        last stage too: joined as they come on the GPU (``_Gather``), its
        results are not looked at again.)
        """
        stacking = _stacked_on_batch(block, output)
        if stacking is not None:
            where = "" if stacking is block else " (one of its branches, a Parallel too)"
            resolved = "" if stacking.dim == 0 else ", dimension 0 of its output"
            raise ValueError(
                f"{type(self).__name__}: stage {name!r} (index {s}) returns the result of a Parallel{where} "
                f"stacking its branches' outputs along dimension {stacking.dim}{resolved} ({_describe(output)} "
                f"for micro-batch 0), which is where the micro-batches' samples are: the batch moves to dimension "
                f"1, where the stages after it do not look for it, and the micro-batches' results, joined along "
                f"dimension 0, would be joined along the branches. Stack along another dimension (dim=1), or "
                f"use chunks=1.")

    def _pipeline(
        self, stages: list[tuple[str, nn.Module]], input: Any, pieces: list[Any], device: torch.device, copy: bool,
        ahead: bool = False, seen: list[_Returned] | None = None, held: list[list[_Held] | None] | None = None,
        watched: list[_Shared] | None = None, rows: list[list[torch.Size | None]] | None = None,
    ) -> list[Any] | _Gather:
        r"""Run every piece of ``input`` through every lane on the side streams.

        ``seen`` receives the versions of each piece's output, in order (see :meth:`_concat`);
        ``held``, ``watched``, ``rows``: see :meth:`_call`.

        Returns the outputs per piece, or, where the last lane concatenated
        them as they came (:class:`_Gather`), the concatenation.

        Work is issued as a wavefront: at step ``t`` lane ``l`` gets piece
        ``t - l``, from the last lane to the first. The items of one step do
        not depend on each other (each depends only on the previous step), so
        even when the CPU issues kernels no faster than the GPU runs them the
        GPU always has work queued on several streams; and handling the older
        piece first keeps the pipeline draining. Each lane still receives its
        pieces in order, which its stream preserves.

        With ``ahead``, a copy lane reading pinned memory is issued whole
        before the wavefront: its copies wait for nothing but the fork and cost
        the CPU only their enqueueing, so the copy engine runs them back to
        back while the CPU issues the compute. In the wavefront the copy of
        piece ``m + 1`` was enqueued only after the compute of piece ``m``, and
        on the GPU machine the CPU took longer to issue that compute (two
        eager convolutions) than the copy engine took to copy a piece: it
        idled 86 us between copies. (Stages replayed from graphs are issued in
        microseconds, yet there too issuing the copies first measured as fast
        as the wavefront, or faster: 961 against 984 us at 4 pieces.) A
        pageable input is staged into pinned memory by the CPU piece by
        piece, which the wavefront overlaps with the GPU's work.
        """
        count = len(pieces)
        lanes: list[Callable[[int, Any], Any]] = []
        if copy:
            def copy_lane(m: int, value: Any) -> Any:
                try:
                    return _to_device(value, device, non_blocking=True, pinned=ahead)
                except Exception as e:
                    raise _with_context(e, f"(raised copying micro-batch {m} of {count} to {device} in "
                                           f"{type(self).__name__})")
            lanes.append(copy_lane)
        for s, (name, stage, block) in enumerate(stages):
            lanes.append(lambda m, v, s=s, name=name, stage=stage, block=block:
                         self._call(s, name, stage, m, count, v, held, block, watched, rows))
        n_lanes = len(lanes)

        capturing = _capture_underway()
        pool = _pool(device, capturing)
        caller = _current_stream(device)
        base = pool.offset
        streams = pool.side_streams(base, n_lanes, caller)
        recording = torch.is_grad_enabled() and not capturing and streams[0] is not caller
        # Events: one per (piece, lane), then the fork, then one join per lane.
        events, e0 = _take_events(device, count * n_lanes + 1 + n_lanes)
        fork = events[e0 + count * n_lanes]
        joins = events[e0 + count * n_lanes + 1:]

        values = list(pieces)
        done = False
        last = n_lanes - 1
        gather = _Gather([p.shape[0] for p in pieces], device) if isinstance(input, torch.Tensor) else None
        used = 0  # lanes 0 .. used-1 have work enqueued
        local = pool._local
        # The first slot of the blocks nested in each lane's stage (see _DevicePool.offset):
        # above those of the lanes issued before, the same for every piece of the lane.
        nested: list[int | None] = [None] * n_lanes
        # What each lane handed the next for its last piece, and its versions (see _handed).
        handed: list[_Returned | None] = [None] * n_lanes

        def issue(lane: int, m: int) -> None:
            r"""Enqueue lane ``lane``'s work on piece ``m`` on the lane's stream."""
            nonlocal used
            stream = streams[lane]
            _set_stream(stream)
            start = nested[lane]
            if start is None:
                start = nested[lane] = local.high
            local.offset = start
            used = max(used, lane + 1)
            if lane == 0:
                if m == 0:
                    # Lane 0 reads the input (made on the caller's stream); every
                    # later lane follows lane 0 through the events, so one wait on
                    # the fork orders the whole call after the caller's earlier
                    # work (including optimizer updates of the parameters).
                    _wait(fork, stream)
                if recording:
                    # Saved for backward, a piece is read again on this lane's stream,
                    # and freed to the caller's pool as soon as that read is enqueued
                    # (see _streams._join_backward): the allocator must wait for it.
                    _mark(values[m], stream)
            else:
                _wait(events[e0 + m * n_lanes + lane - 1], stream)
                if streams[lane - 1] is not stream:
                    _mark(values[m], stream)
            if lane < last:
                # Read by the next lane on its stream: a graphed module inside this stage
                # must not lend it buffers that its next replay on this lane overwrites.
                crossing, _graph_state.crossing = _graph_state.crossing, True
                try:
                    values[m] = lanes[lane](m, values[m])
                finally:
                    _graph_state.crossing = crossing
                _record(events[e0 + m * n_lanes + lane], stream)  # the next lane waits on it
                if count > 1 and lane >= copy:  # (a copy lane's outputs are new)
                    handed[lane] = self._handed(handed[lane], values[m], lane - copy, m, pieces)
                return
            values[m] = lanes[lane](m, values[m])
            if gather is not None and gather.add(m, values[m]):
                # In its place in the result: let the piece go now. Its memory is
                # reused sooner, and a graphed last stage (host input) sees its
                # output released before the next replay, so it lends the next
                # one instead of copying it (both on this lane's stream). Not
                # held in ``seen`` either: Gather.restore says what it gives back.
                values[m] = None
                if seen is not None:
                    seen.append(None)
            elif seen is not None:
                seen.append(_returned(values[m]))
            if m == count - 1:  # no lane follows the last: only the join waits, once
                _record(events[e0 + m * n_lanes + lane], stream)

        # Stages that fork (a nested Parallel or ParallelSequential) take the
        # pool's streams after ours.
        high = local.high
        local.offset = local.high = base + n_lanes
        try:
            _record(fork, caller)
            if ahead:
                for m in range(count):
                    issue(0, m)
            for t in range(count + n_lanes - 1):
                for lane in range(min(t, last), 0 if ahead else -1, -1):
                    if t - lane >= count:
                        break
                    issue(lane, t - lane)
            done = True
        finally:
            local.offset, local.high = base, max(high, local.high)
            _local.cursor = e0
            _set_stream(caller)
            if done:
                # Join: the last lane's last event follows every lane's every
                # piece (each lane waited on its predecessor, piece by piece).
                _wait(events[e0 + count * n_lanes - 1], caller)
            else:
                # A lane raised: join every stream that has work enqueued, so
                # the caller never runs ahead of it, then let the error go.
                for lane in range(used):
                    _record(joins[lane], streams[lane])
                    _wait(joins[lane], caller)
        if not capturing:
            # Stage parameters take one gradient per piece, summed on their lane.
            _join_backward((input,), streams[:used])
        if gather is not None and gather.complete():
            # The caller reads only the concatenation; the pieces were read on their own lane.
            _mark(gather.out, caller)
            return gather
        if gather is not None:
            gather.restore(values, seen)
        for value in values:
            _mark(value, caller)
        return values


class _Gather:
    r"""The last lane's outputs concatenated along dimension 0 as they come, on that lane.

    A concatenation on the caller's stream after the join would start only once
    the last piece is done, and lengthen every call by a pass over the whole
    output (36 us for the 51 MB of the host-to-device benchmark on the GPU
    machine); copied into its place as soon as it is made, each piece but the
    last overlaps the pipeline's other work. Taken only where the result is the
    one ``torch.cat`` gives: contiguous (and not also channels-last) strided
    tensors of one dtype, the input pieces' sizes along dimension 0, the same
    other dimensions, and no autograd history to record (``copy_`` into a
    buffer would record it differently). Otherwise ``complete()`` is false and
    the caller concatenates as before, the pieces already taken given back as
    views of the result (:meth:`restore`).
    """

    __slots__ = ("sizes", "device", "out", "places", "taken", "ok", "first", "version")

    def __init__(self, sizes: list[int], device: torch.device) -> None:
        self.sizes, self.device = sizes, device  # (the lanes': a piece copied to the host is read by the host)
        self.out: torch.Tensor | None = None
        # The first piece, weakly: held, a graphed last stage would see its output kept
        # and copy the next instead of lending it (see _pipeline).
        self.first: Callable[[], Any] = lambda: None
        self.version: int | None = None  # the first piece's, as the stage returned it (see restore)
        self.places: tuple[torch.Tensor, ...] = ()  # each piece's place in ``out``
        self.taken = 0
        self.ok = len(sizes) > 1

    def add(self, m: int, value: Any) -> bool:
        r"""Copy piece ``m`` into its place (on the current stream); whether it was taken."""
        if not self.ok:
            return False
        if self.out is None:
            if (not isinstance(value, torch.Tensor) or value.device != self.device or value.layout != torch.strided
                    or value.dim() == 0 or value.shape[0] != self.sizes[m]
                    or (value.requires_grad and torch.is_grad_enabled())
                    or not value.is_contiguous() or _also_channels_last(value)):
                self.ok = False
                return False
            # Allocated on this lane's stream, which writes it; the caller's
            # stream reads it after the join (record_stream, as for outputs).
            # Every piece's place is cut at once: an eager pipeline fed from the
            # host is bound by its CPU, and each view operation costs it about
            # as much as a launch.
            self.out = value.new_empty((sum(self.sizes), *value.shape[1:]))
            self.places = self.out.split(self.sizes)
            # A view (of a table the stage keeps: ``self.pos[:T]``, as many rows as this piece by
            # chance) is held: where the next piece is the same elements, the concatenation
            # returns this one (see _one_view), which a copy in the result would not be. (A view
            # of an intermediate of the stage's own keeps that piece's memory to the call's end.)
            self.first = (lambda: value) if value._base is not None else weakref.ref(value)
            self.version = None if value.is_inference() else value._version
        else:
            place = self.places[m]
            # The first piece's checks, against its place. Whether a contiguous
            # tensor is also channels-last depends on its sizes past dim 0 (and
            # the strides those give), which equal the first piece's here. A
            # piece of another class than the first (a tensor subclass) is left
            # to torch.cat, which dispatches to it; copied in, it would be lost.
            # The first piece itself again (a parameter every micro-batch returns) is not
            # batched: the concatenation returns it as it is.
            if (value is self.first() or type(value) is not type(place) or value.layout != torch.strided
                    or value.shape != place.shape
                    or value.dtype != place.dtype or value.device != place.device
                    or (value.requires_grad and torch.is_grad_enabled()) or not value.is_contiguous()):
                self.ok = False
                return False
        self.places[m].copy_(value)
        self.taken += 1
        return True

    def restore(self, values: list[Any], seen: list[Any] | None = None) -> None:
        r"""Give back the pieces taken as views of the result, where a later one was not.

        The pieces taken are the first ``taken`` (the last lane adds them in
        order and stops at the first it declines); a later ``None`` is a
        stage's own output, left for the concatenation to refuse. The first
        is given back as itself where it lives on: a later piece may be the
        same tensor. ``seen`` (see ``ParallelSequential._concat``) gets what
        each piece given back was as the stage returned it: a copy taken then,
        written by nothing since; the first itself at the version it had.
        """
        for m in range(self.taken):
            values[m] = self.places[m]
            if seen is not None:
                seen[m] = _returned(values[m])
        first = self.first()
        if self.taken and first is not None:
            values[0] = first  # (itself, which a later piece may be: see add)
            if seen is not None:
                seen[0] = _Returned([first], [self.version], None)

    def complete(self) -> bool:
        return self.ok and self.taken == len(self.sizes)


def _also_channels_last(t: torch.Tensor) -> bool:
    r"""Whether a contiguous ``t`` is channels-last too (size-1 dims): ``torch.cat`` may then pick either layout."""
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)


def _proxies(value: Any) -> bool:
    r"""Whether ``value`` holds a :class:`torch.fx.Proxy` (symbolic tracing)."""
    return any(isinstance(leaf, torch.fx.Proxy) for leaf in pytree.tree_leaves(value))


def _device(value: Any) -> torch.device | None:
    r"""The device of ``value``'s first tensor, as :func:`._inputs._input_device` finds it, looking inside
    the containers pytree keeps whole too (a CPU tensor in a dict subclass is a host input as in a dict)."""
    return value.device if isinstance(value, torch.Tensor) else _leaf_device(_leaves(value))


def _pinned(value: Any) -> bool:
    r"""Whether every CPU tensor of ``value`` is in page-locked memory (copies of it are asynchronous)."""
    leaves = (value,) if isinstance(value, torch.Tensor) else _leaves(value)
    return all(t.is_pinned() for t in leaves if isinstance(t, torch.Tensor) and t.device.type == "cpu")


def _to_device(value: Any, device: torch.device, non_blocking: bool, pinned: bool = False) -> Any:
    r"""Copy the CPU tensors of ``value`` to ``device``.

    Non-blocking copies need page-locked memory to be asynchronous: a pageable
    piece is first copied into a pinned staging buffer (on the CPU, now), and
    the device copy reads that buffer later, on the copy stream. Pinned memory
    (the caller's or the staging buffers) freed before the copy has run is not
    reused early: the caching host allocator records the copy's stream.

    ``pinned``: the caller found every CPU tensor of ``value`` (or of the input
    it was cut from) page-locked with :func:`_pinned`, and none is asked again.
    Each ``is_pinned()`` asks the CUDA driver about the pointer (1-2 us of CPU
    on the H100 machine), and a pipeline fed from the host is often bound by
    its CPU: the pieces of a pinned input need no asking.
    """

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return t
        if non_blocking and not pinned and not t.is_pinned():
            t = t.pin_memory()
        return t.to(device, non_blocking=non_blocking)

    if isinstance(value, torch.Tensor):
        return move(value)
    leaves, spec = _flatten(value)  # (the containers pytree keeps whole too: see _device)
    return pytree.tree_unflatten([move(t) for t in leaves], spec)
