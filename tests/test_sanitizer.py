"""Reliability test 4: ``Parallel`` runs clean under the CUDA Stream Sanitizer (CSAN).

CSAN (``TORCH_CUDA_SANITIZER=1``, read when ``torch`` is imported) records every kernel's
reads and writes per stream and every event record/wait, and on an access not ordered after
a conflicting one on another stream prints ``CSAN detected a possible data race ...`` to
stderr and raises ``CUDASanitizerErrors``. It must be enabled from the start of a process,
so each script runs in a subprocess. A deliberately broken script (a side stream forked but
never joined) must be caught, which shows that the harness can fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[1]

CLEAN = textwrap.dedent(
    """
    import torch
    from torch import nn
    from parallel_modules import Parallel

    torch.manual_seed(0)
    dev = "cuda"

    def mlp(i=32, o=16):
        return nn.Sequential(nn.Linear(i, 32), nn.ReLU(), nn.Linear(32, o))

    inner = Parallel(mlp(), mlp(), mlp(), join="sum", streams=True)
    block = Parallel(
        mlp(), nn.Sequential(nn.Linear(32, 32), inner), mlp(), nn.Identity(),
        join="cat", streams=True,
    )
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), block, nn.Linear(16 * 3 + 32, 8)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    # Training: forward forks from the caller's stream, backward runs on the forward
    # streams; the optimizer reads the gradients on the caller's stream.
    for _ in range(3):
        x = torch.randn(8, 32, device=dev, requires_grad=True)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        x.grad.sum()

    # Inference from a non-default stream, outputs kept and consumed there; a shared input
    # freed and its memory reused after the call.
    heads = Parallel(mlp(), mlp(), mlp(), join=None, streams=True).to(dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(3):
            x = torch.randn(8, 32, device=dev)
            outs = heads(x)
            y = model(x)
            del x
            total = sum(o.sum() for o in outs) + y.sum()
            scratch = torch.ones(8, 32, device=dev)
    torch.cuda.current_stream().wait_stream(s)
    total.item()
    torch.cuda.synchronize()
    print("clean run done")
    """
)

BROKEN = textwrap.dedent(
    """
    import torch

    x = torch.randn(1 << 16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # fork ...
    with torch.cuda.stream(side):
        y = x * 2
    z = y + 1  # ... but no join: the caller's stream reads y without waiting for side
    torch.cuda.synchronize()
    print("no race reported")
    """
)


def _run(script: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["TORCH_CUDA_SANITIZER"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_parallel_runs_clean_under_sanitizer():
    proc = _run(CLEAN)
    report = f"returncode {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, report
    assert "clean run done" in proc.stdout, report
    assert "CSAN" not in proc.stderr and "data race" not in proc.stderr, report


def test_sanitizer_catches_missing_join():
    proc = _run(BROKEN)
    report = f"returncode {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert "CSAN" in proc.stderr or "CUDASanitizerErrors" in proc.stderr, report
    assert proc.returncode != 0, report
    assert "no race reported" not in proc.stdout, report
