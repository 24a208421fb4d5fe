r"""How :class:`~parallel_modules.Parallel` combines its branches' outputs.

A join runs on the caller's stream after every branch has been joined into it.
Named joins work leaf by leaf when branches return (nested) tuples, lists or
dicts of tensors of the same structure; ``"sum"`` and ``"mean"`` add the
outputs left to right, exactly as ``a(x) + b(x) + c(x)`` would, so the result
is bit-for-bit the one of the sequential expression.
"""

from __future__ import annotations

import functools
import reprlib
from typing import Any, Callable, Iterable, Sequence, Union

import torch
from torch import nn
from torch.fx import _symbolic_trace
from torch.utils import _pytree as pytree

from ._inputs import _dynamo_compiling, _with_context
from ._streams import _graph_state, _hold_join_gradients, _is_tracing, _recorded

__all__: list[str] = []

JoinSpec = Union[str, None, Callable[[list], Any]]

_NAMED_JOINS = ("cat", "stack", "sum", "mean", "tuple", "dict")


def _check_join(owner: str, join: JoinSpec) -> str | Callable[[list], Any]:
    r"""Validate ``join`` at construction; ``None`` means ``"tuple"``."""
    if join is None:
        return "tuple"
    if isinstance(join, torch.nn.Module) and (any(True for _ in join.parameters()) or any(True for _ in join.buffers())):
        raise ValueError(
            f"{owner}: join={type(join).__name__}(...) has parameters or buffers, but a join is called, not "
            f"registered: the block's state_dict holds only its branches (the keys of an nn.ModuleList of "
            f"them). Put a learned join after the block: nn.Sequential({owner}(..., join=None), "
            f"{type(join).__name__}(...)) for a module that takes the tuple of outputs, or a named join "
            f"first for one that takes a tensor: nn.Sequential({owner}(..., join='cat'), "
            f"{type(join).__name__}(...))."
        )
    if callable(join):
        return join
    if isinstance(join, str) and join in _NAMED_JOINS:
        return join
    raise (ValueError if isinstance(join, str) else TypeError)(
        f"{owner}: unknown join {join!r}. Expected one of "
        f"{', '.join(repr(j) for j in _NAMED_JOINS)}, None, or a callable taking "
        "the list of branch outputs."
    )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.is_nested:
        try:
            shape = f"{tuple(value.shape)}"
        except RuntimeError:  # (a strided nested tensor has no one shape)
            shape = "[" + ", ".join(str(tuple(t.shape)) for t in value.unbind()) + "]"
        return f"NestedTensor{shape} {str(value.dtype).replace('torch.', '')} on {value.device}"
    if isinstance(value, torch.Tensor):
        layout = "" if value.layout == torch.strided else f" {str(value.layout).replace('torch.', '')}"
        return f"Tensor{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}{layout} on {value.device}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_describe(v) for v in value)
        # (a named tuple by its name: two of other types look alike otherwise)
        kind = type(value).__name__ if type(value) not in (tuple, list) else ""
        return f"{kind}({inner})" if isinstance(value, tuple) else f"{kind}[{inner}]"
    if isinstance(value, dict):
        kind = type(value).__name__ if type(value) is not dict else ""  # (as for tuples and lists)
        return kind + "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in value.items()) + "}"
    return type(value).__name__


def _same_leaf(value: Any, first: Any) -> bool:
    r"""Whether a non-tensor output leaf is the first branch's (an ``==`` that is not one bool -- a
    NumPy array's, elementwise -- is not the same)."""
    if value is first:
        return True
    try:
        return type(value) is type(first) and bool(value == first)
    except Exception:
        return False


_SHORT = reprlib.Repr()
_SHORT.maxother = _SHORT.maxstring = 120  # (a function's repr, with its address, whole)


