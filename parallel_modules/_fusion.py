r"""Structurally identical branches evaluated as one: a batched kernel per layer.

Eight copies of ``Linear(256, 256) -> GELU`` on one input launch sixteen small
kernels; stacked, their weights make one ``[8, 256, 256]`` tensor and the eight
matrix products one ``baddbmm``. This module finds such groups among a
``Parallel``'s branches and runs each group as one batched computation.

**Grouping.** Two branches are *identical* when their module trees match:
same types, same hyper-parameters (``extra_repr`` and public attributes), same
train/eval modes, same parameter and buffer names, shapes, dtypes and devices
(members may differ in ``requires_grad``: frozen ones take no gradient from the
stacks). A branch is *fusable* when nothing in it depends on running
on its own: no hooks, no instance-level ``forward``, no parametrizations, no
in-place buffer updates (BatchNorm in training), no random draws (dropout in
training, whose masks could not match the unfused module's). Branches that are
not are run as usual, and :meth:`_Fusion.report` says why.

**Parameters stay the branches' own, with no copy per call.** The first fused
call stacks each parameter (and buffer) of a group into one tensor and points
every member's parameter at its slice of it (``param.data = stacked[i]``, as
:meth:`torch.nn.RNNBase.flatten_parameters` does for cuDNN). The parameters
keep their identity, names, values and state-dict entries; an optimizer
updating them in place updates the stacked tensor, so the next call -- eager,
or a CUDA graph that read it by address -- sees the new values. Every eager
call checks that each parameter still points into its stack (a parameter
replaced or re-assigned by hand is stacked anew). The biases of ``Linear``
layers of one width after the first are stacked further, into one tensor for
all those layers, so that a CUDA graph writes them all into their products'
outputs with one kernel (see :class:`_Prefill`); each bias stays contiguous. Gradients reach each member's
parameter through :class:`_Unstack`, whose backward hands each one its slice
of the stacked gradient. While a compiler traces, the stacks are built with
``torch.stack`` instead, so the traced graph reads the real parameters.

**Kernels.** For inference, a group of ``Linear`` layers and activations on
a few rows of features computes each layer and the activation after it as
one Triton kernel for all members (:mod:`._batched_linear`): one launch per
layer, where cuBLAS takes a product and an activation per layer (and, in a
capture, a copy of the biases). Captured, that shortens the replay; eagerly,
where each launch costs the host more than the GPU, it halves the launches
(``_Group.kernel_layers`` says where).

**Layouts.** A group's intermediate value is held in one of three layouts,
chosen so that each layer maps to one existing kernel:

* *shared*: the group's common input, ``[B, ...]`` (every member sees it);
* *stacked*: ``[N, B, ...]``, member ``i`` at index ``i`` of dim 0 -- what
  ``baddbmm`` and :func:`torch.vmap` work on;
* *channels*: ``[B, N * C, ...]``, member ``i`` owning channels
  ``i*C .. (i+1)*C`` -- what a grouped convolution works on.

Linear layers, convolutions, eval-mode BatchNorm, LayerNorm, pointwise
activations, pooling and ``Flatten`` have batched rules below; any other
module is run under :func:`torch.vmap` over :func:`torch.func.functional_call`
(correct for anything vmap can batch, slower in eager mode). A group that
fails to run batched (vmap cannot batch an operation, data-dependent control
flow) is marked unfusable with the error as its reason.
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import dataclasses
import enum
import functools
import itertools
import operator
import sys
import threading
import weakref
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch
import torch.autograd.forward_ad as _forward_ad
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _dispatch_stack

from . import _batched_linear, _watch
from ._inputs import _BY_VALUE, _bounded_add
from ._joins import _leaf_join
from ._saved import _saved_storages
from ._streams import (_capture_underway, _current_stream, _dispatch_modes, _functorch_active, _graph_task,
                       _is_tracing, _jit_tracing, _pool, _saved_hooks_recording, _Writes)

_function_modes = torch._C._is_torch_function_mode_enabled  # Python function modes active on this thread


def _overrides_ops(cls: type) -> bool:
    r"""Whether operations on tensors of class ``cls`` go through its ``__torch_function__`` (a subclass
    that keeps its type through operations, ``as_subclass``'s, or one that logs or changes them).

    Batched, a group runs other operations than each member's own (``baddbmm`` for a ``Linear``'s
    ``F.linear``), and ``torch.vmap`` hands back plain tensors: such a subclass would see other calls,
    and lose its type, where unfused it keeps both. A parameter and the fakes of a trace turn it off;
    so does a subclass of ``__torch_dispatch__`` alone (``TwoTensor``), which vmap keeps, batched.
    """
    return cls is not torch.Tensor and cls.__torch_function__ is not torch._C._disabled_torch_function_impl


# Whether torch.export traces, strict or not: its flag, read as it is, where there is one. (Not
# torch.compiler.is_exporting(): torch 2.11's Dynamo takes that for True under torch.compile too.)
if hasattr(torch.compiler, "_is_exporting_flag"):
    def _is_exporting() -> bool:
        return torch.compiler._is_exporting_flag
else:
    _is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)

__all__: list[str] = []


def _keep_vmap_levels_in_graphs() -> None:
    r"""Tell ``torch.fx``'s dead-code elimination to keep the calls that enter and leave a vmap level.

    ``torch.export`` (non-strict) records a fused group's vmapped layers as
    ``_vmap_increment_nesting``, ``_add_batch_dim`` ... ``_remove_batch_dim``,
    ``_vmap_decrement_nesting``. The first and last return nothing the graph uses,
    and torch does not list them among the functions with side effects (as it
    lists ``_set_grad_enabled`` and autocast's): ``torch.export.unflatten``,
    which eliminates dead code, dropped them, and its module then failed in the
    batched layer ("your tensor may have escaped from inside a function being
    vmapped"), as any pass eliminating dead code in such a graph would. (Registered
    for the process, at import: an exported program may be unflattened in a
    process that imports the package but never calls a block. ``lazy_load_decompositions`` registers
    vmap's decompositions the batched layers may need.)
    """
    register = getattr(torch.fx.node, "has_side_effect", None)
    try:
        from torch._functorch import predispatch
    except ImportError:  # pragma: no cover - an older torch, whose export records no vmap levels
        return
    if register is None:  # pragma: no cover
        return
    for name in ("_vmap_increment_nesting", "_vmap_decrement_nesting", "lazy_load_decompositions"):
        fn = getattr(predispatch, name, None)
        if fn is not None:
            register(fn)


_keep_vmap_levels_in_graphs()

_SHARED, _STACKED, _CHANNELS = 0, 1, 2
# A group's final value only: every member returned the group's input itself (see _Group._run).
_INPUT = 3
# A group's final value only, stacked: every member returned a view of the group's input (one for all,
# vmap's expansion of it), which each member gets a view of its own of (see _Group._run).
_VIEWS = 4
# The dtypes whose ``sum`` and ``mean`` accumulate in the dtype itself, as a join's additions do
# (half and bfloat16 accumulate in float32; integers and bool promote to int64). Not in the join's
# order, left to right, from five members on, on the CPU (its reduction keeps several partial
# sums): the result agrees with the unfused one to the dtype's rounding, not bit for bit.
_ACCUMULATED_IN_PLACE = frozenset((torch.float32, torch.float64, torch.complex64, torch.complex128))

# Pointwise modules without parameters: applied to a value as it is, in any
# layout (a shared value stays shared: every member would compute the same).
_POINTWISE = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.Hardtanh, nn.Hardswish,
    nn.Hardsigmoid, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.Softplus, nn.Softsign, nn.Tanhshrink,
    nn.LogSigmoid, nn.Identity,
)
# torch's dropout layers, and their forwards: the identity in eval or with p=0.
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_STOCK_DROPOUT = frozenset(c.forward for c in _DROPOUTS)
# Those of them whose forward reads its input's number of dimensions, and the numbers it takes
# without a warning (a batch of channels of a sequence, an image, a volume, or one unbatched).
_FEATURE_DROPOUTS = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
_QUIET_DROPOUT_DIMS = {nn.Dropout1d: (2, 3), nn.Dropout2d: (4,), nn.Dropout3d: (4, 5)}
# torch's batch norms' checks of their input, which read its number of dimensions only.
_STOCK_DIM_CHECKS = frozenset(c._check_input_dim for c in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
                                                           nn.SyncBatchNorm))
# Pooling works channel by channel, so it applies in the shared and channels layouts.
_POOLING = (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)
# Layers whose forward reads no train/eval mode but which are no ``_POINTWISE`` module (they
# mix a row, hold a parameter or keep no running statistics), run through vmap: a member's put
# in ``eval()`` inside a training block computes as its twins do, so it must not part them.
# (Not ``nn.RReLU``, the instance norms or attention, which read their mode.)
_MODE_FREE_LAYERS = (nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d, nn.GLU, nn.PReLU, nn.Threshold,
                     nn.Hardshrink, nn.Softshrink, nn.GroupNorm, nn.Embedding, nn.ConvTranspose1d, nn.ConvTranspose2d,
                     nn.ConvTranspose3d, nn.Unflatten)
# Modules whose batched rule does not depend on train/eval mode.
_MODE_FREE = frozenset((*_POINTWISE, *_POOLING, *_MODE_FREE_LAYERS, nn.Sequential, nn.Linear, nn.Conv1d,
                        nn.Conv2d, nn.Conv3d, nn.LayerNorm, nn.Flatten))


def _mode_free(m: nn.Module, enclosed_by_free: bool = True) -> bool:
    r"""Whether ``m``'s train/eval mode changes nothing it computes: a ``_MODE_FREE`` type with its stock
    forward, enclosed (below the branch) by such modules only. A module of the user's may read a
    child's mode (``self.lin.training``), which then matters as any other.

    So too a torch dropout whose rate is 0, the identity in either mode (``p=0`` ends a dropout
    schedule, or switches dropout off in one head): left in ``eval()`` it stays fused with its
    twins. Its rate, set in place later, is watched (see ``_Fusion.settings``): raised above 0,
    the branches are grouped anew, and its mode compared again.
    """
    return enclosed_by_free and "forward" not in vars(m) and (
        type(m) in _MODE_FREE or type(m) in _DROPOUTS and m.p == 0)


def _moded(root: nn.Module) -> list[tuple[str, nn.Module]]:
    r"""The submodules of ``root`` (itself too), named, whose train/eval mode may change what it computes
    (see :func:`_mode_free`), in ``named_modules()`` order: what grouping compares and the watches watch."""
    found, stack = [], [("", root, True)]
    while stack:
        name, m, enclosed_by_free = stack.pop()
        free = _mode_free(m, enclosed_by_free)
        if not free:
            found.append((name, m))
        stack.extend((_join(name, n), c, free) for n, c in reversed(m._modules.items()) if c is not None)
    return found


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# Hooks registered for every module (``register_module_forward_hook`` ...): torch mutates
# these dicts in place, so holding them is enough to see one registered later.
_GLOBAL_HOOKS = tuple(getattr(nn.modules.module, "_global" + h) for h in _HOOKS
                      if hasattr(nn.modules.module, "_global" + h))
# Every hook handle torch makes (module hooks, global ones, tensor hooks) takes the next
# id of this class: while it has not moved, no hook was registered anywhere.
_Handle = torch.utils.hooks.RemovableHandle


def _hook_dicts(module: nn.Module, own: bool = True) -> list[dict]:
    r"""The hook dicts of every module below ``module``, and of ``module`` itself if ``own``."""
    return [getattr(m, h) for m in module.modules() if own or m is not module for h in _HOOKS if hasattr(m, h)]


# -------------------------------------------------------------- identical?
# nn.Module's own bookkeeping (parameter, buffer and hook dicts), compared otherwise, and the
# revision a block's setting or a callable branch's ``fn`` set anew gives it (see _watch._members).
_MODULE_STATE = frozenset(vars(nn.Module())) | {"_revision"}


def _hyperparameters(m: nn.Module) -> dict[str, Any]:
    # Every other instance attribute, private ones too: a custom module may keep a
    # setting of its own as ``self._scale``, which a batched call would read off member 0.
    return {k: v for k, v in vars(m).items() if k not in _MODULE_STATE}


def _tensor_attributes(m: nn.Module) -> dict[str, torch.Tensor]:
    r"""``m``'s own tensor attributes that are neither parameters nor buffers (a table, a cache): the
    :func:`_hyperparameters` that the layers run through vmap read off the first member for all."""
    return {k: v for k, v in _hyperparameters(m).items() if isinstance(v, torch.Tensor)}


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # tensors, arrays: not hyper-parameters we can compare
        return False


def _same_tensor(x: Any, y: Any) -> bool:
    r"""Whether two tensor attributes (not parameters or buffers) hold the same values, so that the
    first member's may serve every member of a group: a table or a cache each member computed alike.

    Not one that requires grad (a product of a member's parameters: its gradient would reach the first
    member's alone), nor while a CUDA graph captures (comparing values waits for the device).
    """
    if x is y:
        return True
    try:
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and type(x) is type(y)
                and not x.requires_grad and not y.requires_grad and x.shape == y.shape
                and x.dtype == y.dtype and x.device == y.device and x.layout == y.layout == torch.strided
                and not (x.is_cuda and torch.cuda.is_current_stream_capturing())
                and bool(torch.equal(x, y)))
    except Exception:  # (no values to compare: a meta tensor, a leaked vmap wrapper)
        return False


def _attribute_value(value: Any) -> str:
    r"""An attribute's value (see :func:`_hyperparameters`), for a message."""
    if isinstance(value, torch.Tensor):
        # (Not its values: ``prune`` and the hook-based ``weight_norm`` keep the weight so.)
        return f"a tensor that is not a parameter or buffer, {_describe_tensor(value)}"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _describe_tensor(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    grad = ", requires_grad" if t.requires_grad else ""
    made = ", an inference tensor (made under torch.inference_mode)" if t.is_inference() else ""
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device}{grad}{made}"


def _alike_but(branches: list[nn.Module], i: int, fusable: Iterable[int]) -> str:
    r"""What keeps branch ``i`` from the ``fusable`` branches it is identical to but for a train/eval
    mode (a branch left in eval mode by mistake), a tensor attribute's values (a mask or scale held
    as a plain attribute), or both, or ``""`` where none is.

    ``fuse=True`` refuses such a branch, naming the difference; ``"auto"`` runs it
    unfused, and its ``explain()`` says why, or the user would look for a
    difference in the layers.
    """
    fusable = [j for j in fusable if j != i]
    for j in fusable:
        if _difference(branches[j], branches[i], modes=False) is None:
            return f": {_mode_apart(branches, i, j, 'alike otherwise')} ({_MODE_FIX} to fuse them)"
        if _difference(branches[j], branches[i], tensors=False) is None:
            return f"; beside branch index {j}, alike otherwise, {_difference(branches[j], branches[i])}"
    # (Only then a twin apart in both, whose first difference alone would send the user
    # to fix it and find the other.)
    for j in fusable:
        both = _mode_and_tensor_apart(branches[j], branches[i])
        if both is not None:
            return (f": {_mode_apart(branches, i, j, 'alike but for that and a tensor attribute')} ({_MODE_FIX}); "
                    f"and {both[1]}")
    return ""


_MODE_FIX = "put every branch in one mode with block.train() or block.eval() on the whole block"


def _mode_apart(branches: list[nn.Module], i: int, j: int, alike: str) -> str:
    r"""Which submodule of branch ``i`` is in another train/eval mode than in branch ``j`` (``alike``
    but for modes, or tensor attributes too), for :func:`_alike_but`."""
    path, mode = next((name, m.training) for (name, m), (_, t) in zip(_moded(branches[i]), _moded(branches[j]))
                      if m.training != t.training)
    where = f"its submodule {path!r} is" if path else "it is"
    other = "training" if not mode else "eval"
    return f"{where} in {'training' if mode else 'eval'} mode, and branch index {j}, {alike}, in {other}"


def _mode_and_tensor_apart(a: nn.Module, b: nn.Module) -> tuple[str, str] | None:
    r"""Where ``b`` is identical to ``a`` but for both a train/eval mode and a tensor attribute's values,
    the two differences as :func:`_difference` names them (the mode's, the tensor's); else ``None``."""
    if _difference(a, b, tensors=False, modes=False) is not None:
        return None
    mode, tensor = _difference(a, b, tensors=False), _difference(a, b, modes=False)
    return None if mode is None or tensor is None else (mode, tensor)


def _difference(a: nn.Module, b: nn.Module, path: str = "", tensors: bool = True, modes: bool = True,
                enclosed_by_free: bool = True) -> str | None:
    r"""How module ``b`` differs in structure from ``a``, or ``None`` if identical.

    ``tensors=False``: attributes holding tensors (not parameters or buffers) are not compared.
    ``modes=False``: nor are the modules' train/eval modes (else those :func:`_moded` lists).
    ``enclosed_by_free``: (recursing) whether only :func:`_mode_free` modules enclose ``a``.
    """
    where = f"submodule {path!r}" if path else "the branch"
    if type(a) is not type(b):
        if type(a).__name__ == type(b).__name__:  # (two classes of one name: a factory's, a notebook cell run again)
            return (f"{where} is {_class_name(type(b))}, expected {_class_name(type(a))}: another class of the same "
                    f"name (define the class once and make every branch from it)")
        return f"{where} is {type(b).__name__}, expected {type(a).__name__}"
    # (The same answer in either mode. Where only one is free, another difference parts them
    # -- a dropout's rate, a forward of its own -- which is the one to name: not the mode.)
    free = _mode_free(a, enclosed_by_free) or _mode_free(b, enclosed_by_free)
    if modes and a.training != b.training and not free:
        got, expected = ("training", "eval") if b.training else ("eval", "training")
        fix = "train" if a.training else "eval"
        member = f"this branch's submodule {path!r}" if path else "this branch"
        return (f"{where} is in {got} mode, expected {expected} (as in the first branch): put every branch in one "
                f"mode with block.train() or block.eval() on the whole block, or call .{fix}() on {member}; "
                f"fuse='auto' runs a branch in another mode unfused")
    if a.extra_repr() != b.extra_repr() and not _prints_its_state(a):
        return f"{where} is {type(b).__name__}({b.extra_repr()}), expected {type(a).__name__}({a.extra_repr()})"
    ha, hb = _hyperparameters(a), _hyperparameters(b)
    for k in sorted(set(ha) | set(hb)):
        if not tensors and (isinstance(ha.get(k), torch.Tensor) or isinstance(hb.get(k), torch.Tensor)):
            continue
        if isinstance(ha.get(k), torch.Tensor) and isinstance(hb.get(k), torch.Tensor):
            # Read off the first member for every member (see _vmapped_step): alike only with
            # the same values -- a table, a cache each member's forward computed alike (rotary
            # tables: found different, a mode switch's regrouping unfused them, or refused a
            # fuse=True block).
            if not _same_tensor(ha[k], hb[k]):
                return (f"{where} holds {k!r}, a tensor that is not a parameter or buffer "
                        f"({_describe_tensor(hb[k])}), with other values than in the other branch (or one "
                        f"that requires grad), which fusion cannot stack for each branch: register it "
                        f"with register_buffer (or as a parameter)")
        elif k not in ha or k not in hb or not _same_value(ha[k], hb[k]):
            got = f"{k}={_attribute_value(hb[k])}" if k in hb else f"no attribute {k!r}"
            expected = (f"no attribute {k!r}" if k not in ha else _attribute_value(ha[k]) if k in hb
                        else f"{k}={_attribute_value(ha[k])}")
            return f"{where} has {got}, expected {expected}"
    for kind, ta, tb in (("parameter", a._parameters, b._parameters), ("buffer", a._buffers, b._buffers)):
        # (By name, not in registration order: ``prune.remove``, ``remove_weight_norm`` and
        # ``remove_parametrizations`` register the weight anew, after the bias. The groups
        # look members' tensors up by name.)
        if sorted(ta) != sorted(tb):
            return f"{where} has {kind}s {list(tb)}, expected {list(ta)}"
        for name in ta:
            x, y = ta[name], tb[name]
            # (Not ``requires_grad``: members frozen one by one run batched alike, the
            # stacks carrying gradients back to those that take them (see _Group._stacked);
            # compared, freezing a member made every later regrouping -- ``eval()``,
            # ``.to()``, a deep copy -- refuse the block.)
            # (Inference tensors or not, alike: one stack is one kind, see _stack.)
            same = (x is None) == (y is None) and (x is None or (
                x.shape == y.shape and x.dtype == y.dtype and x.device == y.device
                and x.is_inference() == y.is_inference()))
            if not same:
                return f"{kind} {_join(path, name)!r} is {_describe_tensor(y)}, expected {_describe_tensor(x)}"
    if list(a._modules) != list(b._modules):
        return f"{where} has children {list(b._modules)}, expected {list(a._modules)}"
    for name, ca in a._modules.items():
        cb = b._modules[name]
        if (ca is None) != (cb is None):
            return f"submodule {_join(path, name)!r} is {cb!r}, expected {ca!r}"
        if ca is not None:
            diff = _difference(ca, cb, _join(path, name), tensors, modes, free)
            if diff is not None:
                return diff
    return None


def _attributes_set_apart(a: nn.Module, b: nn.Module) -> str | None:
    r"""How ``b``'s attributes now differ from ``a``'s, or ``None``: :func:`_difference` without its tensor
    attributes, which are compared here by value (``a`` and ``b`` were grouped as identical).

    For members grouped alike whose own calls have run since -- ``fuse="auto"``'s
    first call runs them in turn -- and set attributes of their own: a cache
    their ``forward`` computes from their parameters (``if self.cache is None:
    self.cache = ...``), a loss it keeps (``self.aux_loss = ...``). A layer run
    through vmap reads the first member's for every member (see
    :func:`_vmapped_step`). Tables alike in every member (rotary tables cached
    from the input's length) are equal, and stay grouped.
    """
    diff = _difference(a, b, tensors=False)
    if diff is not None:
        return diff
    held = _attribute_on_tensors(b)
    if held is not None:
        return (f"its attribute {held!r}, a tensor that is not a parameter or buffer, shares memory with its "
                f"parameters or buffers (a view kept of one), which stacking would move")
    for (path, ma), (_, mb) in zip(a.named_modules(), b.named_modules()):
        where = f"submodule {path!r}" if path else "the branch"
        ha, hb = _hyperparameters(ma), _hyperparameters(mb)
        for k, x in ha.items():
            y = hb.get(k)
            if not (isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor)):
                continue
            if not _same_tensor(x, y):
                return (f"{where} holds {k!r}, a tensor that is not a parameter or buffer, of other values "
                        f"({_attribute_value(y)})")
    return None


_Attribute = tuple[str, str, dict, str, torch.Tensor, "int | None", int]


def _attribute_changed(attributes: list[_Attribute]) -> _Attribute | None:
    r"""The first member's tensor attribute (see :meth:`_Group._compare_attributes`) that is no longer the
    tensor it was, at the version it was -- changed in place (``.mul_()``), assigned anew or swapped since -- or
    ``None``.

    ``torch.utils.swap_tensors`` keeps the object and swaps in another tensor's
    contents and version counter, often at the same version: the address of
    its C++ tensor (``_cdata``) tells.

    (Looked at on every eager call of a group whose members hold any: a dict look-up and a
    version per attribute. An inference tensor keeps no version: written in place under
    ``inference_mode``, it is not seen.)
    """
    for a in attributes:
        _, _, d, k, t, v, c = a
        if d.get(k) is not t or t._cdata != c or v is not None and t._version != v:
            return a
    return None


def _member_tensor(member: nn.Module, qual: str) -> Any:
    r"""The parameter or buffer ``qual`` of ``member`` (``"0.bias"``), ``None`` where it has none, or
    ``_GONE`` where it has no submodule of that name (renamed since it was grouped)."""
    prefix, _, name = qual.rpartition(".")
    owner: nn.Module | None = member
    for part in prefix.split(".") if prefix else ():
        owner = owner._modules.get(part)
        if owner is None:
            return _GONE
    return owner._parameters.get(name) if name in owner._parameters else owner._buffers.get(name)


_GONE = object()


def _hidden_by_instance(state: dict[str, Any]) -> list[str]:
    r"""The names of a module's parameters, buffers and submodules that an entry of its instance ``__dict__``,
    ``state`` (which holds its dicts of them too), hides.

    ``nn.Module.__getattr__`` is asked only for what the instance dict lacks:
    an entry written there directly (``m.__dict__["weight"] = t``,
    ``object.__setattr__``; assigning the attribute registers it instead) is
    what the module's ``forward`` reads, while a batched call stacks and runs
    the registered one.
    """
    return [name for key in ("_parameters", "_buffers", "_modules") for name in state[key] if name in state]


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _compiled(m: nn.Module) -> bool:
    r"""Whether ``m`` is what ``torch.compile(module)`` returns (an ``OptimizedModule``)."""
    return type(m).__name__ == "OptimizedModule" and isinstance(getattr(m, "_orig_mod", None), nn.Module)


def _unfusable(branch: nn.Module) -> str | None:
    r"""Why ``branch`` cannot run batched with identical branches, or ``None``."""
    for path, m in branch.named_modules():
        where = f"submodule {path!r} ({type(m).__name__})" if path else f"the branch ({type(m).__name__})"
        if isinstance(m, torch.jit.ScriptModule):
            return f"{where} is a TorchScript module, which torch.func cannot call batched"
        if _quantized(m):
            return f"{where} is a quantized layer, which torch.func cannot call batched"
        if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params():
            # (Before the hooks: its own, which initializes it at its first call, is one.)
            return (f"{where} has uninitialized lazy parameters; call the block once (with fuse=False or "
                    f"'auto'), or the branch, to initialize them first")
        if any(getattr(m, h, None) for h in _HOOKS):
            return (f"{where} has hooks, which a batched call would not run once per branch"
                    + (_norm_hooks(m) or _pruning_hooks(m)))
        if _compiled(m):
            # (Its forward is torch.compile's, set on the instance: said so, not as a monkeypatch.)
            return (f"{where} is compiled with torch.compile, whose code a batched call would not run; pass "
                    f"the uncompiled module and compile the block (or give it compile=) instead")
        if "forward" in vars(m):
            return f"{where} has its forward replaced on the instance"
        hidden = _hidden_by_instance(vars(m))
        if hidden:
            return (f"{where} has instance attributes {hidden} in its __dict__ hiding the registered tensors or "
                    f"submodules of those names from its forward, where a batched call would run the registered "
                    f"ones; delete them from its __dict__, or assign the attribute (m.weight = p) to register it")
        if getattr(m, "parametrizations", None) is not None:
            return f"{where} is parametrized (torch.nn.utils.parametrize)"
        if isinstance(m, _BatchNorm) and m.running_mean is None:
            return (f"{where} normalizes with batch statistics in every mode (track_running_stats=False), "
                    f"which a batched call does not take; construct it with running statistics and call "
                    f".eval() on it to allow fusion")
        if isinstance(m, _BatchNorm) and m.training:
            return (f"{where} normalizes with batch statistics and updates its running statistics in place "
                    f"(BatchNorm in training mode); call .eval() on it to allow fusion")
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            return (f"{where} has sparse gradients (sparse=True), which the members' stacked weight cannot "
                    f"hand back to each branch")
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            return (f"{where} renormalizes the rows it looks up in its weight, in place (max_norm), which "
                    f"autograd refuses on a view of the members' stacked weights")
        if isinstance(m, nn.RNNBase):
            return f"{where} is a recurrent layer, which is not batched across branches"
        if _is_block(m):
            from .pipeline import ParallelSequential  # (imported here, as in _is_block)

            if isinstance(m, ParallelSequential):
                # (A pipeline takes no fuse= of its own: the advice names where fusion is set.)
                return (f"{where} is a pipeline of its own, which is not batched across branches; set fuse= "
                        f"on the Parallel blocks among its stages to fuse their branches")
            return f"{where} is a block of its own; set fuse= on it to fuse its branches"
        if isinstance(m, (_DropoutNd, nn.AlphaDropout, nn.FeatureAlphaDropout)) and m.p > 0 and (
                m.training or type(m).forward not in _STOCK_DROPOUT):
            # (A subclass's forward of its own may draw masks in eval too: Monte Carlo dropout.)
            return (f"{where} draws random masks{' in training mode' if m.training else ''}; fused, its masks "
                    f"could not match the unfused module's")
        if isinstance(m, nn.MultiheadAttention) and m.dropout > 0 and m.training:
            # (Its attention weights' dropout, drawn inside its functional call: vmap refuses
            # random operations, and a group stacked while the rate was 0 ran without any.)
            return (f"{where} draws random masks on its attention weights in training mode "
                    f"(dropout={m.dropout}); fused, its masks could not match the unfused module's "
                    f"(call .eval() on it, or set its dropout to 0, to fuse it)")
        for kind, tensors in (("parameter", m._parameters), ("buffer", m._buffers)):
            for name, t in tensors.items():
                if t is not None and (type(t) not in (torch.Tensor, nn.Parameter) or t.layout != torch.strided):
                    return f"{kind} {_join(path, name)!r} is a {type(t).__name__}, not a plain dense tensor"
    named = list(branch.named_parameters(remove_duplicate=False)) + list(branch.named_buffers(remove_duplicate=False))
    if len({id(t) for _, t in named}) != len(named):
        return "it uses one parameter or buffer in several places (tied weights)"
    tied = _tied_within(branch)
    if tied is not None:
        return (f"its {tied[0]!r} and {tied[1]!r} share memory (a tied weight, or views of one tensor): stacked, "
                f"they would no longer share it")
    held = _attribute_on_tensors(branch)
    if held is not None:
        return (f"its attribute {held!r}, a tensor that is not a parameter or buffer, shares memory with its "
                f"parameters or buffers (a view kept of one): stacked, they would move to new memory and "
                f"{held!r} would no longer see their updates")
    return None


# The hook-based (deprecated) weight and spectral norms, by their forward pre-hooks' classes: each
# utility's name (the parametrized form's too, under torch.nn.utils.parametrizations) and its remover's.
_NORM_HOOKS = ((WeightNorm, "weight_norm", "remove_weight_norm"),
               (SpectralNorm, "spectral_norm", "remove_spectral_norm"))


def _norm_hooks(m: nn.Module) -> str:
    r"""Which hook-based ``weight_norm`` / ``spectral_norm`` set ``m``'s hooks, and how to fix it, to end
    :func:`_unfusable`'s message; ``""`` if neither did."""
    found = [(util, remove, hook.name) for hook in m._forward_pre_hooks.values()
             for cls, util, remove in _NORM_HOOKS if isinstance(hook, cls)]
    if not found:
        return ""
    utils = " and ".join(f"torch.nn.utils.{util} (on {name!r})" for util, _, name in found)
    removes = " and ".join(f"torch.nn.utils.{remove}(module{'' if name == 'weight' else f', {name!r}'})"
                           for _, remove, name in found)
    news = " / ".join(dict.fromkeys(f"torch.nn.utils.parametrizations.{util}" for util, _, _ in found))
    return (f": the forward pre-hook of the old-style {utils}, which recomputes the weight before each call. "
            f"To fuse the branch, remove it with {removes} (the weight stays as it is now, no longer "
            f"renormalized: for inference, or training on without it){_other_hooks(m, len(found))}; the "
            f"parametrized {news} is not fused either (a parametrized module is refused alike). Otherwise "
            f"fuse='auto' runs such a branch unfused, on its own stream")


def _other_hooks(m: nn.Module, named: int) -> str:
    r"""For the fixes :func:`_norm_hooks` and :func:`_pruning_hooks` name: where ``m`` holds hooks beyond the
    ``named`` ones they undo, that those must go too (else the branch, fixed as told, stays unfused)."""
    held = sum(len(getattr(m, h, None) or ()) for h in _HOOKS)
    return "" if held <= named else f", and remove its {held - named} other hook{'s' if held - named > 1 else ''}"


def _pruning_hooks(m: nn.Module) -> str:
    r"""Which tensors of ``m`` ``torch.nn.utils.prune`` masks with its forward pre-hook, and how to fix it, to
    end :func:`_unfusable`'s message; ``""`` if none is pruned.

    Whoever pruned identical branches registered no hook themselves: "has
    hooks" alone does not tell them that ``prune.remove`` lets them fuse.
    """
    # (Pruning a tensor again chains the methods in one PruningContainer, itself a BasePruningMethod.)
    names = [hook._tensor_name for hook in m._forward_pre_hooks.values() if isinstance(hook, BasePruningMethod)]
    if not names:
        return ""
    pruned = " and ".join(repr(name) for name in names)
    removes = " and ".join(f"torch.nn.utils.prune.remove(module, {name!r})" for name in names)
    return (f": the forward pre-hook of torch.nn.utils.prune (on {pruned}), which masks the tensor before each "
            f"call. To fuse the branch, make the pruning permanent with {removes}{_other_hooks(m, len(names))}; "
            f"otherwise fuse='auto' runs such a branch unfused")


def _fusable_settings(m: nn.Module) -> tuple | None:
    r"""The settings of ``m`` that :func:`_unfusable` reads, which a user may set in place after grouping
    (``None`` for a layer without any): a dropout's rate (an attention layer's too), an embedding's
    ``sparse`` and ``max_norm``."""
    if isinstance(m, (_DropoutNd, nn.AlphaDropout, nn.FeatureAlphaDropout)):
        return (m.p,)
    if isinstance(m, nn.MultiheadAttention):
        return (m.dropout,)
    if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
        return (m.sparse, m.max_norm)
    return None


def _prints_its_state(m: nn.Module) -> bool:
    r"""Whether ``m``'s ``extra_repr`` prints the values of its buffers, not only its settings: torch.ao's
    observers (their running ``min_val`` and ``max_val``) and fake quantizers (their ``scale`` and ``zero_point``).

    Those values are state, stacked per member like any buffer, and differ between
    members once they have been called: compared as settings, they made members of one
    group differ after their first call (``fuse="auto"`` unfused them from then on, and
    a ``fuse=True`` block refused its next regrouping, at ``eval()``). Their settings
    are attributes, compared with the others (see :func:`_hyperparameters`). (Looked up
    in ``sys.modules``: where torch.ao.quantization was never imported, no module is one.)
    """
    observer = sys.modules.get("torch.ao.quantization.observer")
    fake = sys.modules.get("torch.ao.quantization.fake_quantize")
    return (observer is not None and isinstance(m, observer.ObserverBase)
            or fake is not None and isinstance(m, fake.FakeQuantizeBase))


def _quantized(m: nn.Module) -> bool:
    r"""Whether ``m`` is a quantized layer (its weights packed, not parameters); not a float reference one."""
    where = type(m).__module__
    return where.startswith(("torch.ao.nn.quantized.", "torch.ao.nn.intrinsic.quantized.")) and not where.startswith(
        "torch.ao.nn.quantized.reference")


def _is_block(m: nn.Module) -> bool:
    from .parallel import Parallel  # (imported here: parallel imports this module)
    from .pipeline import ParallelSequential

    return isinstance(m, (Parallel, ParallelSequential))


def _tensors(branch: nn.Module) -> list[torch.Tensor]:
    return [*branch.parameters(), *branch.buffers()]


def _tensor_ids(branch: nn.Module) -> set[int]:
    return {id(t) for t in _tensors(branch)}


def _span(t: torch.Tensor) -> tuple[int, int, int] | None:
    r"""The bytes ``t`` reads: its storage's address, the first byte and the byte after the last (``None``: no
    memory of its own to share)."""
    address = _watch._sharable_address(t)
    if not address:
        return None
    start = t.storage_offset() * t.element_size()
    return address, start, start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _tied_in_memory(held: list[list[torch.Tensor]]) -> dict[int, int]:
    r"""The branches (by index, in ``held``: each one's tensors) that share memory with another branch through
    distinct tensor objects, each with one such other branch.

    Distinct parameters may share memory -- ``p.data = q.data``, or a checkpoint
    holding one tensor under two keys loaded with ``load_state_dict(assign=True)`` --
    and a plain module then trains them tied (each update lands in the one memory).
    Stacking copies each into a slice of its own: fused, they would be untied. (The
    members of a group laid out in its stacks read disjoint slices of one storage.)
    Not only within a group: stacking a member moves it to new memory, untying it from
    a branch left unfused as well. (One object held by two branches moves for both.)
    """
    spans = sorted((*span, i, id(t)) for i, tensors in enumerate(held) for t in tensors
                   for span in (_span(t),) if span is not None)
    tied: dict[int, int] = {}
    address, open_spans = None, []  # the spans of this address that reach past the current start
    for where, start, end, i, ident in spans:
        if where != address:
            address, open_spans = where, []
        open_spans = [s for s in open_spans if s[0] > start]
        for _, j, other in open_spans:
            if j != i and other != ident:
                tied.setdefault(i, j)
                tied.setdefault(j, i)
        open_spans.append((end, i, ident))
    return tied


def _in_shared_memory(t: torch.Tensor) -> bool:
    r"""Whether ``t`` lies in memory other processes may hold (``share_memory_()``: torch.multiprocessing).

    (The CPU's alone: a CUDA storage always says it is shared, its memory being open to IPC.)
    """
    return t.device.type == "cpu" and t.untyped_storage().is_shared()


def _moves_shared(members: list[nn.Module]) -> str | None:
    r"""The name of a parameter or buffer of ``members`` that lies in shared memory and that stacking would
    move to new memory (the members' tensors of that name are not already one stack), or ``None``.

    ``model.share_memory()`` before processes train it (Hogwild) hands each of them
    the parameters' memory: stacked in one of them afterwards (the groups found
    anew at an ``eval()``, with dropout in training before), a member's parameter
    would be a view of that process's new stack, and its updates would no longer
    reach the others, nor theirs it -- silently. A block's own stacks, shared
    after they were made, stay where they are (see :func:`_adopt`).
    """
    named = [dict([*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)])
             for m in members]
    for qual in named[0]:
        tensors = [d.get(qual) for d in named]
        if (all(isinstance(t, torch.Tensor) for t in tensors) and any(_in_shared_memory(t) for t in tensors)
                and _adopt(tensors) is None):
            return qual
    return None


def _share_memory(tensors: list[torch.Tensor]) -> bool:
    r"""Whether two of ``tensors`` are one, or read overlapping bytes (views of one buffer).

    (Not merely one storage: the members' own buffers, bound, are slices of one stack.)
    """
    return len(set(map(id, tensors))) < len(tensors) or bool(_tied_in_memory([[t] for t in tensors]))


def _unlike(tensors: list[torch.Tensor | None]) -> int | None:
    r"""The first of ``tensors`` that is ``None`` where the first is not (or the reverse), or of another
    shape or dtype; ``None`` where they are all alike (members' tensors, see :class:`_MembersChanged`)."""
    first = tensors[0]
    return next((i for i, t in enumerate(tensors) if (t is None) != (first is None) or t is not None and (
        t.shape != first.shape or t.dtype != first.dtype)), None)


def _attribute_on_tensors(branch: nn.Module) -> str | None:
    r"""The name of a tensor attribute of ``branch`` (not a parameter or buffer) that shares memory with its
    parameters or buffers -- a view kept of one, its ``.data`` -- or ``None``.

    Stacking moves the parameters into the group's stacks: such an attribute would go on
    reading the old memory, no longer seeing the optimizer's updates (unfused, it does).
    """
    held: list[list[torch.Tensor]] = [[*branch.parameters(), *branch.buffers()]]
    names = [""]
    for path, m in branch.named_modules():
        for k, v in _tensor_attributes(m).items():
            held.append([v])
            names.append(_join(path, k))
    if len(held) == 1:
        return None
    i = _tied_in_memory(held).get(0)
    return None if i is None else names[i]


def _tied_within(branch: nn.Module) -> tuple[str, str] | None:
    r"""The names of two of ``branch``'s parameters and buffers that share memory (see :func:`_tied_in_memory`)."""
    named = [*branch.named_parameters(), *branch.named_buffers()]
    tied = _tied_in_memory([[t] for _, t in named])
    return None if not tied else tuple(named[i][0] for i in min(tied.items()))


def _groups(branches: Sequence[nn.Module]) -> tuple[list[list[int]], dict[int, str]]:
    r"""Partition branch indices into groups of identical fusable branches.

    Returns the groups of two or more members, and a reason for every branch
    left out of them.
    """
    reasons: dict[int, str] = {}
    groups: list[list[int]] = []
    ids: dict[int, set[int]] = {}  # each fusable branch's parameters and buffers
    sharers: dict[int, list[int]] = {}  # branch -> the identical ones left out for sharing its tensors
    tied = _tied_in_memory([_tensors(branch) for branch in branches])
    unfusable: list[int] = []
    for i, branch in enumerate(branches):
        why = _unfusable(branch)
        if why is None and i in tied:
            why = (f"it shares memory with branch index {tied[i]} through another parameter or buffer object "
                   f"(a tied weight, or views of one tensor): stacked, they would no longer share it")
        if why is not None:
            reasons[i] = why
            unfusable.append(i)
            continue
        ids[i] = _tensor_ids(branch)
        for group in groups:
            if _difference(branches[group[0]], branch) is None:
                shared = next((j for j in group if ids[i] & ids[j]), None)
                if shared is not None:
                    reasons[i] = f"it shares parameters or buffers with branch index {shared}"
                    sharers.setdefault(shared, []).append(i)
                    break
                group.append(i)
                break
        else:
            groups.append([i])
    # A tensor stacked by two groups would be moved into one stack, then the other, on
    # every call (each sees the other's move as a replaced parameter): the later group
    # leaves such members out.
    holder: dict[int, int] = {}  # tensor id -> the branch of a kept group holding it
    kept = []
    for group in groups:
        if len(group) == 1:
            left = sharers.get(group[0])
            if left:
                reasons[group[0]] = (f"the branches identical to it (index {', '.join(map(str, left))}) share its "
                                     f"parameters or buffers (the same module, or tied weights)")
                continue
            # (Identical ones that cannot be fused themselves: a hook on one, say.)
            alike = [j for j in unfusable if _difference(branches[j], branches[group[0]]) is None]
            reasons[group[0]] = "no other branch is identical to it" + (
                f" but index {', '.join(map(str, alike))}, which cannot be fused (see there)" if alike
                else _alike_but(branches, group[0], ids))
            continue
        members = []
        for i in group:
            shared = next((holder[t] for t in ids[i] if t in holder), None)
            if shared is None:
                members.append(i)
            else:
                reasons[i] = f"it shares parameters or buffers with branch index {shared}, fused with others"
        if len(members) == 1:
            reasons[members[0]] = "the branches identical to it share parameters or buffers with other fused branches"
        elif members:
            qual = _moves_shared([branches[i] for i in members])
            if qual is not None:
                for i in members:
                    reasons[i] = (f"its {qual!r} lies in shared memory (share_memory(), for torch.multiprocessing), "
                                  f"which stacking would move it out of: other processes would no longer see its "
                                  f"updates (call share_memory() after the block has grouped its branches, in the "
                                  f"mode they run in)")
                continue
            kept.append(members)
            for i in members:
                holder.update(dict.fromkeys(ids[i], i))
    return kept, reasons


# ------------------------------------------------------------ the stacks
class _Unstack(torch.autograd.Function):
    r"""The stacked tensor, as a function of the members' parameters.

    Forward returns the stack itself (the parameters already alias its slices,
    so no copy is made); backward gives each parameter its slice of the
    stacked gradient, so gradients accumulate in every branch's own ``.grad``
    -- except a member none of whose outputs received a gradient in this
    backward pass (see :class:`_Received`): unfused, its parameters get none,
    their ``.grad`` stays ``None``, and optimizers skip them (no weight decay,
    no momentum); a slice of zeros would move them.
    """

    @staticmethod
    def forward(ctx: Any, received: "_Received | None", stacked: torch.Tensor,  # type: ignore[override]
                *params: torch.Tensor) -> torch.Tensor:
        ctx.received = received
        ctx.params = params if received is not None else ()
        ctx.set_materialize_grads(False)
        return stacked.view_as(stacked)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple:  # type: ignore[override]
        if grad is None:  # (no gradient came: none for the members either, as unfused)
            return (None, None, *(None for _ in ctx.needs_input_grad[2:]))
        if grad.dim() and (grad.stride(0) == 0 or grad._is_view() and grad.is_contiguous()):
            # Memory that is not this backward's own: a bias added without a reduction (a
            # batch of one) passes its gradient on as it came -- for a cat or stack join, a
            # view of the gradient ``backward(g)`` was given; for a sum or mean join, one
            # gradient expanded to every member. Unbound, each member's slice is contiguous,
            # and autograd keeps it as the member's ``.grad``: a second backward accumulating
            # into it would write into ``g`` (changing what later passes read) or into every
            # member's at once, and so would any in-place change (clipping). Unfused, the
            # bias's gradient is a sum, a tensor of its own. (Weights' come transposed, which
            # autograd copies anyway, or, on the CPU and CUDA in training, as a product of
            # their own, no view: see _TrainedLinear, whose biases' gradient is a sum of its
            # own too. The copy here is of a bias-sized gradient.)
            grad = grad.clone(memory_format=torch.contiguous_format)
        got = ctx.received.got() if ctx.received is not None else None
        if got is None:
            return (None, None, *grad.unbind(0))
        # (A parameter's accumulator runs whatever it is handed, and its hooks with it: handed
        # None, a hook of the user's on it would be called with None, where unfused it is not
        # called at all. Such parameters get zeros, as before members were told apart.)
        return (None, None, *(g if i in got or _hooked(p) else None
                              for i, (g, p) in enumerate(zip(grad.unbind(0), ctx.params))))


# ``_Unstack.apply`` less ``Function.apply``'s Python prologue, which walks every argument to
# unwrap functorch's dead wrappers: the members' parameters, one per member for each stack a
# training call reads (64 for eight 4-layer MLPs), about a third of each apply's host time on
# the development machine (9.6 against 6.2 us for eight members). Taken where no functorch
# transform is active, as the prologue itself does (``_graphs`` does so for its replay): the
# arguments are the group's own stack and the members' parameters as bound, never such wrappers.
try:
    _unstack_apply: Callable[..., Any] | None = super(torch.autograd.Function, _Unstack).apply
except AttributeError:  # another torch: Function.apply as it is
    _unstack_apply = None


def _unstack(received: _Received | None, stacked: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
    r"""``_Unstack.apply(received, stacked, *tensors)`` (see above)."""
    if received is not None:
        received.tensors.append(tensors)
    if _unstack_apply is None or torch._C._are_functorch_transforms_active():
        return _Unstack.apply(received, stacked, *tensors)
    return _unstack_apply(received, stacked, *tensors)


def _hooked(p: torch.Tensor) -> bool:
    r"""Whether ``p`` has hooks of its own (``register_hook``, ``register_post_accumulate_grad_hook``)."""
    return bool(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None))


class _Received:
    r"""Which members' outputs of one fused call received a gradient, per backward pass.

    Reported by :class:`_Split`, whose backward runs before any layer of the
    group's (it takes their outputs), read by :class:`_Unstack`, whose backward
    runs after them all (it makes their parameters). Kept per graph task, as
    one call's graph may be differentiated again (``retain_graph=True``) with
    other members' outputs used; the last few only. Where nothing was
    reported for the pass (a join read off the batched value, a split by
    torch's own operations), every member received one.

    A pass that makes a graph of its own (``create_graph=True``, a gradient
    penalty) lets later passes reach the stacks through that graph, past the
    split, by torch's own nodes. That graph is linear in the gradients the
    pass got, zeros for the members it did not reach, so a later pass through
    it hands those members' slices zeros: unfused, they get none (a penalty on
    one head must leave the others without a gradient). So each member it
    reached has its gradient marked there (:meth:`mark`), and a later pass
    counts a member whose mark the autograd engine will run in that pass --
    not one whose mark lies in a graph the pass leaves out (a loss on another
    head after the penalty's input gradient). Per member, not per parameter: a
    stack's gradient is one batched tensor, so a parameter of a member reached
    that the made graph does not depend on (the last bias, where the loss is
    linear in the head's output) gets zeros, where unfused it gets none.
    A batched gradient (``is_grads_batched=True``, ``torch.autograd.functional``'s
    ``vectorize=True``), one under ``torch.func.vmap``, and a member with hooked
    trained tensors are not marked: a member a pass reached so counts in every
    later pass.
    """

    __slots__ = ("passes", "dropped", "tensors", "marks", "unmarked")

    def __init__(self) -> None:
        self.passes: dict[int, set[int]] = {}
        self.dropped = -1  # the latest graph task whose entry in ``passes`` was dropped (ids only grow)
        # Per stack the call differentiates, the members' tensors of it (see _Unstack).
        self.tensors: list[list[torch.Tensor]] = []
        # The members create_graph passes reached, with their marks' nodes (weakly: a mark's node
        # lives as long as the graph that pass made, which the caller may drop).
        self.marks: list[tuple[int, weakref.ref]] = []
        # The members create_graph passes reached unmarked (see mark), counted in every later pass.
        self.unmarked: frozenset[int] | None = None

    def add(self, member: int) -> None:
        task = _graph_task()
        seen = self.passes.get(task)
        if seen is None:
            seen = set()
            # (The choice of the report to drop and its drop as one: two passes starting at once
            # would each choose the oldest, and the second drop the next, recorded by neither.)
            with _marks_lock:
                dropped = _bounded_add(self.passes, task, seen, limit=4)
                if dropped is not None:
                    self.dropped = max(self.dropped, dropped)
        seen.add(member)

    def mark(self, member: int, grad: torch.Tensor) -> torch.Tensor:
        r"""``grad``, member ``member``'s gradient in a pass with ``create_graph=True``, through a
        :class:`_Mark` of that member (see above)."""
        trained = [t for t in (tensors[member] for tensors in self.tensors) if t.requires_grad]
        # (Counted in every later pass, unmarked: a gradient batched by legacy vmap, under which
        # autograd records on its batched value, so a Function applied to it is cut from the graph
        # the pass makes, and the gradients through it lost; one under torch.func's vmap, which
        # refuses a Function without setup_context; and a member with hooked trained tensors,
        # which the mark cannot be tied to (a pass running it would run their accumulators,
        # handed nothing where the made graph does not depend on them, and their hooks with
        # None, where unfused they are not called) -- untied, a later pass for them alone would
        # not run the mark, nor would one after the hooks' removal, and lose their gradients.)
        if _is_legacy_batched(grad) or torch._C._are_functorch_transforms_active() or any(map(_hooked, trained)):
            with _marks_lock:
                self.unmarked = (self.unmarked or frozenset()) | {member}
            return grad
        # (Tied to the member's own trained tensors: a later torch.autograd.grad for them then
        # counts the mark as run, where it runs that pass's graph; one for other tensors need not.)
        if not trained:
            return grad
        mark = _Mark
        if _forward_ad._current_level >= 0:
            tangent = _forward_ad.unpack_dual(grad).tangent
            if tangent is not None and _is_legacy_batched(tangent):
                # (A gradient whose tangent ``torch._vmap_internals``' vmap batches -- the reverse
                # pass inside ``autograd.functional.hessian(..., vectorize=True,
                # outer_jacobian_strategy="forward-mode")`` -- takes no view in the jvp: see
                # _OwnGradientsCopied.)
                mark = _MarkCopied
        marked = mark.apply(grad, *trained)
        with _marks_lock:
            self.marks = [(i, ref) for i, ref in self.marks if ref() is not None] + [
                (member, weakref.ref(marked.grad_fn))]
        return marked

    def got(self, marked: bool = True) -> set[int] | None:
        r"""The members this backward pass differentiates (``None``: every one); not, where ``marked`` is
        false and the pass reported any, those it counts only as their marks run (see
        :func:`_refuse_changed_members`)."""
        task = _graph_task()
        seen = self.passes.get(task)
        if seen is None and task <= self.dropped:
            # A pass whose report later passes may have dropped (other threads', or ones a hook
            # ran): every member, as where none was reported -- never the marks alone, which
            # would leave out a member reported and dropped.
            return None
        marked = marked or seen is None
        if self.marks and marked or self.unmarked:
            reached = ({i for i, ref in self.marks if (node := ref()) is not None and _will_run(node)}
                       if marked else set())
            if self.unmarked:
                reached |= self.unmarked
            if reached:
                return reached if seen is None else seen | reached
        return seen


# Taken to change a call's marks, which other threads' passes over the call may be making or reading
# at the same time: changed by copy, so that a reader, taking none, iterates what it read as it was;
# and to drop a report of its passes (see _Received.add).
_marks_lock = threading.Lock()

# Whether the autograd engine runs a node in the backward pass under way; without it (another
# torch), every mark counts: zeros for a member a create_graph pass reached, never a lost gradient.
_will_run: Callable[[Any], bool] = getattr(torch._C, "_will_engine_execute_node", lambda node: True)


class _Mark(torch.autograd.Function):
    r"""The identity on a member's gradient in a pass with ``create_graph=True``, whose node tells a
    later pass that it runs that pass's graph for this member (see :class:`_Received`).

    Its other inputs, the member's trained tensors, give the node a place in
    the graph (the gradient itself may require none) and are handed nothing.
    """

    @staticmethod
    def forward(ctx: Any, grad: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple:  # type: ignore[override]
        return (grad, *(None for _ in ctx.needs_input_grad[1:]))

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor | None, *_: Any) -> torch.Tensor | None:  # type: ignore[override]
        return None if tangent is None else tangent.view_as(tangent)


class _MarkCopied(_Mark):
    r"""A :class:`_Mark` returning a copy, for a gradient whose tangent ``torch._vmap_internals``' vmap batches:
    a view of such a tangent is no view to autograd, which refuses a ``jvp`` that returns no view for a
    ``forward`` that does (see :class:`_OwnGradientsCopied`)."""

    @staticmethod
    def forward(ctx: Any, grad: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        return grad.clone()

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor | None, *_: Any) -> torch.Tensor | None:  # type: ignore[override]
        return None if tangent is None else tangent.clone()


class _Split(torch.autograd.Function):
    r"""Member ``i``'s slice of the members' batched value (one of its ``unbind``), a copy of its own, whose
    backward tells ``received`` that it received a gradient (see :class:`_Unstack`).

    One node per member, as autograd's own ``select`` makes: a member's output the
    backward pass leaves out runs nothing (its tensor hooks included), where
    ``select`` would hand its members' parameters zeros all the same. Over the
    slices of one ``unbind``, whose backward stacks the members' gradients once
    (``select``'s would make a whole batched gradient for each member).
    """

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, i: int, received: _Received) -> torch.Tensor:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        ctx.i, ctx.received = i, received
        return _dense_clone(part)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple:  # type: ignore[override]
        if grad is not None:  # (run all the same for an undefined one: a reentrant checkpoint's unused input)
            ctx.received.add(ctx.i)
            if torch.is_grad_enabled():  # (a backward's grad mode is its create_graph)
                grad = ctx.received.mark(ctx.i, grad)
        return grad, None, None


