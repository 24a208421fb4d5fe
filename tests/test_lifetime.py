"""A deleted block is freed, with its parameters, when its last reference goes.

Users build many models (sweeps, notebooks re-running a cell) and expect each
one deleted to give its memory back at once, as a plain ``nn.Sequential`` does.
A reference cycle through the library's own objects would keep the parameters
until the cyclic garbage collector next runs, which users see as memory
growth. So each test runs with the cyclic collector off, and checks with
weakrefs (not memory measurements) that the model and its parameters are gone
right after the ``del``.
"""

from __future__ import annotations

import copy
import gc
import pickle
import threading
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from parallel_modules import Parallel, ParallelSequential
from tests._helpers import mlp


@pytest.fixture(autouse=True)
def _no_cyclic_gc() -> Iterator[None]:
    # Collect what earlier tests left first, so that a collection the allocator triggers
    # cannot free a cycle of this test's by chance; then keep the collector off.
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _refs(model: nn.Module) -> list[weakref.ref]:
    return [weakref.ref(model), *[weakref.ref(p) for p in model.parameters()]]


def _alive(refs: list[weakref.ref]) -> list[str]:
    return [repr(r())[:60] for r in refs if r() is not None]


def _freed_at_del(build: Callable[[], nn.Module], use: Callable[[nn.Module, torch.Tensor], object],
                  train: bool = False) -> list[str]:
    r"""Build a model, ``use`` it once, drop every reference: what is still alive (nothing, if freed at once)."""
    model = build().train(train)
    refs = _refs(model)
    out = use(model, torch.randn(4, 16, requires_grad=train))
    del model, out
    return _alive(refs)


def _call(model: nn.Module, x: torch.Tensor) -> object:
    return model(x)


def _branches() -> list[nn.Module]:
    return [mlp(16, 8) for _ in range(3)]


def test_a_plain_sequential_is_freed_at_del() -> None:
    # The baseline the blocks are held to.
    assert not _freed_at_del(lambda: nn.Sequential(mlp(16, 16), mlp(16, 8)), _call)


@pytest.mark.parametrize("streams", [True, "auto"])
@pytest.mark.parametrize("fuse", [False, "auto", True])
@pytest.mark.parametrize("join", ["cat", "sum", "stack", None])
def test_a_parallel_is_freed_at_del(fuse: object, streams: object, join: object) -> None:
    assert not _freed_at_del(lambda: Parallel(*_branches(), fuse=fuse, streams=streams, join=join), _call)


def _layered() -> nn.Module:
    # Layers whose batched steps read their settings at every call (a convolution, the norms,
    # Flatten) and one run through vmap (GroupNorm), whose steps the group keeps.
    return nn.Sequential(nn.Unflatten(1, (4, 2, 2)), nn.Conv2d(4, 4, 1), nn.GroupNorm(2, 4), nn.Flatten(),
                         nn.LayerNorm(16), nn.Linear(16, 8))


@pytest.mark.parametrize("train", [False, True])
def test_a_fused_group_of_layers_reading_their_settings_is_freed_at_del(train: bool) -> None:
    # Before: the steps closed over their group, which keeps them: a cycle, freed only by the
    # collector (found on the GPU, where a Linear's step reads its GELU's approximation).
    def use(model: nn.Module, x: torch.Tensor) -> object:
        out = model(x)
        if train:
            out.sum().backward()
        return out

    assert not _freed_at_del(lambda: Parallel(*[_layered() for _ in range(3)], fuse=True), use, train=train)


def test_a_parallel_only_built_is_freed_at_del() -> None:
    assert not _freed_at_del(lambda: Parallel(*_branches()), lambda m, x: None)


@pytest.mark.parametrize("backward", [True, False], ids=["backward", "graph_dropped"])
@pytest.mark.parametrize("fuse", [False, "auto", True])
def test_a_trained_parallel_is_freed_at_del(fuse: object, backward: bool) -> None:
    def use(model: nn.Module, x: torch.Tensor) -> object:
        out = model(x)
        if backward:
            out.sum().backward()
        return out

    assert not _freed_at_del(lambda: Parallel(*_branches(), fuse=fuse), use, train=True)


