"""Per-row work around a backward that sums dQ with atomic adds (the Hopper backward).

* :func:`backward_rows_kernel`: delta = rowsum(O ⊙ dO) and the LSE in log2 units, padded to
  whole query blocks (padded rows and rows that saw no key get LSE +inf, so their P is 0), the
  fp32 dQ buffer and the backward's tile counter zeroed, in one pass;
* :func:`finish_dq_kernel`: dQ = scale · buffer, in q's dtype and strides.

Both walk the (batch, head) pairs from the last, against the order of the kernels around them:
the rows pass meets the forward's last outputs while L2 still holds them and ends on the heads
the backward starts with (their zeroed dQ rows and statistics still in L2), and the finish meets
the backward's last dQ sums first.
"""

import triton
import triton.language as tl

from .common import block_and_batch_head, wide_stride

LOG2_E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def backward_rows_kernel(
    Out, DOut, Lse, Delta, Lse2, DQAccum, TileCounter,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_lb, stride_lh,
    num_q_heads, seqlen_q, padded_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
):
    """Also zeroes the int32 at TileCounter, the backward's tile counter (no fill kernel of its own)."""
    stride_om, stride_dom = wide_stride(stride_om, WIDE_OFFSETS), wide_stride(stride_dom, WIDE_OFFSETS)
    if tl.program_id(0) == 0:
        tl.store(TileCounter, 0)
    num_blocks = padded_q // BLOCK_M
    m_block, pair = block_and_batch_head(num_blocks)
    batch_head = tl.num_programs(0) // num_blocks - 1 - pair  # the last (batch, head) first
    batch = batch_head // num_q_heads
    head = batch_head % num_q_heads
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    columns = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    inside = rows < seqlen_q
    mask = inside[:, None] & (columns[None, :] < HEAD_DIM)
    o = tl.load(Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
                + rows[:, None] * stride_om + columns[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DOut + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
                 + rows[:, None] * stride_dom + columns[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # [BLOCK_M]
    lse = tl.load(Lse + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + rows,
                  mask=inside, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2_E)
    padded_rows = batch_head.to(tl.int64) * padded_q + rows
    tl.store(Delta + padded_rows, delta)
    tl.store(Lse2 + padded_rows, lse2)
    tl.store(DQAccum + padded_rows[:, None] * HEAD_DIM + columns[None, :],
             tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), mask=columns[None, :] < HEAD_DIM)


@triton.jit
def finish_dq_kernel(
    DQAccum, DQ,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    num_q_heads, seqlen_q, padded_q, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
):
    stride_dqm = wide_stride(stride_dqm, WIDE_OFFSETS)
    num_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    m_block, pair = block_and_batch_head(num_blocks)
    batch_head = tl.num_programs(0) // num_blocks - 1 - pair  # the last (batch, head) first
    batch = batch_head // num_q_heads
    head = batch_head % num_q_heads
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    columns = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seqlen_q) & (columns[None, :] < HEAD_DIM)
    dq = tl.load(DQAccum + (batch_head.to(tl.int64) * padded_q + rows)[:, None] * HEAD_DIM + columns[None, :],
                 mask=mask, other=0.0)
    tl.store(DQ + batch.to(tl.int64) * stride_dqb + head.to(tl.int64) * stride_dqh
             + rows[:, None] * stride_dqm + columns[None, :] * stride_dqd, (dq * scale).to(DQ.dtype.element_ty),
             mask=mask)