class _SplitDual(_Split):
    r"""A :class:`_Split` under forward-mode AD, whose tangent is a slice of its own too.

    (Apart, as Dynamo traces no ``autograd.Function`` with a ``jvp``.)
    """

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor | None, *_: Any) -> torch.Tensor | None:  # type: ignore[override]
        # (Through ``_Split`` again: a backward through the tangent -- reverse over forward --
        # tells ``received`` too.)
        return None if tangent is None else _Split.apply(tangent, ctx.i, ctx.received)


class _OwnGradients(torch.autograd.Function):
    r"""The identity, whose backward hands the members' gradients memory of their own (see :class:`_Unstack`).

    Where a trace stacks the members' tensors itself (``torch.stack``, whose
    backward unbinds), a bias added without a reduction (a batch of one) under
    a sum or mean join gets one gradient expanded to every member: unbound,
    the members' ``.grad`` would share it, and a second backward accumulating
    into them would add into every member's at once. (Decided on the
    gradient's strides, which a compiler's trace knows.)
    """

    @staticmethod
    def forward(ctx: Any, stacked: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return stacked.view_as(stacked)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.clone(memory_format=torch.contiguous_format) if grad.dim() and grad.stride(0) == 0 else grad


class _OwnGradientsDual(_OwnGradients):
    r"""An :class:`_OwnGradients` under forward-mode AD (apart, as Dynamo traces no ``jvp``)."""

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return tangent.view_as(tangent)  # (the identity's)


class _OwnGradientsCopied(_OwnGradients):
    r"""An :class:`_OwnGradientsDual` returning a copy, for tangents batched by ``torch._vmap_internals``' vmap
    (``autograd.functional.hessian(..., vectorize=True, outer_jacobian_strategy="forward-mode")``,
    ``jacobian(..., strategy="forward-mode")`` over swapped-in parameters): a view of one is no view
    to autograd, which refuses a ``jvp`` that returns no view for a ``forward`` that does."""

    @staticmethod
    def forward(ctx: Any, stacked: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return stacked.clone()

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return tangent.clone()


# One thread at a time stacks the members' tensors and re-points them at their slices
# (``_Group.bind``: two threads would each stack, and the parameters could end up views of
# one thread's stack while the group reads the other's, never seeing an update again), and
# finds the groups and publishes them (``Parallel._reset``, ``_fusion_for``). Taken after a
# block's CUDA graphs' lock (a capture groups and stacks), never before. Not taken while a
# compiler traces, which cannot trace a lock and traces one call at a time.
_lock = threading.RLock()


class _Entry(NamedTuple):
    owners: tuple[nn.Module, ...]  # the submodule holding the tensor, per member
    attr: str  # its name there
    kind: str  # "_parameters" or "_buffers"


class _Value(NamedTuple):
    t: torch.Tensor
    layout: int
    received: _Received | None = None  # the call's, on its final value (see _Split)


class _Structured(NamedTuple):
    r"""A group's final value that is a structure of stacked tensors, and the call's :class:`_Received`."""

    tree: Any
    received: _Received


class _Group:
    r"""One group of identical branches, evaluated as one batched computation."""

    def __init__(self, indices: list[int], names: list[str], members: list[nn.Module],
                 others: Sequence[nn.Module] = (), owner: str = "Parallel") -> None:
        self.owner = owner  # the block's class name, for messages
        self.indices = indices
        self.names = names  # the block's names of the members, for messages
        self.members = members
        self.others = others  # the block's other branches (see _refuse_ties)
        self.n = len(members)
        self.template = members[0]
        self.entries: dict[str, _Entry] = {}
        for kind, named in (("_parameters", "named_parameters"), ("_buffers", "named_buffers")):
            for qual, _ in getattr(self.template, named)(remove_duplicate=False):
                path, _, attr = qual.rpartition(".")
                owners = tuple(m.get_submodule(path) for m in members)
                self.entries[qual] = _Entry(owners, attr, kind)
        self.stacks: dict[str, torch.Tensor] = {}
        self.bound: dict[str, list[torch.Tensor]] = {}
        # Each member's parameters as bound, for a training call's look at which are frozen
        # (see _run): read where the walk of a member's modules that ``parameters()`` makes
        # cost about 30 us a call for 8 members of 4 layers on the development machine.
        self.member_parameters: list[tuple[torch.Tensor, ...]] = []
        self.buffers = [q for q, e in self.entries.items() if e.kind == "_buffers"]
        # The biases a capture writes into the products' output buffers (see
        # _Prefill), by width and dtype: each class with more than one is stacked
        # into one tensor ``[layers, N, width]`` by bind, and filled by one kernel.
        self.joint_classes = _joint_bias_classes(self.template)
        layers = _layers(self.template) if type(self.template) is nn.Sequential else [("", self.template)]
        self.last = layers[-1][0] if layers else None  # the name of the template's last layer
        # (in, out) of each Linear, where the template is Linear layers and activations alone
        # (see kernel_layers); None otherwise.
        self.linear_shapes: list[tuple[int, int]] | None = _linear_shapes([m for _, m in layers])
        # Whether a Linear layer has an activation after it, which the kernel applies in the
        # same launch: what makes the kernel pay in an eager call (see _CallState.lone_kernels).
        self.paired = self.linear_shapes is not None and _paired(self.template)
        self.joint: dict[str, tuple[torch.Tensor, int]] = {}  # bias name -> (its class's tensor, its index)
        # Every member tensor and the address it had when bound (see _bound).
        self.expected: tuple[list[torch.Tensor], list[int], list[int]] = ([], [], [])
        # The owners' dicts of parameters and buffers, and copies made when bound:
        # a tensor swapped in without registration (``torch.func.functional_call``,
        # ``m.bias = None``) shows as a difference (see ``swapped``).
        owners = {id(o): o for e in self.entries.values() for o in e.owners}.values()
        # (Buffers only where there are some: one registered later is seen by _watch.)
        self.tensor_dicts = [d for o in owners for d in (o._parameters, o._buffers) if d]
        self.owners = list(owners)
        self.snapshots: list[dict[str, Any]] = []
        # The members' floating-point buffers as bound, which ``requires_grad_()`` may make
        # differentiable without registering anything (see _stacked).
        self.float_buffers: list[torch.Tensor] = []
        self.scalars = False  # a member tensor of one element (see _watch._swapped)
        self.registrations = -1
        # Whether the kernel takes every Linear layer, by (rows, dtype, device) of the input:
        # the part of kernel_layers that depends on the members, not on the call.
        self.kernel_shapes: dict[tuple, bool] = {}
        # Stacks autograd saves for backward only where the step's input requires grad (a
        # ``Linear``'s weight: a product saves each operand for the other's gradient), and
        # never (an ``Embedding``'s weight: its backward reads the indices alone), as it
        # saves the members' own tensors unfused (see _refuse_changed_members). Filled by
        # _program.
        self.saved_with_input: set[str] = set()
        self.never_saved: set[str] = set()
        # And those saved whenever anything requires grad (_SAVES_WEIGHT): frozen, they are
        # saved for the input's gradient. (A layer of the user's, vmapped, may save none.)
        self.saved_always: set[str] = set()
        # Buffers saved wherever their layer's output requires grad (a BatchNorm's running
        # statistics, in eval). Others, read by vmapped layers, are watched where autograd
        # saved their memory (see _watch_buffers).
        self.buffers_saved: set[str] = set()
        self.ran = False  # whether the group ran batched once (see Parallel._run_group)
        # Why its last eager call ran the members unfused, that call only (None: it ran batched):
        # explain() says so, where the groups alone would say fused.
        self.unbatched: str | None = None
        # Whether its first eager batched call in eval wrote buffers (None: not judged; the same).
        # (Judged once: a change of the members' train/eval modes makes the groups anew, see
        # _Fusion.current.)
        self.wrote_buffers: bool | None = None
        # The batched steps, made at the first eager call (and again where a setting that
        # chose a step is set anew: see _made_anew; the settings they read are read at every
        # call). Made once here for the two sets above, which depend on the layers' types alone.
        self.program: list[_Step] | None = None
        # The members' tensor attributes (not parameters or buffers) when their values were last found
        # alike: the member's name, the attribute's path in it, its module's dict, its name there, the
        # tensor and its version (see _compare_attributes).
        self.attributes: list[_Attribute] = []
        # Whether a layer runs through vmap (a module of the user's), whose own code may write
        # the members' parameters in place (a weight clamped or decayed in its ``forward``):
        # see Parallel._run_group. (Taken as so where the steps cannot be made yet.)
        self.vmapped = True
        try:
            self.vmapped = any([getattr(step, "vmapped", False) for step in _program(self, self.template, "")])
        except Exception:
            pass  # (made again at the first call, which raises it with the group's context)

    # Stacks ---------------------------------------------------------------
    def _tensors(self, entry: _Entry) -> list[torch.Tensor | None]:
        dicts = [getattr(o, entry.kind) for o in entry.owners]
        try:
            return [d[entry.attr] for d in dicts]
        except KeyError:
            pass
        # ``del module.weight`` registers nothing, and a plain tensor set in its place is an
        # attribute, which no stack reads: the members are no longer what was grouped, even
        # where every one of them changed alike. (A compiler traces them unfused: _stacked.)
        kind = "parameter" if entry.kind == "_parameters" else "buffer"
        gone = [name for name, d in zip(self.names, dicts) if entry.attr not in d]
        raise _MembersChanged(
            f"the branches are no longer identical: branch{'es' if len(gone) > 1 else ''} "
            f"{', '.join(map(repr, gone))} no longer {'have' if len(gone) > 1 else 'has'} the {kind} "
            f"{entry.attr!r} of {type(entry.owners[0]).__name__} they were grouped with (deleted, or replaced "
            f"by a plain tensor attribute, which is not a {kind})")

    def _bound(self) -> bool:
        r"""Whether every member's parameters and buffers still point into the stacks."""
        if self.registrations != _watch._changes:
            # Something was registered somewhere (a parameter replaced with ``module.weight =
            # nn.Parameter(...)``, ``load_state_dict(assign=True)``; see _watch): compare the
            # objects, not only their addresses.
            for qual, tensors in self.bound.items():
                if any(t is not b for t, b in zip(self._tensors(self.entries[qual]), tensors)):
                    return False
            self.registrations = _watch._changes
        return _same_addresses(*self.expected)

    def buffer_stacks(self) -> list[torch.Tensor]:
        r"""The stacks of the members' buffers (after :meth:`bind`)."""
        return [t for t in (self.stacks.get(q) for q in self.buffers) if t is not None]

    def follow_resized(self) -> None:
        r"""Point the members back at their slices of every stack a batched call resized in place.

        A layer growing a buffer in ``forward`` (``self.min_val.resize_(n)``, as
        ``PerChannelMinMaxObserver`` does at its first call, or a cache sized by the
        batch) resizes the stack vmap hands it: the members, views of the stack's old
        layout, would keep the old shape (an empty buffer stays empty) or read
        their neighbours' rows. Likewise after the stack is put back to its old shape
        (see ``_put_back``). (Each a view again: nothing moves but the view.)
        """
        resized = [(stack, tensors) for qual, stack in self.stacks.items()
                   for tensors in (self.bound.get(qual),) if tensors and tensors[0].shape != stack.shape[1:]]
        if not resized:  # (the common case: no grad mode entered, which a non-strict export records)
            return
        with torch.no_grad(), torch.inference_mode(False):
            for stack, tensors in resized:
                for i, t in enumerate(tensors):
                    t.data = stack[i]

    def parameter_stacks(self) -> list[torch.Tensor]:
        r"""The stacks of the members' parameters that keep a version (after :meth:`bind`; not inference tensors)."""
        return [t for q, t in self.stacks.items() if self.entries[q].kind == "_parameters" and not t.is_inference()]

    def _no_longer_identical(self, qual: str, tensors: list[torch.Tensor | None], i: int) -> RuntimeError:
        r"""The error for member ``i``'s ``qual`` (of ``tensors``, the members') changed since the group was found."""
        # (The first member set to None against another: named, rather than the others against it.)
        odd, ref = (0, i) if tensors[0] is None and tensors[i] is not None else (i, 0)
        return _MembersChanged(f"the branches are no longer identical: {qual} of branch {self.names[odd]!r} is "
                            f"{_describe_tensor(tensors[odd])}, where branch {self.names[ref]!r} has "
                            f"{_describe_tensor(tensors[ref])}")

    def _refuse_ties(self) -> None:
        r"""Refuse to stack members that share memory with other tensors of the block (see :func:`_tied_in_memory`).

        ``_groups`` left such branches out; ``.data =`` and ``set_()`` tie tensors
        since, registering nothing, and stacking would copy them apart.
        """
        for name, member in zip(self.names, self.members):
            tied = _tied_within(member)
            if tied is not None:
                raise RuntimeError(f"{tied[0]} and {tied[1]} of branch {name!r} share memory now: stacked, they would no "
                                   f"longer share it")
        tied = _tied_in_memory([_tensors(m) for m in (*self.members, *self.others)])
        k = next((k for k in range(self.n) if k in tied), None)
        if k is not None:
            other = tied[k]
            with_ = (f"branch {self.names[other]!r}" if other < self.n else "another branch of the block")
            raise RuntimeError(f"branch {self.names[k]!r} shares memory with {with_} now, through another parameter "
                               f"or buffer object: stacked, they would no longer share it")

    def bind(self) -> bool | None:
        r"""Stack each parameter and buffer of the members; point the members at their slices.

        Returns whether any tensor moved to new memory (which invalidates CUDA
        graphs that read the old memory by address), or ``None`` where it would
        stack but the members hold tensors swapped in for the call
        (``torch.func.functional_call``: left as they are, the call stacks what
        it finds, see :meth:`run`; bound at a call outside). (Swapped in over
        bound tensors, they leave the group bound: :meth:`swapped` tells.)
        Idempotent: tensors already laid out as consecutive slices of one
        storage (by an earlier bind) are adopted as they are, so finding the
        groups anew moves nothing.
        """
        if not self.entries or self.stacks and self._bound():  # (no tensors: nothing to stack)
            return False
        if _watch._swapped_in(self.owners):
            return None
        with _lock:  # (see _lock; looked at again once held: another thread may have stacked)
            if self.stacks and self._bound():
                return False
            return self._bind()

    def _bind(self) -> bool:
        moved = checked = False
        stacks: dict[str, torch.Tensor] = {}
        bound: dict[str, list[torch.Tensor]] = {}
        tensors_bound: list[torch.Tensor] = []
        # (Not inference tensors, where the group is first run under inference_mode:
        # the members' parameters become views of the stacks, and training them
        # later would fail with "Inference tensors cannot be saved for backward".
        # Unless the members' own are: see _stack.)
        with torch.no_grad(), torch.inference_mode(False):
            for qual, entry in self.entries.items():
                tensors = self._tensors(entry)
                first = tensors[0]
                for i, t in enumerate(tensors):
                    # A member's tensor replaced or removed since the group was found: stacking
                    # would drop it (``None``) or convert it (``torch.stack`` promotes dtypes).
                    if (t is None) != (first is None) or (t is not None and (
                            t.shape != first.shape or t.dtype != first.dtype or t.device != first.device
                            or t.is_inference() != first.is_inference())):
                        raise self._no_longer_identical(qual, tensors, i)
                if first is None:
                    continue
                stacked = _adopt(tensors)
                if stacked is None:
                    if not checked:
                        self._refuse_ties()
                        # (Put in shared memory since the groups were found -- a tensor replaced,
                        # then shared: see _moves_shared, which _groups asks.)
                        shared = _moves_shared(self.members)
                        if shared is not None:
                            raise RuntimeError(f"{shared} of branches {self.names} lies in shared memory now "
                                               f"(share_memory()): stacked, it would move out of it, and other "
                                               f"processes would no longer see its updates")
                        checked = True
                    # (Inference tensors, made under inference_mode, keep no version.)
                    versions = [None if t.is_inference() else t._version for t in tensors]
                    old = [t.detach() for t in tensors]
                    stacked = _stack(old)
                    moved = True
                    for i, t in enumerate(tensors):
                        if versions[i] is not None and t._version != versions[i]:
                            # Written in place by another thread since it was copied into
                            # the stack (a load_state_dict, an optimizer step): copied again.
                            # (A write between this check and the next line still lands in
                            # the old memory: a thread writing parameters while the block's
                            # first call runs races it, as with any module's.)
                            stacked[i].copy_(old[i])
                        # ``.data =`` keeps the Parameter object (optimizers hold it)
                        # and makes it a view of the stack: updates reach both.
                        t.data = stacked[i]
                stacks[qual], bound[qual] = stacked, tensors
                tensors_bound += tensors
            joint: dict[str, tuple[torch.Tensor, int]] = {}
            for quals in self.joint_classes:
                parts = [stacks.get(q) for q in quals]
                # (One width and dtype per class: the stacks' shapes agree. A bias tied to
                # another of the class would have two places in the tensor.)
                if (any(t is None for t in parts) or len({t.data_ptr() for t in parts}) != len(parts)
                        or len({t.is_inference() for t in parts}) > 1):  # (one tensor is of one kind: _stack)
                    continue
                together = _adopt(parts)
                if together is None:
                    # One tensor for the class: each layer's stack (and so each member's
                    # bias, still contiguous) becomes a slice of it.
                    together = _stack(parts)
                    moved = True
                    for k, q in enumerate(quals):
                        for i, t in enumerate(bound[q]):
                            t.data = together[k, i]
                        stacks[q] = together[k]
                joint.update((q, (together, k)) for k, q in enumerate(quals))
        # Where the members must point, from the stacks, not from the members: one given
        # other memory by another thread (``.data =``) since it was pointed there is then
        # seen by the next call, and stacked anew.
        ptrs = [stacks[q][i].data_ptr() for q, tensors in bound.items() for i in range(len(tensors))]
        self.stacks, self.bound, self.joint = stacks, bound, joint
        # (Every parameter of a member is an entry: the template's, identical to the others'.)
        self.member_parameters = [tuple(tensors[i] for q, tensors in bound.items()
                                        if self.entries[q].kind == "_parameters") for i in range(self.n)]
        self.float_buffers = [t for q, tensors in bound.items() if self.entries[q].kind == "_buffers"
                              for t in tensors if t.is_floating_point() or t.is_complex()]
        self.kernel_shapes = {}
        self.snapshots = [d.copy() for d in self.tensor_dicts]
        self.scalars = _watch._has_scalars(self.tensor_dicts)
        self.expected = (tensors_bound, ptrs, list(range(len(ptrs))))
        self.registrations = _watch._changes
        return moved

    def changed(self) -> bool:
        r"""Whether a member's parameter or buffer was set to ``None``, deleted, or given another shape
        or dtype than the others' since the group was found (what registers nothing, and a call finds:
        see :class:`_MembersChanged`)."""
        for entry in self.entries.values():
            try:
                tensors = self._tensors(entry)
            except _MembersChanged:
                return True
            # (Every member's set to None is alike too, but the group has a stack for it: an
            # entry is a tensor the members had when grouped.)
            if tensors[0] is None or _unlike(tensors) is not None:
                return True
        return False

    def swapped(self) -> bool:
        r"""Whether a member's parameter or buffer is not the tensor bound, though nothing was registered.

        As inside ``torch.func.functional_call``, which swaps the tensors in the
        modules' dicts: a call then stacks the tensors it finds (differentiably)
        and leaves the bound ones as they are.
        """
        return _watch._swapped(self.tensor_dicts, self.snapshots, self.scalars)

    def _stacked(self, qual: str, tracing: bool, watched: list | None = None,
                 flow: list[bool] | None = None, received: _Received | None = None,
                 read: list[str] | None = None, buffers_grad: bool = False,
                 written: list | None = None, made: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
        r"""The stack of ``qual`` for this call (see :class:`_Unstack`, which ``received`` is handed).

        ``watched`` collects the members' tensors that autograd saves for
        backward, with their versions now (see :func:`_refuse_changed_members`):
        by ``flow``, whether each member's input to the step requires grad (see
        :meth:`_run`). ``read`` collects the names of the parameters and
        buffers the step reads (see :meth:`_after_step`). ``buffers_grad``: a
        member's floating-point buffer requires grad. ``written`` collects a
        restacked buffer's stack, its members' tensors and its version (see
        :meth:`_run`). ``made`` collects the stacks restacked eagerly while
        ``watched`` is (see :meth:`_watch_buffers`).
        """
        entry = self.entries.get(qual)
        if entry is None:  # a parameter the template does not have (``Linear(bias=False)``'s bias)
            if tracing and any([_member_tensor(m, qual) is not None for m in self.members]):
                # Given to a member since the group was found (eagerly, that registration makes
                # the groups anew, at a call outside functional_call): traced, or restacked for
                # tensors swapped in, unfused, as below.
                raise _UnbatchedNow("a member has a parameter or buffer the others lack since grouped")
            return None
        if tracing:
            try:
                tensors = self._tensors(entry)
            except _MembersChanged:  # (a tensor gone from its dict)
                if _is_tracing():  # (as below)
                    raise _UnbatchedNow("traced while a member's tensor is gone from its dict") from None
                raise
            differs = _unlike(tensors)
            if differs is not None:
                # The members differ since the group was found (one's bias removed, a weight of
                # another shape given), which registers nothing. A trace cannot find the groups
                # again (see Parallel._traced_fusion): they are traced unfused. Eagerly (their
                # tensors stacked as they are), the group fails, and "auto" unfuses it for good.
                if _is_tracing():
                    raise _UnbatchedNow("traced while the members' tensors differ")
                raise self._no_longer_identical(qual, tensors, differs)
            if tensors[0] is None:
                if not _is_tracing():
                    # Every member's set to None since grouped (``m.bias = None`` on each: alike, and
                    # registering nothing). Restacked at every call from then on, the group would
                    # never be found anew, nor its saved weights watched: it fails as above.
                    raise _MembersChanged(f"the branches are no longer what was grouped: {qual} of every branch "
                                          f"was set to None")
                return None
            unstacked = False
            if written is not None and entry.kind == "_buffers":
                if _share_memory(tensors):
                    # One buffer given to several members (functional_call; or views of one): each
                    # writes it in turn unfused, which stacked copies would not add up to.
                    raise _UnbatchedNow("members were given one buffer")
                # Made outside inference mode, the stack keeps a version, which a layer's write
                # moves under inference mode too (see _run).
                with torch.inference_mode(False):
                    stacked = torch.stack(tensors)
                written.append((stacked, tensors, _version(stacked)))
            else:
                # Restacked eagerly (tensors swapped in): a function of the members' tensors, as
                # the bound stacks are, by _Unstack, which gives no gradient to a member none of
                # whose outputs received one (torch.stack's backward hands it zeros).
                unstacked = (received is not None and _forward_ad._current_level < 0
                             and any([t.requires_grad for t in tensors]))
                # (Otherwise grad mode left as it is: traced without grad, no change of it in the graph.)
                with torch.no_grad() if unstacked else contextlib.nullcontext():
                    stacked = torch.stack(tensors)
            if made is not None and read is not None:
                # Restacked eagerly (tensors swapped in): autograd saves the stack, not the tensors
                # given, so that one changed in place before the backward (an optimizer's step on
                # functional_call's dict) would go unseen: watched as the bound members' are.
                made[qual] = stacked
                read.append(qual)
                if watched is not None and entry.kind == "_parameters" and self._ruled(qual):
                    self._watch_ruled(qual, watched, tensors, [t.requires_grad for t in tensors], flow)
            if unstacked:
                return _unstack(received, stacked, tensors)
            # (Not under torch.func transforms, which hand gradients back, accumulating none. Nor
            # under torch.export, whose programs hold no autograd.Function: a strict export runs
            # its forward with grad off, cutting the parameters from the gradient, and a non-strict
            # one keeps the forward alone.)
            if stacked.requires_grad and not _functorch_active() and not _is_exporting():
                if not _is_tracing() and _forward_ad._current_level >= 0:  # (dual parameters swapped in)
                    tangent = _forward_ad.unpack_dual(stacked).tangent
                    if tangent is not None and _is_legacy_batched(tangent):
                        return _OwnGradientsCopied.apply(stacked)
                    return _OwnGradientsDual.apply(stacked)
                return _OwnGradients.apply(stacked)
            return stacked
        stacked = self.stacks.get(qual)
        if stacked is None:
            return None
        if torch.is_grad_enabled() and entry.kind == "_parameters" and (stacked.dtype.is_floating_point
                                                                         or stacked.dtype.is_complex):
            tensors = self._tensors(entry)
            grads = [t.requires_grad for t in tensors]
            trained = any(grads)  # (members may be frozen one by one)
            if watched is not None and self._ruled(qual):
                self._watch_ruled(qual, watched, tensors, grads, flow)
            if read is not None:
                read.append(qual)
            if trained:
                return _unstack(received, stacked, tensors)
        elif entry.kind == "_buffers":
            if read is not None:  # (an index or a mask too: saved, it counts)
                read.append(qual)
            if buffers_grad and (stacked.dtype.is_floating_point or stacked.dtype.is_complex):
                # A buffer made to require grad (``requires_grad_()``, which registers nothing):
                # autograd gives each member's its gradient, as unfused. (The stack itself,
                # made under no_grad, is no function of them.)
                tensors = self._tensors(entry)
                if any([t.requires_grad for t in tensors]):
                    return _unstack(received, stacked, tensors)
        return stacked

    def _watch_ruled(self, qual: str, watched: list, tensors: list[torch.Tensor], grads: list[bool],
                     flow: list[bool]) -> None:
        r"""Add the members' parameter ``qual``, of a rule of :func:`_program`'s layers, to ``watched`` where
        autograd saves it (see :func:`_refuse_changed_members`); ``grads``: whether each requires grad."""
        # Per member, as unfused: a Linear's weight where its input requires grad (autograd
        # saves it for the input's gradient, frozen or not); the weight of the layers whose
        # backward saves it whatever requires grad where either does. (Others, a vmapped
        # layer's: see _after_step.)
        if qual in self.saved_with_input:
            _watch_saved(watched, f"parameter {qual!r}", self.indices, tensors, flow)
        elif qual in self.saved_always:
            _watch_saved(watched, f"parameter {qual!r}", self.indices, tensors, [g or f for g, f in zip(grads, flow)])

    def _ruled(self, qual: str) -> bool:
        r"""Whether parameter ``qual`` is watched by a rule of :func:`_program`'s layers (a bias or an
        ``Embedding``'s weight: never; see :meth:`_stacked`), not where a step saved it (see :meth:`_after_step`)."""
        return (self.entries[qual].attr == "bias" or qual in self.never_saved or qual in self.saved_with_input
                or qual in self.saved_always)

    def _compare_attributes(self, since: str) -> None:
        r"""Refuse members whose tensor attributes (not parameters or buffers) are set apart from the first
        member's; else keep them, with their versions, for later calls to look at (see :func:`_attribute_changed`).

        The layers run through vmap read the first member's attributes for every
        member (see _vmapped_step): the members' own calls since they were grouped
        (``fuse="auto"``'s first call runs them in turn) may have set theirs apart --
        a cache computed from their parameters -- and so may the user between calls
        (``block[3].scale.mul_(2)``), which batched would silently be the first
        member's for all. Grouped anew, they are told apart there (see
        :class:`_MembersChanged`). ``since``: how they came apart, for the message.
        """
        # (The first member too, against itself: for a view of its own parameters.)
        for name, member in zip(self.names, self.members):
            diff = _attributes_set_apart(self.template, member)
            if diff is not None:
                first = "" if member is self.template else (
                    f", where branch {self.names[0]!r} has its own, {since} (register a tensor each member "
                    f"keeps apart with register_buffer)")
                raise _MembersChanged(f"the branches are no longer identical: in branch {name!r}, {diff}{first}")
        self.attributes = [(name, _join(path, k), vars(m), k, t, None if t.is_inference() else t._version, t._cdata)
                           for name, member in zip(self.names, self.members) for path, m in member.named_modules()
                           for k, t in _tensor_attributes(m).items()]

    def attribute_tensors(self) -> list[torch.Tensor]:
        r"""The first member's tensor attributes (not parameters or buffers) that keep a version: those a layer
        run through vmap reads, and may write, for every member (see :func:`_vmapped_step`)."""
        return [t for m in self.template.modules() for t in _tensor_attributes(m).values() if not t.is_inference()]

    def _after_step(self, watched: list, read: list[str], out: Any, before: torch.Tensor, flow: list[bool],
                    vmapped: bool, made: dict[str, torch.Tensor] | None = None) -> None:
        r"""Watch what a step read that autograd saved (see :meth:`_watch_buffers`), and move ``flow`` on.

        ``flow[k]``: whether member ``k``'s input to the next step requires grad
        -- where its input to this one did, or a parameter of this step of its
        own does (a member frozen up to a layer computes nothing autograd
        differentiates before it, unfused); for every member where a
        ``vmapped`` step's output requires grad (a layer of the user's may read
        a tensor requiring grad from outside the member).
        """
        # Buffers, and parameters of no rule of _program's (a vmapped layer's): where saved.
        unruled = [q for q in read if self.entries[q].kind == "_buffers" or not self._ruled(q)]
        if vmapped:
            flowed = [True] * self.n
        else:
            flowed = list(flow)
            if not all(flow):
                for qual in read:
                    entry = self.entries[qual]
                    if entry.kind == "_parameters":
                        for k, t in enumerate(self._tensors(entry)):
                            flowed[k] = flowed[k] or t.requires_grad
        if unruled:
            self._watch_buffers(watched, unruled, out, before, flowed, made)
        flow[:] = flowed

    def _watch_buffers(self, watched: list, buffers: list[str], out: Any, before: torch.Tensor,
                       flowed: list[bool], made: dict[str, torch.Tensor] | None = None) -> None:
        r"""Add to ``watched`` the ``buffers`` a step read (from ``before``, its input, to ``out``) that autograd saved
        (and a vmapped layer's parameters, judged alike: see :meth:`_after_step`).

        A member's buffer, as its parameters, is a slice of its stack's memory
        with a version counter of its own (see :func:`_refuse_changed_members`):
        unfused, autograd refuses a backward through a buffer changed in place
        since the forward (``reset_running_stats()`` on an eval BatchNorm whose
        statistics a loss's gradient reads); fused it would silently read the
        new values. Those of ``buffers_saved`` wherever a member's output of
        the step requires grad (``flowed``: its input did, or a parameter of the
        step does); others where autograd saved their stack's memory (a vmapped
        ``x * self.scale`` saves it, ``x + self.shift`` does not), or cannot be
        told (saved-tensor hooks). ``made``: the stacks restacked for the call, where
        not the bound ones (see :meth:`_stacked`).
        """
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not leaves:
            return
        saved: set[int] | None = set()
        if any(q not in self.buffers_saved for q in buffers):
            saved = _saved_storages([t.grad_fn for t in leaves], [before.grad_fn] if before.grad_fn else ())
        for qual in dict.fromkeys(buffers):
            entry = self.entries[qual]
            stacks = self.stacks if made is None else made
            if qual in self.buffers_saved or saved is None or stacks[qual].untyped_storage().data_ptr() in saved:
                what = f"{'buffer' if entry.kind == '_buffers' else 'parameter'} {qual!r}"
                _watch_saved(watched, what, self.indices, self._tensors(entry), flowed)

    # Running --------------------------------------------------------------
    def copies_biases(self, x: torch.Tensor) -> bool:
        r"""Whether a capture of :meth:`run` on ``x``, ``cat_joined``, copies biases in (see :class:`_Prefill`).

        As the ``Linear`` step of :func:`_program` decides it: on rows of
        features, every ``Linear`` with a bias after the first layer (the
        first, on the shared input, adds its bias in the product's epilogue).
        """
        layers = _flat_layers(self.template)
        return (x.dim() == 2 and any(type(m) is nn.Linear and m.bias is not None for m in layers[1:])
                and not self.kernel_layers(x))

    def kernel_layers(self, x: torch.Tensor) -> bool:
        r"""Whether a capture of :meth:`run` on ``x`` computes every ``Linear`` with :mod:`._batched_linear`.

        For inference on rows of features through ``Linear`` layers and
        activations alone, at shapes the kernel takes (see the ``Linear`` step
        of :func:`_program`); under autocast, forward-mode AD or a functorch
        transform, the layers run as they would eagerly.
        """
        shapes = self.linear_shapes
        if (not shapes or x.dim() != 2 or type(x) is not torch.Tensor or torch.is_autocast_enabled(x.device.type)
                or _functorch_active() or _dispatch_modes() and not _only_writes_watched() or _function_modes()):
            # (Subclasses and modes -- FakeTensorMode, FlopCounterMode -- see torch's operations;
            # a kernel launched by hand would go past them.)
            return False
        if torch.is_grad_enabled() and (x.requires_grad or any(
                p.requires_grad for m in self.members for p in m.parameters())):
            return False
        if _forward_ad._current_level >= 0:
            return False
        key = (x.shape[0], x.dtype, x.device)
        takes = self.kernel_shapes.get(key)
        if takes is None:
            # (Made anew by bind whenever it stacks: a member cast or moved is stacked anew.)
            takes = not any(
                t.dtype != x.dtype or t.device != x.device for m in self.template.modules() if type(m) is nn.Linear
                for t in (m.weight, m.bias) if t is not None) and all(
                _batched_linear.supported(x.shape[0], i, o, x.dtype, x.device)
                and self.n * i * o < _batched_linear._MAX_ELEMENTS for i, o in shapes)
            # (Bounded: rows of flattened tokens of variable-length batches make a new key at each call.)
            _bounded_add(self.kernel_shapes, key, takes)
        return takes and _batched_linear._failure is None  # (a kernel that failed since: torch's layers)

    def run(self, x: torch.Tensor, cat_joined: bool = False, eager: bool = False, side_bias: bool = True,
            restack: bool = False) -> Any:
        r"""Every member's output on the shared input ``x``, batched (see :func:`_split`).

        Outside tracing, :meth:`bind` must have been called since the members last changed.
        ``cat_joined``: the caller concatenates the outputs along their dimension 1,
        which reads the channels layout as it is (see :func:`_kernels_cost_more`).
        ``eager``: the caller has already seen that no compiler traces and no graph
        is being captured, which an eager call, CPU-bound, need not ask again.
        ``side_bias``: a capture copies the products' biases in on a side stream
        (see :class:`_Prefill`); ``False``: in line.
        ``restack``: stack the members' tensors as they are now, as under tracing
        (see :meth:`swapped`).
        """
        tracing = False if eager else _is_tracing()
        captured = not tracing and not eager and _kernels_cost_more(x)
        fewer = cat_joined and captured
        # (Eagerly only where launches go straight to the compiled kernel: through Triton's
        # own launch path a layer costs the host more than cuBLAS's two launches.)
        kernels = not tracing and (captured or self.paired and _launches_fast(x)) and self.kernel_layers(x)
        call = _call
        before = call.fewer_kernels, call.prefill, call.cat_joined, call.kernels, call.lone_kernels, call.chained
        if tracing and not any(before):
            # A compiler's trace decides all of them off, as they are: set, they would be a side
            # effect of the traced forward (dynamo warns of it under a strict torch.export).
            return self._run(x, True, keep=False)
        # (Restacked, each layer's weights are stacked anew just before it, on the stream the
        # layers run on: its kernel must not read them before the stack has ended.)
        # (Restacked: the biases this call stacked, not the bound ones stored together.) Made
        # before any of the thread's settings is: a failure here (its stream's event refused)
        # would leave them set for every later call of the thread, past the ``finally`` below.
        prefill = _Prefill(x, side_bias, {} if restack else self.joint) if fewer and not kernels else None
        call.fewer_kernels, call.kernels, call.lone_kernels = fewer, kernels, kernels and captured
        call.chained = None if restack else False
        call.prefill = prefill
        call.cat_joined = cat_joined and not tracing
        try:
            return self._run(x, tracing or restack, keep=not tracing, restacked=restack and not tracing)
        finally:
            call.fewer_kernels, call.prefill, call.cat_joined, call.kernels, call.lone_kernels, call.chained = before

    def _run(self, x: torch.Tensor, tracing: bool, keep: bool = True, restacked: bool = False) -> Any:
        watched: list | None = None
        # Restacked eagerly (tensors swapped in, or changed since bound): the buffers' stacks made
        # for the call, with their versions, which a layer writing its buffers moves (see below).
        written: list | None = [] if restacked and not _differentiating() else None
        # Restacked eagerly while autograd records: the stacks made for the call, watched as the
        # bound ones are (see _stacked). (Not under torch.func transforms, whose wrapped tensors
        # keep no versions.)
        made: dict[str, torch.Tensor] | None = (
            {} if restacked and torch.is_grad_enabled() and not _functorch_active() else None)
        read: list[str] | None = None  # (by the step running: see _after_step)
        received: _Received | None = None
        # Whether each member's input to the step running requires grad (see _after_step).
        flow = [x.requires_grad] * self.n
        if not tracing and not torch.is_grad_enabled():
            get: _Get = self.stacks.get  # nothing to differentiate: the stacks as they are
        elif not tracing and getattr(torch.autograd.graph, "_allow_mutation_on_saved_tensors_enabled", False):
            # Under torch.autograd.graph.allow_mutation_on_saved_tensors(), a tensor autograd
            # saved is cloned before it is changed in place -- the stack, were a member's slice
            # of it changed, is not: the members run unfused, each saving its own tensors.
            raise _UnbatchedNow("under torch.autograd.graph.allow_mutation_on_saved_tensors(), whose "
                                "clones of saved tensors a stack would escape")
        else:
            # (Not under saved-tensor hooks -- checkpoint(use_reentrant=False), save_on_cpu --
            # with which autograd checks no saved tensor's version: unfused, a change in place
            # passes, the recomputation or the packed copy deciding what backward reads.)
            watched = None if tracing and made is None or _saved_hooks_recording() else []
            # (Told by the members' outputs' split: not under torch.func transforms, where they
            # are split by torch's operations, see _members.)
            if (not tracing or made is not None) and _graph_task is not None and not _functorch_active():
                received = _Received()
            read = None if watched is None else []
            # (Once per call, not per buffer read: see _stacked.)
            buffers_grad = not tracing and any([t.requires_grad for t in self.float_buffers])
            get = lambda qual: self._stacked(qual, tracing, watched, flow, received, read,  # noqa: E731
                                             buffers_grad, written, made)
        # (Neither read nor kept by a compiler's trace: assigned there, it was a side effect
        # the compiler guarded on, and the block was compiled a second time; read, an eager
        # call that made it since failed the guard, and compiled the block again.)
        program = self.program if keep else None
        since = "set by their own calls since they were grouped"
        if program is not None and self.attributes and _attribute_changed(self.attributes) is not None:
            # Changed between calls (``block[2].scale.mul_(2)``): compared again, and the steps made
            # anew, whose layers run through vmap hold the attributes of when they were made (one
            # assigned anew alike in every member would not be read).
            program, since = None, "changed since the group's last call (in place, assigned anew or swapped)"
        if program is None:
            if keep:
                self._compare_attributes(since)
            program = _program(self, self.template, "")
            if keep:
                self.program = program
        value: Any = _Value(x, _SHARED)
        for step in program:
            if not isinstance(value, _Value):
                raise TypeError(f"a layer of {type(self.template).__name__} returned a structured value "
                                f"where the next layer expects a tensor")
            before = value.t
            if watched is not None and not before.requires_grad and any(flow):
                flow[:] = [False] * self.n  # (through an operation autograd does not differentiate)
            value = step(value, get)
            if read is not None:
                vmapped = getattr(step, "vmapped", False) and any(
                    isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(value))
                if read or vmapped:
                    self._after_step(watched, read, value, before, flow, vmapped, made)
                    read.clear()
        written_attribute = _attribute_changed(self.attributes) if keep else None
        if written_attribute is not None:
            # A layer run through vmap wrote its tensor attribute in place (``self.calls.add_(1)``), the
            # first member's, once for every member: unfused each member writes its own. (The caller
            # puts the first member's back, where it kept a copy, and runs the members unfused.)
            name, path = written_attribute[:2]
            raise RuntimeError(
                f"{path!r} of branch {name!r}, a tensor attribute that is not a parameter or buffer, was written "
                f"while the branches ran batched (in place in forward, or by another thread): batched, the "
                f"first branch's is written once for all, where each branch writes its own; register it "
                f"with register_buffer")
        if not tracing or restacked:  # (not while a compiler traces: see _expands)
            # Members returning their input itself (an identity of the user's, nn.Identity, an eval
            # dropout; in a tuple, ``(out, x)``): unfused each returns ``x``, the object, which a
            # caller may write into or compare by identity; a view or copy of the batched value
            # would not be it. (Nothing of the group's reaches ``x``: its weights go unchecked.)
            # Members returning views of ``x`` alike (``x.view_as(x)``, ``x[:]``, ``x.detach()``): unfused
            # each returns a view of its own of ``x``'s memory, which a write into it reaches; a copy
            # would not, nor would ``x`` itself be one (see _VIEWS).
            if type(value) is _Value:
                if value.layout == _SHARED and value.t is x:
                    value, watched = _Value(x, _INPUT), None
                # (A stack's stride along the members read first: a dense one, the layers' usual
                # output, holds no expansion, and every fused call of them asks.)
                elif ((value.layout == _SHARED or value.layout == _STACKED and value.t.stride(0) == 0)
                      and type(x) is torch.Tensor and not _functorch_active()):
                    t = value.t.expand(self.n, *value.t.shape) if value.layout == _SHARED else value.t
                    if _views_of(t, x):
                        value = _Value(t, _VIEWS)
            else:
                value = _inputs_returned(value, x, self.n)
        if watched and not x.requires_grad:
            # A member whose parameters are all frozen, on an input that requires no grad,
            # computes nothing autograd differentiates unfused: none of its weights is saved,
            # and a change in place to one (an EMA teacher's update before the students'
            # backward) passes. Fused, its share of the gradient is computed and dropped.
            # (Restacked, the tensors swapped in for the call, not the bound ones: a frozen model's
            # functional_call with trained tensors trains them.)
            members = self.member_parameters
            if made is not None:
                given = [self._tensors(e) for e in self.entries.values() if e.kind == "_parameters"]
                members = [tuple(ts[k] for ts in given) for k in range(self.n)]
            frozen = {i for i, params in zip(self.indices, members)
                      if not any([p is not None and p.requires_grad for p in params])}
            if frozen:
                entries, watched = watched, []
                for what, indices, tensors, versions, impls in entries:
                    kept = [k for k, i in enumerate(indices) if i not in frozen]  # (by branch: entries may hold some)
                    if kept:
                        watched.append((what, [indices[k] for k in kept], [tensors[k] for k in kept],
                                        [versions[k] for k in kept], [impls[k] for k in kept]))
        if watched:
            _refuse_changed_members(value, watched, received, self.indices, self.owner)
        if received is not None:
            value = value._replace(received=received) if isinstance(value, _Value) else _Structured(value, received)
        if written:
            # What the layers wrote into the stacks made for the call (a count of calls, test-time
            # statistics) goes back into the members' buffers, as their own calls write them.
            with torch.no_grad():
                for stacked, tensors, version in written:
                    if _version(stacked) != version:
                        for t, row in zip(tensors, stacked.unbind(0)):
                            t.copy_(row)
        return value


def _watch_saved(watched: list, what: str, indices: list[int], tensors: list[torch.Tensor], saved: list[bool]) -> None:
    r"""Add the members' ``tensors`` that autograd ``saved``, with their versions and C++ tensors
    (``_cdata``, which ``torch.utils.swap_tensors`` replaces) now, to ``watched``."""
    if not all(saved):
        if not any(saved):
            return
        kept = [k for k, s in enumerate(saved) if s]
        indices, tensors = [indices[k] for k in kept], [tensors[k] for k in kept]
    watched.append((what, indices, tensors, [t._version for t in tensors], [t._cdata for t in tensors]))


def _refuse_changed_members(value: Any, watched: list[tuple[str, list[int], list[torch.Tensor], list[int], list[int]]],
                             received: _Received | None = None, indices: Sequence[int] = (),
                             owner: str = "Parallel") -> None:
    r"""Make a backward through ``value`` refuse members' weights (and saved buffers) changed in place since this call.

    Autograd saves views of the stacks, whose version counter is the stack's:
    a member's parameter is a slice of its stack's memory (``.data =``, see
    :meth:`_Group.bind`) but keeps a counter of its own, which an optimizer's
    in-place step moves. Unfused, autograd refuses a backward through weights
    changed since the forward ("modified by an inplace operation": an
    ``optimizer.step()`` between a ``backward(retain_graph=True)`` and another
    backward); fused it would silently use the new values. So, when the
    gradient reaches ``value`` -- before any layer of the group runs its
    backward -- the members' versions are compared with this call's. Left
    out, as unfused autograd saves none of them and lets such a change pass:
    biases, a ``Linear``'s weight where the layer's input does not require
    grad (a probe on frozen features) and an ``Embedding``'s weight. Buffers
    likewise, where saved (see :meth:`_Group._watch_buffers`). And members
    whose outputs this backward pass leaves out (``received``, by position
    among the group's branches ``indices``): unfused, a loss per head
    differentiates only its own head's saved tensors. Not checked: a pass
    through a ``create_graph=True`` pass's graph alone (a gradient penalty's),
    which reaches the stacks past ``value``, through torch's nodes; they saved
    views of the stacks, whose version a change to a member's parameter does
    not move. (Checked at the member's mark, see :class:`_Received`, it
    refused changes that graph does not read, which unfused lets pass.)

    A member's tensor swapped for another since this call
    (``torch.utils.swap_tensors``, as ``.to()`` and ``load_state_dict(assign=True)``
    swap them under ``torch.__future__.set_swap_module_params_on_conversion(True)``)
    is refused too, by its C++ tensor: unfused, autograd holds the tensor it
    saved, and torch refuses to swap one held elsewhere; fused, autograd holds
    the stack, and the swap passes. (Its version, the new tensor's, tells
    nothing: an equal one let the backward read the old stack silently.)
    """
    def check(grad: torch.Tensor) -> None:
        # (Not a member this pass reaches through a create_graph pass's graph alone, past its
        # output, by its mark: that graph reads what it saved, which may not be what the call
        # saved -- a loss linear in a head's output made one that reads the head's last Linear's
        # weight against no gradient of its own, and saves none of it, unfused.)
        got = received.got(marked=False) if received is not None else None
        used = None if got is None else {indices[k] for k in got}
        for what, branches, tensors, versions, impls in watched:
            for i, (t, v, c) in enumerate(zip(tensors, versions, impls)):
                if (t._cdata != c or t._version != v) and (used is None or branches[i] in used):
                    others = [k for k in indices or branches if k != branches[i]]
                    if t._cdata != c:
                        raise RuntimeError(
                            f"{owner}: {what} of the branch at index {branches[i]} (fused with the branches at "
                            f"{others}) was swapped for another tensor (torch.utils.swap_tensors) since the forward "
                            f"pass, which saved it for this backward. Unfused, torch refuses that swap (autograd "
                            f"holds the tensor): run every backward pass before swapping the branches' tensors "
                            f"(as .to(), .half() and load_state_dict(assign=True) swap them under "
                            f"torch.__future__.set_swap_module_params_on_conversion(True)), or compute the loss anew.")
                    raise RuntimeError(
                        f"one of the variables needed for gradient computation has been modified by an "
                        f"inplace operation: {what} of the branch at index {branches[i]} (fused with "
                        f"the branches at {others}) is at version {t._version}; "
                        f"expected version {v} instead ("
                        + ("changed after the forward pass, as by an optimizer.step() between a "
                           "backward(retain_graph=True) and another backward" if what.startswith("parameter") else
                           "changed in place since the forward pass, as by reset_running_stats(), "
                           "load_state_dict() or a call in training mode")
                        + "). Unfused, autograd refuses this backward too: run every backward pass before "
                          "changing the branches, or compute the loss anew.")

    leaves = [value.t] if isinstance(value, _Value) else pytree.tree_leaves(value)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(check)


def _only_writes_watched() -> bool:
    r"""Whether the only dispatch modes active are :class:`._streams._Writes`, which watch for writes to
    the inputs: a kernel launched by hand writes only its own output, and the call that first watches a
    signature then runs the kernels of every later call, not others that round otherwise."""
    return all(type(mode) is _Writes for mode in _dispatch_stack())


def _launches_fast(x: torch.Tensor) -> bool:
    r"""Whether an eager call on ``x`` launches :mod:`._batched_linear`'s kernel as cheaply as it runs cuBLAS's
    two operations (see :func:`._batched_linear.launches_fast`)."""
    return x.is_cuda and _batched_linear.launches_fast()


def _kernels_cost_more(x: torch.Tensor) -> bool:
    r"""Whether the call on ``x`` is being captured in a CUDA graph.

    A replay costs the GPU's kernels, not the CPU's operations: products then
    take the layouts that launch the fewest kernels, at the price of view and
    allocation operations (see the ``Linear`` step of :func:`_program`). An
    eager fused call is CPU-bound instead, each operation costing about as
    much as a launch, so it takes the fewest operations. Only where a ``cat``
    join reads those layouts as they are (``_Group.run``'s ``cat_joined``):
    split into per-branch outputs, they would not be contiguous, where the
    eager path's are.
    """
    return x.is_cuda and _capture_underway()


class _CallState(threading.local):
    r"""What the running fused call of this thread decided once for all its steps."""

    fewer_kernels = False
    prefill: _Prefill | None = None
    cat_joined = False  # the caller concatenates the outputs along dim 1, and no compiler traces
    kernels = False  # Linear layers run as _batched_linear kernels (see _Group.kernel_layers)
    # So do those without an activation after them: in a capture, where that is one kernel
    # on the replay's path where a batched product needs two (the bias copied in); not
    # eagerly, where that product is one operation too, and the kernel saves the host nothing.
    lone_kernels = False
    # A kernel layer of this call was launched (see _batched_linear.linear's ``chained``);
    # ``None``: the call restacks its weights before each layer, which no layer may overtake.
    chained: bool | None = False

    def __init__(self) -> None:
        # Set on each thread's instance, not read off the class: torch.compile guards on the
        # instance's attributes, which a first call writing them would change (a guard failing
        # on the frame that made it, at the second call).
        self.fewer_kernels, self.prefill, self.cat_joined, self.kernels = False, None, False, False
        self.lone_kernels = self.chained = False


class _Prefill:
    r"""Output buffers of a captured fused call's biased products, the bias written in beforehand.

    A batched product with a bias launches two kernels: the bias copied into
    the output, then the product accumulated onto it (``baddbmm``). A single
    branch's ``addmm`` launches one, the bias added in its epilogue; in a CUDA
    graph each launch on the path from input to output costs about 3 us of
    the replay. The copy depends on nothing the group computes, so it is made
    on a side stream that waits only for the work enqueued before the group's
    call (``start``): the graph runs the copies beside the first layers, and
    the path through the layers keeps one kernel per product.

    Memory: the buffers are allocated on the side stream, which no earlier
    layer of the call used, and recorded on the caller's stream, so none of
    them takes a block that a layer still reads or that another buffer
    holds (the allocator defers those frees to the end of a capture, or to
    the caller's stream's progress outside one). Outside CUDA (tests), or with
    ``side=False``, the copy is made in line: a graph of one stream costs the
    host less to launch, and on some hosts that wins over the kernels saved
    on the path (mlp8 on the H100 machine: 36 against 41 us a call; the
    ``Parallel`` captures both and keeps the faster).
    """

    __slots__ = ("caller", "side", "joint", "buffers")

    def __init__(self, x: torch.Tensor, side: bool = True,
                 joint: dict[str, tuple[torch.Tensor, int]] | None = None) -> None:
        self.caller = self.side = None
        if x.is_cuda and side:
            pool = _pool(x.device)
            self.caller = _current_stream(x.device)
            self.side = pool.side_streams(pool.offset, 1, self.caller)[0]
            start = torch.cuda.Event()
            start.record(self.caller)
            self.side.wait_event(start)
        self.joint = joint or {}  # see _Group.joint
        self.buffers: dict[int, torch.Tensor] = {}  # a class's buffers, by id of its biases' tensor

    def filled(self, bias: torch.Tensor, rows: int, name: str | None = None) -> torch.Tensor:
        r"""A ``[N, rows, out]`` view of a ``[rows, N, out]`` buffer holding ``bias`` (``[N, 1, out]``) in every row.

        Where ``name`` is a bias stored with others of its width (``_Group.joint``),
        the first of them asked for fills the buffers of all in one kernel (a
        copy per product is one kernel per layer on the replay's path, where
        the copies run in line), and the others get theirs.
        """
        entry = self.joint.get(name)
        if entry is not None:
            together, k = entry
            buffers = self.buffers.get(id(together))
            if buffers is None and together.numel() * rows * together.element_size() <= _JOINT_FILL_BYTES:
                buffers = self.buffers[id(together)] = self._fill(together, rows)
            if buffers is not None and buffers.shape[1] == rows:
                return buffers[k].transpose(0, 1)
        return self._fill(bias.transpose(0, 1), rows)[0].transpose(0, 1)

    def _fill(self, biases: torch.Tensor, rows: int) -> torch.Tensor:
        r"""``[L, rows, N, out]`` buffers, ``biases`` (``[L, N, out]``) written into every row, on the side stream."""
        layers, n, width = biases.shape
        with torch.cuda.stream(self.side):  # (no stream: in line)
            out = biases.new_empty((layers, rows, n, width))
            out.copy_(biases.unsqueeze(1).expand(layers, rows, n, width))
        if self.side is not None:
            done = torch.cuda.Event()
            done.record(self.side)
            self.caller.wait_event(done)
            out.record_stream(self.caller)
        return out


# The buffers of one class of biases (see _Prefill.filled) are allocated together and
# live until the group's last product; per layer, each could be freed after its
# activation. Small products, where the kernel saved matters, take the joint fill.
_JOINT_FILL_BYTES = 8 << 20


def _joint_bias_classes(template: nn.Module) -> list[list[str]]:
    r"""The biases of ``template``'s ``Linear`` layers after its first, by width and dtype, in classes of two or more.

    These are the biases a capture writes into batched products' outputs (see
    :meth:`_Group.copies_biases`), named as in the template.
    """
    if type(template) is not nn.Sequential:
        return []
    classes: dict[tuple[int, torch.dtype], list[str]] = {}
    for qual, m in _layers(template)[1:]:
        if type(m) is nn.Linear and m.bias is not None:
            classes.setdefault((m.out_features, m.bias.dtype), []).append(_join(qual, "bias"))
    return [quals for quals in classes.values() if len(quals) > 1]


_call = _CallState()


def _python_same_addresses(tensors: list[torch.Tensor], ptrs: list[int], indices: list[int]) -> bool:
    return all(tensors[i].data_ptr() == ptrs[i] for i in indices)


# Checked on every eager fused call, over every parameter of the group (64 for
# eight 4-layer MLPs): one C call where CUDA builds of torch have it (the check
# CUDA graph trees run on each replay), 70 ns per tensor in Python otherwise.
_same_addresses = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None) or _python_same_addresses


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    r"""``torch.stack(tensors)``, an inference tensor where they are (members made under ``inference_mode``).

    Their ``.data`` becomes a view of the stack: a tensor made outside
    inference mode would leave an inference parameter half of each kind,
    refused by its own layer's next call ("Inference tensors do not track
    version counter"). (A group's tensors are all of one kind: see ``_bind``.)
    """
    with torch.inference_mode(tensors[0].is_inference()):
        return torch.stack(tensors)


def _adopt(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    r"""The stack ``tensors`` already are (consecutive contiguous slices of one storage), or ``None``."""
    first = tensors[0]
    storage = first.untyped_storage()
    start, numel = first.storage_offset(), first.numel()
    for i, t in enumerate(tensors):
        if (not t.is_contiguous() or t.dtype != first.dtype or t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.storage_offset() != start + i * numel):
            return None
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, start, (len(tensors), *first.shape))


def _to_stacked(v: _Value, n: int) -> torch.Tensor:
    if v.layout == _STACKED:
        return v.t
    if v.layout == _SHARED:
        return v.t.expand(n, *v.t.shape)
    return v.t.unflatten(1, (n, -1)).movedim(1, 0)


def _member_dims(v: _Value) -> int:
    r"""The number of dimensions of one member's value (the stacked layout adds one)."""
    return v.t.dim() - 1 if v.layout == _STACKED else v.t.dim()


def _to_channels(v: _Value, n: int) -> torch.Tensor:
    if v.layout == _CHANNELS:
        return v.t
    if v.layout == _SHARED:
        # (``cat``, not ``repeat``: a channels-last input gives a channels-last result, as each
        # member's layer would.)
        return torch.cat([v.t] * n, 1)
    return v.t.movedim(0, 1).flatten(1, 2)


class _Joined:
    r"""The outputs of a call where one group covered every branch, in order, still batched.

    A ``cat``/``stack``/``sum``/``mean`` join is read off the batched value
    (:meth:`join`) without splitting it into N tensors first; :meth:`split`
    gives the per-branch outputs for any other join.
    """

    __slots__ = ("value", "n")

    def __init__(self, value: _Value, n: int) -> None:
        self.value, self.n = value, n

    def split(self) -> list[Any]:
        return _split(self.value, self.n)

    def join(self, how: Any, dim: int) -> torch.Tensor | None:
        r"""The joined outputs computed from the batched value, or ``None`` where no shortcut applies.

        Unfused, ``cat`` and ``stack`` return a tensor of their own. Fused, the
        join may be the group's last activation itself or a view of it, which
        the layer that made it may have saved for backward (ReLU, Sigmoid and
        Tanh save their outputs): then it is copied, so that an in-place
        operation on the block's output (a following ``nn.ReLU(inplace=True)``)
        spoils nothing. (A ``Linear`` saves its input, not its output: no copy.)
        """
        joined = self._join(how, dim)
        if joined is not None and joined.requires_grad:
            t = self.value.t
            base = t if t._base is None else t._base
            if joined is t or joined._base is base:
                if _is_tracing():  # (a compiler's trace shows no saved results: copied whatever saved it)
                    return joined.clone()
                fn = base.grad_fn  # (a Python Function's ``ctx`` may have saved anything; not
                # _TrainedLinear's, which saves its inputs alone, as autograd's own product does.
                # Asked of the node's class: reading the node's saved value runs saved-tensor hooks'
                # unpack, which under checkpoint(use_reentrant=False) recomputes the whole forward.)
                if hasattr(type(fn), "_saved_result") or (isinstance(fn, torch.autograd.function.BackwardCFunction)
                                                          and type(fn) is not _TrainedLinear._backward_cls):
                    return joined.clone()
        return joined

    def _join(self, how: Any, dim: int) -> torch.Tensor | None:
        t, layout, n = self.value.t, self.value.layout, self.n
        if layout == _CHANNELS:
            # [B, N*C, ...] is already the outputs concatenated along dimension 1.
            return t if how == "cat" and dim in (1, 1 - t.dim()) else None
        if layout in (_SHARED, _INPUT):  # every member's output is t itself
            if how == "cat" and t.dim() > 0 and -t.dim() <= dim < t.dim():
                return torch.cat([t] * n, dim)
            if how == "stack" and -t.dim() - 1 <= dim <= t.dim():
                return torch.stack([t] * n, dim)
            return None  # (and a bad dim: the general join names it)
        if layout not in (_STACKED, _VIEWS):  # (views: joined into a tensor of its own, as any stack)
            return None
        if how == "cat":
            d = dim + t.dim() - 1 if dim < 0 else dim  # in a member's output, which lacks dim 0 of t
            if not 0 <= d < t.dim() - 1:
                return None
            joined = t.movedim(0, d).flatten(d, d + 1)  # (a copy, dense, unless a dimension has size 1)
            if joined.is_contiguous():
                return joined
            # Dense, as torch.cat's: across a dimension of size 1 ``flatten`` returns a strided
            # view, [B, N, 1, C] to [B, N, C], which ``.view()`` would refuse.
            # (In the format torch.cat would pick from the members' strides: channels-last ones
            # where they are ordered so, which a size-1 dimension leaves ambiguous.)
            return joined.contiguous(memory_format=_suggest_memory_format(t.select(0, 0)))
        if how == "stack":
            d = dim + t.dim() if dim < 0 else dim  # in the stacked result, which has t's dims
            # (Dense, as torch.stack's: a layer's batched rule may leave the stack strided, a
            # Flatten of the channels layout.)
            return (t.contiguous() if d == 0 else t.movedim(0, d).contiguous()) if 0 <= d < t.dim() else None
        if how in ("sum", "mean") and layout == _STACKED:
            if t.dtype in _ACCUMULATED_IN_PLACE:
                return t.sum(0) if how == "sum" else t.mean(0)
            # (Integer and bool outputs: ``sum(0)`` promotes to int64 and ``mean(0)``
            # refuses, where the join's additions keep the outputs' dtype. Half and bfloat16:
            # ``sum(0)`` accumulates in float32 and rounds once, where the join's additions
            # round at each one.) The join's own additions, on the members' slices: split, each
            # slice would be copied while autograd records, which doubled a call of 16 bfloat16
            # members on the CPU. (Strided slices split, copied dense as unfused outputs are.
            # Views of the input too: added as unfused, their sum keeps the input's strides.)
            if _dense_members(t):
                return _leaf_join(how, dim, list(t.unbind(0)))
        return None


def _split(v: _Value | Any, n: int) -> list[Any]:
    r"""The members' outputs, one tensor each, as the unfused branches would return them.

    Unfused, each branch returns a tensor of its own, which its caller may
    change in place. Views of one batched tensor share its version counter:
    while autograd records, a member's output changed in place would spoil
    another's saved for backward, so each member then gets a copy. Otherwise
    single views (``select``; autograd refuses in-place operations on the
    outputs of ``unbind``, which returns several views). Outputs computed once
    for all members (the shared layout) are copied for all but the first.
    """
    recording = torch.is_grad_enabled()
    if not isinstance(v, _Value):  # structured output of a vmapped module: stacked leaves
        received = None
        if type(v) is _Structured:
            v, received = v
        leaves, spec = pytree.tree_flatten(v)
        # (vmap may leave a leaf's member dimension anywhere in memory, a batch norm's output
        # [B, N, C]: then copied, as for the stacked layout below.)
        # (A leaf vmap expanded, one value for every member, copied for each: see the stacked layout.)
        columns = [_members(leaf, 0, n, recording and leaf.requires_grad or not _dense_members(leaf)
                            or _expanded(leaf), received)
                   if isinstance(leaf, torch.Tensor) else leaf.split(n) if type(leaf) is _Input else (leaf,) * n
                   for leaf in leaves]
        return [pytree.tree_unflatten([c[i] for c in columns], spec) for i in range(n)]
    t = v.t
    if v.layout == _INPUT:  # (every member returned the input itself, as each does unfused)
        return [t] * n
    if v.layout == _VIEWS:  # (views of the input, each member's its own, sharing the input's memory and version)
        return _Input(t, views=True).split(n)
    if v.layout == _SHARED:
        return [t, *(t.clone() for _ in range(n - 1))]
    if v.layout == _STACKED:
        # (A member's slice is dense unless a layer's batched rule left the stack strided, a
        # Flatten of the channels layout: then copied, as unfused it would be dense. Copied too
        # where vmap expanded one value for every member -- a layer of the user's computing its
        # output from no tensor of the member's own, ``x * 2`` -- as slices of it would be one
        # memory, each member's write reaching the others', where unfused each has its own.)
        return _members(t, 0, n, recording and t.requires_grad or not _dense_members(t) or _expanded(t), v.received)
    # The channels layout, [B, N * C, ...]: a member's channels are a strided slice of
    # every sample, where unfused it gets a dense tensor (``.view()`` works on it). One
    # copy gives every member a dense block; an input in another memory format
    # (channels-last) gets that format, member by member, as unfused.
    t = t.unflatten(1, (n, -1))
    if recording and t.requires_grad or not t.is_contiguous():
        return _members(t, 1, n, True, v.received)
    return _members(t.movedim(1, 0).contiguous(), 0, n, False)


def _dense_members(t: torch.Tensor) -> bool:
    r"""Whether each member's slice of stacked ``t`` (members along dimension 0) is dense, as a
    tensor a branch returns unfused is (contiguous, or channels-last)."""
    return _is_dense(t.select(0, 0) if t.dim() else t)


_is_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda t: False)

# torch.func's transforms that differentiate: run under one, a function's write in place into a
# tensor from outside it is refused ("would mutate a captured Tensor"), where vmap and functionalize
# make it.
_DIFFERENTIATING = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp)


