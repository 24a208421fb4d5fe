"""``compile=``: each branch (or stage) compiled on its own, under the library's streams and graphs.

CPU tests use inductor where its numerics are the point (it compiles C++ on the CPU, so
sparingly) and otherwise dynamo backends that record what they are given. Tolerances for
inductor against the eager branches: rtol=1e-5, atol=1e-6 in fp32 on the CPU (measured:
1.2e-7 max abs error); on CUDA rtol=1e-4, atol=1e-5 in fp32 (convolutions may pick other
cuDNN algorithms) and 1e-2 in fp16, as the benchmark checks.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

from parallel_modules import Parallel, ParallelSequential
from parallel_modules._cases import inception_branches
from tests._reference import assert_close, assert_same
from tests._helpers import EqualByClass, fresh_dynamo, mlp  # noqa: F401 (fresh_dynamo: an autouse fixture)

CPU_TOL = (1e-5, 1e-6)
CUDA_TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 1e-2)}
cuda = pytest.mark.cuda




def branches(n: int = 3) -> list[nn.Module]:
    torch.manual_seed(0)
    return [mlp() for _ in range(n)]


def cat_reference(block: Parallel, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([b(x) for b in block], 1)


class Recorder:
    r"""A torch.compile backend that keeps every graph it is given and runs it as it is."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.failures = 0
        self.fail_on = fail_on
        self.__qualname__ = "Recorder"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        if self.fail_on is not None and self.fail_on in str(gm.graph):
            self.failures += 1
            raise RuntimeError(f"boom from backend: cannot compile {self.fail_on}")
        self.graphs.append(gm)
        return gm.forward


# ------------------------------------------------------------------ results
def test_inductor_branches_equal_eager():
    block = Parallel(*branches(3), compile="inductor")
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 16)
            assert_close(block(x), cat_reference(block, x), *CPU_TOL)


def test_inductor_stages_equal_eager_with_uneven_micro_batches():
    torch.manual_seed(0)
    pipe = ParallelSequential(mlp(16, 16), nn.ReLU(), mlp(16, 4), chunks=3, compile="inductor")
    with torch.no_grad():
        for batch in (7, 7, 6):  # 3, 2, 2 then 2, 2, 2: shapes the stages compile for
            x = torch.randn(batch, 16)
            assert_close(pipe(x), pipe[2](pipe[1](pipe[0](x))), *CPU_TOL)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_training_gradients_equal_eager(backend):
    block = Parallel(*branches(3), join="sum", compile=backend)
    reference = copy.deepcopy(block)
    params, ref_params = list(block.parameters()), list(reference.parameters())
    for _ in range(2):
        base = torch.randn(4, 16)
        x, x_ref = base.clone().requires_grad_(), base.clone().requires_grad_()
        out = block(x)
        expected = sum(b(x_ref) for b in reference)
        assert_close(out, expected, *CPU_TOL)
        w = torch.randn_like(out)
        got = torch.autograd.grad((out * w).sum(), [x, *params])
        want = torch.autograd.grad((expected * w).sum(), [x_ref, *ref_params])
        for g, e in zip(got, want):
            assert_close(g, e, *CPU_TOL)


def test_train_and_eval_both_correct_and_buffers_follow_eager():
    torch.manual_seed(0)
    make = lambda: [nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8)), mlp()]  # noqa: E731
    block = Parallel(*make(), compile="aot_eager")
    reference = copy.deepcopy(block)
    for mode in (True, False, True):
        block.train(mode)
        reference.train(mode)
        with torch.no_grad():
            x = torch.randn(4, 16)
            assert_close(block(x), torch.cat([b(x) for b in reference], 1), *CPU_TOL)
    for b, r in zip(block.buffers(), reference.buffers()):
        assert_close(b, r, *CPU_TOL)
    assert block[0][1].num_batches_tracked.item() == 2


# --------------------------------------------------- module tree and state
def test_state_dict_and_module_tree_unchanged():
    block = Parallel(OrderedDict(a=mlp(), b=mlp()), join="dict", compile=Recorder())
    pipe = ParallelSequential(mlp(16, 16), mlp(16, 4), chunks=2, compile=Recorder())
    block(torch.randn(4, 16))
    pipe(torch.randn(4, 16))
    assert list(block.state_dict()) == list(nn.ModuleDict(OrderedDict(a=block.a, b=block.b)).state_dict())
    assert list(pipe.state_dict()) == list(nn.Sequential(*pipe).state_dict())
    for model in (block, pipe):
        names = [n for n, _ in model.named_modules()]
        assert not any("_orig_mod" in n for n in names), names
        assert not any(type(m).__name__ == "OptimizedModule" for m in model.modules())
    block.load_state_dict(copy.deepcopy(block.state_dict()))


def test_repr_and_slicing_keep_the_settings():
    block = Parallel(*branches(3), compile="inductor", compile_options={"fullgraph": True}, compile_fallback=True)
    assert "compile='inductor', compile_options={'fullgraph': True}, compile_fallback=True" in repr(block)
    head = block[:2]
    assert isinstance(head, Parallel) and len(head) == 2
    assert head._compiler.settings() == block._compiler.settings()
    assert head._compiler is not block._compiler
    pipe = ParallelSequential(mlp(16, 16), mlp(16, 4), chunks=2, cuda_graph=True, compile="aot_eager")
    text = repr(pipe)
    assert "chunks=2" in text and "cuda_graph=True" in text and text.count("compile=") == 1
    assert pipe[1:]._compiler.settings()["compile"] == "aot_eager"
    assert "compile" not in repr(Parallel(*branches(2)))


def test_each_branch_has_a_compile_cache_of_its_own():
    # Dynamo caches per code object with a limit of 8 entries; twelve nn.Sequential
    # branches compiled through one code object would leave four running eagerly.
    recorder = Recorder()
    torch.manual_seed(0)
    block = Parallel(*[nn.Sequential(*[nn.Linear(8, 8) for _ in range(i % 3 + 1)]) for i in range(12)],
                     compile=recorder)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert_same(block(x), cat_reference(block, x))
        assert len(recorder.graphs) == 12
        block(x)
    assert len(recorder.graphs) == 12  # no recompilation either


@pytest.mark.parametrize(
    "options, graphs",
    # Default: static shapes, one graph per batch size. dynamic=None is torch.compile's own
    # default (static first, then one dynamic graph); dynamic=True: one dynamic graph.
    [({}, 3), ({"dynamic": None}, 2), ({"dynamic": True}, 1)],
    ids=["default_static", "automatic", "dynamic"],
)
def test_shapes_static_by_default(options, graphs):
    recorder = Recorder()
    block = Parallel(mlp(), compile=recorder, compile_options=options)
    with torch.no_grad():
        for batch in (4, 5, 6, 4):
            x = torch.randn(batch, 16)
            assert_same(block(x), block[0](x))
    assert len(recorder.graphs) == graphs
    last = [n.meta.get("example_value") for n in recorder.graphs[-1].graph.nodes if n.op == "placeholder"]
    static = all(isinstance(d, int) for v in last if isinstance(v, torch.Tensor) for d in v.shape)
    assert static == (not options)


