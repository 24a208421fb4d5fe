"""Fused MLP layers in a CUDA graph: programmatic dependent launch and tile shapes (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_triton_pdl.py [N ...]`` on the GPU machine (N MLP branches,
default 8 and 16; fp32, TF32 off, batch 8).

``_batched_linear``'s kernel takes 4 us a layer in mlp8's replay where the arithmetic is a fraction of
that: each layer waits for the one before to end, then launches, then loads its weights. With
programmatic dependent launch (sm90+), a layer is launched while the one before runs, loads its
weights (which no kernel in flight writes) and only then waits (``griddepcontrol.wait``) for the
layer before to end and flush before it reads that layer's output. The first layer of a chain is
launched as usual (whatever came before it, an optimizer step writing the weights included, has
ended before it starts). Times, interleaved, the GPU time per replay of the chain captured with:
the kernel as the library launches it, chained and not, and launched by hand without PDL, with it, and
with it in several tile shapes.
"""
import sys

import torch

from parallel_modules import _batched_linear
from _timing import events_us, gpu_medians, mlp_stacks  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def main() -> None:
    import triton

    print(f"torch {torch.__version__}  triton {triton.__version__}  {torch.cuda.get_device_name()}", flush=True)
    kernel = _batched_linear._kernel()  # (its WAIT and TRIGGER constants: the variants below)
    for n in [int(a) for a in sys.argv[1:]] or [8, 16]:
        branches, x, seq, ref, W, Bs = mlp_stacks(n)
        depth = len(W)
        rows, width, k = x.shape[0], W[-1].shape[1], W[0].shape[2]
        dot_pick, bm, bn, bk, stages = _batched_linear._blocks(rows, k, width, n, None, x.device)

        def layer(h, w, b, out, pdl, early, dot, block_n, warps, block_m=bm, block_k=bk, st=stages):
            ints = (h.shape[1], w.shape[2], w.shape[1], *h.stride(), *w.stride(), b.stride(0), *out.stride())
            grid = (-(-w.shape[1] // block_n), n)
            # (WAIT = launched dependent, TRIGGER = signals its dependents after that point.)
            kernel[grid](h, w, b, out, *ints, True, 1, dot, "tf32x3", block_m, block_n, block_k, pdl, early,
                         num_warps=warps, num_stages=st, launch_pdl=pdl)
            return out

        def chain(pdl, early, dot, block_n, warps, **kw):
            def run(inp):
                h = inp.expand(n, *inp.shape)
                for i in range(depth - 1):
                    h = layer(h, W[i], Bs[i], inp.new_empty((n, rows, W[i].shape[1])), pdl and i > 0,
                              early, dot, block_n, warps, **kw)
                joined = inp.new_empty((rows, n * width))
                layer(h, W[-1], Bs[-1], joined.as_strided((n, rows, width), (width, n * width, 1)),
                      pdl, early, dot, block_n, warps, **kw)
                return joined
            return run

        def shipped(inp, chained=True):
            h = inp.expand(n, *inp.shape)
            for i in range(depth - 1):
                h = _batched_linear.linear(h, W[i], Bs[i], inp.new_empty((n, rows, W[i].shape[1])), 1,
                                           chained=chained and i > 0)
            joined = inp.new_empty((rows, n * width))
            _batched_linear.linear(h, W[-1], Bs[-1], joined.as_strided((n, rows, width), (width, n * width, 1)), 1,
                                   chained=chained)
            return joined

        variants = {"shipped, chained": shipped, "shipped, unchained": lambda inp: shipped(inp, False),
                    "floor (one branch)": branches[0]}
        d = dot_pick
        variants[f"same, no PDL (dot={d}, bn={bn})"] = chain(False, False, d, bn, 4)
        variants[f"PDL wait only (dot={d}, bn={bn})"] = chain(True, False, d, bn, 4)
        variants[f"PDL + early trigger (dot={d}, bn={bn})"] = chain(True, True, d, bn, 4)
        if not d:
            for block_n, warps in ((4, 2), (4, 4), (8, 2), (8, 8), (16, 8), (2, 1), (4, 1)):
                variants[f"PDL early, bn={block_n}, warps={warps}"] = chain(True, True, False, block_n, warps)
            variants["PDL early, bk=128, bn=8, warps=4"] = chain(True, True, False, 8, 4, block_k=128)
            variants["PDL early, tf32x3 dot, bn=16"] = chain(True, True, True, 16, 4, block_m=16, block_k=64,
                                                             st=3)
        else:
            for block_n, warps in ((16, 4), (32, 8), (16, 2)):
                variants[f"PDL early, dot, bn={block_n}, warps={warps}"] = chain(True, True, True, block_n, warps)
            variants["PDL early, FMA bn=8 warps=4"] = chain(True, True, False, 8, 4, block_m=bm, block_k=256, st=1)
        calls = {}
        from parallel_modules.bench import _capture
        with torch.no_grad():
            for name, fn in variants.items():
                try:
                    g = _capture(fn, x)
                    err = (g(x) - ref).abs().max().item() if "floor" not in name else 0.0
                except Exception as e:  # noqa: BLE001
                    print(f"  {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                    continue
                calls[name] = (lambda g: lambda: g(x))(g)
                print(f"  {name}: max abs err {err:.2e}", flush=True)
            pdl = [getattr(getattr(launch, "compiled", None), "metadata", None) for launch in
                   _batched_linear._launchers.values()]
            print(f"mlp{n}, batch {rows}, fp32 (TF32 off); library launchers' launch_pdl: "
                  f"{sorted(str(getattr(m, 'launch_pdl', '?')) for m in pdl)}")
            med = gpu_medians(calls, rounds=30, per_sample=20)
            spin = {name: events_us(fn, 200, spin_cycles=50_000_000)[0] for name, fn in calls.items()}
            for name in calls:
                print(f"  {name:<44} {med[name]:8.2f} us/call   GPU alone {spin[name]:7.2f} us", flush=True)


if __name__ == "__main__":
    main()
