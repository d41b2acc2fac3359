"""Packed variable-length sequences (varlen): where each sequence lies, and which tile runs when.

A varlen call packs B sequences along one token axis: sequence b holds tokens
``cu_seqlens[b] <= t < cu_seqlens[b + 1]`` of q (and of k and v through ``cu_seqlens_k``). The
kernels index the packed tensors directly; :func:`sequence_span` reads one sequence's start and
length, clamped into the tensor, so lengths that do not add up can never move a load or a store
outside it.

Tiles (one block of rows of one sequence) are listed longest-first by
:func:`varlen_schedule_kernel`, a one-program kernel run before the attention kernel, and the
heads take the list one after the other, the last few together (:func:`head_and_entry`), so that
the tiles of a head run side by side and share its K/V in L2 (docs/perf.md, "Varlen"). Under a
causal mask a query block's cost grows with its index, so the list runs the deepest blocks of the
longest sequences first and the cheap tiles fill the tail of the wave: one long sequence among
many short ones is not left running alone at the end. The key-resident backward kernel lists its
blocks from the sequence's end (``FROM_END``), where a key block sees the most queries.
"""

import triton
import triton.language as tl

from .common import block_and_batch_head, chain_launches


@triton.jit
def sequence_span(cu_seqlens, seq, total):
    """``(start, length)`` of sequence ``seq``, clamped into [0, total]."""
    start = tl.load(cu_seqlens + seq)
    end = tl.load(cu_seqlens + seq + 1)
    start = tl.minimum(tl.maximum(start, 0), total)
    end = tl.minimum(tl.maximum(end, start), total)
    return start, end - start


# The last heads of a launch that walk their tiles together (see head_and_entry).
TAIL_HEADS: tl.constexpr = tl.constexpr(4)


