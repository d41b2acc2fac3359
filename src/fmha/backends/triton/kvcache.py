"""The kernel of ``flash_attn_with_kvcache``: append new keys to a KV cache and attend over it, in one launch.

The cache is contiguous, ``(cache batches, S_cache, Hkv, D)``, or paged, ``(pages, PAGE_SIZE, Hkv, D)``
with a block table ``(B, max_blocks)`` naming the page of every PAGE_SIZE positions of a sequence
(any page size: a key block may span pages, so pages are looked up per key). The kernels read the
lengths (``cache_seqlens``) on the device: a decode step needs no host sync and can be captured
in a CUDA graph.

Sequence b is cache positions ``[leftpad_b, cache_seqlens_b + S_new)`` of cache batch
``cache_batch_idx[b]`` (or b); its key j sits at position ``leftpad_b + j``. Lengths are clamped
to the cache, and a cache batch index outside it empties the sequence, so bad lengths never move
a load or a store outside the cache (block table entries are trusted).

:func:`kvcache_attention_kernel` is a split-KV forward: the query heads of one KV head share a
tile (packed query-row major, so a tile spans few query positions), the keys are cut into chunks
of whole blocks, one program per (batch and KV head, chunk, packed block). With one chunk it
writes the output itself; otherwise each chunk writes a float32 partial output and its log2 LSE,
and the last chunk of a tile to finish merges them in chunk order
(:func:`fmha.backends.triton.split_kv.merge_chunks`), in the same launch. Chunks past a
sequence's length run no blocks. New keys and values (``APPEND``) are written by one program per
sequence and KV head, at positions ``cache_seqlens_b + t`` and nowhere else; the programs read
those keys from the new rows rather than from the cache, so the append costs no second launch.

Which keys a query row sees is :mod:`fmha.backends.triton.masking`'s rule with the sequence's own
length: row i sits at key position ``i + Sk_b - Sq`` (FlashAttention's bottom-right alignment).

Scores follow the forward's order (:mod:`fmha.backends.triton.scores`): the softcap, then ALiBi's
``-slope_h · |pos(i) - j|`` (a slope per query head: the rows of a tile belong to several heads);
learnable sinks add ``exp(sinks[h])`` to each row's denominator where the row is normalised (after
the merge of split keys).

Rotary embeddings (cos/sin tables of ROTARY_DIM / 2 columns) rotate the new keys at positions
``cache_seqlens_b + t``, and the queries at ``cache_seqlens_b + i`` (``ROTARY_AT_ROWS``, for causal
or windowed calls) or all at ``cache_seqlens_b``: FlashAttention's convention, with pairs
``(2i, 2i + 1)`` (``INTERLEAVED``) or ``(i, i + ROTARY_DIM / 2)``. Rotated values are rounded to
the tensor's dtype, as if stored.
"""

import triton
import triton.language as tl

from .common import load_rows
from .forward import LN_2
from .masking import key_blocks, visible
from .scores import LOG2_E, NO_MASK, score_tile
from .split_kv import merge_chunks
from .varlen import sequence_span

# New rows written per step of the append (decode appends one): small, so that rotating them does
# not raise the kernel's registers and spill.
APPEND_ROWS: tl.constexpr = tl.constexpr(16)


@triton.jit
def _angles(Cos, Sin, positions, angle, rotated, stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d):
    """``(cos, sin)`` float32 of the tables' rows ``positions`` and columns ``angle`` (broadcast to
    ``rotated``'s shape); (1, 0) where not ``rotated``, so that those features pass through."""
    cos = tl.load(Cos + positions * stride_cos_row + angle * stride_cos_d, mask=rotated, other=1.0)
    sin = tl.load(Sin + positions * stride_sin_row + angle * stride_sin_d, mask=rotated, other=0.0)
    return cos.to(tl.float32), sin.to(tl.float32)


