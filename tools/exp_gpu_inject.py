r"""Fault injection over the CUDA paths of ``Parallel`` / ``ParallelSequential`` (dev tool, not shipped).

Run from the repository root, once, with a wall-clock budget:

    PYTHONPATH=. python3 tools/exp_gpu_inject.py [--budget 420] [--device cuda|cpu] [--only SUBSTR] [--nths 1,2,last]

DESIGN.md promises that after any error raised inside a call (a bad input, a failing branch, a
KeyboardInterrupt) the module still works and nothing is corrupted. This tool checks that promise
where the flags, locks and caches live: side-stream forks and joins and the pools' per-thread slots
(``_streams.py``), CUDA graph capture and replay (capture lock, hand-outs lock, static buffers, graph
cache: ``_graphs.py``), the autotuner's timing schedules (``_autotune.py``), the pipeline's lanes and
host-to-device copy stream (``pipeline.py``).

For each scenario (3 identical MLPs with streams=True fuse=False/True, streams="auto",
cuda_graph=True inference / training with an SGD step between calls / with fuse="auto",
ParallelSequential chunks=3 on a CUDA input, on a pinned host input, with cuda_graph=True):

1. record (``sys.setprofile``, also in the autograd engine's CUDA device thread, where backward runs)
   every function under parallel_modules/ that three calls of a fresh module pass through, and how often;
2. for each such function, its 1st / 2nd / last invocation, at entry or at return, raise
   KeyboardInterrupt or RuntimeError there (``sys.settrace``) during up to 3 calls of a fresh module;
3. after the fault, check: ``torch.cuda.synchronize()`` works, the current stream is still the
   caller's (calls run on a non-default caller stream), no capture is underway, state_dict and
   parameter identity unchanged, no module-level lock held and no thread-local flag of the library's
   left changed (scalars of every ``threading.local`` reachable from the package's globals), no lock
   reachable from the module held, then the next 3 calls (forward, backward, SGD step in training)
   equal a reference computed eagerly and sequentially on a deep copy -- bit for bit for unfused
   streams and graphs, ``torch.testing.assert_close`` (fp32 defaults) for fused and pipelines -- and
   warn no more than a clean call does.

Injection points run most valuable first: functions of _graphs.py, _streams.py, _autotune.py and
pipeline.py before the rest, 1st invocation before later ones, KeyboardInterrupt (which ``except
Exception`` cleanup misses) before RuntimeError. Each scenario is first calibrated by a clean run of the
same check (a scenario whose clean run is not bitwise equal falls back to assert_close, said so).

Output, flushed as it goes, so that a run cut short is still useful:

    FINDING [scenario] file:line function nth=N at=call|return Exception: check that failed
        <short traceback>
    HANG ...            a call blocked > 60 s (all threads' tracebacks follow on stderr; after 60 s
                        more the summary is printed and the process exits with status 3)
    MEMORY ...          torch.cuda.memory_allocated() after gc grew across a scenario's injections
    SKIP scenario (why) e.g. needs CUDA under --device cpu

(A finding about module-level state is also reported once more by the next injection point, whose
clean call resets what the previous one left: read the first of such a pair.)

and at the end (or when --budget seconds are spent) a summary: injection points run / fired / failed,
findings grouped by function, memory at the start and the end. Exit status 1 if anything was found.
TF32 is off. ``--device cpu`` runs the harness on the CPU fallback (CUDA-only scenarios skipped).
"""

from __future__ import annotations

import argparse
import collections
import copy
import faulthandler
import gc
import os
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable

import torch
from torch import nn

import parallel_modules
from parallel_modules import Parallel, ParallelSequential

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

PKG = os.path.dirname(os.path.abspath(parallel_modules.__file__)) + os.sep
HANG_S = 60.0
PRIORITY_FILES = ("_graphs.py", "_streams.py", "_autotune.py", "pipeline.py")


# ---------------------------------------------------------------------------------------- scenarios
def mlp(i: int = 16, o: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(i, 32), nn.GELU(), nn.Linear(32, o))