def test_deepcopy_and_pickle_compile_their_own_modules():
    block = Parallel(*branches(2), compile="aot_eager")
    x = torch.randn(4, 16)
    with torch.no_grad():
        block(x)
        assert len(block._compiler._calls) == 2
        for clone in (copy.deepcopy(block), pickle.loads(pickle.dumps(block))):
            assert clone._compiler._calls == []
            clone[1][0].weight.add_(1.0)  # the clone's own parameters must be the ones read
            assert_close(clone(x), cat_reference(clone, x), *CPU_TOL)
            assert not torch.allclose(clone(x), block(x))
            assert all(c.module is m for c, m in zip(clone._compiler._calls, clone))
        assert_close(block(x), cat_reference(block, x), *CPU_TOL)
        pipe = ParallelSequential(mlp(16, 16), mlp(16, 4), chunks=2, compile="aot_eager")
        pipe(x)
        clone = copy.deepcopy(pipe)
        assert clone._compiler._calls == [] and clone._compiler.settings() == pipe._compiler.settings()
        assert_close(clone(x), clone[1](clone[0](x)), *CPU_TOL)
        assert all(c.module is m for c, m in zip(clone._compiler._calls, clone))


def test_to_drops_the_compiled_code_and_follows_the_dtype():
    recorder = Recorder()
    block = Parallel(*branches(2), compile=recorder)
    pipe = ParallelSequential(mlp(16, 16), mlp(16, 4), compile=Recorder())
    with torch.no_grad():
        for model in (block, pipe):
            model(torch.randn(4, 16))
            assert model._compiler._calls
            model.double()
            assert model._compiler._calls == []
        x = torch.randn(4, 16, dtype=torch.float64)
        out = block(x)
        assert out.dtype == torch.float64
        assert_same(out, cat_reference(block, x))
        assert pipe(x).dtype == torch.float64
    assert len(recorder.graphs) == 4


def test_changed_branches_compile_and_the_others_keep_their_code():
    recorder = Recorder()
    block = Parallel(*branches(2), compile=recorder)
    x = torch.randn(4, 16)
    with torch.no_grad():
        block(x)
        assert len(recorder.graphs) == 2
        kept = block._compiler._calls[0]
        block.append(nn.Linear(16, 4))
        assert_same(block(x), cat_reference(block, x))
        assert len(recorder.graphs) == 3 and block._compiler._calls[0] is kept
        block[1] = nn.Linear(16, 8)
        assert_same(block(x), cat_reference(block, x))
        assert len(recorder.graphs) == 4


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("owner", ["Parallel", "ParallelSequential"])
def test_compile_error_surfaces_at_the_first_call_and_names_the_child(owner):
    recorder = Recorder(fail_on="tanh")
    torch.manual_seed(0)
    if owner == "Parallel":
        model = Parallel(OrderedDict(good=mlp(), bad=nn.Sequential(nn.Linear(16, 8), nn.Tanh())), compile=recorder)
        what = "branch 'bad' (index 1, Sequential)"
    else:
        model = ParallelSequential(OrderedDict(good=mlp(16, 16), bad=nn.Sequential(nn.Linear(16, 8), nn.Tanh())),
                                   chunks=2, compile=recorder)
        what = "stage 'bad' (index 1, Sequential)"
    assert recorder.failures == 0  # construction compiles nothing
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(4, 16))
    message = str(info.value)
    assert message.startswith(f"{owner}: {what} failed to compile with compile='Recorder'")
    assert "boom from backend: cannot compile tanh" in message
    assert "compile_fallback=True" in message
    assert recorder.failures >= 1


