"""Step 3: the fused attention forward (FlashAttention-2 style online softmax).

One program owns BLOCK_M query rows of one (batch, query head). It keeps Q in
registers and walks K/V in BLOCK_N blocks, never writing the score matrix:

* scores are scaled by ``scale * log2(e)`` so the softmax runs on ``exp2``;
* blocks fully below the causal diagonal (and fully inside Sk) run without masks;
* blocks crossing the diagonal or the end of K run a separate masked pass;
* blocks above the diagonal are never visited.

Causality is one integer: query i sees key j iff j <= i + causal_offset
(Sk - Sq for bottom-right, 0 for top-left).
"""

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
LN_2: tl.constexpr = tl.constexpr(0.6931471805599453)


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
def _attend_kv_blocks(
    acc, row_sum, row_max,  # [BLOCK_M, BLOCK_D] f32, [BLOCK_M] f32, [BLOCK_M] f32 (log2 units)
    q,  # [BLOCK_M, BLOCK_D]
    k_ptrs, v_ptrs,  # [BLOCK_N, BLOCK_D] pointers at key block 0
    stride_kn, stride_vn,
    offs_m, offs_n, offs_d,
    kv_start, kv_end, seqlen_k, causal_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    for start_n in range(kv_start, kv_end, BLOCK_N):
        keys = start_n + offs_n  # [BLOCK_N]
        k = _load_rows(k_ptrs + start_n * stride_kn, keys, seqlen_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)  # [BLOCK_N, BLOCK_D]
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = keys[None, :] < seqlen_k
            if CAUSAL:
                visible = visible & (keys[None, :] <= offs_m[:, None] + causal_offset)
            scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))  # [BLOCK_M]
        if MASKED:
            # A row that has seen no key yet keeps max = -inf; subtracting 0 instead
            # gives exp2(-inf) = 0 rather than exp2(-inf + inf) = NaN.
            new_max_safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        else:
            new_max_safe = new_max
        probs = tl.math.exp2(scores - new_max_safe[:, None])  # [BLOCK_M, BLOCK_N]
        rescale = tl.math.exp2(row_max - new_max_safe)  # [BLOCK_M]
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v = _load_rows(v_ptrs + start_n * stride_vn, keys, seqlen_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)  # [BLOCK_N, BLOCK_D]
        acc = tl.dot(probs.to(v.dtype), v, acc * rescale[:, None], input_precision=DOT_PRECISION)
        row_max = new_max
    return acc, row_sum, row_max


@triton.jit
def attention_forward_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    num_q_heads, group_size, seqlen_q, seqlen_k, causal_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Query blocks of one head are adjacent program ids so that they share K/V in L2.
    # Causal blocks run longest first (the last rows see the most keys), so the
    # short tiles fill the tail of the wave.
    num_m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    pid = tl.program_id(0)
    batch_head = pid // num_m_blocks
    m_block = pid % num_m_blocks
    if CAUSAL:
        m_block = num_m_blocks - 1 - m_block
    batch = batch_head // num_q_heads
    head = batch_head % num_q_heads
    kv_head = head // group_size

    q_base = Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    k_base = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    row_in_range = offs_m[:, None] < seqlen_q
    d_in_range = offs_d[None, :] < HEAD_DIM

    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_in_range & d_in_range, other=0.0)  # [BLOCK_M, BLOCK_D]
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd  # [BLOCK_N, BLOCK_D]
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd  # [BLOCK_N, BLOCK_D]

    # Key range of this block: [0, unmasked_end) needs no mask for any row,
    # [unmasked_end, kv_end) is masked, the rest is above the diagonal and skipped.
    first_row = m_block * BLOCK_M
    if CAUSAL:
        kv_end = tl.minimum(seqlen_k, first_row + BLOCK_M + causal_offset)
        unmasked_end = tl.minimum(seqlen_k, first_row + causal_offset + 1)
    else:
        kv_end = seqlen_k
        unmasked_end = seqlen_k
    unmasked_end = tl.maximum(unmasked_end, 0) // BLOCK_N * BLOCK_N

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, row_sum, row_max = _attend_kv_blocks(
        acc, row_sum, row_max, q, k_ptrs, v_ptrs, stride_kn, stride_vn,
        offs_m, offs_n, offs_d, 0, unmasked_end, seqlen_k, causal_offset, qk_scale,
        HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, DOT_PRECISION)
    acc, row_sum, row_max = _attend_kv_blocks(
        acc, row_sum, row_max, q, k_ptrs, v_ptrs, stride_kn, stride_vn,
        offs_m, offs_n, offs_d, unmasked_end, kv_end, seqlen_k, causal_offset, qk_scale,
        HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, DOT_PRECISION)

    # Rows that saw no key: output 0 and LSE -inf, never 0/0.
    seen = row_sum > 0.0
    row_sum_safe = tl.where(seen, row_sum, 1.0)
    out = acc / row_sum_safe[:, None]
    lse = tl.where(seen, (row_max + tl.math.log2(row_sum_safe)) * LN_2, float("-inf"))

    o_base = Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=row_in_range & d_in_range)
    tl.store(Lse + batch_head.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