class RefCat(nn.Module):
    r"""The branches called one after another, joined by ``torch.cat(dim=1)``; state_dict keys as Parallel's."""

    def __init__(self, branches: list[nn.Module]) -> None:
        super().__init__()
        for i, b in enumerate(branches):
            self.add_module(str(i), b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x) for b in self.children()], 1)


class Scenario:
    def __init__(self, name: str, build: Callable[[], tuple[nn.Module, nn.Module]], training: bool,
                 exact: bool, cuda_only: bool = False, pinned: bool = False) -> None:
        self.name, self.build_cpu, self.training, self.exact = name, build, training, exact
        self.cuda_only, self.pinned = cuda_only, pinned

    def build(self, dev: torch.device) -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        model, ref = self.build_cpu()
        return model.to(dev).train(self.training), ref.to(dev).train(self.training)


def parallel(**kw: Any) -> Callable[[], tuple[nn.Module, nn.Module]]:
    def build() -> tuple[nn.Module, nn.Module]:
        bs = [mlp() for _ in range(3)]
        ref = RefCat(copy.deepcopy(bs))
        return Parallel(*bs, join="cat", **kw), ref
    return build


def pipe(nested: bool = False, **kw: Any) -> Callable[[], tuple[nn.Module, nn.Module]]:
    def build() -> tuple[nn.Module, nn.Module]:
        if nested:
            bs = [mlp(32, 16), mlp(32, 16)]
            mid, mid_ref = Parallel(*bs, streams=True), RefCat(copy.deepcopy(bs))
        else:
            mid = nn.Linear(32, 32)
            mid_ref = copy.deepcopy(mid)
        first, last = nn.Sequential(nn.Linear(16, 32), nn.GELU()), nn.Linear(32, 8)
        ref = nn.Sequential(copy.deepcopy(first), mid_ref, copy.deepcopy(last))
        return ParallelSequential(first, mid, last, chunks=3, **kw), ref
    return build


SCENARIOS = [
    Scenario("P(streams=True,fuse=False) train", parallel(streams=True, fuse=False), True, exact=True),
    Scenario("P(cuda_graph=True) eval", parallel(cuda_graph=True), False, exact=True),
    Scenario("P(cuda_graph=True) train+SGD", parallel(cuda_graph=True), True, exact=True),
    Scenario("PS(chunks=3) cuda input train", pipe(nested=True), True, exact=False),
    Scenario("PS(chunks=3) pinned host input eval", pipe(), False, exact=False, cuda_only=True, pinned=True),
    Scenario("P(streams=auto) train", parallel(streams="auto"), True, exact=True),
    Scenario("P(streams=True,fuse=True) train", parallel(streams=True, fuse=True), True, exact=False),
    Scenario("P(cuda_graph=True,fuse=auto) eval", parallel(cuda_graph=True, fuse="auto"), False, exact=False),
    Scenario("PS(chunks=3,cuda_graph=True) eval", pipe(cuda_graph=True), False, exact=False),
    Scenario("P(streams=True,fuse=False) eval", parallel(streams=True, fuse=False), False, exact=True),
]


# ---------------------------------------------------------------------------------------- helpers
DEV = torch.device("cpu")
CALLER: Any = None  # the caller's (non-default) CUDA stream every call runs on


class Finding(Exception):
    pass


def flatten(o: Any) -> list[torch.Tensor]:
    if isinstance(o, torch.Tensor):
        return [o]
    if isinstance(o, (tuple, list)):
        return [t for x in o for t in flatten(x)]
    if isinstance(o, dict):
        return [t for x in o.values() for t in flatten(x)]
    return []


def make_input(sc: Scenario) -> torch.Tensor:
    x = torch.randn(9, 16)  # 9 rows: 3 even micro-batches
    if sc.pinned:
        return x.pin_memory()
    return x.to(DEV)


