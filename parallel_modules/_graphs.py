r"""Whole-forward CUDA graphs: capture once per input signature, replay afterwards.

:class:`_CudaGraphs` is the graph cache of one module (``Parallel`` or
``ParallelSequential``): ``graphs(forward, args, kwargs)`` runs ``forward``
eagerly where graphs cannot apply, and otherwise looks the call's signature up,
capturing a new graph the first time a signature is seen and replaying it on
later calls.

A capture follows :func:`torch.cuda.make_graphed_callables`:

* **static inputs** -- clones of the first call's tensor inputs; later calls
  copy their inputs into them, so a graph only ever reads addresses it owns.
  An inference signature also gets a graph that reads the first call's inputs
  where they lie, replayed for inputs found there (``_CudaGraphs._reader``):
  it saves the copy's launch;
* **warm-up** -- the module runs ``_WARMUP_ITERS`` times on a side stream
  (the capture stream, which waited on the caller's stream) so that lazy
  initialisation, cuDNN/cuBLAS heuristics and side-stream creation stay out of
  the graph; buffers (BatchNorm statistics, ``num_batches_tracked``) are
  snapshotted before and restored after, so the module's state after ``n``
  graphed calls equals its state after ``n`` eager calls;
* **capture** -- ``torch.cuda.graph(..., capture_error_mode="thread_local")``,
  so CUDA work of other threads does not invalidate the capture; the module's
  side streams fork from and join back into the capture stream (the capture
  stream is the current stream, which is what ``_run_forked`` forks from);
* **training** -- when autograd records and an input or a parameter requires
  grad, the backward pass is captured too (``torch.autograd.grad`` of the
  static outputs with respect to the inputs and parameters that require grad)
  and both graphs are wrapped in an :class:`torch.autograd.Function`, whose
  backward replays the backward graph. Parameters are inputs of that function,
  so autograd routes their gradients as usual; on a plain ``backward()`` with
  nothing listening on them, the function writes them into ``.grad`` itself
  when the backward pass ends (see :class:`_HandOut` and ``_Graph.token``).
  With ``direct_grads`` the
  parameters are left out of its inputs whenever nothing listens on them, so
  that the engine visits no accumulator of theirs either;
* the first call's result is the graph's first **replay** on that call's
  inputs, so every user call -- the first included -- runs the module once;
* **outputs** -- clones of the graph's output buffers, or the buffers
  themselves once the caller is seen releasing every output before its next
  call (see :class:`_Lending`); never a buffer the caller still holds.

Memory pools: each signature has a pool of its own, shared only by its
forward and backward graphs (captured, and always replayed, in that order,
as in ``make_graphed_callables``). Sharing one pool between the graphs of
different signatures would be safe only if their replays never overlapped:
the forward graph of one signature may reuse the blocks that hold another
signature's saved activations between its forward and backward, and graphs
replayed from two threads run concurrently on two streams. A pool per
signature costs memory bounded by ``max_graphs``; evicted graphs give their
pool back, and the next capture (``torch.cuda.graph`` empties the cache)
returns it to the device, so repeated captures do not grow memory.

Static buffers (inputs, incoming gradients) are allocated on the capture
stream outside the capture. Blocks of that stream are only ever reused by a
later warm-up or capture, which both start with a device synchronisation, so
a buffer freed with its graph cannot be handed out while a replay on another
stream still reads it.

Threads: captures are serialised process-wide (one capture stream per device);
a module's cache is guarded by a lock; each graph has a lock held around
copy-in, replay and copy-out, and a replay from another stream than the
previous one first waits for that stream (``wait_stream``), so it overwrites
static buffers only after the previous replay and what the caller enqueued
after it are done.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import operator
import os
import statistics
import sys
import threading
import traceback
import warnings
import weakref
from collections import OrderedDict, deque
from typing import Any, Callable, Hashable, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
# What torch.func.functional_call swaps a module's parameters with (see ``_with_aliases``).
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from ._compile import _WHOLE
from . import _watch
from ._watch import _has_scalars, _swapped
from ._fusion import _GLOBAL_HOOKS, _Handle, _moded, _functorch_active, _hook_dicts
from ._inputs import (_BY_VALUE, _bounded_add, _grad_and_training, _input_device, _integer, _signature,
                      _value_key)
from ._saved import _saved_storages
from ._streams import (_CAPTURE_PRIORITY, _capture_underway, _current_stream, _dense, _dispatch_modes,
                       _graph_state, _hidden_tensors, _in_backward, _is_tracing, _pools, _result_changing_function_modes,
                       _saved_hooks_recording, _storage_address, _use_count)

__all__: list[str] = []

# As torch.cuda.make_graphed_callables: enough for lazy initialisation and
# autotuning heuristics to settle before capture.
_WARMUP_ITERS = 3
# Signatures remembered as "cannot be captured" (graph_fallback=True).
_MAX_FAILED = 1024
# Calls in a row that find the same tensors swapped into a graphed module's parameter or
# buffer slots, after which they are taken as its own (see _CudaGraphs._unchanged).
_SWAPS_KEPT = 3
# One attribute of each of many tensors, read in C (a Python loop over mlp8's 64
# parameters is a measurable part of a training call).
_requires_grad = operator.attrgetter("requires_grad")
_grad_of = operator.attrgetter("grad")
# The dtype a parameter's accumulator gives its ``.grad`` (``None``: the gradient's own), where
# torch lets it differ from the parameter's (``Tensor.grad_dtype``, torch >= 2.10).
_grad_dtype_of = operator.attrgetter("grad_dtype" if hasattr(torch.Tensor, "grad_dtype") else "dtype")
_data_ptr = torch.Tensor.data_ptr
_tensor_uses = getattr(torch.Tensor, "_use_count", None)  # references to a tensor's C++ object

# ``active``: this thread is warming up or capturing a graphed module. A graphed
# module called from inside (a nested block) runs eagerly and is recorded by the
# enclosing capture instead of capturing a graph of its own.
_local = _graph_state
# One capture at a time in the process: captures share a capture stream per
# device, and ``torch.cuda.graph`` synchronises the device on entry.
_capture_lock = threading.Lock()
_capture_streams: dict[int, torch.cuda.Stream] = {}

# ``_use_count``: the number of strong references to a storage, how inductor's
# cudagraph trees tell whether a graph's output is still in use. Where a torch
# release lacks it, outputs are always cloned (``tests/test_graphs.py`` notices).
# Calls in a row whose cloned outputs were already freed when the next call
# came, after which a graph lends its output buffers; and calls watched before
# concluding that the caller keeps outputs.
_LEND_AFTER = 2
_WATCH = 16
# How many bytes the outputs of a graph reading its inputs in place may exceed the inputs
# by: its output buffers are memory held beside the first graph's, and a call copying its
# input in copies the first graph's outputs into them; and the alignment (the allocator's)
# modulo which the static inputs lie where the capturing call's inputs did, and a reader's
# inputs must too (cuBLAS and cuDNN pick kernels by alignment).
_IN_PLACE_SPARE_BYTES = 4 << 20
_IN_PLACE_ALIGNMENT = 512
# Calls in a row copying their inputs in, after which a signature drops its reader: its
# caller no longer passes inputs where the first call's lay, and each such call pays a
# copy of the outputs too (see _Graph.replay).
_READER_MISSES = 16
# Time spent deciding whether such a graph is faster than copying in (see _quickest), and
# by how much copying in must be faster for the reader to be dropped (see _CudaGraphs._reader).
_READER_BUDGET_MS = 30.0
_READER_SLACK = 0.03
# Returned by a replay that would overwrite an output the caller still holds, or a
# gradient lent to ``.grad`` that something else still holds (see ``_Graph.reclaim``).
_HELD: Any = object()


class _GradsHeld(Exception):
    r"""Raised inside a training replay's forward, under the graph's lock, when ``_Graph.reclaim`` fails."""


_TORCH_DIR = os.path.dirname(torch.__file__)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


# cuBLAS keeps one workspace per (handle, stream) in a process-wide cache, allocated at the
# first matrix product on a stream and baked into every graph captured on that stream. A graph
# whose workspace came from that cache replays into memory it does not own: whoever clears the
# cache -- inductor's CUDA graph trees (mode="reduce-overhead") do, around every warm-up and
# recording, and recent torch releases do when any graph captured on the stream is destroyed
# -- frees it, and once the allocator reuses or releases it, replays corrupt other tensors or
# fault with an illegal memory access (pytorch/pytorch#193402). Clearing the cache right
# before a capture makes cuBLAS allocate the workspaces the capture needs inside it, from the
# signature's private pool, which lives as long as the graph; clearing it again afterwards
# keeps later eager products out of that pool. Cudagraph trees do the same
# (torch/_inductor/cudagraph_trees.py, clear_cublass_cache). The cost: each graph holds a
# workspace per stream that runs products in it (32 MiB on sm90 by default; the
# CUBLAS_WORKSPACE_CONFIG environment variable sets the size), bounded by max_graphs.
_clear_cublas = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)


def _clear_cublas_workspaces() -> None:
    if _clear_cublas is not None:
        _clear_cublas()


@contextlib.contextmanager
def _collector_paused() -> Any:
    r"""Keep Python's garbage collector from running during warm-up and capture.

    It runs whenever allocations pass its threshold; a CUDA graph it frees in the
    middle of a capture (one of an earlier module, left in a reference cycle) is
    reset there, and resetting a graph is not permitted on a capturing thread: the
    driver invalidates the capture ("operation not permitted when stream is
    capturing"), and the next kernel launched into it fails (cuBLAS reports
    CUBLAS_STATUS_EXECUTION_FAILED). Garbage made meanwhile waits for the next
    collection after the capture.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


# ``CUDAGraph.replay`` without its Python frame (the method of the C base class it calls).
_launch = getattr(getattr(torch._C, "_CUDAGraph", None), "replay", None) or torch.cuda.CUDAGraph.replay


# Whether autograd warns of an accumulator fed from another stream (torch >= 2.9), and setting it.
_warns_of_mismatch = getattr(torch._C, "_warn_on_accumulate_grad_stream_mismatch", lambda: False)
_warn_mismatch = getattr(torch._C, "_set_warn_on_accumulate_grad_stream_mismatch", lambda enabled: None)


# The settings of a graphed block, which its graph cache is made with.
_GRAPH_SETTINGS = frozenset({"cuda_graph", "max_graphs", "static_outputs", "graph_fallback", "direct_grads"})


def _check_graph_setting(owner: str, name: str, value: Any) -> Any:
    if name == "max_graphs":
        count = _integer(value)  # (as ``dim`` and ``chunks`` take integers)
        if count is None:
            raise TypeError(f"{owner}: max_graphs must be an int >= 1 (graphs kept per module), got "
                            f"{type(value).__name__} ({value!r}).")
        if count < 1:
            raise ValueError(f"{owner}: max_graphs must be an int >= 1 (graphs kept per module), got {count!r}.")
        return count
    if not isinstance(value, bool):  # (not bool(value): "False" would be True)
        raise TypeError(f"{owner}: {name} must be True or False, got {type(value).__name__} ({value!r}).")
    return value


def _capture_stream(index: int) -> torch.cuda.Stream:
    stream = _capture_streams.get(index)
    if stream is None:
        # (Of the capture pool's priority: see _streams._pool.)
        stream = _capture_streams[index] = torch.cuda.Stream(index, priority=_CAPTURE_PRIORITY)
    return stream


# Whether autocast is on for any device: one C call without arguments, where asking for CUDA's
# parses a device string (0.3 us of every call's key when autocast is off, as it mostly is).
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast_state() -> Hashable:
    if _any_autocast() and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


_forward_ad = torch.autograd.forward_ad


_SAVED_HOOKS, _BACKWARD, _FORWARD_AD = "saved-tensor hooks", "a backward pass", "forward-mode AD"
_ANOMALY = "anomaly detection"


def _autograd_busy() -> str:
    r"""Why autograd needs this call run eagerly (``""``: it does not).

    Under saved-tensor hooks (``torch.utils.checkpoint(use_reentrant=False)``,
    ``save_on_cpu``) while autograd records, the hooks must see the call's own
    saved tensors, and a graph holds its activations in its pool whatever
    they do. Inside a backward pass (a checkpoint's recomputation, a custom
    ``backward``) the call runs on autograd's thread, possibly while this
    process captures -- waiting there for the capture, which waits for that
    backward, would hang. Under forward-mode AD a replay would drop the tangents.
    Under anomaly detection (``torch.autograd.set_detect_anomaly(True)``) while
    autograd records, the engine checks every backward operation's output for
    NaNs by reading it on the host (``.item()``): inside the capture of a
    backward pass that synchronisation broke the capture, so a training call
    that runs eagerly refused to be graphed; and a replay would check only the
    whole block's gradients, where detection names the operation that made a
    NaN and the forward line that called it.
    """
    if _saved_hooks_recording():
        return _SAVED_HOOKS
    if _in_backward():
        return _BACKWARD
    if _forward_ad._current_level >= 0:
        return _FORWARD_AD
    return _ANOMALY if torch.is_anomaly_enabled() and torch.is_grad_enabled() else ""


_precision = getattr(torch._C, "_get_fp32_precision_getter", None)


def _precision_of(op: str) -> bool:
    r"""Whether the precision API tells ``op``'s CUDA setting (a torch that lacks it raises)."""
    try:
        return _precision is not None and isinstance(_precision("cuda", op), str)
    except Exception:
        return False


# cuDNN's recurrent layers have a TF32 setting of their own (``torch.backends.cudnn.rnn.fp32_precision``;
# the legacy ``torch.backends.cudnn.allow_tf32`` sets it with the convolutions'), which the RNN
# descriptor a capture bakes in reads: an LSTM captured in float32 replayed its float32 kernels after
# the setting turned TF32 on, where eager calls ran TF32 (and the other way round).
_RNN_PRECISION = _precision_of("rnn")


