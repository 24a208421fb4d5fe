"""Two-GPU benchmark of ``parallel_modules`` (dev tool, not shipped).

Usage::

    PYTHONPATH=. python3 tools/bench_multigpu.py OUT.json [--reps 15] [--steps 30]

Two figures, each variant timed interleaved with the others in one process, after
warm-up, as medians; a short table is printed last and everything is written to OUT.json.

1. **Placement** (one process, both GPUs): two branches, each 3 x ``Linear(8192, 8192)``
   in bf16, on a batch of 4096, joined with ``cat``. Both branches on cuda:0 (plain calls,
   and a ``Parallel``) against a ``Parallel`` with one branch per GPU; the input starts on
   cuda:0 and the joined output ends there, so the copies to cuda:1 and back are included.
   Timed with CUDA events on cuda:0's stream (which joins every stream the call uses),
   ``--group`` calls per sample after synchronizing both devices.
2. **DDP** (one process per GPU, NCCL): a training step (forward, backward with gradient
   all-reduce, SGD step) of stem -> branches -> head wrapped in
   ``DistributedDataParallel``, the branches called one after another in plain PyTorch,
   in a ``Parallel`` (``streams="auto"``) and in a ``Parallel(cuda_graph=True)``, for a
   launch-bound case (8 small MLPs) and a compute-bound one (4 large matmul branches).
   Throughput in samples/s over both GPUs (rank 0's wall clock per step, synchronized).

NVLink multicast stays off in every process (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1`` unless already set).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from parallel_modules import Parallel
from parallel_modules._cases import SequentialBranches, mlp_branches

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEADLINE_S = 120


def _log(msg: str) -> None:
    print(f"[bench_multigpu] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------- placement
def _branch(device: torch.device, width: int, depth: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width, device=device, dtype=torch.bfloat16) for _ in range(depth)])


def _sync_all() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def _timed(fns: dict[str, Callable[[], Any]], reps: int, group: int) -> dict[str, list[float]]:
    r"""Milliseconds per call: ``reps`` samples of ``group`` calls per variant, variants interleaved."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        for name, fn in fns.items():
            _sync_all()
            start.record()
            for _ in range(group):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / group)
    return samples


def bench_placement(reps: int, group: int, width: int = 8192, depth: int = 3, batch: int = 4096) -> dict[str, Any]:
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    torch.manual_seed(0)
    a, b = _branch(d0, width, depth), _branch(d0, width, depth)
    b_remote = copy.deepcopy(b).to(d1)
    x = torch.randn(batch, width, device=d0, dtype=torch.bfloat16)
    variants: dict[str, Callable[[], Any]] = {}
    one_plain = SequentialBranches([a, b], "cat")
    one_parallel = Parallel(a, b, join="cat", streams=True)
    two_one_by_one = Parallel(a, b_remote, join="cat", streams=False)
    two_parallel = Parallel(a, b_remote, join="cat", streams=True)
    with torch.no_grad():
        variants = {
            "1 GPU, plain calls": lambda: one_plain(x),
            "1 GPU, Parallel": lambda: one_parallel(x),
            "2 GPUs, one after the other": lambda: two_one_by_one(x),
            "2 GPUs, Parallel": lambda: two_parallel(x),
        }
        expected = one_plain(x)
        checks = {k: bool(torch.equal(fn(), expected)) for k, fn in variants.items()}
        for fn in variants.values():  # warm-up: streams, cuBLAS handles, peer access
            for _ in range(3):
                fn()
        copy_ms = statistics.median(_timed({"copy": lambda: x.to(d1)}, reps, group)["copy"])
        samples = _timed(variants, reps, group)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    base = medians["1 GPU, plain calls"]
    result = {
        "shape": f"2 branches x {depth} x Linear({width}, {width}) bf16, batch {batch}, join cat",
        "peer_access": torch.cuda.can_device_access_peer(0, 1),
        "input_copy_ms": copy_ms,
        "variants": {k: {"median_ms": m, "iqr_ms": _iqr(samples[k]), "speedup_vs_1gpu_plain": base / m,
                         "bit_exact_vs_1gpu_plain": checks[k]} for k, m in medians.items()},
    }
    del a, b, b_remote, x, one_plain, one_parallel, two_one_by_one, two_parallel, variants, expected
    torch.cuda.empty_cache()
    return result


def _iqr(values: list[float]) -> float:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[2] - q[0]


# ------------------------------------------------------------------------- DDP
DDP_CASES = {
    # name: (branches, width, depth, batch per GPU, dtype)
    "8 small MLPs (4 x Linear(256)), fp32": (8, 256, 4, 64, torch.float32),
    "4 large branches (2 x Linear(4096)), bf16": (4, 4096, 2, 2048, torch.bfloat16),
}


class _Net(nn.Module):
    def __init__(self, block: nn.Module, width: int) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.block = block
        self.head = nn.Linear(width, 16)

    def forward(self, x):
        return self.head(self.block(torch.relu(self.stem(x))))