def _differentiating() -> bool:
    r"""Whether a torch.func transform that differentiates (``grad``, ``vjp``, ``jvp``, ``jacrev``...) is active."""
    return any([i.key() in _DIFFERENTIATING for i in torch._C._functorch.get_interpreter_stack() or ()])


def _version(t: torch.Tensor) -> int:
    r"""``t``'s version: under ``torch.vmap``, that of the tensor it batches, which a write in place moves
    (a batched tensor's own stays as it was); under ``torch.func.functionalize``, whether it was written
    (a functional tensor's version stays as it was, a write replacing the tensor it wraps)."""
    while torch._C._functorch.is_batchedtensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    if torch._C._functorch.is_functionaltensor(t):
        return torch._functionalize_has_data_mutation(t)
    return t._version


def _is_dense(t: torch.Tensor) -> bool:
    r"""Whether ``t`` is contiguous in a memory format (contiguous, channels-last, channels-last 3-D)."""
    if t.is_contiguous():
        return True
    if t.dim() not in (4, 5):
        return False
    try:
        return t.is_contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
    except RuntimeError:
        # (The batched tangents of ``torch._vmap_internals``' vmap -- ``autograd.functional.jacobian``'s
        # ``vectorize=True, strategy="forward-mode"``, gradcheck's ``check_batched_forward_grad`` --
        # answer for the contiguous format only: decided from the strides, which they do report.)
        from torch._prims_common import is_channels_last_contiguous  # (torch's own reading of the strides)

        return is_channels_last_contiguous(t)


