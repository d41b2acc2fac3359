"""Step 3: the fused attention forward (FlashAttention-2 style online softmax).

One program owns BLOCK_M query rows of one (batch, query head). It keeps Q in
registers and walks K/V in BLOCK_N blocks, never writing the score matrix:

* scores are scaled by ``scale * log2(e)`` so the softmax runs on ``exp2``;
* blocks every row sees whole (inside the window and inside Sk) run without masks;
* blocks crossing a window edge or the end of K run a separate masked pass;
* blocks outside the window are never visited.

Which keys a row sees is :mod:`fmha.backends.triton.masking`'s rule: row i sees keys
``i + lo <= j <= i + hi`` with each side on when ``HAS_LEFT`` / ``HAS_RIGHT`` (causal: ``HAS_RIGHT``,
``hi = Sk - Sq`` bottom-right or 0 top-left).

Compile-time switches (the launcher picks them per device, see ``fmha.backends.triton.config.KernelFeatures``):

* ``USE_TMA``: Q/K/V/O move through (B, H, S, D) tensor descriptors made on the host (Hopper's
  bulk tensor copies); rows past the end of a sequence and columns past the head dim load as
  zeros and are never stored;
* ``FUSED_SCALE``: the row max is taken on raw scores and the scale is folded into the
  exponent, one FMA per score instead of a multiply and a subtract (needs scale > 0); with a
  softcap alone, the max is taken on the tanh and its factor ``softcap · log2 e`` folds in;
* ``PIPELINE_QK``: in the unmasked loop, Q·Kᵀ of the next block is issued before the
  softmax of the current one, so the tensor cores and the exp units can overlap;
* ``WARP_SPECIALIZE``: Triton's producer/consumer warp specialisation of the unmasked loop;
* ``PERSISTENT``: one program per SM walks the tiles, saving launches and prologues.

Score features (:mod:`fmha.backends.triton.scores`), each a constexpr that costs nothing when off:
``SOFTCAP``, ``ALIBI``, ``MASK`` (SDPA's bool or float attn_mask, loaded through its strides, stride 0
where it broadcasts), ``SINKS`` (each row's denominator gains ``exp(sinks[h])``, folded in where the
row is normalised) and ``DROPOUT`` (kept probabilities enter P·V; the 1/(1 - p) rescale is folded
into the normalisation; the LSE is that of the softmax before dropout).
"""

import triton
import triton.language as tl

from .common import load_rows, wide_stride
from .masking import key_blocks, visible
from .scores import LOG2_E as LOG2_E_CONSTEXPR
from .scores import NO_MASK, dropout_keep, score_mods, score_tile
from .varlen import packed_spans, program_tile

LOG2_E = 1.4426950408889634
LN_2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _load_kv(ptrs, desc, batch, kv_head, start_n, keys, seqlen_k, offs_d,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
             MASKED: tl.constexpr, USE_TMA: tl.constexpr):
    """One [BLOCK_N, BLOCK_D] block of K or V starting at key ``start_n``."""
    if USE_TMA:
        return desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        return load_rows(ptrs, keys, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)


