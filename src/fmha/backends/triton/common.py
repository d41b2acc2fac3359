"""Pieces shared by the forward and backward kernels."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def load_rows(ptrs, rows, num_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASK_ROWS: tl.constexpr):
    """Load a [rows, BLOCK_D] tile, masking only what can be out of range."""
    if MASK_ROWS:
        return tl.load(ptrs, mask=(rows[:, None] < num_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif BLOCK_D != HEAD_DIM:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def wide_stride(stride, WIDE_OFFSETS: tl.constexpr):
    """``stride`` in 64 bits where a tensor's rows span 2^31 elements or more (WIDE_OFFSETS, from
    :func:`fmha.runtime.spans_wide_offsets`): ``row * stride`` would wrap in 32 bits."""
    if WIDE_OFFSETS:
        return tl.cast(stride, tl.int64)
    else:
        return stride


@triton.jit
def block_and_batch_head(num_blocks):
    """``(block, batch_head)`` of this program in a one-axis grid of ``num_blocks`` blocks per
    (batch, head), blocks fastest: the launch order of a (blocks, B·H) grid, without its second
    axis's limit of 65,535 (B·H can pass it: B 4,096, H 16)."""
    program = tl.program_id(0)
    return program % num_blocks, program // num_blocks


@triton.jit
def chain_launches(PDL: tl.constexpr):
    """Programmatic dependent launch (sm_90 on), for kernels that follow one another in one call.

    Each kernel of the chain lets the next one launch now (its CTAs take their places and run
    their set-up while this one works), then waits until the kernel before it has finished and
    its writes are visible. So nothing before this call may read or write global memory: it is
    called first. Both are no-ops for a kernel launched without the attribute.
    """
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
