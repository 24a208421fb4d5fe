"""The fork/join protocol's shortcuts to torch's C bindings (``parallel_modules._streams``)."""
import pytest
import torch

from parallel_modules import _streams
from tests._helpers import sleep_in_backward

cuda = pytest.mark.cuda


@cuda
def test_the_c_bindings_behind_the_fast_fork_join_exist():
    # _streams falls back to the public API when a torch release drops these,
    # correct but several microseconds slower per branch: this test notices.
    for name in ("_cuda_getCurrentStream", "_cuda_setStream", "_cuda_isCurrentStreamCapturing"):
        assert callable(getattr(torch._C, name, None)), name
    assert _streams._record is torch._C._CudaEventBase.record
    assert _streams._wait is torch._C._CudaEventBase.wait


@cuda
def test_stream_capturing_follows_a_capture():
    assert _streams._stream_capturing() is False
    x = torch.zeros(4, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            seen = _streams._stream_capturing()
            x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    assert seen is True and _streams._stream_capturing() is False


@cuda
def test_high_runs_one_item_on_a_high_priority_stream_and_joins_it():
    greatest = torch.cuda.Stream.priority_range()[1]
    dev = torch.device("cuda")
    x = torch.randn(64, device=dev)
    seen: dict[int, torch.cuda.Stream] = {}

    def run(i, fn):
        seen[i] = torch.cuda.current_stream()
        if i == 2:
            torch.cuda._sleep(1_000_000)  # late: a missing join lets the caller read too early
        return fn(x)

    caller = torch.cuda.current_stream()
    out = _streams._run_forked([torch.neg, torch.exp, torch.sin], dev, run, high=2)
    assert seen[0] == caller and torch.cuda.current_stream() == caller
    assert seen[2].priority == greatest and seen[1].priority != greatest and seen[1] != seen[2]
    assert torch.equal(out[2], torch.sin(x)) and torch.equal(out[1], torch.exp(x))
    assert _streams._pool(dev).offset == 0


@cuda
def test_side_streams_never_include_the_callers_stream():
    dev = torch.device("cuda")
    pool = _streams._pool(dev)
    pool.side_streams(0, 4)
    caller = pool.streams[1]
    sides = pool.side_streams(0, 3, caller)
    assert len(sides) == 3 and caller not in sides and len({s.stream_id for s in sides}) == 3
    assert pool.side_streams(0, 3, torch.cuda.current_stream(dev)) == pool.streams[:3]


@cuda
def test_slots_are_the_side_streams_and_events_a_fork_takes_kept_per_caller():
    dev = torch.device("cuda")
    pool = _streams._pool(dev)
    default = torch.cuda.current_stream(dev)
    slots = pool.slots(1, 3, default)
    forks, joins = pool.events(4)
    assert list(slots.streams) == pool.side_streams(1, 2, default)
    assert slots.fork is forks[1] and list(slots.joins) == joins[2:4]
    assert pool.slots(1, 3, default) is slots  # looked up once
    # A caller on one of the pool's streams gets other streams, and its own entry.
    caller = pool.streams[1]
    other = pool.slots(1, 3, caller)
    assert caller not in other.streams and len({s.stream_id for s in other.streams}) == 2
    assert other.fork is slots.fork


@cuda
def test_run_forked_names_the_item_that_raised_and_joins_the_others():
    dev = torch.device("cuda")
    x = torch.randn(64, device=dev)
    caller = torch.cuda.current_stream()

    def slow(t):
        torch.cuda._sleep(1_000_000)
        return t * 2

    def bad(t):
        raise ValueError("boom")

    with pytest.raises(RuntimeError, match="item 2: boom"):
        _streams._run_forked([torch.neg, slow, bad], dev, None, args=(x,),
                             error=lambda e, i: RuntimeError(f"item {i}: {e}"))
    assert torch.cuda.current_stream() == caller and _streams._pool(dev).offset == 0
    out = _streams._run_forked([torch.neg, slow], dev, None, args=(x,))
    assert torch.equal(out[1], x * 2)  # joined: read on the caller's stream after the slow item


@cuda
@pytest.mark.parametrize("entry", ["run_forked", "fork_join"])
def test_a_fork_failing_to_record_leaves_autocasts_cache_on(monkeypatch, entry):
    # Both forks turned autocast's cache off for the items, then recorded the fork event, outside
    # the ``try`` whose ``finally`` turns it back on: a failure of the record (a CUDA error, a
    # KeyboardInterrupt) left the cache off for every later autocast region of the thread.
    dev = torch.device("cuda")
    x = torch.randn(64, device=dev)
    record = _streams._record

    def fork(calls):
        if entry == "run_forked":
            return _streams._run_forked(calls, dev, None, args=(x,))
        return _streams._fork_join(calls, dev, (x,), {}, torch.stack, lambda e, i: e)

    def failing(event, stream):
        raise RuntimeError("CUDA error: an injected failure")

    with torch.autocast("cuda"):
        fork([torch.neg, torch.exp])  # (the fork_join's slots looked up, by the general path)
        monkeypatch.setattr(_streams, "_record", failing)
        with pytest.raises(RuntimeError, match="injected"):
            fork([torch.neg, torch.exp])
        assert torch.is_autocast_cache_enabled()
        monkeypatch.setattr(_streams, "_record", record)
        out = fork([torch.neg, torch.exp])
    assert torch.equal(out[1], torch.exp(x)) and torch.is_autocast_cache_enabled()


@cuda
def test_fork_join_forks_joins_and_names_the_item_that_raised_without_the_general_path(monkeypatch):
    dev = torch.device("cuda")  # (no index: the current device's)
    x = torch.randn(64, device=dev)
    caller = torch.cuda.current_stream()
    seen = []

    def slow(t):
        seen.append(torch.cuda.current_stream())
        torch.cuda._sleep(1_000_000)
        return t * 2

    def bad(t):
        raise ValueError("boom")

    def in_place(t):
        return t.mul_(1)

    def fork_join(calls, t):
        return _streams._fork_join(calls, dev, (t,), {}, torch.stack, lambda e, i: RuntimeError(f"item {i}: {e}"))

    # The first fork of these slots in this thread takes the general path, which looks
    # their streams and events up (unless an earlier test's fork did).
    fork_join([torch.neg, slow, slow], x)
    general = []
    monkeypatch.setattr(_streams, "_run_forked", lambda *a, **k: general.append(1))
    seen.clear()
    out = fork_join([torch.neg, slow, slow], x)
    assert torch.equal(out, torch.stack([-x, x * 2, x * 2]))  # joined: the stack reads the slow items' outputs
    assert len({caller, *seen}) == 3
    with pytest.raises(RuntimeError, match="item 2: boom"):
        fork_join([torch.neg, slow, bad], x)
    assert torch.cuda.current_stream() == caller and _streams._pool(dev).offset == 0
    with pytest.raises(RuntimeError, match="item 1: a branch changed its input in place"):
        fork_join([torch.neg, in_place, slow], x.clone())
    assert torch.cuda.current_stream() == caller and not general
    assert torch.equal(fork_join([torch.neg, slow, slow], x), out)


@cuda
def test_a_caller_on_one_of_the_pools_streams_still_forks_beside_itself():
    # torch.cuda.Stream() cycles through the same 32 streams the pool takes: a
    # user's stream can be a side stream. Branches must then go elsewhere.
    from parallel_modules import Parallel
    from tests._helpers import mlp

    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(torch.cuda.current_stream())
            return x * 2

    p = Parallel(mlp(64, 64), Probe(), Probe(), streams=True).cuda()
    caller = _streams._pool(torch.device("cuda")).side_streams(0, 2)[0]
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        expected = torch.cat([p[0](x), x * 2, x * 2], 1)
        caller.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(caller):
            out = p(x)
        torch.cuda.current_stream().wait_stream(caller)
    assert caller not in seen[-2:] and seen[-2] != seen[-1]
    assert torch.equal(out, expected)


# ------------------------------------------------- backward: parameter gradients
class _SlowWeightGradLinear(torch.nn.Linear):
    r"""A Linear whose weight gradient arrives late on its stream (its input gradient does not)."""

    def forward(self, x):
        # ~25 ms on an H100: far longer than the CPU takes to reach the reader below.
        return torch.nn.functional.linear(x, sleep_in_backward(self.weight, 50_000_000), self.bias)


class _ReadGradsInBackward(torch.autograd.Function):
    r"""What FSDP2 puts in front of a module it shards: when the gradient of the
    module's input is complete, its backward reads the module's parameter
    gradients, on the stream that gradient is handed to (the caller's)."""

    @staticmethod
    def forward(ctx, x, module, seen):
        ctx.module, ctx.seen = module, seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.seen.extend(None if p.grad is None else p.grad.clone() for p in ctx.module.parameters())
        return g, None, None


def _blocks():
    from parallel_modules import Parallel, ParallelSequential

    def side():
        return torch.nn.Sequential(_SlowWeightGradLinear(16, 16), torch.nn.Tanh())

    yield "Parallel", Parallel(torch.nn.Linear(16, 16), side(), side(), join="sum", streams=True)
    yield "ParallelSequential", ParallelSequential(torch.nn.Linear(16, 16), side(), side(), chunks=3)


@cuda
@pytest.mark.parametrize("kind", ["Parallel", "ParallelSequential"])
def test_parameter_gradients_are_complete_when_the_input_gradient_is(kind):
    # The engine hands a branch's input gradient to the caller's stream with an
    # event, but sums its parameters' gradients on the branch's stream after
    # that: without the backward join the reader clones unfinished gradients.
    block = dict(_blocks())[kind].cuda()
    stem = torch.nn.Linear(16, 16).cuda()
    for _ in range(3):  # fresh inputs: stale memory cannot hold the right values
        seen: list = []
        x = torch.randn(12, 16, device="cuda")
        block(_ReadGradsInBackward.apply(stem(x), block, seen)).square().sum().backward()
        torch.cuda.synchronize()
        final = [p.grad for p in block.parameters()]
        assert len(seen) == len(final) and all(s is not None for s in seen)
        for (name, _), s, f in zip(block.named_parameters(), seen, final):
            assert torch.equal(s, f), f"{kind}: {name}.grad read in backward differs from the final one"
        block.zero_grad(set_to_none=True)
        stem.zero_grad(set_to_none=True)


@cuda
def test_the_backward_join_hooks_inputs_made_by_an_operation_only_and_only_with_grad():
    from parallel_modules import Parallel

    block = Parallel(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), streams=True).cuda()
    leaf = torch.randn(4, 8, device="cuda", requires_grad=True)
    for _ in range(2):
        block(leaf).sum().backward()
    assert not leaf._backward_hooks  # it would stay there for every later call
    made = leaf * 1
    with torch.no_grad():
        block(made)
    assert not made._backward_hooks
    block(made)
    other = Parallel(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), streams=True).cuda()
    other(made)  # one hook per tensor, however many blocks read it
    assert len(made._backward_hooks) == 1
    (block(made).sum() + other(made).sum()).backward()
    assert len(made._backward_hooks) == 1