# Other settings that choose the kernels a capture bakes in: reduced-precision reductions
# and accumulation of cuBLAS, deterministic algorithms, which scaled-dot-product
# attention backends may run (``torch.nn.attention.sdpa_kernel``) and whether the math one may
# reduce in half precision (``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp``), whether
# cuDNN runs at all (``torch.backends.cudnn.enabled = False``, or its ``flags(enabled=False)``
# context, which code wraps around recurrent layers for a double backward: eager calls then run
# torch's own convolutions and recurrent kernels, a graph its captured cuDNN ones), and which BLAS
# library runs matrix products (``torch.backends.cuda.preferred_blas_library``: cuBLAS or cuBLASLt,
# whose kernels round otherwise). Also: whether deterministic algorithms only warn of an operation
# that has none (``use_deterministic_algorithms(True, warn_only=True)``: the capture then ran it,
# and a replay would where an eager call raises) and fill the memory ``torch.empty`` returns
# (``torch.utils.deterministic.fill_uninitialized_memory``, kernels of their own), cuDNN's
# benchmarked algorithms (``torch.backends.cudnn.benchmark``: a replay ran the fastest one timed,
# where eager runs the heuristic's, rounding otherwise) and its depthwise kernel
# (``torch.backends.cudnn.depthwise_kernel``), and whether FlashAttention 3 replaces flash
# attention's kernels (``torch.nn.attention.activate_flash_attention_impl("FA3")``). (Getters torch
# lacks are left out.)
_KERNEL_GETTERS = tuple(getter for getter in (getattr(torch._C, name, None) for name in (
    "_get_cublas_allow_fp16_reduced_precision_reduction", "_get_cublas_allow_bf16_reduced_precision_reduction",
    "_get_cublas_allow_fp16_accumulation", "_get_deterministic_algorithms", "_get_cudnn_deterministic",
    "_get_flash_sdp_enabled", "_get_mem_efficient_sdp_enabled", "_get_math_sdp_enabled", "_get_cudnn_sdp_enabled",
    "_get_math_sdp_allow_fp16_bf16_reduction", "_get_cudnn_enabled", "_get_blas_preferred_backend",
    "_get_deterministic_algorithms_warn_only", "_get_deterministic_fill_uninitialized_memory",
    "_get_cudnn_benchmark", "_get_cudnn_depthwise_kernel", "_get_fa3_sdp_enabled",
)) if getter is not None)
# Their names, as explain() gives a graph's settings where they differ from the process's now.
_KERNEL_NAMES = tuple(getter.__name__.removeprefix("_get_") for getter in _KERNEL_GETTERS)
# The order in which scaled-dot-product attention tries the backends enabled
# (``sdpa_kernel([...], set_priority=True)``): the first that takes a call runs it. (A list, which
# a key cannot hold: made a tuple.)
_sdp_priority = getattr(torch._C, "_get_sdp_priority_order", list)


def _kernel_settings() -> Hashable:
    r"""The process's settings that decide which kernels a capture records (see :func:`_tf32`)."""
    return _tf32(), tuple([getter() for getter in _KERNEL_GETTERS]), tuple(_sdp_priority())


def _kernel_differences(settings: Hashable) -> list[str]:
    r"""Which of the kernel ``settings`` a graph was captured under (see :func:`_kernel_settings`) differ
    from the process's now, as ``name=value``."""
    tf32, flags, priority = settings
    now_tf32, now_flags, now_priority = _kernel_settings()
    tf32_names = (("cuda matmul fp32_precision", "cuda conv fp32_precision", "cuda rnn fp32_precision",
                   "cuda fp32_precision", "fp32_precision") if len(tf32) == 5
                  else ("cuda.matmul.allow_tf32", "cudnn.allow_tf32"))
    named = [*zip(tf32_names, tf32, now_tf32), *zip(_KERNEL_NAMES, flags, now_flags),
             ("sdp priority order", priority, now_priority)]
    return [f"{name}={value!r}" for name, value, now in named if value != now]


def _tf32() -> Hashable:
    r"""The float32 precision settings of CUDA's matrix products, convolutions and recurrent layers (TF32 or not).

    Read through the precision API where torch has it (``torch.backends.fp32_precision``
    and its per-backend settings, which the legacy ``allow_tf32`` flags also set): once
    it is used, the legacy getters raise. A setting of ``"none"`` inherits the next one's.
    (The legacy ``torch.backends.cudnn.allow_tf32`` is one flag for convolutions and
    recurrent layers alike.)
    """
    if _precision is not None:
        return (_precision("cuda", "matmul"), _precision("cuda", "conv"),
                _precision("cuda", "rnn") if _RNN_PRECISION else None, _precision("cuda", "all"),
                _precision("generic", "all"))
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def _addresses(tensors: Sequence[torch.Tensor]) -> Any:
    r"""Where ``tensors`` lie: the data pointer of one, a tuple of several's (see ``_Graph.reader``)."""
    return tensors[0].data_ptr() if len(tensors) == 1 else tuple([t.data_ptr() for t in tensors])


def _alignment(args: tuple, kwargs: dict) -> Hashable:
    r"""Where the tensor inputs lie modulo 16 bytes, the alignment PyTorch asks of cuBLAS and
    cuDNN kernels: a graph captured for inputs at one runs the kernels chosen for it, which
    may round otherwise than eager on inputs at another (its static inputs lie as the
    capturing call's did: see :func:`_static_like`)."""
    if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor and args[0].layout == torch.strided:
        return args[0].data_ptr() & 15
    try:
        return tuple([t.data_ptr() & 15 for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and _dense(t)])
    except RuntimeError:  # (a wrapper subclass without storage: what its own operations make of it)
        return None


# How many times its elements' count a static input's memory may span to keep its input's layout
# (a slice of every other row spans 2; see _static_like).
_MAX_SPAN = 4


def _static_like(t: torch.Tensor) -> torch.Tensor:
    r"""A tensor of ``t``'s values laid out as ``t``: its strides, and its address modulo
    ``_IN_PLACE_ALIGNMENT``.

    Kernels pick their paths by both (contiguity, vectorized loads, cuBLAS and cuDNN
    heuristics): a graph reading a dense copy of an expanded, sliced or offset input
    rounded otherwise than eager on the input itself (a last-bit difference of a Conv1d
    on an expanded input, a training BatchNorm1d on a sliced one). The strides are part
    of the signature, so every call of the graph copies in a tensor so laid out. (Its
    memory spans what ``t``'s does, the gaps of a slice included, up to ``_MAX_SPAN`` times
    its elements.)
    """
    if type(t) is not torch.Tensor or not _dense(t) or t.is_quantized:
        # (No strides to keep, or a subclass, whose type a copy keeps -- its own operations
        # then run at capture, as eagerly -- and whose memory may not be its own: a wrapper's;
        # or a quantized tensor, whose scale and zero point an empty one of its dtype lacks.)
        return t.clone()
    size = t.element_size()
    offset = (t.data_ptr() % _IN_PLACE_ALIGNMENT) // size if t.data_ptr() % size == 0 else 0
    span = 0 if t.numel() == 0 else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    if span > _MAX_SPAN * t.numel():
        # A few elements of a large tensor (the last token's features of every sequence): the
        # buffer would hold as much memory as the tensor they are read from, for as long as the
        # graph lives. Copied dense, as before graphs kept layouts (eager may then round the
        # last bit otherwise, see above).
        return t.clone(memory_format=torch.contiguous_format)
    memory = torch.empty(offset + span, dtype=t.dtype, device=t.device).untyped_storage()
    # (Set, not viewed: a leaf of its own, as a clone would be, no view of a base.)
    static = torch.empty(0, dtype=t.dtype, device=t.device).set_(memory, offset, t.shape, t.stride())
    _copy_into(static, t)
    return static


def _copy_into(static: torch.Tensor, t: torch.Tensor) -> None:
    r"""``static.copy_(t)``, where ``static`` may be expanded (see :func:`_static_like`).

    Both are narrowed to one element along the dimensions ``static`` is expanded in
    (stride 0), where a copy would write each element many times (and ``copy_`` refuses
    to); their elements are alike along them. (Overlaps of other strides, an
    ``unfold``'s, ``copy_`` lets through: the elements that share memory in ``static``
    share it in the source, which has its strides, and are written alike.)
    """
    for d, (n, stride) in enumerate(zip(static.shape, static.stride())):
        if stride == 0 and n > 1:  # (narrowed, a dimension keeps its index)
            static, t = static.narrow(d, 0, 1), t.narrow(d, 0, 1)
    static.copy_(t)


def _flipped(tensors: Sequence[torch.Tensor]) -> bool:
    r"""Whether a tensor is a conjugate or negative view: its memory holds other values than it reads as."""
    for t in tensors:
        if t.is_conj() or t.is_neg():
            return True
    return False


def _all_on(tensors: list[torch.Tensor], device: torch.device) -> bool:
    return all(t.device == device for t in tensors)


def _describe(tensors: list[torch.Tensor]) -> str:
    return ", ".join(
        f"Tensor{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
        f"{' requires_grad' if t.requires_grad else ''}"
        for t in tensors
    ) or "no tensors"


# ----------------------------------------------------------- output lending
class _Lending:
    r"""Whether an inference graph returns clones of its output buffers or the buffers themselves.

    A clone costs an allocation and a kernel launch per output and per call,
    on a launch-bound graph about as much CPU time as the replay itself, and it
    is only needed when the caller still holds an earlier output as the next
    replay overwrites the buffers. So outputs are cloned at first, while the
    graph watches whether each call's clones are already freed when the next
    call comes, as when a model consumes the block's output inside its own
    forward. After ``_LEND_AFTER`` such calls in a row it lends the buffers
    (returns new tensors aliasing them) and, before every later replay, checks
    by the storages' reference counts that nothing outside the graph still
    refers to them -- no output, no view of one. If something does, the caller
    kept an output: calls run eagerly instead of overwriting it for as long as
    it lives (``kept``), and the graph clones from then on. A caller that
    keeps outputs (``y = block(x)`` in a loop, a list of results) is seen
    doing so and always gets clones.
    """

    __slots__ = ("lent", "kept", "watch", "streak", "previous", "refs", "baseline")

    def __init__(self, lend: bool = True) -> None:
        self.lent = False
        self.kept = False  # a lent output outlived the call after it, and may still be alive
        self.watch = _WATCH if lend and _use_count is not None else 0
        self.streak = 0
        self.previous: list[StorageWeakRef] = []  # storages of the last call's clones
        self.refs: list[StorageWeakRef] = []  # storages of the lent buffers
        self.baseline: list[int] = []  # their reference counts with nothing lent

    def held(self) -> bool:
        r"""Whether a lent output (or a view of one) is still alive; stops lending if so."""
        if self.lent or self.kept:
            for r, b in zip(self.refs, self.baseline):  # (a loop: a generator costs a frame per call)
                if _use_count(r.cdata) > b:
                    self.lent = False
                    self.kept = True
                    self.watch = 0
                    return True
            self.kept = False
        return False

    def outputs(self, static: list[torch.Tensor]) -> list[torch.Tensor]:
        r"""This call's outputs: the buffers themselves when lending, else clones."""
        if self.lent:
            return [o.detach() for o in static]
        outs = [o.clone() for o in static]
        if self.watch:
            self.watch -= 1
            dropped = bool(self.previous) and all(r.expired() for r in self.previous)
            self.streak = self.streak + 1 if dropped else 0
            self.previous = _storage_refs(outs)
            if self.streak >= _LEND_AFTER:
                self._lend(static)
        return outs

    def _lend(self, static: list[torch.Tensor]) -> None:
        self.refs = _storage_refs(static)
        # Measured with nothing lent: the graph's own tensors (outputs, and
        # static inputs where an output aliases one) and anything a branch
        # cached during capture. Only references beyond these are the caller's.
        self.baseline = [_use_count(r.cdata) for r in self.refs]
        self.lent, self.watch, self.previous = True, 0, []


