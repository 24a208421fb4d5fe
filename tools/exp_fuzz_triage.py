r"""Triage failing seeds of ``tools/exp_gpu_fuzz.py``: each seed as drawn, then with ``cuda_graph``, fusion
or streams switched off in the block alone (the case's draws unchanged), to tell which one the failure
needs (dev tool, not shipped).

    PYTHONPATH=. python3 tools/exp_gpu_fuzz.py ...            # prints FAIL seed=S lines
    PYTHONPATH=. python3 tools/exp_fuzz_triage.py S [S ...]
"""
import sys
import warnings

import torch

sys.path.insert(0, "tools")
import exp_gpu_fuzz as fz  # noqa: E402

warnings.filterwarnings("ignore")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
original = fz.Case.make_block


def variant(**override):
    def make_block(self, branches):
        saved = {k: getattr(self, k) for k in override}
        for k, v in override.items():
            setattr(self, k, v)
        try:
            return original(self, branches)
        finally:
            for k, v in saved.items():
                setattr(self, k, v)
    return make_block


VARIANTS = {"as drawn": {}, "no graph": {"cuda_graph": False}, "graph, fuse=False": {"fuse": False},
            "graph, streams=False": {"streams": False}, "static_outputs=False": {"static_outputs": False},
            "direct_grads=False": {"direct_grads": False}}
for seed in map(int, sys.argv[1:]):
    print(f"seed {seed}: {fz.make_case(seed, dev).describe()}")
    for name, override in VARIANTS.items():
        fz.Case.make_block = variant(**override)
        try:
            fz.run_case(seed, dev)
            print(f"  {name:22s} ok")
        except Exception as e:
            print(f"  {name:22s} {type(e).__name__}: {str(e).splitlines()[0][:150]}")
    fz.Case.make_block = original
