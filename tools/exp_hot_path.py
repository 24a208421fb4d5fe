"""Host time of each piece of a graphed call's Python path, one by one (dev tool, not shipped).

Usage: ``PYTHONPATH=. python3 tools/exp_hot_path.py [case ...]`` on the GPU machine (default mlp8).
Each figure: microseconds of host time per call of that piece alone, best of 5 runs of 2000 calls
(200 for the pieces that launch work, issued on a GPU kept busy by a spin kernel).
The module call minus ``_Graph.replay`` is what the checks before a replay cost; the rows below it
say which.
"""
import sys

import torch

from parallel_modules import Parallel
from parallel_modules._cases import CASES
from parallel_modules._graphs import _autograd_busy, _autocast_state, _kernel_settings, _launch, _tf32
from parallel_modules._inputs import _signature
from parallel_modules._streams import _capture_underway, _current_stream, _is_tracing
from parallel_modules._watch import _swapped
from _timing import events_us  # tools/ is the script's directory

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")

for name in sys.argv[1:] or ["mlp8"]:
    case = CASES[name]
    x = case.make_input(case.batches[0], dev, torch.float32)
    with torch.no_grad():
        for fuse in (True, False):
            m = Parallel(*case.branches(dev, torch.float32), cuda_graph=True, fuse=fuse).train(False)
            for _ in range(30):
                m(x)
            cache = m._graphs
            g = cache._hot[1]
            owner = cache._owner()
            calls = {
                "module call m(x)": lambda: m(x),
                "m.forward(x)": lambda: m.forward(x),
                "cache(m._forward, (x,), {})": lambda: cache(m._forward, (x,), {}),
                "_Graph.replay": lambda: g.replay([x], False),
                "_launch(reader or fwd)": lambda: _launch(g.reader if g.reader is not None else g.fwd),
                "_key": lambda: cache._key(owner, (x,), {}, ()),
                "_signature": lambda: _signature((x,), {}, False),
                "_kernel_settings": _kernel_settings,
                "_tf32": _tf32,
                "_swapped": lambda: _swapped(cache._slots, cache._slot_values, cache._scalars),
                "_autograd_busy": _autograd_busy,
                "_is_tracing": _is_tracing,
                "_capture_underway": _capture_underway,
                "_autocast_state": _autocast_state,
                "is_inference_mode_enabled": torch.is_inference_mode_enabled,
                "_current_stream": lambda: _current_stream(dev),
                "x.data_ptr()": x.data_ptr,
                "out.detach()": g.outputs[0].detach,
                "lending.held()": g.lending.held,
                "cache._owner()": cache._owner,
            }
            print(f"{name} fuse={fuse}: {len(cache._slots)} parameter/buffer dicts checked, "
                  f"{len(cache._moded)} moded modules, lent={g.lending.lent}, reader={g.reader is not None}")
            for label, fn in calls.items():
                launches = label in ("module call m(x)", "m.forward(x)", "cache(m._forward, (x,), {})",
                                     "_Graph.replay", "_launch(reader or fwd)")
                n = 200 if launches else 2000
                spin = int(400e-6 * n * 1.7e9) if launches else 0  # (the GPU never holds the host back)
                for _ in range(20):
                    fn()
                best = min(events_us(fn, n, spin)[1] for _ in range(5))
                print(f"  {label:<32}{best:7.2f} us")