def _storage_refs(tensors: list[torch.Tensor]) -> list[StorageWeakRef]:
    r"""Weak references to the distinct storages of ``tensors`` (no strong one survives the call)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    return [StorageWeakRef(st) for st in storages.values()]


# ----------------------------------------------------------------- one graph
class _GradCopies:
    r"""Copies of some of the gradients a backward graph leaves in its buffers, which its next replay overwrites.

    Autograd may keep a returned gradient as a parameter's ``.grad``, which
    must not alias memory the next replay overwrites. Gradients of one shape
    and dtype are copied into one new ``[count, *shape]`` buffer and handed out
    as the views ``unbind`` makes of it, strided as the parameters, so that
    autograd keeps them as they are: an allocation per shape, one multi-tensor
    copy, and views made in one call each, where a new tensor per gradient
    cost more CPU time than both replays together on an 8-branch MLP (and
    ``torch._utils._unflatten_dense_tensors``' views of one flat buffer, made
    one by one, twice as much as ``unbind``'s). Non-contiguous gradients
    (channels-last parameters) are copied as they are.

    Args:
        grads: the graph's gradient buffers; ``None`` where it computes none.
    """

    def __init__(self, grads: list[torch.Tensor | None]) -> None:
        self.sources = [g for g in grads if g is not None]
        # The parameters' own dtypes (autograd gives a parameter its gradient in its dtype).
        self.dtypes = [g.dtype for g in self.sources]
        self.device = self.sources[0].device if self.sources else None
        buffers: dict[tuple[torch.Size, torch.dtype], list[int]] = {}
        rest: list[int] = []
        for i, g in enumerate(self.sources):
            if g.is_contiguous():
                buffers.setdefault((g.shape, g.dtype), []).append(i)
            else:
                rest.append(i)
        grouped = [i for indices in buffers.values() for i in indices]
        self.buffers = [(shape, dtype, len(indices)) for (shape, dtype), indices in buffers.items()]
        self.grouped = [self.sources[i] for i in grouped]
        self.rest = [self.sources[i] for i in rest]
        # Where each gradient's copy lands among the buffers' views, then the rest's copies.
        order = grouped + rest
        self.order = sorted(range(len(order)), key=order.__getitem__)
        # ``reused``: the copies last handed out, the tensors that own their memory, and
        # how many references to each (and to that memory) there were when they were made.
        self.kept: list[torch.Tensor] | None = None
        self.owners: list[torch.Tensor] = []
        self.counts: list[int] = []

    def fresh(self) -> list[torch.Tensor]:
        r"""New copies, in the order of ``grads`` without its ``None``s."""
        return self._make()[0]

    def _make(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        views: list[torch.Tensor] = []
        owners: list[torch.Tensor] = []
        for shape, dtype, count in self.buffers:
            owners.append(torch.empty((count, *shape), dtype=dtype, device=self.device))
            views += owners[-1].unbind(0)
        if views:
            torch._foreach_copy_(views, self.grouped)
        if self.rest:
            copies = torch._foreach_mul(self.rest, 1.0)  # ``x * 1`` is exact
            views += copies
            owners += copies
        return [views[i] for i in self.order], owners

    def reused(self) -> list[torch.Tensor]:
        r"""The copies handed out last time, refilled, if nothing else holds them any more; else new ones.

        For :func:`_hand_out`, which hands them to the parameters' ``.grad``
        itself: after ``zero_grad(set_to_none=True)`` dropped them, making new
        ones (an allocation per shape, a view per gradient) took as much host
        time as the rest of the backward pass. Any reference to them, to their
        buffers or to their memory (a view, a storage) that was not there when
        they were made -- a ``.grad`` still set, a gradient kept for later --
        shows in a reference count and gets new copies; autograd's own saved
        tensors see the refill in their version counters.
        """
        kept = self.kept
        if kept is not None and self._counts(kept, self.owners) == self.counts:
            torch._foreach_copy_(kept, self.sources)
            return kept
        kept, owners = self._make()
        self.kept, self.owners = kept, owners
        self.counts = self._counts(kept, owners)
        return kept

    @staticmethod
    def _counts(kept: list[torch.Tensor], owners: list[torch.Tensor]) -> list[int]:
        counts = list(map(sys.getrefcount, kept))
        counts += map(sys.getrefcount, owners)
        counts += _storage_holders([t.untyped_storage() for t in owners])
        return counts


def _storage_holders(storages: list[Any]) -> list[int]:
    r"""Who holds each of ``storages``: references to its Python object, then C++ ones to the storage.

    A storage's Python object is one per storage and holds it once, however
    many hold the object: a held one shows in the object's count. Views, and
    anything else holding the memory, show in the storage's use count (where
    torch exposes it).
    """
    counts = list(map(sys.getrefcount, storages))
    if _use_count is not None:
        counts += [_use_count(s._cdata) for s in storages]
    return counts


class _Graph:
    r"""The graphs, static buffers and replay ordering of one input signature."""

    # (See ``__init__``; here too for graphs made without it, as the CPU tests make theirs.)
    written: Sequence[int] = ()

    def __init__(self, name: str, device: torch.device, lend: bool = True) -> None:
        self.name = name
        self.device = device
        self.lock = threading.Lock()
        # The stream of the latest replay. A replay from another stream first
        # waits for everything enqueued on it so far: the previous replay's
        # copy-out, and whatever the caller then enqueued that reads outputs
        # lent without a copy, must finish before the static buffers are
        # overwritten.
        self.last: torch.cuda.Stream | None = None
        # Inference outputs: cloned, or lent without a copy (see ``_Lending``).
        self.lending = _Lending(lend)
        self.fwd = torch.cuda.CUDAGraph()
        self.bwd: torch.cuda.CUDAGraph | None = None
        self.variant: Any = None  # how the owner ran while captured (``_graph_variants``)
        self.pool = torch.cuda.graph_pool_handle()
        self.inputs: list[torch.Tensor] = []
        self.expanded = False  # whether an input has a stride 0, which the copy in writes once (_copy_into)
        self.outputs: list[torch.Tensor] = []
        self.out_flat: list[Any] = []  # output leaves; tensors at out_idx are replaced per call
        self.out_idx: list[int] = []
        self.out_spec: Any = None
        self.out_grad: list[bool] = []
        # Which outputs the backward graph reads (an activation autograd saved): with
        # ``static_outputs``, a change made to one in place before backward is refused.
        self.out_saved: list[bool] = []
        # The owner's parameters the backward graph reads (a weight autograd saved): a
        # change made to one in place, or a swap, before backward is refused.
        self.state_saved: tuple[torch.Tensor, ...] = ()
        self.grad_outputs: list[torch.Tensor | None] = []
        self.grad_inputs: list[torch.Tensor | None] = []
        # Copies of the inputs' gradients (to autograd) and of the parameters' (to
        # autograd, or to ``.grad`` by ``_hand_out``).
        self.input_copies = _GradCopies([])
        self.param_copies = _GradCopies([])
        self.params: tuple[torch.Tensor, ...] = ()
        self.takers: tuple[torch.Tensor, ...] = ()  # (see ``plan_grads``)
        self.param_ids: frozenset[int] = frozenset()  # (which hand-outs to order this one's after)
        # Gradients lent to ``.grad`` (see ``lend_grads``): whether a hand-out may lend the
        # backward graph's own buffers, the views it lends, whether they are out now, where
        # they lie, their storages, and who holds them while nothing but this graph does.
        self.lends_grads = False
        self.lent: list[torch.Tensor] = []
        self.grads_lent = False
        self.lent_at: list[int] = []
        self.lent_storages: list[Any] = []
        self.lent_counts: list[int] = []
        # Training graphs with parameter gradients: a zero-size leaf among
        # ``_Replay``'s inputs (``None`` otherwise); ``token_node`` is its
        # accumulator. Whether the engine will run that accumulator tells a plain
        # ``backward()`` -- which runs every accumulator -- from
        # ``torch.autograd.grad`` and ``backward(inputs=...)``, which never name the
        # token. On a plain ``backward()`` with nothing listening on the
        # parameters, ``_Replay`` writes their gradients into ``.grad`` itself (see
        # ``_HandOut``) and hands their accumulators nothing, which they return on
        # at once. On the H100 machine the engine spent 6.0 us of host time per
        # accumulator given a gradient to keep and 4.3 us per one given none; the
        # mlp8 training step went from 1668 to 1464 us (tools/exp_train_step.py).
        # ``direct``: ``direct_grads``, the parameters are left out of ``_Replay``'s
        # inputs altogether and the token stands in for them.
        self.token: torch.Tensor | None = None
        self.direct = False
        self.token_node: Any = None
        # The token's gradient: defined, so that the engine orders the token's
        # accumulator -- whose stream the caller's waits on at the end of
        # ``backward()`` -- after the backward replay, whose buffers ``_HandOut``
        # then reads on the caller's stream.
        self.token_grad: torch.Tensor | None = None
        # Training: forward replays so far, and the last one whose backward ran.
        self.gen = 0
        self.bwd_gen = -1
        # The parameters' gradients of the latest backward replay, waiting in the
        # buffers for the end of its backward pass (see ``_HandOut``).
        self.pending: _HandOut | None = None
        # Aliases of the owner's parameters and buffers when captured: the graph
        # reads their memory by address, so it must live as long as the graph. A
        # branch moved on its own (``block[0].half()``, ``p.data = ...``) runs its
        # own ``_apply``, not the owner's, and registers nothing: no call sees it
        # (checking every address before each replay costs 5.4 us for mlp8's 64
        # tensors on the H100 machine, a sixth of the call). Held, the old memory
        # is not reused for something else, so such a graph replays the weights it
        # was captured with, as ``torch.cuda.make_graphed_callables`` does.
        self.kept_alive: list[torch.Tensor] = []
        # An inference graph that reads the first call's inputs where they lie, and the
        # addresses it reads (``_addresses``): a replay whose inputs lie there launches it and
        # copies nothing, in or out (see ``_CudaGraphs._reader``). ``readable``: the signature
        # may have one. With a reader, ``outputs`` are its buffers and ``first_outputs`` the
        # first graph's, which a replay of the first graph copies into them; ``misses``: such
        # replays in a row (see ``_READER_MISSES``).
        self.reader: torch.cuda.CUDAGraph | None = None
        self.reader_at: Any = None
        self.readable = False
        self.first_outputs: list[torch.Tensor] | None = None
        self.misses = 0
        self.lend = lend
        self.input_versions: list[int] = []  # the static inputs' versions before warm-up
        # The static inputs the forward changes in place (``nn.ReLU(inplace=True)`` first, ``x.mul_(2)``),
        # as their versions saw it in warm-up: an eager call changes the caller's tensors, so after
        # each replay that copied them in, they are copied back (see ``_copy_back``).
        self.written: list[int] = []

    def plan_grads(self) -> None:
        r"""Decide how the backward graph's gradients (``grad_inputs``) are copied out of it."""
        n = len(self.inputs)
        self.input_copies = _GradCopies(self.grad_inputs[:n])
        self.param_copies = _GradCopies(self.grad_inputs[n:])
        # The parameters that get a gradient, in the order of ``param_copies``' copies.
        self.takers = tuple(p for p, g in zip(self.params, self.grad_inputs[n:]) if g is not None)

    def fresh_grads(self) -> list[torch.Tensor]:
        r"""Copies of the gradients the backward graph left in its buffers (``grad_inputs`` without its ``None``s)."""
        return self.input_copies.fresh() + self.param_copies.fresh()

    def lend_grads(self) -> None:
        r"""Hand the backward graph's own gradient buffers to ``takers``' ``.grad``, every one ``None``; ``lock`` held.

        Copying them out cost a multi-tensor copy per backward (30 us of host
        time for mlp8's 64 gradients on the H200 machine, and their size of
        GPU memory traffic) and kept a second copy of every gradient alive.
        Lent, they are the gradients until the next replay of this graph,
        whose forward first takes them back (:meth:`reclaim`). They are lent
        as views of the buffers, so that what a caller does to the tensor it
        is handed (``.data = ...``) never re-points the graph's own; how many
        hold each view, its storage and that storage's Python object while
        nothing but this graph does is noted when they are made.
        """
        if not self.lent:
            self.lent = [s.detach() for s in self.param_copies.sources]
            self.lent_at = list(map(_data_ptr, self.lent))
            self.lent_storages = [t.untyped_storage() for t in self.lent]
            self.lent_counts = self._lent_counts()
        for p, g in zip(self.takers, self.lent):
            p.grad = g
        self.grads_lent = True

    def _lent_counts(self) -> list[int]:
        r"""Who holds the lent gradients: Python references to each and its storage's object, C++ ones to each and its storage."""
        counts = list(map(sys.getrefcount, self.lent))
        counts += map(_tensor_uses, self.lent)  # (``.grad``, autograd's saved tensors, views)
        counts += _storage_holders(self.lent_storages)
        return counts

    def reclaim(self, stream: torch.cuda.Stream) -> bool:
        r"""Take back the gradients lent to ``.grad`` before a replay on ``stream`` overwrites them.

        ``lock`` and ``_hand_outs_lock`` held. Nothing may hold them but this
        graph and the parameters' ``.grad``: a Python reference to one (a
        gradient kept for later) shows in its reference count, a C++ one
        (another ``.grad``, a tensor autograd saved) or a view in its use
        count, a kept storage in the count of the storage's Python object, and
        one of them re-pointed (``.data = ...``) in where it lies (not one
        re-pointed at another storage made over the same memory, whose
        owner then holds it from outside torch); then this
        returns ``False`` and the call runs otherwise (see
        ``_CudaGraphs._held``). A ``.grad`` still holding its lent gradient
        (gradients accumulated over several backward passes: ``zero_grad()``
        not called, or ``zero_grad(set_to_none=False)``) is given a copy of
        it, and this graph copies from then on (summing into ``.grad`` in
        place is cheaper for that loop). ``stream`` first waits for the
        hand-outs of other graphs to the same parameters, which may have
        summed into a lent gradient on their streams (see
        :func:`_after_hand_outs`). Every lent gradient's version moves, as a
        copy into it would move it: autograd then refuses a backward through
        a tensor that saved one, as after any change in place.
        """
        _after_hand_outs(_hand_outs.setdefault(self.device, {}), self.param_ids, stream)
        if list(map(_data_ptr, self.lent)) != self.lent_at:
            return False
        # Counted first: after ``zero_grad()`` -- every step of a usual loop -- nothing but
        # this graph holds them, and the ``.grad`` of every taker need not be read. (A
        # ``.grad`` holding one adds to its use count, so equal counts mean none does.)
        if self._lent_counts() != self.lent_counts:
            if not self._rehome():
                return False
            self.lends_grads = False
            if self._lent_counts() != self.lent_counts:
                return False
        _bump_versions(self.lent)
        self.grads_lent = False
        return True

    def _rehome(self) -> bool:
        r"""Give each ``.grad`` still holding its lent gradient a copy of it; whether any did.

        (A frame of its own: its locals hold lent gradients, which
        :meth:`reclaim` then counts, and a ``.grad`` holding one adds to its
        reference count on some torch releases.)
        """
        held = list(map(_grad_of, self.takers))
        if not any(map(operator.is_not, held, itertools.repeat(None))):
            return False
        copies = self.param_copies.fresh()
        for p, g, mine, copy in zip(self.takers, held, self.lent, copies):
            if g is mine:
                p.grad = copy
        return True

    def drop_reader(self) -> None:
        r"""Forget the reader: the first graph's buffers are the outputs again, nothing copies them.

        Under ``lock``, with no lent output alive (``_Lending.held``), and never
        for a caller of ``static_outputs``, who may hold the buffers it was
        handed: a new ``_Lending`` watches the buffers now handed out, cloning
        until it sees the caller drop them in time, as for a new signature.
        """
        if self.first_outputs is not None:
            self.outputs, self.first_outputs = self.first_outputs, None
            self.lending = _Lending(self.lend)
        self.reader = self.reader_at = None
        self.misses = 0

    def _order(self, stream: torch.cuda.Stream) -> None:
        last = self.last
        if last is not None and last is not stream and last != stream:
            stream.wait_stream(last)
        self.last = stream

    def _copy_in(self, tensors: Any) -> None:
        for static, t in zip(self.inputs, tensors):
            if static.data_ptr() != t.data_ptr():
                if self.expanded:
                    _copy_into(static, t)
                else:
                    static.copy_(t)

    def _copy_back(self, tensors: Any) -> None:
        r"""Write what the replay wrote into the static inputs of ``written`` back into the call's ``tensors``.

        As an eager call changes them: a caller reading its tensor after the
        call (``x + block(x)``, a block whose first layer is
        ``nn.ReLU(inplace=True)``) read it unchanged after a replay, where
        eagerly it read the change. On the replay's stream, after it; the
        version of each tensor moves as the change's would, so that autograd
        refuses a backward through a node that saved it, as eagerly.
        """
        for i in self.written:
            static, t = self.inputs[i], tensors[i]
            if static.data_ptr() != t.data_ptr():
                t.copy_(static)

    def replay(self, tensors: Sequence[torch.Tensor], static_outputs: bool) -> Any:
        r"""Replay on ``tensors``; ``_HELD`` when a lent output still uses the buffers."""
        if self.bwd is not None:
            token = self.token
            direct = self.direct and _direct_allowed(self.params)
            # Without ``direct``, the parameters are inputs as in any autograd graph,
            # followed by the token, through which a plain ``backward()`` is told apart.
            rest = (token,) if direct else self.params if token is None else (*self.params, token)
            try:
                if _apply is None or torch._C._are_functorch_transforms_active():
                    outs = _Replay.apply(self, static_outputs, direct, *tensors, *rest)
                else:
                    outs = _apply(self, static_outputs, direct, *_unwrap_dead(tensors), *rest)
            except _GradsHeld:
                return _HELD
        else:
            # (``_order``, ``_copy_in`` and ``_Lending.outputs`` written out for the
            # steady state: an inference replay is a few microseconds of CPU, and
            # every Python frame on its path a measurable part of it.)
            with self.lock:
                lending = self.lending
                lent = lending.lent
                if (lent or lending.kept) and not static_outputs and lending.held():
                    return _HELD
                stream = _current_stream(self.device)
                if self.last is not stream:
                    self._order(stream)
                reader = self.reader
                if reader is not None and (tensors[0].data_ptr() if len(tensors) == 1 else tuple(
                        [t.data_ptr() for t in tensors])) == self.reader_at and not _flipped(tensors):
                    # (``_addresses``, without its frame.)
                    _launch(reader)
                    self.misses = 0
                else:
                    if self.expanded:
                        self._copy_in(tensors)
                    else:
                        for static, t in zip(self.inputs, tensors):
                            if static.data_ptr() != t.data_ptr():
                                static.copy_(t)
                    _launch(self.fwd)
                    if self.written:  # (never with a reader: see _readable)
                        self._copy_back(tensors)
                    if reader is not None:
                        # The first graph wrote its own buffers; the call's outputs are the reader's.
                        # (With ``static_outputs`` the caller may read the buffers it was handed
                        # after each call: they stay the same, and the reader with them.)
                        self.misses += 1
                        if self.misses < _READER_MISSES or static_outputs:
                            _copy_out(self.outputs, self.first_outputs)
                        else:
                            self.drop_reader()
                            lending, lent = self.lending, False
                if static_outputs:
                    outs = self.outputs
                elif lent and not _local.crossing:
                    outs = [o.detach() for o in self.outputs]
                elif lent:  # read on another stream, unordered with the next replay: copies
                    outs = [o.clone() for o in self.outputs]
                else:
                    # A user keeping an output across two calls must never see
                    # it overwritten by the next replay: clone, or lend the
                    # buffers where the caller is seen to drop outputs in time.
                    outs = lending.outputs(self.outputs)
        if self.out_spec is None:  # a single tensor
            return outs[0]
        flat = list(self.out_flat)
        for i, o in zip(self.out_idx, outs):
            flat[i] = o
        return pytree.tree_unflatten(flat, self.out_spec)


