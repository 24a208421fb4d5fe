"""Whole models containing ``Parallel`` and ``ParallelSequential``, nested both ways, traced by compilers.

What the traced graph contains (decided, and checked here on every torch release CI runs):
while ``torch.export`` (strict and non-strict) or ``torch.compile`` traces a model, both
modules take their tracing path -- detected with ``torch.compiler.is_compiling()``, a
documented public API -- and run their branches, stages and micro-batches one after another.
The graph therefore holds exactly the operations of the same model written without the
library (``Plain`` below: the branches called in a loop, micro-batches split with
``tensor_split`` and joined with ``torch.cat``), and no stream, event or ``record_stream``
operation and no stream annotation (``torch.ops.streams.*``, ``node.meta["custom"]["stream"]``,
which dynamo emits for stream code since torch 2.10). The compiler, or TensorRT, schedules
the independent branches. Should a torch release stop taking that path (for instance
``is_compiling()`` turning false under one of the tracers, or dynamo tracing through our
fork/join), the graph comparisons below fail; on CUDA the eager path would put stream ops
into the graph, on the CPU the op counts and the probe test catch it.

Tolerances: exported programs run the same ATen operations as eager and are compared
bit-for-bit in fp32 (TF32 off). Inductor may fuse and reorder floating-point work:
compiled outputs and gradients are compared with rtol=1e-5, atol=1e-6 on the CPU (measured:
max abs error 3e-8 on outputs, 2.4e-7 on gradients) and rtol=1e-4, atol=1e-5 on CUDA.
"""

from __future__ import annotations

import collections
import io
import operator
import warnings

import pytest
import torch
from torch import nn

from parallel_modules import Parallel, ParallelSequential
from tests._helpers import cpu_and_cuda
from tests._reference import assert_close, assert_same, join_reference
from tests._helpers import fresh_dynamo, mlp  # noqa: F401 (fresh_dynamo: an autouse fixture)

CPU_TOL = (1e-5, 1e-6)
CUDA_TOL = (1e-4, 1e-5)


def tol(device: str) -> tuple[float, float]:
    return CUDA_TOL if device == "cuda" else CPU_TOL




def make_model(kind: str, **settings) -> nn.Module:
    r"""Models nesting both modules; ``settings`` go to every block (e.g. ``compile=``)."""
    torch.manual_seed(0)
    if kind == "parallel_of_pipeline":  # a ParallelSequential as one branch of a Parallel
        return nn.Sequential(
            nn.Linear(16, 16), nn.ReLU(),
            Parallel(nn.Linear(16, 8), mlp(),
                     ParallelSequential(nn.Linear(16, 16), nn.Tanh(), mlp(), chunks=2, **settings),
                     join="cat", streams=True, **settings),
            nn.Linear(24, 4),
        )
    if kind in ("pipeline_of_parallel_c1", "pipeline_of_parallel_c4"):  # Parallel as a stage
        chunks = int(kind[-1])
        return ParallelSequential(
            nn.Linear(16, 16),
            Parallel(nn.Linear(16, 16), mlp(16, 16), join="sum", streams=True, **settings),
            ParallelSequential(mlp(16, 16), nn.ReLU(), chunks=2, **settings),
            nn.Linear(16, 4),
            chunks=chunks, **settings,
        )
    if kind == "deep":  # Parallel in Parallel in ParallelSequential, and a pipeline inside
        return ParallelSequential(
            Parallel(
                Parallel(nn.Linear(16, 8), mlp(), join="sum", streams=True, **settings),
                nn.Sequential(nn.Linear(16, 16), ParallelSequential(mlp(), chunks=3, **settings)),
                join="cat", streams=True, **settings,
            ),
            nn.Linear(16, 4),
            chunks=2, **settings,
        )
    raise ValueError(kind)


KINDS = ["parallel_of_pipeline", "pipeline_of_parallel_c1", "pipeline_of_parallel_c4", "deep"]
BATCH = 10  # chunks=4 splits it 3, 3, 2, 2; nested pipelines split the pieces again


