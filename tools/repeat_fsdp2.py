"""Run the FSDP2 configurations of tests/test_distributed_cuda.py many times (dev tool, not shipped).

A suspected race shows as a run that drifts from the reference; one run says little.
Usage on the 2-GPU machine: ``PYTHONPATH=. python3 tools/repeat_fsdp2.py 8``
"""
import sys
import tempfile

from tests import _distributed as D
from tests.test_distributed_cuda import ATOL, CONFIGS

names = ["fsdp2", "fsdp2-branches", "fsdp2-branches-delay-in-branch-backward"]
configs = [c for c in CONFIGS if c.name in names]
bad = {n: 0 for n in names}
runs = int(sys.argv[1]) if len(sys.argv) > 1 else 8
for i in range(runs):
    results = D.run(configs, "nccl", tempfile.mkdtemp(), deadline_s=150)
    for n in names:
        worst = max(max(r["diffs"]) for r in D.per_rank(results, n))
        bad[n] += worst > ATOL
        print(f"run {i}: {n:<42} max |param - reference| {worst:.2e}", flush=True)
print("drifted runs:", bad, "of", runs)
