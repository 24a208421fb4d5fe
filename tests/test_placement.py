"""``Parallel`` with branches on different devices: what the CPU can check.

Running branches on several GPUs is tested in ``test_placement_cuda.py`` (two GPUs); here:
mixed device types are refused with a clear error, and the module's memory of where its
branches live is formed once and forgotten whenever the branches or their devices change.
"""

from __future__ import annotations

import copy
import pickle
from collections import OrderedDict

import pytest
import torch
from torch import nn

from parallel_modules import Parallel
from parallel_modules._placement import _UNPLACED
from tests._reference import assert_same


def test_cpu_and_meta_branches_refused_naming_both():
    p = Parallel(OrderedDict(host=nn.Linear(4, 4), nowhere=nn.Linear(4, 4, device="meta")))
    for _ in range(2):  # nothing is remembered from a refused call
        with pytest.raises(RuntimeError) as ei:
            p(torch.randn(2, 4))
        msg = str(ei.value)
        assert "Parallel" in msg and "'host'" in msg and "'nowhere'" in msg
        assert "cpu" in msg and "meta" in msg and "CUDA" in msg
    p[1] = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    assert_same(p(x), torch.cat([p[0](x), p[1](x)], 1))


def test_placement_is_looked_at_once_and_forgotten_on_change():
    p = Parallel(nn.Linear(4, 4), nn.Linear(4, 4))
    assert p._placement is _UNPLACED
    p(torch.randn(2, 4))
    assert p._placement is None  # one device: the single-device path, nothing more per call
    p.append(nn.Linear(4, 4))
    assert p._placement is _UNPLACED
    p(torch.randn(2, 4))
    p.to(torch.float64)
    assert p._placement is _UNPLACED


def test_unplaced_marker_survives_pickle_and_deepcopy():
    assert pickle.loads(pickle.dumps(_UNPLACED)) is _UNPLACED
    p = Parallel(nn.Linear(4, 4), nn.Linear(4, 4))
    p(torch.randn(2, 4))
    for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert q._placement is _UNPLACED
        x = torch.randn(3, 4)
        assert_same(q(x), torch.cat([q[0](x), q[1](x)], 1))