class _Replay(torch.autograd.Function):
    r"""Forward: replay the forward graph. Backward: replay the backward graph.

    Inputs are the call's tensors followed by the parameters that require grad,
    so autograd routes gradients to both (as ``make_graphed_callables`` does),
    then the graph's token, if it has one: on a plain ``backward()`` the
    parameters' gradients are then handed to ``.grad`` when the pass ends
    (:class:`_HandOut`) instead.
    ``direct``: the token alone follows the call's tensors.
    """

    @staticmethod
    def forward(ctx: Any, graph: _Graph, static_outputs: bool, direct: bool,  # type: ignore[override]
                *inputs: torch.Tensor) -> tuple:
        ctx.direct = direct
        # (Taking back lent gradients writes ``.grad``, as hand-outs do: in their lock order.)
        # (``grads_lent`` too: a graph that stopped lending may still have gradients out.)
        with _hand_outs_lock if graph.lends_grads or graph.grads_lent else contextlib.nullcontext(), graph.lock:
            stream = _current_stream(graph.device)
            graph._order(stream)
            if graph.pending is not None:  # (another thread's backward pass has not ended yet)
                graph.pending.stage(graph)
            if graph.grads_lent and not graph.reclaim(stream):
                raise _GradsHeld
            graph._copy_in(inputs[: len(graph.inputs)])
            _launch(graph.fwd)
            graph.gen += 1  # (first: the activations a pending backward needs are gone, whatever follows)
            ctx.gen = graph.gen
            if graph.written:  # (inputs that require no grad: see _CudaGraphs._written_leaf)
                graph._copy_back(inputs[: len(graph.inputs)])
            outs = tuple(o.detach() if static_outputs else o.clone() for o in graph.outputs)
        # The backward graph reads, where the forward left them, the tensors its autograd graph saved: the
        # static outputs among them, and the owner's parameters (which it reads in place, not as inputs). Saved
        # here too, so that autograd refuses a backward after one was changed in place (an optimizer step before
        # ``backward()``), as it refuses one through an eager layer that saved it, and accepts changes to the
        # others (a Linear's bias), as eager does. (torch.utils.swap_tensors then refuses to swap them, as it
        # refuses a tensor an eager layer saved.)
        saved = [o for o, s in zip(outs, graph.out_saved) if s] if static_outputs else []
        if saved or graph.state_saved:
            ctx.save_for_backward(*saved, *graph.state_saved)
        ctx.graph = graph
        frozen = [o for o, g in zip(outs, graph.out_grad) if not g]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:  # type: ignore[override]
        graph: _Graph = ctx.graph
        if torch.is_grad_enabled():
            # (A backward's grad mode is its create_graph.) The backward graph hands out
            # gradients that autograd cannot differentiate again. ``once_differentiable``, as
            # ``make_graphed_callables`` uses it, refuses a second differentiation only where an
            # incoming gradient requires grad; from ``out.sum()`` none does, and a gradient
            # penalty (``autograd.grad(loss, x, create_graph=True)``, then backward through the
            # gradient) silently lost this block's part of it, where eagerly it depends on the
            # weights. Refused, before anything is replayed or consumed.
            raise RuntimeError(
                f"{graph.name}: backward with create_graph=True through a CUDA-graphed call: the captured "
                f"backward computes this block's gradients as constants, so a gradient of them (a gradient "
                f"penalty, a Hessian-vector product) would miss its dependence on the block's weights and "
                f"input. Run the calls whose gradients you differentiate with cuda_graph=False for this "
                f"block (block.cuda_graph = False), or take the gradient without create_graph=True."
            )
        _ = ctx.saved_tensors  # (static outputs changed in place since: autograd's own error)
        with graph.lock:
            # The backward graph reads the activations the forward graph left in
            # the pool: only those of the latest forward replay exist, and the
            # backward graph may reuse their memory, so it can run once.
            if ctx.gen != graph.gen:
                raise RuntimeError(
                    f"{graph.name}: backward of a CUDA-graphed call after a later call with the same "
                    f"input signature: that call overwrote the activations this backward needs. With "
                    f"cuda_graph=True, run backward after each forward (or use cuda_graph=False for "
                    f"this pattern, e.g. several forwards before one backward)."
                )
            if graph.bwd_gen == ctx.gen:
                raise RuntimeError(
                    f"{graph.name}: backward through a CUDA-graphed call ran twice; the graph's saved "
                    f"activations are consumed by the first backward (retain_graph is not supported "
                    f"with cuda_graph=True)."
                )
            graph.bwd_gen = ctx.gen
            graph._order(_current_stream(graph.device))
            for static, g in zip(graph.grad_outputs, grads):
                if static is not None and static.data_ptr() != g.data_ptr():
                    static.copy_(g)
            assert graph.bwd is not None
            _launch(graph.bwd)
            n = len(graph.inputs)
            if graph.token is None:  # no parameter gradients, or a torch that cannot tell a plain backward()
                return (None, None, None) + _in_place(graph.grad_inputs, graph.fresh_grads())
            inputs = (None, None, None) + _in_place(graph.grad_inputs[:n], graph.input_copies.fresh())
            # ``.backward()`` runs every accumulator; ``torch.autograd.grad`` and
            # ``backward(inputs=...)`` run only those of the tensors they name, never
            # the token's, and must leave every other ``.grad`` as it is.
            plain = _will_execute_node(graph.token_node)
            if ctx.direct:
                if plain:
                    if not _direct_allowed(graph.params):
                        raise RuntimeError(
                            f"{graph.name}: a hook was registered on a parameter, or a torch.distributed process "
                            f"group created, between this call's forward and its backward, with direct_grads=True: "
                            f"the forward took the parameters out of autograd's graph, so the hook would not run. "
                            f"Register hooks (and create process groups) before the forward call, or pass "
                            f"direct_grads=False."
                        )
                    _HandOut.queue(graph)
                return inputs + (graph.token_grad,)
            if plain and _direct_allowed(graph.params):
                # Nothing listens on the parameters: their gradients go to ``.grad`` at the
                # end of the pass, in one go, and their accumulators get none (each then
                # returns at once), which saves the engine most of its per-parameter work
                # (see ``_Graph.token``).
                _HandOut.queue(graph)
                return inputs + (None,) * len(graph.params) + (graph.token_grad,)
            # ``torch.autograd.grad``, ``backward(inputs=...)``, hooks: through autograd.
            return inputs + _in_place(graph.grad_inputs[n:], graph.param_copies.fresh()) + (None,)


def _in_place(grads: list[torch.Tensor | None], copies: list[torch.Tensor]) -> tuple:
    r"""``copies`` where ``grads`` has a tensor, ``None`` elsewhere."""
    it = iter(copies)
    return tuple(next(it) if g is not None else None for g in grads)


def _direct_allowed(params: tuple[torch.Tensor, ...]) -> bool:
    r"""Whether a training replay may bypass the parameters' gradient accumulators on this call.

    Not when anything may be listening on them: a hook on a parameter
    (``register_hook``, ``register_post_accumulate_grad_hook``), or a process
    group, whose DistributedDataParallel and FSDP register hooks on the
    accumulators from C++, where they cannot be seen. Those calls go through
    the accumulators, as in any autograd graph.
    """
    if _will_execute_node is None or _distributed():
        return False
    for p in params:
        if p._backward_hooks or p._post_accumulate_grad_hooks:
            return False
    return True


def _own_memory(tensors: list[torch.Tensor]) -> bool:
    r"""Whether no two of ``tensors`` share a storage."""
    return len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)


def _bump_versions(tensors: list[torch.Tensor]) -> None:
    r"""Move the autograd versions of ``tensors``, as a change in place would (one call where torch takes a list)."""
    try:
        torch.autograd.graph.increment_version(tensors)
    except TypeError:  # (a torch whose increment_version takes one tensor)
        for t in tensors:
            torch.autograd.graph.increment_version(t)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class _HandOut:
    r"""The parameters' gradients of one backward replay, handed to ``.grad`` when its backward pass ends.

    Handed out by the backward replay itself, on its own stream, they raced
    with every other writer of the same ``.grad`` in that pass: the block's
    backward for a call made on another stream (the same block called from
    two streams), or a parameter's accumulator fed by a layer outside the
    block that ran on another stream -- where the engine orders the
    accumulator's writes among themselves, but knows nothing of the replay's.
    So the replay leaves them in its buffers and queues this as one of the
    engine's final callbacks, which run after every accumulator, on the
    stream that called ``backward()``, once it has waited for the streams
    of all accumulators (the graph's token among them, whose gradient the
    replay made: so after the replay too). Then ``.grad`` is written last
    in the pass, on the caller's stream, as eager autograd leaves it for
    the caller. Hand-outs of other passes (other threads, other graphs) are
    ordered too: each waits for the streams of the earlier ones that wrote
    one of its parameters (:func:`_after_hand_outs`), and for no other.

    The buffers stay as the replay left them until then, unless a forward
    replay of the same graph comes first (from another thread): that one
    copies them out before it overwrites them (:meth:`stage`). A pass that
    raises runs no final callback: the next forward replay drops this.
    """

    __slots__ = ("graph", "device", "takers", "ids", "copies", "staged", "event")

    def __init__(self, graph: _Graph) -> None:
        # Weakly: the graph holds this as ``pending`` until it runs, or for good after a
        # pass that raised; a cycle would keep an evicted graph's pool until a collection.
        self.graph = weakref.ref(graph)
        self.device = graph.device
        self.takers, self.ids, self.copies = graph.takers, graph.param_ids, graph.param_copies
        self.staged: list[torch.Tensor] | None = None
        self.event: torch.cuda.Event | None = None

    @staticmethod
    def queue(graph: _Graph) -> None:
        r"""Hand out ``graph``'s parameter gradients when the running backward pass ends; ``graph.lock`` held."""
        hand_out = _HandOut(graph)
        graph.pending = hand_out
        torch.autograd.Variable._execution_engine.queue_callback(hand_out)

    def stage(self, graph: _Graph) -> None:
        r"""Copy the gradients out of ``graph``'s buffers, which its forward replay is about to overwrite; ``graph.lock`` held."""
        self.staged = self.copies.fresh()
        self.event = torch.cuda.Event()
        self.event.record(_current_stream(self.device))
        graph.pending = None

    def __call__(self) -> None:
        stream = _current_stream(self.device)  # the caller's of ``backward()``
        with _hand_outs_lock:
            _after_hand_outs(_hand_outs.setdefault(self.device, {}), self.ids, stream)
            graph = self.graph()
            with graph.lock if graph is not None else contextlib.nullcontext():
                if self.staged is None:
                    if graph is not None:
                        graph.pending = None
                        # This stream waited for the replay (see above): the next replay, from
                        # any stream, now waits for these reads before it overwrites the buffers.
                        graph.last = stream
                    _hand_out(self.takers, self.copies, graph)
                    return
            assert self.event is not None
            stream.wait_event(self.event)
            for t in self.staged:  # (made on the forward replay's stream, used on this one)
                t.record_stream(stream)
            _accumulate(self.takers, tuple(self.staged))


# The streams of the latest hand-outs on each device, by the ids of the parameters
# they wrote, and the lock ordering hand-outs (see ``_HandOut``): the engine orders
# the accumulators of one backward pass, not those of passes run by two threads at
# once, nor the hand-outs.
_hand_outs: dict[torch.device, dict[frozenset[int], Any]] = {}
_hand_outs_lock = threading.Lock()
_MAX_HAND_OUTS = 32  # parameter sets remembered per device (one per graph, in training)


def _after_hand_outs(last: dict[frozenset[int], Any], ids: frozenset[int], stream: Any) -> None:
    r"""Order a hand-out to the parameters ``ids`` on ``stream`` after the earlier ones that wrote one of them.

    ``last``: the stream of the latest hand-out of each set of parameters on
    the device, oldest first; ``_hand_outs_lock`` held. Hand-outs to other
    parameters are left unordered, as eager autograd leaves the accumulators
    of two models: ordering every hand-out on the device after the one before
    made a model trained on one stream wait for whatever another, unrelated
    one had enqueued on its own stream by then. (An id reused by a new
    parameter after its owner died orders a hand-out that need not be: a wait
    too many, never one too few.)
    """
    for other_ids, other in last.items():
        if other is not stream and other != stream and not other_ids.isdisjoint(ids):
            stream.wait_stream(other)
    last.pop(ids, None)
    last[ids] = stream  # (the newest last)
    if len(last) > _MAX_HAND_OUTS:
        # Forget the oldest set, after making this stream wait for its hand-out and taking
        # its parameters on: a later hand-out to one of them still waits for it, through
        # this stream.
        old_ids, old = next(iter(last.items()))
        del last[old_ids]
        if old is not stream and old != stream:
            stream.wait_stream(old)
        del last[ids]
        last[ids | old_ids] = stream


