"""Test configuration: skip GPU-only tests where no GPU is present; deterministic numerics."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

# Re-exported so that tests may also use it from here; the canonical import is
# ``from tests._helpers import cpu_and_cuda``.
from tests._helpers import cpu_and_cuda  # noqa: F401


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Decide once per session; the markers are registered in setup.cfg ([tool:pytest]).
    has_cuda = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if has_cuda else 0
    skip_cuda = pytest.mark.skip(reason="CUDA not available")
    skip_multigpu = pytest.mark.skip(reason=f"needs 2 or more CUDA GPUs, found {n_gpus}")
    for item in items:
        if not has_cuda and item.get_closest_marker("cuda") is not None:
            item.add_marker(skip_cuda)
        if n_gpus < 2 and item.get_closest_marker("multigpu") is not None:
            item.add_marker(skip_multigpu)


@pytest.fixture(autouse=True)
def _deterministic_numerics() -> Iterator[None]:
    # Tests compare parallel results bit-for-bit against a sequential reference; TF32 matmuls
    # and convolutions would make those comparisons depend on kernel choice, so turn it off
    # for every test and restore the process-wide settings afterwards.
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


@pytest.fixture
def cuda_autocast_flag() -> Iterator[Callable[[bool], None]]:
    r"""Turns CUDA autocast on as ``torch.autocast("cuda", torch.bfloat16)`` does, without a GPU (which
    ``torch.autocast`` would refuse): the flag only, which CPU tensors' kernels never read."""
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")

    def turn(on: bool) -> None:
        torch.set_autocast_enabled("cuda", on)
        torch.set_autocast_dtype("cuda", torch.bfloat16 if on else dtype)

    yield turn
    torch.set_autocast_enabled("cuda", enabled)
    torch.set_autocast_dtype("cuda", dtype)
