"""Pieces shared by the forward and backward kernels."""

import triton
import triton.language as tl


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
