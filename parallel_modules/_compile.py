r"""Compiled branches: each branch (or stage) compiled on its own, run under the library's streams and graphs.

``Parallel(..., compile="inductor")`` and ``ParallelSequential(..., compile=...)``
keep their children exactly as they are -- the state dict, indexing and the
modules users hold do not change -- and keep next to them, outside the module
tree, one callable per child that runs the child's compiled form
(:class:`_Compiler`). ``Parallel._run`` and ``ParallelSequential`` ask for "the
callable to run for child i" and otherwise run as before, so the fork/join on
side streams and the whole-forward CUDA graph (``cuda_graph=True``) stay in
the library, around the compiled code:

* **streams** -- inductor's generated code and Torch-TensorRT's runtime launch
  their work on the *current* stream at call time, which is the branch's side
  stream (or, for Torch-TensorRT, an engine stream they fork from it with an
  event), so compiled branches overlap like eager ones;
* **CUDA graph** -- compilation happens at a child's first call; with
  ``cuda_graph=True`` that is the warm-up that precedes capture, so the capture
  records the compiled kernels and nothing is compiled inside it. An inference
  signature is captured a second time with the eager children and the faster
  of the two graphs kept (``Parallel.explain()`` says which); the compiled
  code (for Torch-TensorRT, engines holding device memory) is kept either
  way, for the next signature. With a :func:`torch.compile` backend it is
  captured a third time with the whole module compiled as one program
  (``_WHOLE``: what the compiler makes of the module traced as a whole, the
  children one after another on one stream -- see "tracing" below), which
  fuses across children (the concatenation into the children's last kernels,
  one layout conversion of the input instead of one per child) and can replay
  faster when each child alone fills the GPU. Inductor's
  own CUDA graphs (``mode="reduce-overhead"``, ``"max-autotune"``,
  ``triton.cudagraphs``) would capture inside our capture and are refused;
* **dynamo's cache** -- dynamo keeps compiled code, its guards and its
  recompile limit (``torch._dynamo.config.recompile_limit``, 8) per *code
  object* (documented in :func:`torch.compile`). ``torch.compile(module)``
  compiles the code of ``Module.__call__``/``forward``, which every module of a
  class shares: a model with more than 8 compiled branches would exhaust the
  limit and run the rest eagerly. Each child is therefore compiled through a
  function with a code object of its own (``_entry``), which gives it its own
  cache, its own limit, and a name in dynamo's logs. Not past a graph break:
  dynamo compiles the code after it as a function derived from the class's
  ``forward``, shared again, so with more than 8 such branches of one class
  the rest of them run that part eagerly (results are the same);
* **shapes** -- ``dynamic=False`` by default: every new input signature
  compiles kernels specialised to it, as the module's CUDA graphs are per
  signature anyway and static kernels are the fastest. Micro-batches of
  unequal size (``ParallelSequential``, a batch not divisible by ``chunks``)
  compile twice. Past the recompile limit dynamo runs the child eagerly with a
  warning; pass ``compile_options={"dynamic": None}`` (or ``True``) for inputs
  whose shapes vary widely;
* **tracing** -- while a compiler traces a model that contains these modules
  (whole-model ``torch.compile``, ``torch.export``, Torch-TensorRT), the plain
  children are traced: the outer compiler sees ordinary modules.

``.to()``/``.cuda()``/``.half()`` drop the compiled callables (engines bake in
weights, dtypes and devices); pickling and ``copy.deepcopy`` carry the settings
but no compiled code; both compile again at the next call. ``train()``/
``eval()`` keep them: dynamo guards on the training flag and recompiles once
per mode.

Errors: compilation errors surface at a child's first call (or at a
recompilation). The child is then run eagerly on the same inputs to tell the
two apart: if the eager child raises too, the inputs are at fault and its
error is raised as it is; otherwise the compiler is, and the error names the
module, the child and the backend's message -- or, with
``compile_fallback=True``, one warning says so and the child runs eagerly from
then on.

**Torch-TensorRT, per branch** (``compile="tensorrt"``): each child is
compiled at its first call with ``torch_tensorrt.compile(child, ir="dynamo",
inputs=<that call's tensors>, **compile_options)`` (``arg_inputs``/
``kwarg_inputs`` when the call has keyword arguments), one engine per input
signature (unless ``compile_options`` gives ``inputs``/``arg_inputs`` itself,
e.g. ``torch_tensorrt.Input`` ranges). Engines are called from their branch's
stream; when that is the legacy default stream (branch 0, or every branch with
``streams=False``, of a caller on the default stream), the call moves to a side
stream of the library's and back with events, because TensorRT synchronises
around work enqueued on the default stream ("Using default stream in
enqueueV3() may lead to performance issues due to additional calls to
cudaStreamSynchronize()"). Engines are inference-only: a child in training
mode is refused. Keep Torch-TensorRT's own CUDA graphs
(``torch_tensorrt.runtime.set_cudagraphs_mode``) off under ``cuda_graph=True``.

**Torch-TensorRT, whole model** (documented path, no option of ours)::

    model = MyNet().eval().cuda()          # contains Parallel / ParallelSequential blocks
    x = torch.randn(8, 192, 35, 35, device="cuda")
    trt_model = torch_tensorrt.compile(model, ir="dynamo", inputs=[x], max_aux_streams=4)
    # or, in two steps:
    ep = torch.export.export(model, (x,))
    trt_model = torch_tensorrt.dynamo.compile(ep, inputs=[x], max_aux_streams=4)

The exported program holds the branches one after another and no stream or
event operation (``tests/test_tracing_models.py`` checks both, and that it
equals eager), so TensorRT builds one network in which the branches are
independent layers; its builder may then run them concurrently on up to
``max_aux_streams`` auxiliary streams of its own (TensorRT >= 8.6; ``None``
lets TensorRT's heuristics decide, ``0`` turns it off). The library's streams
and CUDA graphs play no part in that program.
"""

