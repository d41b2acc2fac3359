"""The fused attention backward: delta, then dK/dV and dQ in two kernels, no atomics.

With P = softmax(S), S = Q Kᵀ·scale, O = P V and the forward's LSE saved:

* ``delta_i = rowsum(O ⊙ dO)_i`` (preprocess);
* ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P ⊙ (dP - delta)``;
* ``dK = scale · dSᵀ Q`` and ``dQ = scale · dS K``.

P is recomputed block by block from Q, K and the LSE (``exp2`` with the scale folded in),
never stored. The dK/dV kernel keeps one K/V block resident per program and walks the query
blocks of every query head in its GQA group, so dK/dV are summed over the group in registers.
The dQ kernel keeps one query block resident and walks the key blocks. Every output element is
written by exactly one program: the gradients are deterministic run to run.

Masking follows the forward (:mod:`fmha.backends.triton.masking`): blocks outside the window are
skipped, blocks crossing its edges (or the end of a sequence) run a masked pass, the others run
unmasked.

Score features (:mod:`fmha.backends.triton.scores`, the forward's helpers): P is recomputed from the
modified scores; the softcap scales dS by its derivative ``1 - tanh²``; ALiBi and the attn_mask are
constants; the LSE already counts the sinks (their gradient, ``-sum_i exp(sink - lse_i) · delta_i``,
is :func:`sinks_grad_kernel`'s); dropout regenerates the forward's bits: ``dV = (P ∘ Z)ᵀ dO`` and
``dP = Z ∘ dO Vᵀ`` with Z the kept mask scaled by 1/(1 - p), and delta = rowsum(O ⊙ dO) still
equals rowsum(P ∘ dP).
"""

import triton
import triton.language as tl

from .common import block_and_batch_head, load_rows, wide_stride
from .masking import key_blocks, query_blocks, visible
from .scores import NO_MASK, dropout_keep, score_mods, score_tile
from .varlen import program_block

LOG2_E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def backward_preprocess_kernel(
    Out, DOut, Delta,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    num_q_heads, seqlen_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
):
    stride_om, stride_dom = wide_stride(stride_om, WIDE_OFFSETS), wide_stride(stride_dom, WIDE_OFFSETS)
    m_block, batch_head = block_and_batch_head(tl.cdiv(seqlen_q, BLOCK_M))
    batch = batch_head // num_q_heads
    head = batch_head % num_q_heads
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
                + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DOut + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # [BLOCK_M]
    tl.store(Delta + batch_head.to(tl.int64) * seqlen_q + offs_m, delta, mask=offs_m < seqlen_q)


@triton.jit
def sinks_grad_kernel(Lse, Delta, Sinks, SinksGrad, stride_lb, stride_lh, stride_sh, batch, seqlen_q,
                      BLOCK: tl.constexpr, LSE_LOG2: tl.constexpr = False):
    """Program h: ``SinksGrad[h] = -sum over batches and rows of exp(sinks[h] - lse) * delta``
    (LSE_LOG2: the LSE is in log2 units, as the Hopper backward keeps it; Lse and Delta share strides).

    The sink's probability takes mass from every key and gives the output nothing, so its score's
    gradient is ``P(sink) * (0 - delta)``; a row that saw no key (LSE -inf) adds 0. One program per
    head sums in a fixed order: deterministic, and one launch.
    """
    head = tl.program_id(0)
    sink = tl.load(Sinks + head * stride_sh)
    if LSE_LOG2:
        sink = sink * 1.4426950408889634
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for b in range(0, batch):
        base = tl.cast(b, tl.int64) * stride_lb + head.to(tl.int64) * stride_lh
        for start in range(0, seqlen_q, BLOCK):
            rows = start + tl.arange(0, BLOCK)
            lse = tl.load(Lse + base + rows, mask=rows < seqlen_q, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse)  # P(sink) = 0, not inf * 0
            delta = tl.load(Delta + base + rows, mask=rows < seqlen_q, other=0.0)
            if LSE_LOG2:
                total += tl.math.exp2(sink - lse) * delta
            else:
                total += tl.exp(sink - lse) * delta
    tl.store(SinksGrad + head, -tl.sum(total, 0))


