"""Record the stream timelines shown by notebooks/timeline.ipynb (dev tool, run on the GPU machine).

Profiles the Inception-style block of the benchmark (``parallel_modules/_cases.py``, batch 1, fp32,
TF32 off, eval, no grad) twice -- as the plain sequential module and as
``Parallel(..., cuda_graph=True)`` -- and writes both timelines, kernel events only, to one
compact JSON file (a few tens of kB) that can be committed::

    PYTHONPATH=. python3 tools/make_timeline_trace.py notebooks/data/inception_timeline.json
    PYTHONPATH=. python3 tools/make_timeline_trace.py "$OUT/inception_timeline.json" --plot "$OUT/timeline.png"

The file records when and where it was made (date, GPU, torch, CUDA) in its metadata.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from parallel_modules import Parallel
from parallel_modules._cases import CASES, SequentialBranches
from parallel_modules.timeline import load_timelines, record_timeline, save_timelines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="where to write the compact trace (JSON)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--calls", type=int, default=3, help="profiled calls per module")
    p.add_argument("--plot", metavar="PNG", help="also draw both timelines (needs matplotlib)")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print(f"make_timeline_trace: stream timelines need a CUDA GPU, and torch {torch.__version__} sees none; "
              "run this on the GPU machine.", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    case = CASES["inception"]
    device = "cuda"
    branches = case.branches(device, torch.float32)  # the same modules for both recordings
    x = case.make_input(args.batch, device, torch.float32)
    modules = {"eager sequential": SequentialBranches(branches, case.join, case.dim),
               "Parallel(cuda_graph=True)": Parallel(*branches, join=case.join, dim=case.dim, cuda_graph=True)}
    try:
        with torch.no_grad():
            ref = modules["eager sequential"](x)
            if not torch.equal(modules["Parallel(cuda_graph=True)"](x), ref):
                raise SystemExit("make_timeline_trace: Parallel differs from the sequential module")
            timelines = [record_timeline(m, x, calls=args.calls, label=name) for name, m in modules.items()]
    except RuntimeError as e:
        print(f"make_timeline_trace: {e}", file=sys.stderr)
        return 1
    env = {k: timelines[0].metadata.get(k) for k in ("recorded", "gpu", "torch", "cuda", "python")}
    meta = {**env, "case": "inception: 192 channels 35x35, 4 branches, cat on channels",
            "batch": args.batch, "dtype": "float32", "shape": list(x.shape), "calls": args.calls,
            "tool": "tools/make_timeline_trace.py"}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_timelines(args.out, *timelines, metadata=meta)
    for tl in load_timelines(args.out).values():  # what the notebook will read
        print(tl.summary())
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes): {env}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 2.2 * len(timelines)), sharex=True)
        for ax, tl in zip(axes, timelines):
            tl.plot(ax=ax)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
