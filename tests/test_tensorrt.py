"""``compile="tensorrt"`` and the whole-model Torch-TensorRT path.

TensorRT cannot be installed on this project's machines, so most tests use ``FakeTensorRT``:
a stand-in for the ``torch_tensorrt`` module with the documented signature of
``torch_tensorrt.compile(module, ir, inputs, arg_inputs, kwarg_inputs, enabled_precisions,
**kwargs)``, which does what its dynamo path does first (``torch.export.export`` of the branch
on the example inputs) and returns an "engine" that runs the exported program and notes the
stream it was called on. That proves what the library relies on and controls: lazy builds from
the first call's inputs, one engine per signature, the options passed through, no engine
called on the legacy default stream, errors and fallback. The tests marked ``tensorrt`` run
the real package and skip, saying why, where it is missing.
"""

from __future__ import annotations

import importlib.util
import sys
import types
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

from parallel_modules import Parallel, ParallelSequential
from parallel_modules._compile import _Compiler, _TensorRT
from parallel_modules._streams import _pools
from parallel_modules._cases import inception_branches
from tests._reference import assert_close, assert_same

cuda = pytest.mark.cuda
HAS_TENSORRT = importlib.util.find_spec("torch_tensorrt") is not None
tensorrt = pytest.mark.skipif(
    not HAS_TENSORRT,
    reason="torch_tensorrt is not installed (pip install 'parallel_modules[tensorrt]'; it needs NVIDIA's "
           "TensorRT libraries, which this project's machines cannot install)",
)
TRT_TOL = (1e-3, 1e-3)  # TensorRT picks its own kernels; TF32 is turned off below


class FakeEngine:
    def __init__(self, fake: "FakeTensorRT", program: nn.Module) -> None:
        self.fake, self.program = fake, program

    def __call__(self, *args, **kwargs):
        if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            self.fake.streams.append(torch.cuda.current_stream().stream_id)
        return self.program(*args, **kwargs)


class FakeTensorRT(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("torch_tensorrt")
        self.builds: list[dict] = []
        self.streams: list[int] = []

    def compile(self, module, ir="default", inputs=None, arg_inputs=None, kwarg_inputs=None,
                enabled_precisions=None, **kwargs):
        self.builds.append(dict(module=module, ir=ir, inputs=inputs, arg_inputs=arg_inputs,
                                kwarg_inputs=kwarg_inputs, enabled_precisions=enabled_precisions, **kwargs))
        example = inputs if inputs is not None else arg_inputs
        program = torch.export.export(module, tuple(example), kwargs=kwarg_inputs or None)
        return FakeEngine(self, program.module())


@pytest.fixture
def fake(monkeypatch) -> FakeTensorRT:
    module = FakeTensorRT()
    monkeypatch.setitem(sys.modules, "torch_tensorrt", module)
    return module


def mlp(i: int = 16, o: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, 16), nn.GELU(), nn.Linear(16, o))


def branches(n: int = 3, device: str = "cpu") -> list[nn.Module]:
    torch.manual_seed(0)
    return [mlp().to(device).eval() for _ in range(n)]


