"""What reading the kernel settings costs a graphed call's key, getter by getter (dev tool).

``_graphs._kernel_settings()`` is read at every call of a graphed block (a setting changed
since capture must capture anew), so each getter in it is host time on the replay's path.
Prints the best of 7 rounds of 100,000 calls, in microseconds, for the whole key part, its
TF32 part, and each getter alone.
Usage: ``PYTHONPATH=. python3 tools/exp_kernel_settings.py``
"""
import timeit

import torch

from parallel_modules import _graphs


def best(f) -> float:
    return min(timeit.repeat(f, number=100_000, repeat=7)) / 100_000 * 1e6


print(f"torch {torch.__version__}")
print(f"_kernel_settings  {best(_graphs._kernel_settings):.3f} us")
print(f"_tf32             {best(_graphs._tf32):.3f} us")
for getter in _graphs._KERNEL_GETTERS:
    print(f"{getter.__name__:50s} {best(getter):.3f} us")
print(f"{'(an empty lambda)':50s} {best(lambda: None):.3f} us")
