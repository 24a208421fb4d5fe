r"""What may be a child of ``Parallel`` (a branch) or ``ParallelSequential`` (a stage), under which name, and
what its layers tell of it before it runs (whether it writes its input in place first).

Both register their children with ``add_module``, as ``nn.Sequential`` does, so a
child's name is an attribute name of the container too: it may not be one the
container already has (a setting such as ``join`` or ``chunks``, a method), and
torch's own rules apply (a non-empty string without ``"."``). Checked before
anything is registered, so that a bad name fails with the container and the
child named, and leaves the container as it was.
"""

from __future__ import annotations

import collections.abc
import copy
import inspect
import operator
import sys
from typing import Any, Callable, Iterator

import torch
from torch import nn

from . import _watch
from ._fusion import _DROPOUTS, _STOCK_DROPOUT, _compiled
from ._inputs import _with_context
from ._joins import _NAMED_JOINS, _shown

__all__: list[str] = []

# The package, whose modules parallel and pipeline import this one: their classes are read from it
# at call time (a function's import statement cost 1 us at every call of _writes_its_input).
_package = sys.modules[__package__]


class _Function(nn.Module):
    r"""Holds a plain callable branch (``torch.relu``, a lambda) as a module."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def __setattr__(self, name: str, value: Any) -> None:
        replaced = name == "fn" and "fn" in self.__dict__
        super().__setattr__(name, value)
        if replaced:
            # ``block[i].fn = g`` registers nothing, and fused groups run a copy of the first
            # member's holder made with the old callable: a new revision, counted as a
            # registration, makes the blocks above see a changed tree and group their branches
            # anew, as for a branch replaced (see _watch._change_setting).
            self.__dict__["_revision"] = object()
            _watch._count()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__qualname__", None) or repr(self.fn)


def _plural(kind: str) -> str:
    r"""What several children of ``kind`` (``"branch"``, ``"stage"``) are called."""
    return "branches" if kind == "branch" else f"{kind}s"


def _unfit(owner: str, kind: str, name: str, child: Any, constructing: bool = False,
           container: nn.Module | None = None) -> str | None:
    r"""Why ``child`` cannot be a ``kind`` of ``owner`` whatever it is called, or ``None``.

    ``constructing``: ``child`` was passed to ``owner``'s constructor, by position.
    ``container``: the block ``child`` is added to, once built (``append``, ``insert``, ...).
    """
    if container is not None and isinstance(child, nn.Module):
        # A block registered below itself: torch registers the cycle, and from then on its
        # repr, state_dict and every call recurse without end, the block unusable for good.
        within = next((path for path, m in child.named_modules() if m is container), None)
        if within is not None:
            where = "the block itself" if not within else f"a module holding the block (at {within!r})"
            return (f"{owner}: {kind} {name!r} is {where}; a block cannot be its own {kind}: its calls, "
                    f"repr and state_dict would recurse without end. Add a copy, copy.deepcopy(block), "
                    f"or a new block of the same {_plural(kind)}.")
    if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and type(child).forward is nn.Module.forward:
        # (A subclass that defines ``forward`` is an ordinary module.)
        plural = _plural(kind)
        return (f"{owner}: {kind} {name!r} is a {type(child).__name__}, which holds modules but cannot be called. "
                f"Pass its modules as the {plural} ({owner}(*modules), or {owner}(OrderedDict(module_dict))), "
                f"or wrap them in an nn.Sequential to run them one after another as one {kind}.")
    if type(child) in (list, tuple, dict):
        plural = _plural(kind)
        return (f"{owner}: {kind} {name!r} is a {type(child).__name__} of {len(child)}, not a module. Pass the "
                f"{plural} as separate arguments, {owner}(*{plural}), or named in an OrderedDict, "
                f"{owner}(OrderedDict(...)).")
    if isinstance(child, type) and issubclass(child, nn.Module):
        return (f"{owner}: {kind} {name!r} is the class {child.__name__}, not a module; pass an instance, "
                f"e.g. {child.__name__}(...).")
    # A setting passed by position: every setting is keyword-only.
    setting = None if not constructing else (
        "join" if kind == "branch" and isinstance(child, str) and child in _NAMED_JOINS else
        ("chunks" if kind == "stage" else "dim") if type(child) is int else None)
    if setting is not None:
        return (f"{owner}: {kind} {name!r} is the {type(child).__name__} {child!r}, not a module. Settings are "
                f"keyword-only: {owner}(..., {setting}={child!r}).")
    return None


def _as_branch(owner: str, name: str, branch: Any, constructing: bool = False,
               container: nn.Module | None = None) -> nn.Module:
    r"""``branch`` as a module: itself, or a plain callable held by :class:`_Function`."""
    why = _unfit(owner, "branch", name, branch, constructing, container)
    if why:
        raise TypeError(why)
    if isinstance(branch, nn.Module):
        return branch
    if callable(branch):
        return _Function(branch)
    raise TypeError(
        f"{owner}: branch {name!r} must be an nn.Module or a callable, got {_shown(branch)}. "
        "Wrap it in a module or pass a function."
    )


def _check_stage(owner: str, name: str, stage: Any, constructing: bool = False,
                 container: nn.Module | None = None) -> None:
    why = _unfit(owner, "stage", name, stage, constructing, container)
    if why:
        raise TypeError(why)
    if not isinstance(stage, nn.Module):
        raise TypeError(
            f"{owner}: stage {name!r} must be an nn.Module, got {_shown(stage)}. Wrap functions in a module."
        )


# What every module instance holds (``training``, ``_parameters``, the hook dicts).
_MODULE_ATTRIBUTES = frozenset(vars(nn.Module()))


def _check_name(cls: type, kind: str, name: Any, taken: frozenset[str] = frozenset()) -> None:
    r"""Refuse ``name`` for a child of a ``cls`` being built: torch's rules for module names, and no
    attribute the class has (a method, ``chunks``) or its instances get (``taken``: the settings;
    ``cls._internal``: the private state, which a child of the same name would replace or refuse)."""
    owner = cls.__name__
    if not isinstance(name, str):
        raise TypeError(f"{owner}: {kind} names must be strings, got {type(name).__name__} ({name!r}).")
    problem = ("it is empty" if not name else "it contains '.'" if "." in name
               else f"it is {owner}'s setting {name!r}" if name in taken
               else f"{owner} has an attribute {name!r}" if (hasattr(cls, name) or name in _MODULE_ATTRIBUTES
                                                              or name in getattr(cls, "_internal", ()))
               else None)
    if problem:
        raise ValueError(f"{owner}: cannot name a {kind} {name!r}: {problem} (a {kind}'s name becomes an "
                         f"attribute of the {owner}). Choose another name.")


def _insert_index(owner: str, index: Any, n: int, kind: str, plural: str) -> int:
    r"""``index`` of ``insert`` into a container of ``n`` children (``kind``: what one is called, ``plural``:
    what several are), as an int; refused naming ``owner`` where it is no int or out of range (``-n <= index
    <= n``, as a list's)."""
    try:
        index = operator.index(index)  # (a NumPy integer too)
    except TypeError:
        raise TypeError(f"{owner}: insert takes an int index, got {_shown(index)}; call it as "
                        f"insert(index, module).") from None
    if not -n <= index <= n:
        raise IndexError(f"{owner}: insert index {index} is out of range for {n} {kind if n == 1 else plural} "
                         f"(expected {-n} <= index <= {n}).")
    return index


def _check_numbered(owner: str, names: list[str], plural: str, operation: str, named: str, fix: str) -> None:
    r"""Refuse ``operation``, which names children (``plural``) by their position, unless ``names`` are
    ``"0"``..``"n-1"``; ``named``: how else they came to be named, ``fix``: what to do instead."""
    if names != [str(i) for i in range(len(names))]:
        raise ValueError(f"{owner}: {operation} numbers the {plural} by position and needs them named "
                         f"'0'..'{len(names) - 1}', got {names} ({named}). {fix}")


def _listed(owner: str, operation: str, kind: str, modules: Any) -> list:
    r"""``modules``, an iterable of children for ``operation`` (``"extend"``, ``"+"``), as a list; refused
    naming ``owner`` where it is none (one module, whose fix is to append it)."""
    if not isinstance(modules, collections.abc.Iterable):  # (as nn.ModuleList.extend checks)
        plural = _plural(kind)
        fix = "write block + [module]" if operation == "+" else (
            f"use {'block' if kind == 'branch' else 'pipe'}.append(module)")
        raise TypeError(f"{owner}: {operation} takes an iterable of {plural} (another {owner}, a list), got "
                        f"{type(modules).__name__}. To add one {kind}, {fix}.")
    return list(modules)


def _slice_text(idx: slice) -> str:
    r"""``idx`` as written in brackets: ``5:``, ``0:0``, ``::2``."""
    text = ":".join("" if v is None else str(v) for v in (idx.start, idx.stop))
    return text if idx.step is None else f"{text}:{idx.step}"


def _new_like(block: nn.Module, operation: str, kind: str, *args: Any, **settings: Any) -> nn.Module:
    r"""A new container of ``block``'s class, built of ``args`` with ``settings``, for ``operation`` (a slice,
    ``+``, ``*``), as torch's containers build theirs: ``type(block)(...)``.

    A subclass whose own ``__init__`` takes other arguments (``Heads(n, width)``) failed with
    "unexpected keyword argument 'join'", naming neither the operation nor the fix: refused
    before it is called, saying both.
    """
    cls = type(block)
    # (This package's class, not one of a package whose name merely begins with this one's; the
    # package may be vendored under another, ``vendor.parallel_modules``.)
    base = next(c for c in cls.__mro__ if c.__module__.startswith(f"{__package__}.")).__name__
    plural = _plural(kind)
    yourself = f"or build a {base} of the {plural} yourself, {base}(*{plural})."
    try:
        inspect.signature(cls).bind(*args, **settings)
    except TypeError as error:
        raise TypeError(
            f"{cls.__name__}: {operation} builds a new {cls.__name__} of the {plural} with the settings of this one "
            f"({', '.join(settings)}), as {base}.__init__ takes them, but {cls.__name__}.__init__ does "
            f"not ({error}). Let {cls.__name__}.__init__ take them and pass them on to {base}.__init__, {yourself}"
        ) from None
    except ValueError:  # (no signature to read: left to the call)
        pass
    try:
        return cls(*args, **settings)
    except Exception as error:
        # A signature that binds them may still mean other things by them (``__init__(self, width,
        # *branches, **settings)`` takes the branches for its width): the error, raised deep in a
        # layer's constructor, said nothing of the operation that called it.
        raise _with_context(error, (
            f"(raised by {cls.__name__}.__init__, which {operation} called with the {plural} by position and "
            f"the settings of this one ({', '.join(settings)}) by keyword, as {base}.__init__ takes them: "
            f"{cls.__name__}.__init__ takes them, but not as {base}.__init__ does. Let it take the {plural} "
            f"by position and the settings by keyword and pass them on to {base}.__init__, {yourself})"))


def _child_key(owner: str, names: list[str], idx: Any, kind: str, slices: bool = True) -> str:
    r"""The name of child ``idx`` (an int) of a container whose children are ``names``, where
    ``kind`` is what a child is called (``"branch"``, ``"stage"``); the errors say what was
    expected (an int in range, a slice where ``slices``) and how to reach a named child."""
    plural = _plural(kind)
    if not hasattr(idx, "__index__"):
        if isinstance(idx, slice) and not slices:
            raise TypeError(f"{owner}: cannot assign to a slice of {plural} ({idx!r}), as nn.Sequential "
                            f"cannot; assign them one at a time: block[i] = module.")
        named = ""
        if isinstance(idx, str):
            named = (f" A named {kind} is an attribute: block.{idx}." if idx.isidentifier()
                     else f" A named {kind} is an attribute: getattr(block, {idx!r}).")
        raise TypeError(f"{owner}: {plural} are indexed by int or slice, got "
                        f"{type(idx).__name__} ({idx!r}).{named}")
    idx = idx.__index__()
    n = len(names)
    if not -n <= idx < n:
        raise IndexError(f"{owner}: index {idx} is out of range for {n} {kind if n == 1 else plural}.")
    return names[idx % n]


def _state_to_copy(module: nn.Module) -> dict:
    r"""``module``'s ``__dict__`` for ``__getstate__``, with a dict of children of its own, of the same
    modules (as a slice has), and a compiler of its own (the settings, no compiled code).

    ``copy.copy`` hands the copy this state as it is: a child deleted from a dict both
    blocks share would leave the other block's groups, plans and graphs running it,
    unseen; and a shared compiler, whose list of compiled children is one block's, would
    make each call of either block build (and compile) its children anew.

    Built on ``nn.Module.__getstate__``, which leaves out what ``module.compile()`` set
    (``_compiled_call_impl``, compiled code calling *this* module's ``_call_impl``): kept,
    a deep copy ran the original block -- its parameters, not the copy's -- and pickling
    (``torch.save(model)``) failed on it.
    """
    state = nn.Module.__getstate__(module)
    state["_modules"] = module._modules.copy()
    if state.get("_compiler") is not None:
        state["_compiler"] = copy.copy(state["_compiler"])
    return state


def _uncompiled(m: nn.Module) -> nn.Module:
    r"""The module ``torch.compile(m)`` compiled (which returns what it returns), or ``m`` itself."""
    return m._orig_mod if _compiled(m) else m


def _in_turn(m: nn.Module) -> bool:
    r"""Whether ``m`` runs its children one after another on its input: an ``nn.Sequential`` with torch's
    ``forward`` (a subclass's that adds none of its own too), or a nested ``ParallelSequential``."""
    if not isinstance(m, nn.Sequential):
        return False
    forward = type(m).forward
    return forward is nn.Sequential.forward or forward is _package.pipeline.ParallelSequential.forward


def _scripted_in_turn(m: nn.Module) -> bool:
    r"""Whether ``m`` is an ``nn.Sequential`` made a TorchScript module (``torch.jit.script``), which runs
    its children one after another as the container did (its class is TorchScript's: see :func:`_in_turn`)."""
    return isinstance(m, torch.jit.ScriptModule) and getattr(m, "original_name", None) == "Sequential"


def _layers_in_turn(m: nn.Module) -> Iterator[nn.Module]:
    r"""The layers ``m`` runs one after another on its input: those of the containers that run their
    children in turn (:func:`_in_turn`, or an ``nn.Sequential`` made a TorchScript module), flattened, or
    ``m`` itself; a compiled module's, the one it compiled. One at a time: a caller reads the first few,
    some on every call."""
    if type(m) is not nn.Sequential:  # (the common container, asked nothing more)
        m = _uncompiled(m)
        if not (_in_turn(m) or _scripted_in_turn(m)):
            yield m
            return
    for child in m._modules.values():
        yield from _layers_in_turn(child)


# Stock layers returning their input, or a view of it, untouched: the layer after them decides.
_PASSING = (nn.Identity, nn.Flatten, nn.Unflatten)
# The names of those and of torch's dropouts, as TorchScript keeps a stock module's class name, its
# settings and its mode (``torch.jit.script``; what ``torch.jit.trace`` makes keeps no settings).
_PASSING_NAMES = frozenset(cls.__name__ for cls in _PASSING)
_DROPOUT_NAMES = frozenset(cls.__name__ for cls in _DROPOUTS)


def _writes_its_input(child: nn.Module) -> bool:
    r"""Whether ``child`` (a branch, a stage, a fused group's member) begins with a layer writing its input
    in place: a stock one (``nn.ReLU(inplace=True)``, a TorchScript one too), or any whose ``inplace`` is
    set, first, or after layers returning their input (``nn.Identity``, ``nn.Flatten``, a dropout in
    eval), in containers that run it first (:func:`_layers_in_turn`); a ``Parallel`` there writes it
    where any branch does.

    What can be told from the layers alone, before anything runs: by a trace, which cannot
    watch the input's version, and on inputs that keep none. A module of the user's writing
    its input is seen by eager calls only.
    """
    for m in _layers_in_turn(child):
        cls = type(m)
        # (torch's dropouts return their input itself in eval or with p=0, in place or not; getattr: a
        # TorchScript module's class has no forward to read.)
        if cls in _PASSING or getattr(cls, "forward", None) in _STOCK_DROPOUT and (not m.training or m.p == 0):
            continue
        if m.__dict__.get("inplace") is True:  # (not getattr: a module without one raises inside, slowly)
            return True
        parallel = _package.parallel.Parallel
        if isinstance(m, parallel) and cls.forward is parallel.forward:  # every branch gets the input
            return any(_writes_its_input(branch) for branch in m._modules.values())
        if isinstance(m, torch.jit.ScriptModule):
            name = getattr(m, "original_name", None)  # (the class it was made from)
            # (getattr: what torch.jit.trace makes of a dropout keeps no ``p``, unknown then.)
            if name in _PASSING_NAMES or name in _DROPOUT_NAMES and (not m.training or getattr(m, "p", None) == 0):
                continue
            return getattr(m, "inplace", None) is True  # (kept apart from __dict__)
        return False
    return False
