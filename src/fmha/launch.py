"""Python launchers: grid, strides and constexprs for each kernel.

They take tensors that :mod:`fmha.interface` has already checked (4-D, one dtype,
one device, Hq % Hkv == 0, non-empty) and an explicit tile config.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from .config import BackwardConfig, ForwardConfig, KernelFeatures, padded_head_dim
from .kernels.backward import backward_dkdv_kernel, backward_dq_kernel, backward_preprocess_kernel
from .kernels.forward import LOG2_E, attention_forward_kernel
from .naive import pv_kernel, scores_kernel, softmax_kernel

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton < 3.4: the forward keeps plain loads
    TensorDescriptor = None

try:  # the class triton.jit returns when TRITON_INTERPRET=1 was set at import time
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - very old triton
    InterpretedFunction = ()

INTERPRETED = isinstance(attention_forward_kernel, InterpretedFunction)

try:  # Gluon (Triton >= 3.5): the warp-specialised Hopper forward
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from .kernels.forward_hopper import attention_forward_hopper_kernel, register_budget
except ImportError:  # pragma: no cover - older triton: the portable kernel runs everywhere
    attention_forward_hopper_kernel = None


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products, like PyTorch's default matmul (no TF32).
    return "ieee" if dtype == torch.float32 else "tf32"


def tma_compatible(tensor: torch.Tensor) -> bool:
    """Whether a (B, H, S, D) tensor can be described to the bulk tensor copy engine.

    The base and every stride but the last (which must be 1) have to be 16-byte multiples and
    non-zero; a dimension of size 1 is never stepped, so its stride does not matter.
    """
    strides = tensor.stride()
    if strides[3] != 1 or tensor.data_ptr() % 16:
        return False
    return _strides_tma_compatible(tensor.shape, strides, tensor.element_size())


@functools.lru_cache(maxsize=1024)
def _strides_tma_compatible(shape: torch.Size, strides: tuple[int, ...], item: int) -> bool:
    return all(size == 1 or (stride > 0 and stride * item % 16 == 0) for size, stride in zip(shape[:3], strides[:3]))


def _descriptor_strides(tensor: torch.Tensor) -> list[int]:
    return _descriptor_strides_of(tensor.shape, tensor.stride())


@functools.lru_cache(maxsize=1024)
def _descriptor_strides_of(shape: torch.Size, strides: tuple[int, ...]) -> list[int]:
    # Any 16-byte multiple will do for a dimension that is never stepped. (Cached: callers only read it.)
    return [16 if size == 1 and dim < 3 else stride for dim, (size, stride) in enumerate(zip(shape, strides))]


def _descriptor(tensor: torch.Tensor, block_rows: int, block_d: int):
    return TensorDescriptor(tensor, list(tensor.shape), _descriptor_strides(tensor), [1, 1, block_rows, block_d])


HOPPER_CONSUMER_ROWS = 64


def hopper_forward_applies(q, k, v, out, scale: float) -> bool:
    """Whether the warp-specialised Gluon forward can run this call.

    It needs a Hopper GPU (sm_90), 16-bit inputs, a head dim of 64 or 128, a positive scale
    (the scale is folded into exp2 after the row max) and tensors the bulk copy engine can
    address (``tma_compatible``).
    """
    return (attention_forward_hopper_kernel is not None and not INTERPRETED
            and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[3] in (64, 128) and scale > 0
            and _compute_capability(q.device)[0] == 9
            and all(tma_compatible(t) for t in (q, k, v, out)))


@functools.lru_cache(maxsize=None)
def _compute_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def _hopper_layout(block_rows: int, head_dim: int, dtype: torch.dtype):
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([1, 1, block_rows, head_dim], element)


class _HostDescriptor:
    """What Triton's launcher reads from a host tensor descriptor to encode the tensor map.

    Built per call without Gluon's TensorDescriptor checks: ``hopper_forward_applies`` made them.
    """

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, tensor: torch.Tensor):
        self.base, self.shape, self.strides, self.padding = tensor, list(tensor.shape), _descriptor_strides(tensor), "zero"


_HOPPER_INTEGER_ARGS = ("num_q_heads", "group_size", "seqlen_q", "seqlen_k", "causal_offset")


def hopper_forward_source(dtype: torch.dtype, head_dim: int, block_n: int, stages: int, causal: bool,
                          consumers: int, emulated_exp2: int, q_buffers: int = 1, ctas_per_sm: int = 1):
    """The Gluon forward's compile source for one static configuration, and its constexpr values.

    The integer arguments carry no value specialisation, so one binary serves every shape.
    """
    element = "bf16" if dtype == torch.bfloat16 else "fp16"

    def descriptor_type(rows: int) -> str:
        return f"tensordesc<{element}[1,1,{rows},{head_dim}],{_hopper_layout(rows, head_dim, dtype)!r}>"

    constants = {"HEAD_DIM": head_dim, "BLOCK_N": block_n, "STAGES": stages, "CAUSAL": causal,
                 "CONSUMERS": consumers, "EMULATED_EXP2": emulated_exp2,
                 "Q_BUFFERS": q_buffers, "CTAS_PER_SM": ctas_per_sm}
    signature = {"q_desc": descriptor_type(HOPPER_CONSUMER_ROWS), "k_desc": descriptor_type(block_n),
                 "v_desc": descriptor_type(block_n), "o_desc": descriptor_type(HOPPER_CONSUMER_ROWS),
                 "Lse": "*fp32", **dict.fromkeys(_HOPPER_INTEGER_ARGS, "i32"), "qk_scale": "fp32",
                 "num_tiles": "i32", **dict.fromkeys(constants, "constexpr")}
    assert list(signature) == attention_forward_hopper_kernel.arg_names
    return GluonASTSource(attention_forward_hopper_kernel, signature, constants), tuple(constants.values())


def hopper_compile_options(consumers: int, ctas_per_sm: int) -> dict:
    """Compile options of the Gluon forward: the launch register count lets ``ctas_per_sm`` CTAs
    share a multiprocessor (:func:`fmha.kernels.forward_hopper.register_budget`)."""
    return {"num_warps": 4, "maxnreg": register_budget(consumers, ctas_per_sm)[0]}


@functools.lru_cache(maxsize=None)
def _compiled_hopper_forward(device: torch.device, dtype: torch.dtype, head_dim: int, block_n: int, stages: int,
                             causal: bool, consumers: int, emulated_exp2: int, q_buffers: int, ctas_per_sm: int):
    """Compiled once per device and static configuration (Triton's disk cache still applies) and
    launched directly: this skips the JIT's per-call work of binding ~20 arguments, computing
    their specialisation (the descriptors' layouts included) and hashing the cache key."""
    source, constants = hopper_forward_source(dtype, head_dim, block_n, stages, causal, consumers, emulated_exp2,
                                              q_buffers, ctas_per_sm)
    with torch.cuda.device(device):
        compiled = triton.compile(source, target=triton.runtime.driver.active.get_current_target(),
                                  options=hopper_compile_options(consumers, ctas_per_sm))
        compiled._init_handles()  # loads the module on this device
    return compiled, constants


def launch_forward_hopper(q, k, v, out, lse, *, causal_offset: int | None, scale: float,
                          block_n: int = 128, stages: int = 2, persistent: bool = True, consumers: int = 2,
                          emulated_exp2: int = 0, q_buffers: int = 1, ctas_per_sm: int = 1):
    """The Gluon forward (see :func:`hopper_forward_applies`); same outputs as :func:`launch_forward`.

    ``persistent``: ``ctas_per_sm`` programs per multiprocessor walk the tiles (the next tile's
    loads overlap the current tile's end); otherwise one program per tile. ``consumers``: 1, 2 or
    3 warpgroups of 64 query rows per tile. ``emulated_exp2`` (0, 2, 4 or 8): one exponential in
    that many is computed on the FMA units (:mod:`fmha.kernels.forward_hopper`). ``q_buffers`` 2: each consumer's
    next Q tile loads while it works on the current one. ``ctas_per_sm``: CTAs sharing a
    multiprocessor (registers per thread shrink with it; at D=128 only one consumer with 64-key
    blocks fits two, and ptxas refuses three). Returns the compiled kernel.
    """
    batch, num_q_heads, seqlen_q, head_dim = q.shape
    num_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    device = q.device  # a new object per access: read once on this per-call path
    compiled, constants = _compiled_hopper_forward(device, q.dtype, head_dim, block_n, stages,
                                                   causal_offset is not None, consumers, emulated_exp2,
                                                   q_buffers, ctas_per_sm)
    num_tiles = -(-seqlen_q // (consumers * HOPPER_CONSUMER_ROWS)) * batch * num_q_heads
    if not persistent:
        grid = num_tiles
    elif causal_offset is not None:
        grid = min((num_tiles + 1) // 2, ctas_per_sm * multiprocessors(device))  # programs walk pairs
    else:
        grid = min(num_tiles, ctas_per_sm * multiprocessors(device))
    args = (_HostDescriptor(q), _HostDescriptor(k), _HostDescriptor(v), _HostDescriptor(out), lse,
            num_q_heads, num_q_heads // num_kv_heads, seqlen_q, seqlen_k,
            0 if causal_offset is None else causal_offset, scale * LOG2_E, num_tiles, *constants)
    _run_compiled(compiled, grid, device, args)
    return compiled


def _run_compiled(compiled, grid: int, device: torch.device, args: tuple) -> None:
    """Launch a compiled kernel on the current stream; ``args`` are all its parameters in order."""
    stream = torch._C._cuda_getCurrentRawStream(device.index)  # what Triton's own launch asks for
    enter_hook, exit_hook = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
    metadata = compiled.launch_metadata((grid, 1, 1), stream, *args) if enter_hook is not None else None
    compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, metadata,
                 enter_hook, exit_hook, *args)


def _integer_specialisation(value: int) -> tuple[bool, bool, bool]:
    """What Triton's JIT specialises an integer argument on: 1 becomes a constant, multiples of 16
    are marked divisible, and the value picks i32 or i64."""
    return value == 1, value % 16 == 0, -2**31 <= value < 2**31


# Compiled portable forwards by everything Triton's JIT would key them on: the launch below reuses
# them without the JIT's per-call binding and cache-key hashing.
_compiled_forwards: dict = {}


def launch_forward(q, k, v, out, lse, *, causal_offset: int | None, scale: float,
                   config: ForwardConfig, features: KernelFeatures | None = None):
    """Fused forward: writes ``out`` (B, Hq, Sq, D) and ``lse`` (B, Hq, Sq) fp32.

    Returns Triton's compiled kernel (None under the interpreter), for resource reports.
    """
    batch, num_q_heads, seqlen_q, head_dim = q.shape
    if features is None:
        features = DEFAULT_FEATURES
    num_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    block_d = padded_head_dim(head_dim)
    use_tma = (features.tma and TensorDescriptor is not None
               and all(tma_compatible(t) for t in (q, k, v, out)))
    if use_tma:
        descriptors = (_descriptor(q, config.block_m, block_d), _descriptor(k, config.block_n, block_d),
                       _descriptor(v, config.block_n, block_d), _descriptor(out, config.block_m, block_d))
    else:
        descriptors = (None, None, None, None)
    num_tiles = triton.cdiv(seqlen_q, config.block_m) * batch * num_q_heads
    grid = min(num_tiles, multiprocessors(q.device)) if features.persistent else num_tiles
    integers = (*q.stride(), *k.stride(), *v.stride(), *out.stride(),
                batch * num_q_heads, num_q_heads, num_q_heads // num_kv_heads, seqlen_q, seqlen_k,
                0 if causal_offset is None else causal_offset)
    tensors = (q, k, v, out, lse)
    args = (*tensors, *descriptors, *integers, scale * LOG2_E)
    constants = dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        CAUSAL=causal_offset is not None, DOT_PRECISION=dot_precision(q.dtype),
        USE_TMA=use_tma, FUSED_SCALE=features.fused_scale and scale > 0,
        PIPELINE_QK=features.pipeline_qk, WARP_SPECIALIZE=features.warp_specialize, PERSISTENT=features.persistent,
    )
    if INTERPRETED or use_tma:  # the interpreter has no compiled kernel; host descriptors vary per call
        return attention_forward_kernel[(grid,)](*args, **constants, num_warps=config.num_warps,
                                                 num_stages=config.num_stages)
    # The tensors share q's dtype (checked by fmha.interface) but for the fp32 LSE.
    constant_values = tuple(constants.values())
    key = (q.device, q.dtype, config, constant_values, tuple(t.data_ptr() % 16 == 0 for t in tensors),
           tuple(map(_integer_specialisation, integers)))
    compiled = _compiled_forwards.get(key)
    if compiled is None:  # the JIT compiles (or loads from its disk cache) and launches this once
        assert attention_forward_kernel.arg_names[len(args):] == list(constants)  # the direct launch's order
        compiled = attention_forward_kernel[(grid,)](*args, **constants, num_warps=config.num_warps,
                                                     num_stages=config.num_stages)
        _compiled_forwards[key] = compiled
    else:
        _run_compiled(compiled, grid, q.device, (*args, *constant_values))
    return compiled


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """Programs of a persistent launch: one per multiprocessor (a few under the interpreter)."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


# Measured on the H100 (docs/perf.md, "Levers"): the folded scale pays on every shape. Tensor
# descriptors gain 1-4% of GPU time for head dims up to 64 but cost about 130 us of host time per
# launch (made and encoded on the host), so they stay off, as do QK pipelining, the persistent
# grid and Triton's warp specialisation, which lost or did not compile.
DEFAULT_FEATURES = KernelFeatures()


def launch_backward(q, k, v, out, dout, lse, dq, dk, dv, *, causal_offset: int | None, scale: float,
                    config: BackwardConfig) -> None:
    """Writes dq, dk, dv (shapes and dtypes of q, k, v) from the forward's out and LSE."""
    batch, num_q_heads, seqlen_q, head_dim = q.shape
    num_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    block_d = padded_head_dim(head_dim)
    delta = torch.empty((batch, num_q_heads, seqlen_q), device=q.device, dtype=torch.float32)
    preprocess_block = 16 if INTERPRETED else 64
    backward_preprocess_kernel[(triton.cdiv(seqlen_q, preprocess_block), batch * num_q_heads)](
        out, dout, delta, *out.stride(), *dout.stride(), num_q_heads, seqlen_q,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=preprocess_block,
    )
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, CAUSAL=causal_offset is not None,
                  DOT_PRECISION=dot_precision(q.dtype), num_warps=config.num_warps, num_stages=config.num_stages)
    offset = 0 if causal_offset is None else causal_offset
    group_size = num_q_heads // num_kv_heads
    # Each kernel keeps block_n rows resident (keys for dK/dV, queries for dQ) and streams
    # block_m rows of the other side past them.
    backward_dkdv_kernel[(triton.cdiv(seqlen_k, config.block_n), batch * num_kv_heads)](
        q, k, v, dout, lse, delta, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
        num_q_heads, num_kv_heads, group_size, seqlen_q, seqlen_k, offset, scale, scale * LOG2_E,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, **common,
    )
    backward_dq_kernel[(triton.cdiv(seqlen_q, config.block_n), batch * num_q_heads)](
        q, k, v, dout, lse, delta, dq,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
        num_q_heads, group_size, seqlen_q, seqlen_k, offset, scale, scale * LOG2_E,
        BLOCK_M=config.block_n, BLOCK_N=config.block_m, **common,
    )


NAIVE_BLOCK = 16 if INTERPRETED else 64
NAIVE_SOFTMAX_BLOCK = 64 if INTERPRETED else 1024


def launch_naive(q, k, v, out, lse, *, causal_offset: int | None, scale: float) -> list:
    """Materialising baseline: S (fp32) and unnormalised P (input dtype) are allocated in full.

    Returns the three compiled kernels (None under the interpreter).
    """
    batch, num_q_heads, seqlen_q, head_dim = q.shape
    num_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    group_size = num_q_heads // num_kv_heads
    block_d = padded_head_dim(head_dim)
    # Wide head dims would not fit a 64x64 tile per operand in shared memory.
    block = NAIVE_BLOCK if block_d <= 128 else min(NAIVE_BLOCK, 32)
    scores = torch.empty((batch, num_q_heads, seqlen_q, seqlen_k), device=q.device, dtype=torch.float32)
    probs = torch.empty((batch, num_q_heads, seqlen_q, seqlen_k), device=q.device, dtype=q.dtype)
    inv_row_sum = torch.empty((batch, num_q_heads, seqlen_q), device=q.device, dtype=torch.float32)
    precision = dot_precision(q.dtype)
    compiled = [scores_kernel[(triton.cdiv(seqlen_q, block), triton.cdiv(seqlen_k, block), batch * num_q_heads)](
        q, k, scores, *q.stride(), *k.stride(),
        num_q_heads, group_size, seqlen_q, seqlen_k,
        0 if causal_offset is None else causal_offset, scale,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block, BLOCK_N=block,
        CAUSAL=causal_offset is not None, DOT_PRECISION=precision,
    )]
    softmax_block = min(NAIVE_SOFTMAX_BLOCK, triton.next_power_of_2(seqlen_k))
    compiled.append(softmax_kernel[(batch * num_q_heads * seqlen_q,)](
        scores, probs, inv_row_sum, lse, seqlen_k, BLOCK_N=softmax_block,
        num_warps=4 if softmax_block >= 512 else 1,
    ))
    compiled.append(pv_kernel[(triton.cdiv(seqlen_q, block), batch * num_q_heads)](
        probs, v, inv_row_sum, out, *v.stride(), *out.stride(),
        num_q_heads, group_size, seqlen_q, seqlen_k,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block, BLOCK_N=block, DOT_PRECISION=precision,
    ))
    return compiled


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
