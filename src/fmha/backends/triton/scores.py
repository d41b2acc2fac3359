"""What each score becomes, in Triton: the helpers the forward and both backward kernels share.

The design's order of operations, in log2 units (natural-log score · log2 e, so the softmax runs
on ``exp2``):

1. ``scale · q·kᵀ``;
2. softcap: ``softcap · tanh(s / softcap)``;
3. bias: ALiBi's ``-slope_h · |pos(i) - j|`` with ``pos(i) = i + Sk - Sq``, and SDPA's float attn_mask;
4. masking: the key window (:mod:`fmha.backends.triton.masking`, applied by the callers) and SDPA's
   bool attn_mask (False hides the key);
5. softmax (the sink term is added where each row is normalised: the forward's last step);
6. dropout on P: :func:`dropout_keep`, counter-based bits regenerated identically by the backward.

Every feature is a constexpr switch: with all of them off, :func:`score_tile` is the multiply the
kernels always had, and the dense kernels compile to the same instructions.
"""

import triton
import triton.language as tl

LOG2_E: tl.constexpr = tl.constexpr(1.4426950408889634)
TWO_LOG2_E: tl.constexpr = tl.constexpr(2.8853900817779268)

# The SOFTCAP constexpr: off, or the tanh that caps the scores (:func:`exact_tanh`, :func:`fast_tanh`).
NO_SOFTCAP: tl.constexpr = tl.constexpr(0)
EXACT_TANH: tl.constexpr = tl.constexpr(1)
FAST_TANH: tl.constexpr = tl.constexpr(2)

# SDPA's attn_mask, the MASK constexpr.
NO_MASK: tl.constexpr = tl.constexpr(0)
BOOL_MASK: tl.constexpr = tl.constexpr(1)
FLOAT_MASK: tl.constexpr = tl.constexpr(2)


# Below this |x|, ``1 - 2 / (exp(2x) + 1)`` loses digits to cancellation (all of them as x -> 0), and
# :func:`exact_tanh` takes an odd polynomial instead.
TANH_POLYNOMIAL_BOUND: tl.constexpr = tl.constexpr(0.9)


@triton.jit
def exact_tanh(x):
    """tanh in float32 to about one ulp. Below TANH_POLYNOMIAL_BOUND, ``x + x³ · p(x²)`` with p of
    degree 5, fitted for the least maximum relative error on that interval; above it, the sign of x
    times ``1 - 2 / (exp(2|x|) + 1)``: one exp2 and one fast division, exact at the tails (±1, never
    NaN). Runs everywhere: the interpreter, float32 inputs, GPUs other than NVIDIA's."""
    magnitude = tl.abs(x)
    z = x * x
    odd = z * (-0.3333321884 + z * (0.1333045374 + z * (-0.05372604654 + z * (0.02091414318 + z * (
        -0.006870292969 + z * 0.001307918138)))))
    tails = 1.0 - tl.fdiv(2.0, tl.math.exp2(magnitude * TWO_LOG2_E) + 1.0)
    return tl.where(magnitude < TANH_POLYNOMIAL_BOUND, x + x * odd, tl.where(x < 0, -tails, tails))


