"""What a training CUDA graph hands the parameters of heads no loss uses (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_unused_heads_graphed.py`` on the GPU machine. Eagerly (fused or
not) a head whose output the loss leaves out gets no gradient (``.grad`` stays ``None``); a training graph
hands every output a gradient, as ``torch.cuda.make_graphed_callables`` does. Prints, for each mode, what
the unused heads' ``.grad`` hold after one step whose loss reads head 0 alone.
"""
import torch
from torch import nn

from parallel_modules import Parallel

dev = torch.device("cuda")
for fuse in (False, True):
    for graph in (False, True):
        torch.manual_seed(0)
        block = Parallel(*[nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)) for _ in range(3)],
                         join=None, fuse=fuse, cuda_graph=graph).to(dev)
        for _ in range(3):  # (a graph captures on a later call)
            block.zero_grad(set_to_none=True)
            block(torch.randn(8, 16, device=dev))[0].pow(2).sum().backward()
        torch.cuda.synchronize()
        heads = []
        for j in (1, 2):
            g = block[j][0].weight.grad
            heads.append("None" if g is None else "zeros" if not g.any() else "nonzero")
        print(f"fuse={fuse!s:5} cuda_graph={graph!s:5} unused heads' .grad: {heads}; head 0's set: "
              f"{block[0][0].weight.grad is not None}")