def cat_reference(block: Parallel, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([b(x) for b in block], 1)


# -------------------------------------------------------------------- CPU
def test_engines_are_built_from_the_first_call_inputs_one_per_signature(fake):
    branch = mlp().eval()
    trt = _TensorRT(branch, {"enabled_precisions": {torch.float16}})
    x = torch.randn(4, 16)
    engine = trt.engine((x,), {})
    assert len(fake.builds) == 1
    build = fake.builds[0]
    assert build["module"] is branch and build["ir"] == "dynamo"
    assert len(build["inputs"]) == 1 and build["inputs"][0] is x and build["arg_inputs"] is None
    assert build["enabled_precisions"] == {torch.float16}
    assert trt.engine((torch.randn(4, 16),), {}) is engine  # same signature: same engine
    assert trt.engine((torch.randn(5, 16),), {}) is not engine
    assert len(fake.builds) == 2
    with torch.no_grad():
        y = torch.randn(5, 16)
        assert_same(trt.engine((y,), {})(y), branch(y))


def test_keyword_inputs_and_given_input_specs(fake):
    class Scaled(nn.Module):
        def forward(self, x, *, scale):
            return x * scale

    trt = _TensorRT(Scaled().eval(), {})
    x, scale = torch.randn(2, 3), torch.randn(3)
    trt.engine((x,), {"scale": scale})
    assert fake.builds[-1]["arg_inputs"] == [x] and fake.builds[-1]["kwarg_inputs"] == {"scale": scale}
    assert fake.builds[-1]["inputs"] is None
    # Input specs given by the user (e.g. torch_tensorrt.Input ranges): one engine for every signature.
    spec = [torch.randn(4, 16)]
    trt = _TensorRT(mlp().eval(), {"inputs": spec})
    first = trt.engine((torch.randn(4, 16),), {})
    assert trt.engine((torch.randn(4, 16, dtype=torch.float64),), {}) is first
    assert fake.builds[-1]["inputs"] is spec


def test_nothing_is_built_at_construction(fake):
    Parallel(*branches(2), compile="tensorrt")
    ParallelSequential(mlp(16, 16), mlp(16, 4), compile="tensorrt", compile_options={"max_aux_streams": 2})
    assert fake.builds == []


def test_missing_package_names_the_extra_and_the_branch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_tensorrt", None)  # import fails, as where it is not installed
    block = Parallel(OrderedDict(a=mlp(), b=mlp()), compile="tensorrt").eval()
    with pytest.raises(RuntimeError) as info:
        block(torch.randn(4, 16))
    message = str(info.value)
    assert message.startswith("Parallel: branch 'a' (index 0, Sequential) failed to compile with compile='tensorrt'")
    assert "pip install 'parallel_modules[tensorrt]'" in message
    fallback = Parallel(OrderedDict(a=mlp(), b=mlp()), compile="tensorrt", compile_fallback=True).eval()
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(2):
            x = torch.randn(4, 16)
            assert_same(fallback(x), cat_reference(fallback, x))
    assert len([w for w in record if "failed to compile" in str(w.message)]) == 2  # one per branch, once


def test_cpu_inputs_and_training_mode_are_refused(fake):
    block = Parallel(*branches(2), compile="tensorrt")
    with pytest.raises(RuntimeError, match="run on CUDA devices; the input is on cpu"):
        block(torch.randn(4, 16))
    block.train()
    with pytest.raises(RuntimeError, match=r"training mode\. Call \.eval\(\)") as info:
        block(torch.randn(4, 16))
    assert "branch '0' (index 0, Sequential)" in str(info.value)
    assert fake.builds == []
    # Refusals are not failures to compile: with a fallback the branch stays compiled.
    block = Parallel(*branches(2), compile="tensorrt", compile_fallback=True).train()
    with pytest.raises(RuntimeError, match=r"training mode"):
        block(torch.randn(4, 16))
    assert not any(c.failed for c in block._compiler.calls(block._modules))


@pytest.mark.parametrize("change", ["replaced", "load_state_dict", "assign", "in place"])
def test_engines_are_built_anew_when_the_weights_change(fake, change):
    # Engines hold the weights they were built with.
    module = mlp().eval()
    trt = _TensorRT(module, {})
    x = torch.randn(4, 16)
    trt.engine((x,), {})
    trt.engine((x,), {})
    assert len(fake.builds) == 1
    with torch.no_grad():
        if change == "replaced":
            module[0] = nn.Linear(16, 16)
        elif change == "load_state_dict":
            module.load_state_dict(mlp().state_dict())
        elif change == "assign":
            module.load_state_dict(mlp().state_dict(), assign=True)
        else:
            module[2].bias.add_(1)
    trt.engine((x,), {})
    assert len(fake.builds) == 2
    trt.engine((x,), {})
    assert len(fake.builds) == 2


def test_signatures_key_numbers_dtypes_and_devices_by_value():
    # An engine bakes non-tensor arguments in: one built for float16 must not serve float32.
    from parallel_modules._inputs import _signature

    x = torch.randn(2)
    values = (1, True, 1.0, "a", None, torch.float16, torch.float32, torch.device("cpu"))
    assert len({_signature((x, v), {}, False) for v in values}) == len(values)
    assert len({_signature((x,), {"k": v}, False) for v in values}) == len(values)
    assert _signature((x, torch.float16), {}, False) == _signature((x, torch.float16), {}, False)


def test_whole_model_tracing_never_builds_engines(fake):
    # torch_tensorrt.compile(model, ir="dynamo") exports the whole model: blocks with
    # compile="tensorrt" are traced as plain modules, and TensorRT sees one network.
    model = nn.Sequential(Parallel(*branches(2), compile="tensorrt"), nn.Linear(16, 4)).eval()
    x = torch.randn(4, 16)
    ep = torch.export.export(model, (x,))
    assert fake.builds == []
    with torch.no_grad():
        assert_same(ep.module()(x), model[1](cat_reference(model[0], x)))


def test_settings_survive_pickling_without_engines(fake):
    import pickle

    compiler = _Compiler("Parallel", "branch", "tensorrt", {"max_aux_streams": 2}, False)
    compiler.calls(OrderedDict(a=mlp()))
    clone = pickle.loads(pickle.dumps(compiler))
    assert clone.settings() == compiler.settings() and clone._calls == []


# ------------------------------------------------------------------- CUDA
@cuda
@pytest.mark.parametrize("streams", [True, False])
def test_no_engine_runs_on_the_default_stream(fake, streams):
    block = Parallel(*branches(3, "cuda"), streams=streams, compile="tensorrt")
    default = torch.cuda.default_stream().stream_id
    assert torch.cuda.current_stream().stream_id == default
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 16, device="cuda")
            out = block(x)
            assert_same(out, cat_reference(block, x))
    assert len(fake.builds) == 3 and len(fake.streams) == 9
    assert default not in fake.streams, fake.streams