from __future__ import annotations

import copy
import inspect
import re
import threading
import types
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable, Mapping, Union

import torch
from torch import nn

from ._fusion import _GLOBAL_HOOKS, _Handle, _hook_dicts
from ._inputs import _input_device, _put_back, _signature
from ._joins import _first_line
from ._streams import _is_tracing, _record_on
from . import _watch

__all__: list[str] = []

Backend = Union[str, Callable[..., Any]]

# The two ways a module with ``compile=`` is captured when ``cuda_graph=True``
# captures an inference signature (variants of ``_graphs``): with the compiled
# children and with the children as they are. The faster replay is kept, as
# cudnn.benchmark keeps the fastest algorithm: compiled code is not always
# faster once launches cost nothing (the Inception block on an H100, batch 64,
# fp32: 2.98 ms with inductor's kernels against 1.78 ms with eager ones).
_COMPILED, _EAGER = "compiled", "eager"
# A third way, for torch.compile backends: the whole module compiled as one
# program and captured on one stream. On the Inception block at batch 64 fp16
# (H100) it replayed in 380 us, the compiled branches on streams in 436 us and
# torch.compile(mode="reduce-overhead") in 426 us (tools/exp_channels_last.py);
# at batch 8 the branches on streams won (86 us against 134 us).
_WHOLE = "whole"

# TorchScript cannot compile a forward taking ``*args`` nor the modules' Python: say so
# (``__prepare_scriptable__``, which ``torch.jit.script`` calls first) and what works.
_NOT_SCRIPTABLE = (
    "{name} cannot be compiled by torch.jit.script (its forward runs Python that TorchScript does not "
    "support). Use torch.jit.trace(model, example_inputs), torch.export.export or torch.compile, which "
    "trace it into the same result as its eager calls."
)

# Engines kept per child, one per input signature (Torch-TensorRT builds
# static-shape engines from example inputs); as ``max_graphs``' default.
_MAX_ENGINES = 8
# Lines of the backend's message quoted in a compile error.
_MESSAGE_LINES = 12
# Keys of torch.compile's ``options`` that it takes out of the dict itself, whatever the backend
# (documented there): not inductor options.
_TORCH_COMPILE_OPTIONS = ("guard_filter_fn",)
# torch.compile backends that capture CUDA graphs of their own.
_GRAPHING_BACKENDS = ("cudagraphs",)