def test_compile_fallback_warns_once_and_runs_the_branch_eagerly():
    recorder = Recorder(fail_on="tanh")
    torch.manual_seed(0)
    block = Parallel(OrderedDict(good=mlp(), bad=nn.Sequential(nn.Linear(16, 8), nn.Tanh())),
                     compile=recorder, compile_fallback=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(4, 16)
                assert_same(block(x), cat_reference(block, x))
    messages = [str(w.message) for w in record if "failed to compile" in str(w.message)]
    assert len(messages) == 1, messages
    assert "branch 'bad'" in messages[0] and "boom from backend" in messages[0] and "eagerly" in messages[0]
    assert recorder.failures == 1  # not retried
    assert len(recorder.graphs) == 1  # the good branch stays compiled


@pytest.mark.parametrize("fallback", [False, True])
def test_bad_input_is_not_reported_as_a_compile_error(fallback):
    recorder = Recorder()
    block = Parallel(*branches(2), compile=recorder, compile_fallback=fallback)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError) as info:
            block(torch.randn(4, 15))
    assert "failed to compile" not in str(info.value)
    assert "15" in str(info.value)  # the shape mismatch, as the eager branch reports it
    assert "(raised in branch '0' (index 0) of Parallel)" in getattr(info.value, "__notes__", [str(info.value)])[-1]
    assert not [w for w in record if "failed to compile" in str(w.message)]
    x = torch.randn(4, 16)  # still usable, and still compiled
    with torch.no_grad():
        assert_same(block(x), cat_reference(block, x))
    assert len(recorder.graphs) == 2 and not any(c.failed for c in block._compiler._calls)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"compile": "no_such_backend"}, ValueError, "unknown compile backend 'no_such_backend'"),
        ({"compile": 3}, TypeError, "compile must be None"),
        ({"compile_options": {"fullgraph": True}}, ValueError, "without compile="),
        ({"compile": "inductor", "compile_options": ["fullgraph"]}, TypeError, "must be a dict"),
        ({"compile": "inductor", "compile_options": {"fullgrpah": True}}, ValueError, r"\['fullgrpah'\] are not"),
        ({"compile": "inductor", "compile_options": {"mode": "reduce-overhead"}}, ValueError,
         "mode='reduce-overhead' would capture inductor's own CUDA graphs"),
        ({"compile": "inductor", "compile_options": {"mode": "max-autotune"}}, ValueError, "max-autotune-no-cudagraphs"),
        ({"compile": "inductor", "compile_options": {"options": {"triton.cudagraphs": True}}}, ValueError,
         "triton.cudagraphs=True"),
        ({"compile": "inductor", "compile_options": {"mode": "no-such-mode"}}, ValueError, "mode='no-such-mode'"),
        ({"compile": "cudagraphs"}, ValueError, "captures CUDA graphs of its own"),
        # (Before: accepted, then blamed on branch '0' by dynamo's own assertion at the first call.)
        ({"compile": "eager", "compile_options": {"dynamic": "yes"}}, TypeError, "dynamic= must be None or a bool"),
        ({"compile": "eager", "compile_options": {"fullgraph": 1}}, TypeError, "fullgraph= must be a bool"),
        ({"compile": "inductor", "compile_options": {"options": [("max_autotune", True)]}}, TypeError,
         "options= must be None or a dict"),
        # (Before: "are not arguments of torch.compile", which they are.)
        ({"compile": "eager", "compile_options": {"backend": "inductor"}}, ValueError,
         r"compile_options cannot set backend= \(compile='eager' is used\); pass it as compile="),
        ({"compile": "eager", "compile_options": {"model": nn.Linear(2, 2)}}, ValueError,
         "compile_options cannot set model="),
        # (Before: accepted, then torch.compile's own RuntimeError at the first call, naming no module.)
        ({"compile": "aot_eager", "compile_options": {"mode": "default", "options": {}}}, ValueError,
         "gives both mode= and options=, which torch.compile takes only one of with compile='aot_eager'"),
    ],
)
@pytest.mark.parametrize("owner", [Parallel, ParallelSequential])
def test_bad_settings_are_refused_at_construction(owner, kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        owner(mlp(16, 16), mlp(16, 16), **kwargs)
    assert str(info.value).startswith(owner.__name__ + ":")


def test_inductor_modes_without_cuda_graphs_are_accepted():
    for mode in ("default", "max-autotune-no-cudagraphs"):
        block = Parallel(mlp(), compile="inductor", compile_options={"mode": mode})
        kwargs = block._compiler._kwargs
        assert "mode" not in kwargs and kwargs["options"]["triton.cudagraphs"] is False
        assert kwargs["dynamic"] is False


# -------------------------------------------------------------------- CUDA
def _inception(dtype: torch.dtype, **settings) -> Parallel:
    torch.manual_seed(0)
    return Parallel(*[b.to("cuda", dtype).eval() for b in inception_branches()], **settings)


@cuda
@pytest.mark.parametrize("dtype, batch", [(torch.float32, 1), (torch.float16, 8)], ids=["fp32-b1", "fp16-b8"])
def test_inductor_branches_under_the_cuda_graph_equal_eager(dtype, batch):
    block = _inception(dtype, cuda_graph=True, compile="inductor")
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(batch, 192, 35, 35, device="cuda", dtype=dtype)
            out = block(x)
            assert out.shape == (batch, 256, 35, 35)
            assert_close(out, cat_reference(block, x), *CUDA_TOL[dtype])
    assert block._graphs.captures == 1 and len(block._graphs) == 1


@cuda
def test_inductor_stages_under_the_cuda_graph_equal_eager():
    torch.manual_seed(0)
    pipe = ParallelSequential(mlp(16, 64), nn.ReLU(), mlp(64, 4), chunks=2, cuda_graph=True,
                              compile="inductor").cuda().eval()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 16, device="cuda")
            assert_close(pipe(x), pipe[2](pipe[1](pipe[0](x))), *CUDA_TOL[torch.float32])
    assert pipe._graphs.captures == 1


@cuda
def test_inductor_branches_training_under_the_cuda_graph():
    block = Parallel(*branches(3), join="sum", cuda_graph=True, compile="inductor").cuda()
    reference = copy.deepcopy(block)
    reference.cuda_graph, reference._compiler = False, None
    for _ in range(3):
        base = torch.randn(8, 16, device="cuda")
        x, x_ref = base.clone().requires_grad_(), base.clone().requires_grad_()
        out, expected = block(x), reference(x_ref)
        assert_close(out, expected, *CUDA_TOL[torch.float32])
        out.sum().backward()
        expected.sum().backward()
        assert_close(x.grad, x_ref.grad, *CUDA_TOL[torch.float32])
        for p, r in zip(block.parameters(), reference.parameters()):
            assert_close(p.grad, r.grad, *CUDA_TOL[torch.float32])
            p.grad = r.grad = None
    assert block._graphs.captures == 1 and block._graphs._graphs and next(iter(block._graphs._graphs.values())).bwd


class StreamRecorder:
    r"""A torch.compile backend whose compiled code notes the current stream each time it runs."""

    def __init__(self) -> None:
        self.streams: dict[int, list[int]] = {}
        self.__qualname__ = "StreamRecorder"

    def __call__(self, gm, example_inputs):
        key = len(self.streams)
        self.streams[key] = []

        def run(*args):
            self.streams[key].append(torch.cuda.current_stream().stream_id)
            return gm.forward(*args)

        return run


def _side_streams(count: int, capturing: bool = False) -> list[int]:
    r"""The ids of the side streams a top-level fork uses (the library's pool, slots 0..count-1)."""
    from parallel_modules._streams import _pools

    return [s.stream_id for s in _pools[(torch.cuda.current_device(), capturing)].streams[:count]]


@cuda
def test_compiled_branches_run_on_their_branch_streams():
    recorder = StreamRecorder()
    block = Parallel(*[b.cuda() for b in branches(4)], streams=True, compile=recorder)
    caller = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(caller):
        for _ in range(3):
            x = torch.randn(8, 16, device="cuda")
            out = block(x)
        caller.synchronize()
    assert_close(out, cat_reference(block, x), *CUDA_TOL[torch.float32])
    # One compiled graph per branch, each run 3 times on the stream its eager branch would use:
    # branch 0 on the caller's stream, the others on the library's side streams.
    runs = list(recorder.streams.values())
    assert runs == [[sid] * 3 for sid in [caller.stream_id, *_side_streams(3)]]
    assert torch.cuda.default_stream().stream_id not in runs[1]


@cuda
def test_compiled_branches_are_captured_on_the_graph_streams():
    from parallel_modules._graphs import _capture_stream

    recorder = StreamRecorder()
    block = Parallel(*[b.cuda() for b in branches(3)], cuda_graph=True, compile=recorder)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 16, device="cuda")
            assert_close(block(x), cat_reference(block, x), *CUDA_TOL[torch.float32])
    # Warm-up (3 runs) and capture (1 run), on the capture stream and the capture's side
    # streams; replays run no Python.
    expected = [_capture_stream(torch.cuda.current_device()).stream_id, *_side_streams(2, capturing=True)]
    runs = list(recorder.streams.values())
    assert runs[:3] == [[sid] * 4 for sid in expected]
    # Then the block compiled as one program, captured to be weighed against them: one stream.
    # (No graph reading the input in place is captured with compile=: see the next test.)
    assert runs[3:] == [[expected[0]] * 4]
    assert torch.cuda.default_stream().stream_id not in expected


