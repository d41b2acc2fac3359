"""What the kernels run on: the interpreter flag, device facts, and direct launches of compiled kernels.

Everything here is cached per process or per device, because the launch path reads it on every call.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from .compat import InterpretedFunction, TensorDescriptor, active_launch_hooks  # noqa: F401


@triton.jit
def _probe(x):
    tl.store(x, 0)


class KernelBuildError(RuntimeError):
    """A kernel failed to compile for this call; the dispatcher falls back to another backend."""


# Triton decides at decoration time, from TRITON_INTERPRET, whether kernels run interpreted.
INTERPRETED = isinstance(_probe, InterpretedFunction)

_NO_GUARD = contextlib.nullcontext()


def device_guard(tensor: torch.Tensor):
    """Triton launches on the current device: switch only when the tensor lives elsewhere."""
    if tensor.device.type == "cuda" and tensor.device.index != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return _NO_GUARD


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """Programs of a persistent launch: one per multiprocessor (a few under the interpreter)."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def shared_memory_per_block(device) -> int:
    """Shared memory a kernel may ask for on a CUDA ``device`` (0 for any other device, or None)."""
    if device is None or torch.device(device).type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


@functools.lru_cache(maxsize=None)
def compute_capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def compiles_to_ptx(device: torch.device) -> bool:
    """Whether Triton builds this device's kernels through NVIDIA's PTX, so that they may hold inline
    PTX: not under the interpreter, and not on ROCm (whose torch calls AMD GPUs "cuda" too)."""
    return not INTERPRETED and device.type == "cuda" and torch.version.hip is None


@functools.lru_cache(maxsize=None)
def chains_launches(device: torch.device) -> bool:
    """Whether the kernels of one call launch as a chain (programmatic dependent launch, sm_90 on):
    each may start while the one before it finishes, and waits for it before touching memory
    (:func:`fmha.backends.triton.common.chain_launches`)."""
    return compiles_to_ptx(device) and compute_capability(device) >= (9, 0)


@functools.lru_cache(maxsize=None)
def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_properties(device).name


