"""Which launch order and high-priority stream make the graphed Inception block fastest? (dev tool, not shipped)

Captures ``Parallel(cuda_graph=True)`` of the Inception block once per variant (``_graph_variants``
forced to that one), combinations of a launch order and a high-priority side slot among them, and times
each as the module is called (GPU time per call over groups of calls, interleaved rounds, medians), with
the sequential graph captured by hand beside them.
Usage: ``PYTHONPATH=. python3 tools/exp_inception_variants.py [batch] [fp32|fp16]``
"""
import sys

import torch

from parallel_modules import Parallel
from parallel_modules._cases import CASES, SequentialBranches as Seq
from parallel_modules.bench import _capture
from parallel_modules.parallel import _Order, _Priority
from _timing import gpu_medians  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
DEV = torch.device("cuda")
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
dtype = torch.float16 if "fp16" in sys.argv else torch.float32
case = CASES["inception"]
x = case.make_input(batch, DEV, dtype)
base = Parallel(*case.branches(DEV, dtype), cuda_graph=True)
longest = base._longest_first((x,), {})
print("branches longest first:", longest)
n = len(base)
variants = {"branch order": None, "longest first": (_Order(longest),)}
variants.update({f"slot {k} high": (_Priority(k),) for k in range(1, n)})
# The longest on the first side slot, high priority, after each other branch on the capture stream.
for first in longest[1:]:
    rest = [i for i in longest if i != first and i != longest[0]]
    variants[f"{first} then longest high"] = (_Order((first, longest[0], *rest)), _Priority(1))
# Longest first on the capture stream, and the second longest on a high side stream.
variants["longest first, 2nd high"] = (_Order(longest), _Priority(1))
mods = {}
with torch.no_grad():
    seq = Seq(list(base))
    ref = seq(x)
    mods["graph seq (by hand)"] = _capture(seq, x, in_place=True)
    for name, v in variants.items():
        m = Parallel(*case.branches(DEV, dtype), cuda_graph=True)
        m.load_state_dict(base.state_dict())
        m._graph_variants = lambda a, k, first_only=False, v=v: [v]
        out = m(x)
        assert dtype != torch.float32 or torch.equal(out, ref), name
        mods[name] = m
    for r in range(3):
        times = gpu_medians({k: (lambda m=m: m(x)) for k, m in mods.items()}, rounds=40, per_sample=20)
        print(f"-- round {r}: b{batch} {str(dtype)[6:]}")
        for k, t in times.items():
            print(f"{k:<28}{t:8.1f} us   seq graph / this {times['graph seq (by hand)'] / t:5.2f}x")
