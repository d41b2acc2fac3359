"""The forward for grids too small to fill the GPU (decode: a few query rows, many keys).

The per-tile forward runs one program per (query block, batch, query head): with one query row
and 32 heads that is 32 programs streaming all keys each, on a 132-multiprocessor H100. Here:

* the query rows of every head that shares a key/value head are packed into one tile (GQA:
  ``group * Sq`` rows), so K and V are read once per KV head, not once per query head;
* the keys are cut into ``num_splits`` chunks of whole blocks, one program per (chunk, batch,
  KV head): each writes its chunk's normalised output and log-sum-exp in float32;
* :func:`split_kv_combine_kernel` merges the chunks of each row: weights ``2^(lse_s - max)``,
  the exact softmax over all keys. A row that sees no key in a chunk gives LSE -inf there, and
  zeros and LSE -inf if it sees none at all.

The key window is :mod:`fmha.backends.triton.masking`'s rule, applied to each packed row's own
query position; chunks outside a tile's window run no blocks.
"""

import triton
import triton.language as tl

from .common import block_and_batch_head, chain_launches, load_rows, wide_stride
from .forward import LN_2, _softmax_update
from .masking import visible
from .scores import NO_MASK


@triton.jit
def merge_chunks(PartialOut, PartialLse, index, in_range, num_rows, num_splits, offs_d,
                 HEAD_DIM: tl.constexpr, CHUNKS: tl.constexpr, CACHE_MODIFIER: tl.constexpr):
    """Rows ``index`` (flattened (batch, head, i)) merged over the chunks, in groups of ``CHUNKS``
    (a power of two) in chunk order, a running max across the groups (as the forward's online
    softmax): the exact softmax over all keys, ``(out [rows, BLOCK_D] f32, lse [rows] f32 natural
    log)``. A row that saw no key in any chunk gets zeros and -inf. A group's partials are loaded
    at once, so the merge waits one L2 round trip per group rather than one per chunk. The sum
    over a group is a fixed tree: the result depends only on the stored partials. ``CACHE_MODIFIER``
    ".cg" reads past the L1 (other programs of the same launch wrote the partials)."""
    d_in_range = (offs_d < HEAD_DIM)[None, None, :]
    row_max = tl.full(index.shape, float("-inf"), dtype=tl.float32)
    total = tl.zeros(index.shape, dtype=tl.float32)
    acc = tl.zeros([index.shape[0], offs_d.shape[0]], dtype=tl.float32)
    for first in range(0, num_splits, CHUNKS):
        chunks = first + tl.arange(0, CHUNKS)
        # [rows, CHUNKS(, columns)]: the compiler spreads the warps over the first axis, so the sums
        # over the chunks stay within each thread.
        live = in_range[:, None] & (chunks < num_splits)[None, :]
        rows = index[:, None] + chunks.to(tl.int64)[None, :] * num_rows
        lse = tl.load(PartialLse + rows, mask=live, other=float("-inf"), cache_modifier=CACHE_MODIFIER)
        part = tl.load(PartialOut + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                       mask=live[:, :, None] & d_in_range, other=0.0, cache_modifier=CACHE_MODIFIER)
        new_max = tl.maximum(row_max, tl.max(lse, 1))
        new_max_safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # exp2(-inf - 0) = 0, never NaN
        rescale = tl.math.exp2(row_max - new_max_safe)
        weight = tl.math.exp2(lse - new_max_safe[:, None])
        total = total * rescale + tl.sum(weight, 1)
        acc = acc * rescale[:, None] + tl.sum(weight[:, :, None] * part, 1)
        row_max = new_max
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    max_safe = tl.where(row_max == float("-inf"), 0.0, row_max)
    lse = tl.where(seen, (max_safe + tl.math.log2(tl.where(seen, total, 1.0))) * LN_2, float("-inf"))
    return out, lse