@cuda
def test_the_backward_join_takes_an_input_that_gets_no_gradient():
    # One output of a split, unused by the loss while its sibling is: its hook receives None.
    from parallel_modules import Parallel, ParallelSequential

    for block in (Parallel(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), streams=True),
                  ParallelSequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), chunks=2)):
        x = torch.randn(6, 8, device="cuda", requires_grad=True)
        a, b = (x * 1).split(4, dim=1)
        block.cuda()(a)
        b.sum().backward()
        assert torch.equal(x.grad, torch.cat([torch.zeros(6, 4), torch.ones(6, 4)], 1).cuda())


def test_an_output_held_only_by_the_forks_list_is_told_from_one_held_elsewhere():
    # Joined side outputs skip record_stream only when the fork's list holds them alone;
    # the count that means "alone" is measured at import.
    outputs = [None, torch.randn(3)]
    assert _streams._references(outputs, 1) == _streams._OWN_REFERENCES
    stash = outputs[1]
    assert _streams._references(outputs, 1) == _streams._OWN_REFERENCES + 1
    del stash
    assert _streams._references(outputs, 1) == _streams._OWN_REFERENCES


@pytest.mark.parametrize("join", ["sum", "weighted", "residual", "in place"])
def test_a_join_keeps_its_gradients_until_the_backward_pass_ends(join, monkeypatch):
    # (See the module docstring, backward: a gradient the join hands to branches on two streams
    # must not be summed into in place while one of them may still read it.)
    import functools
    import weakref

    from parallel_modules._streams import _hold_join_gradients

    leaves = [torch.randn(3, requires_grad=True) for _ in range(4)]
    before = torch.randn(3, requires_grad=True)
    residual = before.exp()  # (made before the block: its node is the model's, not the join's)
    # (Each branch's output scaled: its node makes a gradient of its own, and the join's is
    # referenced by nothing else once those nodes ran.)
    outputs = [t * 3.0 for t in leaves]
    weights = torch.tensor([1.0, 0.5, 0.25, 2.0], requires_grad=True)  # (a join's parameter: its accumulator)
    # (Read before the join: an in-place one gives the first output a node of its own.)
    first = torch.autograd._get_sequence_nr()
    if join == "in place":
        total = outputs[0]
        for o in outputs[1:]:
            total += o
    else:
        total = (functools.reduce(torch.add, [o * w for o, w in zip(outputs, weights)]) if join == "weighted"
                 else functools.reduce(torch.add, outputs))
    if join == "residual":
        total = total + residual
    hooked = []

    def counted(grad_inputs, grad_outputs):
        hooked.append(len(grad_inputs))
        return _streams._hold_gradients(grad_inputs, grad_outputs)

    monkeypatch.setattr(_streams, "_hold_gradients", counted)
    _hold_join_gradients(total, first)
    monkeypatch.undo()
    handed: list[weakref.ref] = []
    seen_alive: list[bool] = []
    ends = {leaf.grad_fn for leaf in leaves} | {residual.grad_fn}
    todo, joined = [total.grad_fn], []
    while todo:  # the join's own nodes: hooked, and watched here
        node = todo.pop()
        if (node is not None and node not in ends and node not in joined and node._sequence_nr() >= first
                and node.next_functions):
            joined.append(node)
            node.register_hook(lambda grads, _: handed.extend(weakref.ref(g) for g in grads if g is not None))
            todo.extend(n for n, _ in node.next_functions)
    # (Weighted: 4 products, 3 sums and the weights' unbind.)
    assert len(joined) == {"sum": 3, "weighted": 8, "residual": 4, "in place": 3}[join]
    for t in leaves:  # (the last of them to get its gradient looks)
        t.register_hook(lambda g: seen_alive.append(all(r() is not None for r in handed)))
    (total * 2).sum().backward()
    scale = (1.0, 0.5, 0.25, 2.0) if join == "weighted" else (1.0, 1.0, 1.0, 1.0)
    assert all(torch.equal(t.grad, torch.full((3,), 6.0 * w)) for t, w in zip(leaves, scale))
    assert len(seen_alive) == 4 and seen_alive[-1]  # (the join's gradients still held when the last leaf's came)
    assert all(r() is None for r in handed)  # let go once the pass ended
    assert len(hooked) == len(joined)  # the join's nodes only: not the residual's, made before the block


