r"""``Parallel``: independent branches on one input, run concurrently."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterator, Literal, Union, overload

import torch
from torch import nn

from ._autotune import _StreamTuner
from ._inputs import _check_devices, _input_device, _signature, _with_context
from ._joins import JoinSpec, _check_join, _join_outputs
from ._streams import _current_stream, _is_tracing, _run_forked

__all__ = ["Parallel"]

Streams = Union[bool, Literal["auto"]]


class _Function(nn.Module):
    r"""Holds a plain callable branch (``torch.relu``, a lambda) as a module."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__qualname__", None) or repr(self.fn)


def _as_module(owner: str, name: str, branch: Any) -> nn.Module:
    if isinstance(branch, nn.Module):
        return branch
    if callable(branch):
        return _Function(branch)
    raise TypeError(
        f"{owner}: branch {name!r} must be an nn.Module or a callable, got "
        f"{type(branch).__name__} ({branch!r}). Wrap it in a module or pass a function."
    )


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
    branches run one after the other with identical results.

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
            by branch name, or a callable taking the list of outputs. Named
            joins apply leaf by leaf to structured outputs. Default: ``"cat"``.
        dim: dimension for ``"cat"`` and ``"stack"``. Default: ``1``.
        streams: ``True`` to always fork onto side streams, ``False`` to run
            branches one after another on the caller's stream, ``"auto"`` to
            time both on the first calls of each input signature and keep the
            faster one (as ``torch.backends.cudnn.benchmark`` does). Default:
            ``"auto"``.

    Example::

        >>> block = Parallel(
        ...     nn.Conv2d(192, 64, 1),
        ...     nn.Sequential(nn.Conv2d(192, 48, 1), nn.Conv2d(48, 64, 5, padding=2)),
        ...     join="cat", dim=1,
        ... )
        >>> block(torch.randn(8, 192, 35, 35)).shape
        torch.Size([8, 128, 35, 35])

    .. note::
        A branch must not depend on another branch's side effects: they may run
        in any order on the GPU. Outputs produced on side streams are safe to
        keep, free or use on the caller's stream (they are marked with
        :meth:`torch.Tensor.record_stream`).
    """

    _modules: dict[str, nn.Module]  # type: ignore[assignment]

    @overload
    def __init__(self, *branches: nn.Module | Callable[..., Any], join: JoinSpec = "cat", dim: int = 1,
                 streams: Streams = "auto") -> None: ...

    @overload
    def __init__(self, branches: "OrderedDict[str, nn.Module | Callable[..., Any]]", /, *, join: JoinSpec = "cat",
                 dim: int = 1, streams: Streams = "auto") -> None: ...

    def __init__(self, *branches: Any, join: JoinSpec = "cat", dim: int = 1, streams: Streams = "auto") -> None:
        super().__init__()
        owner = type(self).__name__
        if len(branches) == 1 and isinstance(branches[0], OrderedDict):
            items = list(branches[0].items())
        else:
            items = [(str(i), b) for i, b in enumerate(branches)]
        if not items:
            raise ValueError(
                f"{owner}: expected at least one branch, got none. "
                f"Pass modules, e.g. {owner}(nn.Linear(8, 8), nn.Linear(8, 8))."
            )
        if streams not in (True, False, "auto"):
            raise ValueError(f"{owner}: streams must be True, False or 'auto', got {streams!r}.")
        if not isinstance(dim, int):
            raise TypeError(f"{owner}: dim must be an int, got {type(dim).__name__} ({dim!r}).")
        self.join = _check_join(owner, join)
        self.dim = dim
        self.streams = streams
        for name, branch in items:
            self.add_module(name, _as_module(owner, name, branch))
        self._reset()

    # ------------------------------------------------------------------ state
    def _reset(self) -> None:
        r"""Forget everything learnt about calls: after the branches, their
        devices or dtypes change, devices are checked and schedules tuned anew."""
        self._tuner = _StreamTuner(on_decided=self._plans_set)
        self._plans: dict[Hashable, bool] = {}

    def _plans_set(self, key: Hashable, forked: bool) -> None:
        self._plans[key] = forked

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # .to(), .cuda(), .half() ... may move parameters: re-check devices.
        self._reset()
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_tuner", None)
        state.pop("_plans", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._reset()

    # -------------------------------------------------------------- container
    def _settings(self) -> dict[str, Any]:
        return {"join": self.join, "dim": self.dim, "streams": self.streams}

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def _key(self, idx: int) -> str:
        n = len(self._modules)
        if not -n <= idx < n:
            raise IndexError(f"{type(self).__name__}: index {idx} is out of range for {n} branches.")
        return list(self._modules)[idx % n]

    def __getitem__(self, idx: int | slice) -> nn.Module:
        if isinstance(idx, slice):
            return self.__class__(OrderedDict(list(self._modules.items())[idx]), **self._settings())
        return self._modules[self._key(idx)]

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        key = self._key(idx)
        self.add_module(key, _as_module(type(self).__name__, key, module))
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
        self._reset()

    def append(self, module: nn.Module | Callable[..., Any]) -> "Parallel":
        r"""Append a branch at the end; returns ``self``."""
        key = str(len(self._modules))
        if key in self._modules:
            raise ValueError(f"{type(self).__name__}: a branch named {key!r} already exists; use an OrderedDict.")
        self.add_module(key, _as_module(type(self).__name__, key, module))
        self._reset()
        return self

    def extend(self, modules: Any) -> "Parallel":
        r"""Append every module of an iterable; returns ``self``."""
        for m in modules:
            self.append(m)
        return self

    def extra_repr(self) -> str:
        join = getattr(self.join, "__qualname__", None) or repr(self.join)
        return f"join={join}, dim={self.dim}, streams={self.streams!r}"

    # ---------------------------------------------------------------- forward
    def _branch_error(self, error: Exception, index: int) -> Exception:
        name = list(self._modules)[index]
        return _with_context(error, f"(raised in branch {name!r} (index {index}) of {type(self).__name__})")

    def _run(self, args: tuple, kwargs: dict, device: torch.device | None = None) -> list[Any]:
        r"""Run the branches: one after another, or forked onto ``device``'s side streams."""
        if device is None or len(self._modules) == 1:
            outputs: list[Any] = []
            try:
                for module in self._modules.values():
                    outputs.append(module(*args, **kwargs))
            except Exception as e:
                raise self._branch_error(e, len(outputs))
            return outputs

        def run(i: int, module: nn.Module) -> Any:
            try:
                return module(*args, **kwargs)
            except Exception as e:
                raise self._branch_error(e, i)

        calls = list(self._modules.values())
        if device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                return _run_forked(calls, device, run)
        return _run_forked(calls, device, run)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        r"""Run every branch on ``*args, **kwargs`` and join the outputs."""
        outputs = self._outputs(args, kwargs)
        return _join_outputs(type(self).__name__, self.join, self.dim, self._modules, outputs)

    def _outputs(self, args: tuple, kwargs: dict) -> list[Any]:
        if _is_tracing():
            # Compilers see the branches one after the other and schedule them.
            return self._run(args, kwargs)
        # One dict lookup per call decides everything: the schedule chosen for
        # this signature (False: sequential, True: forked, a trial: tuning).
        key = _signature(args, kwargs, self.training)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(key, args, kwargs)
        if plan is False:
            return self._run(args, kwargs)
        device = _input_device(args, kwargs)
        if plan is True or torch.cuda.is_current_stream_capturing():
            # Inside a CUDA graph forking is what makes branches concurrent.
            return self._run(args, kwargs, device)
        return self._tuner.run(
            key,
            _current_stream(device),
            lambda: self._run(args, kwargs),
            lambda: self._run(args, kwargs, device),
        )

    def _plan(self, key: Hashable, args: tuple, kwargs: dict) -> bool | None:
        r"""First call with this signature: check devices, choose how to schedule."""
        device = _input_device(args, kwargs)
        if device is not None:
            _check_devices(type(self).__name__, list(self._modules), self._modules.values(), device)
        if device is None or device.type != "cuda" or self.streams is False or len(self._modules) == 1:
            plan: bool | None = False
        elif self.streams is True:
            plan = True
        else:
            plan = self._tuner.decided(key)
        if plan is not None:
            if len(self._plans) >= 1024:  # dynamic shapes: keep the cache bounded
                self._plans.clear()
            self._plans[key] = plan
        return plan