def _hand_out(taking: tuple[torch.Tensor, ...], copies: _GradCopies, graph: _Graph | None = None) -> None:
    r"""Sum the backward graph's gradients (``copies.sources``) into ``taking``'s ``.grad``, as their accumulators would.

    The common cases take no new tensor: every ``.grad`` set (accumulation,
    ``zero_grad(set_to_none=False)``): one add from the buffers; every
    ``.grad`` ``None`` (``zero_grad()``'s default): the buffers themselves,
    lent until ``graph``'s next replay (:meth:`_Graph.lend_grads`), or where it
    does not lend, the copies handed out last time, refilled when nothing
    holds them any more (:meth:`_GradCopies.reused`). Otherwise new copies, by
    :func:`_accumulate`. ``graph``: the graph whose buffers ``copies`` reads
    (``graph.lock`` held), or ``None``.
    """
    if not taking:
        return
    if not all(map(_requires_grad, taking)) or list(map(_grad_dtype_of, taking)) != copies.dtypes:
        # A parameter frozen between the forward and its backward, or whose ``grad_dtype``
        # was set: eagerly its accumulator, which reads both when it runs, leaves its
        # ``.grad`` alone, or casts the gradient. One by one, as the accumulators would.
        _accumulate(taking, tuple(copies.fresh()))
        return
    held = list(map(_grad_of, taking))
    if all(g is None for g in held):
        if graph is not None and graph.lends_grads:
            graph.lend_grads()
            return
        for p, g in zip(taking, copies.reused()):
            p.grad = g
    elif all(g is not None for g in held):
        torch._foreach_add_(held, copies.sources)
    else:
        _accumulate(tuple(taking), tuple(copies.fresh()))


def _accumulate(params: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor | None, ...]) -> None:
    r"""Sum ``grads`` into ``params``' ``.grad`` as autograd's accumulators do, all at once.

    A ``.grad`` that is ``None`` takes the gradient itself (a fresh copy, in the
    parameter's layout: see :class:`_GradCopies`; cast to its ``grad_dtype``
    where that was set), as an accumulator does when it may steal it; the
    others are summed in place, in one multi-tensor add. A parameter that no
    longer requires grad takes none, as its accumulator, which reads
    ``requires_grad`` when it runs, not when the forward recorded it.
    The engine runs one accumulator node per parameter, and on an 8-branch MLP
    (64 parameters) those took more host time than everything else in the
    backward pass (``tools/exp_train_step.py``).
    """
    into: list[torch.Tensor] = []
    adds: list[torch.Tensor] = []
    for p, g in zip(params, grads):
        # (``requires_grad`` as it is now: an accumulator skips a parameter frozen since the forward.)
        if g is None or not p.requires_grad:
            continue
        if p.grad is None:
            dtype = _grad_dtype_of(p)
            p.grad = g if dtype is None or dtype == g.dtype else g.to(dtype)
        else:
            into.append(p.grad)
            adds.append(g)
    if into:
        torch._foreach_add_(into, adds)


# Whether the running backward pass will execute an autograd node (what
# ``torch.autograd.graph.register_multi_grad_hook`` asks); without it, every
# gradient goes through the accumulators (``_direct_allowed``).
_will_execute_node = getattr(torch._C, "_will_engine_execute_node", None)


# ``_Replay.apply`` less ``Function.apply``'s Python prologue, which walks every
# input (the parameters among them: 64 for eight 4-layer MLPs) to unwrap
# functorch's dead wrappers, and cost a third of a training call's forward on
# the H100 machine. Taken where no functorch transform is active, as the
# prologue itself does; only the call's own tensors can be such wrappers.
try:
    from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead

    _apply: Callable[..., Any] | None = super(torch.autograd.Function, _Replay).apply
except (ImportError, AttributeError):  # another torch: Function.apply as it is
    _apply = None


# ------------------------------------------------------------------ failures
class _CaptureError(RuntimeError):
    pass


def _chain(error: BaseException) -> list[BaseException]:
    r"""``error`` and the exceptions it was raised from or during, innermost first."""
    seen: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen[::-1]


def _explain(error: BaseException) -> str:
    r"""What went wrong, for the capture error: each exception's first line and notes.

    The innermost exception is the operation that broke the capture (the
    ``Parallel`` eager path adds which branch raised it as a note); the outer
    ones are what ending the broken capture raised afterwards.
    """
    lines: list[str] = []
    chain = _chain(error)
    for e in chain:
        text = str(e).strip().splitlines()
        head = f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
        extra = [ln for ln in text[1:] if ln.startswith("(raised in")]  # Python 3.10 keeps notes in the message
        for line in [head, *extra, *getattr(e, "__notes__", [])]:
            if line not in lines:
                lines.append(line)
    where = None
    for frame in reversed(traceback.extract_tb(chain[0].__traceback__)):
        path = os.path.abspath(frame.filename)
        if not path.startswith((_TORCH_DIR, _PACKAGE_DIR)):
            where = f"at {frame.filename}:{frame.lineno}" + (f": {frame.line}" if frame.line else "")
            break
    if where:
        lines.insert(1, where)
    return "\n  ".join(lines)


def _abandon(graph: torch.cuda.CUDAGraph, pool: Any, capture: torch.cuda.Stream, caller: torch.cuda.Stream,
             index: int) -> None:
    r"""Leave no capture open and the caller's stream current after a failed capture.

    ``torch.cuda.graph`` ends the capture on exit, but when a branch on a side
    stream broke it, the fork/join code may have left that side stream
    current, and ``capture_end`` refuses to end a capture on another stream
    than the one it began on. A capture that ended with an error also never
    returned its memory pool to the allocator.
    """
    torch.cuda.set_stream(capture)
    try:
        if torch.cuda.is_current_stream_capturing():
            graph.capture_end()
    except Exception:
        pass  # ending an invalidated capture reports the invalidation again
    try:
        graph.pool()  # fails unless capture_end completed, in which case the graph releases its pool
    except Exception:
        # (Private allocator calls, named as in torch/cuda/memory.py; older releases
        # named the first one _cuda_endAllocateCurrentStreamToPool.)
        for release in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool", "_cuda_releasePool"):
            try:
                getattr(torch._C, release)(index, pool)
            except Exception:
                pass
    # A capture whose end failed leaves the CUDA RNG in capture mode (its
    # epilogue never ran), and every later random op raises "Offset increment
    # outside graph capture". An empty capture runs prologue and epilogue
    # again and puts the generator back in eager mode.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=capture):
                pass
    except Exception:
        pass
    torch.cuda.set_stream(caller)


def _streams_left_capturing(index: int) -> bool:
    streams = [s for capturing in (False, True) for kind in ("streams", "high")
               for s in getattr(_pools.get((index, capturing)), kind, [])]
    caller = torch.cuda.current_stream()
    try:
        for s in [_capture_stream(index), *streams]:
            torch.cuda.set_stream(s)
            if torch.cuda.is_current_stream_capturing():
                return True
    finally:
        torch.cuda.set_stream(caller)
    return False


