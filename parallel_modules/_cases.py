r"""The workloads of the benchmark, defined once and reused by the tests.

Each case builds its branches with a seeded generator, so the ``Parallel``
block and the plain sequential reference share the very same modules.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

__all__: list[str] = []


class SequentialBranches(nn.Module):
    r"""The plain PyTorch module a user would write: branches called one after another.

    This is the reference every mode is checked against. Its joins are written
    out as ordinary expressions (``torch.cat``, ``a + b + c``).
    """

    def __init__(self, branches: list[nn.Module], join: str = "cat", dim: int = 1) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)
        self.join, self.dim = join, dim

    def forward(self, x: torch.Tensor):
        outs = [b(x) for b in self.branches]
        if self.join == "cat":
            return torch.cat(outs, self.dim)
        if self.join == "sum":
            total = outs[0]
            for o in outs[1:]:
                total = total + o
            return total
        return tuple(outs)


def _conv_relu(cin: int, cout: int, k: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2), nn.ReLU())


def inception_branches() -> list[nn.Module]:
    r"""An Inception-style block: 192 channels in, 256 out (64+64+96+32), as the project's specification gives it."""
    return [
        _conv_relu(192, 64, 1),
        nn.Sequential(_conv_relu(192, 48, 1), _conv_relu(48, 64, 5)),
        nn.Sequential(_conv_relu(192, 64, 1), _conv_relu(64, 96, 3), _conv_relu(96, 96, 3)),
        nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), _conv_relu(192, 32, 1)),
    ]


def mlp_branches(n: int, width: int = 256, depth: int = 4) -> list[nn.Module]:
    r"""``n`` small MLPs, each ``depth`` x (Linear(width, width) + GELU)."""
    return [nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())]) for _ in range(n)]


def compute_bound_branches(n: int = 4, width: int = 4096) -> list[nn.Module]:
    r"""``n`` branches of two large Linear layers: each fills the GPU alone."""
    return [nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)) for _ in range(n)]


def head_branches(n: int = 4, width: int = 512, classes: int = 100) -> list[nn.Module]:
    r"""Several task heads on one shared feature vector."""
    return [nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, classes)) for _ in range(n)]


def shared_trunk(width: int = 512) -> nn.Module:
    r"""The shared trunk the heads sit on: two ``Linear(width, width)`` + GELU."""
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU())


def conv_branches(n: int = 4, channels: int = 64) -> list[nn.Module]:
    r"""``n`` identical branches of two 3x3 convolutions (``channels`` -> ``channels``) with a ReLU between."""
    return [nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(channels, channels, 3, padding=1)) for _ in range(n)]


def tiny_branches(n: int) -> list[nn.Module]:
    r"""``n`` branches of one tiny op each: pure launch overhead."""
    return [nn.Linear(16, 16) for _ in range(n)]


@dataclasses.dataclass
class Case:
    r"""One benchmark workload: branches, how they join, and the input they take."""

    name: str
    build: Callable[[], list[nn.Module]]
    input_shape: Callable[[int], tuple[int, ...]]
    batches: tuple[int, ...]
    join: str = "cat"
    dim: int = 1
    quick: bool = True
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    train: bool = False  # time a training step (forward, backward, SGD step) instead of inference
    compiled: bool = False  # also time torch.compile modes (full suite only: compiling takes a while)
    trunk: Callable[[], nn.Module] | None = None  # a module in front of the branches, shared by all

    def branches(self, device, dtype) -> list[nn.Module]:
        torch.manual_seed(0)
        return [b.to(device=device, dtype=dtype).train(self.train) for b in self.build()]

    def model(self, block: nn.Module, device, dtype) -> nn.Module:
        r"""``block`` (the branches, in any mode) behind the case's trunk, if it has one.

        The trunk is built anew from the same seed each time, so every mode's
        model computes the same function.
        """
        if self.trunk is None:
            return block
        torch.manual_seed(1)
        return nn.Sequential(self.trunk().to(device=device, dtype=dtype).train(self.train), block)

    def make_input(self, batch: int, device, dtype) -> torch.Tensor:
        return torch.randn(self.input_shape(batch), device=device, dtype=dtype)


def encoder() -> nn.Sequential:
    r"""4 stride-2 3x3 convs, 3 -> 64 -> 128 -> 256 -> 512 channels."""
    chans = [3, 64, 128, 256, 512]
    return nn.Sequential(*[m for a, b in zip(chans, chans[1:]) for m in (nn.Conv2d(a, b, 3, 2, 1), nn.ReLU())])