try:  # (torch.cat's and ``preserve_format``'s choice, from the strides)
    from torch._prims_common import suggest_memory_format as _suggest_memory_format
except ImportError:  # pragma: no cover - an older torch
    def _suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
        if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
            return torch.channels_last
        if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
            return torch.channels_last_3d
        return torch.contiguous_format

# (Its reading of a shape and strides, without a tensor; None in an older torch.)
_strides_like_channels_last = getattr(getattr(torch, "_prims_common", None), "are_strides_like_channels_last_or_false",
                                      None)


def _dense_clone(part: torch.Tensor) -> torch.Tensor:
    r"""A copy of a member's slice, dense as a branch's own output would be: in the slice's memory format
    where it has one (channels-last), contiguous otherwise (``preserve_format`` keeps the strides of a
    slice that is dense but permuted -- an embedding looking up transposed indices -- which a branch
    called on its own would not return)."""
    # (One copy, its format decided first; channels-last 3-D too, a Conv3d's.)
    if _is_dense(part) or _functorch_active():
        # (Under torch.func transforms -- vmap, jacfwd -- clone takes no channels-last format:
        # "NYI: Tensor.clone(memory_format) inside vmap", raised for a channels-last input the
        # unfused branches take. There, the layout is vmap's own to choose.)
        return part.clone(memory_format=torch.preserve_format)
    memory_format = _suggest_memory_format(part)
    if (memory_format == torch.contiguous_format and part.dim() in (4, 5) and part.shape[0] == 1
            and _strides_like_channels_last is not None):
        # A batch of one may have any stride, and a member's slice of the channels layout
        # ([1, N * C, H, W], channels-last) has N * C there, less than its H's: read as
        # inner, it made the slice look contiguous, and its copy lost the channels-last
        # format the branch's own output has. Read as outermost, as in either format.
        # (From the strides alone: a view made for it would break a compiler's graph.)
        strides = (max(n * s for n, s in zip(part.shape, part.stride())), *part.stride()[1:])
        if _strides_like_channels_last(part.shape, strides):
            memory_format = torch.channels_last if part.dim() == 4 else torch.channels_last_3d
    return part.clone(memory_format=memory_format)


