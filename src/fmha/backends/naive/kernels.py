"""Step 2: the materialising baseline, three kernels with S and P in global memory.

1. ``scores_kernel``:  S = Q K^T * scale, fp32, entries outside the key window set to -inf.
2. ``softmax_kernel``: P = exp(S - rowmax(S)) in the input dtype, 1 / rowsum(P) and the LSE.
3. ``pv_kernel``:      O = (P V) / rowsum(P).

P is stored before normalisation (its largest entry is exactly 1) and the division
happens on the fp32 accumulator, as in the fused kernel: storing normalised
probabilities in fp16 would lose about one bit, more than PyTorch's own error.

This is the "before" of every speedup the report prints: plain tiled kernels,
each a reasonable implementation of its own step, and O(Sq * Sk) memory traffic.
"""

import triton
import triton.language as tl

from ..triton.masking import visible

LOG2_E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN_2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def scores_kernel(
    Q, K, S,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    num_q_heads, group_size, seqlen_q, seqlen_k, lo, hi, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    batch_head = tl.program_id(0)  # B·H on the first axis: the others stop at 65,535
    m_block = tl.program_id(1)
    n_block = tl.program_id(2)
    batch = batch_head // num_q_heads
    kv_head = (batch_head % num_q_heads) // group_size
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_in_range = offs_d[None, :] < HEAD_DIM
    q_ptrs = (Q + batch.to(tl.int64) * stride_qb + (batch_head % num_q_heads).to(tl.int64) * stride_qh
              + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd)
    k_ptrs = (K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
              + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd)
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < seqlen_q) & d_in_range, other=0.0)  # [BLOCK_M, BLOCK_D]
    k = tl.load(k_ptrs, mask=(offs_n[:, None] < seqlen_k) & d_in_range, other=0.0)  # [BLOCK_N, BLOCK_D]
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
    if HAS_LEFT or HAS_RIGHT:
        seen = visible(offs_m[:, None], offs_n[None, :], seqlen_k, lo, hi, HAS_LEFT, HAS_RIGHT)
        scores = tl.where(seen, scores, float("-inf"))
    s_ptrs = S + batch_head.to(tl.int64) * seqlen_q * seqlen_k + offs_m[:, None].to(tl.int64) * seqlen_k + offs_n[None, :]
    tl.store(s_ptrs, scores, mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k))


@triton.jit
def softmax_kernel(S, P, InvRowSum, Lse, seqlen_k, BLOCK_N: tl.constexpr):
    """One program per row: a max/sum pass over S, then a pass that writes P."""
    row = tl.program_id(0).to(tl.int64)
    s_row = S + row * seqlen_k
    p_row = P + row * seqlen_k
    offs = tl.arange(0, BLOCK_N)
    row_max = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, seqlen_k, BLOCK_N):
        s = tl.load(s_row + start + offs, mask=start + offs < seqlen_k, other=float("-inf")) * LOG2_E
        new_max = tl.maximum(row_max, s)
        new_max_safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.math.exp2(row_max - new_max_safe) + tl.math.exp2(s - new_max_safe)
        row_max = new_max
    # Combine the per-lane partial maxima and sums into one per row.
    final_max = tl.max(row_max, 0)
    final_max_safe = tl.where(final_max == float("-inf"), 0.0, final_max)
    total = tl.sum(row_sum * tl.math.exp2(row_max - final_max_safe), 0)
    inv_total = tl.where(total > 0.0, 1.0 / tl.where(total > 0.0, total, 1.0), 0.0)
    for start in range(0, seqlen_k, BLOCK_N):
        s = tl.load(s_row + start + offs, mask=start + offs < seqlen_k, other=float("-inf")) * LOG2_E
        p = tl.math.exp2(s - final_max_safe)
        tl.store(p_row + start + offs, p.to(P.dtype.element_ty), mask=start + offs < seqlen_k)
    lse = tl.where(total > 0.0, (final_max_safe + tl.math.log2(tl.where(total > 0.0, total, 1.0))) * LN_2,
                   float("-inf"))
    tl.store(Lse + row, lse)
    tl.store(InvRowSum + row, inv_total)


@triton.jit
def pv_kernel(
    P, V, InvRowSum, Out,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    num_q_heads, group_size, seqlen_q, seqlen_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    batch_head = tl.program_id(0)
    m_block = tl.program_id(1)
    batch = batch_head // num_q_heads
    head = batch_head % num_q_heads
    kv_head = head // group_size
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_in_range = offs_d[None, :] < HEAD_DIM
    p_ptrs = (P + batch_head.to(tl.int64) * seqlen_q * seqlen_k + offs_m[:, None].to(tl.int64) * seqlen_k
              + offs_n[None, :])
    v_ptrs = (V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
              + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, seqlen_k, BLOCK_N):
        keys_in_range = start_n + offs_n < seqlen_k
        p = tl.load(p_ptrs + start_n, mask=(offs_m[:, None] < seqlen_q) & keys_in_range[None, :], other=0.0)
        v = tl.load(v_ptrs + start_n * stride_vn, mask=keys_in_range[:, None] & d_in_range, other=0.0)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_D]
    inv_row_sum = tl.load(InvRowSum + batch_head.to(tl.int64) * seqlen_q + offs_m, mask=offs_m < seqlen_q, other=0.0)
    acc = acc * inv_row_sum[:, None]
    o_ptrs = (Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
              + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=(offs_m[:, None] < seqlen_q) & d_in_range)
