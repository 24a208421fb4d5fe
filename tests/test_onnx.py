"""Models containing ``Parallel`` and ``ParallelSequential`` exported to ONNX, run by onnxruntime.

Both exporters: ``torch.onnx.export(..., dynamo=True)`` builds on ``torch.export`` (the blocks take
their tracing path, ``torch.compiler.is_compiling()``), ``dynamo=False`` on ``torch.jit.trace`` (the
blocks read the tracer's state; fused groups are traced unfused). Either way the ONNX graph is the
graph of the same model written without the library (``Plain``), with the members' parameters as
initializers under their state-dict names, and onnxruntime's results equal eager ones on batch sizes
other than the example's.

Tolerance: onnxruntime's kernels (Gemm, LayerNorm, Erf for the GELU) sum in other orders than ATen's:
rtol=1e-5, atol=1e-5 (measured: at most 1e-6 on these models, torch 2.13, onnxruntime 1.32).
"""

from __future__ import annotations

import collections
import os
import warnings

import pytest
import torch
from torch import nn

from parallel_modules import Parallel, ParallelSequential
from tests._helpers import mlp
from tests.test_tracing_models import KINDS, Plain, make_model

# (In the ``test`` extra, as the notebooks' kernels are: a missing one fails the file instead of
# skipping it, so that CI never passes without exporting; see tests/test_notebooks.py.)
_ALLOW_MISSING_ENV = "PARALLEL_MODULES_ALLOW_MISSING_EXTRAS"
try:
    import onnx
    import onnxruntime as ort
    import onnxscript  # noqa: F401  (the dynamo exporter's)
except ImportError as e:
    if os.environ.get(_ALLOW_MISSING_ENV):
        pytest.skip(f"ONNX dependencies missing ({e}) and {_ALLOW_MISSING_ENV} is set", allow_module_level=True)
    raise ImportError(f"cannot export to ONNX: {e}. Install the test extra (pip install -e '.[test]'), "
                      f"or set {_ALLOW_MISSING_ENV}=1 to skip these tests.") from e

TOL = dict(rtol=1e-5, atol=1e-5)
EXPORTERS = ["dynamo", "torchscript"]


