"""The Hopper (sm_90) backward of the 256-wide tiles (head dims 136-256), written in Gluon.

At these widths one warpgroup cannot hold dK and dV of its keys (two [64, 256] fp32 tiles are 256
registers a thread), so the two consumer warpgroups share one block of 64 keys and split the work
by role and by columns:

* consumer 0 computes Sᵀ = K Qᵀ and Pᵀ (the masked exponentials against the forward's LSE) and
  puts Pᵀ in shared memory; consumer 1 computes dPᵀ = V dOᵀ, reads Pᵀ, and puts
  dSᵀ = Pᵀ ⊙ (dPᵀ − delta) in shared memory;
* each then adds its columns of dV += Pᵀ dO and dK += dSᵀ Q (consumer 0 the first 128, consumer 1
  the rest) and computes its share of dQ = dS K (transposed, 64 columns at a time), which the bulk
  copy engine adds into the fp32 dQ buffer (a TMA reduce-add, as in
  :mod:`fmha.backends.gluon_sm90.backward`).

Head dims up to 192 build with COLUMNS = 192: the products read only the first 192 columns of the
tiles (Sᵀ and dPᵀ as two products, over 128 and 64 columns), consumer 1 owns 64 columns of dK and
dV, and the three 64-column chunks of dQ go one to consumer 0 and two to consumer 1, which has the
fewer columns of dK and dV. That is a quarter fewer products than the 256-wide build.

One load warp copies the block's K and V once, then Q through two slots and dO through one, for
every query block of every query head of the GQA group that sees the keys. Key blocks that cross
the window's edges or the end of K take the per-score mask (:mod:`fmha.backends.gluon_sm90.masking`).
Shared memory: K, V, two Q slots and dO (160 KiB), Pᵀ and dSᵀ (16 KiB) and one dQ staging tile per
consumer (32 KiB).

Score features as in :mod:`fmha.backends.gluon_sm90.backward`, all on consumer 0, which alone holds
the scores: softcap, ALiBi, SDPA's attn_mask and dropout's flags (the forward's pattern, drawn
again). With softcap or dropout it also puts the float32 tile that dS needs in shared memory
(16 KiB more): P ⊙ (1 − tanh²) with softcap, its sign negative where dropout drops the score.
Pᵀ, which both dV products read, is then the kept probabilities. Packed sequences (VARLEN) take
key blocks from a tile list, as the narrower backward does.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from ...compat import cta_barrier, reinterpret_shared, tma_load
from .backward import LOG2_E, _add_dq_tile, _program_tile, backward_registers
from .forward import CONSUMER_WARPS, accumulator_layout, columns_product, operand_layout
from .masking import query_blocks, visible_block_transposed
from .scores import (NO_MASK, STRIDED_MASK_KEYS, dropout_key, expand_mask, masked_scores, modified_scores, pair_rows,
                     transposed_draw_layout, transposed_keep_bits, unpack_keep)

WIDE_KEYS = gl.constexpr(64)  # keys per program, shared by both consumers
HALF_COLUMNS = gl.constexpr(128)  # consumer 0's columns of dK and dV; the products' first part
DQ_CHUNK = gl.constexpr(64)  # dQ columns per product and reduce-add


@gluon.constexpr_function
def _own_columns(consumer, columns):
    """The consumer's columns of dK and dV (from ``consumer * HALF_COLUMNS``)."""
    return HALF_COLUMNS if consumer == 0 else columns - HALF_COLUMNS


@gluon.constexpr_function
def _first_dq_chunk(consumer, columns):
    """The first of the consumer's dQ columns: 256 columns split 128 / 128, 192 split 64 / 128."""
    return 0 if consumer == 0 else columns - 2 * DQ_CHUNK