class HostDescriptor:
    """What Triton's launcher reads from a host tensor descriptor to encode its tensor map (tensor,
    shape, strides, padding), built per call without TensorDescriptor's checks: for launches of a
    compiled kernel whose first call, through the JIT, passed Triton's own descriptor."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base: torch.Tensor, shape: list[int], strides: list[int]):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, "zero"


# Programs a CUDA grid's second and third axes hold (the first holds 2^31 - 1).
GRID_AXIS_LIMIT = 65535


def spans_wide_offsets(*tensors) -> bool:
    """Whether, in one of ``tensors`` (None skipped), a row lies 2^31 elements or more from the first:
    the kernels' 32-bit ``row * stride`` would wrap, so they build with WIDE_OFFSETS (64-bit row
    strides). Rows are those of one (batch, head): dims 2-3 of a (B, H, S, D) tensor or a (B, H, Sq,
    Sk) mask, dims 0 and 2 of a packed (tokens, H, D) one (batch and head offsets are 64-bit)."""
    for tensor in tensors:
        if tensor is not None:
            shape, strides = tensor.shape, tensor.stride()
            if len(shape) == 3:
                span = (shape[0] - 1) * abs(strides[0]) + (shape[2] - 1) * abs(strides[2])
            else:
                span = (shape[-2] - 1) * abs(strides[-2]) + (shape[-1] - 1) * abs(strides[-1])
            if span >= 2 ** 31 and 0 not in shape:
                return True
    return False


def run_compiled(compiled, grid: int | tuple[int, int, int], device: torch.device, args: tuple) -> None:
    """Launch a compiled kernel on the current stream; ``args`` are all its parameters in order.

    This skips the JIT's per-call work (binding arguments, computing their specialisation and
    hashing the cache key): the caller has already chosen the compiled kernel.
    """
    grid = grid if grid.__class__ is tuple else (grid, 1, 1)
    stream = torch._C._cuda_getCurrentRawStream(device.index)  # what Triton's own launch asks for
    hooks = active_launch_hooks()
    if hooks is None:
        enter_hook = exit_hook = metadata = None
    else:  # a profiler listens: give it what Triton's own launch gives
        enter_hook, exit_hook = hooks
        metadata = compiled.launch_metadata(grid, stream, *args)
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, metadata, enter_hook, exit_hook, *args)


class StreamCounters:
    """Zeroed int32 counters that a kernel leaves zeroed again when it ends (arrival counts, tile
    counters), so that a call needs no fill kernel: one buffer per stream, since launches on one
    stream run one after another while launches on two streams could share a buffer at once.

    A call made while a CUDA graph is being captured gets a buffer of its own, zeroed inside the
    graph (memory allocated during a capture belongs to the graph, and a replay on another stream
    must not share a stream's buffer with its eager calls). With ``graph_buffer``, captures take
    one buffer made now instead, and the graph needs no fill: graphs of one launcher replayed at
    the same time on two streams would then mix their counts.
    """

    __slots__ = ("size", "buffers", "graph_buffer")

    def __init__(self, size: int, device: torch.device, graph_buffer: bool = False):
        self.size, self.buffers, self.graph_buffer = size, {}, None
        if graph_buffer and device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            self.graph_buffer = torch.zeros(size, dtype=torch.int32, device=device)

    def get(self, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":  # the interpreter: one stream
            stream = None
        else:
            if torch.cuda.is_current_stream_capturing():
                if self.graph_buffer is not None:
                    return self.graph_buffer
                return torch.zeros(self.size, dtype=torch.int32, device=device)
            stream = torch._C._cuda_getCurrentRawStream(device.index)
        buffer = self.buffers.get(stream)
        if buffer is None:
            buffer = self.buffers[stream] = torch.zeros(self.size, dtype=torch.int32, device=device)
        return buffer


class CachedLaunch:
    """A ``triton.jit`` kernel with fixed constexprs and launch options, launched through its
    compiled handle once the JIT has built it for a specialisation: the JIT binds and specialises
    every argument on every call, host time that a short call waits for.

    The handle is kept per specialisation key, every argument as given with each tensor replaced
    by its pointer's alignment (what Triton specialises a pointer on; integers are themselves in
    the key). Under the interpreter every call goes through the JIT.
    """

    __slots__ = ("kernel", "constants", "options", "compiled")

    def __init__(self, kernel, constants: dict, **options):
        assert kernel.arg_names[-len(constants):] == list(constants), "constexprs must close the signature"
        self.kernel, self.constants, self.options = kernel, constants, options
        self.compiled = {}

    def __call__(self, grid: tuple, device: torch.device, *args) -> None:
        key = tuple(arg.data_ptr() & 15 if isinstance(arg, torch.Tensor) else arg for arg in args)
        compiled = self.compiled.get(key)
        if compiled is not None:
            run_compiled(compiled, (*grid, 1, 1)[:3], device, (*args, *self.constants.values()))
            return
        compiled = self.kernel[grid](*args, **self.constants, **self.options)
        if not INTERPRETED:
            self.compiled[key] = compiled


def interpreter_upcasts(dtype: torch.dtype) -> bool:
    """bfloat16 ``tl.dot`` is wrong under Triton's interpreter: such calls compute in float32."""
    return INTERPRETED and dtype == torch.bfloat16


class Float32Forward:
    """Runs a float32 forward on bfloat16 tensors (the interpreter's bfloat16 path) and stores in bfloat16."""

    __slots__ = ("inner",)

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, q, k, v, out, lse, *seqlens, **scores):
        out32 = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        compiled = self.inner(q.float(), k.float(), v.float(), out32, lse, *seqlens, **scores)
        out.copy_(out32)
        return compiled
