"""The benchmark's graphed mlp16 modes with its calls per sample set by the reference, and by each mode (dev tool).

Usage: ``PYTHONPATH=. python3 tools/exp_bench_group.py [case ...]`` on the GPU machine (default mlp16).
The benchmark sizes a case's samples by its eager sequential call (``_SAMPLE_S`` of it, at most
``--group`` calls): mlp16's 2.5 ms call gives samples of 8 calls, which every mode, fast or slow, then
uses, each sample starting from an idle GPU. Run twice per case in one process, alternated: as it
is, and with samples of 20 calls (``_SAMPLE_S`` raised), printing each graph mode's median, host
median and ratio to the floor.
"""
import sys

import torch

import parallel_modules.bench as B

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
default = B._SAMPLE_S
for name in sys.argv[1:] or ["mlp16"]:
    case = B.CASES[name]
    for round_ in range(2):
        for sample_s in (default, 0.1):
            B._SAMPLE_S = sample_s
            r = B.run_case(case, case.batches[0], torch.float32, dev, 30, 20, False, ["graph"])
            print(f"{name} round {round_} _SAMPLE_S={sample_s}: floor {r['floor_us']:.1f} us, probe "
                  f"{r['host_probe_us']:.1f} us")
            for mode, v in r["modes"].items():
                print(f"   {mode:<28} {v['median_us']:7.1f} us (host {v['host_median_us']:6.1f}) runs {v['runs']:4d}"
                      f"  x floor {v['x_floor']:.2f}")