def _export(model: nn.Module, x: torch.Tensor, exporter: str, path: str, dynamic: bool = True,
            optimize: bool = True) -> None:
    r"""Exports, with a dynamic batch size where ``dynamic``, as a model for serving would be."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.jit's deprecation, onnxscript's notes)
        if exporter == "dynamo":
            batch = torch.export.Dim("batch", min=4, max=64)
            # (A Parallel as the root takes its dynamic shapes by its parameter's name: see README.)
            shapes = {"args": ({0: batch},)} if isinstance(model, Parallel) else ({0: batch},)
            shapes = shapes if dynamic else None
            program = torch.onnx.export(model, (x,), dynamo=True, dynamic_shapes=shapes, verbose=False, optimize=optimize)
            program.save(path)
        else:
            torch.onnx.export(model, (x,), path, dynamo=False, input_names=["x"],
                              dynamic_axes={"x": {0: "batch"}} if dynamic else None)


def _run(path: str, x: torch.Tensor) -> list[torch.Tensor]:
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return [torch.from_numpy(o) for o in session.run(None, {session.get_inputs()[0].name: x.numpy()})]


def _signature(path: str) -> tuple[collections.Counter, dict[str, int]]:
    r"""The graph's operations, counted, and its floating-point initializers' sizes by name."""
    graph = onnx.load(path).graph
    floats = {i.name: int(torch.Size(i.dims).numel()) for i in graph.initializer
              if i.data_type == onnx.TensorProto.FLOAT}
    return collections.Counter(node.op_type for node in graph.node), floats


def _leaves(out) -> list[torch.Tensor]:
    return torch.utils._pytree.tree_leaves(out)


def _fused(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "fused_mlps":  # batched matmuls
        return nn.Sequential(nn.Linear(16, 16), Parallel(*[mlp(16, 16) for _ in range(3)], join="cat", fuse=True))
    if kind == "fused_layernorm_graphed":  # a layer fusion hands to vmap; cuda_graph=True on the CPU
        return Parallel(*[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(3)],
                        join="sum", fuse="auto", cuda_graph=True)
    if kind == "fused_in_a_pipeline":  # a fused stage of a pipeline with chunks > 1, named branches
        return ParallelSequential(
            nn.Linear(16, 16),
            Parallel(collections.OrderedDict((n, mlp(16, 16)) for n in "abc"), join="mean", fuse=True),
            nn.Linear(16, 4), chunks=3)
    if kind == "joins":  # a tuple join feeding a dict join feeding a callable join
        class Joins(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.pair = Parallel(nn.Linear(16, 16), nn.Linear(16, 8), join=None)
                self.named = Parallel(collections.OrderedDict(a=nn.Linear(16, 4), b=mlp(16, 4)), join="dict")
                self.product = Parallel(nn.Linear(8, 4), nn.Linear(8, 4), join=lambda outs: outs[0] * outs[1])

            def forward(self, x: torch.Tensor):
                wide, narrow = self.pair(x)
                named = self.named(wide)
                return named["a"] + self.product(narrow), named["b"]
        return Joins()
    raise ValueError(kind)


# (dynamo on the deepest nesting only: each of its exports takes seconds.)
@pytest.mark.parametrize("kind, exporter", [(kind, "torchscript") for kind in KINDS] + [("deep", "dynamo")])
def test_onnx_graph_is_the_plain_models(kind, exporter, tmp_path):
    # The README's claim for compilers, held to for ONNX: the exported graph has the operations of
    # the model written without the library (branches and micro-batches one after another; no
    # stream or event operation, which no ONNX op expresses), and the same initializers. (Static
    # shapes: under dynamic ones a pipeline is traced whole, unlike ``Plain``'s loop; see README.)
    model = make_model(kind, cuda_graph=True).eval()
    x = torch.randn(10, 16)
    with torch.no_grad():
        model(x)  # (eager first: the blocks' caches set up, as in a model trained before export)
    ours, plain = os.fspath(tmp_path / "ours.onnx"), os.fspath(tmp_path / "plain.onnx")
    # (onnxscript's optimizer off: it takes seconds, and the graphs are compared as translated.)
    _export(model, x, exporter, ours, dynamic=False, optimize=False)
    _export(Plain(model), x, exporter, plain, dynamic=False, optimize=False)
    (ops, inits), (plain_ops, plain_inits) = _signature(ours), _signature(plain)
    assert ops == plain_ops
    assert {"model." + name: size for name, size in inits.items()} == plain_inits
    x = torch.randn(10, 16)
    with torch.no_grad():
        (got,), expected = _run(ours, x), model(x)
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("kind", ["fused_mlps", "fused_layernorm_graphed", "fused_in_a_pipeline", "joins"])
def test_onnx_export_of_fused_blocks_and_joins_equals_eager(kind, exporter, tmp_path):
    # A fused group exports as batched operations (dynamo) or unfused (torchscript). Either way the
    # model's weights are in the file once: traced unfused, as the members' own parameters under
    # their state-dict names; batched, as their stacks, which onnxscript's optimizer folds into
    # initializers of its own names ("transpose"): not a stack read by an untraced call and baked in
    # beside the parameters, which would hold the weights twice.
    model = _fused(kind).eval()
    with torch.no_grad():
        for p in model.parameters():  # (distinct values: the torchscript exporter merges equal initializers)
            p.add_(torch.randn_like(p), alpha=0.1)
    x = torch.randn(10, 16)
    with torch.no_grad():
        model(x)
    path = os.fspath(tmp_path / "model.onnx")
    _export(model, x, exporter, path)
    _, inits = _signature(path)
    if exporter == "torchscript":
        assert inits == {name: p.numel() for name, p in model.state_dict().items()}
    # (onnxscript adds small constants of its own: a LayerNorm's folded shapes.)
    assert sum(inits.values()) < 1.5 * sum(p.numel() for p in model.state_dict().values())
    for n in (10, 7):
        x = torch.randn(n, 16)
        with torch.no_grad():
            got, expected = _run(path, x), _leaves(model(x))
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, **TOL)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
        return self.linear(x) * scale


class _NamesItsKeywords(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.block(x, scale=scale)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("fuse", [False, True])
def test_onnx_export_of_keyword_inputs(exporter, fuse, tmp_path):
    # Keyword inputs reach every branch (fused too) in the exported graph. The torchscript exporter
    # binds `kwargs=` to the parameters that forward's signature names, and drops the rest without a
    # word (torch 2.13, for any module taking **kwargs): a Parallel as the root would be exported as
    # called without them, so it is exported inside a module that names them (see README).
    block = Parallel(_Scaled(), _Scaled(), _Scaled(), join="sum", fuse=fuse)
    x, scale = torch.randn(10, 16), torch.randn(10, 8)
    path = os.fspath(tmp_path / "model.onnx")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        block(x, scale=scale)
        if exporter == "dynamo":
            torch.onnx.export(block, (x,), kwargs={"scale": scale}, dynamo=True).save(path)
        else:
            torch.onnx.export(_NamesItsKeywords(block), (x, scale), path, dynamo=False)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert len(session.get_inputs()) == 2
    x, scale = torch.randn(10, 16), torch.randn(10, 8)
    (got,) = session.run(None, dict(zip([i.name for i in session.get_inputs()], (x.numpy(), scale.numpy()))))
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), block(x, scale=scale), **TOL)