# ------------------------------------------------------------------- cache
class _CudaGraphs:
    r"""The CUDA graphs of one module, one per input signature, in an LRU cache.

    ``graphs(forward, args, kwargs)`` returns ``forward(*args, **kwargs)``:
    eagerly while a compiler traces, for inputs not on CUDA (warning once),
    inside another capture or warm-up (the enclosing capture records the
    work), and for signatures that failed to capture with ``fallback=True``;
    otherwise from a graph of the call's signature, captured on first use.

    Args:
        owner: the module whose ``forward`` is graphed; its parameters and
            buffers are read in place by the graphs, its buffers restored
            after warm-up. Held weakly.
        max_graphs: graphs kept; the least recently used is freed beyond it.
        static_outputs: return the graph's output buffers themselves (valid
            until the module's next call) instead of fresh copies.
        fallback: on a failed capture warn once and run that signature
            eagerly from then on, instead of raising.
        lend: whether outputs the caller is seen dropping in time may be lent
            (see :class:`_Lending`). That tells only that the caller's stream
            is done with them: a caller that hands outputs to work on other
            streams, as a pipeline stage does to the next, must not be lent any.
        direct_grads: training replays leave the parameters out of autograd's
            graph and hand their gradients to ``.grad`` themselves (see
            :class:`_HandOut`), where nothing listens on them.
        calls_owner: ``forward`` calls the owner itself (``owner.__call__``),
            whose own hooks then run inside the graphs; otherwise they run
            around them, and the owner's hooks do not matter to the graphs.
    """

    def __init__(self, owner: nn.Module, max_graphs: int = 8, static_outputs: bool = False,
                 fallback: bool = False, lend: bool = True, direct_grads: bool = False,
                 calls_owner: bool = False) -> None:
        name = type(owner).__name__
        self.name = name
        self.max_graphs = _check_graph_setting(name, "max_graphs", max_graphs)
        self.static_outputs = bool(static_outputs)
        self.fallback = bool(fallback)
        self.lend = lend
        self.direct_grads = bool(direct_grads)
        # Whether training graphs lend their gradient buffers to ``.grad`` (``_Graph.lend_grads``):
        # off for good once a caller was seen keeping one (``_held``).
        self._lend_grads = _use_count is not None and _tensor_uses is not None
        self.calls_owner = calls_owner
        self.captures = 0  # graphs captured so far (diagnostics and tests)
        self._owner = weakref.ref(owner)
        self._lock = threading.Lock()
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._failed: OrderedDict[Hashable, None] = OrderedDict()
        # Whether each recent call captured: thrashing is more captures than
        # max_graphs within the last 2 * max_graphs calls.
        self._recent: deque[bool] = deque(maxlen=2 * max_graphs)
        self._params: list[nn.Parameter] | None = None
        self._moded: list[nn.Module] = []
        self._warned: set[str] = set()
        # (key, graph) of the last single-tensor call that found or captured a graph (see __call__).
        self._hot: tuple[Hashable, _Graph] | None = None
        # What graphs read without a key for it (see _look): the owner's parameter and buffer
        # dicts, and its modules' hook dicts, with copies of them as captured.
        self._slots: list[dict] = []
        self._slot_values: list[dict] = []
        self._hooks: list[dict] = []
        self._hook_values: list[dict] = []
        self._hooked = False
        self._handles = getattr(_Handle, "next_id", None)
        self._scalars = False
        # Calls in a row that found the same tensors swapped in (see _unchanged).
        self._swaps = 0
        self._swap: list[dict] = []

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        r"""Free every graph (parameters moved, branches changed): the next calls capture anew."""
        with self._lock:
            self._forget()

    def _forget(self) -> None:
        r""":meth:`clear`, the lock held."""
        self._graphs.clear()
        self._failed.clear()
        self._recent.clear()
        self._params = None
        self._hot = None

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, UserWarning, stacklevel=4)

    # ------------------------------------------------------------------ call
    def __call__(self, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if _is_tracing() or _functorch_active() or _dispatch_modes() or _result_changing_function_modes():
            # (torch.func transforms wrap tensors a graph cannot read; a dispatch mode --
            # FlopCounterMode, a debug mode -- must see the call's operations, not one replay;
            # so must a torch function mode, which may change what they compute: captured
            # under one, a graph would replay its results without it, and the reverse.)
            return forward(*args, **kwargs)
        busy = _autograd_busy()
        if busy:
            if busy is _SAVED_HOOKS:
                self._warn_once("saved-hooks", f"{self.name}: cuda_graph=True, but called under saved-tensor "
                                               f"hooks (torch.utils.checkpoint(use_reentrant=False), "
                                               f"torch.autograd.graph.save_on_cpu): such calls run eagerly, "
                                               f"so that the hooks see their activations, which a graph keeps "
                                               f"in its own memory.")
            elif busy is _ANOMALY:
                self._warn_once("anomaly", f"{self.name}: cuda_graph=True, but called under anomaly detection "
                                           f"(torch.autograd.set_detect_anomaly) with grad enabled: such calls "
                                           f"run eagerly, so that it checks each backward operation for NaNs "
                                           f"(reading them on the host, which a captured backward cannot) and "
                                           f"names the one that made them.")
            return forward(*args, **kwargs)
        # A call with one tensor and the signature of the last one replayed -- every
        # call of a model in a loop -- skips the cache: no hashing, no lock, no LRU
        # update. (The key is the cache's own, so both paths agree on what may replay.)
        # Not while another thread holds the lock to capture: callers then wait for the
        # capture to end, as on the cache's path -- PyTorch's CUDA generator refuses
        # random draws anywhere in the process during a capture, and a caller that ran
        # ahead would draw its next input in the middle of it.
        hot = self._hot
        if (hot is not None and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
                and not self._lock.locked()):
            owner = self._owner()
            if (owner is not None and not _capture_underway() and self._key(owner, args, kwargs, ()) == hot[0]
                    and not self._hooked and getattr(_Handle, "next_id", None) == self._handles
                    and not _swapped(self._slots, self._slot_values, self._scalars)):
                # (Nothing swapped in, no hook registered since: else the cache's path sees to it.)
                self._recent.append(False)
                out = hot[1].replay(args, self.static_outputs)  # (``_replay``, without its frame)
                return self._held(hot[1], forward, args, kwargs) if out is _HELD else out
        return self._lookup(forward, args, kwargs)

    def _key(self, owner: nn.Module, args: tuple, kwargs: dict, extra: tuple) -> Hashable:
        r"""Everything a graph is captured for: inputs, modes, and which parameters require grad."""
        params = self._params
        if params is None:
            params = self._look(owner)
        grad = torch.is_grad_enabled()
        return (
            _signature(args, kwargs, owner.training),
            tuple([m.training for m in self._moded]) if self._moded else (),
            extra,
            torch.is_inference_mode_enabled(),
            _autocast_state(),
            # (The dtype of what the forward makes without naming one, ``torch.zeros(n, device=x.device)``,
            # and of the results it takes part in: a capture bakes in the one of its time.)
            torch.get_default_dtype(),
            # (And of the buffers that may be made to require grad, which _lookup refuses to capture.)
            tuple(map(_requires_grad, self._differentiable)) if grad else None,
            _kernel_settings(),  # (kernels are chosen when captured)
            _alignment(args, kwargs),
        )

    def describe(self, key: Hashable) -> str:
        r"""What a graph's cache ``key`` (see :meth:`_key`) holds beyond its input signature and its
        autocast, readable: only where it differs from a plain call's, so that two keys never read alike.

        (The signature tells the owner's mode, whether autograd recorded and which inputs require
        grad; explain() describes it, and the autocast, as it does a schedule's key.)
        """
        _, moded, extra, inference, _, dtype, requires_grad, kernels, alignment = key
        _, training = _grad_and_training(key[0])
        owner = self._owner()
        parts = []
        if inference:
            parts.append("inference mode")
        if moded and owner is not None:
            names = {id(m): name for name, m in owner.named_modules()}
            apart = [names.get(id(m), "?") for m, mode in zip(self._moded, moded) if mode != training]
            if apart:
                parts.append(f"submodules {apart} in {'eval' if training else 'training'} mode")
        if requires_grad is not None and owner is not None:
            params = [name for name, _ in owner.named_parameters()]
            buffers = [name for name, b in owner.named_buffers() if b.is_floating_point() or b.is_complex()]
            frozen = [name for name, rg in zip(params, requires_grad) if not rg]
            if frozen:
                parts.append("parameters frozen" if len(frozen) == len(params) else f"parameters {frozen} frozen")
            grads = [name for name, rg in zip(buffers, requires_grad[len(params):]) if rg]
            if grads:
                parts.append(f"buffers {grads} require grad")
        if dtype != torch.float32:
            parts.append(f"default dtype {str(dtype).replace('torch.', '')}")
        # (Numbers, strings, dtypes and devices the signature shows by value; other arguments by type.)
        baked = [repr(value) for kind, value in extra if not issubclass(kind, _BY_VALUE)]
        if baked:
            parts.append(f"arguments {', '.join(baked)}")
        differences = _kernel_differences(kernels)
        if differences:
            parts.append(f"kernel settings {', '.join(differences)}")
        offsets = alignment if isinstance(alignment, tuple) else (alignment,)
        if any(offsets):
            parts.append(f"input{'s' if len(offsets) > 1 else ''} at {alignment} bytes past 16-byte alignment")
        return "".join(f", {part}" for part in parts)

    def _look(self, owner: nn.Module) -> list[nn.Parameter]:
        r"""Note what the graphs of ``owner`` will read by address or have baked in; returns its parameters."""
        params = list(owner.parameters())
        # With the buffers that may be made to require grad (``requires_grad_()`` registers nothing).
        self._differentiable = params + [b for b in owner.buffers() if b.is_floating_point() or b.is_complex()]
        # Submodules whose behaviour may depend on their own train/eval mode, which a
        # user may set apart from the owner's (a frozen BatchNorm in a training model).
        # (A block reads no child's mode: its children are looked at as branches are. A stage
        # called itself, a module of the user's, may read any of its submodules'.)
        roots = [owner] if self.calls_owner else list(owner.children())
        self._moded = [m for root in roots for _, m in _moded(root) if m is not owner]
        # (TorchScript modules keep theirs in C++, behind a view that is not a dict;
        # ``torch.func.functional_call`` refuses those modules, so nothing swaps them.)
        self._slots = [d for m in owner.modules() for d in (m._parameters, m._buffers)
                       if d and isinstance(d, dict)]
        self._slot_values = [d.copy() for d in self._slots]
        self._scalars = _has_scalars(self._slots)
        self._swaps = 0
        # Hooks of the owner's modules run while captured, and are baked into the graphs (the
        # owner's own run around them, unless ``forward`` is the owner's ``__call__``).
        self._hooks = _hook_dicts(owner, own=self.calls_owner) + list(_GLOBAL_HOOKS)
        self._hook_values = [d.copy() for d in self._hooks]
        self._hooked = any(self._hooks)
        self._handles = getattr(_Handle, "next_id", None)
        self._params = params
        return params

    def _unchanged(self, locked: bool = False) -> bool:
        r"""Whether the graphs may replay: no tensor swapped into the owner, and its hooks as captured.

        A hook registered or removed below the owner frees every graph (they
        ran the old hooks); the next call captures anew. Hook dicts are
        compared only when a hook was registered somewhere since (the
        handles' counter moved) or while the owner has hooks (removing one
        moves nothing). (PyTorch makes a hook's handle before it enters the
        hook in its dict: one another thread enters after this looked is seen
        only when the next handle is made anywhere.) Tensors swapped in for one call
        (``torch.func.functional_call``) run that call eagerly; the same ones
        found for ``_SWAPS_KEPT`` calls in a row are the owner's own now (a
        child's buffers replaced by ``block[0].half()``, which only the
        owner's own ``_apply`` tells it of): the graphs are freed, and the
        next call captures with them. ``locked``: the cache's lock is held.
        """
        if self._hooked or getattr(_Handle, "next_id", None) != self._handles:
            if self._hooks != self._hook_values:
                self._forget() if locked else self.clear()
                return False
            self._handles = getattr(_Handle, "next_id", None)
        if not _swapped(self._slots, self._slot_values, self._scalars):
            self._swaps = 0
            return True
        now = [d.copy() for d in self._slots]
        self._swaps = self._swaps + 1 if self._swaps and not _swapped(now, self._swap, True) else 1
        self._swap = now
        if self._swaps >= _SWAPS_KEPT:
            self._forget() if locked else self.clear()
        return False

    def _replay(self, graph: _Graph, forward: Callable[..., Any], args: tuple, kwargs: dict,
                tensors: list[torch.Tensor]) -> Any:
        out = graph.replay(tensors, self.static_outputs)
        return self._held(graph, forward, args, kwargs) if out is _HELD else out

    def _held(self, graph: _Graph, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        r"""This call, computed eagerly: ``graph`` would overwrite what the caller still holds.

        An inference graph's lent outputs are waited out this way, one call at
        a time (see ``_Lending``). A training graph's gradients lent to
        ``.grad`` and kept elsewhere (``_Graph.reclaim``) would be overwritten
        by every later replay of it: the graph is dropped, and this module's
        later captures copy their gradients out instead of lending them.
        """
        if graph.bwd is not None:
            with self._lock:
                self._lend_grads = False
                for key in [k for k, g in self._graphs.items() if g is graph]:
                    del self._graphs[key]
                if self._hot is not None and self._hot[1] is graph:
                    self._hot = None
        return forward(*args, **kwargs)

    def _reader(self, graph: _Graph, owner: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict,
                tensors: list[torch.Tensor], caller: torch.cuda.Stream) -> None:
        r"""Capture ``graph``'s call anew, reading ``tensors`` where they lie; replays at their addresses use it.

        Copying a call's input into a graph's static buffer is a kernel launch
        of its own, and on a launch-bound block a large part of a replay: on
        the H200 machine, 12 us of the 47 us of host time of graphed mlp8, and
        5 us of its GPU time (the graph waits for the copy). A caller in a
        loop often passes its input at one address -- a graphed block before
        hands its output buffers, an activation of a model's forward lies
        where the allocator put it the iteration before -- which a graph can
        read directly. Such a graph reads that address and no other, so it
        replays only for tensors found there, of the signature it was captured
        for; anything else is copied into the static buffers.

        A call's outputs are the same buffers whichever graph ran, so that
        what ``_Lending`` and ``static_outputs`` promise of them holds: the
        reader's own. It copies nothing out -- a copy on every replay's path,
        1.4 us of the 24 us of fused mlp8's on the H200 machine -- and a
        replay of the first graph, for inputs found elsewhere, copies its
        outputs into them after it (``_Graph.replay``), until the caller is
        seen to have moved for good (``_READER_MISSES``). The reader shares
        its signature's memory pool: the two never run at once (replays of a
        signature are ordered, see ``_Graph._order``), and its output buffers,
        allocated after the first graph's capture ended, may be the first
        graph's scratch memory, which that graph's replay writes before the
        copy into them, both ordered before anything the call hands out.

        Captured with the first graph, inside its locks and on the same Python
        state: one captured later, at an address met later, would bake in
        whatever module attributes were then (a graph replays what it was
        captured with, and both must replay the same), and would stop other
        threads' random draws (a capture puts PyTorch's CUDA generator in
        capture mode process-wide; callers of this module wait for its first
        capture, other code does not). A capture that fails leaves the
        signature copying its inputs in, as before.
        """
        if not graph.outputs:  # (a graph without outputs has nothing to spare: no copies)
            return
        index = graph.device.index
        stream = _capture_stream(index)
        reader = torch.cuda.CUDAGraph()
        _local.variant = (owner, graph.variant)
        begun = False

        def call() -> list[torch.Tensor]:
            nonlocal begun
            begun = True
            return _matching_outputs(graph, _bind(forward, args, kwargs, tensors)())  # (never compiled: see _capture)

        try:
            _clear_cublas_workspaces()  # (see _capture)
            with torch.cuda.graph(reader, pool=graph.pool, stream=stream, capture_error_mode="thread_local"):
                outputs = call()
        except Exception:
            if begun:  # (the pool is the first graph's too: only a capture that began holds it)
                _abandon(reader, graph.pool, stream, caller, index)
            return
        finally:
            _clear_cublas_workspaces()
            torch.cuda.set_stream(caller)
        if not outputs:
            return
        graph.reader, graph.reader_at = reader, _addresses(tensors)
        # Its output buffers stay allocated as the signature's: freed, the pool would hand
        # them to a later capture. (Nothing was lent yet: replays so far were timed with
        # ``static_outputs``. A new ``_Lending`` all the same, for the buffers handed out now.)
        graph.first_outputs, graph.outputs = graph.outputs, [o.detach() for o in outputs]
        graph.lending = _Lending(graph.lend)
        # Kept unless calls copying in take clearly less time than calls read in place (which
        # copy nothing, where the others copy in and out; timed all the same, as the first
        # graph's variants are). Within ``_READER_SLACK`` the reader stays: it also spares each
        # call the copies' launches, host time that these samples, GPU-bound calls back to
        # back, do not see. Calls too long to time within the budget keep it. (A reader dropped
        # leaves the pool grown by its capture, as long as the signature's graph lives.)
        try:
            with torch.cuda.stream(stream), torch.no_grad():
                # Refused here rather than at a later call's: outputs the copy cannot write.
                _copy_out(graph.outputs, graph.first_outputs)
                elsewhere = [t.detach().clone() for t in graph.inputs]
            faster = _quickest([lambda: graph.replay(tensors, True), lambda: graph.replay(elsewhere, True)], stream,
                               _READER_BUDGET_MS, least=4, too_long=0, slack=_READER_SLACK) == 0
        except Exception:
            # Out of memory for the copy's source, say, or outputs the copy out of the first graph
            # refuses (overlapping ones, an expanded view): the first graph stands alone.
            faster = False
        if not faster or graph.reader is not reader:  # (or dropped while timed: samples of <= 10 calls never are)
            graph.drop_reader()
        graph.misses = 0
        graph.last = None  # (every sample was waited for, see _fastest)

    def _hidden_inputs(self, tensors: list[torch.Tensor], hiding: list[Any]) -> str:
        r"""Why inputs holding tensors inside objects pytree keeps whole (``hiding``) are not captured."""
        return (f"{self.name}: cannot capture input signature ({_describe(tensors)}) with "
                f"cuda_graph=True: an argument holds tensors inside a {type(hiding[0]).__name__} "
                f"object. A graph reads its inputs from buffers it copies them into; tensors "
                f"inside other objects would be read from where they were when captured, "
                f"whatever the object holds later. Pass the tensors as arguments (or in plain "
                f"tuples, lists or dicts: pytree keeps subclasses of them whole), or register the "
                f"class with torch.utils._pytree; or pass graph_fallback=True to run this signature "
                f"eagerly with a warning.")

    def _lookup(self, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        device = _input_device(args, kwargs)
        if device is None:
            # Tensors held only inside objects pytree keeps whole (a dict subclass, a dataclass):
            # refused below as such, with how to pass them, not as an input of no tensors.
            hidden = [t for v in pytree.tree_leaves((args, kwargs)) for t in _hidden_tensors(v)]
            device = hidden[0].device if hidden else None
        if device is None or device.type != "cuda":
            got = f"on {device}" if device is not None else "not a tensor"
            self._warn_once("device", f"{self.name}: cuda_graph=True, but the input is {got}; CUDA graphs "
                                      f"need CUDA inputs, so the module runs eagerly.")
            return forward(*args, **kwargs)
        if _capture_underway():
            return forward(*args, **kwargs)

        if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
            tensors, extra, others = [args[0]], (), []
        else:
            leaves = pytree.tree_leaves((args, kwargs))
            tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
            # Non-tensor arguments are baked into the graph: only the same values replay it.
            others = [v for v in leaves if not isinstance(v, torch.Tensor)]
            extra = tuple(_value_key(v) for v in others)
            if not _all_on(tensors, device):
                self._warn_once("devices", f"{self.name}: cuda_graph=True needs every tensor input on "
                                           f"{device}; got {sorted({str(t.device) for t in tensors})}. "
                                           f"Running eagerly (move every tensor input to {device} to replay "
                                           f"a graph).")
                return forward(*args, **kwargs)
        owner = self._owner()
        if owner is None:
            return forward(*args, **kwargs)
        grad = torch.is_grad_enabled()
        # (Under the lock: another thread's capture swaps aliases into the owner's parameter
        # slots, see _with_aliases; this call then waits for it to end.)
        with self._lock:
            if self._params is None and _watch._swapped_in(owner.modules()):
                # Called first inside ``torch.func.functional_call``: the tensors it swapped
                # in are not the owner's own, which the graphs must read.
                key = graph = None
            else:
                key = self._key(owner, args, kwargs, extra)
                if not self._unchanged(locked=True):
                    if self._params is None:  # graphs freed (hooks changed, new buffers kept): capture anew
                        key = self._key(owner, args, kwargs, extra)
                    else:  # tensors swapped in for this call
                        key = graph = None
                params = self._params
            hot = self._hot
            if hot is not None and hot[0] in self._graphs:
                # Replays by the shortcut skip the cache: its graph was used last all the same.
                self._graphs.move_to_end(hot[0])
            try:
                graph = None if key is None else self._graphs.get(key)
            except TypeError:  # an unhashable non-tensor argument
                graph = key = None
                hiding = [v for v in others if _hidden_tensors(v)]
                if not hiding:
                    self._warn_once("unhashable", f"{self.name}: cuda_graph=True cannot key a graph on "
                                                  f"unhashable arguments ({[t for t, _ in extra]}); running "
                                                  f"eagerly (pass such values as tensors, or hashable ones, a "
                                                  f"tuple for a list, a frozenset for a set, to replay a "
                                                  f"graph).")
                elif not self.fallback:  # (a dict subclass holding the tensors: said as such)
                    raise _CaptureError(self._hidden_inputs(tensors, hiding))
                else:
                    self._warn_once("fallback", f"{self._hidden_inputs(tensors, hiding)}\ngraph_fallback=True: "
                                                f"such inputs run eagerly.")
            if key is None or key in self._failed:
                graph = None
            elif graph is not None:
                self._graphs.move_to_end(key)
                self._recent.append(False)
            elif grad and any(map(_requires_grad, self._differentiable[len(params):])):
                # A graph's backward differentiates the parameters and the inputs alone: such a
                # buffer would get no gradient. Eager for this signature, as unfused.
                names = [n for n, b in owner.named_buffers() if b.requires_grad]
                _bounded_add(self._failed, key, limit=_MAX_FAILED)
                self._warn_once("buffer-grad", f"{self.name}: cuda_graph=True, but buffers {names} require grad, "
                                               f"which a graph's backward would not give them: calls with grad "
                                               f"enabled run eagerly while they do (make them parameters to "
                                               f"capture them).")
            else:
                needs_grad = grad and (any(t.requires_grad for t in tensors) or any(p.requires_grad for p in params))
                try:
                    hiding = [v for v in others if _hidden_tensors(v)]
                    if hiding:
                        raise _CaptureError(self._hidden_inputs(tensors, hiding))
                    graph = self._capture(owner, forward, args, kwargs, tensors, device, needs_grad, params)
                except _CaptureError as e:
                    if not self.fallback:
                        raise
                    _bounded_add(self._failed, key, limit=_MAX_FAILED)
                    self._warn_once("fallback", f"{e}\ngraph_fallback=True: this input signature runs "
                                                f"eagerly from now on.")
                else:
                    graph.kept_alive = [t.detach() for t in (*owner.parameters(), *owner.buffers())]
                    self._insert(key, graph)
            if graph is not None and not extra and len(tensors) == 1 and len(args) == 1:
                self._hot = (key, graph)
        if graph is None:
            return forward(*args, **kwargs)
        return self._replay(graph, forward, args, kwargs, tensors)

    def _insert(self, key: Hashable, graph: _Graph) -> None:
        self._graphs[key] = graph
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)  # frees the graph and, with it, its pool
            self._hot = None  # (it may have been the evicted one)
        self._recent.append(True)
        if sum(self._recent) > self.max_graphs:
            self._warn_once(
                "thrash",
                f"{self.name}: CUDA graphs are being recaptured over and over ({sum(self._recent)} captures "
                f"in the last {len(self._recent)} calls, max_graphs={self.max_graphs}): inputs change "
                f"signature (shape, dtype, requires_grad, train/eval ...) more often than the cache holds. "
                f"Raise max_graphs, pad inputs to a few fixed shapes, or use cuda_graph=False.",
            )

    # --------------------------------------------------------------- capture
    def _capture(self, owner: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict,
                 tensors: list[torch.Tensor], device: torch.device, needs_grad: bool,
                 params: list[nn.Parameter]) -> _Graph:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if needs_grad:
            # Warm-up and capture run the blocks below with aliases for the parameters
            # (_with_aliases), in which they cannot tell a change of their own: seen here,
            # on the caller's stream, as their own calls would see it.
            _watch._reset_changed_below(owner)
        # Ways the owner can run this call (``fuse="auto"``: fused or not;
        # ``compile=``: compiled children, eager ones, or the owner compiled as
        # a whole): each is captured and the
        # fastest replay kept, as cudnn.benchmark keeps the fastest algorithm.
        # Each new graph is timed against the best so far and the slower freed
        # at once, so at most two graphs' memory is held. Training graphs take
        # the first, to capture (and hold the memory of) one backward only.
        with torch.cuda.device(index), _capture_lock, _collector_paused():
            caller = torch.cuda.current_stream()
            stream = _capture_stream(index)
            buffers = list(owner.buffers())
            with torch.no_grad():
                saved = [b.clone() for b in buffers]
            slots = _buffer_slots(owner)  # (a forward assigning a buffer anew is refused: _refuse_reassigned)
            autocast_cache = torch.is_autocast_cache_enabled()
            # Casts cached by autocast outside the graph would be read by address
            # and freed when the autocast region ends: cast inside the graph instead.
            torch.set_autocast_cache_enabled(False)
            # Warm-up and capture differentiate the static inputs of branches that run
            # on side streams: an input's accumulator (made on the capture stream) gets
            # gradients from nodes of other streams, which the engine orders with an
            # event, as it should. PyTorch warns of such a mismatch, once per process,
            # as a sign of an accumulator kept alive from an earlier iteration; here it
            # is by design, and it is this module's own call, so it is not warned of.
            warn_mismatch = _warns_of_mismatch()
            _warn_mismatch(False)
            _local.active = True
            try:
                # A graph freed earlier may still be replaying somewhere: its static
                # buffers, allocated on the capture stream, are reused from here on.
                torch.cuda.synchronize()
                stream.wait_stream(caller)
                with torch.cuda.stream(stream):  # (the owner may time its parts: see Parallel._longest_first)
                    variants = getattr(owner, "_graph_variants", lambda a, k, f: [None])(args, kwargs, needs_grad)
                if needs_grad:
                    variants = variants[:1]
                best = None
                for variant in variants:
                    _local.variant = (owner, variant)
                    whole = variant is not None and _WHOLE in variant
                    graph = _Graph(self.name, torch.device("cuda", index), self.lend)
                    graph.variant = variant
                    try:
                        with torch.cuda.stream(stream):
                            with torch.inference_mode(False):
                                # (Not inference tensors, which keep no version: warm-up and capture
                                # fork on these, and the fork sees a branch write to its input by it.)
                                graph.inputs = [_static_like(t.detach()).requires_grad_(t.requires_grad and needs_grad)
                                                for t in tensors]
                                graph.expanded = any(_dense(s) and 0 in s.stride() for s in graph.inputs)
                                graph.input_versions = [s._version for s in graph.inputs]
                            graph.params = tuple(p for p in params if p.requires_grad) if needs_grad else ()
                            graph.param_ids = frozenset(map(id, graph.params))
                            run = owner._compiler.whole(forward) if whole else forward
                            call = _bind(run, args, kwargs, graph.inputs)
                            leaves = graph.params
                            if needs_grad:
                                call, leaves = _with_aliases(owner, call)
                            surface = tuple(s for s in graph.inputs if s.requires_grad) + leaves
                            strays: list[torch.Tensor] = []
                            for i in range(_WARMUP_ITERS):
                                try:
                                    out = call()
                                except RuntimeError as e:
                                    self._written_leaf(e, graph.inputs, tensors)
                                    raise
                                if i < 2:
                                    strays = self._check_leaves(out, surface, strays if i else None)
                                if needs_grad:
                                    _grad(out, surface)
                                del out
                            self._refuse_reassigned(slots, tensors)
                            graph.written = [i for i, (s, v) in enumerate(zip(graph.inputs, graph.input_versions))
                                             if s._version != v]
                        torch.cuda.synchronize()
                        _clear_cublas_workspaces()  # the capture allocates its own (see _clear_cublas_workspaces)
                        self._record(graph, call, surface, leaves, needs_grad, stream, caller, index, tensors)
                    except Exception as e:
                        # The module compiled as a whole is only ever an alternative
                        # to variants already captured: where the compiler cannot
                        # make it, or its code cannot be captured, those stay, and
                        # later signatures do not try again (``explain()`` says why).
                        if not whole or best is None:
                            raise
                        owner._compiler.whole_failure = f"{type(e).__name__}: {str(e).strip()[:500]}"
                        del graph
                        torch.cuda.synchronize()
                        continue
                    best = graph if best is None else _fastest([best, graph], stream)
                    del graph, call  # the slower one's pool goes with its last reference
                graph = best
                if graph.readable and getattr(owner, "_compiler", None) is None:
                    # (Not with compile=: compiled code guards on its inputs, which warm-up
                    # gave as the static clones -- never inference tensors, never requiring
                    # grad -- and the caller's tensors would make it compile anew inside the
                    # capture, and may run other kernels there.)
                    self._reader(graph, owner, forward, args, kwargs, tensors, caller)
            finally:
                # The thread's own state first, before anything that can raise (a CUDA error, or a
                # KeyboardInterrupt arriving in it): left set, ``active`` told every later call of
                # this thread that a capture was under way, for the rest of the process.
                _local.active = False
                _local.variant = None
                torch.set_autocast_cache_enabled(autocast_cache)
                _warn_mismatch(warn_mismatch)
                # Warm-up (and timing replays) ran the module: put its buffers back,
                # so that the replay of this call is the only update they see. (Its own
                # buffers first, where a warm-up that failed had assigned others: no
                # CUDA call, so before those that can raise.)
                _restore_slots(slots)
                torch.cuda.set_stream(caller)
                try:
                    caller.wait_stream(stream)
                    with torch.no_grad():
                        for b, s in zip(buffers, saved):
                            b.copy_(s)
                finally:
                    # Whatever the restore raised: left, the cache would hand later eager
                    # products workspaces from the graph's pool, which its replays overwrite.
                    _clear_cublas_workspaces()
            self.captures += 1
            # The next replay from another stream waits for the restore above (see _Graph._order).
            graph.last = caller
        return graph

    def _refuse_reassigned(self, slots: list[tuple[str, nn.Module, dict]], tensors: list[torch.Tensor]) -> None:
        r"""Refuse a forward that assigns a buffer a new tensor (``self.steps = self.steps + 1``).

        A graph reads a buffer where it lay when captured; one assigned anew by
        each warm-up call lies in memory the capture and the variants' timing
        free (reading it, a replay faulted on the H200 machine), and a replay
        would not assign it anyway. The tensors the warm-up assigned are taken
        out again: the module holds its own buffers, whose values are put back
        with the others'. (Updated in place, ``self.steps.add_(1)``, a buffer
        is captured as BatchNorm's running statistics are.)
        """
        changed = [(name, k) for name, m, kept in slots for k, t in kept.items() if m._buffers.get(k) is not t]
        if not changed:
            return
        _restore_slots(slots)
        where = ", ".join(f"{name + '.' if name else ''}{k}" for name, k in changed[:3])
        raise _CaptureError(
            f"{self.name}: cannot capture input signature ({_describe(tensors)}) with cuda_graph=True: forward "
            f"assigns a new tensor to the buffer {where} (as `self.buf = self.buf + 1` does). A graph reads "
            f"buffers where they lay when captured, and a replay assigns nothing. Update the buffer in place "
            f"(`self.buf.add_(1)`, `self.buf.copy_(...)`), or pass graph_fallback=True to run this signature "
            f"eagerly with a warning.")

    def _written_leaf(self, error: RuntimeError, inputs: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        r"""Refuse a training capture whose forward changes in place an input that requires grad (raises
        :class:`_CaptureError` from ``error`` where that is what ``error`` says; returns otherwise).

        A graph differentiates the static copies of such inputs, which are leaves:
        torch refuses to change a leaf requiring grad in place, where eagerly the
        caller's input -- a layer's output, not a leaf -- may be
        (``nn.ReLU(inplace=True)`` first in a stage or branch). A replay could
        compute the outputs and gradients on a copy, but could not change the
        caller's tensor as the eager call does, with its autograd history.
        Refused, then, as a forward the graphs cannot replay, so that
        ``graph_fallback=True`` runs such calls eagerly; before, torch's error
        went on as raised, which ``graph_fallback`` did not catch.
        """
        if "leaf Variable that requires grad" not in str(error) or not any(s.requires_grad for s in inputs):
            return
        raise _CaptureError(
            f"{self.name}: cannot capture input signature ({_describe(tensors)}) with cuda_graph=True: forward "
            f"changes in place a tensor that requires grad ({str(error).strip().splitlines()[0]}). A graph "
            f"differentiates its own copies of the inputs that require grad, which are leaves; eagerly such an "
            f"input (a layer's output) may be changed in place, as by nn.ReLU(inplace=True) first in a branch "
            f"or stage, but a replay would leave the caller's tensor as it was. Make that operation out of "
            f"place (inplace=False, x = x + 1), or pass graph_fallback=True to run this signature eagerly with "
            f"a warning."
        ) from error

    def _check_leaves(self, out: Any, surface: tuple, before: list[torch.Tensor] | None) -> list[torch.Tensor]:
        r"""Refuse outputs that autograd differentiates with respect to tensors the graphs do not.

        The backward graph computes the gradients of the inputs and of the
        owner's parameters (``surface``); a tensor requiring grad that a branch
        reads from elsewhere -- a closure, a global, a module not registered
        below the owner -- would silently get none. Returns the leaves of
        ``out``'s autograd graph outside ``surface``; ``before``: those of the
        previous warm-up call, and leaves found in both are refused (one made
        anew by each call, ``x.detach().requires_grad_()`` to differentiate
        inside ``forward``, is the call's own business).
        """
        if not torch.is_grad_enabled():
            return []
        known = {id(t) for t in surface}
        seen: dict[int, Any] = {}  # (the nodes held: Python wrappers of nodes are made on access, ids reused)
        strays: list[torch.Tensor] = []
        todo: list[Any] = []
        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.requires_grad:  # (an output may be such a leaf itself)
                todo.append(o.grad_fn if o.grad_fn is not None else o)
        while todo:
            node = todo.pop()
            if isinstance(node, torch.Tensor):
                leaf = node
            else:
                if node is None or id(node) in seen:
                    continue
                seen[id(node)] = node
                leaf = getattr(node, "variable", None)  # (an AccumulateGrad node)
                if leaf is None:
                    todo.extend(n for n, _ in node.next_functions)
                    continue
            if id(leaf) not in known and all(leaf is not t for t in strays):
                strays.append(leaf)
        stray = next((t for t in strays if before is not None and any(t is b for b in before)), None)
        if stray is not None:
            raise _CaptureError(
                f"{self.name}: cannot capture a CUDA graph whose output depends on a tensor requiring grad "
                f"that is neither an input nor a parameter of the module (Tensor{tuple(stray.shape)} "
                f"{str(stray.dtype).replace('torch.', '')}: read from a closure or a global, a module not "
                f"registered below it, or a buffer that requires grad): the graphed backward would leave "
                f"its gradient unset. Register it as an nn.Parameter of a submodule, or pass it as an "
                f"input; or pass graph_fallback=True to run this signature eagerly with a warning.")
        return strays

    def variants(self) -> dict[Hashable, Any]:
        r"""The variant each cached graph runs (see ``_graph_variants``), by cache key."""
        return {k: variant for k, (variant, _) in self.schedules().items()}

    def schedules(self) -> dict[Hashable, tuple[Any, bool]]:
        r"""By cache key, each cached graph's variant and whether it has a reader (see ``_reader``), at one moment."""
        with self._lock:
            return {k: (g.variant, g.reader is not None) for k, g in self._graphs.items()}

    def _record(self, graph: _Graph, call: Callable[[], Any], surface: tuple, leaves: tuple, needs_grad: bool,
                stream: torch.cuda.Stream, caller: torch.cuda.Stream, index: int,
                tensors: list[torch.Tensor]) -> None:
        if self._hooked:
            self._warn_once("hooks", f"{self.name}: cuda_graph=True with hooks on modules it runs: the hooks' "
                                     "tensor operations are captured and replayed, but the hooks themselves "
                                     "run only while a graph is captured (a hook that stores activations or "
                                     "counts calls sees the warm-up and capture calls only). Remove them, or "
                                     "pass cuda_graph=False.")

        def captured(g: torch.cuda.CUDAGraph, fn: Callable[[], Any], what: str = "") -> Any:
            try:
                with torch.cuda.graph(g, pool=graph.pool, stream=stream, capture_error_mode="thread_local"):
                    return fn()
            except BaseException as e:
                _abandon(g, graph.pool, stream, caller, index)
                if not isinstance(e, Exception):
                    raise
                left = _streams_left_capturing(index)
                raise _CaptureError(
                    f"{self.name}: CUDA graph capture{what} failed for input signature "
                    f"({_describe(tensors)}) with cuda_graph=True:\n  {_explain(e)}\n"
                    f"Code captured in a CUDA graph must not synchronise with the host (.item(), .cpu(), "
                    f".tolist(), .nonzero(), printing a CUDA tensor, torch.cuda.synchronize()) nor take "
                    f"Python branches on tensor values, and shapes must not depend on data. Fix the "
                    f"operation above, pass cuda_graph=False, or pass graph_fallback=True to run such "
                    f"signatures eagerly with a warning. The capture was ended; the module and CUDA remain "
                    f"usable."
                    + (" (A side stream is still capturing: restart the process.)" if left else "")
                ) from e

        out = captured(graph.fwd, call)
        flat, spec = pytree.tree_flatten(out)
        hiding = [o for o in flat if not isinstance(o, torch.Tensor) and _hidden_tensors(o)]
        if hiding:
            raise _CaptureError(
                f"{self.name}: cannot replay the output of input signature ({_describe(tensors)}) with "
                f"cuda_graph=True: it holds tensors inside a {type(hiding[0]).__name__} object, which every "
                f"replay would hand back as the same object, its tensors overwritten by the next replay. "
                f"Return tensors, or tuples, lists, dicts or namedtuples of them, or register the class "
                f"with torch.utils._pytree (register_dataclass for a dataclass); or pass "
                f"graph_fallback=True to run this signature eagerly with a warning."
            )
        graph.out_idx = [i for i, o in enumerate(flat) if isinstance(o, torch.Tensor)]
        outputs = [flat[i] for i in graph.out_idx]
        if isinstance(out, torch.Tensor):
            graph.out_spec = None
        else:
            graph.out_spec = spec
            graph.out_flat = [None if isinstance(o, torch.Tensor) else o for o in flat]
        graph.out_grad = [o.requires_grad for o in outputs]
        if needs_grad and any(graph.out_grad):
            with torch.cuda.stream(stream):
                graph.grad_outputs = [torch.empty_like(o) if g else None for o, g in zip(outputs, graph.out_grad)]
            graph.bwd = torch.cuda.CUDAGraph()
            diff = [o for o in outputs if o.requires_grad]
            out_saved, graph.state_saved = _saved(self._owner(), outputs)
            if self.static_outputs:
                graph.out_saved = out_saved
            with _backward_autocast():
                grads = captured(graph.bwd, lambda: _in_layout(torch.autograd.grad(
                    diff, surface, grad_outputs=[g for g in graph.grad_outputs if g is not None],
                    allow_unused=True), surface), " of the backward pass")
            by_id = {id(t): g for t, g in zip(surface, grads)}
            graph.grad_inputs = [by_id.get(id(t)) for t in [*graph.inputs, *leaves]]
            graph.plan_grads()
            if _will_execute_node is not None and any(g is not None for g in graph.grad_inputs[len(graph.inputs):]):
                graph.direct = self.direct_grads
                # (Not where two parameters' gradients are one tensor, or share memory -- an add
                # passes its gradient through to both sides --: each .grad must be its own.)
                graph.lends_grads = self._lend_grads and _own_memory(graph.param_copies.sources)
                graph.token = torch.zeros(0, device=graph.device, requires_grad=True)
                graph.token_node = torch.autograd.graph.get_gradient_edge(graph.token).node
                graph.token_grad = torch.zeros(0, device=graph.device)
        else:
            # Replays copy into the static inputs with autograd on: they must not be leaves requiring grad.
            for s in graph.inputs:
                s.requires_grad_(False)
        graph.outputs = [o.detach() for o in outputs]
        graph.readable = not needs_grad and _readable(graph, tensors, outputs)


def _buffer_slots(owner: nn.Module) -> list[tuple[str, nn.Module, dict]]:
    r"""Each module of ``owner`` with its buffers as they are now (see ``_CudaGraphs._refuse_reassigned``).

    (TorchScript modules keep theirs in C++, behind a view that is not a
    dict, which their own code cannot assign anew from Python.)
    """
    return [(name, m, dict(m._buffers)) for name, m in owner.named_modules()
            if isinstance(m._buffers, dict) and m._buffers]


def _restore_slots(slots: list[tuple[str, nn.Module, dict]]) -> None:
    r"""Put each module's own buffers of ``slots`` back (not through ``setattr``: no registration to be seen)."""
    for _, m, kept in slots:
        if any(m._buffers.get(k) is not t for k, t in kept.items()):
            m._buffers.update(kept)


def _matching_outputs(graph: _Graph, out: Any) -> list[torch.Tensor]:
    r"""The tensors of a reader's output ``out``, if shaped as ``graph``'s outputs; else ``[]`` (no reader)."""
    outputs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    if len(outputs) == len(graph.outputs) and all(
            o.shape == s.shape and o.dtype == s.dtype for o, s in zip(outputs, graph.outputs)):
        return outputs
    return []


def _copy_out(into: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
    r"""Copy a first graph's ``outputs`` into its reader's buffers ``into``, after its replay.

    One multi-tensor kernel for several outputs, a plain copy for one (the
    multi-tensor kernel took 3.2 us for a single 64 kB tensor, where a plain
    copy takes about 1.3 us, on the H200 machine: tools/exp_fused_kernels.py).
    """
    if len(into) == 1:
        into[0].copy_(outputs[0])
    else:
        torch._foreach_copy_(into, outputs)


def _readable(graph: _Graph, tensors: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
    r"""Whether inference ``graph`` may also be captured reading its inputs in place (see ``_CudaGraphs._reader``).

    Where the caller's tensors are laid out and aligned as the static buffers
    (which the call that captured them set: see :func:`_static_like`), carry no conjugate or
    negative bit (which the copy resolves), and were not written in place by
    warm-up or capture (the static buffers keep such writes from the caller's
    tensors); where no output is an input (the reader would return, and hold,
    the caller's tensor); and where the outputs are no larger than the inputs
    by more than ``_IN_PLACE_SPARE_BYTES``: the reader's output buffers are
    held beside the first graph's, and a call copying its inputs in copies
    the outputs too.
    """
    try:
        inputs = {s.untyped_storage().data_ptr() for s in graph.inputs}
        return (all(t.layout == torch.strided and s.stride() == t.stride()
                    and t.data_ptr() % _IN_PLACE_ALIGNMENT == s.data_ptr() % _IN_PLACE_ALIGNMENT
                    for s, t in zip(graph.inputs, tensors))
                and not _flipped(tensors) and [s._version for s in graph.inputs] == graph.input_versions
                and all(o.untyped_storage().data_ptr() not in inputs for o in outputs)
                and sum(o.nbytes for o in outputs) <= sum(s.nbytes for s in graph.inputs) + _IN_PLACE_SPARE_BYTES)
    except RuntimeError:  # (a layout without storage or strides: sparse, nested)
        return False


def _saved(owner: nn.Module | None, outputs: list[torch.Tensor]) -> tuple[list[bool], tuple[torch.Tensor, ...]]:
    r"""Which of ``outputs``, and which of ``owner``'s parameters, autograd saved for the backward of
    ``outputs``: a flag for each output, and the parameters.

    Looked up by memory on the graph's nodes in one walk (see
    :func:`._saved._saved_storages`), once per capture: they saved the outputs
    or views of them, and the aliases of the parameters the capture ran with
    (see :func:`_with_aliases`).

    Outputs: a graph whose saved values cannot all be read counts as saving
    every output: refusing a change in place is the safe side.

    Parameters: not what a node whose saved values Python cannot read saved
    (an in-place write to part of a tensor, a TorchScript function), nor a
    tensor without memory of its own: counted as saving them all, such a graph
    refused changes that eager autograd lets pass (a bias). A graph whose
    saved values cannot be read otherwise (saved-tensor hooks) counts as
    saving them all.
    Not buffers: a capture puts them back in place after its warm-up (see
    :meth:`_CudaGraphs._capture`), a change eagerly unseen -- BatchNorm updates
    its running statistics, which autograd saves, without a new version -- that
    would refuse the backward of an earlier call of another signature.
    """
    # (Each once: ``parameters()`` leaves out those it has seen.)
    params = tuple(owner.parameters()) if owner is not None else ()
    walked_past: list[Any] = []
    hit = _saved_storages([o.grad_fn for o in outputs], walked_past=walked_past)
    if hit is None:
        return [True] * len(outputs), params
    out_saved = ([True] * len(outputs) if walked_past else
                 [o.untyped_storage().data_ptr() in hit and o.numel() > 0 for o in outputs])  # (all empty ones share 0)
    hit.discard(0)  # (an empty tensor's address, and a wrapper subclass's, which has no memory of its own)
    return out_saved, tuple(p for p in params if p.layout == torch.strided and p.numel() > 0
                            and _storage_address(p) in hit)


def _in_layout(grads: tuple, tensors: tuple) -> list[torch.Tensor | None]:
    r"""``grads``, each in the memory layout of the tensor it is the gradient of.

    Autograd keeps a returned gradient as a leaf's ``.grad`` only if its strides
    are the leaf's (for a dense leaf); any other it copies on every backward, an
    allocation and a launch each (a fused group's weight gradients come
    transposed where autograd differentiates its products, which read ``w.mT``:
    under autocast; elsewhere they come laid out as the weights, see
    ``_fusion._TrainedLinear``). Copied once in the backward graph instead.
    """
    out = []
    for g, t in zip(grads, tensors):
        if g is not None and g.layout != torch.strided:
            raise TypeError(
                f"a {str(g.layout).replace('torch.', '')} gradient (of a {tuple(t.shape)} tensor: "
                "nn.Embedding/EmbeddingBag(sparse=True)) has a size that depends on the batch's indices and "
                "cannot be captured; construct such layers with sparse=False to graph their training")
        if g is not None and g.stride() != t.stride():
            like = torch.empty_like(t)  # t's strides where t is dense
            if like.stride() == t.stride():
                g = like.copy_(g)
        out.append(g)
    return out


def _fastest(graphs: list[_Graph], stream: torch.cuda.Stream, budget_ms: float = 100.0) -> _Graph:
    r"""The graph whose calls take the least GPU time (see :func:`_quickest`), each replayed on a copy of its inputs.

    Timed as a module call runs it, the host's part included (the input
    copied in, then the replay). Timed otherwise -- replays alone, or
    queued far ahead of the GPU -- variants of the Inception block at batch 1
    on the H100 machine took 80 us a call alike, or ranked the other way
    round, while called as modules, 94 us in branch order and 88 captured
    longest first.
    """
    with torch.cuda.stream(stream), torch.no_grad():
        sources = [t.detach().clone() for t in graphs[0].inputs]  # (every variant has this signature's inputs)
    best = _quickest([lambda g=g: g.replay(sources, True) for g in graphs], stream, budget_ms)
    for g in graphs:
        # Every sample was waited for: no replay needs ordering after the capture
        # stream, which another thread may be capturing on by the next replay.
        g.last = None
    return graphs[best]


def _quickest(calls: list[Callable[[], Any]], stream: torch.cuda.Stream, budget_ms: float = 100.0,
              sample_ms: float = 1.0, least: int = 8, most: int = 40, too_long: int | None = None,
              slack: float = 0.0) -> int:
    r"""The index of the call that takes the least GPU time on ``stream`` (median of interleaved samples).

    Each sample from an idle GPU and about ``sample_ms`` long (1 to 10
    calls). As many samples of each as fit in ``budget_ms``, from ``least``
    to ``most``: variants can differ by a few microseconds, within the
    spread of a few samples. ``too_long``: returned without sampling where
    a call of each takes longer than the budget. ``slack``: the first call
    is kept unless its median exceeds the quickest's by more than this
    fraction of the quickest's.
    """
    times: list[list[float]] = [[] for _ in calls]
    with torch.cuda.stream(stream), torch.no_grad():

        def sample(call: Callable[[], Any], n: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                call()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        for call in calls:  # first calls: lazy work in the driver
            call()
        call_ms = max(sum(sample(c, 1) for c in calls) / len(calls), 1e-3)
        if too_long is not None and call_ms * len(calls) > budget_ms:
            return too_long
        group = max(1, min(10, int(sample_ms / call_ms)))
        reps = max(least, min(most, int(budget_ms / (call_ms * group * len(calls)))))
        for _ in range(reps):
            for i, call in enumerate(calls):
                times[i].append(sample(call, group))
    medians = [statistics.median(t) for t in times]
    best = medians.index(min(medians))
    return 0 if medians[best] * (1 + slack) >= medians[0] else best


def _graph_variant(owner: nn.Module) -> Any:
    r"""The variant of ``owner`` being warmed up or captured in this thread (``None``: the only one)."""
    current = _local.variant
    return current[1] if current is not None and current[0] is owner else None


def _with_aliases(owner: nn.Module, call: Callable[[], Any]) -> tuple[Callable[[], Any], tuple]:
    r"""``call`` run with the parameters that require grad replaced by aliases: same memory, new leaves.

    The captured backward must not involve the parameters' own gradient
    accumulators: autograd orders each one after the stream it was created
    on, and one created on the default stream and kept alive -- as
    DistributedDataParallel keeps them -- would make the capture depend on the
    legacy stream, which CUDA forbids. Aliases sharing the parameters' memory
    (so the graphs read the live values, and optimizer steps between calls
    are seen) are fresh leaves whose accumulators are created during warm-up
    on the capture stream; the gradients the backward graph computes for them
    are handed to the real parameters by :class:`_Replay`, outside the graph.
    """
    named = [(name, p) for name, p in owner.named_parameters() if p.requires_grad]
    aliases = {name: p.detach().requires_grad_() for name, p in named}

    def aliased() -> Any:
        # (tie_weights: a parameter shared by two branches is named once above; every module
        # holding it must read its alias, or the gradient through the others is lost.)
        with _reparametrize_module(owner, aliases, tie_weights=True):
            return call()

    return aliased, tuple(aliases.values())


def _bind(forward: Callable[..., Any], args: tuple, kwargs: dict, static: list[torch.Tensor]) -> Callable[[], Any]:
    r"""``forward`` called like the user called it, with the static inputs in place of the tensors."""
    if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
        x = static[0]
        return lambda: forward(x)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    it = iter(static)
    leaves = [next(it) if isinstance(v, torch.Tensor) else v for v in leaves]
    sargs, skwargs = pytree.tree_unflatten(leaves, spec)
    return lambda: forward(*sargs, **skwargs)


def _backward_autocast() -> torch.autocast:
    r"""Autocast off for a captured backward, which the forward's call captures under the caller's autocast.

    Autograd runs a backward under the autocast state of the thread that
    starts it, and AMP's backward is started outside autocast (``scaler.scale(
    loss).backward()`` after the ``with torch.autocast(...)`` block): a backward
    captured inside it would compute in half precision what a region with
    autocast disabled kept in float32.
    """
    return torch.autocast("cuda", enabled=False)


def _grad(out: Any, surface: tuple) -> None:
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if outs and surface:
        with _backward_autocast():
            torch.autograd.grad(outs, surface, grad_outputs=[torch.zeros_like(o) for o in outs], allow_unused=True)
