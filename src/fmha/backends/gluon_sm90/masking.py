"""Which keys each query sees, in Gluon: the rule of :mod:`fmha.masking` for the Hopper kernels.

The same contract as :mod:`fmha.backends.triton.masking` (row i sees keys ``i + lo <= j <= i + hi``
and ``j < Sk``; ``HAS_LEFT`` / ``HAS_RIGHT`` switch each side on), written again because a Gluon
kernel cannot call ``triton.jit`` helpers (nor, under TRITON_INTERPRET=1, interpreted ones).
Ranges are counted in key blocks, as the Hopper kernel's load ring walks them.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def visible(rows, keys, seqlen_k, lo, hi, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """Whether row ``rows`` sees key ``keys`` (integer tensors that broadcast, e.g. [M, 1] and [1, N]).

    One compare per score without a left bound: each row's last visible key, then ``keys <= last``.
    Callers may shift keys, seqlen_k, lo and hi by the same amount (block-relative keys).
    """
    last = seqlen_k - 1
    if HAS_RIGHT:
        last = gl.minimum(rows + hi, last)
    seen = keys <= last
    if HAS_LEFT:
        seen = seen & (keys >= rows + lo)
    return seen


@gluon.jit
def _thread_columns_below(limit):
    """How many of the numbers 8i + e (e in {0, 1}, 0 <= i < 16) lie below ``limit``, in [0, 32]."""
    count = (limit >> 3) * 2 + gl.minimum(limit & 7, 2)
    return gl.minimum(gl.maximum(count, 0), 32)


@gluon.jit
def _low_bits(count):
    """uint32 words with their ``count`` (0 to 32) low bits set."""
    return ((gl.full_like(count, 1).to(gl.int64) << count.to(gl.int64)) - 1).to(gl.uint32)


@gluon.jit
def columns_within(first, last, columns0, HAS_FIRST: gl.constexpr):
    """Whether column j of each row lies in [first, last] (``first`` and ``last``: [rows, 1] int32;
    without HAS_FIRST only ``j <= last`` is checked); ``columns0``: ``arange(0, N)``, N <= 128, in a
    slice of the block's layout. The same answer as compares per element, through a word of bits
    per row.

    Column j splits into ``j & 6`` and the bit ``2 · (j >> 3) + (j & 1)`` of a word, and a row's word
    has the bits of the columns it keeps among those with its ``j & 6``. Any layout gives the same
    result; in the wgmma accumulator's, where a thread holds columns 8i + 2c + e, ``j & 6`` = 2c is
    the same in all of a thread's registers, so a thread builds one word per row and each element
    costs a bit test and a select: fewer instructions than two compares and their selects."""
    columns = columns0[None, :]
    pair = columns & 6
    bit = ((columns >> 3) * 2 + (columns & 1)).to(gl.uint32)
    # j <= last exactly when j - (j & 6) = 8i + e lies below last + 1 - (j & 6).
    word = _low_bits(_thread_columns_below(last + 1 - pair))
    if HAS_FIRST:
        word = word & ~_low_bits(_thread_columns_below(first - pair))
    return ((word >> bit) & 1) != 0


@gluon.jit
def visible_block(rows, keys0, seqlen_k, lo, hi, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """:func:`visible` for rows ``rows`` ([M]) and block-relative keys ``keys0`` (``arange(0, N)``;
    seqlen_k, lo and hi shifted by the block's first key) through :func:`columns_within`."""
    last = gl.zeros_like(rows) + (seqlen_k - 1)  # one per row, with or without a right bound
    if HAS_RIGHT:
        last = gl.minimum(rows + hi, last)
    return columns_within(rows[:, None] + lo, last[:, None], keys0, HAS_LEFT)


@gluon.jit
def visible_block_transposed(keys, rows0, first_row, row_end, seqlen_k, lo, hi,
                             HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """:func:`visible` for keys ``keys`` ([N]) against rows ``first_row + rows0`` (``arange(0, M)``)
    that are also below ``row_end``, as a [N, M] block (the backward's Sᵀ), through
    :func:`columns_within`: key k is seen by rows k - hi <= r <= k - lo, and by none past seqlen_k."""
    last = row_end - 1 - first_row
    if HAS_LEFT:
        last = gl.minimum(keys - lo - first_row, last)
    last = gl.where(keys < seqlen_k, last, -1)
    return columns_within((keys - hi - first_row)[:, None], last[:, None], rows0, HAS_RIGHT)


@gluon.jit
def key_blocks(first_row, num_rows, seqlen_k, lo, hi,
               BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """Key blocks seen by rows [first_row, first_row + num_rows): ``(start, full_start, full_end, end)``.

    Blocks [start, full_start) and [full_end, end) need the per-score mask; [full_start, full_end)
    are seen whole by every row. An empty window gives end == start.
    """
    if HAS_RIGHT:
        kv_end = gl.minimum(seqlen_k, first_row + num_rows + hi)
        full_end = gl.minimum(seqlen_k, first_row + hi + 1)
    else:
        kv_end = seqlen_k
        full_end = seqlen_k
    if HAS_LEFT:
        start = gl.maximum(first_row + lo, 0) // BLOCK_N
        full_start = gl.cdiv(gl.maximum(first_row + num_rows - 1 + lo, 0), BLOCK_N)
    else:
        start = 0
        full_start = 0
    end = gl.maximum(gl.cdiv(gl.maximum(kv_end, 0), BLOCK_N), start)
    full_start = gl.minimum(gl.maximum(full_start, start), end)
    full_end = gl.maximum(gl.minimum(gl.maximum(full_end, 0) // BLOCK_N, end), full_start)
    return start, full_start, full_end, end


@gluon.jit
def sequence_span(cu_seqlens, seq, total):
    """``(start, length)`` of packed sequence ``seq``, clamped into [0, total]
    (:func:`fmha.backends.triton.varlen.sequence_span`)."""
    start = gl.load(cu_seqlens + seq)
    end = gl.load(cu_seqlens + seq + 1)
    start = gl.minimum(gl.maximum(start, 0), total)
    end = gl.minimum(gl.maximum(end, start), total)
    return start, end - start


# The last heads of a launch that walk their tiles together (fmha.backends.triton.varlen.TAIL_HEADS).
TAIL_HEADS: gl.constexpr = gl.constexpr(4)


@gluon.jit
def head_and_entry(tile, entries, num_heads):
    """``(head, entry)`` of tile ``tile`` of a launch of ``entries`` tiles for each of ``num_heads``
    heads (:func:`fmha.backends.triton.varlen.head_and_entry`)."""
    tail_heads = gl.minimum(num_heads, TAIL_HEADS)
    tail_start = (num_heads - tail_heads) * entries
    within = gl.maximum(tile - tail_start, 0)
    head = gl.where(tile < tail_start, tile // entries, num_heads - tail_heads + within % tail_heads)
    entry = gl.where(tile < tail_start, tile % entries, within // tail_heads)
    return head, entry


@gluon.jit
def query_blocks(first_key, num_keys, seqlen_q, lo, hi,
                 BLOCK_M: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """Rows that see keys [first_key, first_key + num_keys), in rows rounded to BLOCK_M:
    ``(m_start, full_start, full_end, m_end)`` (:func:`fmha.backends.triton.masking.query_blocks`).

    [m_start, full_start) and [full_end, m_end) need the per-score mask; the rows of
    [full_start, full_end) see every key of the tile (the end of K is the caller's to check).
    """
    if HAS_RIGHT:
        m_start = gl.maximum(first_key - hi, 0) // BLOCK_M * BLOCK_M
        full_start = gl.cdiv(gl.maximum(first_key + num_keys - 1 - hi, 0), BLOCK_M) * BLOCK_M
    else:
        m_start = 0
        full_start = 0
    if HAS_LEFT:
        m_end = gl.minimum(seqlen_q, first_key + num_keys - lo)
        full_end = gl.minimum(seqlen_q, first_key - lo + 1)
    else:
        m_end = seqlen_q
        full_end = seqlen_q
    m_end = gl.maximum(gl.cdiv(gl.maximum(m_end, 0), BLOCK_M) * BLOCK_M, m_start)
    full_start = gl.minimum(gl.maximum(full_start, m_start), m_end)
    full_end = gl.maximum(gl.minimum(gl.maximum(full_end, 0) // BLOCK_M * BLOCK_M, m_end), full_start)
    return m_start, full_start, full_end, m_end
