"""The README's usage example runs as printed (on CUDA) and, moved to the CPU, on any machine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md has no python example"
    return blocks[0]


def _check(scope: dict, device: str) -> None:
    block, y, z = scope["block"], scope["y"], scope["z"]
    assert y.shape == (8, 160, 35, 35) and y.device.type == device
    x = torch.randn(8, 192, 35, 35, device=device)
    with torch.no_grad():
        expected = torch.cat([branch(x) for branch in block], 1)
        torch.testing.assert_close(block(x), expected)
    assert z.shape == (8, 160, 35, 35) and z.device.type == device


def test_readme_example_on_the_cpu():
    code = _example().replace('device="cuda"', 'device="cpu"').replace(".cuda()", ".cpu()")
    code = code.replace(".pin_memory()", "")
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    _check(scope, "cpu")


@pytest.mark.cuda
def test_readme_example_as_printed():
    scope: dict = {}
    exec(compile(_example(), str(README), "exec"), scope)
    _check(scope, "cuda")
