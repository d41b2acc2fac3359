"""What each score becomes, in Gluon: softcap, ALiBi and dropout for the Hopper kernels.

The contract of :mod:`fmha.backends.triton.scores` (the design's order: ``scale · q·kᵀ``, then
``softcap · tanh(s / softcap)``, then ALiBi's ``-slope_h · |pos(i) - j|`` with ``pos(i) = i + Sk - Sq``;
results in log2 units for exp2; dropout on P), written again because a Gluon kernel cannot call
``triton.jit`` helpers. Sinks join each row's denominator where the kernels normalise it; the
attn_mask is not built here (the backend refuses it).

The softcap's tanh is one ``tanh.approx.f32`` (MUFU, maximum relative error about 2^-11, as in
FlashAttention-3) instead of an exp2 and a division: the softmax's exp2 already keeps that unit
busy. Positions enter as float vectors, so ALiBi costs a subtraction and an FMA per score (no
integer-to-float conversion per score, which would run on the same slow unit). Where no key
follows its row (causal), the bias is a term per key plus one per row; the forward then has the
tensor cores add the key term (one more k-step of Q·Kᵀ, ALIBI_CAUSAL_MMA), and only the row's
shift is left for the softmax.

Dropout draws the portable kernels' bits (:func:`fmha.backends.triton.scores.dropout_keep`): Philox-4x32-10
keyed by the call's seed, key j of a row taking half j % 2 of word (j // 8) % 4 of counter
``row_counter + 4 · (j // 32) + (j % 8) // 2``. Those eight keys are the columns one thread holds
in a row of the wgmma accumulator, so each thread runs Philox once per counter of its own columns
(:func:`draw_layout`) and the draws land where the probabilities are, with no exchange.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


# The ALIBI constexpr: off, the distance both ways, or only keys at or before each row's position
# (causal without a right window), where the bias is linear in the key.
ALIBI_OFF: gl.constexpr = gl.constexpr(0)
ALIBI_ANY: gl.constexpr = gl.constexpr(1)
ALIBI_CAUSAL: gl.constexpr = gl.constexpr(2)
# The forward's form of ALIBI_CAUSAL where the tensor cores add the key term to the scores (one more
# k-step of Q·Kᵀ against a tile of the terms), leaving only a shift per row.
ALIBI_CAUSAL_MMA: gl.constexpr = gl.constexpr(3)


@gluon.constexpr_function
def alibi_form(alibi, softcap, dtype):
    """The ALIBI a forward consumer runs: ALIBI_CAUSAL_MMA in place of ALIBI_CAUSAL where the key
    term can join the scores before anything else touches them (no softcap: ALiBi follows its
    tanh) and in bf16, whose range holds ``slope · j / scale`` for any slope and scale."""
    if alibi == 2 and not softcap and dtype == gl.bfloat16:
        return 3
    return alibi


@gluon.jit
def tanh_approx(x):
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def modified_scores(raw, row_positions, key_positions, qk_scale, softcap_scale, slope,
                    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr):
    """``(scores, capped)`` of one tile: the scores in log2 units and the softcap's ``tanh(·)``,
    whose derivative ``1 - capped²`` the backward needs (``raw`` without SOFTCAP).

    ``raw`` is Q·Kᵀ (or its transpose); ``row_positions`` (``i + Sk - Sq``) and ``key_positions`` are
    float tensors that broadcast to its shape. ``qk_scale`` is ``scale / softcap`` with SOFTCAP
    (the result is multiplied by ``softcap_scale = softcap · log2 e``), else ``scale · log2 e``;
    ``slope`` is the head's ALiBi slope · log2 e.
    """
    if SOFTCAP:
        capped = tanh_approx(raw * qk_scale)
        scores = capped * softcap_scale
    else:
        capped = raw
        scores = raw * qk_scale
    if ALIBI:
        scores = scores - slope * gl.abs(row_positions - key_positions)
    return scores, capped


# Philox-4x32-10's constants (as triton.language.random draws it): the round multipliers and the
# key's increments per round.
PHILOX_ROUND_A: gl.constexpr = gl.constexpr(0xD2511F53)
PHILOX_ROUND_B: gl.constexpr = gl.constexpr(0xCD9E8D57)
PHILOX_KEY_A: gl.constexpr = gl.constexpr(0x9E3779B9)
PHILOX_KEY_B: gl.constexpr = gl.constexpr(0xBB67AE85)


@gluon.constexpr_function
def draw_layout(columns):
    """The layout of a [64, columns // 8] tile of counters, one per (row, 8 keys) of a consumer
    warpgroup's [64, columns] accumulator (``NVMMADistributedLayout`` version 3: warp w holds rows
    16w..16w+15, lane t rows t // 4 and t // 4 + 8 of them, and columns 2 · (t % 4) + {0, 1} + 8i).
    Column c is counter c of a key block, which draws for keys 32 · (c // 4) + 2 · (c % 4) + {0, 1}
    + {0, 8, 16, 24}: c % 4 sits in the lanes as the accumulator's column bits 1 and 2 do, c // 4 in
    the registers (with row 8) as its column bits 5 and up, so each thread holds its columns' counters."""
    spans = columns // 32
    registers = [[8, 0]] + [[0, 4 << bit] for bit in range(spans.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=registers, lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, columns // 8])


@gluon.constexpr_function
def _wide_product_asm(factor):
    return "{\n.reg .b64 %wide;\nmul.wide.u32 %wide, $2, " + str(factor) + ";\nmov.b64 {$0, $1}, %wide;\n}"


@gluon.jit
def _wide_product(x, FACTOR: gl.constexpr):
    """``(low, high)`` 32-bit words of ``x · FACTOR``: one IMAD.WIDE.U32, where umulhi and a separate
    multiply compile to two instructions."""
    return gl.inline_asm_elementwise(_wide_product_asm(FACTOR), "=r,=r,r", [x], dtype=(gl.uint32, gl.uint32),
                                     is_pure=True, pack=1)


@gluon.jit
def philox(c0, c1, key0, key1):
    """The four words of Philox-4x32-10 for the counter ``(c0, c1, 0, 0)`` (uint32 tensors) and
    the key ``(key0, key1)`` (uint32 scalars): ``triton.language.randint4x``'s result."""
    # Round one with c2 = c3 = 0: its product of c2 is zero.
    low, high = _wide_product(c0, PHILOX_ROUND_A)
    c0, c1, c2, c3 = c1 ^ key0, gl.zeros_like(c0), high ^ key1, low
    for _ in gl.static_range(9):
        key0 = key0 + PHILOX_KEY_A
        key1 = key1 + PHILOX_KEY_B
        low_a, high_a = _wide_product(c0, PHILOX_ROUND_A)
        low_b, high_b = _wide_product(c2, PHILOX_ROUND_B)
        c0, c1, c2, c3 = high_b ^ c1 ^ key0, low_b, high_a ^ c3 ^ key1, low_a
    return c0, c1, c2, c3


@gluon.jit
def dropout_key(RngState):
    """The Philox key ``(key0, key1)`` of the call: the int64 seed's low and high 32-bit halves."""
    seed = gl.load(RngState).to(gl.uint64, bitcast=True)
    return (seed & 0xFFFFFFFF).to(gl.uint32), (seed >> 32).to(gl.uint32)


@gluon.jit
def dropped(probs, key_start, dropout):
    """``probs`` ([64, BLOCK_N] of keys key_start.., a multiple of 32, in the wgmma accumulator
    layout) with the dropped ones zeroed. ``dropout``: ``(key, row_counters, bounds)``, the Philox
    key, each row's first counter (int64, ``gl.SliceLayout(1, draw_layout(BLOCK_N))``) and
    ``(threshold - 1, 2^16 · threshold - 1)`` (uint32, 1 <= threshold <= 2^16): a draw is kept
    where it is >= threshold, the high half compared as the whole word (no shift).

    The 16-bit draw of key j is half j % 2 of word (j // 8) % 4 of counter ``row_counter + 4 · (j // 32)
    + (j % 8) // 2``: column c of the [64, BLOCK_N // 8] counter tile in :func:`draw_layout` is
    counter c of the block, and its eight draws are the thread's own columns."""
    ROWS: gl.constexpr = probs.shape[0]
    BLOCK_N: gl.constexpr = probs.shape[1]
    key, row_counters, bounds = dropout
    low_bound, high_bound = bounds
    columns = key_start // 8 + gl.arange(0, BLOCK_N // 8, layout=gl.SliceLayout(0, draw_layout(BLOCK_N)))
    counters = row_counters[:, None] + columns[None, :]
    word0, word1, word2, word3 = philox(counters.to(gl.uint32), (counters >> 32).to(gl.uint32), key[0], key[1])
    words = gl.join(gl.join(word0, word1), gl.join(word2, word3))  # [M, 4 · span + lane, word % 2, word // 2]
    keep = gl.join((words & 0xFFFF) > low_bound, words > high_bound)  # [..., half]
    # to key 32 · span + 8 · word + 2 · lane + half: the accumulator's own columns, no data moves
    keep = keep.reshape([ROWS, BLOCK_N // 32, 4, 2, 2, 2]).permute((0, 1, 4, 3, 2, 5)).reshape([ROWS, BLOCK_N])
    keep = gl.convert_layout(keep, probs.type.layout, assert_trivial=True)
    return gl.where(keep, probs, 0.0)