def caller_stream() -> Any:
    return torch.cuda.stream(CALLER) if CALLER is not None else _Null()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def step(model: nn.Module, x: torch.Tensor, training: bool) -> tuple[Any, Any]:
    r"""One call (and, in training, a backward): (outputs cloned, (input grad, param grads) or None)."""
    x = x.detach().clone().requires_grad_(training) if not x.is_pinned() else x
    with torch.set_grad_enabled(training):
        out = model(x if x.device == DEV or x.is_pinned() else x.to(DEV))
    g = None
    if training:
        loss = sum((t.float() ** 2).sum() * (i + 1) for i, t in enumerate(flatten(out)))
        loss.backward()
        g = (x.grad, [p.grad for p in model.parameters()])
    return [t.detach().clone() for t in flatten(out)], g


def compare(a: Any, b: Any, exact: bool, what: str) -> None:
    if isinstance(b, (list, tuple)):
        if not isinstance(a, (list, tuple)) or len(a) != len(b):
            raise AssertionError(f"{what}: structure differs")
        for i, (x, y) in enumerate(zip(a, b)):
            compare(x, y, exact, f"{what}[{i}]")
        return
    if b is None or a is None:
        if a is not b:
            raise AssertionError(f"{what}: {type(a).__name__} vs reference {type(b).__name__}")
        return
    if exact:
        if a.shape != b.shape or not torch.equal(a, b):
            d = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
            raise AssertionError(f"{what}: not bitwise equal (max abs diff {d})")
    else:
        try:
            torch.testing.assert_close(a, b)
        except AssertionError as e:
            raise AssertionError(f"{what}: {str(e).splitlines()[0] if str(e) else e} "
                                 f"{' '.join(str(e).split())[:200]}") from None


# Not injected: ``_set_stream`` is how a ``finally`` gives the caller back its stream, and that call
# failing cannot be undone by anything (the first H200 run reported it as a stream left changed).
_NOT_INJECTED = frozenset({"_set_stream"})
# Thread-local flags cleared by design at the start of the next call, before anything reads them:
# ``_graph_state.forked`` (a fork's note for its join), which ``Parallel.forward`` resets.
_CLEARED_BY_THE_NEXT_CALL = frozenset({"forked"})


def _scalars(local: threading.local) -> dict[str, Any]:
    names = set(vars(local)) | {k for c in type(local).__mro__ if c not in (threading.local, object)
                                for k in vars(c) if not k.startswith("__")}
    out = {}
    for k in sorted(names - _CLEARED_BY_THE_NEXT_CALL):
        v = getattr(local, k, None)
        if callable(v) and not isinstance(v, (list, dict)):
            continue
        out[k] = v if isinstance(v, (int, float, bool, str, type(None))) else type(v).__name__
        if isinstance(v, (list, tuple, set, dict)) and not any(isinstance(x, torch.cuda.Event) for x in v):
            out[k] = f"{type(v).__name__}:{len(v)}" if k in ("entered", "stack", "active") else out[k]
    return out


def _is_lock(v: Any) -> bool:
    return type(v).__name__ in ("lock", "RLock", "_RLock") and hasattr(v, "acquire")


def _walk(roots: list[tuple[str, Any]], depth: int) -> list[tuple[str, Any]]:
    r"""(path, object) pairs reachable from ``roots`` through dicts, lists, tuples and instance dicts."""
    seen, out, frontier = set(), [], list(roots)
    for _ in range(depth):
        nxt = []
        for path, v in frontier:
            if id(v) in seen or isinstance(v, (torch.Tensor, type, str, bytes, int, float)) or callable(v) and \
                    not isinstance(v, nn.Module) and not _is_lock(v):
                continue
            seen.add(id(v))
            out.append((path, v))
            if isinstance(v, dict):
                nxt += [(f"{path}[{k!r}]", x) for k, x in list(v.items())[:64]]
            elif isinstance(v, (list, tuple, set)):
                nxt += [(f"{path}[{i}]", x) for i, x in enumerate(list(v)[:64])]
            elif isinstance(v, threading.local) or not hasattr(v, "__dict__"):
                continue
            elif type(v).__module__.startswith(("parallel_modules", "torch.nn")) or isinstance(v, nn.Module):
                nxt += [(f"{path}.{k}", x) for k, x in list(vars(v).items())]
        frontier = nxt
    return out