def _members(t: torch.Tensor, dim: int, n: int, copy: bool, received: _Received | None = None) -> list[torch.Tensor]:
    r"""``t``'s ``n`` slices along ``dim``: views, or dense copies of their own (in ``t``'s memory format;
    through :class:`_Split`, telling ``received``, where the call made one and autograd records them).

    Views of one tensor share its version counter: a member's output changed in
    place would make autograd refuse another's, saved by the caller's own graph
    (a frozen teacher's heads, one scaled in place), where unfused each has its
    own. Outside autograd's view (``t`` requires no grad) each view gets a
    counter of its own, by ``.data``; not while a compiler or torch.func traces
    it, nor under forward-mode AD (``.data`` drops a tangent), nor for
    inference tensors, which keep none, nor where ``t`` is a view of another
    tensor (a member returning its input, expanded by vmap), whose writes
    autograd must keep seeing.
    """
    if copy:
        if received is not None and t.requires_grad and torch.is_grad_enabled():
            split = _SplitDual if _forward_ad._current_level >= 0 else _Split
            return [split.apply(part, i, received) for i, part in enumerate(t.unbind(dim))]
        return [_dense_clone(t.select(dim, i)) for i in range(n)]
    if (_is_tracing() or t.requires_grad or _functorch_active() or _forward_ad._current_level >= 0
            or t.is_inference() or t._is_view()):  # (a compiler asks the first)
        return [t.select(dim, i) for i in range(n)]
    return [t.select(dim, i).data for i in range(n)]


