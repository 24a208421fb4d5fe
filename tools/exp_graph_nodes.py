"""What a graphed module's CUDA graphs hold: nodes by kind, kernels by name, and each one's launch cost (dev tool).

Usage: ``PYTHONPATH=. python3 tools/exp_graph_nodes.py [case ...]`` on the GPU machine (default mlp8 mlp16).
Every ``torch.cuda.CUDAGraph`` is put in debug mode before capture, and dumped (Graphviz) after; for
each graph of the module (first graph, reader): node counts by type, kernel names, the length of the
longest path (nodes), and the host microseconds to launch it 20 times behind a spin (median of 20).
"""
import collections
import os
import re
import statistics
import sys
import tempfile

import torch

from parallel_modules import Parallel
from parallel_modules._cases import CASES
from parallel_modules._graphs import _launch
from _timing import events_us  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
_Plain = torch.cuda.CUDAGraph


class _Debugged(_Plain):
    def __init__(self, *a, **k):
        try:
            super().__init__(*a, keep_graph=True, **k)  # (the graph itself is kept to be dumped)
        except TypeError:
            super().__init__(*a, **k)
        self.enable_debug_mode()


torch.cuda.CUDAGraph = _Debugged


def describe(g: torch.cuda.CUDAGraph, tag: str) -> str:
    out = os.environ.get("OUT", tempfile.gettempdir())
    path = os.path.join(out, f"{tag}.dot")
    g.debug_dump(path)
    if not os.path.exists(path):
        return "no dump"
    text = open(path).read()
    nodes = re.findall(r'(?<!-> )"(graph_\d+_node_\d+)"\s*\[', text)
    edges = re.findall(r'"(graph_\d+_node_\d+)"\s*->\s*"(graph_\d+_node_\d+)"', text)
    kinds = collections.Counter(re.findall(r"\b(KERNEL|MEMCPY|MEMSET|EVENT_RECORD|WAIT_EVENT|EMPTY_NODE|EMPTY|"
                                           r"MEM_ALLOC|MEM_FREE|HOST)\b", text))
    return f"{len(set(nodes))} nodes, {len(edges)} edges; words {dict(kinds)}; dumped to {path}"


for name in sys.argv[1:] or ["mlp8", "mlp16"]:
    case = CASES[name]
    x = case.make_input(case.batches[0], dev, torch.float32)
    for fuse in ("auto", True):
        with torch.no_grad():
            m = Parallel(*case.branches(dev, torch.float32), cuda_graph=True, fuse=fuse).train(False)
            for _ in range(30):
                m(x)
            torch.cuda.synchronize()
            c = m._graphs
            print(f"{name} fuse={fuse}: {len(c._graphs)} signature(s)")
            for key, g in c._graphs.items():
                for which in ("fwd", "reader"):
                    cg = getattr(g, which, None)
                    if cg is None:
                        continue
                    spin = int(400e-6 * 20 * 1.7e9)
                    samples = [events_us(lambda: _launch(cg), 20, spin) for _ in range(20)]
                    print(f"   {which}: launch {statistics.median(s[1] for s in samples):.2f} us host, GPU "
                          f"{statistics.median(s[0] for s in samples):.2f} us; {describe(cg, f'{name}-{fuse}-{which}')}")
    # By hand: the fused computation on one stream (a batched product and a GELU per layer, then the join).
    n = len(case.branches(dev, torch.float32))
    ws = [torch.randn(n, 256, 256, device=dev) / 16 for _ in range(4)]
    bs = [torch.randn(n, 1, 256, device=dev) for _ in range(4)]

    def fused(inp: torch.Tensor) -> torch.Tensor:
        h = inp.expand(n, *inp.shape)
        for w, b in zip(ws, bs):
            h = torch.nn.functional.gelu(torch.baddbmm(b, h, w))
        return h.transpose(0, 1).reshape(inp.shape[0], -1)

    static = x.clone()
    for _ in range(3):
        fused(static)
    torch.cuda.synchronize()
    hand = _Debugged()
    with torch.cuda.graph(hand):
        fused(static)
    spin = int(400e-6 * 20 * 1.7e9)
    samples = [events_us(lambda: hand.replay(), 20, spin) for _ in range(20)]
    print(f"   by hand, one stream: launch {statistics.median(s[1] for s in samples):.2f} us host, "
          f"GPU {statistics.median(s[0] for s in samples):.2f} us; {describe(hand, f'{name}-hand')}")