def merge_group(rows: int, block_d: int, num_warps: int, splits: int, registers: int = 64) -> int:
    """Chunks :func:`merge_chunks` loads at once: a power of two, at most ``splits`` rounded up, and
    ``rows · block_d`` float32 values per chunk within about ``registers`` a thread (the KV-cache
    kernel's merge shares its registers with the key loop; the combine kernel has nothing else).
    Tiles of more than 16 rows (prefill: compute-bound, few chunks) take one chunk at a time: CUDA
    13's ptxas crashed on a merge of 2 chunks x 128 rows x 64 columns (H100, triton 3.6)."""
    if rows > 16:
        return 1
    budget = registers * 32 * num_warps // (rows * block_d)
    return max(1, min(triton.next_power_of_2(max(splits, 1)), triton.next_power_of_2(budget + 1) // 2))


@triton.jit
def attention_split_kv_kernel(
    Q, K, V, Out, Lse, PartialOut, PartialLse,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    num_rows, num_kv_heads, group_size, seqlen_q, seqlen_k, lo, hi, qk_scale, chunk,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr, ONE_CHUNK: tl.constexpr,
    PDL: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
):
    """Program (chunks of (batch, KV head) on the first axis, chunk fastest; packed block): ``PartialOut[split, b, h, i]`` and
    ``PartialLse[split, b, h, i]`` (log2 units) over keys [split * chunk, (split + 1) * chunk).
    ONE_CHUNK (one chunk holds every key): ``Out[b, h, i]`` and ``Lse[b, h, i]`` (natural log)
    directly, with no combine kernel after it. PDL: the combine kernel launches early
    (:func:`chain_launches`)."""
    chain_launches(PDL)
    stride_qm, stride_kn = wide_stride(stride_qm, WIDE_OFFSETS), wide_stride(stride_kn, WIDE_OFFSETS)
    stride_vn, stride_om = wide_stride(stride_vn, WIDE_OFFSETS), wide_stride(stride_om, WIDE_OFFSETS)
    split, batch_head = block_and_batch_head(tl.cdiv(seqlen_k, chunk))
    batch = batch_head // num_kv_heads
    kv_head = batch_head % num_kv_heads
    packed = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of the (group, Sq) matrix
    in_range = packed < group_size * seqlen_q
    head = kv_head * group_size + packed // seqlen_q
    rows = packed % seqlen_q  # each packed row's query position
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_in_range = offs_d[None, :] < HEAD_DIM

    q = tl.load(Q + batch.to(tl.int64) * stride_qb + head[:, None].to(tl.int64) * stride_qh
                + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=in_range[:, None] & d_in_range, other=0.0)  # [BLOCK_M, BLOCK_D]
    k_ptrs = (K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
              + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd)
    v_ptrs = (V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
              + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd)

    # This chunk, narrowed to the keys that some row of the tile sees (chunks are whole blocks).
    kv_start = split * chunk
    kv_end = tl.minimum(kv_start + chunk, seqlen_k)
    if HAS_RIGHT:
        kv_end = tl.minimum(kv_end, tl.max(tl.where(in_range, rows, 0)) + hi + 1)
    if HAS_LEFT:
        first_seen = tl.maximum(tl.min(tl.where(in_range, rows, seqlen_q)) + lo, 0) // BLOCK_N * BLOCK_N
        kv_start = tl.maximum(kv_start, first_seen)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # Score features are off here (fmha.backends.triton.config.split_kv_config): no score modifiers.
    for start_n in range(kv_start, kv_end, BLOCK_N):
        keys = start_n + offs_n
        k = load_rows(k_ptrs + start_n * stride_kn, keys, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, True)
        raw_scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        v = load_rows(v_ptrs + start_n * stride_vn, keys, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, True)
        acc, row_sum, row_max = _softmax_update(
            acc, row_sum, row_max, raw_scores, v, start_n, keys, rows, seqlen_q, seqlen_k, lo, hi, qk_scale,
            (0.0, 0.0, 0, 0, 0, 0, 0, 0, 0.0), True, HAS_LEFT, HAS_RIGHT, DOT_PRECISION, False,
            False, False, NO_MASK, False)

    seen = row_sum > 0.0
    row_sum_safe = tl.where(seen, row_sum, 1.0)
    out = acc / row_sum_safe[:, None]
    lse = tl.where(seen, row_max + tl.math.log2(row_sum_safe), float("-inf"))
    # (split, batch, head, row) flattened: rows of one split are [0, num_rows)
    index = split.to(tl.int64) * num_rows + (batch * num_kv_heads * group_size + head) * seqlen_q + rows
    if ONE_CHUNK:
        tl.store(Out + batch.to(tl.int64) * stride_ob + head[:, None].to(tl.int64) * stride_oh
                 + rows[:, None] * stride_om + offs_d[None, :] * stride_od, out.to(Out.dtype.element_ty),
                 mask=in_range[:, None] & d_in_range)
        tl.store(Lse + index, lse * LN_2, mask=in_range)
    else:
        tl.store(PartialOut + index[:, None] * HEAD_DIM + offs_d[None, :], out, mask=in_range[:, None] & d_in_range)
        tl.store(PartialLse + index, lse, mask=in_range)


@triton.jit
def split_kv_combine_kernel(
    PartialOut, PartialLse, Out, Lse,
    stride_ob, stride_oh, stride_om, stride_od,
    num_rows, num_q_heads, seqlen_q, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr, CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows (batch, head, i) flattened: the exact softmax over all chunks (``CHUNKS`` loaded at
    once), into Out and Lse. PDL: launched early, it waits for the chunk kernel
    (:func:`chain_launches`)."""
    chain_launches(PDL)
    index = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_range = index < num_rows
    offs_d = tl.arange(0, BLOCK_D)
    mask = in_range[:, None] & (offs_d[None, :] < HEAD_DIM)
    out, lse = merge_chunks(PartialOut, PartialLse, index, in_range, num_rows, num_splits, offs_d, HEAD_DIM, CHUNKS,
                            "")
    batch = index // (num_q_heads * seqlen_q)
    head = index // seqlen_q % num_q_heads
    row = index % seqlen_q
    tl.store(Out + batch[:, None].to(tl.int64) * stride_ob + head[:, None].to(tl.int64) * stride_oh
             + row[:, None] * stride_om + offs_d[None, :] * stride_od, out.to(Out.dtype.element_ty), mask=mask)
    tl.store(Lse + index, lse, mask=in_range)
