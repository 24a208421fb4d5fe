"""The README's usage example runs as printed (on CUDA) and, moved to the CPU, on any machine; the public
classes' docstrings document what they offer and their examples run."""

from __future__ import annotations

import doctest
import inspect
import re
import typing
from pathlib import Path

import pytest
import torch
from torch import nn

import parallel_modules

README = Path(__file__).resolve().parent.parent / "README.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md has no python example"
    return blocks[0]


def _check(scope: dict, device: str) -> None:
    block, y, z = scope["block"], scope["y"], scope["z"]
    assert y.shape == (8, 160, 35, 35) and y.device.type == device
    x = torch.randn(8, 192, 35, 35, device=device)
    with torch.no_grad():
        expected = torch.cat([branch(x) for branch in block], 1)
        torch.testing.assert_close(block(x), expected)
    assert z.shape == (8, 160, 35, 35) and z.device.type == device


def test_readme_example_on_the_cpu():
    code = _example().replace('device="cuda"', 'device="cpu"').replace(".cuda()", ".cpu()")
    code = code.replace(".pin_memory()", "")
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    _check(scope, "cpu")


@pytest.mark.cuda
def test_readme_example_as_printed():
    scope: dict = {}
    exec(compile(_example(), str(README), "exec"), scope)
    _check(scope, "cuda")


# The public classes' docstrings: every public method documented, every constructor
# parameter under "Args:", and the ``>>>`` examples run as printed (moved to the CPU).


def _public_classes() -> list[type]:
    return [getattr(parallel_modules, name) for name in parallel_modules.__all__]


@pytest.mark.parametrize("cls", _public_classes(), ids=lambda c: c.__name__)
def test_public_methods_have_docstrings(cls):
    # (nn.Module's own hooks for subclasses, ``extra_repr``, keep nn.Module's docstring;
    # methods of a container base, ``nn.Sequential.append``, are overridden to behave
    # otherwise and need their own.)
    undocumented = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        doc = inspect.getdoc(getattr(cls, name)) if hasattr(nn.Module, name) else function.__doc__
        if callable(function) and not (doc or "").strip():
            undocumented.append(name)
    assert not undocumented, f"{cls.__name__}: public methods without a docstring: {undocumented}"


@pytest.mark.parametrize("cls", _public_classes(), ids=lambda c: c.__name__)
def test_constructor_parameters_are_documented(cls):
    args = cls.__doc__.split("Args:", 1)[1]
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if name == "self":
            continue
        shown = f"*{name}" if parameter.kind is parameter.VAR_POSITIONAL else name
        assert re.search(rf"^\s+{re.escape(shown)}:", args, re.M), f"{cls.__name__}: {shown} is not under Args:"


@pytest.mark.parametrize("cls", _public_classes(), ids=lambda c: c.__name__)
def test_method_parameters_are_documented(cls):
    # As PyTorch's own (nn.ModuleList.insert, nn.Module.train): a public method that takes
    # arguments lists each under "Args:". (``forward`` is documented by the class, as torch's
    # layers document theirs.)
    missing = []
    for name, value in vars(cls).items():
        if name.startswith("_") or name == "forward" or not inspect.isfunction(value):
            continue
        parameters = [p for p in inspect.signature(value).parameters if p != "self"]
        args = (value.__doc__ or "").split("Args:", 1)[1] if "Args:" in (value.__doc__ or "") else ""
        missing += [f"{name}({p})" for p in parameters if not re.search(rf"^\s+{re.escape(p)}:", args, re.M)]
    assert not missing, f"{cls.__name__}: parameters not under Args: {missing}"


def _run_examples(cls: type, name: str, doc: str) -> None:
    # As the README's example: what needs a GPU is moved to the CPU, the rest runs as printed.
    text = doc.replace(".cuda()", "").replace(".pin_memory()", "")
    test = doctest.DocTestParser().get_doctest(text, {"torch": torch, "nn": nn, cls.__name__: cls}, name, None, 0)
    assert test.examples, f"{name}: no >>> example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report: list[str] = []
    runner.run(test, out=report.append)
    assert not runner.failures, "".join(report)


@pytest.mark.parametrize("cls", _public_classes(), ids=lambda c: c.__name__)
def test_constructor_defaults_are_documented_last(cls):
    # As PyTorch's docstrings: each keyword's entry under Args: ends with "Default: <its default>",
    # the value the signature gives, so a default changed in one place cannot go unnoticed.
    args = cls.__doc__.split("Args:", 1)[1].split("\n\n", 1)[0]
    entries = dict(re.findall(r"^ {8}(\w+): (.*?)(?=^ {8}\w+:|\Z)", args, re.M | re.S))
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if parameter.kind is not parameter.KEYWORD_ONLY:
            continue
        text = " ".join(entries[name].split())
        default = re.escape(f"Default: ``{parameter.default!r}``.".replace("'", '"'))
        assert re.search(rf"{default}$", text), f"{cls.__name__}: {name} does not end with {default}: {text[-80:]!r}"


@pytest.mark.parametrize("cls", _public_classes(), ids=lambda c: c.__name__)
def test_docstring_examples_on_the_cpu(cls):
    _run_examples(cls, cls.__name__, cls.__doc__)