def plain(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    r"""The model as written without the library: loops, ``tensor_split`` and ``torch.cat``."""
    if isinstance(module, Parallel):
        names = [n for n, _ in module.named_children()]
        return join_reference(module.join, module.dim, names, [plain(b, x) for b in module])
    if isinstance(module, ParallelSequential):
        pieces = list(x.tensor_split(module.chunks)) if module.chunks > 1 else [x]
        outs = []
        for piece in pieces:
            for stage in module:
                piece = plain(stage, piece)
            outs.append(piece)
        return torch.cat(outs, 0) if len(outs) > 1 else outs[0]
    if type(module) is nn.Sequential:
        for layer in module:
            x = plain(layer, x)
        return x
    return module(x)


class Plain(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return plain(self.model, x)


# Dynamo records ``a + b`` as operator.add and the joins' torch.add as torch.add: the same op.
_SAME_OP = {operator.add: torch.add}


def ops(graph: torch.fx.Graph) -> collections.Counter:
    return collections.Counter(
        str(_SAME_OP.get(n.target, n.target)) for n in graph.nodes if n.op in ("call_function", "call_method")
    )


def stream_ops(graph: torch.fx.Graph) -> list[str]:
    r"""Every node that touches streams or events, however a torch release spells it."""
    found = []
    for n in graph.nodes:
        text = str(n.target).lower()
        values = torch.utils._pytree.tree_leaves((n.args, n.kwargs))
        if (getattr(n.target, "namespace", None) == "streams"
                or any(word in text for word in ("stream", "event", "synchronize"))
                or (n.meta.get("custom") or {}).get("stream") is not None
                or any(isinstance(v, (torch.Stream, torch.Event)) for v in values)):
            found.append(f"{n.op} {n.target}")
    return found


def warmed(kind: str, device: str, **settings) -> nn.Module:
    model = make_model(kind, **settings).to(device).eval()
    with torch.no_grad():
        model(torch.randn(BATCH, 16, device=device))  # eager first: on CUDA it forks, creating streams and plans
    return model


# ------------------------------------------------------------------ export
@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
@pytest.mark.parametrize("kind", KINDS)
def test_export_graph_is_the_plain_model(device, strict, kind):
    model = warmed(kind, device)
    x = torch.randn(BATCH, 16, device=device)
    with warnings.catch_warnings():
        # The blocks cache nothing on the module while traced: no "side effects" warning.
        warnings.filterwarnings("error", message=".*side effects.*")
        ep = torch.export.export(model, (x,), strict=strict)
    twin = torch.export.export(Plain(model), (x,), strict=strict)
    assert not stream_ops(ep.graph), stream_ops(ep.graph)
    assert ops(ep.graph) == ops(twin.graph)
    assert len(ep.graph.nodes) == len(twin.graph.nodes)
    exported = ep.module()
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(BATCH, 16, device=device)
            expected = model(x)
            assert_same(exported(x), expected)
            assert_same(expected, plain(model, x))


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
@pytest.mark.parametrize("kind", KINDS)
def test_exported_program_saved_and_loaded_equals_eager(strict, kind):
    # torch.export.save serializes every node of the graph: a block's tracing path must put
    # nothing there that the serializer cannot write (a Python callable, a stream object), and
    # the program loaded back -- in a process that may never import this package -- computes
    # the model, on inputs other than the example's.
    model = warmed(kind, "cpu")
    ep = torch.export.export(model, (torch.randn(BATCH, 16),), strict=strict)
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    with torch.no_grad():
        x = torch.randn(BATCH, 16)
        assert_same(loaded(x), model(x))


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
def test_export_keeps_state_dict_keys(strict):
    model = warmed("deep", "cpu", compile="eager")
    ep = torch.export.export(model, (torch.randn(BATCH, 16),), strict=strict)
    assert set(ep.state_dict) == set(model.state_dict())


@pytest.mark.parametrize("tracer", ["export_strict", "export_non_strict", "compile"])
def test_every_tracer_takes_the_tracing_path(tracer):
    # What the graphs above rely on, seen from inside the branches and stages: the probe
    # computes 2x where the library detects tracing and 3x where it runs eagerly. (On the
    # CPU the eager path would trace to the same graph, so this checks the detection itself.)
    from parallel_modules._streams import _is_tracing

    class Probe(nn.Module):
        def forward(self, x):
            return x * (2.0 if _is_tracing() else 3.0)

    model = ParallelSequential(Parallel(Probe(), Probe(), join="sum", streams=True), Probe(), chunks=2)
    x = torch.randn(4, 4)
    assert torch.equal(model(x), x * 3 * 2 * 3)
    if tracer == "compile":
        traced = torch.compile(model, fullgraph=True, backend="eager")
    else:
        traced = torch.export.export(model, (x,), strict=tracer == "export_strict").module()
    assert torch.equal(traced(x), x * 2 * 2 * 2)


# ----------------------------------------------------------------- compile
@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("kind", KINDS)
def test_compile_fullgraph_is_one_graph_of_the_plain_model(device, kind):
    graphs: dict[str, list] = {"model": [], "plain": []}

    def counting(into):
        def backend(gm: torch.fx.GraphModule, example_inputs):
            into.append(gm)
            return gm.forward
        return backend

    model = warmed(kind, device)
    x = torch.randn(BATCH, 16, device=device)
    compiled = torch.compile(model, fullgraph=True, backend=counting(graphs["model"]))
    with torch.no_grad():
        assert_same(compiled(x), model(x))
    torch.compile(Plain(model), fullgraph=True, backend=counting(graphs["plain"]))(x)
    assert len(graphs["model"]) == 1  # fullgraph=True would have raised on a graph break
    graph = graphs["model"][0].graph
    assert not stream_ops(graph), stream_ops(graph)
    assert ops(graph) == ops(graphs["plain"][0].graph)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("kind", ["parallel_of_pipeline", "deep"])
def test_compile_inductor_equals_eager(device, kind):
    model = warmed(kind, device)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(BATCH, 16, device=device)
            assert_close(compiled(x), model(x), *tol(device))


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize(
    "backend, kind",
    # aot_eager: the forward and backward graphs AOTAutograd makes, run as they are; inductor
    # compiles them too (slow on the CPU: two models).
    [("aot_eager", k) for k in KINDS] + [("inductor", "deep"), ("inductor", "pipeline_of_parallel_c4")],
)
def test_compile_training_gradients_equal_eager(device, backend, kind):
    model = make_model(kind).to(device).train()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    params = list(model.parameters())
    for _ in range(2):
        x = torch.randn(BATCH, 16, device=device, requires_grad=True)
        out, expected = compiled(x), plain(model, x)
        assert_close(out, expected, *tol(device))
        w = torch.randn_like(out)
        got = torch.autograd.grad((out * w).sum(), [x, *params])
        want = torch.autograd.grad((expected * w).sum(), [x, *params])
        for g, e in zip(got, want):
            assert_close(g, e, *tol(device))


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["parallel_of_pipeline", "pipeline_of_parallel_c4"])
def test_compile_reduce_overhead_equals_eager(kind):
    model = warmed(kind, "cuda")
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(5):  # warm-up, recording, replays
            x = torch.randn(BATCH, 16, device="cuda")
            assert_close(compiled(x).clone(), model(x), *CUDA_TOL)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_compiled_and_graphed_blocks_are_traced_as_plain_modules(device):
    # compile= and cuda_graph= are this library's eager-mode settings: a compiler tracing
    # the whole model sees the plain branches and never calls the per-branch compiled code.
    calls: list = []

    def per_branch(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    settings = {"compile": per_branch}
    if device == "cuda":
        settings["cuda_graph"] = True
    model = make_model("deep", **settings).to(device).eval()
    x = torch.randn(BATCH, 16, device=device)
    ep = torch.export.export(model, (x,))
    assert calls == []
    blocks = [m for m in model.modules() if isinstance(m, (Parallel, ParallelSequential))]
    assert all(b._compiler._calls == [] for b in blocks)  # nothing compiled, nothing even prepared
    assert ops(ep.graph) == ops(torch.export.export(Plain(model), (x,)).graph)
    assert not stream_ops(ep.graph)
    with torch.no_grad():
        assert_same(ep.module()(x), plain(model, x))
        whole = torch.compile(model, fullgraph=True)
        assert_close(whole(x), plain(model, x), *tol(device))
    assert calls == []


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_export_records_the_branches_and_stages_by_their_names(strict):
    # Before: a block's dict of children was a dict subclass (it counted writes into it), whose
    # items Dynamo names by position: a strict export recorded every branch and stage as
    # ``dict.__getitem__(L['self'].1._modules, list(dict.keys(...))[0])``, unflatten folded their
    # work into the block (warning that the names "do not form a stack"), and
    # preserve_module_call_signature of a stage raised KeyError.
    model = nn.Sequential(nn.Linear(8, 8), Parallel(nn.Sequential(nn.Linear(8, 4), nn.ReLU()), nn.Linear(8, 4)),
                          ParallelSequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8)), chunks=2))
    x = torch.randn(4, 8)
    ep = torch.export.export(model, (x,), strict=strict, preserve_module_call_signature=("2.1",))
    names = {v[0] for n in ep.graph.nodes for v in (n.meta.get("nn_module_stack") or {}).values()}
    assert names == {"", "0", "1", "1.0", "1.0.0", "1.0.1", "1.1", "2", "2.0", "2.1", "2.1.0"}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*do not form a stack")
        unflat = torch.export.unflatten(ep)
    assert_close(unflat(x), model(x))
    # The branch's own work is in its module, which a swap of it reaches.
    unflat.get_submodule("1").get_submodule("1").weight.data.zero_()
    model[1][1].weight.data.zero_()
    assert_close(unflat(x), model(x))