_Get = Callable[[str], "torch.Tensor | None"]
_Step = Callable[[_Value, _Get], Any]


def _layers(m: nn.Sequential, prefix: str = "") -> list[tuple[str, nn.Module]]:
    r"""The modules ``m`` runs one after another and their names, nested ``Sequential`` s flattened (as
    :func:`_program` does)."""
    return [leaf for name, c in m._modules.items()
            for leaf in (_layers(c, _join(prefix, name)) if type(c) is nn.Sequential else [(_join(prefix, name), c)])]


def _flat_layers(template: nn.Module) -> list[nn.Module]:
    r"""The layers a member runs one after another: ``template``'s, flattened (:func:`_layers`), or itself."""
    return [c for _, c in _layers(template)] if type(template) is nn.Sequential else [template]


def _paired(m: nn.Module) -> bool:
    r"""Whether :func:`_program` pairs a ``Linear`` of ``m`` with the activation after it (in one ``Sequential``)."""
    if type(m) is not nn.Sequential:
        return False
    children = list(m._modules.values())
    return any(type(a) is nn.Linear and _batched_linear.activation(b) is not None
               for a, b in zip(children, children[1:])) or any(_paired(c) for c in children)


def _linear_shapes(layers: list[nn.Module]) -> list[tuple[int, int]] | None:
    r"""``(in_features, out_features)`` of each ``Linear`` in ``layers``, if the rest are pointwise; else ``None``."""
    if not any(type(m) is nn.Linear for m in layers) or not all(
            type(m) is nn.Linear or type(m) in _POINTWISE for m in layers):
        return None
    return [(m.in_features, m.out_features) for m in layers if type(m) is nn.Linear]


def _kernel_linear(v: _Value, w: torch.Tensor, b: torch.Tensor | None, n: int, code: int,
                   activation: Callable[[torch.Tensor], torch.Tensor] | None, last: bool) -> _Value:
    r"""A ``Linear`` layer (and the activation ``code`` after it) for every member, in one kernel.

    See :mod:`._batched_linear`. The kernel reads the members' ``[N, rows, in]``
    view of any layout as it lies and writes ``[N, rows, out]``, or, as the last
    layer of a ``cat`` join, the join's ``[rows, N * out]`` itself (see the
    ``Linear`` step of :func:`_program`). Should it fail to compile (or refuse
    the call, see :func:`._batched_linear.linear`), the layer is computed by
    ``baddbmm`` and ``activation`` (the module's ``forward``).
    """
    x = _to_stacked(v, n)
    rows, width = x.shape[1], w.shape[1]
    if last and _call.cat_joined:
        joined = x.new_empty((rows, n * width))
        out, result = joined.as_strided((n, rows, width), (width, n * width, 1)), _Value(joined, _CHANNELS)
    else:
        out = x.new_empty((n, rows, width))
        result = _Value(out, _STACKED)
    call = _call
    if (w.dtype != x.dtype or w.device != x.device  # (torch's layers refuse these as they would unfused)
            or b is not None and (b.dtype != x.dtype or b.device != x.device)
            or _batched_linear.linear(x, w, b, out, code, chained=bool(call.chained)) is None):
        y = _stacked_linear(x, w, b)
        out.copy_(y if activation is None else activation(y))
    if call.chained is not None:
        # The layers after the call's first may load their weights while the one before
        # runs: nothing the call launches writes a parameter (no grad: see kernel_layers;
        # the members' fused stacks as bound, unless restacked for the call: see _Group.run).
        call.chained = True
    return result


def _linear_step(group: _Group, prefix: str) -> _Step:
    r"""The batched step of the ``Linear`` at ``prefix`` in the template: see :func:`_program`."""
    n = group.n
    w_name, b_name = _join(prefix, "weight"), _join(prefix, "bias")
    # Views of the stacks, kept while the stacks are the same objects (no
    # grad: every call gets the stacks themselves), so that a call costs one
    # launch per layer and no view operations: eager fused calls are
    # CPU-bound, a view costing a third of a kernel launch.
    views: list[Any] = [None] * 6
    last = prefix == group.last  # the template's last layer

    def linear(v: _Value, get: _Get) -> _Value:
        call = _call  # (a thread-local: read once)
        w, b = get(w_name), get(b_name)
        if call.lone_kernels:
            return _kernel_linear(v, w, b, n, _batched_linear._NONE, None, last)
        t, layout = v.t, v.layout
        if views[0] is w and views[2] is b:
            wt, bias = views[1], views[3]
        elif w.requires_grad or b is not None and b.requires_grad:
            # Trained: views of the stacks made anew at every call (see _Group._stacked), which
            # _TrainedLinear takes as they are; the products below make theirs where they run.
            wt = bias = None
            if not _is_tracing():  # (a trace's stacks are its own; written, a guard of it would fail)
                views[:] = [None] * 6
        else:
            wt, bias = w.mT, None if b is None else b.unsqueeze(1)
            if not _is_tracing():
                views[:] = [w, wt, b, bias, None, None]
        fewer = call.fewer_kernels
        if (fewer or (last and call.cat_joined)) and layout == _SHARED and t.dim() == 2:
            # Every member reads the same rows: one product with the members' weights
            # one after another ([N * out, in]), the bias added in its epilogue -- one
            # kernel where a batched product needs two (the bias copied into the
            # output first), and member i's outputs come out as columns
            # i*out .. (i+1)*out: the channels layout, which a cat join reads as it is.
            # Eager, only as the last layer, where the cat join reads it (tiny8 on the
            # H100 machine: 22.5-31.6 against 46.5-72.3 us a call, tools/exp_fused_eager_ab.py):
            # a later batched product would read it through two view operations, and an
            # eager call is CPU-bound.
            if views[0] is w and views[4] is not None:
                return _Value(F.linear(t, views[4], views[5]), _CHANNELS)
            flat = w.flatten(0, 1), None if b is None else b.flatten()
            if views[0] is w:
                views[4:] = flat
            return _Value(F.linear(t, *flat), _CHANNELS)
        # Outside a capture, on CUDA, the last layer of a cat join over more than one
        # row: the product writes the concatenation itself (below). Not under functorch
        # transforms (vmap has no batching rule for ``out=``) or forward-mode AD (``out=``
        # refuses tangents); on the CPU the strided product costs more than the copy it saves.
        if (t.dim() == (3 if layout == _STACKED else 2)
                and (fewer or (last and call.cat_joined and t.is_cuda and t.shape[-2] > 1
                               and not _functorch_active() and _forward_ad._current_level < 0))
                and not (t.requires_grad or w.requires_grad or (b is not None and b.requires_grad))
                and not torch.is_autocast_enabled(t.device.type)):
            # Inference on one row vector per sample and member: the batched product
            # reads the [N, B, in] view of any layout as it is and writes the channels
            # layout directly, [B, N * out], where a contiguous [N, B, out] result
            # would cost a transposing copy before a cat join. (``out=`` allows no
            # autograd, and autocast leaves it in the input's dtype.)
            x = _to_stacked(v, n)
            if fewer and bias is not None:
                # The bias already in place (see _Prefill): the product accumulates onto it.
                prefill = _call.prefill
                assert prefill is not None
                out = prefill.filled(bias, x.shape[1], b_name).baddbmm_(x, wt)
                return _Value(out.transpose(0, 1).flatten(1), _CHANNELS)
            # One allocation and one view, where an eager cat join's copy (an allocation
            # and a launch) and a view stood: eager calls are CPU-bound. (``as_strided``:
            # one operation where ``view`` and ``transpose`` are two, 1.2 us apart on the
            # development machine's CPU.)
            rows, width = x.shape[1], wt.shape[-1]
            joined = t.new_empty((rows, n * width))
            out = joined.as_strided((n, rows, width), (width, n * width, 1))
            if bias is None:
                torch.bmm(x, wt, out=out)
            else:  # (the cat join's last layer, above: no prefill outside a capture)
                torch.baddbmm(bias, x, wt, out=out)
            return _Value(joined, _CHANNELS)
        if layout == _SHARED and t.dim() == 2:
            flat, lead = t.expand(n, -1, -1), None
        elif layout == _STACKED and t.dim() == 3:
            flat, lead = t, None
        elif layout == _SHARED:
            lead = t.shape[:-1]
            flat = t.reshape(-1, t.shape[-1]).expand(n, -1, -1)
        else:
            flat = _to_stacked(v, n)
            lead = flat.shape[1:-1]
            flat = flat.reshape(n, -1, flat.shape[-1])
        if (w.requires_grad and torch.is_grad_enabled() and flat.device.type in _OWN_LINEAR_BACKWARD
                and flat.dtype == w.dtype and not (_is_tracing() or _functorch_active()
                                                   or _forward_ad._current_level >= 0
                                                   or torch.is_autocast_enabled(flat.device.type))):
            out = _TrainedLinear.apply(flat, w, b)
        else:
            # (Trained, where _TrainedLinear is not taken, the views are made here: see above.)
            out = (_stacked_linear(flat, w, b) if wt is None
                   else torch.bmm(flat, wt) if bias is None else torch.baddbmm(bias, flat, wt))
        return _Value(out if lead is None else out.view(n, *lead, out.shape[-1]), _STACKED)

    return linear


def _stacked_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    r"""``N`` ``Linear`` layers at once: ``x`` ``[N, rows, in]``, their stacked weights ``[N, out, in]``
    and biases ``[N, out]``."""
    return torch.bmm(x, w.mT) if b is None else torch.baddbmm(b.unsqueeze(1), x, w.mT)


# Where fused ``Linear`` layers train through :class:`_TrainedLinear` (see there), not autograd's own.
_OWN_LINEAR_BACKWARD = ("cpu", "cuda")


