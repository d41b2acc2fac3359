"""What the kernels run on: the interpreter flag, device facts, and direct launches of compiled kernels.

Everything here is cached per process or per device, because the launch path reads it on every call.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

try:  # the class triton.jit returns when TRITON_INTERPRET=1 was set at import time
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - very old triton
    InterpretedFunction = ()

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton < 3.4: the portable forward keeps plain loads
    TensorDescriptor = None


@triton.jit
def _probe(x):
    tl.store(x, 0)


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


@functools.lru_cache(maxsize=None)
def compute_capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_properties(device).name


def run_compiled(compiled, grid: int, device: torch.device, args: tuple) -> None:
    """Launch a compiled kernel on the current stream; ``args`` are all its parameters in order.

    This skips the JIT's per-call work (binding arguments, computing their specialisation and
    hashing the cache key): the caller has already chosen the compiled kernel.
    """
    stream = torch._C._cuda_getCurrentRawStream(device.index)  # what Triton's own launch asks for
    enter_hook, exit_hook = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
    metadata = compiled.launch_metadata((grid, 1, 1), stream, *args) if enter_hook is not None else None
    compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, metadata,
                 enter_hook, exit_hook, *args)


