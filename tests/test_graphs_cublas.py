"""Graphs own their cuBLAS workspaces, so inductor's CUDA graph trees in the same process cannot break them.

cuBLAS keeps a workspace per (handle, stream) in a process-wide cache and a captured product
replays into it. ``torch.compile(mode="reduce-overhead")`` clears that cache around each of its
warm-ups and recordings (``torch._C._cuda_clearCublasWorkspaces``), and recent torch releases
clear a stream's entry when a graph captured on it is destroyed: a graph of ours whose workspace
came from the cache then writes into freed memory -- a silent corruption, or an illegal memory
access once the memory is released (pytorch/pytorch#193402), the likely cause of the benchmark
crash seen in a full run. ``_graphs.py`` clears the cache around each capture, so a capture
allocates its workspaces from its own pool.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from parallel_modules import Parallel
from parallel_modules import _graphs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
cuda = pytest.mark.cuda


@cuda
def test_the_cache_is_cleared_right_before_and_after_each_capture(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(_graphs, "_clear_cublas",
                        lambda: events.append("clear-capturing" if torch.cuda.is_current_stream_capturing()
                                              else "clear"))
    record = _graphs._CudaGraphs._record

    def recording(self, *args, **kwargs):
        events.append("capture")
        return record(self, *args, **kwargs)

    reader = _graphs._CudaGraphs._reader

    def reading(self, *args, **kwargs):
        events.append("reader")  # (the graph reading the first call's input in place, captured after it)
        return reader(self, *args, **kwargs)

    monkeypatch.setattr(_graphs._CudaGraphs, "_record", recording)
    monkeypatch.setattr(_graphs._CudaGraphs, "_reader", reading)
    block = Parallel(nn.Linear(64, 64), nn.Linear(64, 64), cuda_graph=True).cuda()
    with torch.no_grad():
        for batch in (8, 8, 16):  # two signatures, two captures
            block(torch.randn(batch, 64, device="cuda"))
    assert events == ["clear", "capture", "reader", "clear", "clear", "clear"] * 2
    assert hasattr(torch._C, "_cuda_clearCublasWorkspaces")  # the torch API the fix relies on


_SCRIPT = textwrap.dedent(
    """
    import torch
    from torch import nn
    from parallel_modules import Parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    # Long, thin products (K=8192, M=8): cuBLAS splits K and uses its workspace.
    block = Parallel(*[nn.Linear(8192, 64) for _ in range(4)], cuda_graph=True).cuda()
    with torch.no_grad():
        x = torch.randn(8, 8192, device="cuda")
        block(x)  # capture
        # What torch.compile(mode="reduce-overhead") does around its warm-ups: drop the
        # process-wide workspaces; then hand their memory to other tensors.
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        sentinels = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(64)]
        for _ in range(10):
            x = torch.randn(8, 8192, device="cuda")
            out = block(x)
            torch.cuda.synchronize()
            assert torch.equal(out, torch.cat([b(x) for b in block], 1)), "replay differs from eager"
        assert all(bool((s == 7.0).all()) for s in sentinels), "a replay wrote into another tensor"
    print("OK")
    """
)


@cuda
def test_replays_survive_clearing_the_process_wide_cache():
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr
