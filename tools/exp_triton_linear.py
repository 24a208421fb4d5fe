"""Fused MLP branches in a CUDA graph with ``_batched_linear``'s kernel: one per layer (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_triton_linear.py [N ...]`` on the GPU machine (N MLP branches,
default 8 and 16; fp32, TF32 off, batch 8).

Times, interleaved in one process, the GPU time per replay of: the floor (one branch captured alone),
the library's graphed streams and fused calls, the fused computation captured by hand with the kernel
(both ways of ``_batched_linear._blocks``: CUDA-core FMAs, tensor cores with tf32x3, and the one it
picks), and with cuBLAS (the library's layouts before the kernel); and lists the kernels of one replay.
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from parallel_modules import Parallel, _batched_linear
from parallel_modules._cases import CASES
from parallel_modules.bench import _capture
from _timing import events_us, gpu_medians, mlp_stacks  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def kernels(fn) -> str:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    return ", ".join(f"{e.device_time:.1f} {e.name[:12]}" for e in ev)


def main() -> None:
    import triton

    print(f"torch {torch.__version__}  triton {triton.__version__}  {torch.cuda.get_device_name()}")
    dev, dt = torch.device("cuda"), torch.float32
    for n in [int(a) for a in sys.argv[1:]] or [8, 16]:
        case = CASES[f"mlp{n}"]
        branches, x, seq, ref, W, Bs = mlp_stacks(n)
        depth = len(W)
        rows, width = x.shape[0], W[-1].shape[1]

        def chain(dot):
            def run(inp):
                h = inp.expand(n, *inp.shape)
                for k in range(depth - 1):
                    h = _batched_linear.linear(h, W[k], Bs[k], inp.new_empty((n, rows, W[k].shape[1])), 1, dot)
                joined = inp.new_empty((rows, n * width))
                _batched_linear.linear(h, W[-1], Bs[-1], joined.as_strided((n, rows, width), (width, n * width, 1)),
                                       1, dot)
                return joined
            return run

        def cublas(inp):
            h = inp.expand(n, *inp.shape)
            for k in range(depth):
                h = torch.nn.functional.gelu(torch.baddbmm(Bs[k].unsqueeze(1), h, W[k].mT))
            return h.transpose(0, 1).flatten(1)

        calls = {}
        with torch.no_grad():
            for name, fn in (("floor (one branch)", branches[0]), ("graph seq", seq), ("cuBLAS by hand", cublas),
                             ("kernel FMA", chain(False)), ("kernel tf32x3", chain(True)),
                             ("kernel as picked", chain(None))):
                g = _capture(fn, x)
                if name != "floor (one branch)":
                    print(f"  {name}: max abs err {(g(x) - ref).abs().max().item():.2e}")
                calls[name] = (lambda g: lambda: g(x))(g)
            for name, kw in (("graph Parallel streams", dict(streams=True)), ("graph Parallel fused", dict(fuse=True))):
                m = Parallel(*case.branches(dev, dt), cuda_graph=True, **kw).eval()
                for _ in range(3):
                    m(x)
                print(f"  {name}: max abs err {(m(x) - ref).abs().max().item():.2e}")
                calls[name] = (lambda m: lambda: m(x))(m)
            print(f"mlp{n}, batch {rows}, fp32 (TF32 off)")
            med = gpu_medians(calls, rounds=30, per_sample=20)
            spin = {name: events_us(fn, 200, spin_cycles=50_000_000)[0] for name, fn in calls.items()}
            floor = spin["floor (one branch)"]
            for name, fn in calls.items():
                print(f"  {name:<28} {med[name]:8.2f} us/call   GPU alone {spin[name]:7.2f} us (x floor "
                      f"{spin[name] / floor:4.2f})   kernels: {kernels(fn)}")


if __name__ == "__main__":
    main()
