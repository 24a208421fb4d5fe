"""The fork/join protocol's shortcuts to torch's C bindings (``parallel_modules._streams``)."""
import pytest
import torch

from parallel_modules import _streams

cuda = pytest.mark.cuda


@cuda
def test_the_c_bindings_behind_the_fast_fork_join_exist():
    # _streams falls back to the public API when a torch release drops these,
    # correct but several microseconds slower per branch: this test notices.
    for name in ("_cuda_getCurrentStream", "_cuda_setStream", "_cuda_isCurrentStreamCapturing"):
        assert callable(getattr(torch._C, name, None)), name
    assert _streams._record is torch._C._CudaEventBase.record
    assert _streams._wait is torch._C._CudaEventBase.wait


@cuda
def test_stream_capturing_follows_a_capture():
    assert _streams._stream_capturing() is False
    x = torch.zeros(4, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            seen = _streams._stream_capturing()
            x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    assert seen is True and _streams._stream_capturing() is False


@cuda
def test_side_streams_never_include_the_callers_stream():
    dev = torch.device("cuda")
    pool = _streams._pool(dev)
    pool.side_streams(0, 4)
    caller = pool.streams[1]
    sides = pool.side_streams(0, 3, caller)
    assert len(sides) == 3 and caller not in sides and len({s.stream_id for s in sides}) == 3
    assert pool.side_streams(0, 3, torch.cuda.current_stream(dev)) == pool.streams[:3]


@cuda
def test_a_caller_on_one_of_the_pools_streams_still_forks_beside_itself():
    # torch.cuda.Stream() cycles through the same 32 streams the pool takes: a
    # user's stream can be a side stream. Branches must then go elsewhere.
    from parallel_modules import Parallel
    from tests._helpers import mlp

    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(torch.cuda.current_stream())
            return x * 2

    p = Parallel(mlp(64, 64), Probe(), Probe(), streams=True).cuda()
    caller = _streams._pool(torch.device("cuda")).side_streams(0, 2)[0]
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        expected = torch.cat([p[0](x), x * 2, x * 2], 1)
        caller.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(caller):
            out = p(x)
        torch.cuda.current_stream().wait_stream(caller)
    assert caller not in seen[-2:] and seen[-2] != seen[-1]
    assert torch.equal(out, expected)
