"""The plain sequential computation every ``Parallel`` test is checked against.

:func:`reference` runs a model the way a user would without the library: every
``Parallel`` is replaced by its branches called one after another and joined with
ordinary expressions (``torch.cat``, ``a + b + c``), written here independently of
``parallel_modules._joins``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from parallel_modules import Parallel

__all__ = ["assert_close", "assert_same", "join_reference", "reference"]


def _leafwise(fn: Callable[[list], torch.Tensor], outs: Sequence[Any]) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return fn(list(outs))
    if isinstance(first, tuple):
        return tuple(_leafwise(fn, [o[i] for o in outs]) for i in range(len(first)))
    if isinstance(first, list):
        return [_leafwise(fn, [o[i] for o in outs]) for i in range(len(first))]
    if isinstance(first, dict):
        return {k: _leafwise(fn, [o[k] for o in outs]) for k in first}
    if all(o == first for o in outs):  # a non-tensor leaf every branch returns alike is passed on
        return first
    raise TypeError(f"unexpected output type {type(first).__name__}")


def _plain_sum(ts: list) -> torch.Tensor:
    total = ts[0]
    for t in ts[1:]:
        total = total + t
    return total


def join_reference(join: Any, dim: int, names: Sequence[str], outs: Sequence[Any]) -> Any:
    r"""What ``join`` means, as a user would write it out."""
    if join is None or join == "tuple":
        return tuple(outs)
    if join == "dict":
        return dict(zip(names, outs))
    if callable(join):
        return join(list(outs))
    if join == "cat":
        return _leafwise(lambda ts: torch.cat(ts, dim), outs)
    if join == "stack":
        return _leafwise(lambda ts: torch.stack(ts, dim), outs)
    if join == "sum":
        return _leafwise(_plain_sum, outs)
    if join == "mean":
        return _leafwise(lambda ts: _plain_sum(ts) / len(ts), outs)
    raise ValueError(f"unknown join {join!r}")


def reference(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    r"""Run ``module`` with every ``Parallel`` (also inside ``nn.Sequential``) unrolled."""
    if isinstance(module, Parallel):
        names = [name for name, _ in module.named_children()]
        outs = [reference(branch, *args, **kwargs) for branch in module]
        return join_reference(module.join, module.dim, names, outs)
    if type(module) is nn.Sequential:
        (x,) = args
        for layer in module:
            x = reference(layer, x)
        return x
    return module(*args, **kwargs)


def _compare(actual: Any, expected: Any, check: Callable[[torch.Tensor, torch.Tensor, str], None], path: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual).__name__}"
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.device == expected.device, f"{path}: device {actual.device} != {expected.device}"
        check(actual, expected, path)
    elif isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            _compare(a, e, check, f"{path}[{i}]")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected a dict, got {type(actual).__name__}"
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            _compare(actual[k], expected[k], check, f"{path}[{k!r}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_same(actual: Any, expected: Any) -> None:
    r"""Same structure, shapes, dtypes, devices, and bit-for-bit equal values."""

    def check(a: torch.Tensor, e: torch.Tensor, path: str) -> None:
        assert torch.equal(a, e), f"{path}: not bit-for-bit equal, max abs diff {_max_diff(a, e):.3g}"

    _compare(actual, expected, check, "output")


def assert_close(actual: Any, expected: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    r"""Same structure; values equal within ``rtol``/``atol`` (compilers may fuse differently)."""

    def check(a: torch.Tensor, e: torch.Tensor, path: str) -> None:
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{path}: {m}")

    _compare(actual, expected, check, "output")
