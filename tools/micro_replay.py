"""Where the time of a graphed ``Parallel`` call goes (dev tool, not shipped).

For each case: CPU cost per call (host clock over many calls, then one sync)
and GPU time per call (events around many back-to-back calls) of

* the hand-captured multi-stream graph: replay only, + input copy, + output clone
* ``Parallel(cuda_graph=True)`` and with ``static_outputs=True``
* the pieces of the module's Python path, timed alone.

Usage: ``PYTHONPATH=. python3 tools/micro_replay.py``
"""
import statistics

import torch

from parallel_modules import Parallel
from parallel_modules import _graphs, _inputs, _streams
from parallel_modules._cases import CASES, SequentialBranches
import _timing  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")


def cpu_us(fn, n=2000):
    return _timing.cpu_us(fn, n, warmup=50, repeats=5)


def gpu_us(fn, group=20, reps=30):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    # (Each sample starts after the previous one's end event was waited for: an idle GPU.)
    return _timing.gpu_medians({"fn": fn}, rounds=reps, per_sample=group)["fn"]


def single_gpu_us(fn, reps=50):
    """GPU time of one call with an idle GPU and the CPU far ahead (graph launched, then timed)."""
    s = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000)  # let the CPU enqueue everything before the GPU starts
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        s.append(a.elapsed_time(b) * 1e3)
    return statistics.median(s)


def capture(fn, x):
    sx = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            fn(sx)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        out = fn(sx)
    return g, sx, out


rows = []
for name, batch in [("mlp8", 8), ("inception", 1), ("tiny8", 8), ("heads", 32)]:
    case = CASES[name]
    br = case.branches(dev, torch.float32)
    x = case.make_input(batch, dev, torch.float32)
    with torch.no_grad():
        seq = SequentialBranches(br)
        g_seq, sx_seq, o_seq = capture(seq, x)
        g_par, sx, o_par = capture(Parallel(*br, streams=True), x)
        P = Parallel(*br, cuda_graph=True)
        PS = Parallel(*br, cuda_graph=True, static_outputs=True)
        for _ in range(3):
            P(x), PS(x)
        variants = {
            "seq graph: replay": lambda: g_seq.replay(),
            "par graph: replay": lambda: g_par.replay(),
            "par graph: copy+replay": lambda: (sx.copy_(x), g_par.replay()),
            "par graph: copy+replay+clone": lambda: (sx.copy_(x), g_par.replay(), o_par.clone()),
            "Parallel(cuda_graph)": lambda: P(x),
            "Parallel(cuda_graph, static_outputs)": lambda: PS(x),
        }
        if name == "mlp8":
            # What fusing identical branches could give: 4 x (baddbmm + GELU) on stacked weights.
            Ws = [torch.stack([b[2 * i].weight.t() for b in br]) for i in range(4)]
            Bs = [torch.stack([b[2 * i].bias for b in br]).unsqueeze(1) for i in range(4)]

            def fused(inp):
                h = inp.expand(len(br), *inp.shape)
                for W, B in zip(Ws, Bs):
                    h = torch.nn.functional.gelu(torch.baddbmm(B, h, W))
                return torch.cat(h.unbind(0), 1)

            ref = seq(x)
            print("fused max abs err vs seq:", (fused(x) - ref).abs().max().item())
            g_f, sx_f, o_f = capture(fused, x)
            variants["fused eager"] = lambda: fused(x)
            variants["fused graph: copy+replay+clone"] = lambda: (sx_f.copy_(x), g_f.replay(), o_f.clone())
        for v, fn in variants.items():
            rows.append((name, v, cpu_us(fn), gpu_us(fn), single_gpu_us(fn)))

        pieces = {
            "_is_tracing": _streams._is_tracing,
            "_input_device": lambda: _inputs._input_device((x,), {}),
            "_capture_underway": _streams._capture_underway,
            "_signature": lambda: _inputs._signature((x,), {}, False),
            "_current_stream": lambda: _streams._current_stream(dev),
            "autocast state": _graphs._autocast_state,
            "is_inference_mode_enabled": torch.is_inference_mode_enabled,
            "x.clone()": lambda: x.clone(),
            "sx.copy_(x)": lambda: sx.copy_(x),
            "event.record()": lambda: torch.cuda.Event().record(),
            "module __call__ overhead (Identity)": lambda: torch.nn.Identity()(x),
        }
        for v, fn in pieces.items():
            rows.append((name, "piece " + v, cpu_us(fn, 5000), float("nan"), float("nan")))
    break_after = False

print(f"torch {torch.__version__} {torch.cuda.get_device_name()}")
print(f"{'case':<10}{'variant':<42}{'CPU us/call':>12}{'GPU us/call (stream)':>22}{'GPU us single':>15}")
for r in rows:
    print(f"{r[0]:<10}{r[1]:<42}{r[2]:>12.2f}{r[3]:>22.2f}{r[4]:>15.2f}")