def _method_examples() -> list[tuple[type, str]]:
    return [(cls, name) for cls in _public_classes() for name, value in vars(cls).items()
            if not name.startswith("_") and ">>>" in (getattr(value, "__doc__", None) or "")]


def test_explain_has_an_example():
    # (So that the test below, parametrized by what it finds, cannot pass by finding nothing.)
    assert (parallel_modules.Parallel, "explain") in _method_examples()


@pytest.mark.parametrize(("cls", "name"), _method_examples(), ids=lambda v: getattr(v, "__name__", v))
def test_method_docstring_examples_on_the_cpu(cls, name):
    _run_examples(cls, f"{cls.__name__}.{name}", vars(cls)[name].__doc__)


@pytest.mark.parametrize("cls", _public_classes(), ids=lambda c: c.__name__)
def test_docstrings_warn_about_graph_capture_rules(cls):
    # DESIGN.md's style: ``.. warning::`` for the rules code captured with ``cuda_graph=True`` must
    # follow. Both classes take ``cuda_graph``, so both warn, as torch/cuda/graphs.py's do.
    warnings = re.findall(r"^\s*\.\. warning::\n(.*?)(?=^\s*\.\. |\Z)", cls.__doc__, re.M | re.S)
    assert any("cuda_graph=True" in w for w in warnings), (
        f"{cls.__name__}: no '.. warning::' about cuda_graph=True's capture rules in the docstring")


@pytest.mark.parametrize("cls", _public_classes(), ids=lambda c: c.__name__)
def test_public_signatures_are_fully_typed(cls):
    # DESIGN.md: full type hints on public signatures, shipped with py.typed (PEP 561), without
    # which type checkers ignore the hints.
    package = Path(parallel_modules.__file__).parent
    assert (package / "py.typed").is_file()
    assert re.search(r"^parallel_modules\s*=\s*py\.typed$", (package.parent / "setup.cfg").read_text(), re.M)
    untyped = []
    for name, value in vars(cls).items():
        if name.startswith("_") and name != "__init__" and not (name.startswith("__") and hasattr(nn.Sequential, name)):
            continue
        function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if not inspect.isfunction(function):
            continue
        signature = inspect.signature(function)
        missing = [p for p in signature.parameters if p not in ("self", "cls")
                   and signature.parameters[p].annotation is inspect.Parameter.empty]
        if missing or signature.return_annotation is inspect.Signature.empty:
            untyped.append(f"{name}({', '.join(missing)}{'; no return type' if signature.return_annotation is inspect.Signature.empty else ''})")
    assert not untyped, f"{cls.__name__}: public methods without full type hints: {untyped}"


@pytest.mark.parametrize("cls", _public_classes(), ids=lambda c: c.__name__)
def test_public_signatures_show_in_help_as_written(cls):
    # Under ``from __future__ import annotations`` every hint is kept as its source text: a hint
    # quoted as well (``-> "Parallel"``) is kept as the string "'Parallel'", which help() and
    # pydoc print quoted twice (``-> "'Parallel'"``).
    quoted = []
    for name, value in vars(cls).items():
        function = getattr(value, "__func__", value)
        for overload in (function, *typing.get_overloads(function)) if inspect.isfunction(function) else ():
            quoted += [f"{name}: {arg} -> {hint}" for arg, hint in overload.__annotations__.items()
                       if isinstance(hint, str) and hint[:1] in "'\""]
    assert not quoted, f"{cls.__name__}: hints quoted twice: {quoted}"


@pytest.mark.parametrize(("cls", "method"), [(cls, method) for cls in _public_classes()
                                             for method in ("__getitem__", "pop")],
                         ids=lambda v: getattr(v, "__name__", v))
def test_indexing_is_typed_by_its_argument(cls, method):
    # As nn.ModuleList's: an int gives a module, a slice a block of the same class, so that
    # ``block[0].weight`` and ``block[1:].explain()`` type-check without casts.
    overloads = typing.get_overloads(getattr(cls, method))
    hints = sorted((next(iter(h.values())).__name__, h["return"]) for h in map(typing.get_type_hints, overloads))
    assert hints == [("int", nn.Module), ("slice", cls)], f"{cls.__name__}.{method}: {hints}"


@pytest.mark.parametrize(("cls", "base"), [(parallel_modules.Parallel, nn.ModuleList),
                                           (parallel_modules.ParallelSequential, nn.Sequential)],
                         ids=lambda v: v.__name__)
def test_container_methods_take_their_arguments_by_torchs_names(cls, base):
    # The README promises the methods "work as on nn.ModuleList" (nn.Sequential for pipelines),
    # so a call that names its argument, ``block.pop(key=0)``, must work on both. Before (a CPU
    # check of the docs): Parallel.pop took ``idx`` where nn.ModuleList.pop takes ``key``.
    renamed = []
    for name in ("append", "extend", "insert", "pop", "__getitem__", "__setitem__", "__delitem__"):
        ours, theirs = (list(inspect.signature(getattr(c, name)).parameters) for c in (cls, base))
        if ours != theirs:
            renamed.append(f"{name}{tuple(ours)} where {base.__name__} has {tuple(theirs)}")
    assert not renamed, f"{cls.__name__}: {renamed}"