@cuda
def test_compiled_blocks_copy_inference_tensors_in_without_compiling_again():
    # Compiled code guards on its inputs as warm-up gave them (the graph's static clones, never
    # inference tensors): a graph reading the caller's inference tensor in place would compile
    # anew inside its capture. Compiled blocks copy their inputs in.
    recorder = StreamRecorder()
    block = Parallel(*[b.cuda() for b in branches(2)], cuda_graph=True, compile=recorder)
    with torch.inference_mode():
        x = torch.randn(8, 16, device="cuda")
        for _ in range(3):
            x.normal_()
            assert_close(block(x), cat_reference(block, x), *CUDA_TOL[torch.float32])
    graph = next(iter(block._graphs._graphs.values()))
    assert graph.readable and graph.reader is None


# ------------------------------------------------ compiled or eager, whichever replays faster
# About 1 ms on current GPUs: far more than the branches themselves take.
SLEEP = 2_000_000


class SlowBackend:
    r"""A torch.compile backend whose compiled code keeps the stream busy first: a slow compiled branch."""

    def __init__(self) -> None:
        self.__qualname__ = "SlowBackend"

    def __call__(self, gm, example_inputs):
        def run(*args):
            torch.cuda._sleep(SLEEP)
            return gm.forward(*args)

        return run


class SlowWhenEager(nn.Module):
    r"""Doubles its input; run eagerly it keeps the stream busy first, traced by dynamo it does not."""

    def forward(self, x):
        if not torch.compiler.is_compiling():
            torch.cuda._sleep(SLEEP)
        return x * 2


def test_graphs_of_compiled_children_are_weighed_against_eager_ones():
    # Every combination is captured for inference, then the whole block compiled as one;
    # training captures the first.
    x = torch.randn(8, 16)
    block = Parallel(mlp(), mlp(), nn.Identity(), fuse="auto", cuda_graph=True, compile="eager")
    assert block._graph_variants((x,), {}) == [
        ("fused", "compiled"), ("fused", "eager"), ("unfused", "compiled"), ("unfused", "eager"), ("whole",)]
    # Fused groups never run compiled: with every branch fused, both ways are one.
    # An all-fused call is also captured with its biases copied in line (one stream), except for training.
    block = Parallel(mlp(), mlp(), fuse="auto", cuda_graph=True, compile="eager")
    assert block._graph_variants((x,), {}) == [
        ("fused",), ("fused", "bias in line"), ("unfused", "compiled"), ("unfused", "eager"), ("whole",)]
    assert block._graph_variants((x,), {}, first_only=True)[:2] == [("fused",), ("unfused", "compiled")]
    assert Parallel(mlp(), mlp(), fuse=True, cuda_graph=True, compile="eager")._graph_variants((x,), {}) == [
        None, ("bias in line",), ("whole",)]
    # ... only where the fused call copies biases in: not for a sum, nor for one biased layer.
    assert Parallel(mlp(), mlp(), fuse=True, join="sum", cuda_graph=True)._graph_variants((x,), {}) == [None]
    assert Parallel(nn.Linear(16, 4), nn.Linear(16, 4), fuse=True, cuda_graph=True)._graph_variants((x,), {}) == [
        None]
    assert Parallel(mlp(), nn.ReLU(), cuda_graph=True, compile="eager")._graph_variants((x,), {}) == [
        ("compiled",), ("eager",), ("whole",)]
    # Without compile= or fuse=: branches that differ are also tried each on a high-priority stream
    # (all but the first, which runs on the capture stream), up to eight of them.
    from parallel_modules.parallel import _Priority

    assert Parallel(mlp(), nn.ReLU(), nn.Tanh(), cuda_graph=True)._graph_variants((x,), {}) == [
        None, (_Priority(1),), (_Priority(2),)]
    # ... and, where their times alone (measured on CUDA inputs only) put them in another
    # order, captured longest first; not for training, which captures the first variant only.
    from parallel_modules.parallel import _Order

    block = Parallel(mlp(), nn.ReLU(), nn.Tanh(), cuda_graph=True)
    assert block._longest_first((x,), {}) == (0, 1, 2)  # a CPU input: nothing to time
    block._longest_first = lambda args, kwargs: (2, 0, 1)
    assert block._graph_variants((x,), {}) == [None, (_Order((2, 0, 1)),), (_Priority(1),), (_Priority(2),)]
    assert block._graph_variants((x,), {}, first_only=True) == [None]
    assert Parallel(mlp(), mlp(), cuda_graph=True)._graph_variants((x,), {}) == [None]  # nothing to put first
    shared = mlp()  # identical, though not fusable: one module twice
    assert Parallel(shared, shared, cuda_graph=True)._graph_variants((x,), {}) == [None]
    assert Parallel(mlp(), nn.ReLU(), streams=False, cuda_graph=True)._graph_variants((x,), {}) == [None]
    assert Parallel(mlp(), *[nn.ReLU()] * 8, cuda_graph=True)._graph_variants((x,), {}) == [None]
    pipe = ParallelSequential(mlp(), mlp(16, 4), chunks=2, cuda_graph=True, compile="eager")
    assert pipe._graph_variants((x,), {}) == [("compiled",), ("eager",), ("whole",)]
    # Torch-TensorRT builds engines per child only.
    assert Parallel(mlp(), mlp(), cuda_graph=True, compile="tensorrt")._graph_variants((x,), {}) == [
        ("compiled",), ("eager",)]


def test_the_whole_variant_is_the_block_compiled_as_one_program():
    recorder = Recorder()
    block = Parallel(*branches(3), compile=recorder).eval()
    pipe = ParallelSequential(mlp(16, 16), nn.ReLU(), mlp(16, 4), chunks=3, compile=recorder).eval()
    with torch.no_grad():
        x = torch.randn(6, 16)
        assert_same(block._compiler.whole(block._forward)(x), cat_reference(block, x))
        # One program for the block: every branch's two Linear layers, the join, no stream op.
        (graph,) = recorder.graphs
        assert str(graph.graph).count("linear") == 6 and "cat" in str(graph.graph)
        assert not any(w in str(graph.graph).lower() for w in ("stream", "event"))
        # Against the stages on the same micro-batches: a matrix product of 2 rows may sum in
        # another order than one of 6 (it does with MKL on AMD EPYC), so only that is bit-for-bit.
        pieces = [pipe[2](pipe[1](pipe[0](p))) for p in x.tensor_split(3)]
        assert_same(pipe._compiler.whole(pipe._eager)(x), torch.cat(pieces))
        assert str(recorder.graphs[1].graph).count("linear") == 4 * 3  # every micro-batch, one program
    # Compiled once per compiler; dropped with the rest of the compiled code.
    whole = block._compiler._whole
    block._compiler.whole(block._forward)
    assert block._compiler._whole is whole
    assert copy.deepcopy(block)._compiler._whole is None
    block.to(torch.float64)
    assert block._compiler._whole is None


