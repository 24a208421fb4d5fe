"""Run the FSDP2 configurations of tests/test_distributed_cuda.py many times (dev tool, not shipped).

A suspected race shows as a run that drifts from the reference; one run says little. A
control shards the whole model as "fsdp2" does with the blocks on one stream (``streams=False``).
Usage on the 2-GPU machine: ``PYTHONPATH=. python3 tools/repeat_fsdp2.py 8``
"""
import dataclasses
import sys
import tempfile

from tests import _distributed as D
from tests.test_distributed_cuda import ATOL, CONFIGS


def main() -> None:
    names = ["fsdp2", "fsdp2-branches", "fsdp2-branches-delay-in-branch-backward", "fsdp2-no-streams"]
    # The control: the whole model sharded as in "fsdp2", its blocks on one stream.
    control = dataclasses.replace(next(c for c in CONFIGS if c.name == "fsdp2"), name=names[-1], streams=False)
    configs = [c for c in CONFIGS if c.name in names] + [control]
    bad = {n: 0 for n in names}
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    for i in range(runs):
        results = D.run(configs, "nccl", tempfile.mkdtemp(), deadline_s=150)
        for n in names:
            worst = max(max(r["diffs"]) for r in D.per_rank(results, n))
            bad[n] += worst > ATOL
            print(f"run {i}: {n:<42} max |param - reference| {worst:.2e}", flush=True)
    print("drifted runs:", bad, "of", runs)


if __name__ == "__main__":  # spawned ranks import this module: they must not run it
    main()
