"""Does a multi-stream graph cost the host less to launch with fewer streams? (dev tool, not shipped)

A straight-line graph (one stream) launches in about constant host time, a graph with branches in
time growing with its nodes (graph seq mlp8, 64 kernels: ~20 us of host a call; the 8-stream graph
of the same kernels: ~58 us on the H200 machine's slower spells, where the replay is host-bound).
This captures N identical branches by hand on k lanes (lane j runs branches j, j+k, ... one after
another), k = 1, 2, 4, ..., N, then prints per k, microseconds per replay three ways: host time
(replays back to back, then a synchronize), the benchmark's time (events around 20 replays after a
synchronize), the GPU's alone (the same replays queued behind a spin kernel) and the host's
time to issue those (it does not wait for the GPU); and the same for the library's
``Parallel(cuda_graph=True)`` called as a module, and its graph's ``_Graph.replay`` alone (the input
copied in, the replay, the outputs: the module's call less its checks and cache key).

Usage: ``PYTHONPATH=. python3 tools/exp_graph_lanes.py [case ...]`` (default mlp8 mlp16 tiny8).
"""
import statistics
import sys

import torch

from parallel_modules import Parallel
from parallel_modules._cases import CASES
from _timing import events_us, graph_by_hand, host_us  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
CALLS = 20


def lanes_graph(branches, x, k):
    r"""``branches`` on ``x`` captured on ``k`` lanes (forked and joined with events), joined by cat."""
    sides = [torch.cuda.Stream() for _ in range(k - 1)]

    def body(static):
        caller = torch.cuda.current_stream()
        fork = torch.cuda.Event()
        fork.record(caller)
        outs = [None] * len(branches)
        joins = []
        for j in range(k):
            stream = caller if j == 0 else sides[j - 1]
            with torch.cuda.stream(stream):
                if j:
                    stream.wait_event(fork)
                for i in range(j, len(branches), k):
                    outs[i] = branches[i](static)
                if j:
                    e = torch.cuda.Event()
                    e.record(stream)
                    joins.append(e)
        for e in joins:
            caller.wait_event(e)
        made.append(torch.cat(outs, 1))

    made = []
    g = graph_by_hand(body, x)
    g.out = made[-1]  # (the capture's: the graph's output buffer)
    return g


for name in sys.argv[1:] or ["mlp8", "mlp16", "tiny8"]:
    case = CASES[name]
    br = case.branches(dev, torch.float32)
    x = case.make_input(8, dev, torch.float32)
    n = len(br)
    with torch.no_grad():
        ref = torch.cat([b(x) for b in br], 1)
        ks = [k for k in (1, 2, 4, 8, 16) if k <= n]
        graphs = {k: lanes_graph(br, x, k) for k in ks}
        for k, g in graphs.items():
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(g.out, ref), k
        calls = {f"{k} lane(s)": g.replay for k, g in graphs.items()}
        calls.update({f"{k} lane(s) + copy in": (lambda g=g: (g.static.copy_(x), g.replay())) for k, g in graphs.items()})
        module = Parallel(*br, cuda_graph=True)  # (unfused: reads the branches' parameters where they are)
        calls["Parallel(cuda_graph=True)"] = lambda: module(x)
        for _ in range(40):
            module(x)  # (captured; lends its output buffers once it sees each output dropped in time)
        graph = next(iter(module._graphs._graphs.values()))
        calls["  its _Graph.replay"] = lambda: graph.replay([x], False)  # (copy in, replay, outputs)
        for fn in calls.values():
            for _ in range(30):
                fn()
        spin = int(200e-6 * CALLS * 1.7e9)
        rows = {c: ([], [], [], []) for c in calls}
        for _ in range(15):
            for c, fn in calls.items():
                h, e, gpu, issue = rows[c]
                h.append(host_us(fn, CALLS))
                e.append(events_us(fn, CALLS)[0])
                g, i = events_us(fn, CALLS, spin)
                gpu.append(g)
                issue.append(i)
        print(f"==== {name} batch 8 fp32, {n} branches ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}); us per replay, median of 15 samples of {CALLS}")
        print(f"{'':<28}{'host':>9}{'events':>9}{'GPU alone':>11}{'issue':>9}")
        for c, cols in rows.items():
            print(f"{c:<28}" + "".join(f"{statistics.median(v):{w}.1f}" for v, w in zip(cols, (9, 9, 11, 9))))
