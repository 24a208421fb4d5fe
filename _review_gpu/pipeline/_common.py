"""Shared bits of the pipeline GPU repros (run with cwd=repo root, PYTHONPATH=$PWD)."""
import sys

import torch

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
SLEEP = 2_000_000  # about 1 ms: long enough that a missing wait reads unfinished data


def need_cuda(name: str) -> None:
    if not torch.cuda.is_available():
        print(f"FAIL {name}: CUDA not available (run on a GPU)")
        sys.exit(0)


class Sleep(torch.nn.Module):
    def __init__(self, cycles: int = SLEEP) -> None:
        super().__init__()
        self.cycles = cycles

    def forward(self, x):
        torch.cuda._sleep(self.cycles)
        return x


def clean() -> str:
    """'' when the caller's stream and the library's stream pool are as before a call, else why not."""
    from parallel_modules._streams import _pool

    why = []
    if torch.cuda.current_stream() != torch.cuda.default_stream():
        why.append("current stream not restored")
    if torch.cuda.is_current_stream_capturing():
        why.append("capture left open")
    if _pool(torch.device("cuda")).offset != 0:
        why.append("pool offset not 0")
    return ", ".join(why)


def report(name: str, problems: list) -> None:
    print(f"FAIL {name}: " + "; ".join(problems) if problems else f"PASS {name}")