def test_the_eager_variant_runs_the_children_themselves():
    from parallel_modules import _graphs

    block = Parallel(mlp(), mlp(), compile="eager")
    pipe = ParallelSequential(mlp(), mlp(16, 4), compile="eager")
    assert block._branches()[0] is not block[0] and list(pipe._stages())[0] is not pipe[0]
    try:
        _graphs._local.variant = (block, ("eager",))
        assert block._branches() == [block[0], block[1]]
        assert list(pipe._stages())[0] is not pipe[0]  # another module's variant
        _graphs._local.variant = (pipe, ("eager",))
        assert list(pipe._stages()) == [pipe[0], pipe[1]]
    finally:
        _graphs._local.variant = None


@cuda
def test_the_cuda_graph_keeps_eager_branches_when_the_compiled_ones_replay_slower():
    block = Parallel(*[b.cuda().eval() for b in branches(3)], cuda_graph=True, compile=SlowBackend())
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 16, device="cuda")
            assert_close(block(x), cat_reference(block, x), *CUDA_TOL[torch.float32])
    assert list(block._graphs.variants().values()) == [("eager",)]
    assert list(block.explain()["schedules"].values()) == ["CUDA graph, unfused, eager branches, streams"]


@cuda
def test_the_cuda_graph_keeps_compiled_branches_when_they_replay_faster():
    block = Parallel(SlowWhenEager(), SlowWhenEager(), mlp().cuda(), cuda_graph=True, compile="eager")
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 16, device="cuda")
            assert_same(block(x), torch.cat([x * 2, x * 2, block[2](x)], 1))
    # Compiled code, branch by branch or as one block (here they tie), never the slow eager branches.
    (variant,) = block._graphs.variants().values()
    assert variant in [("compiled",), ("whole",)]
    assert "eager" not in next(iter(block.explain()["schedules"].values()))


@cuda
def test_the_cuda_graph_keeps_the_block_compiled_as_one_when_it_replays_fastest():
    # Each compiled program sleeps once per call, each eager branch once: branch by branch on
    # one stream, compiled or not, two sleeps; the block compiled as one program, one sleep.
    for owner in ("Parallel", "ParallelSequential"):
        if owner == "Parallel":
            module = Parallel(SlowWhenEager(), SlowWhenEager(), streams=False, cuda_graph=True,
                              compile=SlowBackend())
            reference = lambda x: torch.cat([x * 2, x * 2], 1)  # noqa: E731
        else:
            module = ParallelSequential(SlowWhenEager(), SlowWhenEager(), cuda_graph=True, compile=SlowBackend())
            reference = lambda x: x * 4  # noqa: E731
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(8, 16, device="cuda")
                assert_same(module(x), reference(x))
        assert list(module._graphs.variants().values()) == [("whole",)], owner
        if owner == "Parallel":
            assert list(module.explain()["schedules"].values()) == [
                "CUDA graph, the block compiled as one, one stream"]


@cuda
def test_a_block_that_cannot_be_compiled_as_one_keeps_its_other_graphs():
    # The backend refuses any program with a concatenation: the whole block's, not a branch's.
    recorder = Recorder(fail_on="cat")
    block = Parallel(mlp().cuda(), mlp().cuda(), cuda_graph=True, compile=recorder)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 16, device="cuda")
            assert_close(block(x), cat_reference(block, x), *CUDA_TOL[torch.float32])
    assert recorder.failures == 1 and len(recorder.graphs) == 2  # the two branches compiled
    assert list(block._graphs.variants().values())[0] in [("compiled",), ("eager",)]
    assert "boom from backend" in block.explain()["not compiled as one"]
    # Not tried again for the next signature (each try is a compilation); a move tries again.
    with torch.no_grad():
        x = torch.randn(4, 16, device="cuda")
        assert_close(block(x), cat_reference(block, x), *CUDA_TOL[torch.float32])
    assert recorder.failures == 1 and ("whole",) not in block._graph_variants((x,), {})
    block.to("cuda")  # (moves nothing: keeps what it learnt)
    assert ("whole",) not in block._graph_variants((x,), {})
    block.double()
    assert ("whole",) in block._graph_variants((x,), {}) and "not compiled as one" not in block.explain()


@cuda
def test_the_cuda_graph_weighs_compiled_stages_against_eager_ones():
    torch.manual_seed(0)
    pipe = ParallelSequential(mlp(16, 64), mlp(64, 4), chunks=2, cuda_graph=True,
                              compile=SlowBackend()).cuda().eval()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 16, device="cuda")
            assert_close(pipe(x), pipe[1](pipe[0](x)), *CUDA_TOL[torch.float32])
    assert list(pipe._graphs.variants().values()) == [("eager",)]


@cuda
def test_training_graphs_capture_the_compiled_branches_only():
    block = Parallel(*[b.cuda() for b in branches(2)], join="sum", cuda_graph=True, compile=SlowBackend())
    x = torch.randn(8, 16, device="cuda", requires_grad=True)
    block(x).sum().backward()
    assert list(block._graphs.variants().values()) == [("compiled",)]


class _NormedThenChecked(nn.Module):
    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.graph_break = graph_break

    def forward(self, x):
        y = self.bn(x)
        if self.graph_break:
            torch._dynamo.graph_break()
            return torch.sigmoid(y)
        if bool((x.abs() > 1e3).any()):  # data-dependent: a graph break, then the user's own error
            raise ValueError("activation blew up")
        return y