def _compiler(owner: str, kind: str, backend: Backend | None, options: Mapping[str, Any] | None,
              fallback: bool) -> "_Compiler | None":
    r"""Validate ``compile=``/``compile_options=``/``compile_fallback=`` at construction."""
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"{owner}: compile_options must be a dict of keyword arguments, got "
                        f"{type(options).__name__} ({options!r}).")
    if not isinstance(fallback, bool):  # (not bool(fallback): "no" would be True)
        raise TypeError(f"{owner}: compile_fallback must be True or False, got {type(fallback).__name__} "
                        f"({fallback!r}).")
    if backend is None:
        given = "compile_options" if options else "compile_fallback=True" if fallback else None
        if given:
            raise ValueError(f"{owner}: {given} was given without compile=; pass compile='inductor' (or "
                             f"another backend) too, or drop {given.split('=')[0]}.")
        return None
    return _Compiler(owner, kind, backend, options, fallback)


def _backend_name(backend: Backend) -> str:
    r"""A backend's name for messages and ``repr``: a callable instance by its class (its ``repr``
    would hold its address, different in every run)."""
    if isinstance(backend, str):
        return backend
    return getattr(backend, "__qualname__", None) or type(backend).__qualname__


def _torch_compile_kwargs(owner: str, backend: Backend, options: dict[str, Any]) -> dict[str, Any]:
    r"""The keyword arguments of :func:`torch.compile` for one child, checked."""
    allowed = [p for p in inspect.signature(torch.compile).parameters if p not in ("model", "backend")]
    for given, instead in (("backend", "as compile=, which compiles each child with it"),
                           ("model", "as a branch or stage: each child is compiled on its own")):
        if given in options:  # (arguments of torch.compile, but this module's to set)
            raise ValueError(f"{owner}: compile_options cannot set {given}= (compile={_backend_name(backend)!r} "
                             f"is used); pass it {instead}.")
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{owner}: compile_options {unknown} are not arguments of torch.compile; with "
                         f"compile={_backend_name(backend)!r} they may be {allowed}.")
    if isinstance(backend, str) and backend in _GRAPHING_BACKENDS:
        raise ValueError(f"{owner}: compile={backend!r} captures CUDA graphs of its own, which cannot run inside "
                         f"this module's; use compile='inductor' and cuda_graph=True, which captures the "
                         f"compiled branches in one graph.")
    # (Values torch.compile reads only when it first compiles, which would blame the child.)
    for name, allowed_types, what in (("fullgraph", (bool,), "a bool"), ("disable", (bool,), "a bool"),
                                      ("dynamic", (bool, type(None)), "None or a bool"),
                                      ("mode", (str, type(None)), "None or a string"),
                                      ("options", (dict, type(None)), "None or a dict")):
        if name in options and not isinstance(options[name], allowed_types):
            raise TypeError(f"{owner}: compile_options {name}= must be {what} (as torch.compile takes it), "
                            f"got {options[name]!r}.")
    if backend != "inductor" and options.get("mode") is not None and options.get("options") is not None:
        # (Inductor's are merged below; torch.compile refuses both for other backends, at the first call.)
        raise ValueError(f"{owner}: compile_options gives both mode= and options=, which torch.compile takes only "
                         f"one of with compile={_backend_name(backend)!r}; drop one of them.")
    kwargs = {"dynamic": False, **options}
    if backend == "inductor":
        # Mode and options both become inductor options, so that CUDA graphs
        # can be turned off explicitly, whatever the global inductor config says.
        from torch._inductor import list_mode_options

        mode = kwargs.pop("mode", None)
        try:
            settings = dict(list_mode_options(mode or "default"))
        except RuntimeError as e:
            raise ValueError(f"{owner}: compile_options mode={mode!r}: {e}") from None
        given = kwargs.pop("options", None) or {}
        try:
            from torch._inductor import list_options
        except ImportError:  # (another torch: inductor checks them at the first call)
            known = set(given)
        else:
            known = set(list_options())
        unknown = sorted(set(given) - known - set(_TORCH_COMPILE_OPTIONS))
        if unknown:
            raise ValueError(f"{owner}: compile_options options={unknown} are not inductor options "
                             f"(torch._inductor.list_options() has them all).")
        settings.update(given)
        if settings.get("triton.cudagraphs"):
            raise ValueError(
                f"{owner}: compile='inductor' with {'mode=' + repr(mode) if mode else 'triton.cudagraphs=True'} "
                f"would capture inductor's own CUDA graphs inside this module's. Use cuda_graph=True on the "
                f"module (it captures the compiled branches in one graph) with mode='default' or "
                f"'max-autotune-no-cudagraphs'."
            )
        settings["triton.cudagraphs"] = False
        kwargs["options"] = settings
    return kwargs