@gluon.constexpr_function
def _dq_chunks(consumer, columns):
    """How many DQ_CHUNK-column products of dQ the consumer computes."""
    return (columns // DQ_CHUNK - 2) if consumer == 0 else 2


@gluon.constexpr_function
def _worker_registers():
    _, consumer, loader = backward_registers(2)
    return [consumer, loader]


@gluon.jit
def _wide_load_partition(args, BLOCK_M: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                         VARLEN: gl.constexpr, HEAD_GROUP: gl.constexpr):
    (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, q_ready, q_free, do_ready, do_free,
     num_kv_heads, group_size, seqlen_q, seqlen_k, lo, hi, num_tiles, sequences) = args
    valid, batch, kv_head, n_block, q_start, seqlen_q, k_start, _, lo, hi, _ = _program_tile(
        gl.program_id(0), num_tiles, sequences, num_kv_heads, seqlen_q, seqlen_k, lo, hi, WIDE_KEYS, VARLEN,
        HEAD_GROUP)
    if valid:
        _wide_load_tile(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, q_ready, q_free,
                        do_ready, do_free, group_size, batch, kv_head, n_block * WIDE_KEYS, q_start, seqlen_q, k_start,
                        lo, hi, BLOCK_M, HAS_LEFT, HAS_RIGHT)


@gluon.jit
def _wide_load_tile(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, q_ready, q_free,
                    do_ready, do_free, group_size, batch, kv_head, first_key, q_start, seqlen_q, k_start, lo, hi,
                    BLOCK_M: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """The block's K and V once, then Q and dO of every query block that sees it, for each query
    head of the KV head (rows and keys counted from q_start and k_start)."""
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [batch, kv_head, k_start + first_key, 0], kv_ready, k_smem)
    tma_load(v_desc, [batch, kv_head, k_start + first_key, 0], kv_ready, v_smem)
    m_start, _, _, m_end = query_blocks(first_key, WIDE_KEYS, seqlen_q, lo, hi, BLOCK_M, HAS_LEFT, HAS_RIGHT)
    steps = (m_end - m_start) // BLOCK_M
    for member in range(group_size):
        head = kv_head * group_size + member
        for step in range(steps):
            position = member * steps + step
            slot = position % 2
            first_row = q_start + m_start + step * BLOCK_M
            # A free barrier completes once per use; the first wait finds it free.
            mbarrier.wait(q_free.index(slot), ((position // 2) & 1) ^ 1)
            mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
            tma_load(q_desc, [batch, head, first_row, 0], q_ready.index(slot), q_smem.index(slot))
            mbarrier.wait(do_free, (position & 1) ^ 1)
            mbarrier.expect(do_ready, do_desc.block_type.nbytes)
            tma_load(do_desc, [batch, head, first_row, 0], do_ready, do_smem)


@gluon.jit
def _wide_steps(dk, dv, shared, rows_base, batch, head, keys, position_base, m_first, m_begin, m_stop, q_start, seqlen_q,
                seqlen_k, lo, hi, qk_scale, mods, dropout, CONSUMER: gl.constexpr, MASKED: gl.constexpr,
                HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                VARLEN: gl.constexpr, DROPOUT: gl.constexpr, MASK: gl.constexpr, COLUMNS: gl.constexpr):
    """Query blocks [m_begin, m_stop) of one head (the block at row m sits at step position
    position_base + (m - m_first) / BLOCK_M); returns the consumer's dK and dV columns. Rows and
    keys count from the sequence's start (q_start in Q's rows). ``mods`` and ``dropout`` as in
    :func:`fmha.backends.gluon_sm90.backward._query_steps` (consumer 0 reads them; consumer 1 only
    ``dropout[3]``, the kept scores' factor)."""
    (q_smem, do_smem, k_smem, v_smem, pt_smem, dst_smem, gt_smem, dq_smem, q_ready, q_free, do_ready, do_free, p_ready,
     p_free, ds_ready, ds_free, dq_desc, Lse2, Delta) = shared
    HEAD_DIM: gl.constexpr = k_smem.shape[3]
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = accumulator_layout(BLOCK_M)  # [WIDE_KEYS, BLOCK_M]: keys are the rows
    row_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    OWN_COLUMNS: gl.constexpr = _own_columns(CONSUMER, COLUMNS)
    a_layout: gl.constexpr = operand_layout(OWN_COLUMNS)  # Pᵀ or dSᵀ as the register A operand of dV, dK
    COLUMN0: gl.constexpr = CONSUMER * HALF_COLUMNS
    # dS takes a float32 tile of consumer 0's (softcap's factor, dropout's flags) in place of Pᵀ.
    GRADIENT_TILE: gl.constexpr = SOFTCAP or DROPOUT
    keys_all = k_smem.reshape([WIDE_KEYS, HEAD_DIM])
    values_all = v_smem.reshape([WIDE_KEYS, HEAD_DIM])
    do = do_smem.reshape([BLOCK_M, HEAD_DIM])
    own_dq = dq_smem.index(CONSUMER)
    no_scores = gl.zeros([WIDE_KEYS, BLOCK_M], gl.float32, layout=s_layout)
    for m in range(m_begin, m_stop, BLOCK_M):
        position = position_base + (m - m_first) // BLOCK_M
        slot = position % 2
        phase = position & 1
        rows = m + gl.arange(0, BLOCK_M, layout=row_layout)
        q = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
        if CONSUMER == 0:  # Sᵀ, then Pᵀ for both consumers
            if DROPOUT:  # the step's flags, drawn while only dK and dV hold registers
                RngState, rng_row, high_bound, _, first_key, key_rows = dropout
                row_words = pair_rows(m, rng_row, BLOCK_M // 2, gl.SliceLayout(0, transposed_draw_layout(BLOCK_M)))
                keep_bits = transposed_keep_bits(first_key, key_rows, row_words, dropout_key(RngState), high_bound,
                                                 BLOCK_M)
            mbarrier.wait(q_ready.index(slot), (position // 2) & 1)
            scores_t = columns_product(keys_all, q, no_scores, COLUMNS)
            lse = gl.load(Lse2 + rows_base + rows)  # log2 units; padded rows +inf
            if MASK != NO_MASK:  # the attn_mask's [keys, rows] tile, read while Sᵀ runs
                mask_rows = gl.minimum(rows, seqlen_q - 1)
                mask_tile = gl.load(mods[4] + (mods[5][:, None] + (mask_rows * mods[6])[None, :]))
            scores_t = warpgroup_mma_wait(0, deps=(scores_t,))
            scale_t = qk_scale
            if SOFTCAP or ALIBI:
                row_positions = (rows + mods[2]).to(gl.float32)
                scores_t, capped_t = modified_scores(scores_t, row_positions[None, :], mods[3][:, None], qk_scale,
                                                     mods[0], mods[1], SOFTCAP, ALIBI)
                scale_t = 1.0
            if MASK != NO_MASK:
                mask_tile = expand_mask(mask_tile, mods[4].dtype.element_ty, s_layout, MASK, STRIDED_MASK_KEYS)
                scores_t, scale_t = masked_scores(scores_t, scale_t, mask_tile, MASK)
            probs_t = gl.exp2(scores_t * scale_t - lse[None, :])
            if MASKED:  # rows past the sequence's end (packed: the next sequence's) see nothing
                row_end = seqlen_q if VARLEN else m + BLOCK_M  # dense: padded rows have an LSE of +inf
                seen = visible_block_transposed(keys, gl.arange(0, BLOCK_M, layout=row_layout), m, row_end, seqlen_k,
                                                lo, hi, HAS_LEFT, HAS_RIGHT)
                probs_t = gl.where(seen, probs_t, 0.0)
            mbarrier.wait(p_free, phase ^ 1)  # consumer 1 has read the previous Pᵀ
            if GRADIENT_TILE:  # stored first: its registers are free before Pᵀ's conversion
                gradient_t = probs_t
                if SOFTCAP:  # d(softcap · tanh(s / softcap)) / ds
                    gradient_t = gradient_t * (1.0 - capped_t * capped_t)
                if DROPOUT:  # dropped scores carry a minus sign to dS
                    keep = gl.convert_layout(unpack_keep(keep_bits, BLOCK_M), s_layout, assert_trivial=True)
                    gradient_t = gl.where(keep, gradient_t, -gradient_t)
                    probs_t = gl.where(keep, probs_t, 0.0)
                gt_smem.store(gradient_t)
            probs_t = probs_t.to(dtype)
            pt_smem.store(probs_t)
            fence_async_shared()
            cta_barrier()  # every thread's part of Pᵀ is written before the arrival
            mbarrier.arrive(p_ready, count=1)
            mbarrier.wait(do_ready, phase)
            dv = warpgroup_mma(gl.convert_layout(probs_t, a_layout), do.slice(COLUMN0, OWN_COLUMNS, dim=1), dv,
                               is_async=True)
            mbarrier.wait(ds_ready, phase)
            dk = warpgroup_mma(dst_smem, q.slice(COLUMN0, OWN_COLUMNS, dim=1), dk, is_async=True)
            dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
        else:  # dPᵀ, then dSᵀ for both consumers
            mbarrier.wait(do_ready, phase)
            dprobs_t = columns_product(values_all, do, no_scores, COLUMNS)
            delta = gl.load(Delta + rows_base + rows)
            dprobs_t = warpgroup_mma_wait(0, deps=(dprobs_t,))
            mbarrier.wait(p_ready, phase)
            if GRADIENT_TILE:
                gradient_t = gt_smem.load(s_layout)
                if DROPOUT:
                    dprobs_t = gl.where(gradient_t > 0.0, dprobs_t * dropout[3], 0.0)
                    gradient_t = gl.abs(gradient_t)
            else:
                gradient_t = pt_smem.load(s_layout).to(gl.float32)
            dscores_t = (gradient_t * (dprobs_t - delta[None, :])).to(dtype)
            mbarrier.wait(ds_free, phase ^ 1)  # both consumers are done with the previous dSᵀ
            dst_smem.store(dscores_t)
            fence_async_shared()
            cta_barrier()
            mbarrier.arrive(ds_ready, count=1)
            dv = warpgroup_mma(pt_smem, do.slice(COLUMN0, OWN_COLUMNS, dim=1), dv, is_async=True)
            mbarrier.wait(q_ready.index(slot), (position // 2) & 1)
            dk = warpgroup_mma(gl.convert_layout(dscores_t, a_layout), q.slice(COLUMN0, OWN_COLUMNS, dim=1), dk,
                               is_async=True)
            dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
            mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(do_free, count=1)
        mbarrier.arrive(q_free.index(slot), count=1)  # dQ reads dSᵀ and K only
        DQ_FIRST: gl.constexpr = _first_dq_chunk(CONSUMER, COLUMNS)
        DQ_LAST: gl.constexpr = DQ_FIRST + (_dq_chunks(CONSUMER, COLUMNS) - 1) * DQ_CHUNK
        if DQ_LAST > DQ_FIRST:
            _add_dq_tile(_dq_columns(keys_all, dst_smem, DQ_FIRST), own_dq, dq_desc, [batch, head, q_start + m, DQ_FIRST])
        dq_t = _dq_columns(keys_all, dst_smem, DQ_LAST)
        mbarrier.arrive(ds_free, count=1)  # the consumer's products that read dSᵀ are done
        _add_dq_tile(dq_t, own_dq, dq_desc, [batch, head, q_start + m, DQ_LAST])
    return dk, dv


@gluon.jit
def _dq_columns(keys_all, dst_smem, COLUMN0: gl.constexpr):
    """dQᵀ = Kᵀ dSᵀ for DQ_CHUNK columns from COLUMN0: the transposed tile stores into the staging
    buffer without bank conflicts."""
    BLOCK_M: gl.constexpr = dst_smem.shape[1]
    dq_t = warpgroup_mma(keys_all.slice(COLUMN0, DQ_CHUNK, dim=1).permute((1, 0)), dst_smem,
                         gl.zeros([DQ_CHUNK, BLOCK_M], gl.float32, layout=accumulator_layout(BLOCK_M)), use_acc=False,
                         is_async=True)
    return warpgroup_mma_wait(0, deps=(dq_t,))


@gluon.jit
def _wide_consumer_partition(args, CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, HAS_LEFT: gl.constexpr,
                             HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, VARLEN: gl.constexpr,
                             DROPOUT: gl.constexpr, MASK: gl.constexpr, HEAD_GROUP: gl.constexpr,
                             COLUMNS: gl.constexpr):
    (shared, kv_ready, gradients, num_q_heads, num_kv_heads, group_size, padded_q, seqlen_q, seqlen_k, lo, hi, scale,
     qk_scale, score_args, num_tiles, sequences) = args
    valid, batch, kv_head, n_block, q_start, seq_q, k_start, seq_k, seq_lo, seq_hi, sequence = _program_tile(
        gl.program_id(0), num_tiles, sequences, num_kv_heads, seqlen_q, seqlen_k, lo, hi, WIDE_KEYS, VARLEN,
        HEAD_GROUP)
    if valid:
        _wide_consumer_tile(shared, kv_ready, gradients, num_q_heads, group_size, padded_q, scale, qk_scale, score_args,
                            batch, kv_head, n_block * WIDE_KEYS, q_start, seq_q, k_start, seq_k, seq_lo, seq_hi,
                            sequence, seqlen_q, CONSUMER, BLOCK_M, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, VARLEN,
                            DROPOUT, MASK, COLUMNS)


@gluon.jit
def _wide_consumer_tile(shared, kv_ready, gradients, num_q_heads, group_size, padded_q, scale, qk_scale, score_args,
                        batch, kv_head, first_key, q_start, seqlen_q, k_start, seqlen_k, lo, hi, sequence,
                        rows_per_head, CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, HAS_LEFT: gl.constexpr,
                        HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, VARLEN: gl.constexpr,
                        DROPOUT: gl.constexpr, MASK: gl.constexpr, COLUMNS: gl.constexpr):
    """The consumer's columns of dK and dV of the 64 keys from ``first_key`` (counted from k_start)
    over every query block and query head that sees them, then their stores. ``rows_per_head``: Sq,
    or the packed total (the dropout counters' numbering of rows)."""
    DK, DV, dk_strides, dv_strides, head_dim = gradients
    (AlibiSlopes, stride_ab, stride_ah, softcap_scale, RngState, dropout_threshold, dropout_scale, Mask,
     mask_strides) = score_args
    dtype: gl.constexpr = shared[2].dtype
    s_layout: gl.constexpr = accumulator_layout(BLOCK_M)
    OWN_COLUMNS: gl.constexpr = _own_columns(CONSUMER, COLUMNS)
    kv_layout: gl.constexpr = accumulator_layout(OWN_COLUMNS)
    keys = first_key + gl.arange(0, WIDE_KEYS, layout=gl.SliceLayout(1, s_layout))
    m_start, full_start, full_end, m_end = query_blocks(first_key, WIDE_KEYS, seqlen_q, lo, hi, BLOCK_M, HAS_LEFT,
                                                        HAS_RIGHT)
    if first_key + WIDE_KEYS > seqlen_k:  # keys past the end: every block takes the mask
        full_end = full_start
    steps = (m_end - m_start) // BLOCK_M
    dk = gl.zeros([WIDE_KEYS, OWN_COLUMNS], gl.float32, layout=kv_layout)
    dv = gl.zeros([WIDE_KEYS, OWN_COLUMNS], gl.float32, layout=kv_layout)
    mbarrier.wait(kv_ready, 0)
    for member in range(group_size):
        head = kv_head * group_size + member
        # of the (B, Hq, padded_q) row statistics; packed sequences: (1, Hq, padded total)
        rows_base = (batch * num_q_heads + head).to(gl.int64) * padded_q + q_start
        position_base = member * steps
        slope = 0.0
        if ALIBI:
            slope = gl.load(AlibiSlopes + sequence.to(gl.int64) * stride_ab + head.to(gl.int64) * stride_ah) * LOG2_E
        mask_base, mask_columns, stride_mm = 0, 0, 0
        if MASK != NO_MASK:  # the (batch, head)'s attn_mask, and its offsets of the keys (past the end: the last)
            stride_mb, stride_mh, stride_mm, stride_mn = mask_strides
            mask_base = Mask + sequence.to(gl.int64) * stride_mb + head.to(gl.int64) * stride_mh
            mask_columns = gl.minimum(keys, seqlen_k - 1) * stride_mn.to(gl.int32)
            stride_mm = stride_mm.to(gl.int32)
        mods = (softcap_scale, slope, seqlen_k - seqlen_q, keys.to(gl.float32), mask_base, mask_columns, stride_mm)
        dropout = (0, 0, 0, 0.0, 0, 0)
        if DROPOUT:  # rows numbered as the forward numbers them: (batch, head, row), or (head, packed row)
            rng_row = (batch * num_q_heads + head).to(gl.int64) * rows_per_head + q_start
            key_rows = gl.arange(0, 32, layout=gl.SliceLayout(1, transposed_draw_layout(BLOCK_M)))
            dropout = (RngState, rng_row, (dropout_threshold.to(gl.uint32) << 24) - 1, dropout_scale, first_key,
                       key_rows)
        dk, dv = _wide_steps(dk, dv, shared, rows_base, batch, head, keys, position_base, m_start, m_start, full_start,
                             q_start, seqlen_q, seqlen_k, lo, hi, qk_scale, mods, dropout, CONSUMER, True, HAS_LEFT,
                             HAS_RIGHT, SOFTCAP, ALIBI, VARLEN, DROPOUT, MASK, COLUMNS)
        dk, dv = _wide_steps(dk, dv, shared, rows_base, batch, head, keys, position_base, m_start, full_start, full_end,
                             q_start, seqlen_q, seqlen_k, lo, hi, qk_scale, mods, dropout, CONSUMER, False, HAS_LEFT,
                             HAS_RIGHT, SOFTCAP, ALIBI, VARLEN, DROPOUT, MASK, COLUMNS)
        dk, dv = _wide_steps(dk, dv, shared, rows_base, batch, head, keys, position_base, m_start, full_end, m_end,
                             q_start, seqlen_q, seqlen_k, lo, hi, qk_scale, mods, dropout, CONSUMER, True, HAS_LEFT,
                             HAS_RIGHT, SOFTCAP, ALIBI, VARLEN, DROPOUT, MASK, COLUMNS)
    if DROPOUT:  # P·dO summed the kept probabilities
        dv = dv * dropout_scale
    # The consumer's columns (once per program), through its dQ staging tile: keys past the
    # sequence's end and columns past the call's head dim are left out.
    dk = (dk * scale).to(dtype)
    dv = dv.to(dtype)
    staging = shared[7].index(CONSUMER)
    dk_base = DK + batch.to(gl.int64) * dk_strides[0] + kv_head.to(gl.int64) * dk_strides[1]
    dv_base = DV + batch.to(gl.int64) * dv_strides[0] + kv_head.to(gl.int64) * dv_strides[1]
    _store_block(dk, staging, dk_base, dk_strides[2], k_start, first_key, seqlen_k, CONSUMER * HALF_COLUMNS, head_dim)
    _store_block(dv, staging, dv_base, dv_strides[2], k_start, first_key, seqlen_k, CONSUMER * HALF_COLUMNS, head_dim)


@gluon.jit
def _store_block(values, staging, base, stride_row, k_start, first_key, seqlen_k, column0, head_dim):
    """A consumer's [WIDE_KEYS, columns] block of dK or dV (16-bit) into rows ``first_key``.. and
    columns ``column0``.. of a (keys, head dim) matrix at ``base``, through ``staging`` (the
    consumer's float32 dQ tile, the same bytes): the accumulator layout's scattered 4-byte pieces
    become 16-byte stores along each row."""
    ROWS: gl.constexpr = values.shape[0]
    COLUMNS: gl.constexpr = values.shape[1]
    THREADS_PER_ROW: gl.constexpr = COLUMNS // 8
    tile = reinterpret_shared(staging, values.dtype, [ROWS, COLUMNS],
                              gl.NVMMASharedLayout.get_default_for([ROWS, COLUMNS], values.dtype))
    tma.store_wait(0)  # the last dQ tile (or the block before) has left the buffer
    cta_barrier()
    tile.store(values)
    cta_barrier()  # every row is in shared memory before any thread reads another's
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // THREADS_PER_ROW, THREADS_PER_ROW], [CONSUMER_WARPS, 1],
                                            [1, 0])
    out = tile.load(layout)
    rows = first_key + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    columns = column0 + gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, layout))
    pointers = base + (k_start + rows).to(gl.int64)[:, None] * stride_row + columns[None, :]
    gl.store(pointers, out, mask=(rows[:, None] < seqlen_k) & (columns[None, :] < head_dim))


@gluon.jit
def attention_backward_wide_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, DK, DV, Lse2, Delta, AlibiSlopes, RngState, CuSeqlensQ, CuSeqlensK, Tiles,
    Mask, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_ab, stride_ah,
    stride_mb, stride_mh, stride_mm, stride_mn,
    padded_q, num_q_heads, num_kv_heads, group_size, seqlen_q, seqlen_k, lo, hi, num_tiles, head_dim,
    dropout_threshold, scale, qk_scale, softcap_scale, dropout_scale,
    BLOCK_M: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
    ALIBI: gl.constexpr, VARLEN: gl.constexpr, DROPOUT: gl.constexpr, MASK: gl.constexpr, HEAD_GROUP: gl.constexpr,
    COLUMNS: gl.constexpr,
):
    """One program per (batch, KV head, block of 64 keys), num_tiles of them. Descriptors are
    (B, H, S, D) at the tiles' width of 256 (the call's head_dim may be narrower: the copies fill
    zeros past it; COLUMNS, 192 or 256, are the columns the products read): Q and dO in blocks of BLOCK_M rows, K and V of the program's keys, dQ's zeroed
    fp32 buffer (B, Hq, padded_q, D) in [BLOCK_M, 64] blocks. Lse2 (log2 units) and Delta are flat
    (B·Hq·padded_q) fp32 vectors (:mod:`fmha.backends.triton.backward_rows`); DK and DV take the
    keys' gradients through their strides (the last one 1).

    Score features as in :func:`fmha.backends.gluon_sm90.backward.attention_backward_hopper_kernel`
    (SOFTCAP: ``qk_scale`` is ``scale / softcap``; ALIBI, DROPOUT, MASK with their pointers and
    strides; the sinks are in the LSE). Packed sequences (VARLEN): the descriptors and DK, DV view
    (total, H, D) tensors as (1, H, total, D); seqlen_q and seqlen_k are the totals; program i takes
    entry i of the key blocks' list in ``Tiles`` (with CuSeqlensQ and CuSeqlensK); the row
    statistics are (Hq, padded total)."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    transposed_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WIDE_KEYS, BLOCK_M], dtype)
    pt_smem = gl.allocate_shared_memory(dtype, [WIDE_KEYS, BLOCK_M], transposed_layout)
    dst_smem = gl.allocate_shared_memory(dtype, [WIDE_KEYS, BLOCK_M], transposed_layout)
    if SOFTCAP or DROPOUT:  # written and read in the accumulator layout: any layout without bank conflicts
        gradient_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WIDE_KEYS, BLOCK_M], gl.float32)
        gt_smem = gl.allocate_shared_memory(gl.float32, [WIDE_KEYS, BLOCK_M], gradient_layout)
    else:
        gt_smem = pt_smem  # not read
    dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    do_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    p_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    p_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    ds_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    ds_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    mbarrier.init(kv_ready, count=1)
    for slot in gl.static_range(2):
        mbarrier.init(q_ready.index(slot), count=1)
        mbarrier.init(q_free.index(slot), count=2)  # one arrival per consumer
    mbarrier.init(do_ready, count=1)
    mbarrier.init(do_free, count=2)
    mbarrier.init(p_ready, count=1)  # consumer 0 writes Pᵀ
    mbarrier.init(p_free, count=1)  # consumer 1 reads it
    mbarrier.init(ds_ready, count=1)  # consumer 1 writes dSᵀ
    mbarrier.init(ds_free, count=2)  # both read it
    shared = (q_smem, do_smem, k_smem, v_smem, pt_smem, dst_smem, gt_smem, dq_smem, q_ready, q_free, do_ready, do_free,
              p_ready, p_free, ds_ready, ds_free, dq_desc, Lse2, Delta)
    gradients = (DK, DV, (stride_dkb, stride_dkh, stride_dkn), (stride_dvb, stride_dvh, stride_dvn), head_dim)
    score_args = (AlibiSlopes, stride_ab, stride_ah, softcap_scale, RngState, dropout_threshold, dropout_scale, Mask,
                  (stride_mb, stride_mh, stride_mm, stride_mn))
    sequences = (CuSeqlensQ, CuSeqlensK, Tiles)
    consumer_args = (shared, kv_ready, gradients, num_q_heads, num_kv_heads, group_size, padded_q, seqlen_q, seqlen_k,
                     lo, hi, scale, qk_scale, score_args, num_tiles, sequences)
    load_args = (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, q_ready, q_free,
                 do_ready, do_free, num_kv_heads, group_size, seqlen_q, seqlen_k, lo, hi, num_tiles, sequences)
    gl.static_assert(CONSUMER_WARPS == 4)
    gl.warp_specialize(
        [(_wide_consumer_partition, (consumer_args, 0, BLOCK_M, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, VARLEN, DROPOUT,
                                     MASK, HEAD_GROUP, COLUMNS)),
         (_wide_consumer_partition, (consumer_args, 1, BLOCK_M, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, VARLEN, DROPOUT,
                                     MASK, HEAD_GROUP, COLUMNS)),
         (_wide_load_partition, (load_args, BLOCK_M, HAS_LEFT, HAS_RIGHT, VARLEN, HEAD_GROUP))],
        worker_num_warps=[CONSUMER_WARPS, 1], worker_num_regs=_worker_registers())
