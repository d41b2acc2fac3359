"""Pieces shared by the forward and backward kernels."""

import triton
import triton.language as tl


@triton.jit
def _load_rows(ptrs, rows, num_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASK_ROWS: tl.constexpr):
    """Load a [rows, BLOCK_D] tile, masking only what can be out of range."""
    if MASK_ROWS:
        return tl.load(ptrs, mask=(rows[:, None] < num_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif BLOCK_D != HEAD_DIM:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _key_range(first_row, seqlen_k, causal_offset,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys seen by query rows [first_row, first_row + BLOCK_M): ``(unmasked_end, kv_end)``.

    Keys [0, unmasked_end) need no mask for any of the rows and start a whole key block;
    [unmasked_end, kv_end) cross the diagonal or the end of K and are masked; keys from
    kv_end on lie above the diagonal of every row and are never visited.
    """
    if CAUSAL:
        kv_end = tl.minimum(seqlen_k, first_row + BLOCK_M + causal_offset)
        unmasked_end = tl.minimum(seqlen_k, first_row + causal_offset + 1)
    else:
        kv_end = seqlen_k
        unmasked_end = seqlen_k
    unmasked_end = tl.maximum(unmasked_end, 0) // BLOCK_N * BLOCK_N
    return unmasked_end, kv_end
