r"""What a call receives: its device, its signature, and errors that name a branch."""

from __future__ import annotations

import numbers
import operator
import sys
from typing import Any, Hashable, Iterable

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__: list[str] = []


def _integer(value: Any) -> int | None:
    r"""``value`` as the ``int`` it is, where it is an integer: an ``int``, a NumPy integer, or a 0-dim
    integer tensor (as ``torch.cat``'s ``dim`` and ``torch.tensor_split``'s sections take them); ``None``
    for anything else.

    The one rule of the integer settings (``dim``, ``chunks``, ``max_graphs``) and counts
    (``record_timeline``'s): kept as an ``int``, which JSON and a graph's key hold. ``bool``
    is refused, though Python counts it an ``int``: ``chunks=True`` is a mistake, not 1.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return operator.index(value)
    if (isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool
            and not (value.is_floating_point() or value.is_complex() or value.is_meta)):  # (meta: no value)
        return operator.index(value)
    return None


def _leaves(args: tuple, kwargs: dict) -> list[Any]:
    if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
        return [args[0]]
    return pytree.tree_leaves((args, kwargs))


# Non-tensor inputs keyed by value in a signature.
_BY_VALUE = (int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format, numbers.Number)


def _input_device(args: tuple, kwargs: dict) -> torch.device | None:
    r"""The device of the first tensor among the inputs, or ``None``.

    A 0-dim CPU tensor is passed over for a later tensor: PyTorch lets such
    scalars join tensors of any device.
    """
    if args and isinstance(args[0], torch.Tensor):
        device = args[0].device  # (a new object at each read)
        if device.type != "cpu" or args[0].dim():
            return device
    return _leaf_device(_leaves(args, kwargs))


def _leaf_device(leaves: list[Any]) -> torch.device | None:
    r""":func:`_input_device` of inputs flattened to ``leaves``."""
    first = None
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.device.type != "cpu" or leaf.dim():
                return leaf.device
            if first is None:
                first = leaf.device
    return first


_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _signature(args: tuple, kwargs: dict, training: bool, floats: bool = True) -> Hashable:
    r"""A hashable key for everything about a call that may change how it runs.

    Shapes, dtypes, devices, strides (contiguity decides kernels),
    ``requires_grad`` and the subclass, if any, of every tensor input, the structure of the inputs, the
    values of numbers, strings, dtypes and devices among them (a compiled
    engine bakes them in) and the types of other non-tensor inputs, the
    module's train/eval mode and whether autograd is recording.
    ``floats=False``: floats by type only, for a key of what schedules a call
    (a scale or a diffusion timestep changing at every call would otherwise
    make every call a new signature, never scheduled, and its trials fill the
    tuner's table).
    """
    grad = torch.is_grad_enabled()
    if (not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor and args[0].layout is torch.strided
            and not args[0].is_nested):
        # (Dense only: a sparse COO tensor has strides of its own, (0, 0) for a matrix, as an
        # expanded dense one may; the general path keys sparse layouts and their sizes.)
        x = args[0]
        return (x.shape, x.stride(), x.dtype, x.device, x.requires_grad, grad, training)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts: list[Hashable] = [spec, grad, training]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_nested:
            # (A strided nested tensor has no one shape: the shapes of its components.)
            parts.append(("nested", leaf.layout, tuple(t.shape for t in leaf.unbind()), leaf.dtype, leaf.device,
                          leaf.requires_grad))
        elif isinstance(leaf, torch.Tensor):
            # (A sparse layout by its count of stored values; others without strides, MKL-DNN's, by layout.)
            layout = (leaf.stride() if leaf.layout == torch.strided else (leaf.layout, leaf._nnz())
                      if leaf.layout in _SPARSE_LAYOUTS else (leaf.layout,))
            key = (leaf.shape, layout, leaf.dtype, leaf.device, leaf.requires_grad)
            # A subclass (a parameter, a __torch_function__ wrapper) may run other code
            # and return its own type: a graph captured for plain tensors must not replay for it.
            parts.append(key if type(leaf) is torch.Tensor else (*key, type(leaf)))
        elif isinstance(leaf, _BY_VALUE) and (floats or not _inexact(leaf)):
            parts.append(_value_key(leaf))
        else:
            parts.append(type(leaf))
    return tuple(parts)


def _grad_and_training(signature: Hashable) -> tuple[bool, bool]:
    r"""Whether autograd recorded, and whether the module was training, in a call of ``signature`` (see
    :func:`_signature`)."""
    if isinstance(signature[0], torch.Size):  # (shape, stride, dtype, device, requires_grad, grad, training)
        return signature[5], signature[6]
    return signature[1], signature[2]  # (spec, grad, training, *leaves)


def _value_key(value: Any) -> Hashable:
    r"""A non-tensor argument as a key: by type and value.

    The type too, since ``1``, ``True`` and ``1.0`` are equal and hash alike;
    floats by their exact bits, since ``0.0 == -0.0`` (``1 / x`` differs) and
    ``nan != nan`` (a fresh NaN would never find its key again). So are
    numpy's ``float32`` and ``float16`` scalars, which are no ``float`` but
    compare as one, and the parts of a complex number; a ``Fraction`` that
    no float holds exactly is keyed by its value (it has neither).
    """
    if isinstance(value, float):
        return (type(value), float.hex(value))
    if _inexact(value):
        if isinstance(value, numbers.Real):
            f = float(value)
            if f != f or f == value:
                return (type(value), float.hex(f))
        else:
            z = complex(value)
            return (type(value), (float.hex(z.real), float.hex(z.imag)))
    return (type(value), value)


def _inexact(value: Any) -> bool:
    r"""Whether ``value`` is a number that is not an integer: a float, numpy's, a complex."""
    # (The common arguments asked nothing more: an isinstance of numbers' abstract classes cost an int
    # 0.55 us on the development machine's CPU, at every call keying a graph or a schedule on it.)
    return (type(value) not in _EXACT and isinstance(value, numbers.Complex)
            and not isinstance(value, numbers.Integral))


_EXACT = frozenset((int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format))


def _module_devices(module: nn.Module) -> set[torch.device]:
    # (Set displays, not ``set.update(generator)``: dynamo records consuming a generator as a mutation
    # of its iterator and keeps that record, holding the tracer and so the module, in a reference cycle
    # after the trace -- a compiled block would be freed only by the cyclic collector, not at del.)
    return {p.device for p in module.parameters()} | {b.device for b in module.buffers()}


def _check_devices(owner: str, names: Iterable[str], children: Iterable[nn.Module], device: torch.device) -> None:
    r"""Refuse inputs on another device than the parameters.

    Caught here, once per input signature, the error can name the branch; left
    to the first kernel, it would say only "Expected all tensors to be on the
    same device". (Branches on several devices never get here: ``_placement``
    runs them.)
    """
    seen: dict[torch.device, str] = {}
    for name, child in zip(names, children):
        for d in _module_devices(child):
            seen.setdefault(d, name)
    for d, name in seen.items():
        if d.type != device.type or (d.index is not None and device.index is not None and d.index != device.index):
            raise RuntimeError(
                f"{owner}: the input is on {device} but branch {name!r} has parameters on {d}. "
                f"Move the input with x.to({str(d)!r}) or the module with .to({str(device)!r})."
            )


# (PyTorch 2.3 and later; before, any compiler's trace.)
_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def _with_context(error: BaseException, context: str) -> BaseException:
    r"""Add ``context`` (which module, which branch) to an exception raised inside a branch.

    The exception keeps its type and its ``args``, so ``except`` clauses and
    code reading the exception (a ``KeyError``'s key, an ``OSError``'s errno)
    still work: Python 3.11+ shows the context as a note under the traceback.
    Python 3.10 shows no notes: there ``__notes__`` is set as 3.11 would, and the
    context is also appended to the message of an exception whose only argument
    is its message (not a ``KeyError``'s key, whose ``str`` is its ``repr``).
    An exception that takes no note (a frozen dataclass, a ``__notes__`` that
    is not a list) goes on as raised. (Not while Dynamo traces: ``torch.compile``
    or strict ``torch.export``.)
    """
    if _dynamo_compiling():
        # Dynamo cannot trace ``add_note`` and would report that instead of the
        # user's exception: the exception goes on as raised. (Not is_compiling(),
        # also true under non-strict torch.export, which runs this Python as it is:
        # there the note names the branch as in an eager call.)
        return error
    try:
        if sys.version_info >= (3, 11):
            error.add_note(context)
            return error
        notes = getattr(error, "__notes__", None)
        if notes is None:
            notes = error.__notes__ = []
        if not isinstance(notes, list):
            return error
        notes.append(context)
        if (len(error.args) == 1 and isinstance(error.args[0], str) and not isinstance(error, KeyError)
                and type(error).__str__ is BaseException.__str__):
            error.args = (f"{error.args[0]}\n{context}",)
    except (AttributeError, TypeError):  # (its attributes cannot be set: the user's exception matters more)
        pass
    return error


# Schedules kept per block (one per input signature), and signatures seen unwritten.
_MAX_PLANS = 1024


def _bounded_add(seen: dict[Hashable, Any], key: Hashable, value: Any = None,
                 limit: int | None = None) -> Hashable | None:
    r"""Set ``seen[key]``, dropping the oldest entries beyond ``limit`` (by signature: dynamic shapes make many);
    the key dropped last, if one was (one, unless other threads added at once).

    ``None``: :data:`_MAX_PLANS`, read at the call (tests lower it)."""
    limit = _MAX_PLANS if limit is None else limit
    dropped = None
    if key not in seen:  # (a key set anew takes no more room: nothing goes)
        # Down to the limit, not one key per add: threads adding at once may each drop the same
        # oldest key and add their own, and the table would keep every such extra key for good.
        while len(seen) >= limit:
            try:
                oldest = next(iter(seen))
            except StopIteration:  # (emptied by another thread meanwhile)
                break
            except RuntimeError:  # (changed by another thread between ``iter`` and ``next``)
                continue
            seen.pop(oldest, None)  # (another thread may have dropped the same one)
            dropped = oldest
    seen[key] = value
    return dropped


def _put_back(kept: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
    r"""Write each buffer's copy back into it (``kept``: pairs of a buffer and its copy, or ``None``)."""
    if kept:
        with torch.no_grad():
            for b, saved in kept:
                if b.is_inference() and not torch.is_inference_mode_enabled():
                    continue  # (not writable here, so not written by what ran either)
                if b.shape != saved.shape:  # (grown in place: resize_)
                    b.resize_(saved.shape)
                b.copy_(saved)
