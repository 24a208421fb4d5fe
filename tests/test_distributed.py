"""``Parallel`` and ``ParallelSequential`` inside DDP and FSDP2, on the CPU with gloo.

Two processes (``torch.multiprocessing``, spawn; loopback rendezvous on a free port) train
the model of ``tests/_distributed.py`` for ``STEPS`` steps, each on half of every global
batch; after every step the parameters must equal, within ``ATOL`` (fp32), those of a
reference trained in the same process on the whole batch without any wrapper, and be
bit-for-bit the same on both ranks. On the CPU the blocks run their branches and
micro-batches one after the other, so this covers the wiring: gradient hooks, bucket views,
static graphs, unused branches, sharded parameters. The GPU version, with streams, graphs
and delays, is ``test_distributed_cuda.py``. Every configuration runs in the same two
processes (one start-up of a few seconds); the processes are killed after ``DEADLINE_S``.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests import _distributed as D

# fp32: the reference adds up 16 samples where each rank adds 8 and DDP averages the two
# (measured: at most 3e-8 after 4 steps, parameters of magnitude 0.35).
ATOL = 1e-6
DEADLINE_S = 120

CONFIGS = [
    D.Config("ddp"),
    D.Config("ddp-gradient-as-bucket-view", ddp={"gradient_as_bucket_view": True}),
    D.Config("ddp-static-graph", ddp={"static_graph": True}),
    D.Config("ddp-find-unused-branch", ddp={"find_unused_parameters": True}, use_c=False),
    D.Config("ddp-fused", fuse=True),
    D.Config("fsdp2", wrapper="fsdp2"),
    D.Config("fsdp2-branches", wrapper="fsdp2-branches"),
    D.Config("control-no-averaging", wrapper="none"),  # must NOT match: proves the comparison
]
NAMES = [c.name for c in CONFIGS]

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo not available")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return D.run(CONFIGS, "gloo", tmp_path_factory.mktemp("gloo"), deadline_s=DEADLINE_S)




@pytest.mark.parametrize("name", [n for n in NAMES if not n.startswith("control")])
def test_parameters_match_single_process_reference_after_every_step(results, name):
    for rank, r in enumerate(D.per_rank(results, name)):
        assert len(r["diffs"]) == D.STEPS
        worst = max(r["diffs"])
        assert worst <= ATOL, f"rank {rank}: max |param - reference| per step {r['diffs']}"
        assert r["ranks_equal"], f"rank {rank}: parameters differ from rank 0's"


def test_comparison_catches_unaveraged_gradients(results):
    # Without a wrapper each rank follows its own half batch: far from the reference.
    per_rank = D.per_rank(results, "control-no-averaging")
    for r in per_rank:
        assert min(r["diffs"]) > 100 * ATOL
    assert not per_rank[1]["ranks_equal"]  # (rank 0 compares with itself)
