"""Host cost of launching a graph against the Python around it (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/micro_graphlaunch.py [CASE ...]`` (default mlp8 tiny2). Per case:
host microseconds per call (many calls, then one sync) and GPU microseconds per call of

* ``seq graph replay``: the branches one after another captured by hand, ``replay()`` alone;
* ``forked graph replay``: a ``Parallel`` (streams) captured by hand, ``replay()`` alone;
* the ``cuda_graph=True`` modules (unfused and fused): the whole call, the graph's ``replay()``
  alone, and ``_Graph.replay`` (copy-in, replay, outputs) alone.

The difference between a forked graph's ``replay()`` and a straight one is the driver's; the rest
between ``replay()`` and the module call is ours.
"""
import sys

import torch

from parallel_modules import Parallel
from parallel_modules._cases import CASES, SequentialBranches
from _timing import cpu_us, gpu_medians, graph_by_hand, profile  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")


for name in sys.argv[1:] or ["mlp8", "tiny2"]:
    case = CASES[name]
    br = case.branches(dev, torch.float32)
    x = case.make_input(case.batches[0], dev, torch.float32)
    with torch.no_grad():
        # First: fuse=True stacks the branches' parameters into new memory, which graphs read by address.
        modules = {"graph Parallel": Parallel(*br, cuda_graph=True),
                   "graph fused": Parallel(*br, cuda_graph=True, fuse=True)}
        seq_g = graph_by_hand(SequentialBranches(br), x)
        fork_g = graph_by_hand(Parallel(*br, streams=True), x)
        calls = {"seq graph replay()": seq_g.replay, "forked graph replay()": fork_g.replay}
        for label, m in modules.items():
            for _ in range(40):
                m(x)
            graph = next(iter(m._graphs._graphs.values()))
            calls[f"{label}: call"] = lambda m=m: m(x)
            calls[f"{label}: replay()"] = graph.fwd.replay
            calls[f"{label}: _Graph.replay"] = lambda g=graph: g.replay([x], False)
        gpu = gpu_medians(calls)
        print(f"==== {name} batch {case.batches[0]} fp32 ({torch.cuda.get_device_name()}, torch {torch.__version__})")
        for label, fn in calls.items():
            print(f"{label:<36}{cpu_us(fn):9.2f} us CPU/call {gpu[label]:9.2f} us GPU/call")
        profile(f"{name} graph fused call", calls["graph fused: call"], top=22)

# The pieces of a graphed call, each alone (host microseconds per call).
from parallel_modules._graphs import _autocast_state  # noqa: E402
from parallel_modules._inputs import _input_device, _signature  # noqa: E402
from parallel_modules._streams import _capture_underway, _current_stream, _is_tracing  # noqa: E402

case = CASES["tiny2"]
x = case.make_input(case.batches[0], dev, torch.float32)
with torch.no_grad():
    m = Parallel(*case.branches(dev, torch.float32), cuda_graph=True)
    for _ in range(40):
        m(x)
    graph = next(iter(m._graphs._graphs.values()))
    static = graph.inputs[0]
    lock = graph.lock

    def locked():
        with lock:
            pass

    pieces = {
        "module call": lambda: m(x),
        "nn.Module.__call__ -> forward (Identity)": (lambda ident=torch.nn.Identity(): ident(x)),
        "_is_tracing()": _is_tracing,
        "_input_device": lambda: _input_device((x,), {}),
        "_capture_underway()": _capture_underway,
        "_signature": lambda: _signature((x,), {}, False),
        "is_inference_mode_enabled + autocast": lambda: (torch.is_inference_mode_enabled(), _autocast_state()),
        "lock": locked,
        "lending.held()": graph.lending.held,
        "_current_stream": lambda: _current_stream(x.device),
        "static.copy_(x)": lambda: static.copy_(x),
        "_foreach_copy_([static], [x])": lambda: torch._foreach_copy_([static], [x]),
        "torch.add(x, 0, out=static)": lambda: torch.add(x, 0, out=static),
        "fwd.replay()": graph.fwd.replay,
        "_CUDAGraph.replay(fwd) (no wrapper)": lambda: torch._C._CUDAGraph.replay(graph.fwd),
        "o.detach()": lambda: graph.outputs[0].detach(),
    }
    print("==== pieces of a tiny2 graphed call")
    for label, fn in pieces.items():
        print(f"{label:<42}{cpu_us(fn, n=4000):9.2f} us CPU/call")