class _TrainedLinear(torch.autograd.Function):
    r"""``baddbmm(b.unsqueeze(1), x, w.mT)`` (``bmm`` without a bias) for stacked weights ``w`` ``[N, out, in]``
    and biases ``b`` ``[N, out]``, whose backward lays the weights' gradient out as the weights are.

    Autograd's own gives the gradient of ``w.mT``, ``x.mT @ grad`` ``[N, in, out]``, so that
    of ``w`` is its transposed view; each member's slice of it (see :class:`_Unstack`)
    then fails the layout the accumulator keeps as ``.grad`` and is copied, a transposing
    copy per member and layer. Here ``grad.mT @ x`` is ``[N, out, in]`` contiguous, and
    every member keeps its slice as it is. Measured on a fused training step of 8 MLPs of
    four ``Linear(256, 256)``, batch 8: on the CPU the copies took about a third of its
    backward, and made it 0.8x the unfused step; on the H200 machine their 32 launches took
    10% of an eager step (5091 to 4568 us) and 5% of a graphed one (2348 to 2237 us;
    ``tools/exp_train_ab.py``). Other devices keep autograd's own, unmeasured. Not under
    autocast (the backward would meet the half-precision gradient with the float32 weight),
    forward-mode AD or functorch transforms (no rules here), nor while a compiler traces.
    Double backward differentiates the products below. The biases' gradient is a sum of
    its own, ``[N, out]``: returned for ``b.unsqueeze(1)``, it would reach :class:`_Unstack`
    as a view, which takes it for memory that is not the backward's own and copies it.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor,  # type: ignore[override]
                bias: torch.Tensor | None) -> torch.Tensor:
        # (Each only where the other's gradient needs it, as autograd's own node saves them: a weight
        # changed in place before the backward then fails it exactly where it fails unfused.)
        wants_x, wants_w, _ = ctx.needs_input_grad
        ctx.save_for_backward(x if wants_w else None, w if wants_x else None)
        ctx.bias = bias is not None
        ctx.set_materialize_grads(False)  # (no gradient came: none goes on, as autograd's own node does)
        return _stacked_linear(x, w, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple:  # type: ignore[override]
        if grad is None:
            return None, None, None
        x, w = ctx.saved_tensors
        wants_x, wants_w, wants_bias = ctx.needs_input_grad
        # (Conjugated, as autograd's own: complex members' gradients. A real tensor's
        # ``conj()`` is the tensor itself, a complex one's a lazy view that bmm reads.)
        return (torch.bmm(grad, w.conj()) if wants_x else None,
                torch.bmm(grad.mT, x.conj()) if wants_w else None,
                grad.sum(1) if ctx.bias and wants_bias else None)


def _program(group: _Group, m: nn.Module, prefix: str, then: tuple[nn.Module, str, int] | None = None
             ) -> list[_Step]:
    r"""The batched steps that compute submodule ``m`` (at ``prefix`` in the template) for every member.

    Built once per group (again where a setting that chose a step is set anew, see
    :func:`_made_anew`), so that a call does no module-type dispatch or name
    formatting: each step has its parameters' qualified names baked in.
    ``then``: for a ``Linear``, the activation module that follows it, its
    name and its code in :mod:`._batched_linear`, applied by the same step
    (in the kernel's epilogue where the kernel runs).
    """
    if type(m) is nn.Sequential:
        steps: list[_Step] = []
        children = list(m._modules.items())
        i = 0
        while i < len(children):
            name, child = children[i]
            after = children[i + 1] if i + 1 < len(children) else None
            code = _batched_linear.activation(after[1]) if after is not None and type(child) is nn.Linear else None
            if code is not None:
                steps += _program(group, child, _join(prefix, name), (after[1], _join(prefix, after[0]), code))
                i += 2
            else:
                steps += _program(group, child, _join(prefix, name))
                i += 1
        return steps
    n = group.n
    # (The group keeps its steps: one holding the group would make a cycle, freed by the collector
    # only, the members' parameters with it, where a plain model is freed at ``del``.)
    this = weakref.ref(group)
    q = lambda name: _join(prefix, name)  # noqa: E731
    fallback = _vmapped_step(group, m, prefix)
    # (The steps below read the first member's settings -- a stride, an eps -- at every call,
    # as its own ``forward`` would: the program is kept for the group's life, and a setting
    # changed alike in every member after its first call (``model.apply`` setting eps) would
    # otherwise be seen by the plain branches only. A few attribute reads per layer and call;
    # one found changed compares the members, see _watched: set on the first alone, it is
    # not taken for every member's.)
    # ATen's instance norm saves a copy of its weight, repeated for each sample, unfused as
    # under vmap: a change in place after the forward pass reaches neither backward. (Not
    # where a subclass's forward of its own may read the weight itself.)
    # (Sets read, not written, under a trace: see _Group.)
    if q("weight") in group.entries:
        if type(m).forward is nn.modules.instancenorm._InstanceNorm.forward:
            if q("weight") not in group.never_saved:
                group.never_saved.add(q("weight"))
        elif type(m).forward is nn.RMSNorm.forward and not _rms_norm_saves_weight(m.weight):
            # (The CPU's composite: a product, which saves the weight for the input's gradient.)
            if q("weight") not in group.saved_with_input:
                group.saved_with_input.add(q("weight"))
        elif isinstance(m, _SAVES_WEIGHT) and q("weight") not in group.saved_always:
            group.saved_always.add(q("weight"))

    # (Dropout: only in eval or with p=0, see _unfusable; and only torch's own forward: a
    # subclass's, an MC dropout drawing its masks in eval, is vmapped as any module.)
    if type(m) in _POINTWISE or type(m).forward in _STOCK_DROPOUT:
        # ``forward`` itself: fused members have no hooks (see _unfusable), and
        # ``Module.__call__`` costs as much CPU as the launch it wraps.
        forward = m.forward
        if isinstance(m, _FEATURE_DROPOUTS):
            # F.dropout1d/2d/3d check (and warn about) their input's dimensions: a member's,
            # one fewer than the stack's. Here (eval, or p=0) they return their input itself.
            # They read the number of dimensions only: one they take without a warning is not
            # checked (slicing a member out of the stack and the call cost more host time than
            # the step itself, as a batch norm's check: see below); others warn, as the
            # branches do, at every call, or raise.
            quiet = next(d for c, d in _QUIET_DROPOUT_DIMS.items() if isinstance(m, c))

            def feature_dropout(v: _Value, get: _Get) -> _Value:
                if v.layout != _STACKED:
                    return _Value(forward(v.t), v.layout)
                if v.t.dim() - 1 not in quiet:
                    forward(v.t[0])
                return v

            return [feature_dropout]
        return [lambda v, get: _Value(forward(v.t), v.layout)]

    if type(m) is nn.Linear:
        if q("weight") not in group.saved_with_input:  # (read, not written, under a trace: see _Group)
            group.saved_with_input.add(q("weight"))
        linear = _linear_step(group, prefix)
        if then is None:
            return [linear]
        activation, code, last = then[0].forward, then[2], then[1] == group.last
        w_name, b_name = q("weight"), q("bias")
        # (GELU's approximation, which chose the epilogue's code, is read at every call, as the
        # layer's forward reads it: set anew alike on every member, the code is chosen anew.)
        gelu = then[0] if type(then[0]) is nn.GELU else None
        approximate = None if gelu is None else gelu.approximate

        def linear_activation(v: _Value, get: _Get) -> _Value:
            nonlocal code, approximate
            if _call.kernels:
                if gelu is not None and gelu.approximate != approximate:
                    _refuse_set_apart(this(), then[1])  # (not traced: kernels are off there)
                    approximate = gelu.approximate
                    code = _batched_linear.activation(gelu)
                return _kernel_linear(v, get(w_name), get(b_name), n, code, activation, last)
            out = linear(v, get)
            return _Value(activation(out.t), out.layout)

        return [linear_activation]

    if type(m) in (nn.Conv1d, nn.Conv2d, nn.Conv3d) and m.padding_mode == "zeros":
        nd = len(m.kernel_size)
        conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
        w_name, b_name = q("weight"), q("bias")
        settings = _watched(this, prefix, lambda: (m.stride, m.padding, m.dilation, m.groups))

        def convolution(v: _Value, get: _Get) -> Any:
            if m.padding_mode != "zeros":  # (set since: the input padded by the layer's own forward)
                return _made_anew(this(), m, prefix)(v, get)
            if _member_dims(v) != nd + 2:  # an unbatched input: no channel layout to batch in
                return fallback(v, get)
            stride, padding, dilation, groups = settings()
            w, b = get(w_name), get(b_name)
            if v.layout == _SHARED and groups == 1:
                x, g = v.t, 1  # members' weights side by side: one convolution, N * C_out channels
            else:
                x, g = _to_channels(v, n), groups * n
            out = conv(x, w.flatten(0, 1), None if b is None else b.flatten(), stride, padding, dilation, g)
            return _Value(out, _CHANNELS)

        return [convolution]

    if type(m).forward is _BatchNorm.forward:  # eval mode with running statistics (see _unfusable)
        # (torch's own forward: a subclass's of its own is vmapped as any module.)
        names = [q(k) for k in ("running_mean", "running_var", "weight", "bias")]
        if not group.buffers_saved.issuperset(names[:2]):  # (saved by its backward: the input's gradient reads them)
            group.buffers_saved.update(names[:2])

        # The layer's own check of a member's dimensions (BatchNorm2d takes 4-D inputs only),
        # which F.batch_norm below, taking any, would not make. torch's layers read only the
        # number of dimensions: checked once per number, since a member's slice costs 1.5 us
        # of host time per call (a subclass's own check runs at every call).
        check, passed = m._check_input_dim, set()
        stock = type(m)._check_input_dim in _STOCK_DIM_CHECKS
        eps = _watched(this, prefix, lambda: m.eps)

        def batch_norm(v: _Value, get: _Get) -> Any:
            dims = _member_dims(v)
            if dims < 2:
                return fallback(v, get)
            if dims not in passed:
                check(v.t[0] if v.layout == _STACKED else v.t)
                if stock:
                    passed.add(dims)
            mean, var, w, b = (None if t is None else t.flatten() for t in map(get, names))
            return _Value(F.batch_norm(_to_channels(v, n), mean, var, w, b, False, 0.0, eps()), _CHANNELS)

        return [batch_norm]

    if type(m) is nn.LayerNorm:
        w_name, b_name = q("weight"), q("bias")
        settings = _watched(this, prefix, lambda: (m.normalized_shape, m.eps))

        def layer_norm(v: _Value, get: _Get) -> _Value:
            shape, eps = settings()
            if v.layout != _SHARED and _member_dims(v) < len(shape):
                # On the stack, [N, *value], a shape longer than a member's value would take in
                # the members' dimension (where it begins with N) and normalize across them, as
                # vmap's rule does (torch 2.13 checks the stack's shape, not a member's): the
                # branches' own error, from one member's value.
                F.layer_norm(_to_stacked(v, n)[0], shape, None, None, eps)
            x = v.t if v.layout == _SHARED else _to_stacked(v, n)
            w, b = get(w_name), get(b_name)
            if w is None and b is None:
                return _Value(F.layer_norm(x, shape, None, None, eps), _SHARED if v.layout == _SHARED else _STACKED)
            if not _layer_norm_dtypes(x, w, b):
                # Dtypes layer_norm refuses, which the product below would promote: its own error,
                # from one row.
                F.layer_norm(x.new_zeros(shape), shape, None if w is None else w[0], None if b is None else b[0], eps)
                return fallback(v, get)
            # The affine part per member: weights [N, *shape] broadcast over the batch dimensions.
            # In float32 and rounded once to layer_norm's output dtype, as layer_norm does it:
            # half-precision members normalize in float32, and under autocast float32
            # weights would otherwise promote the result.
            # (So too under the CPU's autocast, which leaves layer_norm alone: a bfloat16 input
            # -- a Linear's output there -- normalized in bfloat16 was rounded twice, up to 1.35
            # times the unfused error. CUDA's autocast runs layer_norm in float32: nothing to round.)
            half = x.dtype in (torch.float16, torch.bfloat16) and not (
                x.device.type != "cpu" and torch.is_autocast_enabled(x.device.type))
            out = F.layer_norm(x.float() if half else x, shape, None, None, eps)
            dtype = x.dtype if half else out.dtype
            if out.dtype in (torch.float16, torch.bfloat16):  # (not float64, which float32 would round)
                out = out.float()
            lead = (1,) * (out.dim() - len(shape) - (0 if v.layout == _SHARED else 1))
            if w is not None:
                out = out * w.view(n, *lead, *shape)
            if b is not None:
                out = out + b.view(n, *lead, *shape)
            return _Value(out.to(dtype), _STACKED)

        return [layer_norm]

    if type(m) in _POOLING and not getattr(m, "return_indices", False):
        # Channel by channel: a shared value stays shared, a channels layout stays valid.
        nd = int(type(m).__name__[-2])  # MaxPool2d: 2

        def pool(v: _Value, get: _Get) -> Any:
            if v.layout == _SHARED:
                return _Value(m(v.t), _SHARED)
            if _member_dims(v) != nd + 2:
                # An unbatched value (C, *spatial): in the channels layout the members'
                # values would be one signal, and windows would cross from one to the next.
                return fallback(v, get)
            return _Value(m(_to_channels(v, n)), _CHANNELS)

        return [pool]

    if type(m) is nn.Embedding and m.max_norm is None and not m.scale_grad_by_freq:
        # One ``F.embedding`` on the members' tables one after another ([N * rows, dim]),
        # member i's indices offset by i * rows: traceable by torch.export, where
        # exporting vmap's embedding fails, and with ``F.embedding``'s backward, which
        # sums a row's gradients in float32 in a fixed order (``index_select``'s sums
        # in the weights' dtype with atomics: bfloat16 gradients 50x further off on
        # the H100, and not the same from one run to the next). The indices are the
        # members' own: one out of range is out of range of the whole table for the
        # last member (too large) or the first (negative), and raises as unfused.
        w_name = q("weight")
        if w_name not in group.never_saved:
            group.never_saved.add(w_name)

        padding = _watched(this, prefix, lambda: m.padding_idx)

        def embedding(v: _Value, get: _Get) -> Any:
            if m.scale_grad_by_freq:  # (set since: counted per member by the layer's own forward)
                return _made_anew(this(), m, prefix)(v, get)
            padding_idx = padding()
            if (v.layout != _SHARED or padding_idx is not None and _forward_ad._current_level >= 0
                    or v.t.dtype not in (torch.int32, torch.int64)):
                # Each member's own indices, or forward-mode AD (whose padding row keeps its
                # tangent, which the ``detach`` below would drop): vmap's rule. (So too indices
                # of a dtype the layer refuses, which the offsets' int64 would promote.)
                return fallback(v, get)
            idx, w = v.t, get(w_name)
            rows = w.shape[1]  # (the tables' own: resized through .data alike, a setting would be stale)
            offsets = torch.arange(0, n * rows, rows, device=idx.device).view(n, *(1,) * idx.dim())
            out = F.embedding(idx + offsets, w.flatten(0, 1))
            if padding_idx is not None and out.requires_grad:
                # The padding row gets no gradient, as ``F.embedding(..., padding_idx)`` gives it none.
                out = torch.where((idx == padding_idx).unsqueeze(-1), out.detach(), out)
            return _Value(out, _STACKED)

        return [embedding]

    if (type(m) is nn.EmbeddingBag and m.max_norm is None and not m.scale_grad_by_freq
            and m.padding_idx is None):
        # As ``Embedding`` above: one ``F.embedding_bag`` on the members' tables one after
        # another, member i's bags of indices offset by i * rows. vmap has no batched rule
        # for embedding_bag: torch looped over the members, warning of it at every call.
        # (Fused calls take one tensor, so no offsets and no per-sample weights: 2-D bags.
        # A padding index would be one row per member, which embedding_bag takes one of.)
        w_name = q("weight")
        if w_name not in group.never_saved:  # (its backward reads the table's size only)
            group.never_saved.add(w_name)

        mode = _watched(this, prefix, lambda: m.mode)

        def embedding_bag(v: _Value, get: _Get) -> Any:
            if m.scale_grad_by_freq or m.padding_idx is not None:
                # (Set since: see above. A max_norm set groups the branches anew: see _Fusion.)
                return _made_anew(this(), m, prefix)(v, get)
            if v.layout != _SHARED or v.t.dim() != 2 or v.t.dtype not in (torch.int32, torch.int64):
                return fallback(v, get)  # (and the layer's own error for 1-D bags without offsets)
            idx, w = v.t, get(w_name)
            rows = w.shape[1]
            offsets = torch.arange(0, n * rows, rows, device=idx.device).view(n, 1, 1)
            out = F.embedding_bag((idx + offsets).flatten(0, 1), w.flatten(0, 1), mode=mode())
            return _Value(out.view(n, idx.shape[0], w.shape[-1]), _STACKED)  # (an empty batch too)

        return [embedding_bag]

    if type(m) is nn.Flatten:
        settings = _watched(this, prefix, lambda: (m.start_dim, m.end_dim))

        def flatten(v: _Value, get: _Get) -> _Value:
            start_dim, end_dim = settings()
            if v.layout == _SHARED:
                return _Value(m(v.t), _SHARED)
            dims = _member_dims(v)
            if not (-dims <= start_dim < dims and -dims <= end_dim < dims):
                # A dim beyond a member's value (or a 0-d one): on the stack, [N, *value], a
                # negative one would reach into the members' dimension and flatten them
                # together. vmap's rule raises the branches' own IndexError.
                return fallback(v, get)
            start, end = (start_dim + 1 if start_dim >= 0 else start_dim), (end_dim + 1 if end_dim >= 0 else end_dim)
            return _Value(_to_stacked(v, n).flatten(start, end), _STACKED)

        return [flatten]

    return [fallback]


# vmap returns tensors only. A structured output's other leaves (``(out, None)``, as
# ``nn.MultiheadAttention(need_weights=False)`` returns) are the same for every member
# -- the module's Python runs once for all -- so a vmapped step hands vmap the tensors
# and keeps the structure here, per thread, with _TENSOR where the tensors go. (A
# module-level ``threading.local``: dynamo traces its attributes, not its creation.)
_structure = threading.local()
_TENSOR = object()


class _Running(threading.local):
    r"""Per thread: whether a vmapped step is running its members' call (see :func:`_vmapped_step`)."""

    now = False


class _Batching(threading.local):
    r"""Per thread: the device type of the input that a vmapped step's batched call runs on, else ``None``;
    and the message of an autocast refused inside it (see :func:`_watch_autocast`), or :data:`_CHECKPOINTED`
    where a checkpoint was entered in it (see :func:`_watch_checkpoint`), else ``None``."""

    device: str | None = None
    refused: str | None = None


_batching = _Batching()


@_watch._once
def _watch_autocast() -> None:
    r"""Make an autocast entered inside a vmapped step's batched call raise :class:`_AutocastEntered`.

    Wrapped once per process, as ``_watch`` wraps torch's registrations. A
    member's ``forward`` entering autocast itself (``with torch.autocast(...)``,
    or as a decorator) is not seen before the call, as the caller's autocast is;
    batched, its layers would return another dtype than its own call (see
    :class:`_UnbatchedNow`). Raised before autocast is entered, as a failure
    of the batched call (see :class:`_AutocastEntered`).
    """
    cls = torch.amp.autocast_mode.autocast
    enter = cls.__enter__

    @functools.wraps(enter)
    def __enter__(self: Any) -> Any:
        device = _batching.device
        if device is not None and self.device == device and getattr(self, "_enabled", False):
            # (Kept too: a member that catches the error runs on without autocast.)
            _batching.refused = (f"a member enters {self.device} autocast in its forward: batched, its "
                                 f"layers would return another dtype than its own call")
            raise _AutocastEntered(_batching.refused)
        return enter(self)

    cls.__enter__ = __enter__


@_watch._once
def _watch_checkpoint() -> None:
    r"""Make a ``torch.utils.checkpoint(use_reentrant=False)`` entered with grad enabled inside a vmapped
    step's batched call fail that call with :class:`_CheckpointEntered` where its outputs require grad.

    Its saved-tensor hooks recompute the member's function in the backward pass,
    outside vmap, on the member's unbatched tensors: the backward failed with
    torch's ``CheckpointError`` (other shapes than the forward's) at every call,
    ``fuse="auto"`` included. Noted as it is entered, judged after the call (see
    :func:`_vmapped_step`): outputs that require no grad have no backward to
    recompute anything (frozen members called with grad on), and run batched as
    they did. (A reentrant checkpoint is refused by vmap itself, an
    ``autograd.Function`` without ``setup_context``.) As :func:`_watch_autocast`,
    wrapped once per process.
    """
    import torch.utils.checkpoint  # (imported by torch 2.13 itself, not necessarily by every torch)

    cls = getattr(torch.utils.checkpoint, "_checkpoint_hook", None)
    if cls is None:  # pragma: no cover - another torch
        return
    enter = cls.__enter__

    @functools.wraps(enter)
    def __enter__(self: Any) -> Any:
        if _batching.device is not None and torch.is_grad_enabled() and _batching.refused is None:
            # (Noted, not raised: raising here refused members that nothing trains, whose
            # outputs need no backward. An autocast refused in the same call takes precedence.)
            _batching.refused = _CHECKPOINTED
        return enter(self)

    cls.__enter__ = __enter__


class _MembersChanged(RuntimeError):
    r"""A member's parameter or buffer no longer matches the others' since the group was found.

    Set to ``None`` (``module.bias = None``) or deleted, which registers nothing
    (see ``_watch``): the block groups its branches anew from its next call.
    """


def _holds_tensors(value: Any) -> bool:
    r"""Whether ``value``, an output leaf that is no tensor, holds tensors in its fields (a dataclass,
    or another object whose attributes :mod:`torch.utils._pytree` does not flatten)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    else:
        fields = list(getattr(value, "__dict__", {}).values())
    return any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(fields))


class _UnbatchedNow(Exception):
    r"""Raised by a vmapped step that cannot batch this call: the group's members run unfused for it.

    Under autocast, ``torch.vmap`` decomposes layers it has no batching rule for
    below autocast: a ``Linear`` with a bias becomes a product that autocast
    casts and an addition of the float32 bias that promotes it back, so the
    batched call returns float32 where the members' own calls return the
    autocast dtype. And layers with an inference-only fast path
    (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` in ``eval()``)
    decide on it by asking whether their weights require grad, which the
    members' weights, stacked and batched by vmap, do not show: the batched call
    would take a path autograd cannot differentiate.
    """


class _AutocastEntered(RuntimeError):
    r"""Raised where a member enters autocast inside a vmapped step's batched call (see :func:`_watch_autocast`).

    A failure of the group, as an operation vmap cannot batch is, not of the
    call (the caller's autocast, :class:`_UnbatchedNow`): what a member's
    ``forward`` does, it does at every call. ``fuse="auto"`` runs the group
    unfused from then on, where trying it batched first at every call cost a
    call of 8 small members about 1.5x the unfused call on the development
    machine's CPU; ``fuse=True`` refuses it, naming it.
    """


# What a checkpoint entered inside a vmapped step's batched call leaves in ``_batching.refused`` (see
# _watch_checkpoint): a failure of the call only where its outputs require grad. (Told apart by identity.)
_CHECKPOINTED = ("a member calls torch.utils.checkpoint(use_reentrant=False) in its forward: its backward would "
                 "recompute the member outside the batched call")


class _CheckpointEntered(_AutocastEntered):
    r"""Raised where a member enters a non-reentrant checkpoint inside a vmapped step's batched call with
    grad enabled and the call's outputs require grad (see :func:`_watch_checkpoint`): a failure of the
    group, as :class:`_AutocastEntered`."""


# Layers that take an inference-only path when they see no tensor requiring grad (see _UnbatchedNow).
_FAST_PATHS = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)

# Layers whose backward saves their weight whenever anything requires grad: the input's
# gradient reads it (a convolution's kernel, a norm's scale, PReLU's slopes). Unfused,
# autograd refuses a backward after such a weight changed in place, frozen or not.
# (Not a stock instance norm's, which saves a copy: see _program.)
_SAVES_WEIGHT = (nn.modules.conv._ConvNd, _BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.LayerNorm,
                 nn.GroupNorm, nn.PReLU, nn.RMSNorm)


def _class_name(cls: type) -> str:
    r"""``cls``'s module and qualified name, and where it was made if they are shared (a class made in a function)."""
    return f"{cls.__module__}.{cls.__qualname__} (at {id(cls):#x})"


# Whether ``F.rms_norm`` saves its weight whatever requires grad, by device type and dtype
# (see _rms_norm_saves_weight).
_RMS_SAVES: dict[tuple[str, torch.dtype], bool] = {}


def _layer_norm_dtypes(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    r"""Whether ``F.layer_norm`` takes ``x`` with weight ``w`` and bias ``b`` as their dtypes are.

    The same dtype; on the CPU also a half-precision input with float32 affine
    parameters (its kernels' mixed dtypes). CUDA's autocast runs layer_norm in
    float32, casting every tensor but float64 ones first; the CPU's leaves it alone.
    """
    dtypes = [t.dtype for t in (x, w, b) if t is not None]
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        dtypes = [d if d == torch.float64 else torch.float32 for d in dtypes]
    rest = set(dtypes[1:])
    return rest == {dtypes[0]} or (x.device.type == "cpu" and dtypes[0] in (torch.float16, torch.bfloat16)
                                   and rest == {torch.float32})


def _rms_norm_saves_weight(weight: torch.Tensor) -> bool:
    r"""Whether ``F.rms_norm`` with ``weight``'s device and dtype saves the weight for backward
    whenever anything requires grad, as :data:`_SAVES_WEIGHT` layers do.

    Torch runs a fused kernel on some devices (CUDA's), whose backward reads the
    weight for either gradient, and a composite elsewhere (the CPU's), whose
    product saves the weight for the input's gradient alone: there a weight
    changed in place before backward passes where the input needs no gradient.
    Asked of autograd once, on a tiny call, rather than assumed: the choice
    belongs to the build. Where it cannot be asked (a tracer's fake tensors,
    saved-tensor hooks that hide what autograd saved), the weight is taken to
    be saved, as by a fused kernel, and asked again next time.
    """
    key = (weight.device.type, weight.dtype)
    saves = _RMS_SAVES.get(key)
    if saves is None:
        if _is_tracing() or _functorch_active() or _dispatch_modes() or weight.is_cuda and _capture_underway():
            return True  # (nothing to run a real call on, or one that would be recorded)
        try:
            with torch.inference_mode(False), torch.enable_grad():
                w = torch.ones(2, device=weight.device, dtype=weight.dtype, requires_grad=True)
                out = F.rms_norm(torch.ones(1, 2, device=weight.device, dtype=weight.dtype), (2,), w)
                saved = _saved_storages([out.grad_fn])
                if saved is None or out.grad_fn is None:
                    return True  # (saved-tensor hooks hide what was saved: asked again next time)
                saves = w.untyped_storage().data_ptr() in saved
        except Exception:
            return True
        _RMS_SAVES[key] = saves
    return saves


def _vmappable_layout(t: torch.Tensor, batch: int) -> torch.Tensor:
    r"""``t`` with each member's sample contiguous where it is an image batch of another layout
    (channels last, say); ``batch``: 0 for the members' common input, 1 for a stack of theirs.

    Under vmap such a sample reaches the members' layers with strides no unbatched tensor has.
    On CUDA, batch norm asks whether its input is channels last, which vmap cannot answer
    (torch 2.11: "NYI: querying is_contiguous inside of vmap"), and the group would run
    unfused for good over the layout of one call. On the CPU, ATen's batch norm backward
    misreads a batch of one so laid out (torch 2.13, strides ``(8, 1, 28, 4)`` of a
    ``(1, 4, 4, 7)`` input): the members' gradients came out wrong, silently. A copy of the
    input avoids both; a stack read as N copies of one sample stays so.
    """
    sample = t if batch == 0 else t[0]
    if sample.dim() not in (4, 5) or sample.is_contiguous():
        return t
    if batch and t.stride(0) == 0:
        return sample.contiguous().expand(t.shape)
    return t.contiguous()


def _made_anew(group: _Group, m: nn.Module, prefix: str) -> _Step:
    r"""For a layer whose batched step no longer applies, a setting that chose it set anew since the
    group's steps were made (``conv.padding_mode = "reflect"``): the layer run through vmap for this
    call, and the group's steps made anew at its next call (a trace's own are made for it)."""
    if not _is_tracing():
        _refuse_set_apart(group, prefix)
        group.program = None
    return _vmapped_step(group, m, prefix)


def _watched(group: Callable[[], _Group | None], prefix: str, read: Callable[[], Any]) -> Callable[[], Any]:
    r"""``read`` (the first member's settings that a step reads at every call, see :func:`_program`), which
    compares the members (see :func:`_refuse_set_apart`) whenever its value is not the one it last had.
    ``group``: a weak reference to the group (see :func:`_program`)."""
    seen = read()

    def settings() -> Any:
        nonlocal seen
        now = read()
        if now != seen:
            if not _is_tracing():
                _refuse_set_apart(group(), prefix)
            seen = now
        return now

    return settings


def _refuse_set_apart(group: _Group | None, prefix: str) -> None:
    r"""Raise :class:`_MembersChanged` where a member's layer at ``prefix`` no longer matches the first
    member's, whose setting a step found set anew since it last looked.

    The steps read the first member's settings for every member: set on it alone,
    it would be taken for all. Asked only where a step sees one changed, so that
    a call costs nothing more; one set on another member alone is not seen (see
    the README's limits). Not while a compiler traces, which compares the members
    itself (see :meth:`_Fusion.current`).
    """
    if group is None:  # (its steps outlive it only while a caller still holds them)
        return
    first = group.template.get_submodule(prefix)
    for name, member in zip(group.names[1:], group.members[1:]):
        diff = _difference(first, member.get_submodule(prefix), prefix, tensors=False)
        if diff is not None:
            raise _MembersChanged(f"the branches are no longer identical: in branch {name!r}, {diff}, set on "
                                  f"branch {group.names[0]!r} since the group's first call")


def _vmapped_step(group: _Group, m: nn.Module, prefix: str) -> _Step:
    r"""Any other module: :func:`torch.vmap` of :func:`torch.func.functional_call` over the stacks."""
    quals = [q for q in group.entries if q.startswith(prefix + ".")] if prefix else list(group.entries)
    local = [(q[len(prefix) + 1:] if prefix else q, q) for q in quals]
    n, this = group.n, weakref.ref(group)  # (not the group itself: see _program)
    # ``functional_call`` writes the stacks into ``runner``'s dicts for the call and puts its
    # tensors back after: two threads would read, and put back, each other's. (Per layer: the
    # blocks of other threads run on. A compiler tracing the steps it makes for its trace
    # copies nothing and takes no lock: its graph runs no module, and one trace at a time.)
    tracing = _is_tracing()
    runner = m if tracing else _own_dicts(m)
    settings = None if tracing else _Settings(m, runner)
    lock = contextlib.nullcontext() if tracing else threading.Lock()
    running = None if tracing else _Running()  # whether this thread is inside this step's call (see step)

    # The runner's parameter and buffer dicts, and the entries in them no stack gives (a buffer
    # registered as None, which ``forward`` sets at its first call: a mask, a lazily made table).
    dicts = [(path, sub, d) for path, sub in runner.named_modules() for d in (sub._parameters, sub._buffers)]
    unset = [(d, k, _join(path, k)) for path, _, d in dicts for k, t in d.items() if t is None]
    # The buffers its ``forward`` may resize in place (see _Group.follow_resized): a layer without
    # any, as most are, looks at no shape on its calls.
    resizable = [k for k, q in local if group.entries[q].kind == "_buffers"]

    def call(state: dict[str, torch.Tensor], x: torch.Tensor, kept: list | None = None) -> Any:
        given = dict(state)
        sizes = [len(d) for _, _, d in dicts]
        out = torch.func.functional_call(runner, state, (x,), tie_weights=False, strict=False)
        # A tensor assigned in forward (``self.avg = ...``, not ``self.avg.mul_(...)``) is
        # written back into ``state`` and the stacked one put back in the module: the
        # members would silently keep their old tensors. Refused: the group runs unfused.
        changed = [k for k, t in given.items() if state.get(k) is not t]
        # So too one assigned to a parameter or buffer that was None, or registered in forward,
        # which functional_call leaves in the runner's own dicts: the members' stayed None (or
        # missing), and with them their state dicts' entries. (Put back: the runner would hold a
        # tensor of vmap's, and see no None at the next call.)
        for d, k, name in unset:
            if d.get(k) is not None:
                changed.append(name)
                d[k] = None
        for (path, sub, d), size in zip(dicts, sizes):
            for k in list(d)[size:] if len(d) != size else ():
                changed.append(_join(path, k))
                del d[k]
                sub.__dict__.get("_non_persistent_buffers_set", set()).discard(k)
        if changed:
            raise RuntimeError(
                f"{type(m).__name__} assigns a new tensor to {changed[0]!r} in forward, which a batched "
                f"call cannot hand back to each branch; update it in place instead (`self.buf.add_(1)`, "
                f"`self.buf.copy_(new)`), registering it with a tensor in __init__ where it starts as None")
        # (Set by every call, not only where leaves are no tensors: a member calling its own
        # block runs other steps inside this one's call, which may have set it.)
        leaves, spec = ([out], None) if isinstance(out, torch.Tensor) else pytree.tree_flatten(out)
        if kept is None:
            _structure.value = None
            # Which of the tensors the member returned are its input itself, the object. vmap
            # expands them alike with views of it (``x.view_as(x)``, ``x[:]``): only the
            # member's own call tells them apart (see _vmapped_input).
            _structure.itself = [leaf is x for leaf in leaves if isinstance(leaf, torch.Tensor)]
        subclass = None
        if spec is not None or type(out) is not torch.Tensor:  # (one plain tensor, the common case: none)
            subclass = next((leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and _overrides_ops(type(leaf))),
                            None)
        if subclass is not None:
            # vmap hands back a plain tensor in its place: the caller would lose the class
            # (and whatever its __torch_function__ does to later operations).
            raise RuntimeError(
                f"{type(m).__name__} returns a tensor of subclass {type(subclass).__name__}, which a batched "
                f"call hands back as a plain torch.Tensor; return plain tensors (`.as_subclass(torch.Tensor)`) "
                f"and make the subclass after the block, or use fuse=False")
        if spec is None:
            return out
        if all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            return out
        # (Values kept by value -- None, numbers, strings, enum members -- hold no tensors: not looked
        # into, which Dynamo cannot trace for all of them under torch 2.11: ``hasattr(NoneType, ...)``
        # under a strict export, ``hasattr`` of an enum member under ``fullgraph=True``.)
        held = next((leaf for leaf in leaves if not isinstance(leaf, (torch.Tensor, enum.Enum, *_BY_VALUE))
                     and _holds_tensors(leaf)), None)
        if held is not None:
            # An object pytree does not look into (a dataclass) passes out of vmap as it is, with
            # the batched tensors inside it: they would reach the caller unbatched and dead.
            raise RuntimeError(
                f"{type(m).__name__} returns an object of type {type(held).__name__} holding tensors, which a "
                f"batched call cannot split per branch; return tensors or tuples, lists or dicts of them, or "
                f"register the class with torch.export.register_dataclass")
        iterator = next((leaf for leaf in leaves if isinstance(leaf, collections.abc.Iterator)), None)
        if iterator is not None:
            # Likewise an iterator (a generator), whose tensors no field shows: and being one object,
            # read once, it would be handed to every branch, the first taking all it yields.
            raise RuntimeError(
                f"{type(m).__name__} returns a {type(iterator).__name__}, which a batched call cannot split per "
                f"branch; return tensors or tuples, lists or dicts of them (`tuple(...)` of what it yields)")
        # (Without the tensors, which must not leave vmap unbatched.)
        structure = (spec, [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])
        if kept is None:
            _structure.value = structure
        else:
            kept.append(structure)
        return tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))

    _watch_autocast()
    _watch_checkpoint()
    fast_paths = [sub for sub in m.modules() if isinstance(sub, _FAST_PATHS)]
    mixed_kernel = isinstance(m, (nn.GroupNorm, nn.modules.instancenorm._InstanceNorm))
    shared = torch.vmap(call, in_dims=(0, None))
    stacked = torch.vmap(call, in_dims=(0, 0))

    def step(v: _Value, get: _Get) -> Any:
        if torch.is_autocast_enabled(v.t.device.type):
            raise _UnbatchedNow("autocast is on: batched, layers would return another dtype than each "
                                "member's own call")
        state = {k: t for k, t in ((k, get(q)) for k, q in local) if t is not None}
        if mixed_kernel and v.t.is_floating_point() and any(
                t.is_floating_point() and t.dtype != v.t.dtype for t in state.values()):
            # A group or instance norm kept in float32 under bfloat16 activations: ATen's kernel
            # returns the input's dtype, where vmap's decomposition promotes to the weights'.
            # (See _UnbatchedNow. Other layers promote as vmap does, or refuse alike.)
            raise _UnbatchedNow("a group or instance norm with weights of another dtype than its input: "
                                "batched, it would return another dtype")
        if (fast_paths and torch.is_grad_enabled() and not all(sub.training for sub in fast_paths)
                and (v.t.requires_grad or any(t.requires_grad for t in state.values()))):
            raise _UnbatchedNow("an attention layer in eval() with grad enabled: batched, it would take its "
                                "inference fast path, which autograd cannot differentiate")
        tracing = _is_tracing()
        guard = None if tracing else running
        if guard is not None and guard.now:
            # A member calling the block it is a member of (recursion on a smaller input) reaches
            # this step again inside its own call, which holds the lock and the runner's dicts:
            # the inner call runs the members unfused (waiting on the lock, it would wait forever).
            raise _UnbatchedNow("a member called the block again inside its own call")
        kept: list | None = None
        if tracing:
            # The structure of the outputs goes into a list made here, in the trace: written
            # into the module-level thread-local, it was a side effect of the traced forward,
            # which a strict torch.export warned of (and a compiler would guard on).
            kept = []
            run = torch.vmap(functools.partial(call, kept=kept), in_dims=(
                0, None if v.layout == _SHARED and state else 0))
        else:
            _structure.value = _structure.itself = None
            run = shared if v.layout == _SHARED and state else stacked
        refused = None
        # (A layer may resize a buffer in place: see _Group.follow_resized.)
        shapes = None if tracing or not resizable else [
            (t, t.shape) for t in (state.get(k) for k in resizable) if t is not None]
        with contextlib.nullcontext() if tracing else lock:  # (see runner; a program made eagerly may be traced)
            if settings is not None and not tracing and settings.follow():  # (a program made eagerly traced: as made)
                _refuse_set_apart(this(), prefix)
            if guard is not None:
                guard.now = True
                batching, _batching.device = _batching.device, v.t.device.type
                outer, _batching.refused = _batching.refused, None
            try:
                if v.layout == _SHARED and state:
                    out = run(state, _vmappable_layout(v.t, 0))
                else:
                    # (Without parameters or buffers nothing else is batched, and vmap needs a batched
                    # input: the members' common input is read as N stacked copies, without copying.)
                    out = run(state, _vmappable_layout(_to_stacked(v, n), 1))
            finally:
                if guard is not None:
                    guard.now = False
                    _batching.device = batching
                    refused, _batching.refused = _batching.refused, outer
        if shapes and any([t.shape != shape for t, shape in shapes]):
            group = this()
            if group is not None:
                group.follow_resized()
        if refused is _CHECKPOINTED:
            if any([t.requires_grad for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]):
                raise _CheckpointEntered(refused)
        elif refused is not None:
            # A member caught the error of the autocast it entered (``except RuntimeError``, to run
            # without it) and ran on batched, in another dtype than its own call: a failure all the same.
            raise _AutocastEntered(refused)
        if state and not tracing:  # (traced, the stacks are made in the graph: nothing to alias)
            out = _own_memory(out, state)
        itself = None if tracing else _structure.itself
        if isinstance(out, torch.Tensor):
            return _Value(out, _STACKED) if tracing else _vmapped_input(out, v, itself[0])
        structure = _structure.value if kept is None else kept[-1] if kept else None
        if structure is not None:  # put the batched tensors back among the other leaves
            spec, leaves = structure
            tensors = iter(out)
            out = pytree.tree_unflatten(
                [next(tensors) if leaf is _TENSOR else leaf for leaf in leaves], spec)
        if itself is not None and any(itself) and v.layout == _SHARED and not _functorch_active():
            # The outputs that are the members' common input itself (``(out, x)``), marked here, where
            # the member's own call told them apart from views of it (see _inputs_returned).
            leaves, spec = pytree.tree_flatten(out)
            returned = iter(itself)
            out = pytree.tree_unflatten([_Input(v.t) if isinstance(leaf, torch.Tensor) and next(returned) else leaf
                                         for leaf in leaves], spec)
        return out

    step.vmapped = True  # type: ignore[attr-defined]  # (see _Group._after_step)
    return step


class _Settings:
    r"""The settings of a layer and its submodules (see :func:`_hyperparameters`), as a copy made of it by
    :func:`_own_dicts` holds them: set anew on the layer (``norm.eps = 1e-3``, alike on every member), they
    are set on the copy before its next call, as the layer's own ``forward`` would read them.

    Those the copy's ``forward`` assigns itself stay the copy's while the layer's
    own are not set anew. One C comparison of the values held a call (about 25 ns
    a setting); one added to the layer later is not looked at.
    """

    __slots__ = ("sources", "keys", "copies", "values")

    def __init__(self, m: nn.Module, runner: nn.Module) -> None:
        self.sources: list[dict] = []
        self.keys: list[str] = []
        self.copies: list[dict] = []
        pairs = [(m, runner)]
        while pairs:
            source, copied = pairs.pop()
            for k in _hyperparameters(source):
                self.sources.append(source.__dict__)
                self.keys.append(k)
                self.copies.append(copied.__dict__)
            pairs += [(c, copied._modules[name]) for name, c in source._modules.items() if c is not None]
        self.values = list(map(dict.get, self.sources, self.keys))

    def follow(self) -> bool:
        r"""Set on the copy the settings set anew on the layer since the last call (one deleted: deleted);
        whether one was."""
        if all(map(operator.is_, map(dict.get, self.sources, self.keys), self.values)):
            return False
        for i, (source, k, copied, value) in enumerate(zip(self.sources, self.keys, self.copies, self.values)):
            now = source.get(k, _GONE)
            if now is not value:
                if now is _GONE:
                    copied.pop(k, None)
                else:
                    copied[k] = now
                self.values[i] = now
        # (A deleted one: _GONE, never found by dict.get again, would be set at every call.)
        kept = [i for i, v in enumerate(self.values) if v is not _GONE]
        if len(kept) != len(self.values):
            self.sources, self.keys, self.copies, self.values = (
                [xs[i] for i in kept] for xs in (self.sources, self.keys, self.copies, self.values))
        return True


_GONE = object()


def _own_dicts(m: nn.Module) -> nn.Module:
    r"""``m`` with parameter, buffer and submodule dicts (and set of non-persistent buffers) of its own, and so
    its submodules; all else shared.

    ``torch.func.functional_call`` writes the stacks into the dicts of the module
    it runs for the call: those of the template layer -- the first member's own
    -- would show them to another thread calling that member directly (a branch
    left unfused, the user's own code) while the call runs. Every other
    attribute is the template's own object (a table the members share, a mask
    changed in place); settings set anew on ``m`` later are set on the copy by
    :class:`_Settings`.
    """
    runner = copy.copy(m)
    d = runner.__dict__
    d["_parameters"], d["_buffers"] = dict(m._parameters), dict(m._buffers)
    if "_non_persistent_buffers_set" in d:  # (register_buffer(..., persistent=...) in forward writes it)
        d["_non_persistent_buffers_set"] = set(d["_non_persistent_buffers_set"])
    d["_modules"] = {name: None if c is None else _own_dicts(c) for name, c in m._modules.items()}
    return runner


def _own_memory(out: Any, state: dict[str, torch.Tensor]) -> Any:
    r"""``out``'s tensors, each copied where it shares memory with a stacked tensor of ``state``.

    A member returning its parameter or buffer (learned queries), or a view of
    it, gives the stack itself, which holds every member's tensor: joined by
    ``cat`` or ``stack`` along the stacked dimension, the block's output would be
    that memory, changed by an in-place operation on it (and, while autograd
    records, a view it refuses to change), where unfused the join makes a new
    tensor. (The vmapped path only: the batched rules compute new tensors.)
    """
    stacks = {_watch._sharable_address(t) for t in state.values()} - {0}

    def own(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and _watch._sharable_address(t) in stacks:
            return t.clone()
        return t

    return own(out) if isinstance(out, torch.Tensor) else pytree.tree_map(own, out)


class _Input:
    r"""A leaf of a vmapped group's structured value that the members share (see :func:`_inputs_returned`).

    ``views=False``: the group's input ``t``, which every member returned itself, handed to each
    member as the input itself. ``views=True``: ``t`` is vmap's expansion over the members of views
    of the group's input the members made (``x.view(...)``, ``x.detach()``), handed to each member as
    a view of its own (a slice of ``t``), of the input's memory, as each gets unfused.
    """

    __slots__ = ("t", "views")

    def __init__(self, t: torch.Tensor, views: bool = False) -> None:
        self.t, self.views = t, views

    def split(self, n: int) -> list[torch.Tensor]:
        return [self.t.select(0, i) for i in range(n)] if self.views else [self.t] * n


def _expands(t: torch.Tensor, x: torch.Tensor) -> bool:
    r"""Whether ``t`` is ``x`` expanded along a new leading dimension of members (vmap's output for members
    returning their unbatched input, or a view of it alike): same memory, shape, strides and history as ``x``.

    (An alias made by the member -- ``x.detach()``, whose result requires no grad -- is not ``x``. Nor
    anything without memory -- the meta device's tensors, empty ones -- whose address says nothing.)
    """
    return (t.dim() == x.dim() + 1 and t.stride(0) == 0 and t.data_ptr() == x.data_ptr() != 0
            and t.shape[1:] == x.shape and t.stride()[1:] == x.stride() and t.requires_grad == x.requires_grad
            and t.dtype == x.dtype)


def _vmapped_input(out: Any, v: _Value, itself: bool) -> Any:
    r"""A vmapped step's tensor ``out`` as a value of its own; the step's shared input ``v`` itself where
    every member returned it (``itself``: a member that is an identity of the user's), see :meth:`_Group._run`.

    A view of it alike (``x.view_as(x)``, ``x[:]``), which vmap expands as it expands ``x``, is read as
    one shared value for the next layer too, but not as ``x``: unfused, such a member returns a tensor of
    its own, a view of ``x``, which a caller comparing by identity (``out is x``) tells apart.
    """
    if v.layout == _SHARED and itself:
        return v
    if v.layout == _SHARED and not _functorch_active() and _expands(out, v.t):
        return _Value(out.select(0, 0), _SHARED)
    return _Value(out, _STACKED)


def _expanded(t: torch.Tensor) -> bool:
    r"""Whether stacked ``t`` holds one value for every member: vmap's expansion of a value the members'
    call computed once, from no tensor of a member's own (stride 0 along the members)."""
    return t.dim() > 0 and t.stride(0) == 0


def _views_of(t: torch.Tensor, x: torch.Tensor) -> bool:
    r"""Whether stacked ``t`` is one value for every member in the memory of the group's input ``x``: the
    expansion of views of ``x`` that the members made."""
    return _expanded(t) and _watch._sharable_address(t) == _watch._sharable_address(x) != 0


def _inputs_returned(value: Any, x: torch.Tensor, n: int) -> Any:
    r"""A vmapped group's structured ``value`` with each leaf the members share marked as :class:`_Input`: the
    group's input ``x`` where the members returned it itself (``(out, x)``, marked by the step as such),
    views of it where they returned views of it.

    (A leaf the step marked as a shared value of the group's other than ``x`` -- the members' input
    to their last layer, computed once for all -- is expanded back: unfused, each member returns a
    tensor of its own, which :func:`_split` copies for each.)
    """
    tree = value.tree if type(value) is _Structured else value
    leaves, spec = pytree.tree_flatten(tree)
    plain = not _functorch_active() and type(x) is torch.Tensor

    def mark(leaf: Any) -> Any:
        if type(leaf) is _Input and not leaf.views:
            if leaf.t is x:
                return leaf
            leaf = leaf.t.expand(n, *leaf.t.shape)
        if plain and isinstance(leaf, torch.Tensor) and _views_of(leaf, x):
            return _Input(leaf, views=True)
        return leaf

    marked = [mark(leaf) for leaf in leaves]
    if all(a is b for a, b in zip(marked, leaves)):
        return value
    tree = pytree.tree_unflatten(marked, spec)
    return value._replace(tree=tree) if type(value) is _Structured else tree


# ------------------------------------------------------- a module's fusion
class _Unfused(list):
    r"""The outputs of a group's members run one by one, after running them batched failed.

    Told apart from a batched value that is itself a list (the stacked outputs of
    members that return lists).
    """


class _Fusion:
    r"""The fused groups of one ``Parallel`` and why its other branches are not fused.

    Found when the branches are set (see ``Parallel._prepare_fusion``) and
    again when a submodule's train/eval mode changed (:meth:`current`).

    ``units`` lists what a call runs, in order: a branch index (run as usual)
    or a :class:`_Group`. ``scatter`` puts their outputs back in branch order.
    """

    def __init__(self, owner: str, names: list[str], branches: list[nn.Module], required: bool,
                 serial: int = -1) -> None:
        _watch._install()
        self.names = names
        self.branches = tuple(branches)  # (see grouped_from)
        # (Read before the hook dicts are: a hook registered by another thread while they are
        # read moves it after, and the next call looks at them again.)
        handles = getattr(_Handle, "next_id", None)
        groups, self.reasons = _groups(branches)
        # (One branch, or none, is identical to itself: it runs as it is.)
        if required and len(branches) > 1 and (len(groups) != 1 or len(groups[0]) != len(branches)):
            raise ValueError(_required_error(owner, names, branches, self.reasons))
        self.groups = [_Group(g, [names[i] for i in g], [branches[i] for i in g],
                              [b for i, b in enumerate(branches) if i not in g], owner) for g in groups]
        # Grouping depended on these submodules' train/eval modes (BatchNorm,
        # dropout, modules run through vmap): a call that finds one changed
        # (``branch.train()`` called directly) finds the groups anew.
        self.modes = [(m, m.training) for branch in branches for _, m in _moded(branch)]
        # Whether a branch holds a module compiled on its own (see Parallel._traced_fusion).
        self.compiled = any([_compiled(m) for branch in branches for m in branch.modules()])
        # And on settings that decide whether a layer may run batched at all (see _unfusable):
        # a dropout's ``p`` raised from 0 (a dropout schedule), an embedding given a ``max_norm``
        # or made sparse. Set in place, they register nothing; batched, the members would share
        # one dropout mask, or skip the renormalization. (Of every branch, as the modes are: one
        # left out for its dropout's rate fuses once the rate is lowered to 0.)
        self.settings = [(m, s) for branch in branches for m in branch.modules()
                         for s in (_fusable_settings(m),) if s is not None]
        # Hooks registered on a fused member after grouping would not run: the hook
        # dicts of every module of every fused member, which must stay empty. (About
        # 2 us a call for eight 4-layer MLPs. Hooks registered for the whole process
        # leave the groups as they are: calls run them unfused while they are there,
        # see parallel._held_by_hooks.)
        self.hooks = [d for g in self.groups for member in g.members for d in _hook_dicts(member)]
        self.handles = handles  # the hook dicts are looked at when it moves
        # Branches left out for their hooks (an uninitialized lazy layer's own initializing one
        # too): grouped anew once they are gone.
        self.hooked = [_hook_dicts(branches[i]) for i, why in self.reasons.items()
                       if "hooks" in why or "uninitialized lazy" in why]
        # The fused members' module trees: a layer replaced since (``block[0][1] = nn.ReLU()``,
        # as adapter and quantization tools do) is seen eagerly by ``_watch``'s count of
        # registrations, which a compiler must not read (see :meth:`current`).
        self.trees = [(member, tuple(member.modules())) for g in self.groups for member in g.members]
        # And the names of their parameters and buffers, which a tensor registered since
        # (``register_buffer`` on one member) changes: seen eagerly by the same count.
        self.registered = [(d, tuple(d)) for _, modules in self.trees for m in modules
                           for d in (m._parameters, m._buffers)]
        # The instance dicts of the fused members' modules, where a ``forward`` replaced
        # on an instance (a monkeypatch, accelerate's ``add_hook_to_module``) shows, and an
        # entry hiding a registered tensor (see _hidden_by_instance).
        self.instances = [vars(m) for _, modules in self.trees for m in modules]
        self.differ: bool | None = None  # the members compared again, at the first call (see forward_replaced)
        self.serial = serial  # (the block's number, for a trace's comparison of the members: see _differs)
        self.while_swapped = False  # found from tensors swapped in for a call (see Parallel._new_fusion)
        self._rebuild()

    def grouped_from(self, branches: Iterable[nn.Module]) -> bool:
        r"""Whether ``branches`` (a block's children now) are, one by one, the branches grouped here.

        Asked while a compiler traces, which cannot read the count of registrations
        that tells an eager call of a branch replaced, added or removed since.
        """
        now = tuple(branches)
        if len(now) != len(self.branches):
            return False
        for a, b in zip(now, self.branches):
            if a is not b:
                return False
        return True

    def forward_replaced(self) -> bool:
        r"""Whether a fused member's ``forward`` was replaced on its instance since grouping (or an instance
        attribute hides one of its registered tensors or submodules: see :meth:`_forward_patched`), or, the first
        time this is asked, whether a member no longer matches its group's first (a hyperparameter set in
        place between the block's construction and its first call: ``branch[1].negative_slope = 0.5``).

        Looked at when a call's schedule is chosen and when a graph is
        captured, not on every call: for eight 4-layer MLPs the first costs about
        2 us on the development machine's CPU, a measurable part of a fused call,
        and comparing the members' layers 0.6 ms. (Not their tensor attributes,
        which a ``forward`` may set for itself -- a cache of rotary tables --
        and which no member has yet before its first call.)
        """
        if self._forward_patched():
            return True
        if self.differ is None:  # (kept: asked again under the lock, the answer must hold)
            self.differ = _members_differ(self)
        return self.differ

    def current(self) -> bool:
        r"""Whether the grouping still holds: no submodule's train/eval mode changed, no hook registered on
        a member nor removed from a branch left out for it."""
        if _is_tracing():
            # The hook dicts themselves: a compiler would guard on the process-wide counter's
            # value, and recompile whenever a hook anywhere is registered. And the members'
            # layers themselves, for the same reason: a group traced with a layer replaced
            # since it was found would run the old layer for every member. (A compiler
            # guards on the modules it reads: replaced later, the block is traced anew.) And a
            # ``forward`` replaced on a member's instance (a monkeypatch, accelerate's
            # ``add_hook_to_module``), which eager calls see as they choose a signature's
            # schedule (see forward_replaced): traced fused, the members ran the class's. And the
            # members compared (see _members_differ): a hyperparameter set in place on one since
            # grouping (``branch[1][1].negative_slope = 0.5``) is seen eagerly by the block's first
            # call (see forward_replaced), which a trace before it never made: traced fused, every
            # member ran the first's setting. (Compared at every trace: traces are rare.)
            if (any(self.hooks) or not self._same_trees() or not self._same_tensors_registered()
                    or self._forward_patched() or _members_differ(self)):
                return False
        else:
            handles = getattr(_Handle, "next_id", 0)
            if handles != self.handles:  # a hook registered somewhere: on a member?
                if any(self.hooks):
                    return False
                self.handles = handles
        return (all(m.training == mode for m, mode in self.modes) and all(map(any, self.hooked))
                and (not self.settings or all([_fusable_settings(m) == s for m, s in self.settings])))

    def _same_trees(self) -> bool:
        r"""Whether every fused member holds the modules it held when grouped."""
        for member, modules in self.trees:
            now = tuple(member.modules())
            if len(now) != len(modules) or any([a is not b for a, b in zip(now, modules)]):
                return False
        return True

    def _forward_patched(self) -> bool:
        r"""Whether a fused member module's ``forward`` was replaced on its instance (see ``instances``), or an
        instance attribute hides one of its registered tensors or submodules (see :func:`_hidden_by_instance`)."""
        return any(["forward" in d or _hidden_by_instance(d) for d in self.instances])

    def _same_tensors_registered(self) -> bool:
        r"""Whether every module of the fused members holds parameters and buffers of the names it held when
        grouped (a member's own, registered since, is run by none of the batched steps)."""
        for d, names in self.registered:
            if tuple(d) != names:
                return False
        return True

    def _rebuild(self) -> None:
        grouped = {i: g for g in self.groups for i in g.indices}
        units: list[Any] = []
        seen: set[int] = set()
        for i in range(len(self.names)):
            g = grouped.get(i)
            if g is None:
                units.append(i)
            elif id(g) not in seen:
                seen.add(id(g))
                units.append(g)
        self.units = units

    def disable(self, group: _Group, error: BaseException) -> None:
        r"""Run ``group``'s members as ordinary branches from now on, recording why."""
        why = f"running them batched failed: {type(error).__name__}: {error}"
        for i in group.indices:
            self.reasons[i] = why
        self.groups = [g for g in self.groups if g is not group]
        self._rebuild()

    def scatter(self, units: list[Any], outputs: list[Any]) -> Any:
        r"""Outputs per unit (of ``units``, this call's) -> outputs per branch, in branch order."""
        if len(units) == 1 and isinstance(outputs[0], _Value):
            return _Joined(outputs[0], len(self.names))  # one group of every branch, in order
        result: list[Any] = [None] * len(self.names)
        for unit, out in zip(units, outputs):
            if isinstance(unit, _Group):
                if type(out) is not _Unfused:  # batched, not the members' own outputs
                    out = _split(out, unit.n)
                for i, o in zip(unit.indices, out):
                    result[i] = o
            else:
                result[unit] = out
        return result

    def report(self) -> dict[str, Any]:
        return {
            "fused": [[self.names[i] for i in g.indices] for g in self.groups],
            "unfused": {self.names[i]: why for i, why in sorted(self.reasons.items())},
        }


def _members_differ(fusion: _Fusion) -> bool:
    r"""Whether a member of one of ``fusion``'s groups no longer matches the group's first, tensor
    attributes aside (see :meth:`_Fusion.forward_replaced`)."""
    if torch.compiler.is_compiling():
        return _differs(fusion.serial)
    if _jit_tracing():  # (after is_compiling: see _streams._is_tracing)
        # torch.jit.trace runs every group unfused (see parallel._traced_unfused): nothing to
        # compare, and it would record the comparison's reads of parameter shapes, refusing
        # those of a member no longer in the block (a branch replaced since) as constants.
        return False
    return _compared(fusion)  # (eagerly, this fusion itself: maybe not yet the block's)


def _compared(fusion: _Fusion) -> bool:
    r"""Whether a member of one of ``fusion``'s groups differs from the group's first, tensor attributes aside."""
    return any([_difference(g.template, member, tensors=False) is not None
                for g in fusion.groups for member in g.members[1:]])


# Every live block by its number (see _differs), which its fusions carry.
_blocks: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
_serials = itertools.count()


def _numbered(block: nn.Module) -> int:
    r"""A new number for ``block`` (made or copied), by which :func:`_differs` finds it."""
    serial = next(_serials)
    _blocks[serial] = block
    return serial


@torch.compiler.assume_constant_result
def _differs(serial: int) -> bool:
    r"""Whether a member of a group of the fusion numbered ``serial`` differs from its group's first, tensor
    attributes aside.

    Marked constant for Dynamo, which cannot trace the comparison (``extra_repr``
    strings, ``is_inference``): it runs it as Python while it traces and keeps the
    answer, as eager calls keep their first call's, guarding on none of the
    attributes compared. Given the block's number, not the fusion or its modules:
    Dynamo before torch 2.13 takes only constants as such a function's arguments,
    and a number of the fusion's own would change at every regrouping (a
    ``load_state_dict(assign=True)``), each a recompilation. (Other tracers run it
    as Python.)
    """
    fusion = getattr(_blocks.get(serial), "_fusion", None)
    return fusion is not None and _compared(fusion)


def _required_error(owner: str, names: list[str], branches: list[nn.Module], reasons: dict[int, str]) -> str:
    first = 0
    lines = []
    if first in reasons and not reasons[first].startswith("no other branch is identical to it"):
        lines.append(f"branch {names[first]!r} cannot be fused: {reasons[first]}")
    for i, b in enumerate(branches[1:], 1):
        why = _unfusable(b)
        if why is not None:
            lines.append(f"branch {names[i]!r} cannot be fused: {why}")
            continue
        diff = _difference(branches[first], b)
        both = _mode_and_tensor_apart(branches[first], b) if diff is not None else None
        if both is not None:  # (both named: the first alone would be fixed, then the other found)
            diff = f"{both[0]}; and, alike otherwise, {both[1]}"
        if diff is not None:
            lines.append(f"branch {names[i]!r} differs from branch {names[first]!r}: {diff}")
        elif i in reasons:  # identical, but not fusable with the others (shared parameters)
            lines.append(f"branch {names[i]!r} cannot be fused: {reasons[i]}")
    return (
        f"{owner}: fuse=True needs every branch to be structurally identical and fusable, but\n  "
        + "\n  ".join(lines)
        + "\nMake the branches identical (same layers, sizes, dtypes, devices and modes), or pass "
        "fuse='auto' to fuse the identical groups and run the rest on streams, or fuse=False."
    )