@triton.jit
def fast_tanh(x):
    """One ``tanh.approx.f32`` (NVIDIA, sm_75 and later), as FlashAttention-3 caps its scores: half the
    special-function work of :func:`exact_tanh`. Its relative error is at most about 2^-11, so a capped
    score moves by at most about softcap · 2^-11: the launcher picks it for 16-bit inputs, whose own
    rounding is of that order, and keeps :func:`exact_tanh` for float32 ones."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def score_tile(raw, rows, keys, seqlen_q, seqlen_k, qk_scale, softcap_scale, slope, mask_ptr, stride_mm, stride_mn,
               SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASK: tl.constexpr):
    """``(scores, capped)`` of one tile: the scores in log2 units, and ``tanh(·)`` of the softcap
    (whose derivative ``1 - capped²`` the backward needs; ``raw`` when SOFTCAP is off). SOFTCAP is
    NO_SOFTCAP, EXACT_TANH or FAST_TANH; the backward recomputes ``capped`` with the forward's tanh.

    ``raw`` is Q·Kᵀ; ``rows`` and ``keys`` are integer tiles that broadcast to its shape ([M, 1] and
    [1, N], or [1, M] and [N, 1] for a transposed tile). ``qk_scale`` is ``scale · log2 e``, or
    ``scale / softcap`` with SOFTCAP, whose result is multiplied by ``softcap_scale = softcap · log2 e``;
    ``slope`` is the head's ALiBi slope · log2 e; ``mask_ptr`` points at the (batch, head)'s attn_mask.
    """
    if SOFTCAP:
        if SOFTCAP == FAST_TANH:
            capped = fast_tanh(raw * qk_scale)
        else:
            capped = exact_tanh(raw * qk_scale)
        scores = capped * softcap_scale
    else:
        capped = raw
        scores = raw * qk_scale
    if ALIBI:
        scores -= slope * tl.abs(rows + (seqlen_k - seqlen_q) - keys).to(tl.float32)
    if MASK != NO_MASK:
        in_range = (rows < seqlen_q) & (keys < seqlen_k)
        ptrs = mask_ptr + rows.to(tl.int64) * stride_mm + keys.to(tl.int64) * stride_mn
        if MASK == BOOL_MASK:
            allowed = tl.load(ptrs, mask=in_range, other=0)
            scores = tl.where(allowed != 0, scores, float("-inf"))
        else:
            bias = tl.load(ptrs, mask=in_range, other=0.0)
            scores += bias.to(tl.float32) * LOG2_E
    return scores, capped


# Philox-4x32's rounds per draw: FlashAttention-2's seven (Random123 finds seven enough for its
# statistical tests; ten is its default, with margin).
PHILOX_ROUNDS: tl.constexpr = tl.constexpr(7)
# Each counter's four words give sixteen 8-bit draws: two rows by eight keys.
DRAW_BITS: tl.constexpr = tl.constexpr(8)


@triton.jit
def _draws(seed, rng_row, rows, first_key, BLOCK_M: tl.constexpr, KEYS: tl.constexpr):
    """uint32 [BLOCK_M, KEYS]: the 8-bit draws of rows ``rows`` (the first a multiple of 16) and keys
    [first_key, first_key + KEYS) (both multiples of 32); see :func:`dropout_keep`."""
    # rows i with i % 16 < 8: the first row of each pair
    leaders, _ = tl.split(rows.reshape(BLOCK_M // 16, 2, 8).permute(0, 2, 1))  # [M / 16, 8]
    groups = (first_key // 8 + tl.arange(0, KEYS // 8)).to(tl.uint32)  # [N / 8]: 4 · (j // 32) + (j % 8) // 2
    shape: tl.constexpr = [BLOCK_M // 16, 8, KEYS // 8]
    pair_rows = tl.broadcast_to((rng_row + leaders.to(tl.int64)).to(tl.uint32)[:, :, None], shape)
    zeros = tl.zeros(shape, tl.uint32)
    word0, word1, word2, word3 = tl.philox(seed, zeros, pair_rows, zeros, tl.broadcast_to(groups[None, None, :], shape),
                                           PHILOX_ROUNDS)
    # [M/16, i % 8, group, word % 2 (= (j // 16) % 2), word // 2 (= (i // 8) % 2)]
    words = tl.join(tl.join(word0, word1), tl.join(word2, word3)).to(tl.uint32, bitcast=True)
    # byte b of a word: b % 2 = j % 2, b // 2 = (j // 8) % 2
    draws = tl.join(tl.join(words & 0xFF, (words >> 8) & 0xFF), tl.join((words >> 16) & 0xFF, words >> 24))
    # [M/16, i % 8, j // 32, (j % 8) // 2, (j // 16) % 2, (i // 8) % 2, j % 2, (j // 8) % 2] to row
    # 16 · (i // 16) + 8 · ((i // 8) % 2) + i % 8, key 32 · (j // 32) + 16 · .. + 8 · .. + 2 · .. + j % 2
    draws = draws.reshape(BLOCK_M // 16, 8, KEYS // 32, 4, 2, 2, 2, 2).permute(0, 5, 1, 2, 4, 7, 3, 6)
    return draws.reshape(BLOCK_M, KEYS)


@triton.jit
def dropout_keep(seed, rng_row, rows, first_key, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool tile: which probabilities of rows ``rows`` (counted within their
    sequence, the first a multiple of 16) and keys [first_key, first_key + BLOCK_N) survive dropout.

    Philox-4x32-7 (key ``seed``) gives four 32-bit words per counter, sixteen 8-bit draws, for a
    block of two rows by eight keys: rows i and i + 8 (i % 16 < 8) and keys j + {0, 1, 8, 9, 16, 17,
    24, 25} (j % 32 < 8, even). Key j of row i takes byte 2 · ((j // 8) % 2) + j % 2 of word
    2 · ((i // 8) % 2) + (j // 16) % 2 of the counter ``(0, row, 0, group)``: ``row`` the pair's first
    row ``rng_row + i - (i & 8)`` (modulo 2^32) and ``group`` the key group ``4 · (j // 32) + (j % 8) // 2``.
    Both enter Philox's first round by an exclusive or, so a kernel whose loop keeps the rows (the
    forward) or the keys (a backward) fixed makes fewer of the later rounds' products per block.
    A score's bits depend on its (row, key) alone, so the backward, whatever its tiles, regenerates
    the forward's. An NVIDIA tensor-core accumulator (wgmma, mma.sync) gives one thread rows i and
    i + 8 and key pairs 8 apart: the Hopper forward draws a counter's sixteen bytes in the thread
    that holds their scores, and a key pair's two bytes sit in one 16-bit half of a word.

    A draw >= ``threshold`` (:func:`fmha.backends.triton.launch.dropout_threshold`, from 1 to 256)
    keeps its score: the keep probability is ``1 - threshold / 256`` (the launcher scales kept
    scores by its inverse). BLOCK_M and BLOCK_N are multiples of 16, and ``first_key`` a multiple
    of BLOCK_N; tiles of 16 keys draw their 32-key block and take their half.
    """
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0, "tiles of whole 16 x 16 blocks")
    if BLOCK_N >= 32:
        draws = _draws(seed, rng_row, rows, first_key, BLOCK_M, BLOCK_N)
    else:
        low, high = tl.split(_draws(seed, rng_row, rows, first_key // 32 * 32, BLOCK_M, 32)
                             .reshape(BLOCK_M, 2, 16).permute(0, 2, 1))
        draws = tl.where((first_key // 16) % 2 == 1, high, low)
    return draws >= threshold.to(tl.uint32)


@triton.jit
def score_mods(AlibiSlopes, Mask, RngState, stride_ab, stride_ah, stride_mb, stride_mh, stride_mm, stride_mn,
               softcap_scale, dropout_threshold, dropout_scale, batch, head, rng_row,
               ALIBI: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr):
    """What the score features of one (batch, head) need at run time, as one tuple: ``(softcap_scale,
    slope, mask_ptr, stride_mm, stride_mn, seed, rng_row, dropout_threshold, dropout_scale)``.

    Dropout gives every (row, key) of the call its own draw (:func:`dropout_keep`): ``rng_row``
    numbers row 0 of this (batch, head) among all rows of the call (fewer than 2^32). A
    switched-off feature's values are placeholders that are never read.
    """
    slope = 0.0
    if ALIBI:
        slope = tl.load(AlibiSlopes + batch.to(tl.int64) * stride_ab + head.to(tl.int64) * stride_ah) * LOG2_E
    mask_ptr = 0  # (a returned tuple cannot hold None)
    if MASK != NO_MASK:
        mask_ptr = Mask + batch.to(tl.int64) * stride_mb + head.to(tl.int64) * stride_mh
    seed = 0
    if DROPOUT:
        seed = tl.load(RngState)
        rng_row = tl.cast(rng_row, tl.int64)
    return softcap_scale, slope, mask_ptr, stride_mm, stride_mn, seed, rng_row, dropout_threshold, dropout_scale


@triton.jit
def dropout_mask_kernel(RngState, Keep, SequenceStarts, SequenceLengths, keys_per_row, threshold,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``Keep[r, j]``: whether the attention kernels keep key j of counter row r (a testing aid: the
    kernels themselves never write the pattern). Rows are numbered as :func:`score_mods` numbers
    them; sequence s holds rows [SequenceStarts[s], + SequenceLengths[s]) (program axis 0)."""
    sequence = tl.program_id(0)
    start = tl.load(SequenceStarts + sequence)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    first_key = tl.program_id(2) * BLOCK_N
    keys = first_key + tl.arange(0, BLOCK_N)
    keep = dropout_keep(tl.load(RngState), start, rows, first_key, threshold, BLOCK_M, BLOCK_N)
    tl.store(Keep + (start + rows.to(tl.int64))[:, None] * keys_per_row + keys[None, :], keep,
             mask=(rows[:, None] < tl.load(SequenceLengths + sequence)) & (keys[None, :] < keys_per_row))