def _ddp_worker(rank: int, world: int, port: int, steps: int, rounds: int, out_dir: str) -> None:
    try:  # die with the parent, should `timeout` kill it (Linux)
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    except Exception:
        pass
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.backends.cuda.matmul.allow_tf32 = True
    results: dict[str, Any] = {}
    try:
        for case, (n, width, depth, batch, dtype) in DDP_CASES.items():
            torch.manual_seed(0)
            branches = mlp_branches(n, width, depth)
            blocks = {
                "plain calls": SequentialBranches(branches, "sum"),
                "Parallel": Parallel(*branches, join="sum"),
                "Parallel graph": Parallel(*branches, join="sum", cuda_graph=True),
            }
            torch.manual_seed(1)
            trunk = _Net(nn.Identity(), width)
            models, opts = {}, {}
            for name, block in blocks.items():
                net = copy.deepcopy(trunk)
                net.block = copy.deepcopy(block)
                net = net.to(device, dtype)
                models[name] = nn.parallel.DistributedDataParallel(net, device_ids=[rank])
                opts[name] = torch.optim.SGD(models[name].parameters(), lr=1e-3)
            gen = torch.Generator(device=device).manual_seed(rank)
            x = torch.randn(batch, width, device=device, dtype=dtype, generator=gen)

            def step(name: str) -> torch.Tensor:
                loss = models[name](x).float().square().mean()
                loss.backward()
                opts[name].step()
                opts[name].zero_grad(set_to_none=True)
                return loss.detach()

            first_loss = {name: step(name).item() for name in models}  # same weights, same data
            for name in models:  # warm-up: bucket rebuild, stream tuning, graph capture
                for _ in range(10):
                    step(name)
            samples: dict[str, list[float]] = {name: [] for name in models}
            for _ in range(rounds):
                for name in models:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        step(name)
                    torch.cuda.synchronize()
                    samples[name].append((time.perf_counter() - t0) / steps * 1e3)
            medians = {k: statistics.median(v) for k, v in samples.items()}
            base = medians["plain calls"]
            results[case] = {
                "batch_per_gpu": batch, "world": world,
                "first_step_loss": first_loss,
                "variants": {k: {"median_step_ms": m, "iqr_ms": _iqr(samples[k]),
                                 "samples_per_s": world * batch / (m / 1e3), "speedup_vs_plain": base / m}
                             for k, m in medians.items()},
            }
            del models, opts, blocks, branches, trunk
            torch.cuda.empty_cache()
        if rank == 0:
            Path(out_dir, "ddp.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_ddp(steps: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_ddp_worker, args=(2, _free_port(), steps, rounds, out_dir), nprocs=2,
                                 join=False, start_method="spawn")
        end = time.monotonic() + DEADLINE_S
        try:
            while not ctx.join(timeout=max(0.1, end - time.monotonic())):
                if time.monotonic() >= end:
                    raise TimeoutError(f"DDP benchmark processes still running after {DEADLINE_S} s")
        finally:
            for p in ctx.processes:  # only the processes started here
                if p.is_alive():
                    p.kill()
                    p.join(10)
        return json.loads(Path(out_dir, "ddp.json").read_text())


# ------------------------------------------------------------------------ main
def _environment() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else None,
        "env": {k: os.environ.get(k) for k in NCCL_ENV},
    }


def _table(data: dict[str, Any]) -> str:
    lines = []
    p = data.get("placement")
    if p:
        lines += [f"Placement: {p['shape']} (input copy {p['input_copy_ms']:.3f} ms, peer access "
                  f"{p['peer_access']})", f"  {'variant':32} {'median ms':>10} {'vs 1 GPU':>9}  exact"]
        for k, v in p["variants"].items():
            lines.append(f"  {k:32} {v['median_ms']:10.3f} {v['speedup_vs_1gpu_plain']:8.2f}x  "
                         f"{v['bit_exact_vs_1gpu_plain']}")
    for case, r in data.get("ddp", {}).items():
        lines += [f"DDP training step, 2 GPUs: {case}, batch {r['batch_per_gpu']}/GPU",
                  f"  {'variant':32} {'step ms':>10} {'samples/s':>11} {'vs plain':>9}"]
        for k, v in r["variants"].items():
            lines.append(f"  {k:32} {v['median_step_ms']:10.3f} {v['samples_per_s']:11.0f} "
                         f"{v['speedup_vs_plain']:8.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="where to write the results")
    parser.add_argument("--reps", type=int, default=15, help="placement samples per variant")
    parser.add_argument("--group", type=int, default=5, help="placement calls per sample")
    parser.add_argument("--steps", type=int, default=20, help="DDP training steps per sample")
    parser.add_argument("--rounds", type=int, default=7, help="DDP samples per variant")
    parser.add_argument("--skip-ddp", action="store_true")
    args = parser.parse_args(argv)
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print(f"needs 2 CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        return 1
    data: dict[str, Any] = {"environment": _environment()}
    t0 = time.perf_counter()
    _log("placement ...")
    data["placement"] = bench_placement(args.reps, args.group)
    Path(args.json).write_text(json.dumps(data, indent=1))
    if not args.skip_ddp:
        _log("DDP ...")
        data["ddp"] = bench_ddp(args.steps, args.rounds)
        Path(args.json).write_text(json.dumps(data, indent=1))
    data["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.json).write_text(json.dumps(data, indent=1))
    print(json.dumps(data["environment"]))
    print(_table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
