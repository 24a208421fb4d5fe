"""Fused groups' ``Linear`` layers as one Triton kernel each in a CUDA graph (``parallel_modules._batched_linear``).

The kernel is compared with the same layer computed by torch (float32 accumulation, so fp32
agrees within ``1e-5``); where it applies is checked on the CPU with the kernel stood in for
(``tests/test_fusion.py``'s ``layouts`` fixture runs every fused case that way too).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_modules import Parallel, _batched_linear, _fusion
from tests._reference import assert_close, reference

ACTIVATIONS = {
    _batched_linear._NONE: lambda y: y,
    _batched_linear._GELU: F.gelu,
    _batched_linear._RELU: F.relu,
    _batched_linear._GELU_TANH: lambda y: F.gelu(y, approximate="tanh"),
    _batched_linear._SILU: F.silu,
}


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                     act: int = 0) -> torch.Tensor:
    r"""What ``_batched_linear.linear`` computes, by torch: ``out[n] = act(x[n] @ weight[n].T + bias[n])``."""
    y = x.float() @ weight.float().mT
    if bias is not None:
        y = y + bias.float().unsqueeze(1)
    out.copy_(ACTIVATIONS[act](y))
    return out


needs_kernel = pytest.mark.skipif(
    not torch.cuda.is_available() or _batched_linear.unavailable() is not None,
    reason="needs a CUDA GPU and Triton")


def mlp(width: int = 32, depth: int = 3, act: type[nn.Module] = nn.GELU, **kw) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), act(**kw))])


# ---------------------------------------------------------------- on the CPU
@pytest.mark.parametrize("module, code", [
    (nn.GELU(), _batched_linear._GELU), (nn.GELU(approximate="tanh"), _batched_linear._GELU_TANH),
    (nn.ReLU(), _batched_linear._RELU), (nn.SiLU(), _batched_linear._SILU), (nn.Tanh(), None),
    (nn.LeakyReLU(), None), (None, None),
])
def test_activations_the_epilogue_applies(module, code):
    assert _batched_linear.activation(module) == code


def test_never_on_the_cpu():
    assert not _batched_linear.supported(8, 256, 256, torch.float32, torch.device("cpu"))


def test_without_triton_or_after_a_failure_nothing_is_launched(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(_batched_linear, "_kernel", lambda: None)
    assert _batched_linear.unavailable() == "Triton is not installed"
    assert not _batched_linear.supported(8, 256, 256, torch.float32, cuda)

    def launch(*args, **kwargs):
        raise AssertionError("launched")

    monkeypatch.setattr(_batched_linear, "_kernel", lambda: launch)
    monkeypatch.setattr(_batched_linear, "_failure", "the Triton kernel failed: ...")
    assert _batched_linear.unavailable() == "the Triton kernel failed: ..."
    assert not _batched_linear.supported(8, 256, 256, torch.float32, cuda)
    x, w = torch.zeros(2, 3, 4), torch.zeros(2, 5, 4)
    assert _batched_linear.linear(x, w, None, torch.zeros(2, 3, 5)) is None


@pytest.fixture
def stand_in_triton(monkeypatch):
    r"""A Triton stood in for on the CPU: ``kernel[grid](...)`` and the compiled kernel's launcher
    compute the layer by torch and log ``("jit" | "direct", grid, stream)``; returns the log."""
    import types

    class Log(list):
        flags: list[tuple[bool, bool]]  # each launch's (WAIT, TRIGGER)

    log = Log()
    log.flags = []

    def compute(args):
        log.flags.append(tuple(args[-2:]))
        x, w, b, out = args[:4]
        has_bias, act = args[17:19]
        reference_linear(x, w, b if has_bias else None, out, act)

    class Compiled:
        function, packed_metadata = object(), object()

        def __init__(self, options):
            self.options = options  # (Triton's own compile options, launch_pdl among them)

        def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit, *args):
            assert (function, metadata) == (self.function, self.packed_metadata) and g2 == 1
            assert self.options.get("launch_pdl", False) == args[-2]  # (a WAIT kernel launched dependent)
            log.append(("direct", (g0, g1), stream))
            compute(args)

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, num_warps, num_stages, **options):
                assert options == ({"launch_pdl": True} if args[-2] else {})  # (chained: WAIT)
                log.append(("jit", grid, None))
                compute(args)
                return Compiled(options)
            return launch

    triton = types.ModuleType("triton")
    triton.knobs = types.SimpleNamespace(runtime=types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    monkeypatch.setattr(_batched_linear, "_kernel", Kernel)
    monkeypatch.setattr(_batched_linear, "_launchers", {})
    monkeypatch.setattr(_batched_linear, "_direct", True)
    monkeypatch.setattr(_batched_linear, "_failure", None)
    return log, triton.knobs.runtime


def layer(rows: int = 3, seed: int = 0, n: int = 2):
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(n, rows, 8, generator=g), torch.randn(n, 5, 8, generator=g), torch.randn(n, 5, generator=g)
    return x, w, b, torch.empty(n, rows, 5)


def test_launches_after_a_specializations_first_go_to_its_compiled_kernel(stand_in_triton):
    log, _ = stand_in_triton
    for seed in range(3):  # fresh values, one specialization
        x, w, b, out = layer(seed=seed)
        assert _batched_linear.linear(x, w, b, out, _batched_linear._GELU, dot=False) is out
        torch.testing.assert_close(out, reference_linear(x, w, b, torch.empty_like(out), _batched_linear._GELU))
    assert [kind for kind, *_ in log] == ["jit", "direct", "direct"]
    assert log[1][1:] == (log[0][1], 7)  # the first launch's grid, on the current stream
    _batched_linear.linear(*layer(rows=4), dot=False)  # another shape: through Triton's own launch first
    _batched_linear.linear(*layer(rows=3), act=_batched_linear._RELU, dot=False)  # another activation
    assert [kind for kind, *_ in log[3:]] == ["jit", "jit"]
    assert _batched_linear.launches_fast()
    # As many members again, every stride the same: another grid, which a launcher is bound to.
    x, w, b, out = layer(n=4)
    assert x.stride() == layer()[0].stride() and out.stride() == layer()[3].stride()
    _batched_linear.linear(x, w, b, out, _batched_linear._GELU, dot=False)
    torch.testing.assert_close(out, reference_linear(x, w, b, torch.empty_like(out), _batched_linear._GELU))
    assert log[-1][:2] == ("jit", (log[0][1][0], 4))


def test_chained_layers_are_launched_dependent_where_the_device_allows(stand_in_triton, monkeypatch):
    # A chained launch waits for the kernel before (WAIT) where programmatic dependent launch
    # exists; every launch there signals its dependents (TRIGGER). Each is its own specialization.
    log, _ = stand_in_triton
    for pdl in (False, True):
        monkeypatch.setattr(_batched_linear, "_pdl", lambda index: pdl)
        for chained in (False, True, True):
            x, w, b, out = layer(seed=len(log))
            assert _batched_linear.linear(x, w, b, out, _batched_linear._RELU, dot=False, chained=chained) is out
            torch.testing.assert_close(out, reference_linear(x, w, b, torch.empty_like(out), _batched_linear._RELU))
    assert log.flags == [(False, False)] * 3 + [(False, True), (True, True), (True, True)]
    assert [kind for kind, *_ in log] == ["jit", "direct", "direct", "jit", "jit", "direct"]


@pytest.mark.parametrize("capability, option, gdc, pdl", [
    ((9, 0), True, True, True), ((10, 0), True, True, True),
    ((8, 0), True, True, False),  # (programmatic dependent launch: sm90 and later)
    ((9, 0), False, True, False), ((9, 0), True, False, False),  # (a Triton without it)
    ((9, 0), True, None, False), ((9, 0), None, True, False),  # (without the modules at all)
])
def test_dependent_launches_where_device_and_triton_have_them(monkeypatch, capability, option, gdc, pdl):
    import dataclasses
    import types

    @dataclasses.dataclass
    class CUDAOptions:
        num_warps: int = 4

    if option:
        CUDAOptions = dataclasses.make_dataclass("CUDAOptions", [("launch_pdl", bool, False)], bases=(CUDAOptions,))
    compiler = types.ModuleType("triton.backends.nvidia.compiler")
    compiler.CUDAOptions = CUDAOptions
    extra = types.ModuleType("triton.language.extra.cuda")
    if gdc:
        extra.gdc_wait = extra.gdc_launch_dependents = lambda: None
    # (None in sys.modules: the import raises ImportError.)
    compiler, extra = (None if flag is None else module for flag, module in ((option, compiler), (gdc, extra)))
    monkeypatch.setitem(sys.modules, "triton.backends.nvidia.compiler", compiler)
    monkeypatch.setitem(sys.modules, "triton.language.extra.cuda", extra)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    _batched_linear._pdl.cache_clear()
    try:
        assert _batched_linear._pdl(0) is pdl
        assert _batched_linear._pdl(None) is False  # (a CPU tensor's device)
    finally:
        _batched_linear._pdl.cache_clear()


def test_launches_under_a_launch_hook_go_through_triton(stand_in_triton):
    # Triton's profilers hook launches and read the metadata its own launch path prepares.
    # (Newer Tritons hold a chain of hooks, empty unless a profiler added one.)
    import types

    log, runtime = stand_in_triton
    _batched_linear.linear(*layer(), dot=False)
    for hook in (lambda metadata: None, types.SimpleNamespace(calls=[print])):
        runtime.launch_exit_hook = hook
        x, w, b, out = layer(seed=1)
        _batched_linear.linear(x, w, b, out, dot=False)
        torch.testing.assert_close(out, reference_linear(x, w, b, torch.empty_like(out)))
    for hook in (None, types.SimpleNamespace(calls=[])):
        runtime.launch_enter_hook = runtime.launch_exit_hook = hook
        _batched_linear.linear(*layer(), dot=False)
    assert [kind for kind, *_ in log] == ["jit", "jit", "jit", "direct", "direct"]


def test_a_launcher_that_refuses_its_arguments_leaves_launches_to_triton(stand_in_triton, monkeypatch):
    # A Triton whose compiled kernels take their arguments otherwise: refused before anything
    # is launched, that launch and every later one go through Triton's own launch path.
    log, _ = stand_in_triton
    _batched_linear.linear(*layer(), dot=False)
    key = next(iter(_batched_linear._launchers))
    monkeypatch.setitem(_batched_linear._launchers, key, lambda *args: (_ for _ in ()).throw(TypeError("arguments")))
    x, w, b, out = layer(seed=1)
    assert _batched_linear.linear(x, w, b, out, dot=False) is out
    torch.testing.assert_close(out, reference_linear(x, w, b, torch.empty_like(out)))
    assert not _batched_linear.launches_fast()
    _batched_linear.linear(*layer(rows=4), dot=False)
    _batched_linear.linear(*layer(rows=4), dot=False)
    assert [kind for kind, *_ in log] == ["jit", "jit", "jit", "jit"]
    assert set(_batched_linear._launchers.values()) == {None}


@pytest.mark.parametrize("rows, k, width, dtype, takes", [
    (8, 256, 256, torch.float32, True), (16, 4096, 4096, torch.bfloat16, True),
    (17, 256, 256, torch.float32, False), (8, 8192, 256, torch.float32, False), (8, 256, 256, torch.float64, False),
])
def test_shapes_the_kernel_takes(monkeypatch, rows, k, width, dtype, takes):
    monkeypatch.setattr(_batched_linear, "unavailable", lambda: None)
    monkeypatch.setattr(torch.version, "hip", None)
    assert _batched_linear.supported(rows, k, width, dtype, torch.device("cuda", 0)) is takes


def group_of(p: Parallel) -> _fusion._Group:
    p(torch.zeros(2, 32))  # (finds the groups)
    (group,) = p._fusion.units
    return group


@pytest.mark.parametrize("branch, takes", [
    (lambda: mlp(), True),
    (lambda: nn.Linear(32, 32), True),
    (lambda: nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8, bias=False)), True),
    (lambda: nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32)), False),  # not Linear and pointwise alone
    (lambda: nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5)), False),
])
def test_which_groups_the_kernel_takes(monkeypatch, branch, takes):
    monkeypatch.setattr(_batched_linear, "supported", lambda *args: True)
    p = Parallel(*[branch().eval() for _ in range(3)], fuse=True).eval()
    group = group_of(p)
    with torch.no_grad():
        assert group.kernel_layers(torch.zeros(4, 32)) is takes
        assert not group.kernel_layers(torch.zeros(2, 4, 32))  # rows of features only
        assert not group.kernel_layers(torch.zeros(4, 32, dtype=torch.float64))  # not the weights' dtype


def test_the_kernel_answers_by_row_count_are_bounded(monkeypatch):
    # Before (a CPU hunt for unbounded growth): kernel_layers remembered its answer for every
    # row count it was asked of, eagerly at every call on CUDA, without bound: tokens of
    # variable-length batches flattened into rows made a new entry at each call.
    from parallel_modules import _inputs
    monkeypatch.setattr(_inputs, "_MAX_PLANS", 8)
    group = group_of(Parallel(*[mlp().eval() for _ in range(3)], fuse=True).eval())
    with torch.no_grad():
        for rows in range(1, 21):
            group.kernel_layers(torch.zeros(rows, 32))
    assert list(group.kernel_shapes) == [(rows, torch.float32, torch.device("cpu")) for rows in range(13, 21)]


@pytest.mark.parametrize("branch, paired", [
    (mlp, True), (lambda: nn.Linear(32, 32), False), (lambda: nn.Sequential(nn.Linear(32, 32), nn.Tanh()), False),
    (lambda: nn.Sequential(nn.GELU(), nn.Linear(32, 32)), False),
    (lambda: nn.Sequential(nn.Linear(32, 32), nn.SiLU()), True),
])
def test_eager_calls_take_the_kernel_where_it_saves_a_launch(branch, paired):
    # Eagerly a Linear without an activation after it is one cuBLAS call already.
    assert group_of(Parallel(*[branch() for _ in range(3)], fuse=True)).paired is paired


class Passing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.fixture
def eager_kernels(monkeypatch):
    r"""Eager calls take the kernel as they would on a GPU whose launches are direct, the CPU standing in
    for it with the reference; returns the activation code of each launch."""
    launched: list[int] = []

    def stand_in(x, weight, bias, out, act=0, dot=None, chained=False):
        launched.append(act)
        return reference_linear(x, weight, bias, out, act)

    monkeypatch.setattr(_fusion, "_launches_fast", lambda x: True)
    monkeypatch.setattr(_batched_linear, "supported", lambda *args: True)
    monkeypatch.setattr(_batched_linear, "linear", stand_in)
    return launched


@pytest.mark.parametrize("branch, launches", [
    (lambda: nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8)), [_batched_linear._GELU]),
    (lambda: nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 32), nn.SiLU())),
     [_batched_linear._RELU, _batched_linear._SILU]),
    (lambda: nn.Linear(32, 8), []),
    (lambda: nn.Sequential(nn.Sequential(nn.Linear(32, 32)), nn.GELU()), []),  # (not paired across Sequentials)
])
@pytest.mark.parametrize("join", ["cat", "sum", None])
def test_eager_calls_launch_the_kernel_for_paired_layers_only(eager_kernels, branch, launches, join):
    p = Parallel(*[branch() for _ in range(3)], fuse=True, join=join).eval()
    with torch.no_grad():
        for _ in range(2):  # fresh inputs
            eager_kernels.clear()
            x = torch.randn(4, 32)
            assert_close(p(x), reference(p, x), atol=1e-5)
            assert eager_kernels == launches
        x = torch.randn(4, 32)
        p(x)
        eager_kernels.clear()
        with Passing():  # (a dispatch mode sees torch's operations, which a launch by hand would pass by)
            out = p(x)
        assert eager_kernels == []
        assert_close(out, reference(p, x), atol=1e-5)
    eager_kernels.clear()
    assert_close(p(x), reference(p, x), atol=1e-5)  # autograd records: torch's layers, which have a backward
    assert eager_kernels == []


def test_an_activation_s_approximation_set_after_a_call_is_launched(eager_kernels):
    # Before: the epilogue's code was taken when the group's steps were made: GELU's
    # approximation set to "tanh" alike on every member after the first call was launched
    # as the exact GELU, where the branches computed the tanh one (unfused, and on the CPU,
    # the step calls the layer and saw it).
    p = Parallel(*[nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8)) for _ in range(3)],
                 fuse=True).eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        p(x)
        for b in p:
            b[1].approximate = "tanh"
        eager_kernels.clear()
        assert_close(p(x), reference(p, x), atol=1e-5)
    assert eager_kernels == [_batched_linear._GELU_TANH]


def test_an_activation_s_approximation_set_on_the_first_member_only_is_not_launched_for_all(eager_kernels):
    # Before: the epilogue's code chosen anew from the first member's GELU, set to "tanh" on it
    # alone after the first call, was launched for every member, where the other branches
    # computed the exact GELU. Seen as it is chosen anew, the members are compared.
    p = Parallel(*[nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8)) for _ in range(3)],
                 fuse="auto").eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        for _ in range(3):  # (fuse="auto" runs its first calls unfused, as a trial)
            p(x)
        p[0][1].approximate = "tanh"
        for _ in range(2):
            assert_close(p(x), reference(p, x), atol=1e-5)
    assert p.explain()["fused"] == [["1", "2"]]


@pytest.mark.parametrize("captured", [False, True])
def test_layers_restacked_for_the_call_are_never_chained(monkeypatch, captured):
    # Under torch.func.functional_call the members' tensors are stacked anew before each
    # layer, on the stream the layers run on: no layer may load its weights before that
    # stack has ended, which only a launch that is not chained waits for.
    chains = []

    def stand_in(x, weight, bias, out, act=0, dot=None, chained=False):
        chains.append(chained)
        return reference_linear(x, weight, bias, out, act)

    monkeypatch.setattr(_fusion, "_launches_fast", lambda x: True)
    monkeypatch.setattr(_fusion, "_kernels_cost_more", lambda x: captured)
    monkeypatch.setattr(_batched_linear, "supported", lambda *args: True)
    monkeypatch.setattr(_batched_linear, "linear", stand_in)
    p = Parallel(*[mlp() for _ in range(3)], fuse=True).eval()
    with torch.no_grad():
        x = torch.randn(4, 32)
        p(x)
        assert chains == [False, True, True]
        assert _fusion._call.chained is False  # (put back as it was before the call)
        chains.clear()
        params = {k: v * 2 for k, v in p.named_parameters()}
        out = torch.func.functional_call(p, params, (x,))
        assert chains == [False, False, False]
        assert _fusion._call.chained is False
        doubled = copy.deepcopy(p)
        for name, value in params.items():
            doubled.get_parameter(name).copy_(value)
        torch.testing.assert_close(out, reference(doubled, x), rtol=1e-5, atol=1e-5)


def test_eager_kernels_refuse_what_torch_refuses(eager_kernels):
    # Biases in another dtype than the input: F.linear raises, so must the fused call (its
    # members, run unfused after the batched attempt, name the branch).
    branches = [nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)]
    for b in branches:
        b[0].bias.data = b[0].bias.data.bfloat16()
    p = Parallel(*branches, fuse=True).eval()
    with torch.no_grad(), pytest.raises(RuntimeError, match="dtype"):
        p(torch.randn(4, 32))
    assert eager_kernels == []


def test_the_kernel_is_for_inference(monkeypatch):
    monkeypatch.setattr(_batched_linear, "supported", lambda *args: True)
    group = group_of(Parallel(*[mlp() for _ in range(3)], fuse=True))
    x = torch.zeros(4, 32)
    assert not group.kernel_layers(x)  # parameters that take gradients
    with torch.no_grad():
        assert group.kernel_layers(x)
        with torch.autocast("cpu"):
            assert not group.kernel_layers(x)
    for p in group.members[1].parameters():
        p.requires_grad_(False)
    assert not group.kernel_layers(x)  # one member still trains
    for m in group.members:
        m.requires_grad_(False)
    assert group.kernel_layers(x)
    assert not group.kernel_layers(x.requires_grad_())


def test_not_under_functorch_transforms_or_forward_ad(monkeypatch):
    monkeypatch.setattr(_batched_linear, "supported", lambda *args: True)
    group = group_of(Parallel(*[mlp() for _ in range(3)], fuse=True).eval())
    x = torch.zeros(4, 32)
    seen = []

    def look(t):
        seen.append(group.kernel_layers(x))
        return t

    with torch.no_grad():
        assert group.kernel_layers(x)
        torch.func.vmap(look)(torch.zeros(2, 3))
        with torch.autograd.forward_ad.dual_level():
            seen.append(group.kernel_layers(x))
    assert seen == [False, False]


def test_stacks_the_kernels_offsets_cannot_reach_run_as_they_would(monkeypatch):
    monkeypatch.setattr(_batched_linear, "supported", lambda *args: True)
    with torch.no_grad():
        assert group_of(Parallel(*[mlp() for _ in range(3)], fuse=True).eval()).kernel_layers(torch.zeros(4, 32))
        monkeypatch.setattr(_batched_linear, "_MAX_ELEMENTS", 3 * 32 * 32)
        assert not group_of(Parallel(*[mlp() for _ in range(3)], fuse=True).eval()).kernel_layers(torch.zeros(4, 32))
    monkeypatch.setattr(_batched_linear, "_kernel", lambda: pytest.fail("launched"))
    x, w = torch.zeros(3, 2, 32), torch.zeros(3, 32, 32)
    assert _batched_linear.linear(x, w, None, torch.zeros(3, 2, 32)) is None  # (too large, as patched)
    monkeypatch.setattr(_batched_linear, "_MAX_ELEMENTS", 1 << 31)
    assert _batched_linear.linear(x, w, torch.zeros(32, 3).t(), torch.zeros(3, 2, 32)) is None  # strided bias


@pytest.mark.parametrize("join", ["cat", "sum"])
def test_kernel_layers_write_what_the_join_reads_and_copy_no_bias(monkeypatch, join):
    # The last layer of a cat join writes the joined [rows, N * out] itself (the channels
    # layout); for any other join, the stacked [N, rows, out]. No bias is copied in beforehand.
    def no_prefill(*args, **kwargs):
        raise AssertionError("biases copied in while the kernel takes every layer")

    monkeypatch.setattr(_fusion, "_kernels_cost_more", lambda x: True)
    monkeypatch.setattr(_batched_linear, "supported", lambda *args: True)
    chains = []

    def stand_in(x, weight, bias, out, act=0, dot=None, chained=False):
        chains.append(chained)
        return reference_linear(x, weight, bias, out, act)

    monkeypatch.setattr(_batched_linear, "linear", stand_in)
    p = Parallel(*[nn.Sequential(mlp(), nn.Linear(32, 5), nn.ReLU()) for _ in range(3)], fuse=True, join=join).eval()
    group = group_of(p)  # (a call with autograd on: the products' usual layouts)
    monkeypatch.setattr(_fusion, "_Prefill", no_prefill)
    with torch.no_grad():
        x = torch.randn(4, 32)
        chains.clear()
        value = group.run(x, cat_joined=join == "cat")
        # Each layer after the call's first follows the one before on the stream: chained.
        assert chains == [False, True, True, True]
        torch.testing.assert_close(p(x), reference(p, x), rtol=1e-5, atol=1e-5)
        assert chains[4:] == [False, True, True, True]  # (each call's first layer anew)
    if join == "cat":
        assert value.layout == _fusion._CHANNELS and value.t.shape == (4, 15)
    else:
        assert value.layout == _fusion._STACKED and value.t.shape == (3, 4, 5)


def test_a_capture_whose_kernel_takes_every_layer_copies_no_bias(monkeypatch):
    branches = [mlp() for _ in range(3)]
    x = torch.zeros(4, 32)
    with torch.no_grad():
        assert group_of(Parallel(*branches, fuse=True).eval()).copies_biases(x)
        monkeypatch.setattr(_batched_linear, "supported", lambda *args: True)
        group = group_of(Parallel(*branches, fuse=True).eval())
        assert not group.copies_biases(x)
        monkeypatch.setattr(_batched_linear, "_failure", "the Triton kernel failed: ...")
        assert group.copies_biases(x)  # (a kernel that failed since the group looked: torch's layers)


@pytest.mark.parametrize("join", ["cat", "sum", None])
def test_a_kernel_that_fails_leaves_the_layer_to_torch(monkeypatch, join):
    # The kernel refused (it returns None): each layer is computed by baddbmm and its activation.
    monkeypatch.setattr(_fusion, "_kernels_cost_more", lambda x: True)
    monkeypatch.setattr(_batched_linear, "supported", lambda *args: True)
    calls = []
    monkeypatch.setattr(_batched_linear, "linear", lambda *args, chained: calls.append(args[-1]))
    p = Parallel(*[mlp(act=nn.SiLU) for _ in range(4)], fuse=True, join=join).eval()
    with torch.no_grad():
        x = torch.randn(5, 32)
        torch.testing.assert_close(p(x), reference(p, x), rtol=1e-5, atol=1e-5)
    assert calls == [_batched_linear._SILU] * 3


# ---------------------------------------------------------------- on the GPU
@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("n, rows, k, width", [(8, 8, 256, 256), (3, 5, 40, 24), (2, 1, 300, 7), (4, 16, 513, 64)])
@pytest.mark.parametrize("dot", [False, True])  # CUDA-core FMAs, tensor cores (tf32x3 for float32)
def test_kernel_equals_torch(dtype, tol, act, n, rows, k, width, dot):
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(n, rows, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, width, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
    b = torch.randn(n, width, device="cuda", dtype=dtype, generator=g)
    for bias in (b, None):
        out = torch.full((n, rows, width), float("nan"), device="cuda", dtype=dtype)
        assert _batched_linear.linear(x, w, bias, out, act, dot) is out
        torch.testing.assert_close(out, reference_linear(x, w, bias, torch.empty_like(out), act), rtol=tol, atol=tol)


@pytest.mark.cuda
@needs_kernel
def test_an_activation_s_approximation_set_after_a_call_is_computed_on_the_gpu():
    # The epilogue's code chosen anew at an eager call (see the test with the CPU standing in;
    # a CUDA graph replays the values it was captured with, as README says).
    p = Parallel(*[nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)) for _ in range(4)],
                 fuse=True).cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            p(x)
        for b in p:
            b[1].approximate = "tanh"
        assert_close(p(x), reference(p, x), atol=1e-5)


@pytest.mark.cuda
@needs_kernel
def test_kernel_reads_and_writes_any_strides():
    # A shared input (member stride 0), a transposed one, and a cat join's layout as the output.
    n, rows, k, width = 3, 6, 48, 20
    x = torch.randn(rows, k, device="cuda")
    w, b = torch.randn(n, width, k, device="cuda"), torch.randn(n, width, device="cuda")
    transposed = torch.randn(n, k, rows, device="cuda").mT
    for xs, dot in ((x.expand(n, rows, k), False), (x.expand(n, rows, k), True), (transposed, False),
                    (transposed, True)):
        joined = torch.full((rows, n * width), float("nan"), device="cuda")
        out = joined.as_strided((n, rows, width), (width, n * width, 1))
        _batched_linear.linear(xs, w, b, out, _batched_linear._GELU, dot)
        want = reference_linear(xs, w, b, torch.empty(n, rows, width, device="cuda"), _batched_linear._GELU)
        torch.testing.assert_close(joined, want.transpose(0, 1).flatten(1), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("captured", [False, True])
def test_chained_layers_read_what_the_layer_before_wrote(dot, captured):
    # A chain of layers launched back to back, each after the first chained (on an sm90 GPU,
    # each one's launch and weight loads overlap the layer before), its weights written in place
    # on the stream just before the chain's first layer: every layer reads the weights written and
    # the output of the layer before, eagerly and replayed, the host running ahead of the GPU.
    torch.backends.cuda.matmul.allow_tf32 = False
    n, rows, width, depth = 8, 8, 512, 4
    ws = [torch.randn(n, width, width, device="cuda") / width ** 0.5 for _ in range(depth)]
    bs = [torch.randn(n, width, device="cuda") for _ in range(depth)]
    x = torch.randn(rows, width, device="cuda")
    new = [torch.empty_like(w) for w in ws]

    def chain():
        for w, fresh in reversed(list(zip(ws, new))):  # (the first layer's last, just before it)
            w.copy_(fresh)
        h = x.expand(n, rows, width)
        for i, (w, b) in enumerate(zip(ws, bs)):
            h = _batched_linear.linear(h, w, b, torch.empty(n, rows, width, device="cuda"), _batched_linear._GELU,
                                       dot, chained=i > 0)
            assert h is not None
        return h

    def want():
        h = x.expand(n, rows, width)
        for w, b in zip(ws, bs):
            h = reference_linear(h, w, b, torch.empty(n, rows, width, device="cuda"), _batched_linear._GELU)
        return h

    run = chain
    if captured:
        chain()  # (every specialization launched before the capture)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static = chain()
        run = lambda: (g.replay(), static)[1]  # noqa: E731
    for _ in range(5):
        for fresh in new:
            fresh.normal_(0, width ** -0.5)
        x.normal_()
        torch.cuda._sleep(2_000_000)  # (what follows is queued behind it, launched together)
        out = run().clone()
        torch.testing.assert_close(out, want(), rtol=1e-5, atol=1e-5)
    from triton.backends.nvidia.compiler import CUDAOptions

    if (torch.cuda.get_device_capability() >= (9, 0)
            and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})):
        # Where dependent launch exists, the chained layers were launched so: their launchers'
        # kernels are built with launch_pdl, the others' without (key[5]: the launch's WAIT).
        assert _batched_linear._pdl(torch.cuda.current_device())
        launched = {k[5]: launch.compiled.metadata.launch_pdl for k, launch in _batched_linear._launchers.items()
                    if launch is not None and k[1] == n and k[0][2] == width}
        assert launched == {False: False, True: True}


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("join", ["cat", "sum"])
def test_graphed_fused_mlps_replay_one_kernel_per_layer(join):
    torch.backends.cuda.matmul.allow_tf32 = False
    branches = [mlp(width=64, depth=4) for _ in range(8)]
    p = Parallel(*branches, fuse=True, cuda_graph=True, join=join).cuda().eval()
    with torch.no_grad():
        for _ in range(5):  # fresh inputs, replayed
            x = torch.randn(8, 64, device="cuda")
            torch.testing.assert_close(p(x), reference(p, x), rtol=1e-5, atol=1e-5)
        names = kernel_names(lambda: p(x))
    assert sum("linear_act" in name for name in names) == 4, names
    assert not any("gemm" in name.lower() or "gelu" in name.lower() for name in names), names


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("join", ["cat", "sum"])
def test_eager_fused_mlps_launch_one_kernel_per_layer(join):
    # Eagerly too, after the first call, each layer is one launch of the compiled kernel.
    torch.backends.cuda.matmul.allow_tf32 = False
    p = Parallel(*[mlp(width=64, depth=4) for _ in range(8)], fuse=True, join=join).cuda().eval()
    with torch.no_grad():
        for _ in range(4):  # fresh inputs
            x = torch.randn(8, 64, device="cuda")
            torch.testing.assert_close(p(x), reference(p, x), rtol=1e-5, atol=1e-5)
        names = kernel_names(lambda: p(x))
    assert sum("linear_act" in name for name in names) == 4, names
    assert not any("gemm" in name.lower() or "gelu" in name.lower() for name in names), names
    assert _batched_linear.launches_fast()  # (this Triton's compiled kernels take the arguments given)


@pytest.mark.cuda
@needs_kernel
def test_eager_blocks_of_as_many_layers_and_more_members_each_compute_their_own():
    torch.backends.cuda.matmul.allow_tf32 = False
    blocks = [Parallel(*[mlp(width=64) for _ in range(n)], fuse=True).cuda().eval() for n in (8, 16, 8)]
    with torch.no_grad():
        for _ in range(2):
            for p in blocks:
                x = torch.randn(4, 64, device="cuda")
                torch.testing.assert_close(p(x), reference(p, x), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@needs_kernel
def test_direct_launches_equal_tritons_own_and_respect_its_launch_hooks(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(_batched_linear, "_launchers", {})
    jit, through_triton = _batched_linear._kernel(), []

    class Counted:  # Triton's own launch path, counted
        def __getitem__(self, grid):
            through_triton.append(grid)
            return jit[grid]

    monkeypatch.setattr(_batched_linear, "_kernel", Counted)
    w, b = torch.randn(4, 48, 40, device="cuda"), torch.randn(4, 48, device="cuda")
    seen = []
    for i in range(4):  # the first through Triton's launch, the second straight to the kernel, then hooked
        if i == 2:
            monkeypatch.setattr(knobs.runtime, "launch_enter_hook", seen.append)
        elif i == 3:
            monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
        x, out = torch.randn(4, 5, 40, device="cuda"), torch.empty(4, 5, 48, device="cuda")
        assert _batched_linear.linear(x, w, b, out, _batched_linear._SILU) is out
        torch.testing.assert_close(out, reference_linear(x, w, b, torch.empty_like(out), _batched_linear._SILU),
                                   rtol=1e-5, atol=1e-5)
    assert len(seen) == 1 and callable(next(iter(_batched_linear._launchers.values())))
    assert len(through_triton) == 2  # the first launch and the hooked one


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_training_keeps_torch_layers(cuda_graph):
    # Gradients need a backward the kernel does not have: the products stay cuBLAS's.
    p = Parallel(*[mlp(width=64) for _ in range(4)], fuse=True, cuda_graph=cuda_graph).cuda()
    x = torch.randn(8, 64, device="cuda")
    for _ in range(3):
        p(x).sum().backward()
    names = kernel_names(lambda: p(x).sum().backward())
    assert not any("linear_act" in name for name in names)


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("warmed_up", [False, True])
def test_a_users_capture_compiles_no_kernel(warmed_up, monkeypatch):
    # A fused block captured by the user's own torch.cuda.graph: compiling the kernel there
    # would invalidate the capture, so only a kernel launched before (in a warm-up under
    # capture's layouts, as a cuda_graph=True module's) is launched; the rest is torch's.
    monkeypatch.setattr(_batched_linear, "_launchers", {})  # (whatever other tests launched)
    width = 40 + 8 * warmed_up
    p = Parallel(*[mlp(width=width, act=nn.ReLU) for _ in range(3)], fuse=True).cuda().eval()
    x = torch.randn(3, width, device="cuda")
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.no_grad():
        p(x[:2])  # (finds the groups and stacks, eagerly: the kernel launched for 2 rows, not 3)
        if warmed_up:
            from parallel_modules._streams import _graph_state

            _graph_state.active = True  # (as a cuda_graph=True module's warm-up)
            try:
                p(x)
            finally:
                _graph_state.active = False
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=side):
            y = p(x)
        x.copy_(torch.randn_like(x))
        names = kernel_names(g.replay)
        torch.testing.assert_close(y, reference(p, x), rtol=1e-5, atol=1e-5)
    assert sum("linear_act" in name for name in names) == (3 if warmed_up else 0), names