def test_the_branchs_own_error_is_raised_without_running_it_again():
    # A failed compiled call used to run the branch a second time, eagerly, to tell whose
    # fault it was: its buffer updates happened twice.
    torch.manual_seed(0)
    ref, block = _NormedThenChecked().train(), Parallel(_NormedThenChecked(), compile="aot_eager").train()
    bad = torch.randn(8, 4)
    bad[0, 0] = 1e9
    for m in (ref, block):
        m(torch.randn(8, 4))
        with pytest.raises(ValueError, match="activation blew up"):
            m(bad)
    assert int(block[0].bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 2


def test_first_call_falling_back_after_a_partial_run_updates_buffers_once():
    # The backend refuses the graph after the break, once the graph before it (BatchNorm) ran.
    def picky(gm, example_inputs):
        if any(n.target in (torch.sigmoid, torch.ops.aten.sigmoid.default) for n in gm.graph.nodes):
            raise NotImplementedError("sigmoid is not supported by this backend")
        return gm.forward

    torch.manual_seed(0)
    x = torch.randn(8, 4) + 3.0
    ref = _NormedThenChecked(graph_break=True).train()
    block = Parallel(copy.deepcopy(ref), compile=picky, compile_fallback=True).train()
    with pytest.warns(UserWarning, match="failed to compile"):
        out = block(x)
    assert_close(out, ref(x))
    assert int(block[0].bn.num_batches_tracked) == 1
    assert_close(block[0].bn.running_mean, ref.bn.running_mean)
    assert_close(block[0].bn.running_var, ref.bn.running_var)


# --------------------------------------------------- found by a review of compile=
class _ShapeRecorder(Recorder):
    r"""Fails on graphs whose first input has ``rows`` rows."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        if any(isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == self.rows for t in example_inputs):
            self.failures += 1
            raise RuntimeError(f"boom from backend: {self.rows} rows")
        self.graphs.append(gm)
        return gm.forward


def test_a_backend_failure_changes_no_state_and_is_not_tried_again():
    # Before: each call re-ran the branch eagerly to diagnose the failure (BatchNorm's
    # counter moved 1, 2, 3 over three failing calls) and compiled again.
    recorder = Recorder(fail_on="tanh")
    bad = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh())
    block = Parallel(nn.Linear(8, 8), bad, compile=recorder).train()
    for _ in range(3):
        with pytest.raises(RuntimeError, match=r"(?s)branch '1' .*failed to compile.*The backend failed"):
            block(torch.randn(4, 8))
    assert bad[1].num_batches_tracked.item() == 0 and recorder.failures == 1


def test_compile_fallback_runs_eagerly_only_the_signatures_that_failed():
    # Before: one failure sent the branch to eager mode for every input signature.
    recorder = _ShapeRecorder(rows=3)
    block = Parallel(nn.Linear(8, 8), nn.Linear(8, 8), compile=recorder, compile_fallback=True)
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        for rows in (4, 3, 5, 4, 3):
            x = torch.randn(rows, 8)
            assert_same(block(x), cat_reference(block, x))
    assert len([w for w in record if "failed to compile" in str(w.message)]) == 2  # once per branch
    assert all(len(c.failed) == 1 for c in block._compiler._calls)
    compiled = len(recorder.graphs)
    with torch.no_grad():
        block(torch.randn(4, 8))
    assert len(recorder.graphs) == compiled  # batch 4 still runs compiled, not compiled again


def test_a_hook_registered_after_the_first_call_runs():
    # Dynamo does not guard on hooks added after tracing: the compiled branch ignored it.
    lin = nn.Linear(4, 4)
    block = Parallel(lin, nn.Identity(), compile="eager")
    x = torch.randn(2, 4)
    with torch.no_grad():
        block(x)
        handle = lin.register_forward_hook(lambda m, i, o: o * 0)
        assert_same(block(x), torch.cat([torch.zeros(2, 4), x], 1))
        handle.remove()
        assert_same(block(x), torch.cat([lin(x), x], 1))
        handle = lin.register_forward_hook(lambda m, i, o: o * 2)  # after a removal, seen as well
        assert_same(block(x), torch.cat([nn.functional.linear(x, lin.weight, lin.bias) * 2, x], 1))
        handle.remove()
        assert_same(block(x), torch.cat([lin(x), x], 1))


def test_deepcopy_shares_a_callable_backend_and_names_it_by_class():
    import threading

    class Locked(Recorder):
        def __init__(self) -> None:
            super().__init__()
            del self.__qualname__
            self.lock = threading.Lock()

    backend = Locked()
    block = Parallel(nn.Linear(4, 4), compile=backend)
    clone = copy.deepcopy(block)
    assert clone._compiler.backend is backend and clone[0] is not block[0]
    assert "compile='test_deepcopy_shares_a_callable_backend_and_names_it_by_class.<locals>.Locked'" in repr(block)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert_same(clone(x), clone[0](x))


def test_misspelt_inductor_options_are_refused_when_built():
    with pytest.raises(ValueError, match=r"Parallel: compile_options options=\['max_autotun'\] are not inductor"):
        Parallel(nn.Linear(4, 4), compile="inductor", compile_options={"options": {"max_autotun": True}})


def test_a_to_that_moves_nothing_keeps_the_compiled_branches():
    # Before: model.to(device) in a loop compiled every branch anew at each call.
    recorder = Recorder()
    block = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), compile=recorder)
    pipe = ParallelSequential(nn.Linear(4, 4), compile=recorder)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            block.to("cpu").float()(x)
            pipe.to("cpu").float()(x)
        assert len(recorder.graphs) == 3
        block.double()  # a cast that changes the parameters compiles anew
        assert_same(block(x.double()), cat_reference(block, x.double()))
    assert len(recorder.graphs) == 5


def test_a_to_after_a_branch_moved_on_its_own_still_resets_the_block():
    # The README's remedy for a branch moved by a .to() of its own: moving the whole block.
    # Nothing moves at that call, but the block differs from what it learnt: it starts over.
    block = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), compile=Recorder())
    x = torch.randn(2, 4)
    with torch.no_grad():
        block(x)
        tuner = block._tuner
        block[0].double(), block[1].double()
        block.double()
        assert block._tuner is not tuner and not block._compiler._calls
        assert_same(block(x.double()), cat_reference(block, x.double()))


def test_a_pipeline_checking_its_softmax_dims_compiles_its_stages_once():
    # Before (a CPU hunt): the first call of a signature ran the compiled stages under the
    # softmax check's torch function mode, on which compiled code guards: every stage compiled
    # again for the next call (3 frames, then 6). It runs them uncompiled instead.
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    counter = CompileCounter()
    model = ParallelSequential(nn.Linear(8, 8), nn.Softmax(dim=-1), nn.Linear(8, 8), chunks=2, compile=counter)
    x = torch.randn(6, 8)
    expected = torch.cat([nn.Sequential(*model)(c) for c in x.tensor_split(2)])
    frames = []
    for _ in range(3):
        assert_same(model(x), expected)
        frames.append(counter.frame_count)
    assert frames == [0, 3, 3]
    with pytest.raises(RuntimeError, match=r"contains '1' \(Softmax\(dim=-2\)\).*dimension 0"):
        ParallelSequential(nn.Linear(8, 8), nn.Softmax(dim=-2), chunks=2, compile=CompileCounter())(x)


@cuda
def test_a_host_input_pipeline_checking_its_softmax_dims_captures_its_compiled_stages():
    # Before (a review): the first call of a signature, run uncompiled for the softmax check,
    # captured the per-stage graphs of a host-input cuda_graph=True pipeline from the
    # uncompiled stages, which every later call then replayed: compile= had no effect.
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    counter = CompileCounter()
    model = ParallelSequential(nn.Linear(8, 8), nn.Softmax(dim=-1), nn.Linear(8, 8), chunks=2, compile=counter,
                               cuda_graph=True).cuda().eval()
    reference = nn.Sequential(*copy.deepcopy(list(model)))
    x = torch.randn(6, 8)
    with torch.no_grad():
        for _ in range(3):
            assert_close(model(x), reference(x.cuda()))
    assert counter.frame_count > 0
    assert all(c.captures > 0 for c in model._per_stage.values())


@pytest.mark.parametrize("owner", [Parallel, ParallelSequential])
def test_a_shallow_copy_compiles_its_children_once(owner):
    # Before (a CPU hunt): copy.copy shared the block's compiler, which keeps one list of
    # compiled children: once the two lists of children differed, each call of either
    # block built its children anew and compiled the one the other lacks (2 frames per call).
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    torch.manual_seed(0)
    block = owner(nn.Linear(8, 8), nn.Linear(8, 8), compile=counter)
    other = copy.copy(block)
    other[1] = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    frames = []
    with torch.no_grad():
        for _ in range(3):
            for model in (block, other):
                expected = (torch.cat([m(x) for m in model], 1) if owner is Parallel else model[1](model[0](x)))
                assert_same(model(x), expected)
            frames.append(counter.frame_count)
    assert frames == [4, 4, 4]  # each block's two children, compiled once
    assert other._compiler is not block._compiler
    assert other._compiler.settings() == block._compiler.settings()


@pytest.mark.parametrize("owner", [Parallel, ParallelSequential])
def test_a_hook_on_a_submodule_added_after_the_first_call_runs(owner):
    # Before (a CPU hunt): the compiled form watched the hook dicts of the modules the child
    # held when it was traced; a hook registered on a submodule put in later never ran.
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model = owner(seq, nn.Identity(), compile="eager")
    x = torch.randn(2, 4)
    expected = (lambda: torch.cat([seq(x), x], 1)) if owner is Parallel else (lambda: seq(x))
    with torch.no_grad():
        model(x)
        new = nn.Linear(4, 4)
        seq[0] = new
        assert_same(model(x), expected())  # (dynamo compiles anew for the new module)
        handle = new.register_forward_hook(lambda m, i, o: o * 0 - 1)
        assert_same(model(x), expected())
        assert float(seq(x).abs().max()) == 0.0  # (the hook zeroes the branch: ReLU(-1))
        handle.remove()
        assert_same(model(x), expected())


@pytest.mark.parametrize("owner", [Parallel, ParallelSequential])
def test_a_copy_of_a_block_compiled_by_module_compile_runs_its_own_parameters(owner):
    # Before (a CPU hunt): __getstate__ copied the block's __dict__ with what
    # ``module.compile()`` keeps there (compiled code calling *this* block's _call_impl),
    # which nn.Module's own __getstate__ leaves out: a deep copy ran the original block,
    # and pickling (torch.save(model)) failed on it.
    torch.manual_seed(0)
    block = owner(nn.Linear(4, 3), nn.Linear(4, 3) if owner is Parallel else nn.ReLU())
    block.compile(backend="eager")
    x = torch.randn(2, 4)
    with torch.no_grad():
        block(x)
        for make in (copy.deepcopy, lambda b: pickle.loads(pickle.dumps(b))):
            clone = make(block)
            clone[0].weight.zero_()
            clone[0].bias.fill_(1.0)
            expected = torch.ones(2, 6) if owner is Parallel else torch.ones(2, 3)
            if owner is Parallel:
                expected[:, 3:] = clone[1](x)
            assert_same(clone(x), expected)
        assert_same(block(x), torch.cat([b(x) for b in block], 1) if owner is Parallel else block[1](block[0](x)))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_guard_filter_reaches_every_compiled_branch(backend):
    # torch.compile takes guard_filter_fn out of the options dict it is given: before, the
    # dict was shared, so the first branch compiled took it from the others (and, for
    # backends but inductor, from the user's dict); inductor refused it as no option of its.
    filtered: list[int] = []

    def keep_all(entries):
        filtered.append(len(entries))
        return [True] * len(entries)

    options = {"guard_filter_fn": keep_all}
    block = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), compile=backend, compile_options={"options": options})
    assert options == {"guard_filter_fn": keep_all}
    if backend == "inductor":  # (compiling C++ on the CPU: what each branch's torch.compile gets)
        assert all(block._compiler._compile_kwargs()["options"]["guard_filter_fn"] is keep_all for _ in range(2))
        return
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert_same(block(x), cat_reference(block, x))
    assert len(filtered) == 2 and options == {"guard_filter_fn": keep_all}


@pytest.mark.parametrize("owner", [Parallel, ParallelSequential])
def test_a_compile_error_raised_leaves_the_buffers_as_they_were(owner):
    # fullgraph=True refuses the graph break (dynamo's error, not a backend's): the child runs
    # eagerly to tell whose failure it is. Before, that run's BatchNorm update stayed although
    # the call raised; the same call again, refused at once, changed nothing.
    block = owner(_NormedThenChecked(graph_break=True), compile="eager",
                  compile_options={"fullgraph": True}).train()
    bn = block[0].bn
    before = [b.clone() for b in bn.buffers()]
    for _ in range(2):
        with pytest.raises(RuntimeError, match="failed to compile"):
            block(torch.randn(8, 4))
        for b, saved in zip(bn.buffers(), before):
            assert_same(b, saved)


def test_explain_names_the_branches_that_fall_back_to_eager():
    # Before: explain() said nothing of a branch that compile_fallback=True runs eagerly.
    recorder = _ShapeRecorder(rows=3)
    block = Parallel(OrderedDict(a=nn.Linear(8, 8), b=nn.Linear(8, 8)), compile=recorder, compile_fallback=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block(torch.randn(4, 8))
        assert "compile fallback" not in block.explain()
        block(torch.randn(3, 8))
    assert block.explain()["compile fallback"] == {
        name: "runs eagerly on 1 input signature(s) it failed to compile for (RuntimeError: boom from backend: 3 rows)"
        for name in "ab"}
    block.b = nn.Linear(8, 8)  # compiled anew at the next call
    assert list(block.explain()["compile fallback"]) == ["a"]
    strict = Parallel(nn.Linear(8, 8), compile=_ShapeRecorder(rows=3))
    with pytest.raises(RuntimeError, match="failed to compile"):
        strict(torch.randn(3, 8))
    assert "compile fallback" not in strict.explain()  # (such calls raise: nothing runs eagerly)


class _SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.att(x, x, x, need_weights=False)[0]


def test_a_compiled_pipeline_refuses_an_unbatched_sequence_it_would_cut():
    # Before: the check that a batch_first sequence layer is not given a 2-D micro-batch (one
    # sequence, cut by chunks=) ran only without compile=; compiled, the pipeline returned the
    # wrong result silently. The first call of a signature runs the stages uncompiled for it.
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    counter = CompileCounter()
    model = ParallelSequential(_SelfAttention(), nn.Linear(8, 8), chunks=2, compile=counter).eval()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"contains '0.att' \(MultiheadAttention, batch_first=True\), given "
                                               r"a 2-D input \(3, 8\)"):
            model(torch.randn(6, 8))
        x = torch.randn(4, 5, 8)  # batched sequences: run, as without compile=
        expected = nn.Sequential(*model)(x)
        frames = []
        for _ in range(3):
            assert_close(model(x), expected, *CPU_TOL)
            frames.append(counter.frame_count)
    assert frames[0] == 0 and frames[1] == frames[2] > 0  # checked uncompiled, then compiled once


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("owner", [Parallel, ParallelSequential])
def test_a_child_that_failed_to_compile_compiles_again_once_a_layer_is_replaced(owner, fallback):
    # Before (a CPU hunt): a signature that failed to compile stayed failed for the child's
    # life: with the layer the backend refused replaced, calls still raised the old message
    # (naming a Tanh no longer there), or with compile_fallback=True ran eagerly for good.
    recorder = Recorder(fail_on="tanh")
    torch.manual_seed(0)
    child = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    model = owner(nn.Linear(8, 8), child, compile=recorder, compile_fallback=fallback)
    x = torch.randn(4, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if fallback:
            model(x)
        else:
            with pytest.raises(RuntimeError, match="failed to compile"):
                model(x)
        compiled = len(recorder.graphs)
        child[1] = nn.Sigmoid()
        if owner is Parallel and fallback:
            assert "compile fallback" not in model.explain()  # (the failure was the old layer's)
        expected = torch.cat([m(x) for m in model], 1) if owner is Parallel else child(model[0](x))
        assert_same(model(x), expected)
    assert len(recorder.graphs) == compiled + 1  # the child, compiled with its new layer
    assert not model._compiler._calls[1].failed


@pytest.mark.parametrize("owner", [Parallel, ParallelSequential])
def test_a_child_replaced_by_one_that_compares_equal_runs_the_new_one(owner):
    # Before (a CPU hunt): the compiled children were found anew when the tuple of children
    # differed by ``!=``, which calls a module's own ``__eq__``: a layer replaced by one equal
    # to it ran the old layer's compiled form, with the old weights.
    torch.manual_seed(0)
    model = owner(EqualByClass(4, 4), compile="eager")
    x = torch.randn(2, 4)
    with torch.no_grad():
        model(x)
        model[0] = EqualByClass(4, 4)
        assert_same(model(x), model[0](x))
    assert model._compiler._calls[0].module is model[0]


class _RefusingAutocast:
    r"""A backend that compiles graphs traced without autocast (counted) and refuses those traced under it."""

    def __init__(self) -> None:
        self.compiled = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("this backend takes no autocast graph")
        self.compiled += 1
        return gm.forward


@pytest.mark.parametrize("fallback", [False, True])
def test_a_failure_to_compile_under_autocast_is_not_held_against_calls_without_it(fallback):
    # Before (a CPU hunt): a failure was remembered by the input signature alone, so a child that
    # failed under autocast was refused (or run eagerly, with compile_fallback=True) on the same
    # inputs without autocast, which compile.
    torch.manual_seed(0)
    backend = _RefusingAutocast()
    model = Parallel(nn.Linear(8, 8), compile=backend, compile_fallback=fallback)
    x = torch.randn(2, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fallback:
                assert_same(model(x), model[0](x))
            else:
                with pytest.raises(RuntimeError, match="takes no autocast graph"):
                    model(x)
        assert_same(model(x), model[0](x))
        assert backend.compiled == 1  # (not refused, nor run eagerly, for autocast's failure)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # (still remembered under autocast)
            if fallback:
                assert_same(model(x), model[0](x))
            else:
                with pytest.raises(RuntimeError, match="failed to compile"):
                    model(x)
    assert len(model._compiler._calls[0].failed) == 1


def test_a_swap_elsewhere_does_not_forget_a_childs_failure_to_compile():
    # Before: the tree that watches a failed child (a module of the user's, which keeps no
    # placement of its last reset) took any torch.utils.swap_tensors in the process, of tensors
    # it does not hold, as its change: the failure was forgotten, the child compiled again and
    # warned again, and explain() left it out meanwhile.
    recorder = Recorder(fail_on="tanh")
    block = Parallel(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), compile=recorder,
                     compile_fallback=True)
    x = torch.randn(4, 8)
    with torch.no_grad(), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        block(x)
        torch.utils.swap_tensors(torch.zeros(2), torch.ones(2))  # (tensors of no block's)
        assert list(block.explain()["compile fallback"]) == ["1"]
        assert_same(block(x), cat_reference(block, x))
    assert len([w for w in record if "failed to compile" in str(w.message)]) == 1
    assert recorder.failures == 1



def test_compiled_autograd_trains_a_fused_block_as_eager():
    # Compiled autograd captures the backward pass the engine would run as one FX graph, a fused
    # group's own autograd Functions (its stacks' unstacking, which hands no gradient to heads the
    # loss leaves out, its batched Linear's backward) included, and hands .grad as the engine does:
    # gradients and an optimizer's steps must match the sequential module's, for losses on other
    # heads at each step. (The graph is run as captured: Dynamo compiling it, as
    # ``torch._dynamo.config.compiled_autograd = True`` does, takes 9 s here, and gives the same.)
    from torch._dynamo import compiled_autograd

    torch.manual_seed(0)
    made = [nn.Linear(16, 8) for _ in range(3)]
    block, ref = Parallel(*copy.deepcopy(made), fuse=True, join=None), nn.ModuleList(made)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (block, ref))
    for heads in [(0,), (1, 2)]:
        x = torch.randn(4, 16)
        opt.zero_grad(), ref_opt.zero_grad()
        with compiled_autograd._enable(lambda graph: graph):
            outs = block(x)
            sum(outs[h].square().mean() * (h + 1) for h in heads).backward()
        sum(ref[h](x).square().mean() * (h + 1) for h in heads).backward()
        for q, qr in zip(block.parameters(), ref.parameters()):
            assert (q.grad is None) == (qr.grad is None)
            if q.grad is not None:
                assert_close(q.grad, qr.grad)
        opt.step(), ref_opt.step()
        for q, qr in zip(block.parameters(), ref.parameters()):
            assert_close(q, qr)
    assert block.explain()["fused"] == [["0", "1", "2"]]