def test_a_join_after_a_recorded_fork_resets_what_the_fork_noted():
    # A fork of branches that autograd records notes it for the join that follows (whose sums
    # then hold the gradient they hand the branches): read by that join only, not by the next.
    from parallel_modules._joins import _join_outputs
    from parallel_modules._streams import _graph_state

    xs = [torch.randn(3, requires_grad=True) for _ in range(2)]
    try:
        _graph_state.forked = True
        with torch.no_grad():
            _join_outputs("Parallel", "sum", 0, ["a", "b"], [x.detach() for x in xs])
        assert _graph_state.forked  # (nothing recorded: nothing to hold, nothing read)
        total = _join_outputs("Parallel", "mean", 0, ["a", "b"], xs)
        assert not _graph_state.forked and torch.equal(total, (xs[0] + xs[1]) / 2)
    finally:
        _graph_state.forked = False



def test_a_call_failing_between_its_fork_and_its_join_leaves_nothing_for_the_next_join_to_hold(monkeypatch):
    # A fork notes branches that autograd recorded for the join that follows (see _streams,
    # backward). An exception between the note and that join (raised by _join_backward or a fused
    # group's scatter, a KeyboardInterrupt) left the note set: the thread's next join, of a block
    # that never forked, took it for its own and held its gradients to the end of the backward pass.
    from torch import nn

    from parallel_modules import Parallel, _joins
    from parallel_modules import parallel as _parallel

    def noted_then_failed(calls, device, args, kwargs, join, error):  # (_fork_join's arguments)
        outputs = [call(*args, **kwargs) for call in calls]
        if torch.is_grad_enabled() and _streams._recording(outputs):
            _streams._graph_state.forked = True  # as _run_forked notes it, before _join_backward
        raise RuntimeError("interrupted before the join")

    with monkeypatch.context() as m:  # (a CUDA input, as the fork sees it)
        m.setattr(_parallel, "_input_device", lambda a, k: torch.device("cuda", 0))
        m.setattr(_parallel, "_check_devices", lambda *a: None)
        m.setattr(_parallel, "_current_device", lambda: 0)
        m.setattr(_parallel, "_capture_underway", lambda: False)
        m.setattr(_parallel, "_fork_join", noted_then_failed)
        forked = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), join="sum", streams=True)
        with pytest.raises(RuntimeError, match="interrupted before the join"):
            forked(torch.randn(2, 4))
    try:
        held = []
        monkeypatch.setattr(_joins, "_hold_join_gradients", lambda *a, **k: held.append(a))
        other = Parallel(nn.Linear(4, 4), nn.Linear(4, 4), join="sum")
        other(torch.randn(2, 4)).sum().backward()
        assert held == []
    finally:
        _streams._graph_state.forked = False