@triton.jit
def _softmax_update(
    acc, row_sum, row_max,  # [BLOCK_M, BLOCK_DV] f32, [BLOCK_M] f32, [BLOCK_M] f32 (log2 units)
    raw_scores,  # [BLOCK_M, BLOCK_N] f32, Q·Kᵀ unscaled
    v,  # [BLOCK_N, BLOCK_DV]
    start_n, keys, offs_m, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FUSED_SCALE: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASK: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    """Fold one key block into the running max, sum and output accumulator.

    ``mods``: the score features' runtime values (:func:`fmha.backends.triton.scores.score_mods`).
    """
    softcap_scale, slope, mask_ptr, stride_mm, stride_mn, seed, rng_row, threshold, _ = mods
    if FUSED_SCALE:
        tl.static_assert(not ALIBI and MASK == NO_MASK, "biased scores are scaled before the row max")
        if SOFTCAP:  # the factor after the tanh folds in
            _, scores = score_tile(raw_scores, offs_m[:, None], keys[None, :], seqlen_q, seqlen_k, qk_scale,
                                   softcap_scale, slope, mask_ptr, stride_mm, stride_mn, SOFTCAP, ALIBI, MASK)
            factor = softcap_scale
        else:
            scores = raw_scores
            factor = qk_scale
    elif SOFTCAP or ALIBI or MASK != NO_MASK:
        scores, _ = score_tile(raw_scores, offs_m[:, None], keys[None, :], seqlen_q, seqlen_k, qk_scale,
                               softcap_scale, slope, mask_ptr, stride_mm, stride_mn, SOFTCAP, ALIBI, MASK)
    else:
        scores = raw_scores * qk_scale
    if MASKED:
        seen = visible(offs_m[:, None], keys[None, :], seqlen_k, lo, hi, HAS_LEFT, HAS_RIGHT)
        scores = tl.where(seen, scores, float("-inf"))
    if FUSED_SCALE:
        new_max = tl.maximum(row_max, tl.max(scores, 1) * factor)  # [BLOCK_M]
    else:
        new_max = tl.maximum(row_max, tl.max(scores, 1))  # [BLOCK_M]
    if MASKED or MASK != NO_MASK:
        # A row that has seen no key yet keeps max = -inf; subtracting 0 instead
        # gives exp2(-inf) = 0 rather than exp2(-inf + inf) = NaN.
        new_max_safe = tl.where(new_max == float("-inf"), 0.0, new_max)
    else:
        new_max_safe = new_max
    if FUSED_SCALE:
        probs = tl.math.exp2(scores * factor - new_max_safe[:, None])  # [BLOCK_M, BLOCK_N]
    else:
        probs = tl.math.exp2(scores - new_max_safe[:, None])  # [BLOCK_M, BLOCK_N]
    rescale = tl.math.exp2(row_max - new_max_safe)  # [BLOCK_M]
    row_sum = row_sum * rescale + tl.sum(probs, 1)
    if DROPOUT:  # the softmax's sum counts every probability; P·V only the kept ones
        keep = dropout_keep(seed, rng_row, offs_m, start_n, threshold, probs.shape[0], probs.shape[1])
        probs = tl.where(keep, probs, 0.0)
    acc = tl.dot(probs.to(v.dtype), v, acc * rescale[:, None], input_precision=DOT_PRECISION)
    return acc, row_sum, new_max


@triton.jit
def _attend_kv_blocks(
    acc, row_sum, row_max,
    q,  # [BLOCK_M, BLOCK_D]
    k_ptrs, v_ptrs,  # [BLOCK_N, BLOCK_D] and [BLOCK_N, BLOCK_DV] pointers at key block 0 (unused with TMA)
    k_desc, v_desc, batch, kv_head,  # (B, H, S, D) descriptors of K and V (with TMA)
    stride_kn, stride_vn,
    offs_m, offs_n, offs_d, offs_dv,
    kv_start, kv_end, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, FUSED_SCALE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr,
):
    for start_n in tl.range(kv_start, kv_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        keys = start_n + offs_n  # [BLOCK_N]
        k = _load_kv(k_ptrs + start_n * stride_kn, k_desc, batch, kv_head, start_n, keys, seqlen_k, offs_d,
                     HEAD_DIM, BLOCK_D, BLOCK_N, MASKED, USE_TMA)  # [BLOCK_N, BLOCK_D]
        raw_scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        v = _load_kv(v_ptrs + start_n * stride_vn, v_desc, batch, kv_head, start_n, keys, seqlen_k, offs_dv,
                     HEAD_DIM_V, BLOCK_DV, BLOCK_N, MASKED, USE_TMA)  # [BLOCK_N, BLOCK_DV]
        acc, row_sum, row_max = _softmax_update(
            acc, row_sum, row_max, raw_scores, v, start_n, keys, offs_m, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
            MASKED, HAS_LEFT, HAS_RIGHT, DOT_PRECISION, FUSED_SCALE, SOFTCAP, ALIBI, MASK, DROPOUT)
    return acc, row_sum, row_max


@triton.jit
def _attend_kv_blocks_pipelined(
    acc, row_sum, row_max, q, k_ptrs, v_ptrs, k_desc, v_desc, batch, kv_head,
    stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dv,
    kv_start, kv_end, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, FUSED_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr,
):
    """The unmasked loop with Q·Kᵀ one block ahead of the softmax (kv_end > kv_start)."""
    k = _load_kv(k_ptrs + kv_start * stride_kn, k_desc, batch, kv_head, kv_start, kv_start + offs_n,
                 seqlen_k, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, False, USE_TMA)
    raw_scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    for start_n in range(kv_start, kv_end - BLOCK_N, BLOCK_N):
        next_n = start_n + BLOCK_N
        k = _load_kv(k_ptrs + next_n * stride_kn, k_desc, batch, kv_head, next_n, next_n + offs_n,
                     seqlen_k, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, False, USE_TMA)
        next_scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        v = _load_kv(v_ptrs + start_n * stride_vn, v_desc, batch, kv_head, start_n, start_n + offs_n,
                     seqlen_k, offs_dv, HEAD_DIM_V, BLOCK_DV, BLOCK_N, False, USE_TMA)
        acc, row_sum, row_max = _softmax_update(
            acc, row_sum, row_max, raw_scores, v, start_n, start_n + offs_n, offs_m, seqlen_q, seqlen_k, lo, hi,
            qk_scale, mods, False, False, False, DOT_PRECISION, FUSED_SCALE, SOFTCAP, ALIBI, MASK, DROPOUT)
        raw_scores = next_scores
    last_n = kv_end - BLOCK_N
    v = _load_kv(v_ptrs + last_n * stride_vn, v_desc, batch, kv_head, last_n, last_n + offs_n,
                 seqlen_k, offs_dv, HEAD_DIM_V, BLOCK_DV, BLOCK_N, False, USE_TMA)
    return _softmax_update(acc, row_sum, row_max, raw_scores, v, last_n, last_n + offs_n, offs_m, seqlen_q, seqlen_k,
                           lo, hi, qk_scale, mods, False, False, False, DOT_PRECISION, FUSED_SCALE,
                           SOFTCAP, ALIBI, MASK, DROPOUT)


@triton.jit
def _forward_tile(
    Q, K, V, Out, Lse, q_desc, k_desc, v_desc, o_desc, Sinks,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_sh,
    batch, head, m_block, q_start, k_start,
    group_size, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, FUSED_SCALE: tl.constexpr, PIPELINE_QK: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASK: tl.constexpr, SINKS: tl.constexpr, DROPOUT: tl.constexpr,
):
    """Rows [m_block * BLOCK_M, +BLOCK_M) of one head of one sequence, which starts at token
    ``q_start`` of Q (``k_start`` of K and V): 0 for dense tensors, the packed offset for varlen.
    ``mods``: :func:`fmha.backends.triton.scores.score_mods` of this (batch, head)."""
    kv_head = head // group_size

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    offs_dv = tl.arange(0, BLOCK_DV)  # [BLOCK_DV]
    row_in_range = offs_m[:, None] < seqlen_q
    d_in_range = offs_d[None, :] < HEAD_DIM
    dv_in_range = offs_dv[None, :] < HEAD_DIM_V

    q_start = tl.cast(q_start, tl.int64)
    k_start = tl.cast(k_start, tl.int64)
    q_base = Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh + q_start * stride_qm
    k_base = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh + k_start * stride_kn
    v_base = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh + k_start * stride_vn
    o_base = Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh + q_start * stride_om
    if USE_TMA:
        q = q_desc.load([batch, head, m_block * BLOCK_M, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=row_in_range & d_in_range, other=0.0)  # [BLOCK_M, BLOCK_D]
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd  # [BLOCK_N, BLOCK_D]
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd  # [BLOCK_N, BLOCK_DV]

    kv_start, full_start, full_end, kv_end = key_blocks(
        m_block * BLOCK_M, BLOCK_M, seqlen_k, lo, hi, BLOCK_N, HAS_LEFT, HAS_RIGHT)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if HAS_LEFT:  # blocks crossing the window's left edge
        acc, row_sum, row_max = _attend_kv_blocks(
            acc, row_sum, row_max, q, k_ptrs, v_ptrs, k_desc, v_desc, batch, kv_head, stride_kn, stride_vn,
            offs_m, offs_n, offs_d, offs_dv, kv_start, full_start, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
            HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, DOT_PRECISION, USE_TMA,
            FUSED_SCALE, False,
            SOFTCAP, ALIBI, MASK, DROPOUT)
    if PIPELINE_QK:
        if full_end > full_start:
            acc, row_sum, row_max = _attend_kv_blocks_pipelined(
                acc, row_sum, row_max, q, k_ptrs, v_ptrs, k_desc, v_desc, batch, kv_head,
                stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dv, full_start, full_end, seqlen_q, seqlen_k, lo, hi,
                qk_scale, mods, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, DOT_PRECISION, USE_TMA, FUSED_SCALE,
                SOFTCAP, ALIBI, MASK, DROPOUT)
    else:
        acc, row_sum, row_max = _attend_kv_blocks(
            acc, row_sum, row_max, q, k_ptrs, v_ptrs, k_desc, v_desc, batch, kv_head, stride_kn, stride_vn,
            offs_m, offs_n, offs_d, offs_dv, full_start, full_end, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
            HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, DOT_PRECISION, USE_TMA,
            FUSED_SCALE,
            WARP_SPECIALIZE, SOFTCAP, ALIBI, MASK, DROPOUT)
    acc, row_sum, row_max = _attend_kv_blocks(
        acc, row_sum, row_max, q, k_ptrs, v_ptrs, k_desc, v_desc, batch, kv_head, stride_kn, stride_vn,
        offs_m, offs_n, offs_d, offs_dv, full_end, kv_end, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
        HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, DOT_PRECISION, USE_TMA,
        FUSED_SCALE, False,
        SOFTCAP, ALIBI, MASK, DROPOUT)

    # Rows that saw no key: output 0 and LSE -inf, never 0/0.
    seen = row_sum > 0.0
    if SINKS:
        # The sink joins the row's max and denominator: exp2(sink - top) of mass that goes nowhere.
        sink = tl.load(Sinks + head.to(tl.int64) * stride_sh) * LOG2_E_CONSTEXPR
        top = tl.maximum(row_max, sink)
        top = tl.where(top == float("-inf"), 0.0, top)
        kept = tl.math.exp2(row_max - top)
        total = row_sum * kept + tl.math.exp2(sink - top)
        out = acc * tl.where(seen, kept / tl.where(seen, total, 1.0), 0.0)[:, None]
        lse = tl.where(seen, (top + tl.math.log2(tl.where(seen, total, 1.0))) * LN_2, float("-inf"))
    else:
        row_sum_safe = tl.where(seen, row_sum, 1.0)
        out = acc / row_sum_safe[:, None]
        lse = tl.where(seen, (row_max + tl.math.log2(row_sum_safe)) * LN_2, float("-inf"))
    if DROPOUT:
        out = out * mods[8]  # 1 / (1 - p)

    if USE_TMA:
        o_desc.store([batch, head, m_block * BLOCK_M, 0],
                     out.to(Out.dtype.element_ty).reshape(1, 1, BLOCK_M, BLOCK_DV))
    else:
        tl.store(o_base + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
                 out.to(Out.dtype.element_ty), mask=row_in_range & dv_in_range)
    lse_base = Lse + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + q_start
    tl.store(lse_base + offs_m, lse, mask=offs_m < seqlen_q)


@triton.jit
def _m_block_of(tile, num_m_blocks, HAS_RIGHT: tl.constexpr):
    m_block = tile % num_m_blocks
    if HAS_RIGHT:
        m_block = num_m_blocks - 1 - m_block
    return m_block


@triton.jit
def attention_forward_kernel(
    Q, K, V, Out, Lse, q_desc, k_desc, v_desc, o_desc, CuSeqlensQ, CuSeqlensK, Tiles,
    AlibiSlopes, Sinks, Mask, RngState,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh,
    stride_ab, stride_ah, stride_sh, stride_mb, stride_mh, stride_mm, stride_mn,
    num_batch_heads, num_q_heads, group_size, seqlen_q, seqlen_k, lo, hi, qk_scale,
    softcap_scale, dropout_threshold, dropout_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, FUSED_SCALE: tl.constexpr, PIPELINE_QK: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, PERSISTENT: tl.constexpr, VARLEN: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASK: tl.constexpr, SINKS: tl.constexpr, DROPOUT: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
):
    stride_qm, stride_kn = wide_stride(stride_qm, WIDE_OFFSETS), wide_stride(stride_kn, WIDE_OFFSETS)
    stride_vn, stride_om = wide_stride(stride_vn, WIDE_OFFSETS), wide_stride(stride_om, WIDE_OFFSETS)
    stride_mm, stride_mn = wide_stride(stride_mm, WIDE_OFFSETS), wide_stride(stride_mn, WIDE_OFFSETS)
    if VARLEN:
        # Packed sequences: Q is (1, Hq, total_q, D), seqlen_q/seqlen_k are the packed totals and
        # lo/hi hold the window without its per-sequence offset. Program p runs one entry of the
        # tile list for one head (fmha.backends.triton.varlen.head_and_entry).
        seq, m_block, head = program_tile(Tiles, num_q_heads)
        if seq >= 0:
            q_start, seqlen_q_seq, k_start, seqlen_k_seq = packed_spans(CuSeqlensQ, CuSeqlensK, seq, seqlen_q,
                                                                        seqlen_k)
            offset = seqlen_k_seq - seqlen_q_seq
            mods = score_mods(AlibiSlopes, Mask, RngState, stride_ab, stride_ah, stride_mb, stride_mh, stride_mm,
                              stride_mn, softcap_scale, dropout_threshold, dropout_scale, seq, head,
                              head * seqlen_q + q_start, ALIBI, MASK, DROPOUT)
            _forward_tile(
                Q, K, V, Out, Lse, q_desc, k_desc, v_desc, o_desc, Sinks,
                stride_qb, stride_qh, stride_qm, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_sh,
                seq, head, m_block, q_start, k_start,  # batch strides are 0
                group_size, seqlen_q_seq, seqlen_k_seq, lo + offset, hi + offset, qk_scale, mods,
                HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, DOT_PRECISION,
                False, FUSED_SCALE, PIPELINE_QK, WARP_SPECIALIZE, SOFTCAP, ALIBI, MASK, SINKS, DROPOUT)
    else:
        # Tile t covers query block t % num_m_blocks of (batch, head) t // num_m_blocks: the query
        # blocks of one head are adjacent so that they share K/V in L2. Causal blocks run longest
        # first (the last rows see the most keys), so the short tiles fill the tail of the wave.
        num_m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
        if PERSISTENT:
            for tile in range(tl.program_id(0), num_m_blocks * num_batch_heads, tl.num_programs(0)):
                batch_head = tile // num_m_blocks
                m_block = _m_block_of(tile, num_m_blocks, HAS_RIGHT)
                mods = score_mods(AlibiSlopes, Mask, RngState, stride_ab, stride_ah, stride_mb, stride_mh,
                                  stride_mm, stride_mn, softcap_scale, dropout_threshold, dropout_scale,
                                  batch_head // num_q_heads, batch_head % num_q_heads, batch_head * seqlen_q,
                                  ALIBI, MASK, DROPOUT)
                _forward_tile(
                    Q, K, V, Out, Lse, q_desc, k_desc, v_desc, o_desc, Sinks,
                    stride_qb, stride_qh, stride_qm, stride_qd,
                    stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd,
                    stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_sh,
                    batch_head // num_q_heads, batch_head % num_q_heads, m_block,
                    0, 0, group_size, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
                    HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, DOT_PRECISION,
                    USE_TMA, FUSED_SCALE, PIPELINE_QK, WARP_SPECIALIZE, SOFTCAP, ALIBI, MASK, SINKS, DROPOUT)
        else:
            tile = tl.program_id(0)
            batch_head = tile // num_m_blocks
            m_block = _m_block_of(tile, num_m_blocks, HAS_RIGHT)
            mods = score_mods(AlibiSlopes, Mask, RngState, stride_ab, stride_ah, stride_mb, stride_mh, stride_mm,
                              stride_mn, softcap_scale, dropout_threshold, dropout_scale, batch_head // num_q_heads,
                              batch_head % num_q_heads, batch_head * seqlen_q, ALIBI, MASK, DROPOUT)
            _forward_tile(
                Q, K, V, Out, Lse, q_desc, k_desc, v_desc, o_desc, Sinks,
                stride_qb, stride_qh, stride_qm, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_sh,
                batch_head // num_q_heads, batch_head % num_q_heads, m_block,
                0, 0, group_size, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
                HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, DOT_PRECISION,
                USE_TMA, FUSED_SCALE, PIPELINE_QK, WARP_SPECIALIZE, SOFTCAP, ALIBI, MASK, SINKS, DROPOUT)
