r"""What autograd saved for backward: the memory a backward pass will read.

A change in place to a tensor autograd saved is refused by the backward
("modified by an inplace operation"), through the saved tensor's version
counter. Where this package hands autograd other tensors than the user's --
a CUDA graph's static outputs, a fused group's stacks, which share memory
with the members' own tensors but not their version counters -- it finds the
memory autograd saved here, and watches the user's tensors for it.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ._streams import _storage_address

__all__: list[str] = []

# Nodes whose saved tensors Python cannot read: an in-place change of part of a tensor
# (``CopySlices``, which holds the node of the change), a TorchScript function's.
_HIDDEN_SAVES = frozenset({"CopySlices", "CppFunction"})
# Each node type's saved attributes: ``dir()`` of every node was most of a walk's time.
_NAMES: dict[type, list[str]] = {}


def _saved_storages(roots: Iterable[Any], stop: Iterable[Any] = (),
                    walked_past: list[Any] | None = None) -> set[int] | None:
    r"""The storages (data pointers) of the strided tensors that the autograd nodes from ``roots`` back save.

    Walked from the nodes ``roots`` along their inputs, not past those in
    ``stop`` (where an earlier computation begins). ``None`` where it cannot
    be told: a node whose saved values Python cannot read, or a value saved
    through saved-tensor hooks
    (``torch.utils.checkpoint(use_reentrant=False)``, ``save_on_cpu``), which
    reading would unpack -- a checkpoint's recomputation of its whole forward,
    whose activations it then keeps; a saved tensor without memory of its own
    (a wrapper subclass: DTensor, torchao's float8 and quantized tensors,
    whose memory is their inner tensors'). ``walked_past``: a node whose saved
    values Python cannot read is walked past instead, such a tensor left out,
    each appended to it, and what the others save is returned (some of what
    the graph saves; all of it where ``walked_past`` stays empty).
    """
    hit: set[int] = set()
    seen: set[Any] = set(stop)
    stack = [node for node in roots if node is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        hidden = type(node).__name__ in _HIDDEN_SAVES
        if hidden:
            if walked_past is None:
                return None
            walked_past.append(node)
        names = () if hidden else _NAMES.get(type(node))
        if names is None:
            names = [n for n in dir(node) if n.startswith("_saved_")]
            if hasattr(type(node), "saved_tensors"):  # (on the node, the property would unpack)
                names.append("saved_tensors")
            _NAMES[type(node)] = names
        for name in names:
            if _unpacked_by_hook(getattr(node, "_raw" + name if name[0] == "_" else "_raw_" + name, None)):
                return None
            try:
                value = getattr(node, name)
            except Exception:
                return None
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    address = _storage_address(t)
                    if address or not t.numel():  # (an empty one may have none)
                        hit.add(address)
                    elif walked_past is None:  # (a wrapper subclass: its memory is its inner tensors')
                        return None
                    else:
                        walked_past.append(t)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return hit


def _unpacked_by_hook(raw: Any) -> bool:
    r"""Whether a node's raw saved value (``_raw_saved_*``: a ``SavedTensor`` or a sequence of them) has an unpack hook."""
    for saved in raw if isinstance(raw, (tuple, list)) else (raw,):
        if getattr(saved, "unpack_hook", None) is not None:
            return True
    return False
