r"""The ``Linear`` layers of a fused group: product, bias and activation as one Triton kernel for all members.

A fused group of small MLP branches replayed in a CUDA graph is bound by how
many kernels lie on its path, not by their arithmetic: on the H200 machine
each costs 2-4 us of the replay whatever it computes. Eight branches of
four ``Linear(256, 256)`` + ``GELU`` on a batch of 8 take, per layer, a
cuBLAS batched product, a GELU and (shared by the layers) a copy of the
biases into the products' outputs: 9 kernels and about 23 us, where one
branch alone takes 8 kernels and 20 us (``addmm`` adds its bias in cuBLAS's
epilogue). PyTorch has no batched product with a bias and an activation in
its epilogue; inductor's Triton templates have one, but their fp32 products
(TF32 off) were slower than cuBLAS's at these shapes. Eagerly, each launch
costs the host more than the GPU's work: one launch per layer where cuBLAS
takes two is what counts there.

The kernel here is written for the shape at hand -- few rows -- and computes
``y[n] = act(x[n] @ w[n].T + b[n])`` for every member ``n`` at once: each
program takes a tile of ``BLOCK_N`` outputs of one member for all rows,
loads the whole ``[BLOCK_M, BLOCK_K]`` input and ``[BLOCK_K, BLOCK_N]``
weight tiles (one round trip to memory per ``BLOCK_K`` of the reduction),
multiplies with CUDA-core FMAs and sums in float32, whatever the dtype. The
grid spreads members times output tiles over the SMs. One kernel per layer:
mlp8's replay takes 4 kernels and 16-17 us, below the single branch's 20 us
(``tools/exp_triton_linear.py``); 12 us where each layer after the first is
launched while the one before runs (``chained``, see :func:`linear`). It
reads and writes any strides, so it takes the shared input of a group's
first layer as it lies (member stride 0) and writes a ``cat`` join's layout
directly.

Only where it is known to win: on a CUDA device whose Triton compiles it,
for inference (no autograd: there is no backward), on rows few enough that
the products are latency-bound (see :func:`supported`); eagerly, only for a
layer with an activation after it, and only where launches after the first
go straight to the compiled kernel (see :func:`_bind`: through
``kernel[grid]`` a launch costs the host far more than cuBLAS's two). The
first launch of each shape compiles it (for a graphed module, during its
warm-up, before any capture); if that fails -- no compiler, an old Triton --
the process falls back to cuBLAS for good and :func:`unavailable` says why.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any, Callable

import torch
from torch import nn

__all__: list[str] = []

# Activations the kernel applies in its epilogue, by code. nn.GELU's exact form is the
# error function's; its tanh form and SiLU are written with sigmoid, which every Triton has.
_NONE, _GELU, _RELU, _GELU_TANH, _SILU = 0, 1, 2, 3, 4

# Rows above this make the product worth tensor cores and cuBLAS's tiling; the
# kernel's tiles hold every row of a program's outputs.
_MAX_ROWS = 16
# The reduction is unrolled in chunks of at most this many; the tile of partial
# products, [BLOCK_M, BLOCK_K, BLOCK_N], is held in registers.
_MAX_BLOCK_K = 256
_TILE = 16384  # elements of that tile: 128 per thread at 4 warps
_MAX_FEATURES = 4096
_MAX_ELEMENTS = 1 << 31  # of a member stack: the kernel's offsets are 32-bit


def activation(m: nn.Module | None) -> int | None:
    r"""The epilogue code of activation module ``m``, or ``None`` when the kernel has none for it."""
    t = type(m)
    if t is nn.GELU:
        return {"none": _GELU, "tanh": _GELU_TANH}.get(m.approximate)
    if t is nn.ReLU:
        return _RELU
    if t is nn.SiLU:
        return _SILU
    return None


_failure: str | None = None  # why the kernel cannot run in this process, once known
# Each specialization launched outside a capture, by its key (see :func:`linear`), with the
# compiled kernel's launcher bound to it (``None`` where ``_direct`` is off). A first launch
# compiles and loads the kernel, which would invalidate a CUDA graph capture underway; later
# ones go straight to the compiled kernel's C launcher (see :func:`_bind`).
_launchers: dict[tuple, Callable[..., bool] | None] = {}
_MAX_LAUNCHERS = 4096  # (a process that launches more distinct shapes starts the table anew)
_direct = True  # whether launchers are bound (off for good once one is refused, see _bind)
_NO_CONTEXT = contextlib.nullcontext()


def unavailable() -> str | None:
    r"""Why the kernel is not used in this process (``None``: it is, where it applies)."""
    if _kernel() is None:
        return "Triton is not installed"
    return _failure


def supported(rows: int, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device) -> bool:
    r"""Whether layers of this shape take the kernel (see the module docstring)."""
    return (device.type == "cuda" and torch.version.hip is None and dtype in (torch.float32, torch.float16,
                                                                              torch.bfloat16)
            and 1 <= rows <= _MAX_ROWS and in_features <= _MAX_FEATURES and out_features <= _MAX_FEATURES
            and unavailable() is None)


@functools.cache
def _kernel() -> Any:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # (a Triton without them: never called, see _pdl)
        gdc_launch_dependents = gdc_wait = None

    @triton.jit
    def linear_act(x_ptr, w_ptr, b_ptr, y_ptr, M, K, OUT,
                   sxn, sxm, sxk, swn, swo, swk, sbn, syn, sym, syo,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   WAIT: tl.constexpr, TRIGGER: tl.constexpr):
        pid_o = tl.program_id(0)
        n = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        ro = pid_o * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_base = x_ptr + n * sxn + rm[:, None] * sxm
        w_base = w_ptr + n * swn + ro[None, :] * swo
        # The weights' first chunk and the bias first: a chained launch loads them
        # while the kernel before it still runs (see ``chained`` in :func:`linear`).
        w = tl.load(w_base + rk[:, None] * swk, mask=(rk[:, None] < K) & (ro[None, :] < OUT), other=0.0)
        if HAS_BIAS:
            bias = tl.load(b_ptr + n * sbn + ro, mask=ro < OUT, other=0.0).to(tl.float32)
        if WAIT:
            gdc_wait()  # the kernel before has ended, its writes visible: ``x`` may be read, ``y`` written
        if TRIGGER:
            gdc_launch_dependents()  # a chained kernel after this one may start loading its weights
        x = tl.load(x_base + rk[None, :] * sxk, mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        if DOT:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        else:
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(x_base + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(w_base + kk[:, None] * swk, mask=(kk[:, None] < K) & (ro[None, :] < OUT), other=0.0)
            if DOT:
                acc = tl.dot(x, w, acc, input_precision=PRECISION)
            else:
                acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        if HAS_BIAS:
            acc += bias[None, :]
        if ACT == 1:  # GELU: x * Phi(x)
            acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
        elif ACT == 2:
            acc = tl.maximum(acc, 0.0)
        elif ACT == 3:  # GELU, tanh form: 0.5 x (1 + tanh(u)) = x * sigmoid(2u)
            acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
        elif ACT == 4:
            acc = acc * tl.sigmoid(acc)
        tl.store(y_ptr + n * syn + rm[:, None] * sym + ro[None, :] * syo, acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (ro[None, :] < OUT))

    return linear_act


@functools.cache
def _pdl(index: int | None) -> bool:
    r"""Whether this Triton launches kernels on CUDA device ``index`` as programmatically dependent ones.

    Programmatic dependent launch (compute capability 9.0 and later): a kernel
    so launched may start once every program of the kernel before it on the
    stream has signalled (``griddepcontrol.launch_dependents``), and waits
    (``griddepcontrol.wait``) for that kernel to end and its writes to be
    visible only where it says. CUDA graph captures keep such launches as
    programmatic edges.
    """
    if index is None:  # (not a CUDA device: a CUDA tensor's device has an index)
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        gdc = importlib.import_module("triton.language.extra.cuda")
    except ImportError:
        return False
    return (hasattr(gdc, "gdc_wait") and hasattr(gdc, "gdc_launch_dependents")
            and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
            and torch.cuda.get_device_capability(index) >= (9, 0))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _blocks(rows: int, k: int, width: int, members: int, dot: bool | None, device: torch.device
            ) -> tuple[bool, int, int, int, int]:
    r"""``(dot, BLOCK_M, BLOCK_N, BLOCK_K, num_stages)`` for a layer; ``dot=None``: as measured best.

    Two ways to the same sums, in float32 either way. FMA: a program per 8 or
    so outputs of a member, its ``[rows, BLOCK_K, BLOCK_N]`` partial products
    summed along K -- many small programs, each one round trip to memory.
    ``tl.dot``: tensor cores (for float32, three TF32 products per
    product, ``tf32x3``, which keep float32's accuracy), wider tiles, the K
    loop pipelined. On the H200 machine, FMA wins while its programs fit in
    about two per SM (mlp8: 4 layers in 16.4-17.2 us, against 20.0 by
    ``tl.dot``), and ``tl.dot`` past that (mlp16: 20.4 against 26.1).
    """
    block_m = _pow2(rows)
    block_k = min(_pow2(k), _MAX_BLOCK_K)
    block_n = max(1, min(64, _TILE // (block_m * block_k), _pow2(width)))
    if dot is None:
        dot = members * -(-width // block_n) > 2 * _sm_count(device.index if device.index is not None
                                                              else torch.cuda.current_device())
    if dot:  # (tl.dot needs 16 or more along every dimension)
        return True, 16, min(32, max(16, _pow2(width))), min(64, max(16, _pow2(k))), 3
    return False, block_m, block_n, block_k, 1


def _bind(compiled: Any, grid: tuple[int, int], constants: tuple) -> Callable[..., bool] | None:
    r"""The compiled kernel's own launcher, bound to one specialization's grid and constants.

    ``kernel[grid](...)`` binds every argument, computes Triton's cache key and
    looks the kernel up before it launches: 60 us of host time a launch on the
    H200 machine, where the compiled kernel's launcher took 15 and cuBLAS's
    ``baddbmm`` and a ``gelu`` 39 (``tools/exp_triton_eager.py``) -- a price
    paid only outside CUDA graphs. The launcher returns ``False`` (nothing
    launched) while a launch hook is set (Triton's profilers read the metadata
    ``kernel[grid]`` prepares; see :func:`_hooked`); ``None`` here where this Triton lacks what it
    needs.
    """
    try:
        from triton import knobs

        runtime = knobs.runtime
        run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
        runtime.launch_enter_hook, runtime.launch_exit_hook  # noqa: B018 (both must exist)
        stream = torch._C._cuda_getCurrentRawStream  # (the device's current stream: a capture's, or the caller's)
    except (ImportError, AttributeError):
        return None
    if function is None:
        return None
    g0, g1 = grid

    def launch(index: int, tensors: tuple[torch.Tensor, ...], ints: tuple[int, ...]) -> bool:
        if _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
            return False
        # (Every argument, the constants too, as ``kernel[grid]`` passes them; no metadata, no hooks.)
        run(g0, g1, 1, stream(index), function, metadata, None, None, None, *tensors, *ints, *constants)
        return True

    launch.compiled = compiled  # (held with it: ``function`` lives in the module the compiled kernel loaded)
    return launch


def _hooked(hook: Any) -> bool:
    r"""Whether Triton's launch hook ``hook`` calls anything: ``None``, or a chain of none (newer Tritons'
    ``HookChain``), does not."""
    return hook is not None and getattr(hook, "calls", True) != []


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
           act: int = _NONE, dot: bool | None = None, chained: bool = False) -> torch.Tensor | None:
    r"""``out[n] = act(x[n] @ weight[n].T + bias[n])`` for every member ``n``; ``out``, or ``None`` if it cannot run.

    ``x``: ``[N, rows, in]``, any strides (a member stride of 0 for a shared
    input); ``weight``: ``[N, out, in]``; ``bias``: ``[N, out]``, each
    member's contiguous, or ``None``; ``out``: ``[N, rows, out]``, any strides
    that do not overlap; all on one device, in one dtype, none of them
    ``2**31`` elements or more (the kernel's offsets are 32-bit). ``dot``:
    force one way of computing it (see :func:`_blocks`). ``None`` (nothing
    written) when the kernel fails to compile or launch: it is then refused
    for the rest of the process, and the caller computes the layer another
    way. Also ``None`` during a CUDA graph capture for a specialization not
    launched before it (a module's own capture follows a warm-up that
    launches it; a capture of the user's own may not): compiling would
    invalidate the capture.

    ``chained``: nothing launched on the current stream since the last launch
    of this kernel that was not chained writes ``weight`` or ``bias`` (the
    layers of one fused call after its first, see ``_fusion._kernel_linear``).
    Where the device and Triton allow it (:func:`_pdl`), the kernel is then
    launched as a programmatically dependent one: it loads its weights and
    bias while the kernel before it still runs, and waits for that one to end
    before it reads ``x`` or writes ``out``. Each kernel signals its
    dependents as soon as it has waited, so in a chain of layers each one's
    launch and weight loads overlap the layer before (mlp8's four layers
    captured by hand replayed in 13.8 us of GPU time instead of 16.0, mlp16's
    in 18.2 instead of 20.7, on the H200 machine: ``tools/exp_triton_pdl.py``).
    The first layer is not chained: what came before it (an optimizer step
    writing the weights) has ended when it starts, and so before any later
    layer starts. (PTX promises a dependent kernel the writes of the kernel
    before only once it has waited, hence the invariant.)
    """
    global _failure, _direct
    if _failure is not None or (bias is not None and bias.stride(-1) != 1) or weight.numel() >= _MAX_ELEMENTS:
        return None
    b = bias if bias is not None else weight  # (any pointer: not read)
    ints = (x.shape[1], weight.shape[2], weight.shape[1], *x.stride(), *weight.stride(), b.stride(0), *out.stride())
    index = x.device.index
    trigger = _pdl(index)
    wait = chained and trigger
    # The launch's key: finer than the specialization Triton compiles for (its dtypes,
    # which pointers are 16-byte aligned, which integers are 1, multiples of 16 or past
    # 32 bits), so that a key launched before names a kernel compiled and loaded; and
    # everything the grid and the constants are made of (the members, which no stride
    # need show), which its launcher is bound to.
    key = (ints, weight.shape[0], act, bias is not None, dot, wait, trigger, index, x.dtype, weight.dtype, b.dtype,
           out.dtype, x.data_ptr() % 16 == 0, weight.data_ptr() % 16 == 0, b.data_ptr() % 16 == 0,
           out.data_ptr() % 16 == 0)
    launch = _launchers.get(key)
    # Triton launches on the current device's current stream: the capture's, or the caller's.
    other_device = x.is_cuda and index != torch.cuda.current_device()
    if launch is not None:
        try:
            with torch.cuda.device(index) if other_device else _NO_CONTEXT:
                if launch(index, (x, weight, b, out), ints):
                    return out
        except Exception:  # (arguments this Triton's launchers take otherwise: refused before launching)
            # Triton's own launch path from now on, which turns a failure into torch's layers.
            _direct = False
            _launchers.update(dict.fromkeys(_launchers))
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing and key not in _launchers:
        return None
    kernel = _kernel()
    n, width, k = weight.shape
    dot, block_m, block_n, block_k, stages = _blocks(ints[0], k, width, n, dot, x.device)
    constants = (bias is not None, act, dot, "tf32x3" if x.dtype == torch.float32 else "ieee", block_m, block_n,
                 block_k, wait, trigger)
    options = {"launch_pdl": True} if wait else {}  # (only where Triton knows the option: see _pdl)
    grid = (-(-width // block_n), n)
    try:
        with torch.cuda.device(index) if other_device else _NO_CONTEXT:
            compiled = kernel[grid](
                x, weight, b, out, *ints, *constants, num_warps=4, num_stages=stages, **options)
    except Exception as e:  # (a compiler's error, a missing C compiler, a launch refused)
        if capturing:
            raise  # a capture cannot go on as if nothing had been enqueued
        _failure = f"the Triton kernel failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return None
    if compiled is None:  # (a cache hook of Triton's took the launch over: nothing written)
        return None
    if not capturing and key not in _launchers:
        if len(_launchers) >= _MAX_LAUNCHERS:
            _launchers.clear()
        launch = _bind(compiled, grid, constants) if _direct else None
        _direct = _direct and launch is not None  # (another thread may have turned it off meanwhile)
        _launchers[key] = launch
    return out


def launches_fast() -> bool:
    r"""Whether launches after a specialization's first go straight to its compiled kernel (see :func:`_bind`)."""
    return _direct
