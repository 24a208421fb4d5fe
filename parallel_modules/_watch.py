r"""Whether a module's children changed since its caches were built.

``Parallel`` and ``ParallelSequential`` learn things about their children at
the first calls -- fused groups, schedules, batch-mixing stages, CUDA graphs --
that a later change to a child invalidates: a submodule replaced anywhere below
(``block[0][2] = nn.Linear(...)``, as adapter and quantization tools inject
layers), a branch added with ``add_module``, a parameter registered anew
(``load_state_dict(assign=True)``), a buffer of another device, dtype or shape
(one assigned a tensor like the last, as a ``forward`` counting its calls does,
is left to what reads it: see :meth:`_Tree.same`). Walking the whole tree on every call
would cost more than a small call itself, so torch's global registration hooks
count such changes anywhere in the process, and a module walks its tree only
when the count moved since it last looked (:class:`_Tree`); fused groups compare
their members' tensors with the stacked ones then (``_fusion._Group._bound``).

A block's own settings (``block.join = "sum"``, ``block.max_graphs = 2``) are
checked and make it forget what it learnt as soon as they are set
(:func:`_change_setting`).

Changes to children that register nothing -- ``del block[0][1]`` and
``del m.child`` (``nn.Module.__delattr__``), ``block[0].insert(1, layer)`` of a
layer built before (building one registers its parameters), ``nn.ModuleDict``'s
``pop`` and ``clear`` -- are counted by torch's own methods that make them,
wrapped once (:func:`_install`). Writes straight into a module's private
``_modules`` dict call none of them (``layer._modules[name] = new``, as
``torch.ao.quantization.convert`` and ``torch.fx``-style passes swap layers;
``_modules.pop(name)``; a container subclass's own ``insert``), and where the
layer written holds no tensors (an activation, ``nn.Identity``) or was built
before, nothing registers at all. A pipeline compares the dicts of children
below it with copies at every call (:meth:`_Tree.rewritten`), a fraction of a
microsecond of calls that cost milliseconds, so that its plan (the stages that
mix samples, see ``pipeline``) and its graphs are made anew. ``Parallel`` does
not: on the H200 machine the comparison added 1.7 us to a graphed fused call of
eight 4-layer MLPs (21.1 to 22.8 us) and 2.5 us to one of sixteen (21.3 to
23.8 us), a tenth of the call (``tools/exp_graph_ab.py``, session 72). A dict
of children that counted its own writes (a ``dict`` subclass as
``_modules``) would cost nothing per call, but made Dynamo name every child
below it by position (``dict.__getitem__(L['self']._modules,
list(dict.keys(...))[0])``): a strict ``torch.export`` lost the modules' names,
which ``unflatten``, ``preserve_module_call_signature`` and quantizers select
by. Not seen until the next registration anywhere: a dict of children replaced
whole below a block (``layer._modules = {...}``, the old one left as it was; a
block's own is), and the same children put back in another order under the
same names (popped and set again). (A parameter or buffer written into
``_parameters`` or ``_buffers`` registers nothing either: fused groups see it
by its address, see ``_fusion._Group._bound``.)

``torch.utils.swap_tensors`` gives a parameter or buffer another tensor's
memory, dtype and shape, keeping the object, and registers nothing: with
``torch.__future__.set_swap_module_params_on_conversion(True)``, ``.to()``,
``.half()`` and ``load_state_dict(assign=True)`` swap every tensor they change.
Wrapped once too (:func:`_counted_swap`), a swap counts as a change; a walk after
one also compares where the tree's tensors lie with where they lay when the
block last made its state anew (``_placed``, see :func:`_reset_if_moved`): CUDA
graphs read them by address, and eager calls would read them anew, but the
graphs would replay the old memory. (A swap that moved nothing -- ``.float()``
of float tensors under the flag -- changes nothing.)
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable

import torch
import torch.nn.utils.stateless
from torch import nn

from ._inputs import _dynamo_compiling
from ._streams import _FakeTensor, _storage_address

__all__: list[str] = []

# Module, parameter and buffer registrations anywhere in the process so far.
_changes = 0
# ``torch.utils.swap_tensors`` calls anywhere in the process so far (each also counted in _changes).
_swaps = 0


# Whether a strict ``torch.export`` traces, as Dynamo reads it. Not asked before torch 2.13,
# whose Dynamo also read ``is_exporting()`` as true under ``torch.compile`` (2.11 did), where
# the registrations it traces must be counted (see _count): such exports warn there.
_exporting = torch.compiler.is_exporting if torch.__version__ >= (2, 13) else lambda: False


def _count(*_: Any) -> None:
    # Not while a strict ``torch.export`` traces (Dynamo, exporting): it replays nothing on the
    # real modules, and warned of the count's store as a side effect of the model's forward.
    # Under ``torch.compile`` the count is kept: Dynamo writes the registrations it replays
    # into the modules' dicts without running the hooks, and only the count's store, replayed
    # after the graph, tells a block of a layer replaced below it inside compiled code. (It is
    # a global Dynamo guards on: a compiled model registering modules at every call compiles
    # again at every call once a block is built, as README says.)
    if _exporting() and _dynamo_compiling():
        return
    global _changes
    _changes += 1


def _children_changed() -> None:
    r"""Count a change a block made to its own children that registers nothing (``del block[i]``,
    ``del block.name``, ``insert``, which write ``_modules`` directly), as a registration.

    The block forgets what it learnt itself (``_reset``); counted, the blocks
    enclosing it (a pipeline whose stage it is, its batch-mixing layers planned
    from the old children; a graphed block whose branch it is, its graphs
    captured with them) walk their trees at their next call and see it too.
    """
    _count()


def _counted_delattr(delattr: Callable[[nn.Module, str], None]) -> Callable[[nn.Module, str], None]:
    r"""``nn.Module.__delattr__``, counting the deletion of a child (``del m.fc``, and so
    ``del seq[i]``, which deletes its attribute), which registers nothing."""

    @functools.wraps(delattr)
    def __delattr__(self: nn.Module, name: str) -> None:
        child = name in self.__dict__.get("_modules", ())
        delattr(self, name)
        if child:
            _count()

    return __delattr__


def _counted(method: Callable[..., Any]) -> Callable[..., Any]:
    r"""A container's method that changes its children writing its ``_modules`` directly, counting the change."""

    @functools.wraps(method)
    def counted(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        finally:
            _count()

    return counted


def _counted_swap(swap: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    r"""``torch.utils.swap_tensors``, counting the swap (see the module's docstring)."""

    @functools.wraps(swap)
    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        global _swaps
        try:
            return swap(t1, t2)
        finally:
            _swaps += 1
            _count()

    return swap_tensors


# torch's container methods that change children by writing ``_modules`` directly (see above).
_DIRECT_WRITERS = ((nn.Sequential, "insert"), (nn.ModuleList, "insert"), (nn.ModuleDict, "__delitem__"),
                   (nn.ModuleDict, "clear"))


def _once(install: Callable[[], None]) -> Callable[[], None]:
    r"""``install``, run at its first call only, however many threads make it at once.

    For what wraps torch's own functions or registers global hooks, which done
    twice would wrap or register them twice.
    """
    done = False
    lock = threading.Lock()

    @functools.wraps(install)
    def once() -> None:
        nonlocal done
        if done:  # (no lock: a compiler tracing a call that groups branches anew cannot trace one)
            return
        with lock:
            if not done:
                install()
                done = True

    return once


@_once
def _install() -> None:
    hooks = nn.modules.module
    hooks.register_module_module_registration_hook(_count)
    hooks.register_module_parameter_registration_hook(_count)
    hooks.register_module_buffer_registration_hook(_count)
    # (Wrapped once per process, as the hooks are registered once; a class defining
    # its own -- a subclass's insert -- is wrapped where it calls torch's.)
    nn.Module.__delattr__ = _counted_delattr(nn.Module.__delattr__)  # type: ignore[method-assign]
    for cls, name in _DIRECT_WRITERS:
        setattr(cls, name, _counted(cls.__dict__[name]))
    # (Looked up on ``torch.utils`` at each call by ``nn.Module._apply`` and
    # ``_load_from_state_dict``; a name imported from it before is not counted.)
    torch.utils.swap_tensors = _counted_swap(torch.utils.swap_tensors)


def _members(root: nn.Module) -> tuple[tuple[Any, ...], tuple[torch.Tensor, ...]]:
    r"""The submodules, parameters and settings revisions of ``root`` (see :func:`_change_setting`), and its buffers.

    One walk of the tree, each module's own dicts read as they are: a module
    or tensor held twice is listed twice, in both snapshots compared. ``root``
    itself is not listed: it is the one compared (see :class:`_Tree`).
    """
    modules = tuple(root.modules())
    members = (*modules[1:], *[p for m in modules for p in m._parameters.values() if p is not None],
               *[m.__dict__.get("_revision") for m in modules])
    return members, tuple([b for m in modules for b in m._buffers.values() if b is not None])


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return type(t), t.layout, t.device, t.dtype, t.shape


def _sharable_address(t: torch.Tensor) -> int:
    r"""Where ``t``'s memory starts, to tell tensors that share elements (tied, stacked, views); ``0``
    where it has no element to share with another tensor.

    Unlike :func:`._streams._storage_address`, ``0`` also for a tensor without elements (an empty
    view of another's memory shares nothing with it), a meta tensor, an uninitialized parameter, and
    one whose storage raises anything (wrapper subclasses, functorch wrappers, DTensor, XLA).
    """
    if isinstance(t, _Uninitialized) or t.numel() == 0 or t.device.type == "meta":
        return 0  # (no memory of its own to share)
    try:
        return _storage_address(t)
    except Exception:  # (no storage: wrapper subclasses, functorch wrappers, DTensor, XLA)
        return 0


# torch's containers, whose dicts of children are watched even while empty (see _Tree).
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

# What _Tree.changed returns for modules changed while tensors are swapped in for the call: the
# caller runs its children one after another, as they are, learning nothing.
_WHILE_SWAPPED = "while swapped"


class _Tree:
    r"""The submodules, parameters and buffers of ``root`` when it was last looked at.

    ``children``: also hold the dicts of children of ``root`` and below it, and
    a copy of each, which the block's calls compare (see :meth:`rewritten`): a
    pipeline's (see the module's docstring for why not a ``Parallel``'s).

    ``root`` itself is not held, only what is below it and its dict of children
    (which does not hold it): the block keeps its tree, and a tree holding the
    block would make every block a reference cycle, freed with its parameters
    only when the cyclic garbage collector next runs, not when the last
    reference to it goes. Every look is given ``root`` again.
    """

    __slots__ = ("seen", "walked", "swaps", "members", "buffers", "parameters", "modules", "children", "copies")

    def __init__(self, root: nn.Module, children: bool = False) -> None:
        _install()
        # The count at the last walk that found the tree settled, and at the last walk (see same):
        # the next call walks once more.
        self.seen, self.walked = -1, _changes
        self.swaps = _swaps  # (see same)
        # Held (not only their ids), so that an id is not reused by a new object while compared.
        self.members, self.buffers = _members(root)
        modules = tuple(root.modules())
        self.modules = modules[1:]  # (below root: see above)
        # Without walking the tree again (whether any is trained, on a hot path).
        self.parameters = tuple(root.parameters())
        # The modules' dicts of children (those holding any, and torch's containers, which may be
        # filled later), the dicts themselves, and their copies (see rewritten). (TorchScript
        # modules keep theirs in C++, behind a view that is not a dict.) The root's own dict too
        # (``pipe._modules["1"] = nn.Tanh()``): the dict does not hold the root.
        self.children = [m._modules for m in modules if (m._modules or isinstance(m, _CONTAINERS))
                         and isinstance(m._modules, dict)] if children else []
        self.copies = [d.copy() for d in self.children]

    def rewritten(self) -> bool:
        r"""Whether a dict of children below the root was written into directly since it was looked at last,
        which registers nothing (see the module's docstring).

        One C comparison of the dicts with their copies, children by identity
        first. (Hot paths compare them inline, without this frame.)
        """
        return self.children != self.copies

    def forget(self) -> None:
        r"""Take the tree as changed at the next look: a change found otherwise, which registered nothing."""
        self.seen, self.members, self.modules = -1, (), ()

    def changed(self, root: nn.Module) -> bool | str:
        r"""Whether ``root``'s tree changed since it was looked at last, not by tensors swapped in for one call.

        ``torch.func.functional_call`` swaps tensors, never modules: a module
        replaced or added counts inside one too (see :func:`_swapped_in`), as
        :data:`_WHILE_SWAPPED`. What was learnt is then made anew at a call
        outside one, not in it: a snapshot of the tree taken in it would hold
        the tensors swapped in (the caller's, with their autograd graph;
        functorch's, which have no memory to look at).
        """
        if self.same(root):
            return False
        now = tuple(root.modules())
        swapped = _swapped_in(now)
        below = now[1:]
        if len(below) != len(self.modules) or any([a is not b for a, b in zip(below, self.modules)]):
            return _WHILE_SWAPPED if swapped else True
        return not swapped

    def same(self, root: nn.Module) -> bool:
        r"""Whether ``root``'s tree holds the same objects as when looked at last (cheap while nothing registered),
        and no dict of children below was written into (see :meth:`rewritten`).

        A buffer assigned a new tensor of its own, of the same class, layout,
        device, dtype and shape (``self.steps = self.steps + 1`` in a
        ``forward``; assigning one runs the registration hooks), leaves the
        tree the same: what blocks learnt does not depend on which tensor it
        is, and what reads it by address looks for itself (fused stacks bind
        anew, CUDA graphs see tensors swapped in). Made anew at every call,
        schedules were tuned anew at every call. A buffer tied to another
        tensor of the tree (the same one, or its memory) changes it: fused
        groups refuse branches that share tensors. After a
        ``torch.utils.swap_tensors`` anywhere, a tensor that no longer lies
        where it lay when ``root`` last made its state anew changes it too
        (see the module's docstring).
        """
        if self.rewritten():
            # (Even where the walk would find the same modules in the same order, renamed:
            # grouping compares the names of the members' children too.)
            return False
        seen, swaps = _changes, _swaps  # (before the walk: a registration during it is looked at next time)
        if self.seen == seen:
            return True
        now, buffers = _members(root)
        if len(now) != len(self.members) or any(a is not b for a, b in zip(now, self.members)):
            return False
        if len(buffers) != len(self.buffers):
            return False
        changed = [(a, b) for a, b in zip(self.buffers, buffers) if a is not b]
        if changed:
            if any(_layout(a) != _layout(b) for a, b in changed):
                return False
            mine = [p for p in (_sharable_address(b) for _, b in changed) if p]  # (0: nothing to tie; type compared above)
            if mine:
                held = [_sharable_address(t) for t in (*root.parameters(), *buffers)]
                if any(held.count(p) > 1 for p in mine):
                    return False
        if swaps != self.swaps:
            # A tensor swapped somewhere: the same objects may now lie elsewhere, or be of another
            # dtype or shape (see the module's docstring). ``_placed`` is set when the root makes
            # its state anew, after its fused groups stack the parameters. (A module of the user's,
            # watched for its failure to compile, keeps none: that failure holds wherever its
            # tensors lie, as it does across a ``.to()`` without the flag.)
            placed = root.__dict__.get("_placed")
            if placed is not None and _placement(root) != placed:
                return False
            self.swaps = swaps
        self.buffers = buffers
        # torch runs the registration hooks before it stores what they announce: a walk
        # from another thread between the two saw the old tree. So the tree is walked once
        # more at the next call with the count unchanged -- a miss would need the
        # registering thread to stall between hook and store through a whole call -- and
        # only then taken as seen. (Where a forward assigns a buffer, every call walks anyway.)
        if self.walked == seen:
            self.seen = seen
        self.walked = seen
        return True


def _reset_changed_below(root: nn.Module) -> None:
    r"""Make the blocks below ``root`` whose tree changed forget what they learnt, as their own calls would.

    For a CUDA-graph capture of ``root`` in training, which runs the blocks
    below with their parameters swapped for aliases (``_graphs._with_aliases``):
    a block then takes any change in its tree for the aliases' (see
    :func:`_swapped_in`) and keeps what it learnt -- fused groups stacked from
    a replaced layer's old parameters. Done before the aliases go in.
    """
    for m in root.modules():
        tree = m.__dict__.get("_tree")
        if m is not root and isinstance(tree, _Tree) and not tree.same(m):
            m._reset()


def _swapped_in(modules: Any) -> bool:
    r"""Whether ``modules`` hold tensors swapped in for one call: a parameter slot holds a tensor that is not an
    ``nn.Parameter``, or a slot holds a tensor given to an enclosing ``torch.func.functional_call``.

    Registering a parameter requires one; ``torch.func.functional_call`` writes
    the tensors it is given (plain tensors, functorch wrappers, dual tensors,
    another model's parameters and buffers) into the modules' dicts for the
    call, registering nothing. While they are there, a change seen in the tree
    (another registration anywhere in the process moved the count) is theirs:
    nothing learnt is reset for it, and they are not stacked into fused
    groups, which would re-point the caller's tensors and drop their autograd
    and forward-mode state.
    """
    modules = tuple(modules)
    held = [t for m in modules for d in (m._parameters, m._buffers) for t in d.values() if t is not None]
    if not held:
        return False
    if any(not isinstance(t, nn.Parameter) for m in modules for t in m._parameters.values() if t is not None):
        return True
    given = _given_to_functional_call()
    return bool(given) and any(id(t) in given for t in held)


# The frame every ``functional_call`` (``torch.func``'s, ``nn.utils.stateless``'s) runs the module from.
_FUNCTIONAL_CALL = getattr(getattr(torch.nn.utils.stateless, "_functional_call", None), "__code__", None)


def _given_to_functional_call() -> set[int]:
    r"""The ids of the tensors the enclosing ``torch.func.functional_call``\ s swap in (none outside one).

    ``nn.Parameter``\ s and buffers swapped in look like the module's own:
    only the call's own argument tells. (Asked where a block's tree or a
    group's stacks are seen to differ, and while groups found inside one
    are kept, not on every call; the stack is walked.)
    """
    ids: set[int] = set()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _FUNCTIONAL_CALL:
            given = frame.f_locals.get("parameters_and_buffers")
            if isinstance(given, dict):
                ids.update(id(t) for t in given.values())
        frame = frame.f_back
    return ids


def _swapped(dicts: list[dict], snapshot: list[dict], scalars: bool) -> bool:
    r"""Whether parameter or buffer ``dicts`` hold other tensors than their copies ``snapshot``.

    ``torch.func.functional_call`` writes the tensors it is given into the
    dicts for one call, registering nothing. Dicts compare their values by
    identity first, and tensors that are not the same object by value, which
    raises for more than one element; a tensor of one element (``scalars``:
    the snapshot holds one, see :func:`_has_scalars`) could compare equal to
    another, so those dicts are compared by identity, in Python.
    """
    if scalars:
        return any(len(d) != len(s) or any([a is not b for a, b in zip(d.values(), s.values())])
                   for d, s in zip(dicts, snapshot))
    try:
        return dicts != snapshot
    except RuntimeError:
        return True


def _has_scalars(dicts: list[dict]) -> bool:
    r"""Whether ``dicts`` hold a tensor of at most one element (see :func:`_swapped`)."""
    return any(t is not None and t.numel() <= 1 for d in dicts for t in d.values())


def _change_setting(module: nn.Module, name: str, value: Any, reset: Callable[[], None]) -> None:
    r"""Set a constructed block's setting ``name`` (checked already) and ``reset`` it.

    The graph cache is made anew by ``reset``, with the new settings. Where
    ``reset`` refuses the new value (``fuse=True`` on branches that differ),
    the old one is put back before the error goes on: the block works as before.
    """
    state = module.__dict__
    previous = state[name]
    state[name] = value
    state.pop("_graphs", None)
    # A block nested in another's graphed branch: the outer block's graphs ran the old
    # setting (and read parameters a new ``fuse`` moves). A new revision, counted as a
    # registration, makes every block above see a changed tree and make its own anew.
    state["_revision"] = object()
    try:
        reset()
    except BaseException as error:  # (an interrupt too: not a setting half made, as refused ones are not)
        state[name] = previous
        state.pop("_graphs", None)
        try:
            reset()
        except Exception:
            # The old value is refused too (``block.fuse = block.fuse`` with fuse=True
            # once a member was changed in place): its calls raise the same error.
            pass
        raise error
    finally:
        _count()


# Constructor arguments fixed once a block is built (its compiled children are made with
# them); ``compile`` is also ``nn.Module.compile``, which an attribute would hide.
_FIXED = frozenset({"compile", "compile_options", "compile_fallback"})


def _check_attribute(module: nn.Module, name: str, settings: frozenset[str], deleting: bool = False) -> None:
    r"""Refuse to set a constructed block's fixed argument, or to delete one of its ``settings``."""
    owner = type(module).__name__
    if deleting and name in settings:
        raise AttributeError(f"{owner}: cannot delete the setting {name!r}; set it to another value instead "
                             f"(e.g. {owner.lower()}.{name} = ...).")
    if not deleting and name in _FIXED and "_tree" in module.__dict__:
        raise AttributeError(f"{owner}: {name}= is fixed when the block is built; build a new {owner} with "
                             f"{name}=... instead (setting the attribute would change nothing"
                             f"{', and would hide nn.Module.compile' if name == 'compile' else ''}).")


# (Run eagerly where a compiled function changes a block's structure, ``block[1] = layer``:
# Dynamo in torch 2.13 raised an internal error, a guard naming ``___tuple_iterator_getitem``
# it had not defined, resuming in the loop below after the graph break that change makes.)
@torch.compiler.disable
def _placement(module: nn.Module) -> list[tuple]:
    r"""Each parameter and buffer below ``module``: the tensor, where its memory is, and its layout.

    Compared across ``module._apply(fn)``: a ``.to()``, ``.float()`` or
    ``.cuda()`` that moved or cast nothing leaves it equal, and what was
    learnt about the module (graphs, compiled code, fused stacks) holds.
    """
    return [(id(t), t.dtype, t.device, *(
        ("uninitialized",) if isinstance(t, _Uninitialized)  # (a lazy module's: no memory yet)
        else ("fake", t.stride()) if isinstance(t, _FakeTensor)  # (built under FakeTensorMode: no memory)
        else (t.data_ptr(), t.stride()) if t.layout == torch.strided else (t.layout,)))
        for t in (*module.parameters(), *module.buffers())]


_Uninitialized = nn.parameter.UninitializedTensorMixin


def _reset_if_moved(module: nn.Module) -> None:
    r"""After ``module._apply(fn)``: forget what the block learnt (``_reset``) and its compiled
    children, unless no parameter or buffer moved since its last reset (``_placed``).

    ``model.to(device)`` in a loop would otherwise capture and compile anew at
    every call; a branch moved by a ``.to()`` of its own before is seen here.
    """
    if _placement(module) != module.__dict__.get("_placed"):
        module._reset()
        if module._compiler is not None:
            module._compiler.clear()