def decoder(classes: int = 10) -> nn.Sequential:
    r"""4 stride-2 transposed convs back to full resolution and ``classes`` channels."""
    chans = [512, 256, 128, 64, classes]
    layers: list[nn.Module] = []
    for a, b in zip(chans, chans[1:]):
        layers += [nn.ConvTranspose2d(a, b, 4, 2, 1), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def h2d_model(width: int = 32) -> nn.Sequential:
    r"""A small conv net, ``3 -> width -> 64`` channels, for the host-to-device case.

    The case asks for a model whose compute at batch 64, 224x224 takes about as
    long as copying its input, which depends on the GPU: the copy of 38.5 MB of
    pinned fp32 runs at the bus's speed (705-712 us on both the H100 and the
    H200 machine), the convolutions at the GPU's (width 32: 570 us on the H100,
    515 us on the H200). So the benchmark builds it at each of the case's
    ``widths`` in turn and keeps the one whose compute comes closest to the
    copy (see ``bench._calibrated``); its time and the copy's are reported
    with the case (``width``, ``compute_us``, ``copy_us``). The width changes
    the work of each kernel, not the number of operations the CPU issues.
    """
    return nn.Sequential(nn.Conv2d(3, width, 3, 2, 1), nn.ReLU(), nn.Conv2d(width, 64, 3, 2, 1), nn.ReLU())


@dataclasses.dataclass
class PipelineCase:
    r"""A stage-by-stage workload for ``ParallelSequential``; ``host_input`` puts the input in pinned CPU memory."""

    name: str
    build: Callable[..., list[nn.Module]]
    input_shape: Callable[[int], tuple[int, ...]]
    batches: tuple[int, ...]
    chunks: tuple[int, ...]
    host_input: bool = False
    quick: bool = True
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    # Sizes ``build`` takes (``build(width)``), smallest first: the benchmark keeps the
    # one whose compute takes about as long as the copy of a host input (host_input cases).
    widths: tuple[int, ...] = ()
    width: int | None = None  # the size built; None: build()'s default

    def stages(self, device, dtype) -> list[nn.Module]:
        torch.manual_seed(0)
        stages = self.build() if self.width is None else self.build(self.width)
        return [s.to(device=device, dtype=dtype).eval() for s in stages]

    def make_input(self, batch: int, device, dtype) -> torch.Tensor:
        x = torch.randn(self.input_shape(batch), dtype=dtype)
        if not self.host_input:
            return x.to(device)
        return x.pin_memory() if torch.cuda.is_available() else x


PIPELINES: dict[str, PipelineCase] = {
    c.name: c
    for c in [
        PipelineCase("encdec", lambda: [encoder(), decoder()], lambda b: (b, 3, 256, 256), (8,), (1, 2, 4, 8)),
        PipelineCase("h2d", lambda width=32: [h2d_model(width)], lambda b: (b, 3, 224, 224), (64,), (1, 2, 4, 8),
                     host_input=True, widths=tuple(range(16, 129, 4))),
    ]
}

CASES: dict[str, Case] = {
    c.name: c
    for c in [
        Case("mlp8", lambda: mlp_branches(8), lambda b: (b, 256), (8,), compiled=True),
        Case("mlp16", lambda: mlp_branches(16), lambda b: (b, 256), (8,), quick=False),
        Case("mlp8-train", lambda: mlp_branches(8), lambda b: (b, 256), (8,), train=True),
        Case("inception", inception_branches, lambda b: (b, 192, 35, 35), (1, 8, 64),
             dtypes=(torch.float32, torch.float16), compiled=True),
        Case("conv4", conv_branches, lambda b: (b, 64, 56, 56), (1, 8)),
        Case("heads", head_branches, lambda b: (b, 512), (32,), trunk=shared_trunk),
        Case("compute", compute_bound_branches, lambda b: (b, 4096), (4096,), quick=False, compiled=True),
        Case("tiny2", lambda: tiny_branches(2), lambda b: (b, 16), (8,), quick=False),
        Case("tiny4", lambda: tiny_branches(4), lambda b: (b, 16), (8,), quick=False),
        Case("tiny8", lambda: tiny_branches(8), lambda b: (b, 16), (8,)),
        Case("tiny16", lambda: tiny_branches(16), lambda b: (b, 16), (8,), quick=False),
    ]
}