def _entry(module: Callable[..., Any], label: str) -> Callable[..., Any]:
    r"""``module(*args, **kwargs)`` (a child, or a function) as a function whose code object is its own.

    Dynamo caches compiled code per code object (see the module docstring), so
    every child gets a cache, guards and a recompile limit of its own; the
    name shows up in dynamo's logs and errors.
    """

    def branch(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    code = branch.__code__.replace(co_name=label)
    if hasattr(code, "co_qualname"):  # Python 3.11+
        code = code.replace(co_qualname=label)
    return types.FunctionType(code, branch.__globals__, label, branch.__defaults__, branch.__closure__)


def _compiler_error(error: BaseException) -> bool:
    r"""Whether torch.compile raised ``error`` itself (inductor's InductorError too).

    It also wraps errors that tracing found in the child's code (a shape
    mismatch: TorchRuntimeError), which an eager run tells apart.
    """
    import torch._dynamo.exc  # (imported by any compilation before this runs)

    return isinstance(error, torch._dynamo.exc.TorchDynamoException)


# ------------------------------------------------------------------ TensorRT
_substitutes: dict[int, torch.cuda.Stream] = {}
_substitutes_lock = threading.Lock()


def _substitute_stream(device: torch.device) -> torch.cuda.Stream:
    r"""A side stream of ``device`` on which engines run instead of the legacy default stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _substitutes.get(index)
    if stream is None:
        with _substitutes_lock:
            stream = _substitutes.setdefault(index, torch.cuda.Stream(index))
    return stream


def _import_tensorrt() -> Any:
    try:
        import torch_tensorrt
    except ImportError as e:
        raise ImportError(
            f"compile='tensorrt' needs the torch_tensorrt package ({e}); install it with "
            f"pip install 'parallel_modules[tensorrt]' (it needs NVIDIA's TensorRT libraries)."
        ) from e
    return torch_tensorrt


class _Refused(RuntimeError):
    r"""A call the compiled form does not take (not a failure to compile: nothing falls back)."""


class _TensorRT:
    r"""One child as Torch-TensorRT engines: built per input signature, called off the default stream."""

    def __init__(self, module: nn.Module, options: dict[str, Any]) -> None:
        self.module = module
        self.options = options
        self.engines: OrderedDict[Hashable, Callable[..., Any]] = OrderedDict()
        self.lock = threading.Lock()
        # The parameters and buffers the engines were built with, and their versions.
        self.tensors: list[torch.Tensor] = []
        self.versions: list[tuple[int, int]] = []
        self.seen = -1

    def _drop_stale(self) -> None:
        # Engines hold the weights they were built with: a parameter or buffer
        # replaced below the child (seen by _watch), or written in place
        # (load_state_dict, a weight update: its version moves), makes them stale.
        if self.seen != _watch._changes:
            tensors = [*self.module.parameters(), *self.module.buffers()]
            if len(tensors) != len(self.tensors) or any(a is not b for a, b in zip(tensors, self.tensors)):
                self.engines.clear()
            self.tensors, self.seen = tensors, _watch._changes
        # (Each tensor's address too: ``p.data = new`` keeps the parameter and its version.)
        versions = [(t._version, t.data_ptr()) for t in self.tensors]
        if versions != self.versions:
            self.engines.clear()
            self.versions = versions

    def _build(self, args: tuple, kwargs: dict) -> Callable[..., Any]:
        torch_tensorrt = _import_tensorrt()
        settings = dict(self.options)
        settings.setdefault("ir", "dynamo")
        if not any(k in settings for k in ("inputs", "arg_inputs", "kwarg_inputs")):
            if kwargs:  # arg_inputs/kwarg_inputs: Torch-TensorRT >= 2.5
                settings["arg_inputs"], settings["kwarg_inputs"] = list(args), dict(kwargs)
            else:
                settings["inputs"] = list(args)
        return torch_tensorrt.compile(self.module, **settings)

    def engine(self, args: tuple, kwargs: dict) -> Callable[..., Any]:
        r"""The engine for this call's signature, built from its inputs the first time."""
        # Engines built from example tensors have static shapes: one per
        # signature, unless the options describe the inputs themselves.
        key = None if any(k in self.options for k in ("inputs", "arg_inputs")) else _signature(args, kwargs, False)
        with self.lock:  # (two threads' first calls build one engine)
            self._drop_stale()
            engine = self.engines.get(key)
            if engine is None:
                engine = self.engines[key] = self._build(args, kwargs)
                while len(self.engines) > _MAX_ENGINES:
                    self.engines.popitem(last=False)
        return engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _import_tensorrt()
        if self.module.training:
            raise _Refused("TensorRT engines are built for inference and record no autograd history, but "
                           "the module is in training mode. Call .eval() on the model (and run it under "
                           "torch.no_grad() or torch.inference_mode()).")
        device = _input_device(args, kwargs)
        if device is None or device.type != "cuda":
            raise _Refused(f"TensorRT engines run on CUDA devices; the input is "
                           f"{'on ' + str(device) if device is not None else 'not a tensor'}.")
        engine = self.engine(args, kwargs)
        caller = torch.cuda.current_stream(device)
        if caller != torch.cuda.default_stream(device):
            return engine(*args, **kwargs)
        # The legacy default stream: TensorRT would synchronise around it. Run
        # on a side stream forked from it and join back, as a side branch.
        side = _substitute_stream(device)
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            out = engine(*args, **kwargs)
        caller.wait_stream(side)
        # Outputs were allocated on ``side`` and are used on ``caller``.
        _record_on(out, caller)
        return out


# -------------------------------------------------------------- one child
# The device types whose autocast a failure to compile is remembered under (see _Child._key).
_AUTOCAST_DEVICES = ("cuda", "cpu")


class _Child:
    r"""The callable run for one child: its compiled form, built at the first call."""

    __slots__ = ("compiler", "module", "index", "name", "fn", "failed", "reason", "hooks", "failed_tree")

    def __init__(self, compiler: "_Compiler", module: nn.Module, index: int, name: str) -> None:
        # A proxy: the compiler holds its children, and a strong reference back would make every
        # module with compile= a reference cycle after its first call, its parameters freed only
        # by the cyclic collector, not at del. (A child runs only as its compiler's, which is alive.)
        self.compiler = weakref.proxy(compiler)
        self.module = module
        self.index = index
        self.name = name
        self.fn: Callable[..., Any] | None = None
        # The input signatures the compiler failed on, and its message: run eagerly
        # (compile_fallback=True) or refused at once, without compiling again.
        self.failed: OrderedDict[Hashable, str] = OrderedDict()
        self.reason = ""  # the compiler's latest failure, in a line: see _Compiler.fallen_back
        self.hooks: _Hooks | None = None  # the hooks the compiled form was traced with
        # The child's submodules and parameters when it last failed to compile: once one is
        # replaced or added (the layer the backend refused, swapped for another), the failures
        # are the old child's, and every signature is compiled again.
        self.failed_tree: _watch._Tree | None = None

    def _key(self, args: tuple, kwargs: dict) -> Hashable:
        r"""What a failure to compile is remembered by: the input signature, and the autocast in force
        (a backend may fail on the lower precision's graph only, and compile the other)."""
        return (_signature(args, kwargs, self.module.training),
                *[(d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tree = self.failed_tree
        if self.failed and tree is not None and not tree.same(self.module):
            self.failed.clear()
            self.reason, self.failed_tree = "", None
        if self.failed:
            message = self.failed.get(self._key(args, kwargs))
            if message is not None:
                if self.compiler.fallback:
                    return self.module(*args, **kwargs)
                raise RuntimeError(message)
        if self.fn is not None and self.hooks is not None and self.hooks.added():
            # Dynamo does not guard on hooks registered after tracing (torch.compile's
            # own behaviour): a hook registered below the child since would never run.
            self.fn = None
        state = None
        try:
            fn = self.fn
            if fn is None:
                with self.compiler._lock:  # two threads' first calls build one compiled form
                    fn = self.fn
                    if fn is None:
                        self.hooks = _Hooks(self.module)
                        fn = self.fn = self.compiler._build(self)
                        # The first call compiles, and may fail after part of the child ran
                        # (code before a graph break): its buffers are put back before the
                        # child runs eagerly (see _failed).
                        state = [(b, b.detach().clone()) for b in self.module.buffers()]
            return fn(*args, **kwargs)
        except _Refused as e:
            raise RuntimeError(f"{self._label()} cannot run with compile='tensorrt': {e}") from None
        except Exception as e:
            if self.compiler.backend != "tensorrt" and not _compiler_error(e):
                # Raised by the child's own code as its compiled form ran: the child's
                # error, as eager would raise it (and it must not run a second time).
                raise
            return self._failed(e, args, kwargs, state)

    def _label(self) -> str:
        compiler = self.compiler
        return f"{compiler.owner}: {compiler.kind} {self.name!r} (index {self.index}, {type(self.module).__name__})"

    def _failed(self, error: Exception, args: tuple, kwargs: dict, state: list | None) -> Any:
        # A backend's own failure is the compiler's. Other errors compilers report as
        # their own may be in the user's code (a shape mismatch found while tracing):
        # the child run eagerly tells which. (Either may come after part of the child
        # ran, before a graph break: the first call's buffer updates are put back; a
        # later call's, and other side effects of that part, are not, and run again
        # eagerly -- a limit of running a child partly compiled.)
        _put_back(state)
        compiler = self.compiler
        out = _NOT_RUN
        if not _backend_failed(error):
            # Without the fallback this call raises all the same: the eager run only tells whose
            # failure it is, and leaves the buffers as they were (as later calls of the signature,
            # refused at once, and a backend's failure do).
            kept = None if compiler.fallback else [(b, b.detach().clone()) for b in self.module.buffers()]
            try:
                out = self.module(*args, **kwargs)
            except Exception as eager_error:
                # The child fails without the compiler too: that is the error to see.
                raise eager_error from None
            _put_back(kept)
        message = (
            f"{self._label()} failed to compile with compile={_backend_name(compiler.backend)!r}:\n"
            f"  {_summary(error)}\n"
        )
        if not compiler.fallback:
            message += ("Run eagerly, the " + compiler.kind + " works on these inputs, so the compiler failed"
                        if out is not _NOT_RUN else "The backend failed") + (
                ": pass compile_fallback=True to run such inputs eagerly with a warning, or compile=None.")
        key = self._key(args, kwargs)
        self.failed_tree = _watch._Tree(self.module)
        self.failed[key] = message
        # (A backend's failure wraps what it raised, whose message is the one to read.)
        cause = getattr(error, "inner_exception", None) or error
        self.reason = f"{type(cause).__name__}: {_first_line(cause)}"
        while len(self.failed) > _MAX_ENGINES:
            self.failed.popitem(last=False)
        if not compiler.fallback:
            raise RuntimeError(message) from error
        if len(self.failed) == 1:  # (once per child)
            warnings.warn(message + f"compile_fallback=True: this {compiler.kind} runs eagerly on inputs like "
                                    f"these from now on.", UserWarning, stacklevel=2)
        return self.module(*args, **kwargs) if out is _NOT_RUN else out


_NOT_RUN: Any = object()


class _Hooks:
    r"""The hooks of a child's modules (and the global ones) when its compiled form was traced.

    :meth:`added` costs one comparison until a hook handle is made anywhere in
    the process; then the hook dicts are compared with their copies, as lists
    (in C: 4 us for the 368 dicts of a 92-module child on the development
    machine, where a set difference per dict took 81 us -- and forked training
    calls make a handle every call, for the backward join).
    """

    __slots__ = ("module", "handles", "changes", "dicts", "copies")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.handles = getattr(_Handle, "next_id", None)
        self.changes = _watch._changes
        self.dicts = _hook_dicts(module) + list(_GLOBAL_HOOKS)
        self.copies = [d.copy() for d in self.dicts]

    def added(self) -> bool:
        handles = getattr(_Handle, "next_id", None)
        if handles == self.handles:
            return False
        if _watch._changes != self.changes:
            # Modules registered somewhere since (``branch[0] = nn.Linear(...)``): the hook
            # dicts of those below the child are watched too, or a hook registered on one
            # would never run. One that already holds hooks may have been traced with them
            # (dynamo recompiles on the new module) or not: compiled anew.
            current = _hook_dicts(self.module) + list(_GLOBAL_HOOKS)
            old = {id(d): c for d, c in zip(self.dicts, self.copies)}
            if any(d for d in current if id(d) not in old):
                return True
            self.dicts, self.copies = current, [old[id(d)] if id(d) in old else d.copy() for d in current]
            self.changes = _watch._changes
        try:
            same = self.dicts == self.copies
        except Exception:  # (a hook object whose ``==`` raises)
            same = False
        if not same:
            if any(d.keys() - c.keys() for d, c in zip(self.dicts, self.copies)):
                return True
            self.copies = [d.copy() for d in self.dicts]  # (removed: dynamo sees removals)
        self.handles = handles  # (a hook registered elsewhere)
        return False


def _backend_failed(error: BaseException) -> bool:
    r"""Whether ``error`` is a compile backend's own failure (not the child's code, as tracing found it)."""
    import torch._dynamo.exc

    failed = getattr(torch._dynamo.exc, "BackendCompilerFailed", ())
    return isinstance(error, failed) or isinstance(error, RuntimeError) and type(error).__name__ == "InductorError"


def _summary(error: BaseException) -> str:
    lines = f"{type(error).__name__}: {error}".strip().splitlines()
    text = "\n  ".join(line for line in lines[:_MESSAGE_LINES])
    return text + ("\n  ..." if len(lines) > _MESSAGE_LINES else "")


# --------------------------------------------------------------- compiler
class _Compiler:
    r"""The compiled forms of one module's children, built lazily, never in its state dict.

    Args:
        owner: the module's class name, for messages.
        kind: ``"branch"`` or ``"stage"``, for messages.
        backend: ``"tensorrt"``, or a :func:`torch.compile` backend (a
            registered name such as ``"inductor"``, or a callable).
        options: keyword arguments of :func:`torch.compile` (``mode``,
            ``dynamic``, ``fullgraph``, ``options``, ...), or of
            ``torch_tensorrt.compile`` for ``"tensorrt"``.
        fallback: warn once and run a child eagerly when it fails to compile.
    """

    def __init__(self, owner: str, kind: str, backend: Backend, options: Mapping[str, Any] | None,
                 fallback: bool) -> None:
        if not (isinstance(backend, str) or callable(backend)):
            raise TypeError(f"{owner}: compile must be None, a backend name such as 'inductor' or 'tensorrt', "
                            f"or a torch.compile backend callable; got {type(backend).__name__} ({backend!r}).")
        if isinstance(backend, str) and backend != "tensorrt":
            names = torch.compiler.list_backends(exclude_tags=())
            if backend not in names:
                raise ValueError(f"{owner}: unknown compile backend {backend!r}; expected 'tensorrt' or one of "
                                 f"torch.compiler.list_backends(): {sorted(names)}, or a backend callable.")
        self.owner = owner
        self.kind = kind
        self.backend = backend
        self.options = dict(options or {})
        self.fallback = fallback
        self._kwargs = None if backend == "tensorrt" else _torch_compile_kwargs(owner, backend, self.options)
        self._init_cache()

    def _init_cache(self) -> None:
        self._children: tuple[int, ...] = ()  # the ids of the children _calls were built for
        self._calls: list[_Child] = []
        self._whole: Callable[..., Any] | None = None
        # Why the owner could not be compiled (or captured) as one program, once it failed:
        # not tried again (each try costs a compilation) until the compiled code is dropped.
        self.whole_failure: str | None = None
        self._lock = threading.Lock()

    @property
    def compiles_whole(self) -> bool:
        r"""Whether the owner is also captured compiled as a whole (``_WHOLE``): torch.compile backends, until that fails."""
        return self.backend != "tensorrt" and self.whole_failure is None

    def settings(self) -> dict[str, Any]:
        r"""The constructor arguments that recreate this compiler (slicing keeps them)."""
        return {"compile": self.backend, "compile_options": dict(self.options) or None,
                "compile_fallback": self.fallback}

    def extra_repr(self) -> str:
        text = f"compile={_backend_name(self.backend)!r}"
        if self.options:
            text += f", compile_options={self.options!r}"
        if self.fallback:
            text += ", compile_fallback=True"
        return text

    def calls(self, modules: Mapping[str, nn.Module]) -> list[Any]:
        r"""The callable to run for each child: its compiled form; the child itself while tracing."""
        if _is_tracing():
            # A compiler tracing the whole model compiles the children itself.
            return list(modules.values())
        # By identity: ``==`` would call a module's own ``__eq__`` (equal to a new layer like
        # it), and run the old one. (The ids stay unique: the children of _calls hold them.)
        children = tuple(map(id, modules.values()))
        if children != self._children:
            with self._lock:
                if children != self._children:
                    # Children added, replaced or removed: keep what the others compiled.
                    old = {id(c.module): c for c in self._calls}
                    calls = []
                    for i, (name, module) in enumerate(modules.items()):
                        child = old.pop(id(module), None)  # (a module given twice gets two)
                        if child is None or child.module is not module:
                            child = _Child(self, module, i, name)
                        child.index, child.name = i, name
                        calls.append(child)
                    self._calls, self._children = calls, children
        return self._calls

    def fallen_back(self, modules: Mapping[str, nn.Module]) -> dict[str, str]:
        r"""For ``explain()``: the children of ``modules`` that run eagerly on the input signatures they
        failed to compile for (``compile_fallback=True``; otherwise such calls raise), and why.

        Only those still there and unchanged: a child replaced since its failure, or one with a layer
        replaced or added below it, is compiled anew at the next call.
        """
        if not self.fallback:
            return {}
        return {c.name: f"runs eagerly on {len(c.failed)} input signature(s) it failed to compile for "
                        f"({c.reason})" for c in list(self._calls)
                if c.failed and modules.get(c.name) is c.module
                and (c.failed_tree is None or c.failed_tree.same(c.module))}

    def clear(self) -> None:
        r"""Drop every compiled child (parameters moved or cast): the next call compiles anew."""
        with self._lock:
            self._calls, self._children, self._whole, self.whole_failure = [], (), None, None

    def whole(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        r"""``forward`` (a bound method of the owner) compiled as one program (the ``_WHOLE`` variant).

        The compiler traces the owner as it traces any model that contains it:
        children one after another, no stream operation (``_is_tracing``). The
        owner is an argument of the compiled function, not held by it, so the
        compiled code keeps no reference cycle through the module.
        """
        assert self.backend != "tensorrt", "Torch-TensorRT engines are built per child only"
        compiled = self._whole
        if compiled is None:
            label = re.sub(r"\W", "_", f"{self.owner}_whole")
            compiled = self._whole = torch.compile(_entry(forward.__func__, label), backend=self.backend,
                                                   **self._compile_kwargs())
        owner = forward.__self__
        return lambda *args, **kwargs: compiled(owner, *args, **kwargs)

    def _build(self, child: _Child) -> Callable[..., Any]:
        if self.backend == "tensorrt":
            return _TensorRT(child.module, self.options)
        label = re.sub(r"\W", "_", f"{self.owner}_{self.kind}_{child.name}")
        return torch.compile(_entry(child.module, label), backend=self.backend, **self._compile_kwargs())

    def _compile_kwargs(self) -> dict[str, Any]:
        r"""The keyword arguments of one :func:`torch.compile` call: ``options`` a dict of its own.

        torch.compile pops ``guard_filter_fn`` out of the dict it is given, so a shared
        dict (for backends other than inductor, the user's own) would hand it to the
        first child compiled only.
        """
        kwargs = dict(self._kwargs)
        if isinstance(kwargs.get("options"), dict):
            kwargs["options"] = dict(kwargs["options"])
        return kwargs

    def __getstate__(self) -> dict:
        # Compiled code belongs to this process and to these very modules.
        state = self.__dict__.copy()
        for k in ("_children", "_calls", "_whole", "whole_failure", "_lock"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_cache()

    def __deepcopy__(self, memo: dict) -> "_Compiler":
        # The backend is shared, as slicing a block shares it: a callable backend may
        # hold what cannot be copied (a lock) or should not be (a cache of engines).
        clone = _Compiler.__new__(_Compiler)
        memo[id(self)] = clone
        state = self.__getstate__()
        backend = state.pop("backend")
        clone.__setstate__({**copy.deepcopy(state, memo), "backend": backend})
        return clone
