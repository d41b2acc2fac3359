"""Packed variable-length sequences (varlen): where each sequence lies, and which tile runs when.

A varlen call packs B sequences along one token axis: sequence b holds tokens
``cu_seqlens[b] <= t < cu_seqlens[b + 1]`` of q (and of k and v through ``cu_seqlens_k``). The
kernels index the packed tensors directly; :func:`sequence_span` reads one sequence's start and
length, clamped into the tensor, so lengths that do not add up can never move a load or a store
outside it.

Tiles (one block of rows of one sequence) are listed longest-first by
:func:`varlen_schedule_kernel`, a one-program kernel run before the attention kernel: with E
entries, program p works on entry p % E for head p // E, so the tiles of one head run side by
side and share its K/V in L2 (docs/perf.md, "Varlen"). Under a causal mask a query block's cost grows with its index,
so each head's list runs the deepest blocks of the longest sequences first and the cheap tiles
fill the tail of the wave: one long sequence among many short ones is not left running alone
at the end. The key-resident backward kernel lists
its blocks from the sequence's end (``FROM_END``), where a key block sees the most queries.
"""

import triton
import triton.language as tl


@triton.jit
def sequence_span(cu_seqlens, seq, total):
    """``(start, length)`` of sequence ``seq``, clamped into [0, total]."""
    start = tl.load(cu_seqlens + seq)
    end = tl.load(cu_seqlens + seq + 1)
    start = tl.minimum(tl.maximum(start, 0), total)
    end = tl.minimum(tl.maximum(end, start), total)
    return start, end - start


@triton.jit
def program_tile(Tiles, num_heads):
    """``(seq, block, head)`` of this program: entry p % E of the E-entry list, head p // E
    (seq is -1 past the list's last tile)."""
    entries = tl.num_programs(0) // num_heads
    entry = tl.program_id(0) % entries
    return tl.load(Tiles + 2 * entry), tl.load(Tiles + 2 * entry + 1), tl.program_id(0) // entries


@triton.jit
def packed_spans(cu_seqlens_q, cu_seqlens_k, seq, total_q, total_k):
    """``(q_start, seqlen_q, k_start, seqlen_k)`` of sequence ``seq`` (:func:`sequence_span`)."""
    q_start, seqlen_q = sequence_span(cu_seqlens_q, seq, total_q)
    k_start, seqlen_k = sequence_span(cu_seqlens_k, seq, total_k)
    return q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def program_block(Tiles, cu_seqlens_q, cu_seqlens_k, num_heads, seqlen_q, seqlen_k, lo, hi, VARLEN: tl.constexpr):
    """This program's block and head and where its sequence lies, for the kernels with a
    (blocks, B·H) grid: ``(past_end, block, batch, head, q_start, k_start, seqlen_q, seqlen_k, lo, hi)``.

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
        return (False, tl.program_id(0), tl.program_id(1) // num_heads, tl.program_id(1) % num_heads, 0, 0,
                seqlen_q, seqlen_k, lo, hi)


@triton.jit
def _blocks_per_sequence(cu_seqlens, seqs, num_seqs, total, BLOCK: tl.constexpr):
    in_range = seqs < num_seqs
    start = tl.load(cu_seqlens + seqs, mask=in_range, other=0)
    end = tl.load(cu_seqlens + seqs + 1, mask=in_range, other=0)
    start = tl.minimum(tl.maximum(start, 0), total)
    end = tl.minimum(tl.maximum(end, start), total)
    return tl.where(in_range, tl.cdiv(end - start, BLOCK), 0)


@triton.jit
def varlen_schedule_kernel(CuSeqlens, Tiles, num_seqs, total, num_tiles,
                           BLOCK: tl.constexpr, FROM_END: tl.constexpr, BLOCK_SEQS: tl.constexpr):
    """``Tiles[2r], Tiles[2r + 1]`` = sequence and block of the r-th tile; (-1, 0) past the last.

    A tile's depth is its block index (or, ``FROM_END``, its distance from the sequence's last
    block); tiles are written deepest first, sequences in order within one depth.
    """
    deepest = 0
    for first in range(0, num_seqs, BLOCK_SEQS):
        seqs = first + tl.arange(0, BLOCK_SEQS)
        deepest = tl.maximum(deepest, tl.max(_blocks_per_sequence(CuSeqlens, seqs, num_seqs, total, BLOCK)))
    written = 0
    for step in range(0, deepest):
        depth = deepest - 1 - step
        for first in range(0, num_seqs, BLOCK_SEQS):
            seqs = first + tl.arange(0, BLOCK_SEQS)
            blocks = _blocks_per_sequence(CuSeqlens, seqs, num_seqs, total, BLOCK)
            has_tile = blocks > depth
            slots = written + tl.cumsum(has_tile.to(tl.int32), 0) - 1
            if FROM_END:
                block = blocks - 1 - depth
            else:
                block = tl.zeros_like(blocks) + depth
            # Lengths that overlap could list more tiles than the grid holds: never write past it.
            keep = has_tile & (slots < num_tiles)
            tl.store(Tiles + 2 * slots, seqs, mask=keep)
            tl.store(Tiles + 2 * slots + 1, block, mask=keep)
            written += tl.sum(has_tile.to(tl.int32), 0)
    for first in range(written, num_tiles, BLOCK_SEQS):
        slots = first + tl.arange(0, BLOCK_SEQS)
        tl.store(Tiles + 2 * slots, tl.full([BLOCK_SEQS], -1, tl.int32), mask=slots < num_tiles)
        tl.store(Tiles + 2 * slots + 1, tl.zeros([BLOCK_SEQS], tl.int32), mask=slots < num_tiles)
