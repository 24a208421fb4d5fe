"""Micro-benchmark of the CPU cost of fork/join primitives (dev tool, not shipped)."""
import time, torch
from torch import nn
torch.cuda.init()
dev = torch.device("cuda")
s1 = torch.cuda.Stream(); cur = torch.cuda.current_stream()
ev = torch.cuda.Event(); x = torch.randn(8, 16, device=dev); lin = nn.Linear(16, 16).cuda()
N = 20000
def t(name, fn):
    for _ in range(200): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(N): fn()
    dt = (time.perf_counter() - t0) / N * 1e6
    torch.cuda.synchronize()
    print(f"{name:<40}{dt:8.2f} us")
sid, sdi, sdt = s1.stream_id, s1.device_index, s1.device_type
cid, cdi, cdt = cur.stream_id, cur.device_index, cur.device_type
t("noop lambda", lambda: None)
t("torch.cuda.current_stream()", lambda: torch.cuda.current_stream())
t("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev))
t("set_stream x2 (public)", lambda: (torch.cuda.set_stream(s1), torch.cuda.set_stream(cur)))
t("_cuda_setStream x2 (C)", lambda: (torch._C._cuda_setStream(sid, sdi, sdt), torch._C._cuda_setStream(cid, cdi, cdt)))
t("Event.record(stream) public", lambda: ev.record(cur))
t("_CudaEventBase.record (C)", lambda: torch._C._CudaEventBase.record(ev, cur))
t("stream.wait_event public", lambda: s1.wait_event(ev))
t("_CudaEventBase.wait (C)", lambda: torch._C._CudaEventBase.wait(ev, s1))
t("record_stream", lambda: x.record_stream(s1))
t("torch.cuda.Event()", lambda: torch.cuda.Event())
t("Event()+record", lambda: torch.cuda.Event().record(cur))
t("tiny Linear fwd", lambda: lin(x))
t("x + x", lambda: x + x)
t("is_current_stream_capturing", lambda: torch.cuda.is_current_stream_capturing())
t("torch.compiler.is_compiling", lambda: torch.compiler.is_compiling())
t("torch.cuda.current_device", lambda: torch.cuda.current_device())
def fj():
    ev.record(cur); s1.wait_event(ev); torch.cuda.set_stream(s1); y = lin(x); ev.record(s1); torch.cuda.set_stream(cur); cur.wait_event(ev); y.record_stream(cur)
t("full fork/join of 1 Linear (public)", fj)
def fj_c(record=True):
    _rec(ev, cur); _wait(ev, s1); _set(sid, sdi, sdt); y = lin(x); _rec(ev, s1); _set(cid, cdi, cdt); _wait(ev, cur)
    if record:
        y.record_stream(cur)
_rec, _wait, _set = torch._C._CudaEventBase.record, torch._C._CudaEventBase.wait, torch._C._cuda_setStream
t("full fork/join of 1 Linear (C bindings)", fj_c)
t("  the same without record_stream", lambda: fj_c(False))
t("  Linear alone", lambda: lin(x))
def alloc_free(record):
    y = torch.empty(8, 16, device=dev)
    if record:
        y.record_stream(s1)
t("empty(8,16) + free", lambda: alloc_free(False))
t("empty(8,16) + record_stream + free", lambda: alloc_free(True))
ss = [torch.cuda.Stream() for _ in range(16)]
lins = [nn.Linear(16, 16).cuda() for _ in range(16)]
def same():
    for l in lins: l(x)
def switched():
    for s, l in zip(ss, lins):
        torch.cuda.set_stream(s); l(x)
    torch.cuda.set_stream(cur)
def switched_ew():
    for s in ss:
        torch.cuda.set_stream(s); x * 2.0
    torch.cuda.set_stream(cur)
def same_ew():
    for s in ss: x * 2.0
t("16 Linear same stream", same)
t("16 Linear, stream switch each (no events)", switched)
t("16 x*2 same stream", same_ew)
t("16 x*2, stream switch each", switched_ew)
from parallel_modules import Parallel
p = Parallel(*lins, streams=True); q = Parallel(*lins, streams=False)
t("Parallel(16 Linear) streams=True", lambda: p(x))
t("Parallel(16 Linear) streams=False", lambda: q(x))
t("16 Linear + cat", lambda: torch.cat([l(x) for l in lins], 1))