def test_an_in_place_join_after_a_fork_holds_its_gradients(monkeypatch):
    # (A join of the user's summing in place gives the first output a node of its own: the
    # outputs' nodes are numbered before the join runs, or its sum would be taken for theirs.)
    from parallel_modules._joins import _join_outputs
    from parallel_modules._streams import _graph_state

    def in_place(outputs):
        total = outputs[0]
        for o in outputs[1:]:
            total += o
        return total

    hooked = []
    monkeypatch.setattr(_streams, "_hold_gradients", lambda grads, _: hooked.append(len(grads)))
    xs = [torch.randn(3, requires_grad=True) for _ in range(3)]
    try:
        _graph_state.forked = True
        total = _join_outputs("Parallel", in_place, 0, ["a", "b", "c"], [x * 1.0 for x in xs])
    finally:
        _graph_state.forked = False
    total.sum().backward()
    assert hooked == [2, 2]  # (the two in-place sums, each handing one gradient to both sides)
    assert all(torch.equal(x.grad, torch.ones(3)) for x in xs)


def test_a_join_holds_its_own_nodes_only_whatever_thread_made_what_it_reads(monkeypatch):
    # (Autograd numbers each thread's nodes apart: a tensor made on another thread may be
    # numbered above the join's nodes, or its outputs' above them.)
    import threading

    from parallel_modules._joins import _join_outputs
    from parallel_modules._streams import _graph_state

    def on_thread(fn):
        made, failed = [], []

        def run():
            try:
                made.append(fn())
            except BaseException as e:  # (raised again on the calling thread)
                failed.append(e)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        if failed:
            raise failed[0]
        return made[0]

    def deep(t):  # nodes numbered up to 49 on a fresh thread
        for _ in range(50):
            t = t * 1.01
        return t

    hooked = []
    monkeypatch.setattr(_streams, "_hold_gradients", lambda grads, _: hooked.append(len(grads)))

    def joined(how, outputs):
        try:
            _graph_state.forked = True
            return _join_outputs("Parallel", how, 0, ["a", "b"], outputs)
        finally:
            _graph_state.forked = False

    def body():
        x = torch.randn(3, requires_grad=True)
        context = on_thread(lambda: deep(torch.randn(3, requires_grad=True)))
        for _ in range(2):  # (the context's graph lives on: nothing hooked on it, call after call)
            hooked.clear()
            joined(lambda outputs: outputs[0] + outputs[1] + context, [x * 2.0, x * 3.0]).sum().backward(
                retain_graph=True)
            assert hooked == [2, 2]  # the join's two sums, not the other thread's 50 products
        hooked.clear()
        x.grad = None
        joined("sum", [x * 2.0, on_thread(lambda: deep(x))]).sum().backward()
        assert hooked == [2]  # the sum's node, numbered below the other thread's output
        assert torch.allclose(x.grad, torch.full((3,), 2.0 + 1.01 ** 50))

    # On a fresh thread too, numbered from 0 as the other threads are: on this one, past the
    # nodes of every test run before, the join's own numbers would be above theirs, and the
    # rule before (above the outputs' numbers) would pass as well.
    on_thread(body)