@pytest.mark.parametrize("backward", [True, False], ids=["backward", "graph_dropped"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_a_pipeline_is_freed_at_del(chunks: int, backward: bool) -> None:
    def build() -> nn.Module:
        return ParallelSequential(nn.Linear(16, 16), Parallel(*_branches(), join="sum", fuse=True), nn.Linear(8, 8),
                                  chunks=chunks)

    def use(model: nn.Module, x: torch.Tensor) -> object:
        out = model(x)
        if backward:
            out.sum().backward()
        return out

    assert not _freed_at_del(build, use, train=True)


def test_a_model_trained_with_an_optimizer_is_freed_at_del() -> None:
    model = ParallelSequential(nn.Linear(16, 16), Parallel(*_branches(), join="sum", fuse="auto"), chunks=2)
    refs = _refs(model)
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(3):
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    del model, optimizer
    assert not _alive(refs)


@pytest.mark.parametrize("block", ["parallel", "fused", "pipeline"])
def test_a_block_is_freed_at_del_after_explain_and_functional_call(block: str) -> None:
    def build() -> nn.Module:
        if block == "pipeline":
            return ParallelSequential(nn.Linear(16, 16), Parallel(*_branches(), join="sum"), chunks=2)
        return Parallel(*_branches(), fuse=block == "fused")

    def use(model: nn.Module, x: torch.Tensor) -> object:
        model(x)
        if isinstance(model, Parallel):
            model.explain()
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        return torch.func.functional_call(model, params, (x,))

    assert not _freed_at_del(build, use)


@pytest.mark.parametrize("join", ["cat", "sum"])
def test_a_parallel_compiled_whole_is_freed_at_del(join: str) -> None:
    # Dynamo keeps a record of each container mutated while tracing past the trace, in a
    # cycle with the tracer: a container built in the block's forward from a generator
    # over the branches' parameters held the block, freed only by the collector.
    torch._dynamo.reset()  # (a cached trace of another test's Parallel would run without tracing)

    def use(model: nn.Module, x: torch.Tensor) -> object:
        return torch.compile(model, backend="eager")(x)

    assert not _freed_at_del(lambda: Parallel(*_branches(), join=join), use)


@pytest.mark.parametrize("block", ["parallel", "pipeline"])
def test_a_block_with_compiled_children_is_freed_at_del(block: str) -> None:
    # The first call builds each child's compiled form, which its compiler holds.
    def build() -> nn.Module:
        if block == "pipeline":
            return ParallelSequential(nn.Linear(16, 16), nn.Linear(16, 8), chunks=2, compile="eager")
        return Parallel(*_branches(), compile="eager")

    assert not _freed_at_del(build, _call)


class _Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("raised by a branch")


@pytest.mark.parametrize("block", ["parallel", "auto", "pipeline", "pipeline_of_parallel"])
def test_a_block_whose_branch_raised_is_freed_at_del(block: str) -> None:
    # The error and its traceback (whose frames hold the model) dropped: nothing of the
    # call is kept by the library.
    def build() -> nn.Module:
        if block == "pipeline":
            return ParallelSequential(nn.Linear(16, 16), _Raises(), chunks=2)
        if block == "pipeline_of_parallel":
            return ParallelSequential(nn.Linear(16, 16), Parallel(mlp(16, 8), _Raises()), chunks=2)
        return Parallel(*_branches(), _Raises(), fuse="auto" if block == "auto" else False)

    def use(model: nn.Module, x: torch.Tensor) -> object:
        with pytest.raises(RuntimeError, match="raised by a branch"):
            model(x)
        return None

    assert not _freed_at_del(build, use)


@pytest.mark.parametrize("fuse", [False, True])
def test_a_block_called_from_threads_is_freed_at_del(fuse: bool) -> None:
    def use(model: nn.Module, x: torch.Tensor) -> object:
        outs: list[torch.Tensor] = []
        threads = [threading.Thread(target=lambda: outs.append(model(x))) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(outs) == 3
        return outs

    assert not _freed_at_del(lambda: Parallel(*_branches(), fuse=fuse), use)


@pytest.mark.parametrize("copy_with", ["deepcopy", "pickle"])
@pytest.mark.parametrize("block", ["parallel", "fused", "pipeline"])
def test_a_copied_block_and_its_original_are_freed_at_del(block: str, copy_with: str) -> None:
    if block == "pipeline":
        original: nn.Module = ParallelSequential(nn.Linear(16, 16), Parallel(*_branches(), join="sum"), chunks=2)
    else:
        original = Parallel(*_branches(), fuse=block == "fused")
    x = torch.randn(4, 16)
    original(x)
    copied = copy.deepcopy(original) if copy_with == "deepcopy" else pickle.loads(pickle.dumps(original))
    copied(x)
    refs = _refs(original) + _refs(copied)
    del original, copied
    assert not _alive(refs)


class _JoinedByOwner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 2.0
        self.block = Parallel(*_branches(), join=self.join)

    def join(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        return sum(outputs) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_a_join_closing_over_the_model_is_freed_by_the_collector() -> None:
    # A join that is the owner's bound method, or a lambda naming the block, is a cycle the
    # user made (as ``seq.f = lambda: seq`` is on a plain module): freed by the collector.
    def closing() -> nn.Module:
        block = Parallel(*_branches(), join="sum")
        block.join = lambda outputs: sum(outputs) * (2 if block.training else 1)
        return block

    refs: list[weakref.ref] = []
    for build in (_JoinedByOwner, closing):
        model = build()
        refs += _refs(model)
        model(torch.randn(4, 16))
        del model
    gc.collect()
    assert not _alive(refs)


@pytest.mark.cuda
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_a_cuda_block_is_freed_at_del_after_record_timeline(cuda_graph: bool) -> None:
    from parallel_modules.timeline import record_timeline

    model = ParallelSequential(nn.Linear(16, 16), Parallel(*_branches(), join="sum", fuse="auto"), chunks=2,
                               cuda_graph=cuda_graph).cuda()
    refs = _refs(model)
    x = torch.randn(4, 16, device="cuda")
    record_timeline(model, x, warmup=3, calls=1)
    model(x).sum().backward()
    del model
    torch.cuda.synchronize()
    assert not _alive(refs)
