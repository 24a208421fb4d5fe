"""Helpers shared by the test modules.

Import as ``from tests._helpers import cpu_and_cuda``; ``tests/`` is a package, so pytest
puts the repository root on ``sys.path`` and the import works with both ``pytest`` and
``python -m pytest`` run from the repository root.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
from torch import nn


def cpu_and_cuda() -> tuple:
    """Devices to parametrize a test over, as in torchvision's ``cpu_and_cuda()``.

    The ``cuda`` entry carries the ``cuda`` marker, which ``conftest.py`` turns into a skip on
    machines without a GPU, so CPU-only CI still runs the CPU fallback.

    Example::

        @pytest.mark.parametrize("device", cpu_and_cuda())
        def test_something(device): ...
    """
    return ("cpu", pytest.param("cuda", marks=pytest.mark.cuda))


def mlp(i: int = 16, o: int = 8) -> nn.Sequential:
    r"""A small branch: ``Linear(i, 16) -> GELU -> Linear(16, o)``."""
    return nn.Sequential(nn.Linear(i, 16), nn.GELU(), nn.Linear(16, o))


class ScaleBy(nn.Module):
    r"""Multiplies by a random buffer of ``width`` (which a test may make require grad)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("s", torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


class DoubledInTraining(nn.Module):
    r"""A ``Linear(width, width)`` whose output this module doubles while the Linear is in training mode:
    a module of the user's that reads a child's train/eval mode."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (2 if self.lin.training else 1)


class Steps(nn.Module):
    r"""Counts its calls in a buffer it assigns anew at each one (``self.steps = self.steps + 1``)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        return self.lin(x)


class EqualByClass(nn.Linear):
    r"""A layer that defines ``==`` (as dataclass-style modules do): equal to any other of its class."""

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    __hash__ = nn.Module.__hash__


class Loop(nn.Module):
    r"""The plain module a ``cat`` block stands for: its branches, under the same names, called in a loop."""

    def __init__(self, branches: list[nn.Module]) -> None:
        super().__init__()
        for i, branch in enumerate(branches):
            self.add_module(str(i), branch)

    def __getitem__(self, i: int) -> nn.Module:
        return self._modules[str(i)]

    def forward(self, *args, **kwargs):
        return torch.cat([branch(*args, **kwargs) for branch in self._modules.values()], 1)


def hook_shapes(value):
    r"""What a hook was handed, for comparing two modules' hook calls: tensors by shape."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (tuple, list)):
        return tuple(hook_shapes(v) for v in value)
    if isinstance(value, dict):
        return {k: hook_shapes(v) for k, v in value.items()}
    return value


def rewriting_hooks(root: nn.Module, target: nn.Module, log: list, backward: bool = True) -> None:
    r"""Hooks of every kind on ``target``, logging by name below ``root``; the forward pre-hook, the
    forward hook and the backward pre-hook rewrite what they are handed. ``backward=False``: the
    forward ones only (Dynamo traces no backward hook of a module it inlines)."""
    name = {m: n for n, m in root.named_modules()}[target]

    def pre(m, args, kwargs):
        log.append(("pre", name, hook_shapes(args), hook_shapes(kwargs)))
        return (args[0] * 2, *args[1:]), kwargs

    def forward(m, args, kwargs, out):
        log.append(("forward", name, hook_shapes(args), hook_shapes(kwargs), hook_shapes(out)))
        return out.tanh()

    def backward_pre(m, grad_out):
        log.append(("backward pre", name, hook_shapes(grad_out)))
        return (grad_out[0] * 3,)

    target.register_forward_pre_hook(pre, with_kwargs=True)
    target.register_forward_hook(forward, with_kwargs=True)
    target.register_forward_hook(lambda m, a, out: log.append(("always", name, hook_shapes(out))), always_call=True)
    if not backward:
        return
    target.register_full_backward_pre_hook(backward_pre)
    target.register_full_backward_hook(
        lambda m, grad_in, grad_out: log.append(("backward", name, hook_shapes(grad_in), hook_shapes(grad_out))))


def assert_same_backward(model: nn.Module, ref: nn.Module, x: torch.Tensor, rtol: float, atol: float) -> None:
    r"""Backward of ``model`` and of ``ref`` (a copy of its parameters, run otherwise) on copies of ``x``:
    the input's gradients and the parameters', in order, agree."""
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(x1).square().mean().backward()
    ref(x2).square().mean().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=rtol, atol=atol)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol)


def appending_from_another_thread(container: nn.Module, module: nn.Module, while_len: int) -> Callable:
    r"""A forward hook that, while ``container`` holds ``while_len`` children, appends ``module`` to it from
    another thread and waits for that thread: an edit landing in the middle of a call, every time."""
    def hook(_module: nn.Module, _args: tuple, _output: Any) -> None:
        if len(container) == while_len:
            thread = threading.Thread(target=container.append, args=(module,))
            thread.start()
            thread.join()

    return hook


class Queries(nn.Module):
    r"""Learned queries: returns its parameter of ``shape``, whatever the input."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.randn(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q


@pytest.fixture(autouse=True)
def fresh_dynamo():
    r"""Each test compiles from scratch (import it into a test module to apply it there)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# GPU cycles that ``Sleepy`` spins for by default: long enough (~50 ms on an H100) that a
# missing wait lets the next kernel read unfinished data almost surely.
SLEEP = 100_000_000


class Sleepy(nn.Module):
    r"""Keeps the current stream (of the current device) busy for ``cycles`` before computing ``inner``."""

    def __init__(self, inner: nn.Module, cycles: int = SLEEP) -> None:
        super().__init__()
        self.inner, self.cycles = inner, cycles

    def forward(self, x):
        torch.cuda._sleep(self.cycles)
        return self.inner(x)


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cycles, streams):
        ctx.cycles, ctx.streams = cycles, streams
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.streams is not None:
            ctx.streams.append(torch.cuda.current_stream())
        torch.cuda._sleep(ctx.cycles)
        return g * 1, None, None


def sleep_in_backward(x: torch.Tensor, cycles: int = SLEEP, streams: list | None = None) -> torch.Tensor:
    r"""``x`` unchanged; in backward, its gradient is passed on only after ``cycles`` GPU cycles.

    The sleep runs on the stream autograd runs this backward on (the one its forward ran on),
    which is appended to ``streams`` when given: whatever follows on that stream -- the
    gradients of the weights before it -- comes late, and a consumer that does not wait for
    that stream reads unfinished data.
    """
    return _SleepInBackward.apply(x, cycles, streams)


class SlowGrad(nn.Module):
    r"""Identity module around :func:`sleep_in_backward`."""

    def __init__(self, cycles: int = SLEEP, streams: list | None = None) -> None:
        super().__init__()
        self.cycles, self.streams = cycles, streams

    def forward(self, x):
        return sleep_in_backward(x, self.cycles, self.streams)


def half(device: str) -> torch.dtype:
    r"""The reduced precision autocast runs ``device``'s matmuls in, for the mixed-precision tests."""
    return torch.float16 if device == "cuda" else torch.bfloat16


def under_autocast_saving(how: str, device: str, module: Callable[..., Any], x: torch.Tensor) -> Any:
    r"""``module(x)`` under autocast, its saved tensors kept as ``how`` says: ``"checkpoint"`` (or
    ``"checkpoint-reentrant"``) recomputes them, ``"save_on_cpu"`` (or ``"save_on_cpu-pinned"``) moves them."""
    from torch.utils.checkpoint import checkpoint

    with torch.autocast(device, dtype=half(device)):
        if how.startswith("save_on_cpu"):
            # (Pinned, on CUDA: packed by a copy on the stream that saved, unpacked by a copy that
            # does not wait, on the stream that runs the backward node.)
            with torch.autograd.graph.save_on_cpu(pin_memory=how.endswith("pinned")):
                return module(x)
        return checkpoint(module, x, use_reentrant=how == "checkpoint-reentrant")


class Float32Region(nn.Linear):
    r"""A ``Linear`` kept in float32 under autocast, as AMP recipes keep a loss head or a norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return super().forward(x.float())


class OwnAutocast(nn.Linear):
    r"""A ``Linear`` under an autocast (to :func:`half`) that its ``forward`` enters itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=half(x.device.type)):
            return super().forward(x)