@cuda
def test_on_a_user_stream_engines_run_on_the_branch_streams(fake):
    block = Parallel(*branches(3, "cuda"), streams=True, compile="tensorrt")
    caller = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(caller):
        x = torch.randn(8, 16, device="cuda")
        out = block(x)
        expected = cat_reference(block, x)
    caller.synchronize()
    assert_same(out, expected)
    # Branch 0 on the caller's stream, the others on the library's side streams: as without TensorRT.
    # (The pool's side streams for this caller: PyTorch hands out streams round-robin, so the
    # caller's may be one of the pool's, which another then stands in for.)
    side = [s.stream_id for s in _pools[(torch.cuda.current_device(), False)].side_streams(0, 2, caller)]
    assert fake.streams == [caller.stream_id, *side]


@cuda
def test_engines_under_the_cuda_graph(fake):
    pipe = ParallelSequential(mlp(16, 16).cuda().eval(), mlp(16, 4).cuda().eval(), chunks=2, cuda_graph=True,
                              compile="tensorrt")
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(8, 16, device="cuda")
            # Micro-batches of 4 rows may pick other matmul kernels than the batch of 8.
            assert_close(pipe(x), pipe[1](pipe[0](x)), 1e-5, 1e-6)
    assert pipe._graphs.captures == 1
    assert len(fake.builds) == 2  # one engine per stage: both micro-batches have one signature
    assert torch.cuda.default_stream().stream_id not in fake.streams


# ------------------------------------------------------ the real TensorRT
def _inception() -> list[nn.Module]:
    torch.manual_seed(0)
    return [b.cuda().eval() for b in inception_branches()]


@tensorrt
@cuda
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_tensorrt_branches_equal_eager(cuda_graph):
    block = Parallel(*_inception(), cuda_graph=cuda_graph, compile="tensorrt",
                     compile_options={"disable_tf32": True})
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 192, 35, 35, device="cuda")
            assert_close(block(x), cat_reference(block, x), *TRT_TOL)
    assert all(isinstance(c.fn, _TensorRT) and c.fn.engines for c in block._compiler._calls)


@tensorrt
@cuda
def test_tensorrt_whole_model_through_export_equals_eager():
    import torch_tensorrt

    model = nn.Sequential(Parallel(*_inception(), streams=True), nn.ReLU()).eval()
    x = torch.randn(8, 192, 35, 35, device="cuda")
    trt_model = torch_tensorrt.compile(model, ir="dynamo", inputs=[x], max_aux_streams=4, disable_tf32=True)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 192, 35, 35, device="cuda")
            assert_close(trt_model(x), model(x), *TRT_TOL)
