"""Lent outputs vs. a consumer on another stream that used record_stream (async D2H offload).

An inference loop copies each output to pinned host memory on a side copy stream,
calls y.record_stream(copy_stream) and drops y -- correct eager code: the caching
allocator will not reuse y's memory until the copy stream is done. With cuda_graph=True,
_Lending (_graphs.py: _Lending.outputs/_lend, _Graph.replay) sees the outputs dropped
before each next call and starts lending the graph's own output buffers; before a
replay it checks only reference counts (held()) and orders only against the stream of
the previous *replay* (_Graph._order), not against streams the caller recorded the
output on. The next replay then overwrites the buffer while the copy stream still has
to read it. Expected (correct library): every host copy equals that call's output.
"""
import os
import sys
import warnings

import torch
from torch import nn

NAME = "lend_record_stream"
DEV = os.environ.get("REVIEW_DEVICE", "cuda")
N = 12


def run(block, xs, cuda):
    host = [torch.empty(256, 1024, pin_memory=cuda) for _ in xs]
    side = torch.cuda.Stream() if cuda else None
    with torch.no_grad():
        for i, x in enumerate(xs):
            y = block(x)
            if cuda:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch.cuda._sleep(20_000_000)  # the copy stream is busy: it reads y late
                    host[i].copy_(y, non_blocking=True)
                y.record_stream(side)
            else:
                host[i].copy_(y)
            del y
        if cuda:
            torch.cuda.synchronize()
    return host


def main():
    from parallel_modules import Parallel

    cuda = DEV == "cuda"
    torch.manual_seed(0)
    a, b = nn.Linear(512, 512).to(DEV), nn.Linear(512, 512).to(DEV)
    graphed = Parallel(a, b, cuda_graph=True)
    eager = Parallel(a, b, cuda_graph=False)
    xs = [torch.randn(256, 512, device=DEV) for _ in range(N)]
    with torch.no_grad():
        refs = [torch.cat([a(x), b(x)], 1).cpu() for x in xs]
    got_eager = run(eager, xs, cuda)
    bad_eager = [i for i in range(N) if not torch.allclose(got_eager[i], refs[i], atol=1e-4, rtol=1e-4)]
    if bad_eager:
        return False, f"harness: eager module also wrong at calls {bad_eager}"
    got = run(graphed, xs, cuda)
    bad = [i for i in range(N) if not torch.allclose(got[i], refs[i], atol=1e-4, rtol=1e-4)]
    lent = any(g.lending.lent for g in graphed._graphs._graphs.values()) if len(graphed._graphs) else False
    if bad:
        later = [i for i in bad if any(torch.allclose(got[i], refs[j], atol=1e-4, rtol=1e-4) for j in range(i + 1, N))]
        return False, (f"async host copies of calls {bad} are wrong ({len(later)} of them hold a LATER call's "
                       f"output: the replay overwrote a lent buffer still being read); graph lending={lent}")
    return True, ""


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if DEV == "cuda" and not torch.cuda.is_available():
        print(f"FAIL {NAME}: no CUDA device")
        sys.exit(0)
    try:
        ok, detail = main()
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()
        ok, detail = False, f"exception {type(e).__name__}: {msg[0][:300] if msg else ''}"
    print(f"PASS {NAME}" if ok else f"FAIL {NAME}: {detail}")