def global_state() -> dict[str, Any]:
    r"""Lock states and thread-local scalars of everything reachable from the package's module globals."""
    roots = [(name, mod) for name, mod in list(sys.modules.items()) if name.startswith("parallel_modules")]
    snap = {}
    for path, v in _walk([(n, vars(m)) for n, m in roots], 4):
        if isinstance(v, threading.local):
            snap[path] = _scalars(v)
        elif _is_lock(v):
            snap[path] = ("locked" if (v.locked() if hasattr(v, "locked") else not _try(v)) else "free")
    return snap


def _try(lock: Any) -> bool:
    if lock.acquire(blocking=False):
        lock.release()
        return True
    return False


def held_locks(model: nn.Module) -> list[str]:
    return [p for p, v in _walk([("model", model)], 6)
            if _is_lock(v) and (v.locked() if hasattr(v, "locked") else not _try(v))]


def in_autograd_thread(fn: Callable[[], None]) -> None:
    r"""Run ``fn`` in the autograd engine's CUDA device thread (keeps its Python thread state)."""
    if DEV.type != "cuda":
        return

    class Hop(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            fn()
            return g

    with torch.enable_grad():
        Hop.apply(torch.zeros(1, device=DEV, requires_grad=True)).sum().backward()


def set_trace(f: Any) -> None:
    sys.settrace(f)
    in_autograd_thread(lambda: sys.settrace(f))


def set_profile(f: Any) -> None:
    sys.setprofile(f)
    in_autograd_thread(lambda: sys.setprofile(f))


def short_tb(e: BaseException, limit: int = 6) -> str:
    lines = traceback.format_exception(type(e), e, e.__traceback__)
    body = [ln for ln in lines if ln.strip()][-limit * 2:]
    return "        " + "".join(body).rstrip().replace("\n", "\n        ")


def injected(e: BaseException) -> bool:
    seen = 0
    while e is not None and seen < 8:
        if "injected at" in str(e):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


# ---------------------------------------------------------------------------------------- hang detector
class Watchdog(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.deadline: float | None = None
        self.what = ""
        self.reported = False
        self.on_kill: Callable[[], None] = lambda: None

    def arm(self, what: str) -> None:
        self.what, self.deadline, self.reported = what, time.monotonic() + HANG_S, False

    def disarm(self) -> None:
        self.deadline = None

    def run(self) -> None:
        while True:
            time.sleep(1.0)
            d = self.deadline
            if d is None:
                continue
            now = time.monotonic()
            if now > d and not self.reported:
                self.reported = True
                print(f"HANG {self.what}: a call blocked > {HANG_S:.0f} s; tracebacks of all threads on stderr",
                      flush=True)
                faulthandler.dump_traceback(all_threads=True)
                sys.stderr.flush()
            if now > d + HANG_S:
                print("HANG not resolved after another 60 s: giving up", flush=True)
                self.on_kill()
                sys.stdout.flush()
                os._exit(3)


WATCH = Watchdog()


# ---------------------------------------------------------------------------------------- injection
def injecting(code: Any, nth: int, at: str, exc: type) -> tuple[Any, list[int]]:
    count = [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "return":
            sys.settrace(None)
            raise exc(f"injected at return of {code.co_name}")
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is code:
            count[0] += 1
            if count[0] == nth:
                if at == "call":
                    sys.settrace(None)
                    raise exc(f"injected at entry of {code.co_name}")
                return local
        return None
    return tracer, count


def record(sc: Scenario) -> collections.Counter:
    model, _ = sc.build(DEV)
    counts: collections.Counter = collections.Counter()

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PKG):
            counts[frame.f_code] += 1
    xs = [make_input(sc) for _ in range(3)]
    with caller_stream():
        set_profile(prof)
        try:
            for x in xs:
                step(model, x, sc.training)
                for p in model.parameters():
                    p.grad = None
        finally:
            set_profile(None)
    return counts


def run_one(sc: Scenario, exact: bool, code: Any, nth: int, at: str, exc: type, baseline_warn: int,
            where: str) -> tuple[str, BaseException | None] | None:
    r"""One injection; None where it did not fire, else ("ok" | what failed, the exception behind it)."""
    model, ref = sc.build(DEV)
    sd0 = {k: v.clone() for k, v in model.state_dict().items()}
    ids0 = [id(p) for p in model.parameters()]
    gs0 = global_state()
    torch.manual_seed(1)
    fired = code is None  # (calibration: no injection)
    fault: BaseException | None = None
    if code is not None:
        for i in range(3):
            x = make_input(sc)
            tracer, count = injecting(code, nth, at, exc)
            WATCH.arm(f"{where} (faulted call {i})")
            with caller_stream(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    set_trace(tracer)
                    step(model, x, sc.training)
                except BaseException as e:  # noqa: the injected one, or an error it caused
                    set_trace(None)
                    if not injected(e):
                        return f"the faulted call raised something else: {type(e).__name__}: {str(e)[:200]}", e
                    fired, fault = True, e
                    if CALLER is not None and torch.cuda.current_stream() != CALLER:
                        return (f"current stream after the error is {torch.cuda.current_stream()}, "
                                f"not the caller's {CALLER}"), e
                    break
                finally:
                    set_trace(None)
                    WATCH.disarm()
            nth -= count[0]
            if nth <= 0:
                break
        if not fired:
            return None
    problems: list[str] = []
    first_exc: BaseException | None = None
    if DEV.type == "cuda":
        try:
            torch.cuda.synchronize()
        except BaseException as e:
            return f"torch.cuda.synchronize() failed: {type(e).__name__}: {str(e)[:200]}", e
        if torch.cuda.is_current_stream_capturing():
            problems.append("a stream capture is still underway")
        with caller_stream():
            if torch.cuda.is_current_stream_capturing():
                problems.append("the caller's stream is still capturing")
    for p in list(model.parameters()) + list(ref.parameters()):
        p.grad = None
    sd = model.state_dict()
    if list(sd) != list(sd0) or any(not torch.equal(v, sd0[k]) for k, v in sd.items()):
        problems.append("state_dict changed")
    if [id(p) for p in model.parameters()] != ids0:
        problems.append("parameters are other objects")
    gs = global_state()
    if gs != gs0:
        diff = {k: (gs0.get(k), gs.get(k)) for k in set(gs) | set(gs0) if gs.get(k) != gs0.get(k)}
        problems.append(f"module-level state left changed: {str(diff)[:400]}")
    held = held_locks(model)
    if held:
        problems.append(f"locks held: {held}")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rkeys = ref.state_dict().keys()
    for i in range(3):
        x = make_input(sc)
        with warnings.catch_warnings(record=True) as w, caller_stream():
            warnings.simplefilter("always")
            WATCH.arm(f"{where} (check call {i})")
            try:
                out, g = step(model, x, sc.training)
            except BaseException as e:
                problems.append(f"check call {i} raised {type(e).__name__}: {str(e)[:200]}")
                first_exc = first_exc or e
                break
            finally:
                WATCH.disarm()
            rout, rg = step(ref, x.to(DEV), sc.training)
        try:
            compare(out, rout, exact, f"check call {i} output")
            if g is not None:
                compare(g[0], rg[0], False, f"check call {i} input grad")
                compare(g[1], rg[1], exact, f"check call {i} param grads")
        except AssertionError as e:
            problems.append(str(e))
            break
        if len(w) > baseline_warn:
            problems.append(f"check call {i} warned: {[str(m.message)[:150] for m in w]}")
        if g is not None:
            opt.step()
            ropt.step()
            opt.zero_grad()
            ropt.zero_grad()
            msd = model.state_dict()
            if list(msd) != list(rkeys):
                problems.append("state_dict keys differ from the reference's")
                break
            try:
                compare(list(msd.values()), list(ref.state_dict().values()), exact, f"after SGD step {i}")
            except AssertionError as e:
                problems.append(str(e))
                break
    if DEV.type == "cuda":
        try:
            torch.cuda.synchronize()
        except BaseException as e:
            problems.append(f"synchronize after the check calls failed: {e}")
            first_exc = first_exc or e
    return ("; ".join(problems) if problems else "ok"), first_exc or fault


def prio(code: Any, nth_rank: int, at: str, exc: type, pos: int, si: int) -> tuple:
    f = os.path.basename(code.co_filename)
    frank = 0 if f in PRIORITY_FILES else (1 if f in ("parallel.py", "_fusion.py") else 2)
    return (frank, nth_rank, 0 if exc is KeyboardInterrupt else 1, 0 if at == "call" else 1, pos, si)


def mem() -> int:
    gc.collect()
    if DEV.type != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def main() -> int:
    global DEV, CALLER
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=420.0, help="wall-clock seconds for the whole run")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default="", help="run the scenarios whose name contains this")
    ap.add_argument("--nths", default="1,2,last")
    args = ap.parse_args()
    t0 = time.monotonic()
    DEV = torch.device(args.device)
    if DEV.type == "cuda":
        torch.cuda.init()
        CALLER = torch.cuda.Stream()
    print(f"torch {torch.__version__} on {DEV} ({torch.cuda.get_device_name() if DEV.type == 'cuda' else 'CPU'}),"
          f" python {sys.version.split()[0]}, budget {args.budget:.0f} s", flush=True)
    findings: dict[str, list[str]] = collections.defaultdict(list)
    stats = collections.Counter()
    mem_track: dict[str, list[int]] = collections.defaultdict(list)

    def summary() -> None:
        el = time.monotonic() - t0
        print(f"\nSUMMARY after {el:.0f} s: {stats['run']} injection points run, {stats['fired']} fired, "
              f"{stats['failed']} failed, {stats['left']} left unrun (budget)", flush=True)
        for name, ms in mem_track.items():
            if len(ms) > 1:
                print(f"  memory {name}: {ms[0] / 2**20:.2f} -> {ms[-1] / 2**20:.2f} MiB over {len(ms)} samples")
        if DEV.type == "cuda":
            print(f"  memory_allocated: start {mem_start / 2**20:.2f} MiB, end {mem() / 2**20:.2f} MiB")
        for k, v in sorted(findings.items()):
            print(f"\n== {k}: {len(v)} failure(s)")
            for line in v[:6]:
                print("   ", line)
        print("RESULT:", "FINDINGS" if findings else "no findings", flush=True)
    WATCH.on_kill = summary
    WATCH.start()
    faulthandler.dump_traceback_later(args.budget + 3 * HANG_S + 60, exit=True)  # last resort
    mem_start = mem()

    # Calibrate and record each scenario.
    plans: list[tuple[tuple, int, Any, int, str, type]] = []
    active: dict[int, tuple[Scenario, bool, int]] = {}
    wanted = [int(n) if n != "last" else -1 for n in args.nths.split(",")]
    for si, sc in enumerate(SCENARIOS):
        if args.only and args.only not in sc.name:
            continue
        if sc.cuda_only and DEV.type != "cuda":
            print(f"SKIP {sc.name} (needs CUDA: a pinned host input to a CUDA module)", flush=True)
            continue
        if time.monotonic() - t0 > args.budget * 0.4:
            print(f"SKIP {sc.name} (budget spent on recording)", flush=True)
            continue
        try:
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                exact = sc.exact
                r, e = run_one(sc, exact, None, 0, "", RuntimeError, 10**9, f"[{sc.name}] calibration")
                if r != "ok" and exact:
                    print(f"NOTE {sc.name}: clean run not bitwise equal ({r[:200]}); compared with assert_close",
                          flush=True)
                    exact = False
                    r, e = run_one(sc, exact, None, 0, "", RuntimeError, 10**9, f"[{sc.name}] calibration")
                if r != "ok":
                    print(f"SKIP {sc.name} (clean run fails: {r[:300]})", flush=True)
                    if e is not None:
                        print(short_tb(e), flush=True)
                    continue
                # The most warnings one call of a fresh module gives (a first call may warn once):
                # the baseline a check call may not exceed.
                model, _ = sc.build(DEV)
                base_warn = 0
                for _ in range(4):
                    with warnings.catch_warnings(record=True) as w, caller_stream():
                        warnings.simplefilter("always")
                        step(model, make_input(sc), sc.training)
                    base_warn = max(base_warn, len(w))
            del model
            counts = record(sc)
        except BaseException as e:
            print(f"SKIP {sc.name} (setup failed: {type(e).__name__}: {str(e)[:200]})", flush=True)
            print(short_tb(e), flush=True)
            continue
        active[si] = (sc, exact, base_warn)
        for pos, (code, n) in enumerate(counts.items()):
            if code.co_name in _NOT_INJECTED:
                continue
            nths = sorted({n if k == -1 else k for k in wanted} & set(range(1, n + 1)))
            for rank, nth in enumerate(nths):
                for at in ("call", "return"):
                    for exc in (KeyboardInterrupt, RuntimeError):
                        plans.append((prio(code, rank, at, exc, pos, si), si, code, nth, at, exc))
        print(f"recorded {sc.name}: {len(counts)} functions, {len(plans)} points so far "
              f"({time.monotonic() - t0:.1f} s)", flush=True)
    plans.sort(key=lambda p: p[0])
    print(f"{len(plans)} injection points in priority order; running within the budget", flush=True)

    slowest = 0.0
    for k, (_, si, code, nth, at, exc) in enumerate(plans):
        if time.monotonic() - t0 + max(slowest, 1.0) + 5 > args.budget:
            stats["left"] = len(plans) - k
            print(f"BUDGET spent: stopping with {len(plans) - k} points left", flush=True)
            break
        sc, exact, base_warn = active[si]
        fn = f"{os.path.relpath(code.co_filename, PKG)}:{code.co_firstlineno} {code.co_name}"
        where = f"[{sc.name}] {fn} nth={nth} at={at} {exc.__name__}"
        t1 = time.monotonic()
        try:
            res = run_one(sc, exact, code, nth, at, exc, base_warn, where)
        except BaseException as e:  # an error of the harness's own calls (reference, optimizer)
            res = (f"harness error {type(e).__name__}: {str(e)[:200]}", e)
        finally:
            set_trace(None)
        slowest = max(slowest, time.monotonic() - t1)
        stats["run"] += 1
        if res is not None:
            stats["fired"] += 1
            r, e = res
            if r != "ok":
                stats["failed"] += 1
                findings[fn].append(f"[{sc.name}] nth={nth} at={at} {exc.__name__}: {r[:300]}")
                print(f"FINDING {where}: {r[:600]}", flush=True)
                if e is not None:
                    print(short_tb(e), flush=True)
        if stats["run"] % 8 == 0 or k == len(plans) - 1:
            mem_track[sc.name].append(mem())
        if stats["run"] % 50 == 0:
            print(f"... {stats['run']} run, {stats['fired']} fired, {stats['failed']} failed "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
    for name, ms in mem_track.items():
        half = ms[len(ms) // 2:]
        if len(ms) >= 4 and ms[-1] - ms[0] > 4 * 2**20 and half[-1] > half[0]:
            findings["memory"].append(f"{name}: {ms[0] / 2**20:.2f} -> {ms[-1] / 2**20:.2f} MiB")
            print(f"MEMORY {name}: memory_allocated grew {ms[0] / 2**20:.2f} -> {ms[-1] / 2**20:.2f} MiB "
                  f"across injections (samples {[round(m / 2**20, 2) for m in ms][:12]})", flush=True)
    faulthandler.cancel_dump_traceback_later()
    summary()
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
