"""The fused backward for Hopper (sm_90), written in Gluon: dK and dV with K and V resident, dQ
summed into an fp32 buffer with atomic adds, in one pass over the query blocks.

Same math as :mod:`fmha.backends.triton.backward` (P recomputed from Q, K and the forward's LSE;
``dS = P ⊙ (dP − delta)``), scheduled for this chip:

* a CTA owns BLOCK_N = 64 x CONSUMERS keys of one (batch, KV head) and walks the query blocks of
  every query head in its GQA group, so dK and dV are summed over the group in registers;
* one load warp streams Q and dO blocks through a ring of STAGES shared-memory slots with bulk
  tensor copies (TMA), after loading the CTA's K and V once;
* each consumer warpgroup owns 64 of the keys and computes, transposed so that the keys are the
  rows of every product: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (both issued at once), Pᵀ, dV += Pᵀ dO and
  dSᵀ; dK += dSᵀ Q runs on the tensor cores while dSᵀ goes to shared memory;
* dQ = dS K needs every key of the tile, so it waits until each consumer's half of dSᵀ is in
  shared memory. At head dim 128 each consumer then computes half of dQ's columns; at 64 one
  consumer computes the whole tile, taking turns step by step (the other goes on to its next
  step). Both compute it transposed (dQᵀ = Kᵀ dSᵀ), which stores into shared memory without
  bank conflicts, and the bulk copy engine adds the tile from there into an fp32 buffer (a TMA
  reduce-add); with DQ_LATE the tile is stored once the next step's first products are issued,
  and with DQ_EARLY (head dim 128) the dQ product is issued behind dK's, before waiting for dK and dV.
  The order of the adds varies run to run: with ``deterministic=True`` this backend refuses the
  call and the portable backward, which has no atomics, runs instead.

The row statistics come from a preparation kernel (:mod:`fmha.backends.triton.backward_rows`):
delta and the LSE in log2 units, padded to whole query blocks (padded rows have LSE +inf, so P = 0
there), which the load warp copies in with Q and dO; it also zeroes the dQ buffer. Key blocks that cross the window's edges or the end of K take the
per-score mask of :mod:`fmha.backends.gluon_sm90.masking`; whole blocks inside it take none.
SDPA's attn_mask (MASK) is read per step, one element per score of the transposed tile, once Sᵀ
has landed (while dPᵀ runs): its rows lie apart in memory, so no two of a thread's elements share
a load.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ...compat import cta_barrier, tma_atomic_add, tma_load, tma_store
from .forward import CONSUMER_WARPS, _store_rows, accumulator_layout, operand_layout
from .masking import head_and_entry, query_blocks, sequence_span, visible, visible_block_transposed
from .scores import (NO_MASK, STRIDED_MASK_KEYS, dropout_key, expand_mask, masked_scores, modified_scores, pair_rows,
                     transposed_draw_layout, transposed_keep_bits, unpack_keep)
from .tile_queue import allocate_tile_slots, draw_tile, hand_out_tile, take_tile

LOG2_E: gl.constexpr = gl.constexpr(1.4426950408889634)

CONSUMER_KEYS = gl.constexpr(64)  # keys per consumer warpgroup: one wgmma row block
_ROW_STATS_LAYOUT = gl.constexpr(gl.BlockedLayout([2], [32], [1], [0]))  # 64 rows over the load warp


@gluon.constexpr_function
def backward_registers(consumers: int) -> tuple[int, int, int]:
    """(registers per thread at launch, per consumer thread, per load-warp thread): one CTA per
    multiprocessor, the load warp's registers given to the consumers (setmaxnreg)."""
    threads = 128 * (consumers + 1)
    launch = 65536 // threads // 8 * 8
    loader = 24
    consumer = min(240, (launch * threads - 128 * loader) // (128 * consumers) // 8 * 8)
    return launch, consumer, loader


@gluon.constexpr_function
def _worker_registers(consumers):
    _, consumer, loader = backward_registers(consumers)
    return [consumer] * (consumers - 1) + [loader]


# Causal heads of up to this many key blocks (8,192 keys) go in head groups; longer heads keep
# their own order (docs/perf.md, "dQ's product issued behind dK and dV").
GROUPED_BLOCKS: gl.constexpr = gl.constexpr(64)


@gluon.jit
def _program_block(tile, num_tiles, num_kv_heads, seqlen_k, BLOCK_N: gl.constexpr, HEAD_GROUP: gl.constexpr):
    """(batch, kv_head, n_block) of tile ``tile``: the key blocks of one head run side by side
    (they share its Q and dO in L2), the first keys first (causal: they see the most rows). With
    HEAD_GROUP, heads of up to GROUPED_BLOCKS key blocks go in groups of that many, and a group's
    key blocks in order of their first key across its heads: the last tiles to start are then
    short ones, not a head's longest. Longer heads keep their own order (there L2 rules), but for
    the last few, which walk their blocks together (:func:`head_and_entry`)."""
    num_n_blocks = gl.cdiv(seqlen_k, BLOCK_N)
    n_block = tile % num_n_blocks
    batch_head = tile // num_n_blocks
    if HEAD_GROUP > 1:
        if num_n_blocks <= GROUPED_BLOCKS:
            group_tiles = HEAD_GROUP * num_n_blocks
            first_head = (tile // group_tiles) * HEAD_GROUP
            members = gl.minimum(num_tiles // num_n_blocks - first_head, HEAD_GROUP)
            within = tile - (tile // group_tiles) * group_tiles
            n_block = within // members
            batch_head = first_head + within % members
        else:
            batch_head, n_block = head_and_entry(tile, num_n_blocks, num_tiles // num_n_blocks)
    return batch_head // num_kv_heads, batch_head % num_kv_heads, n_block


@gluon.jit
def _program_tile(tile, num_tiles, sequences, num_kv_heads, seqlen_q, seqlen_k, lo, hi, BLOCK_N: gl.constexpr,
                  VARLEN: gl.constexpr, HEAD_GROUP: gl.constexpr):
    """``(valid, batch, kv_head, n_block, q_start, seqlen_q, k_start, seqlen_k, lo, hi, sequence)``
    of tile ``tile`` of ``num_tiles``: its key block, and its sequence's start, lengths and window
    in its own rows.

    Packed sequences (VARLEN): ``sequences`` holds cu_seqlens_q, cu_seqlens_k and the key blocks'
    tile list (:mod:`fmha.backends.triton.varlen`, deepest first), taken KV head after KV head,
    the last few together (:func:`head_and_entry`); seqlen_q and seqlen_k arrive as the packed
    totals, lo and hi without the sequence's Sk - Sq. Entries past the list's end are not valid.
    ``sequence`` indexes the sequence's ALiBi slopes (the batch, dense)."""
    if VARLEN:
        cu_seqlens_q, cu_seqlens_k, tiles = sequences
        kv_head, entry = head_and_entry(tile, num_tiles // num_kv_heads, num_kv_heads)
        seq = gl.load(tiles + 2 * entry)
        sequence = gl.maximum(seq, 0)
        q_start, seq_q = sequence_span(cu_seqlens_q, sequence, seqlen_q)
        k_start, seq_k = sequence_span(cu_seqlens_k, sequence, seqlen_k)
        return (seq >= 0, 0, kv_head, gl.load(tiles + 2 * entry + 1), q_start, seq_q, k_start,
                seq_k, lo + seq_k - seq_q, hi + seq_k - seq_q, sequence)
    else:
        batch, kv_head, n_block = _program_block(tile, num_tiles, num_kv_heads, seqlen_k, BLOCK_N, HEAD_GROUP)
        return True, batch, kv_head, n_block, 0, seqlen_q, 0, seqlen_k, lo, hi, batch


@gluon.jit
def _load_partition(args, tile_slots, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
                    HAS_RIGHT: gl.constexpr, VARLEN: gl.constexpr, DYNAMIC: gl.constexpr, HEAD_GROUP: gl.constexpr):
    (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem,
     kv_ready, kv_free, q_ready, q_free, num_q_heads, num_kv_heads, group_size, padded_q, seqlen_q, seqlen_k, lo, hi,
     num_tiles, packed) = args
    sequences, Lse2, Delta = packed
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    if DYNAMIC:  # tiles from the launch's counter, handed to the consumers (the forward's scheme)
        counter = tile_slots[0]
        handed = 0
        ring_position = 0
        tile_count = 0
        tile = draw_tile(counter)
        while tile < num_tiles:
            hand_out_tile(tile_slots, handed, tile, ())
            valid, batch, kv_head, n_block, q_start, seq_q, k_start, _, seq_lo, seq_hi, _ = _program_tile(
                tile, num_tiles, sequences, num_kv_heads, seqlen_q, seqlen_k, lo, hi, BLOCK_N, VARLEN, HEAD_GROUP)
            if valid:
                # The consumers are done with the previous tile's K and V (the first tile finds them free).
                mbarrier.wait(kv_free, (tile_count & 1) ^ 1)
                ring_position = _load_tile(
                    q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem,
                    k_smem, v_smem, kv_ready, q_ready, q_free, num_q_heads, group_size, padded_q, batch, kv_head,
                    n_block * BLOCK_N, q_start, seq_q, k_start, seq_lo, seq_hi, Lse2, Delta, ring_position, BLOCK_M,
                    STAGES, HAS_LEFT, HAS_RIGHT, VARLEN)
                tile_count += 1
            handed += 1
            tile = draw_tile(counter)
        hand_out_tile(tile_slots, handed, num_tiles, ())
    else:
        valid, batch, kv_head, n_block, q_start, seq_q, k_start, _, seq_lo, seq_hi, _ = _program_tile(
            gl.program_id(0), num_tiles, sequences, num_kv_heads, seqlen_q, seqlen_k, lo, hi, BLOCK_N, VARLEN,
            HEAD_GROUP)
        if valid:
            _load_tile(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem,
                       k_smem, v_smem, kv_ready, q_ready, q_free, num_q_heads, group_size, padded_q, batch, kv_head,
                       n_block * BLOCK_N, q_start, seq_q, k_start, seq_lo, seq_hi, Lse2, Delta, 0, BLOCK_M, STAGES,
                       HAS_LEFT, HAS_RIGHT, VARLEN)


@gluon.jit
def _load_tile(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem,
               k_smem, v_smem, kv_ready, q_ready, q_free, num_q_heads, group_size, padded_q, batch, kv_head,
               first_key, q_start, seqlen_q, k_start, lo, hi, Lse2, Delta, ring_position,
               BLOCK_M: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
               VARLEN: gl.constexpr):
    """The tile's K and V block once, then Q, dO and the row statistics of every query block that
    sees it, for each query head of the KV head (rows and keys counted from q_start and k_start),
    through the ring from ``ring_position``; returns the ring position after the tile.

    Packed sequences copy the row statistics with plain loads and shared-memory stores (Lse2 and
    Delta): a sequence's rows start anywhere, and a bulk copy of a row vector must start 16-byte
    aligned. The slot's arrival follows the stores, so the consumers' wait orders them."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [batch, kv_head, k_start + first_key, 0], kv_ready, k_smem)
    tma_load(v_desc, [batch, kv_head, k_start + first_key, 0], kv_ready, v_smem)
    m_start, _, _, m_end = query_blocks(first_key, BLOCK_N, seqlen_q, lo, hi, BLOCK_M, HAS_LEFT, HAS_RIGHT)
    steps = (m_end - m_start) // BLOCK_M
    for member in range(group_size):
        head = kv_head * group_size + member
        # of the (B, Hq, padded_q) row statistics; packed sequences: (1, Hq, padded total)
        rows_base = (batch * num_q_heads + head) * padded_q + q_start
        for step in range(steps):
            position = ring_position + member * steps + step
            slot = position % STAGES
            # A free barrier completes once per use; the first wait finds it free.
            mbarrier.wait(q_free.index(slot), ((position // STAGES) & 1) ^ 1)
            first_row = m_start + step * BLOCK_M
            if VARLEN:
                stats = rows_base + first_row + gl.arange(0, BLOCK_M, layout=_ROW_STATS_LAYOUT)
                lse_smem.index(slot).store(gl.load(Lse2 + stats))
                delta_smem.index(slot).store(gl.load(Delta + stats))
                mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            else:
                mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
                tma_load(lse_desc, [rows_base + first_row], q_ready.index(slot), lse_smem.index(slot))
                tma_load(delta_desc, [rows_base + first_row], q_ready.index(slot), delta_smem.index(slot))
            tma_load(q_desc, [batch, head, q_start + first_row, 0], q_ready.index(slot), q_smem.index(slot))
            tma_load(do_desc, [batch, head, q_start + first_row, 0], q_ready.index(slot), do_smem.index(slot))
    return ring_position + group_size * steps


@gluon.jit
def _query_steps(
    dk, dv,  # [CONSUMER_KEYS, HEAD_DIM] f32 accumulators
    k_rows, v_rows, k_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
    q_ready, q_free, ds_ready, ds_free, dq_desc,
    batch, head, keys, position_base, m_first, m_begin, m_stop, q_start, seqlen_q, seqlen_k, lo, hi, qk_scale, mods,
    dropout, CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr,
    MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, COMPUTE_DQ: gl.constexpr,
    DQ_ALTERNATE: gl.constexpr, LSE_EARLY: gl.constexpr, DQ_LATE: gl.constexpr, DQ_EARLY: gl.constexpr,
    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, VARLEN: gl.constexpr, DROPOUT: gl.constexpr, MASK: gl.constexpr,
):
    """Query blocks [m_begin, m_stop) of one head; the block at row m sits at ring position
    position_base + (m - m_first) / BLOCK_M. Packed sequences: rows past the sequence's end (the next
    sequence's tokens) take the mask, and dQ's rows start at q_start. ``mods``: ``(softcap_scale, slope, position_offset,
    key_positions, mask_base, mask_columns, stride_mm)``, the score features' values for this head
    (position_offset = Sk - Sq; the attn_mask's (batch, head) pointer, int32 offsets of the consumer's
    keys and its row stride: the launcher keeps every offset under 2^31); ``dropout``:
    ``(RngState, rng_row, high_bound, dropout_scale, first_key, key_rows)`` (DROPOUT: the
    forward's pattern, :func:`fmha.backends.gluon_sm90.scores.transposed_keep_bits`; P·dO and dP take the
    kept scores, and dV the factor ``dropout_scale`` at its store)."""
    HEAD_DIM: gl.constexpr = k_smem.shape[3]
    BLOCK_N: gl.constexpr = k_smem.shape[2]
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = accumulator_layout(BLOCK_M)  # [CONSUMER_KEYS, BLOCK_M]
    a_layout: gl.constexpr = operand_layout(HEAD_DIM)  # Pᵀ, dSᵀ as the A operand of dV, dK
    row_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # [BLOCK_M] along the query rows
    if DQ_ALTERNATE:  # one consumer per step computes all of dQ's tile
        DQ_COLUMNS: gl.constexpr = HEAD_DIM
        DQ_COLUMN0: gl.constexpr = 0
    else:  # each consumer computes HEAD_DIM / CONSUMERS columns of it every step
        DQ_COLUMNS: gl.constexpr = HEAD_DIM // CONSUMERS
        DQ_COLUMN0: gl.constexpr = CONSUMER * DQ_COLUMNS
    dq_t_layout: gl.constexpr = accumulator_layout(BLOCK_M)  # [DQ_COLUMNS, BLOCK_M]: dQᵀ
    own_dq = dq_smem.index(CONSUMER)
    no_scores = gl.zeros([CONSUMER_KEYS, BLOCK_M], gl.float32, layout=s_layout)
    # DQ_LATE: the previous step's dQᵀ and its first row (-1: none), stored after this step's first products
    pending_dq = gl.zeros([DQ_COLUMNS, BLOCK_M], gl.float32, layout=dq_t_layout)
    pending_m = -1
    for m in range(m_begin, m_stop, BLOCK_M):
        position = position_base + (m - m_first) // BLOCK_M
        slot = position % STAGES
        if DROPOUT:  # the step's flags, drawn while only dK and dV hold registers
            RngState, rng_row, high_bound, _, first_key, key_rows = dropout
            # The seed is loaded every step: the key's round constants derived from it once would
            # hold 20 registers through the loop.
            rng_key = dropout_key(RngState)
            row_words = pair_rows(m, rng_row, BLOCK_M // 2, gl.SliceLayout(0, transposed_draw_layout(BLOCK_M)))
            keep_bits = transposed_keep_bits(first_key, key_rows, row_words, rng_key, high_bound, BLOCK_M)
        mbarrier.wait(q_ready.index(slot), (position // STAGES) & 1)
        q = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
        do = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
        scores_t = warpgroup_mma(k_rows, q.permute((1, 0)), no_scores, use_acc=False, is_async=True)
        dprobs_t = warpgroup_mma(v_rows, do.permute((1, 0)), no_scores, use_acc=False, is_async=True)
        if LSE_EARLY:  # read while the products run: behind them, shared memory answers slowly
            lse = lse_smem.index(slot).load(row_layout)  # log2 units; padded rows +inf
        if DQ_LATE:  # the previous step's dQ tile leaves while this step's first products run
            if pending_m >= 0:
                _add_dq_tile(pending_dq, own_dq, dq_desc, [batch, head, q_start + pending_m, DQ_COLUMN0])
            pending_m = -1
        scores_t = warpgroup_mma_wait(1, deps=(scores_t,))
        if MASK != NO_MASK:  # the attn_mask's [keys, rows] tile, read while dP runs
            rows = gl.minimum(m + gl.arange(0, BLOCK_M, layout=row_layout), seqlen_q - 1)
            mask_tile = gl.load(mods[4] + (mods[5][:, None] + (rows * mods[6])[None, :]))
        if not LSE_EARLY:
            lse = lse_smem.index(slot).load(row_layout)
        scale_t = qk_scale
        if SOFTCAP or ALIBI:
            softcap_scale, slope, position_offset, key_positions = mods[0], mods[1], mods[2], mods[3]
            row_positions = (m + position_offset + gl.arange(0, BLOCK_M, layout=row_layout)).to(gl.float32)
            scores_t, capped_t = modified_scores(scores_t, row_positions[None, :], key_positions[:, None], qk_scale,
                                                 softcap_scale, slope, SOFTCAP, ALIBI)
            scale_t = 1.0
        if MASK != NO_MASK:
            mask_tile = expand_mask(mask_tile, mods[4].dtype.element_ty, s_layout, MASK, STRIDED_MASK_KEYS)
            scores_t, scale_t = masked_scores(scores_t, scale_t, mask_tile, MASK)
        probs_t = gl.exp2(scores_t * scale_t - lse[None, :])
        if MASKED:
            if HEAD_DIM == 64:  # a word of bits per key: measured faster at D = 64, slower at 128
                row_end = seqlen_q if VARLEN else m + BLOCK_M  # padded rows have an LSE of +inf
                seen = visible_block_transposed(keys, gl.arange(0, BLOCK_M, layout=row_layout), m, row_end,
                                                seqlen_k, lo, hi, HAS_LEFT, HAS_RIGHT)
            else:
                rows = m + gl.arange(0, BLOCK_M, layout=row_layout)
                seen = visible(rows[None, :], keys[:, None], seqlen_k, lo, hi, HAS_LEFT, HAS_RIGHT)
                if VARLEN:
                    seen = seen & (rows[None, :] < seqlen_q)
            probs_t = gl.where(seen, probs_t, 0.0)
        if DROPOUT:
            # The dropped probabilities carry a minus sign until dS: no tile of flags stays live.
            keep = gl.convert_layout(unpack_keep(keep_bits, BLOCK_M), s_layout, assert_trivial=True)
            probs_t = gl.where(keep, probs_t, -probs_t)
            dv = warpgroup_mma(gl.convert_layout(gl.maximum(probs_t, 0.0).to(dtype), a_layout), do, dv,
                               is_async=True)
        else:
            dv = warpgroup_mma(gl.convert_layout(probs_t.to(dtype), a_layout), do, dv, is_async=True)
        if SOFTCAP:  # dS takes d(softcap · tanh(s / softcap)) / ds: fold it into P now, and keep one tile
            probs_t = probs_t * (1.0 - capped_t * capped_t)
        dprobs_t = warpgroup_mma_wait(1, deps=(dprobs_t,))
        delta = delta_smem.index(slot).load(row_layout)
        if DROPOUT:
            dprobs_t = gl.where(probs_t > 0.0, dprobs_t * dropout[3], 0.0)
            probs_t = gl.abs(probs_t)
        dscores_t = (probs_t * (dprobs_t - delta[None, :])).to(dtype)
        dk = warpgroup_mma(gl.convert_layout(dscores_t, a_layout), q, dk, is_async=True)
        if COMPUTE_DQ:
            buffer = position % 2
            buffer_phase = (position // 2) & 1
            mbarrier.wait(ds_free.index(buffer), buffer_phase ^ 1)  # its readers are done with it
            ds_buffer = ds_smem.index(buffer)  # [BLOCK_N, BLOCK_M]: dSᵀ
            ds_buffer.slice(CONSUMER * CONSUMER_KEYS, CONSUMER_KEYS).store(dscores_t)
            fence_async_shared()
            cta_barrier()  # every thread's part of dSᵀ is written before the arrival
            mbarrier.arrive(ds_ready.index(buffer), count=1)
            EARLY: gl.constexpr = DQ_EARLY and not DQ_ALTERNATE
            if not EARLY:
                dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
                mbarrier.arrive(q_free.index(slot), count=1)  # dQ reads dS and K only
            if DQ_ALTERNATE:
                computes_dq = position % CONSUMERS == CONSUMER
            else:
                computes_dq: gl.constexpr = True
            if computes_dq:
                mbarrier.wait(ds_ready.index(buffer), buffer_phase)
                k_columns = k_smem.reshape([BLOCK_N, HEAD_DIM]).slice(DQ_COLUMN0, DQ_COLUMNS, dim=1)
                # dQᵀ = Kᵀ dSᵀ: a thread holds pairs of values in two rows of dQ, and its stores
                # then meet no bank conflicts in the swizzled tile (dQ's own pairs share banks).
                dq_t = warpgroup_mma(k_columns.permute((1, 0)), ds_buffer,
                                     gl.zeros([DQ_COLUMNS, BLOCK_M], gl.float32, layout=dq_t_layout),
                                     use_acc=False, is_async=True)
                if EARLY:  # dQ queued behind dK and dV: the slot is free once they are done
                    dk, dv = warpgroup_mma_wait(1, deps=(dk, dv))
                    mbarrier.arrive(q_free.index(slot), count=1)
                dq_t = warpgroup_mma_wait(0, deps=(dq_t,))
                mbarrier.arrive(ds_free.index(buffer), count=1)
                if DQ_LATE:
                    pending_dq = dq_t
                    pending_m = m
                else:
                    _add_dq_tile(dq_t, own_dq, dq_desc, [batch, head, q_start + m, DQ_COLUMN0])
        else:
            dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
            mbarrier.arrive(q_free.index(slot), count=1)
    if DQ_LATE:
        if pending_m >= 0:
            _add_dq_tile(pending_dq, own_dq, dq_desc, [batch, head, q_start + pending_m, DQ_COLUMN0])
    return dk, dv


@gluon.jit
def _add_dq_tile(dq_t, own_dq, dq_desc, coordinates):
    """dQᵀ's tile into the consumer's shared buffer, then added into the fp32 buffer by the bulk
    copy engine (a TMA reduce-add); the previous tile's add has read the buffer first."""
    tma.store_wait(0)
    own_dq.reshape([dq_t.shape[1], dq_t.shape[0]]).permute((1, 0)).store(dq_t)
    fence_async_shared()
    tma_atomic_add(dq_desc, coordinates, own_dq)


@gluon.jit
def _store_rows_of(values, staging, desc, coordinates):
    """A consumer's [CONSUMER_KEYS, HEAD_DIM] block through shared memory and a bulk tensor store."""
    tma.store_wait(0)  # the staging buffer's previous contents have left
    staging.reshape(values.shape).store(values)
    fence_async_shared()
    tma_store(desc, coordinates, staging)


@gluon.jit
def _consumer_partition(
    args,  # unpacked below
    tile_slots,  # with DYNAMIC: where the load warp hands out tiles
    CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, COMPUTE_DQ: gl.constexpr, DQ_ALTERNATE: gl.constexpr,
    LSE_EARLY: gl.constexpr, DQ_LATE: gl.constexpr, DQ_EARLY: gl.constexpr, SOFTCAP: gl.constexpr,
    ALIBI: gl.constexpr, VARLEN: gl.constexpr, DROPOUT: gl.constexpr, DYNAMIC: gl.constexpr, MASK: gl.constexpr,
    KV_REGISTERS: gl.constexpr, HEAD_GROUP: gl.constexpr,
):
    (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, staging, kv_ready, kv_free, q_ready,
     q_free, ds_ready, ds_free, dk_desc, dv_desc, dq_desc, num_kv_heads, group_size, seqlen_q, seqlen_k, lo, hi, scale,
     qk_scale, score_args, num_tiles, sequences, packed) = args
    BLOCK_N: gl.constexpr = k_smem.shape[2]
    rng = 0
    if DROPOUT:  # the Philox seed, the bound a kept draw passes, and the kept scores' factor
        RngState, threshold, dropout_scale = score_args[4], score_args[5], score_args[6]
        rng = (RngState, (threshold.to(gl.uint32) << 24) - 1, dropout_scale, num_kv_heads * group_size)
    if DYNAMIC:
        handed = 0
        ring_position = 0
        tile_count = 0
        tile = take_tile(tile_slots, handed)
        while tile < num_tiles:
            valid, batch, kv_head, n_block, q_start, seq_q, k_start, seq_k, seq_lo, seq_hi, sequence = _program_tile(
                tile, num_tiles, sequences, num_kv_heads, seqlen_q, seqlen_k, lo, hi, BLOCK_N, VARLEN, HEAD_GROUP)
            if valid:
                ring_position = _consumer_tile(
                    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, staging, kv_ready,
                    kv_free, q_ready, q_free, ds_ready, ds_free, dk_desc, dv_desc, dq_desc, group_size, scale,
                    qk_scale, score_args, packed, batch, kv_head, n_block * BLOCK_N, q_start, seq_q, k_start, seq_k,
                    seq_lo, seq_hi, sequence, ring_position, tile_count, rng, seqlen_q, CONSUMER, CONSUMERS, BLOCK_M,
                    STAGES, HAS_LEFT, HAS_RIGHT, COMPUTE_DQ, DQ_ALTERNATE, LSE_EARLY, DQ_LATE, DQ_EARLY, SOFTCAP, ALIBI,
                    VARLEN, DROPOUT, MASK, KV_REGISTERS)
                tile_count += 1
            handed += 1
            tile = take_tile(tile_slots, handed)
    else:
        valid, batch, kv_head, n_block, q_start, seq_q, k_start, seq_k, seq_lo, seq_hi, sequence = _program_tile(
            gl.program_id(0), num_tiles, sequences, num_kv_heads, seqlen_q, seqlen_k, lo, hi, BLOCK_N, VARLEN,
            HEAD_GROUP)
        if valid:
            _consumer_tile(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, staging,
                           kv_ready, kv_free, q_ready, q_free, ds_ready, ds_free, dk_desc, dv_desc, dq_desc, group_size,
                           scale, qk_scale, score_args, packed, batch, kv_head, n_block * BLOCK_N, q_start, seq_q,
                           k_start, seq_k, seq_lo, seq_hi, sequence, 0, 0, rng, seqlen_q, CONSUMER, CONSUMERS, BLOCK_M,
                           STAGES, HAS_LEFT, HAS_RIGHT, COMPUTE_DQ, DQ_ALTERNATE, LSE_EARLY, DQ_LATE, DQ_EARLY,
                           SOFTCAP, ALIBI, VARLEN, DROPOUT, MASK, KV_REGISTERS)
    tma.store_wait(0)


@gluon.jit
def _consumer_tile(
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, staging, kv_ready, kv_free, q_ready,
    q_free, ds_ready, ds_free, dk_desc, dv_desc, dq_desc, group_size, scale, qk_scale, score_args, packed,
    batch, kv_head, first_key, q_start, seqlen_q, k_start, seqlen_k, lo, hi, sequence, ring_position, tile_count,
    rng, rows_per_head, CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, COMPUTE_DQ: gl.constexpr, DQ_ALTERNATE: gl.constexpr,
    LSE_EARLY: gl.constexpr, DQ_LATE: gl.constexpr, DQ_EARLY: gl.constexpr, SOFTCAP: gl.constexpr,
    ALIBI: gl.constexpr, VARLEN: gl.constexpr, DROPOUT: gl.constexpr, MASK: gl.constexpr, KV_REGISTERS: gl.constexpr,
):
    """One consumer's 64 keys of a key block, the program's tile_count-th: dK and dV over every
    query block and query head that sees them, then their stores. Its query blocks sit at ring
    positions from ``ring_position`` on; returns the position after them. ``rng`` (DROPOUT):
    ``(RngState, high_bound, dropout_scale, num_q_heads)``; ``rows_per_head``: Sq, or the
    packed total (the dropout counters' numbering of rows)."""
    AlibiSlopes, stride_ab, stride_ah, softcap_scale = score_args[0], score_args[1], score_args[2], score_args[3]
    HEAD_DIM: gl.constexpr = k_smem.shape[3]
    BLOCK_N: gl.constexpr = k_smem.shape[2]
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = accumulator_layout(BLOCK_M)
    kv_layout: gl.constexpr = accumulator_layout(HEAD_DIM)
    own_first_key = first_key + CONSUMER * CONSUMER_KEYS
    keys = own_first_key + gl.arange(0, CONSUMER_KEYS, layout=gl.SliceLayout(1, s_layout))
    key_positions = keys.to(gl.float32)
    m_start, full_start, full_end, m_end = query_blocks(
        first_key, BLOCK_N, seqlen_q, lo, hi, BLOCK_M, HAS_LEFT, HAS_RIGHT)
    if first_key + BLOCK_N > seqlen_k:  # keys past the end: every block takes the mask
        full_end = full_start
    steps = (m_end - m_start) // BLOCK_M
    k_rows = k_smem.reshape([BLOCK_N, HEAD_DIM]).slice(CONSUMER * CONSUMER_KEYS, CONSUMER_KEYS)
    v_rows = v_smem.reshape([BLOCK_N, HEAD_DIM]).slice(CONSUMER * CONSUMER_KEYS, CONSUMER_KEYS)
    dk = gl.zeros([CONSUMER_KEYS, HEAD_DIM], gl.float32, layout=kv_layout)
    dv = gl.zeros([CONSUMER_KEYS, HEAD_DIM], gl.float32, layout=kv_layout)
    mbarrier.wait(kv_ready, tile_count & 1)
    if KV_REGISTERS:  # the A operands of Sᵀ and dPᵀ from registers: half their shared-memory reads
        k_rows = k_rows.load(operand_layout(BLOCK_M))
        v_rows = v_rows.load(operand_layout(BLOCK_M))
    for member in range(group_size):
        head = kv_head * group_size + member
        position_base = ring_position + member * steps
        slope = 0.0
        if ALIBI:
            slope = gl.load(AlibiSlopes + sequence.to(gl.int64) * stride_ab + head.to(gl.int64) * stride_ah) * LOG2_E
        mask_base, mask_columns, stride_mm = 0, 0, 0
        if MASK != NO_MASK:  # the (batch, head)'s attn_mask, and its offsets of the keys (past the end: the last)
            Mask = score_args[7]
            stride_mb, stride_mh, stride_mm, stride_mn = score_args[8]
            mask_base = Mask + sequence.to(gl.int64) * stride_mb + head.to(gl.int64) * stride_mh
            mask_columns = gl.minimum(keys, seqlen_k - 1) * stride_mn.to(gl.int32)
            stride_mm = stride_mm.to(gl.int32)
        mods = (softcap_scale, slope, seqlen_k - seqlen_q, key_positions, mask_base, mask_columns, stride_mm)
        dropout = 0
        if DROPOUT:  # rows numbered as the forward numbers them: (batch, head, row), or (head, packed row)
            rng_row = (batch * rng[3] + head).to(gl.int64) * rows_per_head + q_start
            key_rows = gl.arange(0, 32, layout=gl.SliceLayout(1, transposed_draw_layout(BLOCK_M)))
            dropout = (rng[0], rng_row, rng[1], rng[2], own_first_key, key_rows)
        dk, dv = _query_steps(
            dk, dv, k_rows, v_rows, k_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
            q_ready, q_free, ds_ready, ds_free, dq_desc, batch, head, keys, position_base, m_start, m_start, full_start, q_start,
            seqlen_q, seqlen_k, lo, hi, qk_scale, mods, dropout, CONSUMER, CONSUMERS, STAGES, True, HAS_LEFT,
            HAS_RIGHT, COMPUTE_DQ, DQ_ALTERNATE, LSE_EARLY, DQ_LATE, DQ_EARLY, SOFTCAP, ALIBI, VARLEN, DROPOUT, MASK)
        dk, dv = _query_steps(
            dk, dv, k_rows, v_rows, k_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
            q_ready, q_free, ds_ready, ds_free, dq_desc, batch, head, keys, position_base, m_start, full_start, full_end, q_start,
            seqlen_q, seqlen_k, lo, hi, qk_scale, mods, dropout, CONSUMER, CONSUMERS, STAGES, False, HAS_LEFT,
            HAS_RIGHT, COMPUTE_DQ, DQ_ALTERNATE, LSE_EARLY, DQ_LATE, DQ_EARLY, SOFTCAP, ALIBI, VARLEN, DROPOUT, MASK)
        dk, dv = _query_steps(
            dk, dv, k_rows, v_rows, k_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
            q_ready, q_free, ds_ready, ds_free, dq_desc, batch, head, keys, position_base, m_start, full_end, m_end, q_start,
            seqlen_q, seqlen_k, lo, hi, qk_scale, mods, dropout, CONSUMER, CONSUMERS, STAGES, True, HAS_LEFT,
            HAS_RIGHT, COMPUTE_DQ, DQ_ALTERNATE, LSE_EARLY, DQ_LATE, DQ_EARLY, SOFTCAP, ALIBI, VARLEN, DROPOUT, MASK)
    mbarrier.arrive(kv_free, count=1)  # every product that reads K and V has completed
    own_staging = staging.index(CONSUMER)
    if DROPOUT:  # P·dO summed the kept probabilities
        dv = dv * rng[2]
    if VARLEN and own_first_key + CONSUMER_KEYS > seqlen_k:
        # The block ends past its sequence: its keys only (the next sequence's rows are another program's).
        DK, DV, stride_kn, stride_kh = packed[0], packed[1], packed[2], packed[3]
        offset = k_start.to(gl.int64) * stride_kn + kv_head.to(gl.int64) * stride_kh
        _store_rows((dk * scale).to(dtype), own_staging, DK + offset, stride_kn, own_first_key, seqlen_k,
                    dk_desc.shape[3], CONSUMER_KEYS, HEAD_DIM, HEAD_DIM)
        _store_rows(dv.to(dtype), own_staging, DV + offset, stride_kn, own_first_key, seqlen_k, dk_desc.shape[3],
                    CONSUMER_KEYS, HEAD_DIM, HEAD_DIM)
    else:  # the descriptors clip keys past the end of K
        _store_rows_of((dk * scale).to(dtype), own_staging, dk_desc, [batch, kv_head, k_start + own_first_key, 0])
        _store_rows_of(dv.to(dtype), own_staging, dv_desc, [batch, kv_head, k_start + own_first_key, 0])
    return ring_position + group_size * steps


@gluon.jit
def attention_backward_hopper_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_desc, delta_desc, AlibiSlopes, RngState,
    CuSeqlensQ, CuSeqlensK, Tiles, DK, DV, Lse2, Delta, TileCounter, Mask, stride_kn, stride_kh,
    stride_ab, stride_ah, stride_mb, stride_mh, stride_mm, stride_mn, padded_q, num_q_heads, num_kv_heads, group_size,
    seqlen_q, seqlen_k, lo, hi, num_tiles,
    dropout_threshold, scale, qk_scale, softcap_scale, dropout_scale,
    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    CONSUMERS: gl.constexpr, COMPUTE_DQ: gl.constexpr, DQ_ALTERNATE: gl.constexpr, LSE_EARLY: gl.constexpr,
    DQ_LATE: gl.constexpr, DQ_EARLY: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, VARLEN: gl.constexpr,
    DROPOUT: gl.constexpr, DYNAMIC: gl.constexpr, MASK: gl.constexpr, KV_REGISTERS: gl.constexpr,
    HEAD_GROUP: gl.constexpr,
):
    """One tile per (batch, KV head, key block of 64 x CONSUMERS keys), num_tiles of them: one
    program per tile, or with DYNAMIC persistent programs that take them from the int32 counter at
    TileCounter (zero at launch; :mod:`fmha.backends.gluon_sm90.tile_queue`). Descriptors are
    (B, H, S, D): Q and dO in blocks of BLOCK_M rows, K and V of the whole key block, dK and dV of
    one consumer's 64 keys, and dQ's fp32 buffer (B, Hq, padded_q, D), zeroed, of one consumer's share
    of a step; the LSE (log2 units) and delta are flat (B·Hq·padded_q) fp32 vectors, in blocks of
    BLOCK_M (:mod:`fmha.backends.triton.backward_rows`).

    Score features as in the forward: SOFTCAP (``qk_scale`` is ``scale / softcap``, and dS takes the
    factor ``1 - tanh²``), ALIBI (slopes through stride_ab, stride_ah). The LSE counts the sinks, so
    the kernel never sees them (their gradient is the launcher's). DROPOUT: the forward's pattern
    for the int64 Philox seed at RngState (a draw >= dropout_threshold keeps its score, scaled by
    dropout_scale). MASK: SDPA's attn_mask of (batch, head) at ``Mask + batch · stride_mb + head ·
    stride_mh`` (strides in elements), as in the forward: BOOL_MASK hides keys, FLOAT_MASK adds to
    the scores.

    Packed sequences (VARLEN): the descriptors view (total, H, D) tensors as (1, H, total, D);
    seqlen_q and seqlen_k are the totals; programs take key blocks from the list in ``Tiles``; DK
    and DV (token stride stride_kn, head stride stride_kh) take the keys of a block that ends past
    its sequence; the row statistics are (Hq, padded total), read through Lse2 and Delta."""
    dtype: gl.constexpr = q_desc.dtype
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    staging = gl.allocate_shared_memory(dtype, [CONSUMERS] + dk_desc.block_type.shape, dk_desc.layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS] + dq_desc.block_type.shape, dq_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    kv_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(kv_free, count=CONSUMERS)
    tile_slots = (TileCounter,)  # not read without DYNAMIC
    if DYNAMIC:
        tile_slots = allocate_tile_slots(TileCounter, CONSUMERS)
    for slot in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(slot), count=1)
        mbarrier.init(q_free.index(slot), count=CONSUMERS)  # one arrival per consumer
    for buffer in gl.static_range(2):
        mbarrier.init(ds_ready.index(buffer), count=CONSUMERS)
        # Read by every consumer (each takes columns of dQ), or by the one whose turn it is.
        mbarrier.init(ds_free.index(buffer), count=1 if DQ_ALTERNATE else CONSUMERS)

    shared = (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, staging, kv_ready, kv_free,
              q_ready, q_free, ds_ready, ds_free, dk_desc, dv_desc, dq_desc, num_kv_heads, group_size, seqlen_q,
              seqlen_k, lo, hi, scale, qk_scale,
              (AlibiSlopes, stride_ab, stride_ah, softcap_scale, RngState, dropout_threshold, dropout_scale, Mask,
               (stride_mb, stride_mh, stride_mm, stride_mn)), num_tiles)
    load_args = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem,
                 k_smem, v_smem, kv_ready, kv_free, q_ready, q_free, num_q_heads, num_kv_heads, group_size, padded_q,
                 seqlen_q, seqlen_k, lo, hi, num_tiles)
    if VARLEN:  # the partitions also get the sequences (and the consumers dK's and dV's pointers); dense
        # builds capture nothing more
        sequences = (CuSeqlensQ, CuSeqlensK, Tiles)
        shared = shared + (sequences, (DK, DV, stride_kn, stride_kh))
        load_args = load_args + ((sequences, Lse2, Delta),)
    else:  # placeholders, never read
        shared = shared + (0, 0)
        load_args = load_args + ((0, 0, 0),)
    if CONSUMERS == 1:
        gl.warp_specialize(
            [(_consumer_partition, (shared, tile_slots, 0, CONSUMERS, BLOCK_M, STAGES, HAS_LEFT, HAS_RIGHT, COMPUTE_DQ,
                                    DQ_ALTERNATE, LSE_EARLY, DQ_LATE, DQ_EARLY, SOFTCAP, ALIBI, VARLEN, DROPOUT,
                                    DYNAMIC, MASK, KV_REGISTERS, HEAD_GROUP)),
             (_load_partition, (load_args, tile_slots, BLOCK_M, STAGES, HAS_LEFT, HAS_RIGHT, VARLEN, DYNAMIC,
                                HEAD_GROUP))],
            worker_num_warps=[1], worker_num_regs=_worker_registers(CONSUMERS))
    else:
        gl.warp_specialize(
            [(_consumer_partition, (shared, tile_slots, 0, CONSUMERS, BLOCK_M, STAGES, HAS_LEFT, HAS_RIGHT, COMPUTE_DQ,
                                    DQ_ALTERNATE, LSE_EARLY, DQ_LATE, DQ_EARLY, SOFTCAP, ALIBI, VARLEN, DROPOUT,
                                    DYNAMIC, MASK, KV_REGISTERS, HEAD_GROUP)),
             (_consumer_partition, (shared, tile_slots, 1, CONSUMERS, BLOCK_M, STAGES, HAS_LEFT, HAS_RIGHT, COMPUTE_DQ,
                                    DQ_ALTERNATE, LSE_EARLY, DQ_LATE, DQ_EARLY, SOFTCAP, ALIBI, VARLEN, DROPOUT,
                                    DYNAMIC, MASK, KV_REGISTERS, HEAD_GROUP)),
             (_load_partition, (load_args, tile_slots, BLOCK_M, STAGES, HAS_LEFT, HAS_RIGHT, VARLEN, DYNAMIC,
                                HEAD_GROUP))],
            worker_num_warps=[CONSUMER_WARPS, 1], worker_num_regs=_worker_registers(CONSUMERS))