@triton.jit
def _rotate(x, row_ptrs, stride_d, offs_d, positions, mask, Cos, Sin,
            stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d, rotary_rows,
            ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """``x`` [rows, BLOCK_D], loaded from ``row_ptrs`` [rows], rotated at ``positions`` [rows] (float32).

    The pairs split in registers: neighbours, or the halves of each group of ROTARY_DIM columns
    where ROTARY_DIM is a power of two (the first group turns). Halves of other rotary dims load
    each column's partner again."""
    ROWS: tl.constexpr = x.shape[0]
    BLOCK_D: tl.constexpr = x.shape[1]
    half: tl.constexpr = ROTARY_DIM // 2
    in_table = (positions >= 0) & (positions < rotary_rows)
    if INTERLEAVED:
        first, second = x.to(tl.float32).reshape([ROWS, BLOCK_D // 2, 2]).split()
        row_mask, _ = mask.reshape([ROWS, BLOCK_D // 2, 2]).split()
        angle = tl.arange(0, BLOCK_D // 2)
        rotated = row_mask & (angle[None, :] < half) & in_table[:, None]
        cos, sin = _angles(Cos, Sin, positions[:, None], angle[None, :], rotated, stride_cos_row, stride_cos_d,
                           stride_sin_row, stride_sin_d)
        return tl.join(first * cos - second * sin, second * cos + first * sin).reshape([ROWS, BLOCK_D])
    elif (ROTARY_DIM & (ROTARY_DIM - 1)) == 0:
        GROUPS: tl.constexpr = BLOCK_D // ROTARY_DIM
        first, second = x.to(tl.float32).reshape([ROWS, GROUPS, 2, half]).permute(0, 1, 3, 2).split()
        row_mask, _ = mask.reshape([ROWS, GROUPS, 2, half]).permute(0, 1, 3, 2).split()
        group = tl.arange(0, GROUPS)
        angle = tl.arange(0, half)
        rotated = row_mask & (group[None, :, None] == 0) & in_table[:, None, None]
        cos, sin = _angles(Cos, Sin, positions[:, None, None], angle[None, None, :], rotated, stride_cos_row,
                           stride_cos_d, stride_sin_row, stride_sin_d)
        pairs = tl.join(first * cos - second * sin, second * cos + first * sin)
        return pairs.permute(0, 1, 3, 2).reshape([ROWS, BLOCK_D])
    else:
        first_half = offs_d < half
        partner = tl.where(first_half, offs_d + half, offs_d - half)
        angle = tl.where(first_half, offs_d, offs_d - half)
        sign = tl.where(first_half, -1.0, 1.0)
        rotated = mask & (offs_d[None, :] < ROTARY_DIM) & in_table[:, None]
        other = tl.load(row_ptrs[:, None] + partner[None, :] * stride_d, mask=rotated, other=0.0).to(tl.float32)
        cos, sin = _angles(Cos, Sin, positions[:, None], angle[None, :], rotated, stride_cos_row, stride_cos_d,
                           stride_sin_row, stride_sin_d)
        return x.to(tl.float32) * cos + sign[None, :] * other * sin


@triton.jit
def _cache_slots(table_row, cache_batch, positions, in_range, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """``(major, minor)`` int64 indices of sequence positions in the cache: (cache batch, position),
    or (page from the block table, row in the page)."""
    if PAGE_SIZE == 0:
        return cache_batch.to(tl.int64), positions.to(tl.int64)
    else:
        if MASKED:
            page = tl.load(table_row + positions // PAGE_SIZE, mask=in_range, other=0)
        else:
            page = tl.load(table_row + positions // PAGE_SIZE)
        return page.to(tl.int64), (positions % PAGE_SIZE).to(tl.int64)


@triton.jit
def _sequence(CacheSeqlens, CacheBatchIdx, batch, cache_seqlen, new_keys, capacity, cache_batches,
              HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, CUMULATIVE: tl.constexpr):
    """``(cached, end, cache_batch)``: the sequence's cached length, the end of its keys after the
    append (clamped to the cache; 0 for a cache batch index outside it) and its cache batch.
    ``CUMULATIVE``: CacheSeqlens holds offsets, the length is ``CacheSeqlens[b + 1] - CacheSeqlens[b]``."""
    if CUMULATIVE:
        cached = tl.load(CacheSeqlens + batch + 1) - tl.load(CacheSeqlens + batch)
    elif HAS_SEQLENS:
        cached = tl.load(CacheSeqlens + batch)
    else:
        cached = cache_seqlen + 0 * batch
    end = tl.minimum(tl.maximum(cached + new_keys, 0), capacity)
    if HAS_BATCH_IDX:
        cache_batch = tl.load(CacheBatchIdx + batch)
        end = tl.where((cache_batch >= 0) & (cache_batch < cache_batches), end, 0)
    else:
        cache_batch = batch
    return cached, end, cache_batch


@triton.jit
def _append_rows(k_new, v_new, k_head, v_head, stride_knt, stride_knd, stride_vnt, stride_vnd,
                 stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd,
                 table_row, cache_batch, cached, end, new_keys, cache_batches, offs_d,
                 Cos, Sin, stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d, rotary_rows,
                 HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr):
    """One sequence's new keys (rotated) and values into one KV head of the cache, at positions
    ``cached + t``; positions past the sequence's end in the cache (and pages outside it) are dropped."""
    for first in range(0, new_keys, BLOCK_T):
        new = first + tl.arange(0, BLOCK_T)
        positions = cached + new
        keep = (new < new_keys) & (positions >= 0) & (positions < end)
        major, minor = _cache_slots(table_row, cache_batch, positions, keep, PAGE_SIZE, True)
        if PAGE_SIZE > 0:
            keep = keep & (major >= 0) & (major < cache_batches)
        mask = keep[:, None] & (offs_d[None, :] < HEAD_DIM)
        k_rows = k_new + new.to(tl.int64) * stride_knt
        k = tl.load(k_rows[:, None] + offs_d[None, :] * stride_knd, mask=mask, other=0.0)
        if ROTARY_DIM > 0:
            k = _rotate(k, k_rows, stride_knd, offs_d, positions, mask, Cos, Sin, stride_cos_row, stride_cos_d,
                        stride_sin_row, stride_sin_d, rotary_rows, ROTARY_DIM, ROTARY_INTERLEAVED)
        k_slots = k_head + major * stride_kb + minor * stride_kn
        tl.store(k_slots[:, None] + offs_d[None, :] * stride_kd, k.to(k_head.dtype.element_ty), mask=mask)
        v_rows = v_new + new.to(tl.int64) * stride_vnt
        v = tl.load(v_rows[:, None] + offs_d[None, :] * stride_vnd, mask=mask, other=0.0)
        v_slots = v_head + major * stride_vb + minor * stride_vn
        tl.store(v_slots[:, None] + offs_d[None, :] * stride_vd, v.to(v_head.dtype.element_ty), mask=mask)


@triton.jit
def _load_block(cache_head, stride_cb, stride_cn, stride_cd, major, minor, new_rows, stride_nt, stride_nd,
                keys, seqlen_k, new_start, cached, offs_d,
                Cos, Sin, stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d, rotary_rows,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, MERGED: tl.constexpr,
                ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr):
    """Keys ``keys`` of K or V: from the cache, or (``MERGED``) from the new rows for keys at or past
    ``new_start``, rotated as the append stores them; the cache's copies of those rows are being
    written by this launch."""
    cache_ptrs = cache_head + (major * stride_cb + minor * stride_cn)[:, None] + offs_d[None, :] * stride_cd
    if MERGED:
        fresh = keys >= new_start
        in_range = (keys < seqlen_k)[:, None] & (offs_d[None, :] < HEAD_DIM)
        stored = tl.load(cache_ptrs, mask=in_range & ~fresh[:, None], other=0.0)
        rows = new_rows + (keys - new_start).to(tl.int64) * stride_nt
        fresh_mask = in_range & fresh[:, None]
        appended = tl.load(rows[:, None] + offs_d[None, :] * stride_nd, mask=fresh_mask, other=0.0)
        if ROTARY_DIM > 0:
            appended = _rotate(appended, rows, stride_nd, offs_d, cached + keys - new_start, fresh_mask, Cos, Sin,
                               stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d, rotary_rows,
                               ROTARY_DIM, ROTARY_INTERLEAVED)
        return tl.where(fresh[:, None], appended.to(stored.dtype), stored)
    else:
        return load_rows(cache_ptrs, keys, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)


@triton.jit
def _softmax_step(acc, row_sum, row_max, raw_scores, v, keys, rows, seqlen_q, seqlen_k, lo, hi, qk_scale,
                  softcap_scale, slopes, fresh,
                  MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  FUSED_SCALE: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, SHIFTED: tl.constexpr):
    """Fold one key block (``raw_scores`` = Q·Kᵀ unscaled [M, N], ``v`` [N, D]) into the running
    max and sum (log2 units) and the accumulator: the forward's online softmax, kept here so that
    this kernel and the forward change apart; the scores through the forward's
    :func:`fmha.backends.triton.scores.score_tile` (``slopes`` [M]: each row's head's ALiBi slope).
    ``SHIFTED``: keys below ``fresh`` were folded by the block before, and are masked here."""
    if SOFTCAP or ALIBI:
        row_slopes = 0.0
        if ALIBI:
            row_slopes = slopes[:, None]
        scores, _ = score_tile(raw_scores, rows[:, None], keys[None, :], seqlen_q, seqlen_k, qk_scale, softcap_scale,
                               row_slopes, 0, 0, 0, SOFTCAP, ALIBI, NO_MASK)
    else:
        scores = raw_scores if FUSED_SCALE else raw_scores * qk_scale
    if MASKED:
        seen = visible(rows[:, None], keys[None, :], seqlen_k, lo, hi, HAS_LEFT, HAS_RIGHT)
        if SHIFTED:
            seen = seen & (keys >= fresh)[None, :]
        scores = tl.where(seen, scores, float("-inf"))
    if FUSED_SCALE:  # the scale folded into the exponent (scale > 0)
        new_max = tl.maximum(row_max, tl.max(scores, 1) * qk_scale)
    else:
        new_max = tl.maximum(row_max, tl.max(scores, 1))
    # A row that has seen no key keeps max -inf: subtracting 0 gives exp2(-inf) = 0, not NaN.
    new_max_safe = tl.where(new_max == float("-inf"), 0.0, new_max) if MASKED else new_max
    if FUSED_SCALE:
        probs = tl.math.exp2(scores * qk_scale - new_max_safe[:, None])
    else:
        probs = tl.math.exp2(scores - new_max_safe[:, None])
    rescale = tl.math.exp2(row_max - new_max_safe)
    row_sum = row_sum * rescale + tl.sum(probs, 1)
    acc = tl.dot(probs.to(v.dtype), v, acc * rescale[:, None], input_precision=DOT_PRECISION)
    return acc, row_sum, new_max


@triton.jit
def _attend_cache_blocks(
    acc, row_sum, row_max, q, k_head, v_head, k_new, v_new, table_row, cache_batch,
    stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_knt, stride_knd, stride_vnt, stride_vnd,
    Cos, Sin, stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d, rotary_rows,
    rows, offs_d, start, end, leftpad, seqlen_q, seqlen_k, new_start, cached, lo, hi, qk_scale, softcap_scale, slopes,
    k_descriptor, v_descriptor, descriptor_row, descriptor_column,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr, MERGED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FUSED_SCALE: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    TMA: tl.constexpr,
):
    """Keys [start, end) of the sequence (whole blocks from ``start``), masked or not; ``MERGED``
    reads the keys being appended from the new rows.

    ``TMA``: the blocks come through the cache's tensor descriptors (bulk copies), row
    ``descriptor_row + key`` and columns from ``descriptor_column``. No copy reads a key outside
    [0, end): the last block is moved back to end at ``end`` (the caller makes sure end ≥ BLOCK_N),
    its keys that the block before it covered masked out. So whatever the cache holds past the
    sequence, or before it (leftpad), never reaches a product."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        if TMA:
            first = tl.minimum(start_n, end - BLOCK_N)
            keys = first + offs_n
            k = k_descriptor.load([descriptor_row + first, descriptor_column])
        else:
            keys = start_n + offs_n
            major, minor = _cache_slots(table_row, cache_batch, leftpad + keys, keys < seqlen_k, PAGE_SIZE, MASKED)
            k = _load_block(k_head, stride_kb, stride_kn, stride_kd, major, minor, k_new, stride_knt, stride_knd,
                            keys, seqlen_k, new_start, cached, offs_d, Cos, Sin, stride_cos_row, stride_cos_d,
                            stride_sin_row, stride_sin_d, rotary_rows, HEAD_DIM, BLOCK_D, MASKED, MERGED,
                            ROTARY_DIM, ROTARY_INTERLEAVED)
        if DOT_FP32:
            k = k.to(tl.float32)
        raw_scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if TMA:
            v = v_descriptor.load([descriptor_row + first, descriptor_column])
        else:
            v = _load_block(v_head, stride_vb, stride_vn, stride_vd, major, minor, v_new, stride_vnt, stride_vnd,
                            keys, seqlen_k, new_start, cached, offs_d, Cos, Sin, stride_cos_row, stride_cos_d,
                            stride_sin_row, stride_sin_d, rotary_rows, HEAD_DIM, BLOCK_D, MASKED, MERGED, 0, False)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc, row_sum, row_max = _softmax_step(acc, row_sum, row_max, raw_scores, v, keys, rows, seqlen_q, seqlen_k,
                                              lo, hi, qk_scale, softcap_scale, slopes, start_n, MASKED, HAS_LEFT,
                                              HAS_RIGHT, DOT_PRECISION, FUSED_SCALE, SOFTCAP, ALIBI, TMA)
    return acc, row_sum, row_max


@triton.jit
def _packed_rows(packed, packed_rows, group_size, kv_head):
    """Packed rows ``packed`` of a KV head's (query position, query head) tile: ``(in_range, rows,
    heads)``, rows the query positions."""
    return packed < packed_rows, packed // group_size, kv_head * group_size + packed % group_size


@triton.jit
def _with_sinks(out, lse, Sinks, heads, stride_sh):
    """Rows normalised over all their keys (``out``, ``lse`` in log2 units) renormalised with each
    head's sink in the denominator: ``lse' = log2(2^lse + 2^sink)``, ``out' = out · 2^(lse - lse')``.
    A row that saw no key keeps zeros and -inf."""
    sink = tl.load(Sinks + heads.to(tl.int64) * stride_sh) * LOG2_E
    seen = lse > float("-inf")
    top = tl.where(seen, tl.maximum(lse, sink), 0.0)
    kept = tl.math.exp2(tl.where(seen, lse - top, float("-inf")))
    total = kept + tl.math.exp2(sink - top)
    return out * (kept / total)[:, None], tl.where(seen, top + tl.math.log2(total), float("-inf"))


@triton.jit
def _attend_tile(
    tile, chunk_start, chunk_end, q_ptr, q_start, seqlen_q, batch, kv_head, group_size,
    stride_qb, stride_qm, stride_qh, stride_qd, k_head, v_head, k_new, v_new, table_row, cache_batch,
    stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_knt, stride_knd, stride_vnt, stride_vnd,
    Cos, Sin, stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d, rotary_rows,
    leftpad, seqlen_k, new_start, cached, lo, hi, qk_scale, softcap_scale, AlibiSlopes, stride_ab, stride_ah,
    k_descriptor, v_descriptor, descriptor_row, descriptor_column,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, APPEND: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr, ROTARY_AT_ROWS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FUSED_SCALE: tl.constexpr, DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, ONE_RANGE: tl.constexpr, TMA: tl.constexpr,
):
    """Packed block ``tile`` of the sequence (BLOCK_M rows of the group's query heads) over its keys
    in [chunk_start, chunk_end): ``(out, lse, rows, heads, in_range)``, out normalised over those
    keys and lse in log2 units (-inf and zeros for rows that saw none). ``ONE_RANGE``: every block
    masked, in one loop, instead of the masked edges and the whole blocks apart; with ``TMA`` that
    loop reads the keys through the cache's tensor descriptors when they span a whole block (a
    shorter range keeps the pointer loads, whose masks read nothing outside it)."""
    packed_rows = group_size * seqlen_q
    in_range, rows, heads = _packed_rows(tile * BLOCK_M + tl.arange(0, BLOCK_M), packed_rows, group_size, kv_head)
    offs_d = tl.arange(0, BLOCK_D)
    slopes = 0.0
    if ALIBI:  # log2 units, one per row's head
        slopes = tl.load(AlibiSlopes + batch.to(tl.int64) * stride_ab + heads.to(tl.int64) * stride_ah) * LOG2_E

    first_row = tile * BLOCK_M // group_size
    last_row = (tl.minimum(tile * BLOCK_M + BLOCK_M, packed_rows) - 1) // group_size
    kv_start, full_start, full_end, kv_end = key_blocks(
        first_row, last_row - first_row + 1, seqlen_k, lo, hi, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if APPEND:  # blocks holding appended keys run masked, reading those keys from the new rows
        full_end = tl.maximum(tl.minimum(full_end, tl.maximum(new_start, 0) // BLOCK_N * BLOCK_N), full_start)

    q_mask = in_range[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_rows = (q_ptr + batch.to(tl.int64) * stride_qb + (q_start + rows).to(tl.int64) * stride_qm
              + heads.to(tl.int64) * stride_qh)
    q = tl.load(q_rows[:, None] + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    if ROTARY_DIM > 0:
        if ROTARY_AT_ROWS:
            positions = cached + rows
        else:
            positions = cached + 0 * rows
        q = _rotate(q, q_rows, stride_qd, offs_d, positions, q_mask, Cos, Sin, stride_cos_row, stride_cos_d,
                    stride_sin_row, stride_sin_d, rotary_rows, ROTARY_DIM, ROTARY_INTERLEAVED).to(q_ptr.dtype.element_ty)
    if DOT_FP32:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # The tile's three ranges (masked, whole blocks, masked), each cut to the chunk. ONE_RANGE (decode
    # tiles): the first range takes every key; the blocks' masks cost little beside the memory
    # stream, while each pipelined loop is a prologue and an epilogue of code that a short call
    # fetches and runs.
    if ONE_RANGE:
        first_end = kv_end
    else:
        first_end = full_start
    first_start = tl.maximum(kv_start, chunk_start)
    first_end = tl.minimum(first_end, chunk_end)
    # Bulk copies (TMA) where the keys span a whole block: then no block need reach outside them.
    if TMA:
        if first_end >= BLOCK_N:
            acc, row_sum, row_max = _attend_cache_blocks(
                acc, row_sum, row_max, q, k_head, v_head, k_new, v_new, table_row, cache_batch,
                stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_knt, stride_knd, stride_vnt,
                stride_vnd, Cos, Sin, stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d, rotary_rows,
                rows, offs_d, first_start, first_end,
                leftpad, seqlen_q, seqlen_k, new_start, cached, lo, hi, qk_scale, softcap_scale, slopes,
                k_descriptor, v_descriptor, descriptor_row, descriptor_column,
                HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, False, HAS_LEFT, HAS_RIGHT, ROTARY_DIM, ROTARY_INTERLEAVED,
                DOT_PRECISION, FUSED_SCALE, DOT_FP32, SOFTCAP, ALIBI, True)
        else:
            acc, row_sum, row_max = _attend_cache_blocks(
                acc, row_sum, row_max, q, k_head, v_head, k_new, v_new, table_row, cache_batch,
                stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_knt, stride_knd, stride_vnt,
                stride_vnd, Cos, Sin, stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d, rotary_rows,
                rows, offs_d, first_start, first_end,
                leftpad, seqlen_q, seqlen_k, new_start, cached, lo, hi, qk_scale, softcap_scale, slopes,
                k_descriptor, v_descriptor, descriptor_row, descriptor_column,
                HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, APPEND, HAS_LEFT, HAS_RIGHT, ROTARY_DIM, ROTARY_INTERLEAVED,
                DOT_PRECISION, FUSED_SCALE, DOT_FP32, SOFTCAP, ALIBI, False)
    else:
        acc, row_sum, row_max = _attend_cache_blocks(
            acc, row_sum, row_max, q, k_head, v_head, k_new, v_new, table_row, cache_batch,
            stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_knt, stride_knd, stride_vnt,
            stride_vnd, Cos, Sin, stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d, rotary_rows,
            rows, offs_d, first_start, first_end,
            leftpad, seqlen_q, seqlen_k, new_start, cached, lo, hi, qk_scale, softcap_scale, slopes,
            k_descriptor, v_descriptor, descriptor_row, descriptor_column,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, APPEND, HAS_LEFT, HAS_RIGHT, ROTARY_DIM, ROTARY_INTERLEAVED,
            DOT_PRECISION, FUSED_SCALE, DOT_FP32, SOFTCAP, ALIBI, False)
    if not ONE_RANGE:
        acc, row_sum, row_max = _attend_cache_blocks(
            acc, row_sum, row_max, q, k_head, v_head, k_new, v_new, table_row, cache_batch,
            stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_knt, stride_knd, stride_vnt,
            stride_vnd, Cos, Sin, stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d, rotary_rows,
            rows, offs_d, tl.maximum(full_start, chunk_start), tl.minimum(full_end, chunk_end),
            leftpad, seqlen_q, seqlen_k, new_start, cached, lo, hi, qk_scale, softcap_scale, slopes,
            k_descriptor, v_descriptor, descriptor_row, descriptor_column,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, False, False, HAS_LEFT, HAS_RIGHT, ROTARY_DIM, ROTARY_INTERLEAVED,
            DOT_PRECISION, FUSED_SCALE, DOT_FP32, SOFTCAP, ALIBI, False)
        acc, row_sum, row_max = _attend_cache_blocks(
            acc, row_sum, row_max, q, k_head, v_head, k_new, v_new, table_row, cache_batch,
            stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_knt, stride_knd, stride_vnt,
            stride_vnd, Cos, Sin, stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d, rotary_rows,
            rows, offs_d, tl.maximum(full_end, chunk_start), tl.minimum(kv_end, chunk_end),
            leftpad, seqlen_q, seqlen_k, new_start, cached, lo, hi, qk_scale, softcap_scale, slopes,
            k_descriptor, v_descriptor, descriptor_row, descriptor_column,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, APPEND, HAS_LEFT, HAS_RIGHT, ROTARY_DIM, ROTARY_INTERLEAVED,
            DOT_PRECISION, FUSED_SCALE, DOT_FP32, SOFTCAP, ALIBI, False)

    # Rows that saw no key: output 0 and LSE -inf, never 0/0.
    seen = row_sum > 0.0
    row_sum_safe = tl.where(seen, row_sum, 1.0)
    out = acc / row_sum_safe[:, None]
    lse = tl.where(seen, row_max + tl.math.log2(row_sum_safe), float("-inf"))
    return out, lse, rows, heads, in_range


@triton.jit(do_not_specialize=["cache_seqlen"])
def kvcache_attention_kernel(
    Q, KCache, VCache, KDescriptor, VDescriptor, KNew, VNew, Out, Lse, PartialOut, PartialLse, Arrivals,
    CacheSeqlens, CacheBatchIdx, CacheLeftpad, BlockTable, Cos, Sin, AlibiSlopes, Sinks, CuSeqlensQ, cache_seqlen,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_knb, stride_knt, stride_knh, stride_knd,
    stride_vnb, stride_vnt, stride_vnh, stride_vnd,
    stride_ob, stride_om, stride_oh, stride_od, stride_lb, stride_lh,
    stride_table, stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d,
    new_keys, capacity, cache_batches, rotary_rows,
    num_kv_heads, group_size, seqlen_q, total_q, num_rows, chunk, window_left, window_right, qk_scale,
    stride_ab, stride_ah, stride_sh, softcap_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    APPEND: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr, ROTARY_AT_ROWS: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, FUSED_SCALE: tl.constexpr, DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, SINKS: tl.constexpr, VARLEN_Q: tl.constexpr,
    ONE_RANGE: tl.constexpr, MERGE_ROWS: tl.constexpr, MERGE_CHUNKS: tl.constexpr, TMA: tl.constexpr,
):
    """Program (batch * KV head, chunk, packed block) over keys [chunk * split, chunk * (split + 1)).

    ``APPEND``: the program of chunk 0 and packed block 0 writes the sequence's new rows into the
    cache (for its KV head), and every program reads the keys at or past ``cache_seqlens_b`` from
    the new rows, so no program waits for another.
    ``SPLIT``: each chunk writes ``PartialOut[split, row]`` and ``PartialLse`` (log2 units), rows
    numbered as in ``Lse``, then counts itself in ``Arrivals[program_id(0), program_id(2)]``
    (int32, zero before the launch); the last chunk of the tile to arrive merges all of them in
    chunk order into ``Out`` and ``Lse`` (the tile's rows, padded to MERGE_ROWS ≤ BLOCK_M, with
    MERGE_CHUNKS chunks loaded at a time: :func:`fmha.backends.triton.split_kv.merge_chunks`) and
    sets its counter back to zero (so the next launch, a CUDA graph's replay included, finds
    zeros). The merge reads only the stored partials in a fixed order, so the result does not
    depend on which chunk is last. Else ``Out`` and ``Lse`` directly.
    Row i of head h of sequence b is ``Out[b, q_start + i, h]`` and ``Lse[b · stride_lb + h · stride_lh
    + q_start + i]``: q_start is 0 for (B, Sq, Hq, D) queries.

    ``TMA`` (with ONE_RANGE): KDescriptor and VDescriptor are tensor descriptors of the contiguous
    cache viewed as (cache batches · capacity, Hkv · D), blocks of (BLOCK_N, HEAD_DIM); a tile whose
    keys span a whole block reads them through these (:func:`_attend_cache_blocks`).

    ``VARLEN_Q``: packed queries (FlashAttention's varlen functions over a paged cache): sequence b
    is rows ``CuSeqlensQ[b]:CuSeqlensQ[b + 1]`` of q and Out (batch strides 0), ``seqlen_q`` is
    ``max_seqlen_q`` (it sized the grid), and ``CacheSeqlens`` holds cumulative key lengths. Rows
    of a longer sequence past the grid get NaN (as in FlashAttention, max_seqlen_q must be at least
    the longest sequence; the lengths live on the device, so the host cannot check it).

    ``qk_scale`` is ``scale · log2 e``, or ``scale / softcap`` with SOFTCAP (then ``softcap_scale =
    softcap · log2 e``); ALIBI: slopes ``AlibiSlopes[b · stride_ab + h · stride_ah]``; SINKS: one
    per query head, ``Sinks[h · stride_sh]``.
    """
    batch = tl.program_id(0) // num_kv_heads
    kv_head = tl.program_id(0) % num_kv_heads
    split = tl.program_id(1)
    tile = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    cached, end, cache_batch = _sequence(CacheSeqlens, CacheBatchIdx, batch, cache_seqlen, new_keys, capacity,
                                         cache_batches, HAS_SEQLENS, HAS_BATCH_IDX, VARLEN_Q)
    q_start = 0
    if VARLEN_Q:
        q_start, seqlen_q = sequence_span(CuSeqlensQ, batch, total_q)
        # A tile past the sequence's rows (every chunk of it alike) attends no key and writes no
        # row. Not a branch: an early return would hold the key lengths' loads back behind these.
        end = tl.where(tile * BLOCK_M >= group_size * seqlen_q, 0, end)
    if HAS_LEFTPAD:
        leftpad = tl.minimum(tl.maximum(tl.load(CacheLeftpad + batch), 0), end)
    else:
        leftpad = 0
    seqlen_k = end - leftpad
    lo = seqlen_k - seqlen_q - window_left
    hi = seqlen_k - seqlen_q + window_right
    new_start = cached - leftpad  # the first appended key

    k_head = KCache + kv_head.to(tl.int64) * stride_kh
    v_head = VCache + kv_head.to(tl.int64) * stride_vh
    table_row = BlockTable
    if PAGE_SIZE > 0:
        table_row = BlockTable + batch.to(tl.int64) * stride_table
    k_new = KNew
    v_new = VNew
    if APPEND:
        k_new = KNew + batch.to(tl.int64) * stride_knb + kv_head.to(tl.int64) * stride_knh
        v_new = VNew + batch.to(tl.int64) * stride_vnb + kv_head.to(tl.int64) * stride_vnh
        if (split == 0) & (tile == 0):
            _append_rows(k_new, v_new, k_head, v_head, stride_knt, stride_knd, stride_vnt, stride_vnd,
                         stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd,
                         table_row, cache_batch, cached, end, new_keys, cache_batches, offs_d,
                         Cos, Sin, stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d, rotary_rows,
                         HEAD_DIM, APPEND_ROWS, PAGE_SIZE, ROTARY_DIM, ROTARY_INTERLEAVED)

    out, lse, rows, heads, in_range = _attend_tile(
        tile, split * chunk, split * chunk + chunk, Q, q_start, seqlen_q, batch, kv_head, group_size,
        stride_qb, stride_qm, stride_qh, stride_qd, k_head, v_head, k_new, v_new, table_row, cache_batch,
        stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_knt, stride_knd, stride_vnt,
        stride_vnd, Cos, Sin, stride_cos_row, stride_cos_d, stride_sin_row, stride_sin_d, rotary_rows,
        leftpad, seqlen_k, new_start, cached, lo, hi, qk_scale, softcap_scale, AlibiSlopes, stride_ab, stride_ah,
        KDescriptor, VDescriptor, cache_batch * capacity + leftpad, kv_head * HEAD_DIM,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGE_SIZE, APPEND, HAS_LEFT, HAS_RIGHT, ROTARY_DIM,
        ROTARY_INTERLEAVED, ROTARY_AT_ROWS, DOT_PRECISION, FUSED_SCALE, DOT_FP32, SOFTCAP, ALIBI, ONE_RANGE, TMA)
    if SINKS and not SPLIT:  # split keys: after the merge
        out, lse = _with_sinks(out, lse, Sinks, heads, stride_sh)
    q_mask = in_range[:, None] & (offs_d[None, :] < HEAD_DIM)
    index = batch.to(tl.int64) * stride_lb + heads.to(tl.int64) * stride_lh + q_start + rows
    o_rows = (Out + batch.to(tl.int64) * stride_ob + (q_start + rows).to(tl.int64) * stride_om
              + heads.to(tl.int64) * stride_oh)
    if SPLIT:
        partial = index + split.to(tl.int64) * num_rows
        tl.store(PartialOut + partial[:, None] * HEAD_DIM + offs_d[None, :], out, mask=q_mask)
        tl.store(PartialLse + partial, lse, mask=in_range)
        # Every thread's stores come before the count (a CTA barrier, then a release at GPU scope);
        # the count's acquire comes before the merge's loads, which bypass the L1.
        tl.debug_barrier()
        counter = Arrivals + tl.program_id(0) * tl.num_programs(2) + tile
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:
            tl.store(counter, 0)
            # MERGE_ROWS covers the tile's packed rows (a decode tile's BLOCK_M rows are mostly padding).
            merge_in_range, merge_rows, merge_heads = _packed_rows(tile * BLOCK_M + tl.arange(0, MERGE_ROWS),
                                                                   group_size * seqlen_q, group_size, kv_head)
            merge_index = batch.to(tl.int64) * stride_lb + merge_heads.to(tl.int64) * stride_lh + q_start + merge_rows
            merged, merged_lse = merge_chunks(PartialOut, PartialLse, merge_index, merge_in_range, num_rows,
                                              tl.num_programs(1), offs_d, HEAD_DIM, MERGE_CHUNKS, ".cg")
            if SINKS:
                merged, merged_lse = _with_sinks(merged, merged_lse * LOG2_E, Sinks, merge_heads, stride_sh)
                merged_lse = merged_lse * LN_2
            merge_out = (Out + batch.to(tl.int64) * stride_ob + (q_start + merge_rows).to(tl.int64) * stride_om
                         + merge_heads.to(tl.int64) * stride_oh)
            tl.store(merge_out[:, None] + offs_d[None, :] * stride_od, merged.to(Out.dtype.element_ty),
                     mask=merge_in_range[:, None] & (offs_d[None, :] < HEAD_DIM))
            tl.store(Lse + merge_index, merged_lse, mask=merge_in_range)
    else:
        tl.store(o_rows[:, None] + offs_d[None, :] * stride_od, out.to(Out.dtype.element_ty), mask=q_mask)
        tl.store(Lse + index, lse * LN_2, mask=in_range)

    if VARLEN_Q:
        # A sequence longer than the grid covers (max_seqlen_q below its length): its rows past the
        # grid are not computed, and come out NaN rather than whatever memory held.
        if (tile == tl.num_programs(2) - 1) & (split == 0):
            packed_rows = group_size * seqlen_q
            for first in range(tile * BLOCK_M + BLOCK_M, packed_rows, BLOCK_M):
                packed = first + tl.arange(0, BLOCK_M)
                in_range = packed < packed_rows
                rows = q_start + packed // group_size
                heads = kv_head * group_size + packed % group_size
                o_rows = Out + rows.to(tl.int64) * stride_om + heads.to(tl.int64) * stride_oh
                nan = tl.full([BLOCK_M, BLOCK_D], float("nan"), tl.float32)
                tl.store(o_rows[:, None] + offs_d[None, :] * stride_od, nan.to(Out.dtype.element_ty),
                         mask=in_range[:, None] & (offs_d[None, :] < HEAD_DIM))
                tl.store(Lse + heads.to(tl.int64) * stride_lh + rows, tl.full([BLOCK_M], float("nan"), tl.float32),
                         mask=in_range)
