"""Which keys each query sees, in Triton: the rule of :mod:`fmha.masking` for the kernels.

A launch describes the window with two integers: row i sees keys ``i + lo <= j <= i + hi`` (and
``j < Sk``), with ``lo = offset - left`` and ``hi = offset + right`` (``offset`` the row's key
position, :class:`fmha.masking.Window`). ``HAS_LEFT`` / ``HAS_RIGHT`` say whether each side is
bounded at all, so an unbounded side costs nothing: causal is ``HAS_RIGHT`` with ``hi = Sk - Sq``
(or 0), a sliding window adds ``HAS_LEFT``.

Tiles are cut into three ranges of blocks: a masked range, whole blocks visible to every row of
the tile (no per-score mask), and a masked range; blocks outside the window are never visited.
"""

import triton
import triton.language as tl


@triton.jit
def visible(rows, keys, seqlen_k, lo, hi, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Whether row ``rows`` sees key ``keys`` (integer tiles that broadcast, e.g. [M, 1] and [1, N]).

    One compare per score without a left bound: each row's last visible key, then ``keys <= last``.
    """
    last = seqlen_k - 1
    if HAS_RIGHT:
        last = tl.minimum(rows + hi, last)
    seen = keys <= last
    if HAS_LEFT:
        seen = seen & (keys >= rows + lo)
    return seen


@triton.jit
def key_blocks(first_row, num_rows, seqlen_k, lo, hi,
               BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Keys seen by rows [first_row, first_row + num_rows): ``(kv_start, full_start, full_end, kv_end)``.

    [kv_start, full_start) and [full_end, kv_end) run masked; [full_start, full_end) are whole
    blocks that every row sees entirely. kv_start, full_start and full_end are block multiples
    (full_start may equal kv_end, which is then not one); an empty window gives kv_end == kv_start.
    """
    if HAS_RIGHT:
        kv_end = tl.minimum(seqlen_k, first_row + num_rows + hi)
        full_end = tl.minimum(seqlen_k, first_row + hi + 1)
    else:
        kv_end = seqlen_k
        full_end = seqlen_k
    if HAS_LEFT:
        kv_start = tl.maximum(first_row + lo, 0) // BLOCK_N * BLOCK_N
        full_start = tl.cdiv(tl.maximum(first_row + num_rows - 1 + lo, 0), BLOCK_N) * BLOCK_N
        kv_end = tl.maximum(kv_end, kv_start)
        full_start = tl.minimum(tl.maximum(full_start, kv_start), kv_end)
    else:
        kv_start = 0
        full_start = 0
        kv_end = tl.maximum(kv_end, 0)
    full_end = tl.maximum(tl.minimum(tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N, kv_end), full_start)
    return kv_start, full_start, full_end, kv_end


@triton.jit
def query_blocks(first_key, num_keys, seqlen_q, lo, hi,
                 BLOCK_M: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Rows that see keys [first_key, first_key + num_keys): ``(m_start, full_start, full_end, m_end)``.

    The transpose of :func:`key_blocks`, for the backward's key-resident kernel: [m_start,
    full_start) and [full_end, m_end) run masked (rows past Sq included), [full_start, full_end)
    are whole blocks of rows that see every key of the tile.
    """
    if HAS_RIGHT:
        m_start = tl.maximum(first_key - hi, 0) // BLOCK_M * BLOCK_M
        full_start = tl.cdiv(tl.maximum(first_key + num_keys - 1 - hi, 0), BLOCK_M) * BLOCK_M
    else:
        m_start = 0
        full_start = 0
    if HAS_LEFT:
        m_end = tl.minimum(seqlen_q, first_key + num_keys - lo)
        full_end = tl.minimum(seqlen_q, first_key - lo + 1)
    else:
        m_end = seqlen_q
        full_end = seqlen_q
    m_end = tl.maximum(tl.cdiv(tl.maximum(m_end, 0), BLOCK_M) * BLOCK_M, m_start)
    full_start = tl.minimum(tl.maximum(full_start, m_start), m_end)
    full_end = tl.maximum(tl.minimum(tl.maximum(full_end, 0) // BLOCK_M * BLOCK_M, m_end), full_start)
    return m_start, full_start, full_end, m_end
