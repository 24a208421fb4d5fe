"""Helpers shared by the test modules.

Import as ``from tests._helpers import cpu_and_cuda``; ``tests/`` is a package, so pytest
puts the repository root on ``sys.path`` and the import works with both ``pytest`` and
``python -m pytest`` run from the repository root.
"""

from __future__ import annotations

import pytest


def cpu_and_cuda() -> tuple:
    """Devices to parametrize a test over, as in torchvision's ``cpu_and_cuda()``.

    The ``cuda`` entry carries the ``cuda`` marker, which ``conftest.py`` turns into a skip on
    machines without a GPU, so CPU-only CI still runs the CPU fallback.

    Example::

        @pytest.mark.parametrize("device", cpu_and_cuda())
        def test_something(device): ...
    """
    return ("cpu", pytest.param("cuda", marks=pytest.mark.cuda))