@triton.jit
def head_and_entry(tile, entries, num_heads):
    """``(head, entry)`` of tile ``tile`` of a launch of ``entries`` tiles for each of ``num_heads``
    heads (a packed call's tile list, or a dense head's query or key blocks), each head's taken
    longest first. The heads go one after the other, so that the tiles of one head run side by side
    and share its K/V in L2, except the last TAIL_HEADS heads, which walk their entries together
    (entry 0 of each, then entry 1, ...): their longest tiles then start with the others' instead of
    alone at the end of the launch."""
    tail_heads = tl.minimum(num_heads, TAIL_HEADS)
    tail_start = (num_heads - tail_heads) * entries
    within = tl.maximum(tile - tail_start, 0)
    head = tl.where(tile < tail_start, tile // entries, num_heads - tail_heads + within % tail_heads)
    entry = tl.where(tile < tail_start, tile % entries, within // tail_heads)
    return head, entry


@triton.jit
def program_tile(Tiles, num_heads):
    """``(seq, block, head)`` of this program, the grid's p-th tile (:func:`head_and_entry`; seq is
    -1 past the list's last tile)."""
    head, entry = head_and_entry(tl.program_id(0), tl.num_programs(0) // num_heads, num_heads)
    return tl.load(Tiles + 2 * entry), tl.load(Tiles + 2 * entry + 1), head


@triton.jit
def packed_spans(cu_seqlens_q, cu_seqlens_k, seq, total_q, total_k):
    """``(q_start, seqlen_q, k_start, seqlen_k)`` of sequence ``seq`` (:func:`sequence_span`)."""
    q_start, seqlen_q = sequence_span(cu_seqlens_q, seq, total_q)
    k_start, seqlen_k = sequence_span(cu_seqlens_k, seq, total_k)
    return q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def program_block(Tiles, cu_seqlens_q, cu_seqlens_k, num_heads, seqlen_q, seqlen_k, lo, hi, num_blocks,
                  VARLEN: tl.constexpr):
    """This program's block and head and where its sequence lies, for the kernels with a
    (blocks, B·H) grid flattened to one axis (:func:`block_and_batch_head`, ``num_blocks`` blocks
    per (batch, head)): ``(past_end, block, batch, head, q_start, k_start, seqlen_q, seqlen_k, lo, hi)``.

    Packed sequences walk the tile list: seqlen_q/seqlen_k come in as the totals and go out as the
    sequence's lengths, lo/hi gain its Sk - Sq, and batch is the sequence (packed tensors have
    batch strides 0); ``past_end`` marks an entry past the list's last tile.
    """
    if VARLEN:
        seq, block, head = program_tile(Tiles, num_heads)
        q_start, seqlen_q, k_start, seqlen_k = packed_spans(cu_seqlens_q, cu_seqlens_k, tl.maximum(seq, 0),
                                                            seqlen_q, seqlen_k)
        offset = seqlen_k - seqlen_q
        return seq < 0, block, seq, head, q_start, k_start, seqlen_q, seqlen_k, lo + offset, hi + offset
    else:
        block, batch_head = block_and_batch_head(num_blocks)
        return False, block, batch_head // num_heads, batch_head % num_heads, 0, 0, seqlen_q, seqlen_k, lo, hi


@triton.jit
def _blocks_per_sequence(cu_seqlens, seqs, num_seqs, total, BLOCK: tl.constexpr):
    in_range = seqs < num_seqs
    start = tl.load(cu_seqlens + seqs, mask=in_range, other=0)
    end = tl.load(cu_seqlens + seqs + 1, mask=in_range, other=0)
    start = tl.minimum(tl.maximum(start, 0), total)
    end = tl.minimum(tl.maximum(end, start), total)
    return tl.where(in_range, tl.cdiv(end - start, BLOCK), 0)


@triton.jit
def _list_depths(Tiles, seqs, blocks, depth, first_slot, num_tiles, FROM_END: tl.constexpr):
    """Write the tiles of ``seqs`` at each of the depths ``depth`` (below 0: none) from that
    depth's ``first_slot`` on, in sequence order."""
    has_tile = (blocks[None, :] > depth[:, None]) & (depth[:, None] >= 0)
    slots = first_slot[:, None] + tl.cumsum(has_tile.to(tl.int32), axis=1) - 1
    if FROM_END:
        block = blocks[None, :] - 1 - depth[:, None]
    else:
        block = tl.zeros_like(blocks)[None, :] + depth[:, None]
    # Lengths that overlap could list more tiles than the grid holds: never write past it.
    keep = has_tile & (slots < num_tiles)
    tl.store(Tiles + 2 * slots, tl.zeros_like(block) + seqs[None, :], mask=keep)
    tl.store(Tiles + 2 * slots + 1, block, mask=keep)


@triton.jit
def varlen_schedule_kernel(CuSeqlens, Tiles, num_seqs, total, num_tiles,
                           BLOCK: tl.constexpr, FROM_END: tl.constexpr, BLOCK_SEQS: tl.constexpr,
                           BLOCK_DEPTHS: tl.constexpr, PDL: tl.constexpr):
    """``Tiles[2r], Tiles[2r + 1]`` = sequence and block of the r-th tile; (-1, 0) past the last;
    ``Tiles[2 num_tiles]`` (a tile counter for the kernels that draw tiles) = 0.

    A tile's depth is its block index (or, ``FROM_END``, its distance from the sequence's last
    block); tiles are written deepest first, sequences in order within one depth. Up to
    BLOCK_SEQS sequences, the lengths are loaded once and BLOCK_DEPTHS depths are listed at a time
    (a tile's slot is the count of deeper tiles plus its rank within its depth); more sequences
    are listed one depth at a time, BLOCK_SEQS sequences at a time. PDL: the attention kernel
    launches as this one starts (:func:`chain_launches`).
    """
    chain_launches(PDL)
    written = 0
    if num_seqs <= BLOCK_SEQS:
        seqs = tl.arange(0, BLOCK_SEQS)
        blocks = _blocks_per_sequence(CuSeqlens, seqs, num_seqs, total, BLOCK)
        deepest = tl.max(blocks)
        for first in range(0, deepest, BLOCK_DEPTHS):
            depth = deepest - 1 - first - tl.arange(0, BLOCK_DEPTHS)
            deeper = tl.sum(tl.maximum(blocks[None, :] - 1 - depth[:, None], 0), axis=1)  # tiles at depths > depth
            _list_depths(Tiles, seqs, blocks, depth, deeper, num_tiles, FROM_END)
        written = tl.sum(blocks)
    else:
        deepest = 0
        for first in range(0, num_seqs, BLOCK_SEQS):
            seqs = first + tl.arange(0, BLOCK_SEQS)
            deepest = tl.maximum(deepest, tl.max(_blocks_per_sequence(CuSeqlens, seqs, num_seqs, total, BLOCK)))
        for step in range(0, deepest):
            depth = tl.zeros([1], tl.int32) + deepest - 1 - step
            for first in range(0, num_seqs, BLOCK_SEQS):
                seqs = first + tl.arange(0, BLOCK_SEQS)
                blocks = _blocks_per_sequence(CuSeqlens, seqs, num_seqs, total, BLOCK)
                # the chunk's tiles at this depth follow the deeper ones and the earlier chunks'
                _list_depths(Tiles, seqs, blocks, depth, tl.zeros([1], tl.int32) + written, num_tiles, FROM_END)
                written += tl.sum((blocks > depth).to(tl.int32), 0)
    for first in range(written, num_tiles, BLOCK_SEQS):
        slots = first + tl.arange(0, BLOCK_SEQS)
        tl.store(Tiles + 2 * slots, tl.full([BLOCK_SEQS], -1, tl.int32), mask=slots < num_tiles)
        tl.store(Tiles + 2 * slots + 1, tl.zeros([BLOCK_SEQS], tl.int32), mask=slots < num_tiles)
    tl.store(Tiles + 2 * num_tiles, 0)
