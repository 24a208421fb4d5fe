r"""Declarative ``nn.Module`` combinators that run independent parts of a model
concurrently on one GPU: :class:`Parallel` (branches on one input) and
:class:`ParallelSequential` (stages pipelined over micro-batches)."""

from .parallel import Parallel
from .pipeline import ParallelSequential

__all__ = ["Parallel", "ParallelSequential"]
__version__ = "0.1.0"