def _shown(value: Any) -> str:
    r"""``value`` for an error: a tensor by its shape, dtype and device (its repr prints its data, pages of
    it for a weight passed by mistake), anything else by its type and a repr cut short."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return _describe(value)
    return f"{type(value).__name__} ({_SHORT.repr(value)})"


def _listing(names: Sequence[str], outputs: Sequence[Any]) -> str:
    return "\n".join(f"  branch {n!r}: {_describe(o)}" for n, o in zip(names, outputs))


def _leaf_join(how: str, dim: int, leaves: list[torch.Tensor]) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # A compiler cannot catch what torch.cat raises for a fake tensor: its own error, which
        # names no branch, would replace ours (see _join_error). The shapes it traces with say.
        mismatch = _mismatch(how, dim, leaves)
        if mismatch is not None:
            raise mismatch
    if how == "cat":
        return torch.cat(leaves, dim)
    if how == "stack":
        return torch.stack(leaves, dim)
    total = functools.reduce(torch.add, leaves)
    return total / len(leaves) if how == "mean" else total


def _differ(a: Any, b: Any) -> bool:
    r"""Whether sizes ``a`` and ``b`` surely differ, asking the compiler for no guard (on a size that
    depends on data, ``x[x > 0]``, it cannot guard; where it is unsure, torch's own checks decide)."""
    return _guard_or_false(a != b)


def _guard_or_false(condition: Any) -> bool:
    r"""``condition``, a comparison of sizes, where it surely holds without a guard; ``False`` otherwise.

    Called only while a compiler traces, which has imported the symbolic shapes module (imported
    with this one, it would add sympy's 0.6 s to every import of the package).
    """
    from torch.fx.experimental import symbolic_shapes

    guard = getattr(symbolic_shapes, "guard_or_false", None)  # (PyTorch 2.8 and later)
    return guard(condition) if guard is not None else symbolic_shapes.statically_known_true(condition)


def _mismatch(how: str, dim: int, leaves: list[Any]) -> Exception | None:
    r"""The exception ``_leaf_join(how, dim, leaves)`` would raise, where the shapes and devices show
    it surely would (``None`` otherwise): torch's own checks, written for a compiler's trace."""
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if len(tensors) < len(leaves) or not tensors:
        return None
    if len({t.device for t in tensors}) > 1 and how in ("cat", "stack"):
        return RuntimeError("Expected all tensors to be on the same device")
    shapes = [tuple(t.shape) for t in tensors]
    if how == "stack":
        n = len(shapes[0]) + 1
        if not -n <= dim < n:
            return IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
        if any(len(shape) != n - 1 or any(map(_differ, shape, shapes[0])) for shape in shapes):
            return RuntimeError("stack expects each tensor to be equal size")
        return None
    if how == "cat":
        if any(len(shape) == 1 and not _differ(shape[0], 0) for shape in shapes):
            return None  # (legacy: torch.cat skips 1-D empty tensors)
        n = len(shapes[0])
        if any(len(shape) == 0 for shape in shapes):
            return RuntimeError("zero-dimensional tensor cannot be concatenated")
        # (torch.cat checks dim against the first tensor before it compares the others' ranks: a dim
        # out of range is an IndexError even where the ranks differ too, as eagerly)
        if not -n <= dim < n:
            return IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
        if any(len(shape) != n for shape in shapes):
            return RuntimeError("Tensors must have same number of dimensions")
        d = dim % n
        if any(_differ(a, b) for shape in shapes for i, (a, b) in enumerate(zip(shape, shapes[0])) if i != d):
            return RuntimeError("Sizes of tensors must match except in the concatenated dimension")
        return None
    # sum, mean: added left to right, broadcasting
    size: tuple | None = shapes[0]
    for shape in shapes[1:]:
        size = _broadcast(size, shape)
        if size is None:
            return RuntimeError("The size of tensor a must match the size of tensor b at a non-singleton dimension")
    return None


def _broadcast(a: tuple, b: tuple) -> tuple | None:
    r"""The shape of ``a`` and ``b`` broadcast together, or ``None`` where they surely do not broadcast
    (``torch.broadcast_shapes``, in Python: a compiler traces it without a tensor, nor a guard)."""
    if len(a) < len(b):
        a, b = b, a
    lead = len(a) - len(b)
    out = list(a[:lead])
    for x, y in zip(a[lead:], b):
        if _differ(x, y) and _differ(x, 1) and _differ(y, 1):
            return None
        out.append(y if _guard_or_false(x == 1) else x)
    return tuple(out)


_EXPECTED = {
    "cat": "all dimensions except dim={dim} to match",
    "stack": "all shapes to be equal",
    "sum": "shapes that broadcast together",
    "mean": "shapes that broadcast together",
}


# What is joined as a tensor: tensors, and the proxies torch.fx.symbolic_trace passes
# through the branches in their place (a proxy compared as a value would end the trace).
_LEAVES = (torch.Tensor, torch.fx.Proxy)


def _join_outputs(
    owner: str, how: str | Callable[[list], Any], dim: int, names: Iterable[str], outputs: list[Any]
) -> Any:
    r"""Combine ``outputs`` (one per branch, in branch order) as ``how`` says."""
    # (Grad mode first: an inference call asks nothing more; a compiler reads no thread-local.)
    if not torch.is_grad_enabled() or _is_tracing() or not _graph_state.forked:
        return _join(owner, how, dim, names, outputs)
    # Branches that autograd recorded on several streams: a sum hands them one gradient, which
    # its nodes hold until the backward pass ends (see _streams, backward).
    _graph_state.forked = False
    hold = (how in ("sum", "mean") or callable(how)) and _recorded(outputs)
    # (This thread's nodes from here are the join's: an output may have been made on another.)
    first = torch.autograd._get_sequence_nr()
    result = _join(owner, how, dim, names, outputs)
    if hold:
        _hold_join_gradients(result, first)
    return result


def _join(owner: str, how: str | Callable[[list], Any], dim: int, names: Iterable[str], outputs: list[Any]) -> Any:
    # (Callables first, and the type of outputs looked at rather than an exception caught:
    # torch.compile cannot compare a builtin such as ``sum`` with a string, nor trace an
    # exception raised by torch.cat.)
    if callable(how):
        try:
            if isinstance(how, nn.Module) and _symbolic_trace._is_fx_tracing_flag:
                # (torch.fx.symbolic_trace records a module's call by its path in the traced root,
                # which a join, called but not registered, does not have: its forward is traced.)
                return how.forward(outputs)
            return how(outputs)
        except Exception as e:
            raise _with_context(e, f"(raised in the join {getattr(how, '__qualname__', how)!r} of {owner}, "
                                   f"called with one argument: the list of the outputs of branches "
                                   f"{list(names)})")
    if how == "cat" and all(isinstance(o, _LEAVES) for o in outputs):  # the common case first
        try:
            return _leaf_join(how, dim, outputs)
        except (RuntimeError, IndexError) as e:  # IndexError: dim out of range
            raise _join_error(owner, how, dim, names, outputs, e) from e
    elif how == "tuple":
        return tuple(outputs)
    elif how == "dict":
        return dict(zip(names, outputs))
    if not all(isinstance(o, _LEAVES) for o in outputs):
        return _structured_join(owner, how, dim, list(names), outputs)
    try:
        return _leaf_join(how, dim, outputs)
    except (RuntimeError, TypeError, IndexError) as e:
        raise _join_error(owner, how, dim, names, outputs, e) from e


def _in_order_of(value: Any, template: Any) -> Any:
    r"""``value`` with the keys of its dicts in ``template``'s order, where they are the same keys
    (``{"x": .., "y": ..}`` and ``{"y": .., "x": ..}`` are equal dicts, but flatten differently)."""
    if type(value) is dict and isinstance(template, dict) and value.keys() == template.keys():
        return {k: _in_order_of(value[k], template[k]) for k in template}
    if type(value) in (tuple, list) and type(value) is type(template) and len(value) == len(template):
        return type(value)(_in_order_of(v, t) for v, t in zip(value, template))
    if type(value) is type(template) and pytree.is_namedtuple_instance(value):
        # (A namedtuple of dicts too: ``Out(logits, aux={...})``. Its class takes the fields by position.)
        return type(value)(*(_in_order_of(v, t) for v, t in zip(value, template)))
    return value


def _structured_join(owner: str, how: str, dim: int, names: list[str], outputs: list[Any]) -> Any:
    outputs = [outputs[0]] + [_in_order_of(o, outputs[0]) for o in outputs[1:]]
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    for name, (_, other) in zip(names, flat):
        if other != spec:
            raise ValueError(
                f"{owner}: join={how!r} needs every branch to return the same structure, "
                f"but branch {names[0]!r} and branch {name!r} differ:\n{_listing(names, outputs)}\n"
                "Return the same (nested) tuple/list/dict of tensors from every branch, "
                "or pass join=None to receive the outputs as a tuple."
            )
    if not any(isinstance(v, _LEAVES) for leaves, _ in flat for v in leaves):
        # (A forward that forgot its ``return``: joined, the Nones would pass on as the result. Every
        # branch's leaves are looked at: a first branch returning ``2`` where another returns a
        # tensor is a leaf that differs, which the loop below names, not "no tensor at all".)
        raise TypeError(
            f"{owner}: join={how!r} joins tensors, but no branch returned one:\n{_listing(names, outputs)}\n"
            "Return tensors (or tuples/lists/dicts of them) from the branches, or pass join=None to "
            "receive the outputs as a tuple."
        )
    joined = []
    for i, column in enumerate(zip(*(leaves for leaves, _ in flat))):
        if all(isinstance(v, _LEAVES) for v in column):
            try:
                joined.append(_leaf_join(how, dim, list(column)))
            except (RuntimeError, TypeError, IndexError) as e:
                raise _join_error(owner, how, dim, names, outputs, e, list(column), _leaf_path(outputs[0], i)) from e
        elif not any(isinstance(v, _LEAVES) for v in column) and all(_same_leaf(v, column[0]) for v in column):
            joined.append(column[0])  # the same non-tensor from every branch (``None``): passed on
        else:
            # A TypeError where some branches return a tensor there (as where no branch returned
            # one), a ValueError where none does and their values differ. The structures are listed
            # only where the outputs are structures (a leaf's path): a single leaf's would repeat
            # the line above it.
            where = _leaf_path(outputs[0], i)
            got = ", ".join(f"branch {n!r}: {_shown(v)}" for n, v in zip(names, column))
            what, between, there = ((f"the outputs at {where}", f".\n{_listing(names, outputs)}\n", " there") if where
                                    else ("the branch outputs", ". ", ""))
            raise (TypeError if any(isinstance(v, _LEAVES) for v in column) else ValueError)(
                f"{owner}: join={how!r} joins tensors, but {what} are not a tensor in every branch, nor the same "
                f"value in all: {got}{between}Return a tensor{there} from every branch (or the same non-tensor "
                f"value), or pass join=None to receive the outputs as a tuple.")
    return pytree.tree_unflatten(joined, spec)


def _leaf_path(output: Any, i: int) -> str:
    r"""Where leaf ``i`` of a branch's structured ``output`` lies (``['z'][0]``), for an error; its number
    while Dynamo traces (which need not trace the paths of an error it only raises; export's non-strict
    mode runs them as Python)."""
    if not _dynamo_compiling():
        try:
            return pytree.keystr(pytree.tree_flatten_with_path(output)[0][i][0])
        except Exception:  # (a registered class without key paths)
            pass
    return f"leaf {i}"


def _out_of_memory(e: BaseException) -> bool:
    r"""Whether ``e`` is an allocation failure, which is not a mismatch of the outputs and keeps its
    type (a caller may catch :class:`torch.OutOfMemoryError` to retry with a smaller batch)."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    # (Allocators that raise a plain RuntimeError: the CPU's "can't allocate memory", other
    # backends'. Not another type that says so, a user's ValueError about a cache server.)
    text = str(e) if isinstance(e, RuntimeError) else ""
    return "out of memory" in text or "not enough memory" in text or "can't allocate memory" in text


_ONE_DEVICE = "all outputs on one device (move them in the branches, e.g. .to(x.device))"


def _expectation(how: str, dim: int, leaves: list[Any]) -> str:
    r"""What ``how`` expects of the tensors ``leaves`` that it could not join, the mismatch torch met
    first where it is one a shape listing does not make plain (torch checks devices before shapes)."""
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if how in ("sum", "mean"):
        return _first_failing_sum(tensors)
    if len({t.device for t in tensors}) > 1:
        return _ONE_DEVICE
    if len({t.layout for t in tensors}) > 1 and not any(t.is_nested for t in tensors):
        return "outputs of one layout (all dense, or all sparse: convert with .to_dense() or .to_sparse())"
    if how == "cat" and any(t.dim() == 0 for t in tensors):
        return "outputs of at least one dimension (0-d tensors cannot be concatenated; join='stack' stacks them)"
    ndims = sorted({t.dim() for t in tensors})
    if how == "cat" and len(ndims) > 1:
        return (f"outputs of one number of dimensions (here {' and '.join(map(str, ndims))}), matching in every "
                f"dimension but dim={dim}")
    return _EXPECTED[how].format(dim=dim)


def _first_failing_sum(tensors: list[torch.Tensor]) -> str:
    r"""Why a sum of ``tensors``, added left to right, fails: the first addition that fails says
    (a 0-d CPU tensor adds to a tensor of any device, as a number)."""
    try:
        shape, device = tensors[0].shape, tensors[0].device
        for t in tensors[1:]:
            scalar = t.dim() == 0 and t.device.type == "cpu"
            if not scalar and device != t.device and not (len(shape) == 0 and device.type == "cpu"):
                return _ONE_DEVICE
            shape = _broadcast(tuple(shape), tuple(t.shape))
            if shape is None:
                break
            device = device if scalar else t.device
    except Exception:  # (nested tensors, which have no one shape)
        pass
    return _EXPECTED["sum"]


def _join_error(owner: str, how: str, dim: int, names: Iterable[str], outputs: list[Any],
                e: Exception, leaves: list[Any] | None = None, where: str = "") -> Exception:
    r"""The error for outputs ``how`` cannot join, of the type torch raised (``e``): ``IndexError`` for a
    ``dim`` out of range, ``RuntimeError`` for shapes or devices that do not match. ``leaves``: the
    tensors that failed to join, where ``outputs`` are structures (the default: ``outputs``), found
    at ``where`` in each (:func:`_leaf_path`)."""
    if _out_of_memory(e):
        raise _with_context(e, f"(raised joining the branch outputs of {owner} with join={how!r})")
    names = list(names)
    along = f" (dim={dim})" if how in ("cat", "stack") else ""  # (sum and mean take no dim)
    # (The listing shows whole structures: say which of their tensors failed.)
    where = f" at {where}" if where else ""
    ndims = sorted({t.dim() for t in (outputs if leaves is None else leaves) if isinstance(t, torch.Tensor)})
    if isinstance(e, IndexError) and along and len(ndims) == 1:  # (of several ranks: those differ first)
        # (stack adds a dimension: its dim may be one more)
        valid = ", ".join(f"{-n - (how == 'stack')} to {n - (how != 'stack')}" for n in ndims)
        return IndexError(
            f"{owner}: join={how!r}{along}: dim is out of range for branch outputs of "
            f"{' or '.join(map(str, ndims))} dimensions{where} (valid: {valid}); got:\n{_listing(names, outputs)}\n"
            f"Pass a dim in that range, or join=None to receive the outputs as a tuple. ({_first_line(e)})"
        )
    expected = _expectation(how, dim, outputs if leaves is None else leaves)
    kind = (TypeError if isinstance(e, TypeError) else NotImplementedError if isinstance(e, NotImplementedError)
            else RuntimeError)
    return (IndexError if isinstance(e, IndexError) else kind)(
        f"{owner}: join={how!r}{along} cannot combine the branch outputs{where}; it expects "
        f"{expected}, got:\n{_listing(names, outputs)}\n"
        f"Make the branches agree, choose another join{' or dim' if along else ''}, "
        f"or pass join=None to receive the outputs as a tuple. ({type(e).__name__}: {_first_line(e)})"
    )


def _first_line(e: BaseException) -> str:
    r"""``e``'s message without what follows its first line (a dispatcher's table of kernels: the
    exception is chained as the cause, where it is whole)."""
    text = str(e)
    return text.split("\n", 1)[0] + (" [...]" if "\n" in text else "")