@pytest.mark.parametrize("read", ["mul", "add", "matmul"])
def test_a_join_reading_a_view_whose_base_it_changed_in_place_holds_its_gradients(read, monkeypatch):
    # (An operation reading a view whose base changed in place since makes its own node first,
    # then the view's anew, numbered above it: the in-place sum below was left unheld.)
    from parallel_modules._joins import _join_outputs
    from parallel_modules._streams import _graph_state

    def join(outputs):
        total = outputs[0] * 1.0
        head = total[:2]  # a view, taken before its base changes in place
        total += outputs[1]  # the sum: one gradient to both sides
        if read == "mul":
            return head * 2.0
        if read == "add":
            return head + 1.0
        return head @ torch.ones(3, 3)

    hooked = []
    monkeypatch.setattr(_streams, "_hold_gradients",
                        lambda grads, _: hooked.append(sum(g is not None for g in grads)))
    xs = [torch.randn(4, 3, requires_grad=True) for _ in range(2)]
    try:
        _graph_state.forked = True
        out = _join_outputs("Parallel", join, 0, ["a", "b"], [x * 1.0 for x in xs])
    finally:
        _graph_state.forked = False
    out.sum().backward()
    # The read, the view's node made anew, the in-place sum (both sides), the copy: all the join's.
    assert sorted(hooked) == [1, 1, 1, 2]
    assert all(torch.equal(x.grad[:2], torch.full((2, 3), 1.0 if read == "add" else 2.0 if read == "mul" else 3.0))
               for x in xs)


def test_record_on_marks_a_dual_outputs_tangent_too(monkeypatch):
    # Under forward-mode AD a side branch's output carries a tangent made on the side
    # stream, with memory of its own, which the caller reads as well: the allocator must
    # be told of both. (record_stream itself needs CUDA: the marks are counted here.)
    import torch.autograd.forward_ad as fwAD

    marked = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: marked.append(t.data_ptr()))
    with fwAD.dual_level():
        primal, tangent = torch.randn(3), torch.randn(3)
        out = fwAD.make_dual(primal, tangent) * 2
        _streams._record_tensor(out, "the caller's stream")
        expected = {fwAD.unpack_dual(out).primal.data_ptr(), fwAD.unpack_dual(out).tangent.data_ptr()}
    assert set(marked) == expected and len(marked) == 2
    marked.clear()
    _streams._record_tensor(torch.randn(3), "the caller's stream")  # no dual level: the tensor alone
    assert len(marked) == 1