@triton.jit
def _load_row_stats(lse_ptr, delta_ptr, rows, seqlen_q, MASKED: tl.constexpr):
    """LSE (log2 units) and delta of some query rows; a row that saw no key gets LSE +inf, so P = 0."""
    if MASKED:
        lse = tl.load(lse_ptr + rows, mask=rows < seqlen_q, other=0.0)
        delta = tl.load(delta_ptr + rows, mask=rows < seqlen_q, other=0.0)
    else:
        lse = tl.load(lse_ptr + rows)
        delta = tl.load(delta_ptr + rows)
    lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2_E)
    return lse, delta


@triton.jit
def _dkdv_query_blocks(
    dk, dv,  # [BLOCK_N, BLOCK_D] and [BLOCK_N, BLOCK_DV] f32 accumulators
    k, v,  # [BLOCK_N, BLOCK_D], [BLOCK_N, BLOCK_DV]
    q_base, do_base, lse_ptr, delta_ptr,
    stride_qm, stride_qd, stride_dom, stride_dod,
    keys, first_key, offs_m, offs_d, offs_dv,
    m_start, m_end, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr,
):
    softcap_scale, slope, mask_ptr, stride_mm, stride_mn, seed, rng_row, threshold, dropout_scale = mods
    for start_m in range(m_start, m_end, BLOCK_M):
        rows = start_m + offs_m  # [BLOCK_M]
        q = load_rows(q_base + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd, rows, seqlen_q,
                       offs_d, HEAD_DIM, BLOCK_D, MASKED)  # [BLOCK_M, BLOCK_D]
        do = load_rows(do_base + rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod, rows, seqlen_q,
                        offs_dv, HEAD_DIM_V, BLOCK_DV, MASKED)  # [BLOCK_M, BLOCK_DV]
        lse, delta = _load_row_stats(lse_ptr, delta_ptr, rows, seqlen_q, MASKED)  # [BLOCK_M] each
        raw_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        if SOFTCAP or ALIBI or MASK != NO_MASK:
            scores_t, capped_t = score_tile(raw_t, rows[None, :], keys[:, None], seqlen_q, seqlen_k, qk_scale,
                                            softcap_scale, slope, mask_ptr, stride_mm, stride_mn,
                                            SOFTCAP, ALIBI, MASK)
        else:
            scores_t = raw_t * qk_scale
        probs_t = tl.math.exp2(scores_t - lse[None, :])  # [BLOCK_N, BLOCK_M]
        if MASKED:
            seen = visible(rows[None, :], keys[:, None], seqlen_k, lo, hi, HAS_LEFT, HAS_RIGHT)
            probs_t = tl.where(seen & (rows[None, :] < seqlen_q), probs_t, 0.0)
        if DROPOUT:  # the forward's bits, made in its [rows, keys] order
            keep_t = tl.trans(dropout_keep(seed, rng_row, rows, first_key, threshold, BLOCK_M, BLOCK_N))
            dv = tl.dot(tl.where(keep_t, probs_t * dropout_scale, 0.0).to(do.dtype), do, dv,
                        input_precision=DOT_PRECISION)
        else:
            dv = tl.dot(probs_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dprobs_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        if DROPOUT:
            dprobs_t = tl.where(keep_t, dprobs_t * dropout_scale, 0.0)
        dscores_t = probs_t * (dprobs_t - delta[None, :])  # [BLOCK_N, BLOCK_M]
        if SOFTCAP:
            dscores_t = dscores_t * (1.0 - capped_t * capped_t)
        dk = tl.dot(dscores_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def backward_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, CuSeqlensQ, CuSeqlensK, Tiles, AlibiSlopes, Mask, RngState,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_lb, stride_lh, stride_ab, stride_ah, stride_mb, stride_mh, stride_mm, stride_mn,
    num_q_heads, num_kv_heads, group_size, seqlen_q, seqlen_k, lo, hi, scale, qk_scale,
    softcap_scale, dropout_threshold, dropout_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
):
    stride_qm, stride_kn = wide_stride(stride_qm, WIDE_OFFSETS), wide_stride(stride_kn, WIDE_OFFSETS)
    stride_vn, stride_dom = wide_stride(stride_vn, WIDE_OFFSETS), wide_stride(stride_dom, WIDE_OFFSETS)
    stride_mm, stride_mn = wide_stride(stride_mm, WIDE_OFFSETS), wide_stride(stride_mn, WIDE_OFFSETS)
    stride_dkn, stride_dvn = wide_stride(stride_dkn, WIDE_OFFSETS), wide_stride(stride_dvn, WIDE_OFFSETS)
    total_q = seqlen_q  # the dropout counters' row numbering (packed: the total)
    # One key block of one KV head (packed sequences: an entry of the key-block list).
    past_end, n_block, batch, kv_head, q_start, k_start, seqlen_q, seqlen_k, lo, hi = program_block(
        Tiles, CuSeqlensQ, CuSeqlensK, num_kv_heads, seqlen_q, seqlen_k, lo, hi, tl.cdiv(seqlen_k, BLOCK_N), VARLEN)
    if past_end:
        return
    q_start = tl.cast(q_start, tl.int64)
    k_start = tl.cast(k_start, tl.int64)

    keys = n_block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    offs_dv = tl.arange(0, BLOCK_DV)  # [BLOCK_DV]
    k_mask = (keys[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    v_mask = (keys[:, None] < seqlen_k) & (offs_dv[None, :] < HEAD_DIM_V)
    k = tl.load(K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh + k_start * stride_kn
                + keys[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=k_mask, other=0.0)
    v = tl.load(V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh + k_start * stride_vn
                + keys[:, None] * stride_vn + offs_dv[None, :] * stride_vd, mask=v_mask, other=0.0)

    # Query rows that see this key block: [m_start, m_end); rows [full_start, full_end) see all of
    # it (whole query blocks inside Sq, so they run unmasked).
    m_start, full_start, full_end, m_end = query_blocks(
        n_block * BLOCK_N, BLOCK_N, seqlen_q, lo, hi, BLOCK_M, HAS_LEFT, HAS_RIGHT)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for member in range(0, group_size):
        head = kv_head * group_size + member
        q_base = Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh + q_start * stride_qm
        do_base = DOut + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh + q_start * stride_dom
        # Delta has the LSE's layout.
        row_stats = batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + q_start
        lse_ptr = Lse + row_stats
        delta_ptr = Delta + row_stats
        if VARLEN:
            rng_row = head * total_q + q_start
        else:
            rng_row = (batch * num_q_heads + head) * seqlen_q
        mods = score_mods(AlibiSlopes, Mask, RngState, stride_ab, stride_ah, stride_mb, stride_mh, stride_mm,
                          stride_mn, softcap_scale, dropout_threshold, dropout_scale, batch, head, rng_row,
                          ALIBI, MASK, DROPOUT)
        dk, dv = _dkdv_query_blocks(
            dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, stride_qm, stride_qd, stride_dom, stride_dod,
            keys, n_block * BLOCK_N, offs_m, offs_d, offs_dv, m_start, full_start, seqlen_q, seqlen_k, lo, hi,
            qk_scale, mods,
            HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, DOT_PRECISION,
            SOFTCAP, ALIBI, MASK, DROPOUT)
        dk, dv = _dkdv_query_blocks(
            dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, stride_qm, stride_qd, stride_dom, stride_dod,
            keys, n_block * BLOCK_N, offs_m, offs_d, offs_dv, full_start, full_end, seqlen_q, seqlen_k, lo, hi,
            qk_scale, mods,
            HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, DOT_PRECISION,
            SOFTCAP, ALIBI, MASK, DROPOUT)
        dk, dv = _dkdv_query_blocks(
            dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, stride_qm, stride_qd, stride_dom, stride_dod,
            keys, n_block * BLOCK_N, offs_m, offs_d, offs_dv, full_end, m_end, seqlen_q, seqlen_k, lo, hi, qk_scale,
            mods,
            HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, DOT_PRECISION,
            SOFTCAP, ALIBI, MASK, DROPOUT)

    dk = dk * scale
    tl.store(DK + batch.to(tl.int64) * stride_dkb + kv_head.to(tl.int64) * stride_dkh + k_start * stride_dkn
             + keys[:, None] * stride_dkn + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty), mask=k_mask)
    tl.store(DV + batch.to(tl.int64) * stride_dvb + kv_head.to(tl.int64) * stride_dvh + k_start * stride_dvn
             + keys[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=v_mask)


@triton.jit
def _dq_key_blocks(
    dq,  # [BLOCK_M, BLOCK_D] f32 accumulator
    q, do, lse, delta,  # [BLOCK_M, BLOCK_D], [BLOCK_M, BLOCK_DV], [BLOCK_M] x2
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    rows, offs_n, offs_d, offs_dv,
    n_start, n_end, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
    dmask_base, stride_gm,  # the attn_mask's gradient (MASK_GRAD): this (batch, head)'s [Sq, Sk] float32
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr, MASK_GRAD: tl.constexpr,
):
    softcap_scale, slope, mask_ptr, stride_mm, stride_mn, seed, rng_row, threshold, dropout_scale = mods
    for start_n in range(n_start, n_end, BLOCK_N):
        keys = start_n + offs_n  # [BLOCK_N]
        k = load_rows(k_base + keys[:, None] * stride_kn + offs_d[None, :] * stride_kd, keys, seqlen_k,
                       offs_d, HEAD_DIM, BLOCK_D, MASKED)  # [BLOCK_N, BLOCK_D]
        v = load_rows(v_base + keys[:, None] * stride_vn + offs_dv[None, :] * stride_vd, keys, seqlen_k,
                       offs_dv, HEAD_DIM_V, BLOCK_DV, MASKED)  # [BLOCK_N, BLOCK_DV]
        raw = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if SOFTCAP or ALIBI or MASK != NO_MASK:
            scores, capped = score_tile(raw, rows[:, None], keys[None, :], seqlen_q, seqlen_k, qk_scale,
                                        softcap_scale, slope, mask_ptr, stride_mm, stride_mn, SOFTCAP, ALIBI, MASK)
        else:
            scores = raw * qk_scale
        probs = tl.math.exp2(scores - lse[:, None])  # [BLOCK_M, BLOCK_N]
        if MASKED:
            seen = visible(rows[:, None], keys[None, :], seqlen_k, lo, hi, HAS_LEFT, HAS_RIGHT)
            probs = tl.where(seen, probs, 0.0)
        dprobs = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if DROPOUT:
            keep = dropout_keep(seed, rng_row, rows, start_n, threshold, probs.shape[0], BLOCK_N)
            dprobs = tl.where(keep, dprobs * dropout_scale, 0.0)
        dscores = probs * (dprobs - delta[:, None])  # [BLOCK_M, BLOCK_N]
        if MASK_GRAD:  # the mask is added to the score after the scale and softcap: its gradient is dS
            tl.store(dmask_base + rows.to(tl.int64)[:, None] * stride_gm + keys[None, :], dscores,
                     mask=(rows[:, None] < seqlen_q) & (keys[None, :] < seqlen_k))
        if SOFTCAP:
            dscores = dscores * (1.0 - capped * capped)
        dq = tl.dot(dscores.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def backward_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, CuSeqlensQ, CuSeqlensK, Tiles, AlibiSlopes, Mask, RngState, DMask,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_lb, stride_lh, stride_ab, stride_ah, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_gb, stride_gh, stride_gm,
    num_q_heads, group_size, seqlen_q, seqlen_k, lo, hi, scale, qk_scale,
    softcap_scale, dropout_threshold, dropout_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr,
    MASK_GRAD: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
):
    """dQ of BLOCK_M query rows; with MASK_GRAD also dS of those rows, the gradient of SDPA's float
    attn_mask, into DMask (B, Hq, Sq, Sk) float32."""
    stride_qm, stride_kn = wide_stride(stride_qm, WIDE_OFFSETS), wide_stride(stride_kn, WIDE_OFFSETS)
    stride_vn, stride_dom = wide_stride(stride_vn, WIDE_OFFSETS), wide_stride(stride_dom, WIDE_OFFSETS)
    stride_mm, stride_mn = wide_stride(stride_mm, WIDE_OFFSETS), wide_stride(stride_mn, WIDE_OFFSETS)
    stride_dqm = wide_stride(stride_dqm, WIDE_OFFSETS)
    total_q = seqlen_q  # the dropout counters' row numbering (packed: the total)
    past_end, m_block, batch, head, q_start, k_start, seqlen_q, seqlen_k, lo, hi = program_block(
        Tiles, CuSeqlensQ, CuSeqlensK, num_q_heads, seqlen_q, seqlen_k, lo, hi, tl.cdiv(seqlen_q, BLOCK_M), VARLEN)
    if past_end:
        return
    q_start = tl.cast(q_start, tl.int64)
    k_start = tl.cast(k_start, tl.int64)
    kv_head = head // group_size

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    offs_dv = tl.arange(0, BLOCK_DV)  # [BLOCK_DV]
    q_mask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh + q_start * stride_qm
                + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    do = tl.load(DOut + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh + q_start * stride_dom
                 + rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=(rows[:, None] < seqlen_q) & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    row_stats = batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + q_start
    lse, delta = _load_row_stats(Lse + row_stats, Delta + row_stats, rows, seqlen_q, True)
    k_base = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh + k_start * stride_kn
    v_base = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh + k_start * stride_vn
    if VARLEN:
        rng_row = head * total_q + q_start
    else:
        rng_row = (batch * num_q_heads + head) * seqlen_q
    mods = score_mods(AlibiSlopes, Mask, RngState, stride_ab, stride_ah, stride_mb, stride_mh, stride_mm, stride_mn,
                      softcap_scale, dropout_threshold, dropout_scale, batch, head, rng_row,
                      ALIBI, MASK, DROPOUT)
    dmask_base = DMask + batch.to(tl.int64) * stride_gb + head.to(tl.int64) * stride_gh

    # The forward's key ranges: masked, whole blocks every row sees, masked.
    kv_start, full_start, full_end, kv_end = key_blocks(
        m_block * BLOCK_M, BLOCK_M, seqlen_k, lo, hi, BLOCK_N, HAS_LEFT, HAS_RIGHT)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_LEFT:
        dq = _dq_key_blocks(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                            rows, offs_n, offs_d, offs_dv, kv_start, full_start, seqlen_q, seqlen_k, lo, hi,
                            qk_scale, mods,
                            dmask_base, stride_gm,
                            HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, DOT_PRECISION,
                            SOFTCAP, ALIBI, MASK, DROPOUT, MASK_GRAD)
    dq = _dq_key_blocks(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                        rows, offs_n, offs_d, offs_dv, full_start, full_end, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
                        dmask_base, stride_gm,
                        HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, DOT_PRECISION,
                        SOFTCAP, ALIBI, MASK, DROPOUT, MASK_GRAD)
    dq = _dq_key_blocks(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                        rows, offs_n, offs_d, offs_dv, full_end, kv_end, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
                        dmask_base, stride_gm,
                        HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, DOT_PRECISION,
                        SOFTCAP, ALIBI, MASK, DROPOUT, MASK_GRAD)
    dq = dq * scale
    tl.store(DQ + batch.to(tl.int64) * stride_dqb + head.to(tl.int64) * stride_dqh + q_start * stride_dqm
             + rows[:, None] * stride_dqm + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty), mask=q_mask)
