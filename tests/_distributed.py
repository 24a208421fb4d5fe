"""Data-parallel training of a model holding ``Parallel`` and ``ParallelSequential``.

Used by ``test_distributed.py`` (gloo, CPU) and ``test_distributed_cuda.py`` (NCCL, two
GPUs). :func:`run` starts ``world`` processes with ``torch.multiprocessing`` (spawn), which
meet on a free loopback port; each trains the same :class:`Net` for ``STEPS`` steps on its
share of a global batch, wrapped in ``DistributedDataParallel`` or ``fully_shard`` (FSDP2)
as a configuration says, and after every step compares its parameters with a reference
trained in the same process, without any wrapper, on the whole (concatenated) batch. Each
rank writes what it saw to ``rank<r>.json``; the tests assert on those files.

Everything is bounded in time: collectives time out (``init_process_group(timeout=...)``)
and :func:`run` kills the processes it started once its deadline passes, so a hang
fails the test instead of blocking CI.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import time
import traceback
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from parallel_modules import Parallel, ParallelSequential
from tests._helpers import sleep_in_backward

# NVLink multicast stays off in every process started here, as on the GPU machine (set
# there already; kept if a caller sets other values).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
STEPS = 4
IN, OUT = 16, 4
# GPU clock cycles slept in branch b's backward: ~25 ms on an H100/H200, far longer than
# the CPU needs to reach the gradient all-reduce.
SLEEP = 50_000_000


@dataclass
class Config:
    r"""One training run: the wrapper and its options, and what the model contains."""

    name: str
    # "ddp"; "fsdp2": fully_shard on the blocks and the model; "fsdp2-branches": on each branch
    # of the Parallel too; "none": no wrapper, so no gradient is averaged (a broken setup)
    wrapper: str = "ddp"
    ddp: dict = field(default_factory=dict)  # keyword arguments of DistributedDataParallel
    use_c: bool = True  # False: branch c's output is dropped, its parameters get no gradient
    hook: str = "none"  # in branch b, between its Linear and activation: "none", "sleep", "rogue"
    cuda_graph: bool = False
    streams: Any = "auto"
    # fuse=True: the pipeline's Parallel gets two identical branches, fused (on the CPU their
    # Linear layers train through the library's own backward: see _fusion._TrainedLinear)
    fuse: Any = False
    width: int = 32
    batch: int = 8  # per rank


# ---------------------------------------------------------------------- the model
# The streams branch b's sleeping backward ran on (hook="sleep").
_SLEPT_ON: list = []


class _RogueBackward(torch.autograd.Function):
    r"""A deliberately broken backward: the gradient is written on a stream nobody waits for.

    It returns zeros at once and fills in the true gradient later, after a sleep, on a
    stream of its own. Used to show that the comparison with the reference catches a
    gradient that is not complete when it is consumed.
    """

    stream: torch.cuda.Stream | None = None

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        out = torch.zeros_like(g)
        if _RogueBackward.stream is None:
            _RogueBackward.stream = torch.cuda.Stream()
        rogue = _RogueBackward.stream
        rogue.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(rogue):
            torch.cuda._sleep(SLEEP)
            out.copy_(g)
        out.record_stream(rogue)
        g.record_stream(rogue)
        return out


class _Hook(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x):
        if self.kind == "sleep":
            return sleep_in_backward(x, SLEEP, _SLEPT_ON)
        if self.kind == "rogue":
            return _RogueBackward.apply(x)
        return x


class _BranchB(nn.Module):
    def __init__(self, width: int, hook: str) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.hook = _Hook(hook)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.hook(self.lin(x)))


class Net(nn.Module):
    r"""stem -> Parallel(a, b, c) -> ParallelSequential(Parallel(d, e), f; 2 micro-batches) -> head."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        w = cfg.width
        self.use_c = cfg.use_c
        self.stem = nn.Sequential(nn.Linear(IN, w), nn.ReLU())
        self.block = Parallel(
            OrderedDict(a=nn.Sequential(nn.Linear(w, w), nn.Tanh()), b=_BranchB(w, cfg.hook), c=nn.Linear(w, w)),
            join="dict", streams=cfg.streams, cuda_graph=cfg.cuda_graph,
        )
        self.pipe = ParallelSequential(
            Parallel(nn.Sequential(nn.Linear(w, w // 2), nn.ReLU()) if cfg.fuse else nn.Linear(w, w // 2),
                     nn.Sequential(nn.Linear(w, w // 2), nn.ReLU()), join="cat", streams=cfg.streams, fuse=cfg.fuse),
            nn.Linear(w, 8),
            chunks=2, cuda_graph=cfg.cuda_graph,
        )
        self.head = nn.Linear(8, OUT)

    def forward(self, x):
        outs = self.block(self.stem(x))
        h = outs["a"] + outs["b"]
        if self.use_c:
            h = h + outs["c"]
        return self.head(self.pipe(h))


def reference_forward(net: Net, x: torch.Tensor) -> torch.Tensor:
    r"""``net`` written out without the library: branches called in order, the whole batch at once."""
    s = net.stem(x)
    blk = net.block
    h = blk.a(s) + blk.b.act(blk.b.lin(s))  # branch b without its test hook
    if net.use_c:
        h = h + blk.c(s)
    d, e = net.pipe[0]
    return net.head(net.pipe[1](torch.cat([d(h), e(h)], 1)))


# ------------------------------------------------------------------- one process
def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # a DTensor sharded by fully_shard
    return (full() if full is not None else t).detach()


def _wrap(model: Net, cfg: Config, device: torch.device) -> nn.Module:
    if cfg.wrapper == "none":
        return model
    if cfg.wrapper == "ddp":
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, **cfg.ddp
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if cfg.wrapper == "fsdp2-branches":
        # FSDP's hooks then run inside the branches, on their side streams.
        for branch in model.block:
            fully_shard(branch, mesh=mesh)
    fully_shard(model.block, mesh=mesh)
    fully_shard(model.pipe, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(cfg: Config, rank: int, world: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = Net(cfg).to(device)
    ref = copy.deepcopy(model)
    wrapped = _wrap(model, cfg, device)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    _SLEPT_ON.clear()
    diffs, scale, ranks_equal = [], 0.0, True
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 + step)
        X = torch.randn(world * cfg.batch, IN, generator=gen).to(device)
        Y = torch.randn(world * cfg.batch, OUT, generator=gen).to(device)
        mine = slice(rank * cfg.batch, (rank + 1) * cfg.batch)
        loss = nn.functional.mse_loss(wrapped(X[mine]), Y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = nn.functional.mse_loss(reference_forward(ref, X), Y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        params = [_full(p) for p in model.parameters()]
        diffs.append(max((p - r.detach()).abs().max().item() for p, r in zip(params, ref.parameters())))
        scale = max(scale, max(r.detach().abs().max().item() for r in ref.parameters()))
        # DDP keeps the replicas identical, bit for bit: compare with rank 0's.
        flat = torch.cat([p.flatten() for p in params])
        first = flat.clone()
        dist.broadcast(first, src=0)
        ranks_equal = ranks_equal and torch.equal(flat, first)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"diffs": diffs, "scale": scale, "ranks_equal": ranks_equal,
            "sleep_on_side_stream": [s != torch.cuda.default_stream(s.device) for s in _SLEPT_ON], "error": None}


def _die_with_parent() -> None:
    r"""Ask Linux to kill this process if the test process dies (``timeout`` kills only it)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass  # not Linux: run()'s deadline still applies while the test process lives


def _worker(rank: int, world: int, port: int, backend: str, configs: list[dict], out_dir: str,
            timeout_s: float) -> None:
    _die_with_parent()
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # two processes share the CI's two cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    results: dict[str, Any] = {}
    try:
        for raw in configs:
            cfg = Config(**raw)
            start = time.perf_counter()
            try:
                results[cfg.name] = _train(cfg, rank, world, device)
            except Exception:
                results[cfg.name] = {"error": traceback.format_exc()}
            results[cfg.name]["seconds"] = round(time.perf_counter() - start, 3)
            # Written after every configuration: a later hang keeps what was learnt.
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------ launcher
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def per_rank(results: list[dict], name: str) -> list[dict]:
    r"""Each rank's result for config ``name``, asserting that no rank raised."""
    per_rank = [r[name] for r in results]
    for rank, r in enumerate(per_rank):
        assert r["error"] is None, f"rank {rank}, {name}:\n{r['error']}"
    return per_rank


def run(configs: list[Config], backend: str, out_dir: str | Path, world: int = 2, deadline_s: float = 120.0,
        collective_timeout_s: float = 60.0) -> list[dict]:
    r"""Train every configuration in ``world`` fresh processes; each rank's results, by name.

    Raises ``TimeoutError`` if the processes are not done within ``deadline_s`` (they are
    killed), and ``torch.multiprocessing``'s exceptions if one of them dies.
    """
    for k, v in NCCL_ENV.items():  # inherited by the spawned processes
        os.environ.setdefault(k, v)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(
        _worker, args=(world, free_port(), backend, [asdict(c) for c in configs], str(out_dir), collective_timeout_s),
        nprocs=world, join=False, start_method="spawn",
    )
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=max(0.1, end - time.monotonic())):
            if time.monotonic() >= end:
                done = {}
                for r in range(world):
                    path = out_dir / f"rank{r}.json"
                    done[r] = sorted(json.loads(path.read_text())) if path.exists() else []
                raise TimeoutError(f"{backend} training processes still running after {deadline_s:.0f} s; "
                                   f"configurations finished per rank: {done}")
    finally:
        for p in ctx.processes:  # only the processes started here
            if p.is_alive():
                p.kill()
                p.join(10)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
