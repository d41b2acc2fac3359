"""What each score becomes, in Gluon: softcap, ALiBi and dropout for the Hopper kernels.

The contract of :mod:`fmha.backends.triton.scores` (the design's order: ``scale · q·kᵀ``, then
``softcap · tanh(s / softcap)``, then ALiBi's ``-slope_h · |pos(i) - j|`` with ``pos(i) = i + Sk - Sq``;
results in log2 units for exp2; dropout on P), written again because a Gluon kernel cannot call
``triton.jit`` helpers. Sinks join each row's denominator where the kernels normalise it. SDPA's
attn_mask (bool: False hides the key; float: added to the scores) is read where the scores are,
one element per score in the accumulator's own layout (:func:`load_mask`), while the products run.

The softcap's tanh is one ``tanh.approx.f32`` (MUFU, maximum relative error about 2^-11, as in
FlashAttention-3) instead of an exp2 and a division: the softmax's exp2 already keeps that unit
busy. Positions enter as float vectors, so ALiBi costs a subtraction and an FMA per score (no
integer-to-float conversion per score, which would run on the same slow unit). Where no key
follows its row (causal), the bias is a term per key plus one per row; the forward then has the
tensor cores add the key term (one more k-step of Q·Kᵀ, ALIBI_CAUSAL_MMA), and only the row's
shift is left for the softmax.

Dropout draws the portable kernels' bits (:func:`fmha.backends.triton.scores.dropout_keep`): Philox-4x32-7
keyed by the call's seed, one counter per two rows (i and i + 8) by eight keys (j + {0, 1, 8, 9, 16,
17, 24, 25}), an 8-bit draw each. Those sixteen scores sit in one thread of a wgmma accumulator, so
the forward runs Philox once per counter of its own scores (:func:`draw_layout`) and the draws land
where the probabilities are, with no exchange: a key pair's two bytes become the 16-bit halves of
one word (one PRMT), compared by one half-precision instruction (``set.f16x2``: the bytes are
small non-negative halves, ordered as integers) whose mask clears the dropped halves of the pair's
P·V operand word. The
backward's tiles hold keys as rows (Sᵀ): a thread there holds four of a counter's scores (keys j
and j + 8 by two rows), and the threads holding the other keys compute the same counter
(:func:`transposed_draw_layout`).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..triton.scores import BOOL_MASK, FLOAT_MASK, LOG2_E, NO_MASK  # noqa: F401 - SDPA's attn_mask, the MASK constexpr
from ..triton.scores import PHILOX_ROUNDS


# The ALIBI constexpr: off, the distance both ways, or only keys at or before each row's position
# (causal without a right window), where the bias is linear in the key.
ALIBI_OFF: gl.constexpr = gl.constexpr(0)
ALIBI_ANY: gl.constexpr = gl.constexpr(1)
ALIBI_CAUSAL: gl.constexpr = gl.constexpr(2)
# The forward's form of ALIBI_CAUSAL where the tensor cores add the key term to the scores (one more
# k-step of Q·Kᵀ against a tile of the terms), leaving only a shift per row.
ALIBI_CAUSAL_MMA: gl.constexpr = gl.constexpr(3)


# How the attn_mask's keys lie in memory, the MASK_KEYS constexpr: any stride; stride 1; stride 1
# with every row's start a multiple of two elements, so that a thread reads its accumulator's key
# pairs (2c, 2c + 1) in one load.
STRIDED_MASK_KEYS: gl.constexpr = gl.constexpr(0)
UNIT_MASK_KEYS: gl.constexpr = gl.constexpr(1)
PAIRED_MASK_KEYS: gl.constexpr = gl.constexpr(2)


@gluon.constexpr_function
def key_pair_layout(columns):
    """The layout of a [64, columns // 2] tile of key pairs, pair c holding keys 2c and 2c + 1 of a
    consumer warpgroup's [64, columns] accumulator (``NVMMADistributedLayout`` version 3): each
    thread holds its scores' pairs, so that splitting each into two keys (:func:`expand_mask`) gives
    the accumulator's layout with no data moving."""
    registers = [[8, 0]] + [[0, 4 << bit] for bit in range((columns // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=registers, lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, columns // 2])


@gluon.jit
def mask_rows(Mask, batch, head, rows, seqlen_q, strides):
    """Pointers to the rows ``rows`` of the (batch, head)'s attn_mask; ``strides``: ``(stride_mb,
    stride_mh, stride_mm, stride_mn)`` in elements. Rows past the end point at the last row (their
    scores are never stored), so that the loads need no predicate for them."""
    stride_mb, stride_mh, stride_mm = strides[0], strides[1], strides[2]
    base = Mask + batch.to(gl.int64) * stride_mb + head.to(gl.int64) * stride_mh
    return base + gl.minimum(rows, seqlen_q - 1).to(gl.int64) * stride_mm


@gluon.constexpr_function
def _pair_type(element_bits):
    """The integer type of two mask elements."""
    return {8: gl.int16, 16: gl.int32, 32: gl.int64}[element_bits]


@gluon.jit
def load_mask(row_pointers, key_start, seqlen_k, stride_mn, layout: gl.constexpr, MASKED: gl.constexpr,
              MASK_KEYS: gl.constexpr):
    """The attn_mask's tile of rows ``row_pointers`` (:func:`mask_rows`, [ROWS]) and BLOCK_N keys
    from ``key_start`` (a multiple of BLOCK_N) for the accumulator ``layout``, as loaded: give it
    to :func:`expand_mask` where it is used, so that only the loaded words stay live meanwhile.
    Keys past ``seqlen_k`` read 0 (only blocks with MASKED reach them).

    PAIRED_MASK_KEYS reads each thread's key pairs (2c, 2c + 1) as one integer (half the loads and
    registers; the launcher checks the alignment and that Sk is even); the other forms read
    elements, UNIT_MASK_KEYS at a row's address plus a constant."""
    BLOCK_N: gl.constexpr = layout.instr_shape[1]
    if MASK_KEYS == PAIRED_MASK_KEYS:
        pair_layout: gl.constexpr = key_pair_layout(BLOCK_N)
        word_type: gl.constexpr = _pair_type(row_pointers.dtype.element_ty.primitive_bitwidth)
        pairs = key_start // 2 + gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(0, pair_layout))
        rows = gl.convert_layout(row_pointers.to(gl.pointer_type(word_type), bitcast=True),
                                 gl.SliceLayout(1, pair_layout))
        pointers = rows[:, None] + pairs[None, :]
        if MASKED:
            pointers, in_range = gl.broadcast(pointers, (pairs < seqlen_k // 2)[None, :])
            tile = gl.load(pointers, mask=in_range, other=0)
        else:
            tile = gl.load(pointers)
    else:
        keys = key_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        if MASK_KEYS == STRIDED_MASK_KEYS:
            offsets = keys.to(gl.int64) * stride_mn
        else:
            offsets = keys
        pointers = row_pointers[:, None] + offsets[None, :]
        if MASKED:
            pointers, in_range = gl.broadcast(pointers, (keys < seqlen_k)[None, :])
            tile = gl.load(pointers, mask=in_range, other=0)
        else:
            tile = gl.load(pointers)
    return tile


@gluon.jit
def expand_mask(tile, element_type: gl.constexpr, layout: gl.constexpr, MASK: gl.constexpr,
                MASK_KEYS: gl.constexpr):
    """:func:`load_mask`'s tile in the accumulator ``layout``: with BOOL_MASK whether each key takes
    part, with FLOAT_MASK the float32 bias. ``element_type``: the mask's element type."""
    if MASK_KEYS == PAIRED_MASK_KEYS:
        BITS: gl.constexpr = element_type.primitive_bitwidth
        if BITS == 8:  # bool
            low = (tile & 0xFF) != 0
            high = (tile >> 8) != 0  # the sign extends into bits that stay 0 or nonzero alike
        elif BITS == 32:  # float32
            low = (tile & 0xFFFFFFFF).to(gl.uint32).to(gl.float32, bitcast=True)
            high = (tile >> 32).to(gl.uint32).to(gl.float32, bitcast=True)
        elif element_type == gl.bfloat16:  # its bits are a float32's high half
            low = (tile << 16).to(gl.float32, bitcast=True)
            high = (tile & -65536).to(gl.float32, bitcast=True)
        else:  # float16
            low = (tile & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
            high = (tile >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        ROWS: gl.constexpr = tile.shape[0]
        tile = gl.convert_layout(gl.join(low, high).reshape([ROWS, 2 * tile.shape[1]]), layout, assert_trivial=True)
    elif MASK == BOOL_MASK:
        tile = tile != 0
    else:
        tile = tile.to(gl.float32)
    return tile


@gluon.jit
def masked_scores(scores, qk_scale, mask_tile, MASK: gl.constexpr):
    """``(scores, qk_scale)`` after SDPA's attn_mask (:func:`expand_mask`'s tile): a bool one hides
    keys (-inf), a float one is added in log2 units, after the scale (which is then 1)."""
    if MASK == BOOL_MASK:
        scores = gl.where(mask_tile, scores, float("-inf"))
    elif MASK == FLOAT_MASK:
        scores = scores * qk_scale + mask_tile * LOG2_E
        qk_scale = 1.0
    return scores, qk_scale


@gluon.constexpr_function
def alibi_form(alibi, softcap, dtype, output_in_q=False):
    """The ALIBI a forward consumer runs: ALIBI_CAUSAL_MMA in place of ALIBI_CAUSAL where the key
    term can join the scores before anything else touches them (no softcap: ALiBi follows its
    tanh) and in bf16, whose range holds ``slope · j / scale`` for any slope and scale, and where
    the output staging tile that holds its operands is not the Q buffer (``output_in_q``)."""
    if alibi == 2 and not softcap and dtype == gl.bfloat16 and not output_in_q:
        return 3
    return alibi


# The SOFTCAP constexpr: off; running, with the rows' running max; or bounded: a softcapped score lies in
# [-C, C] (C = softcap · log2 e, log2 units), so the forward subtracts the fixed max C -
# BOUNDED_MAX_OFFSET instead of a running one. exp2 of a score then lies in [2^(32 - 2C), 2^32]:
# with C <= 76 (softcap <= fmha.backends.gluon_sm90.schedule.BOUNDED_SOFTCAP_LIMIT) every
# probability is a normal float32 and bf16 (whose range is float32's), row sums and P·V stay far
# inside the range, and no row max, rescale factor or accumulator rescale is computed: the tanh and
# the exp2 of one score follow each other with no reduction between them. fp16's range is too short.
# No probability is then exactly 1, so a row that sees one key gets that key's value times P's bf16
# rounding over P (within 2^-8 of it) where a running max gives the value exactly.
SOFTCAP_OFF: gl.constexpr = gl.constexpr(0)
SOFTCAP_RUNNING: gl.constexpr = gl.constexpr(1)
SOFTCAP_BOUNDED: gl.constexpr = gl.constexpr(2)
BOUNDED_MAX_OFFSET: gl.constexpr = gl.constexpr(32.0)


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


# Philox-4x32's constants (as triton.language.random draws it): the round multipliers and the
# key's increments per round.
PHILOX_ROUND_A: gl.constexpr = gl.constexpr(0xD2511F53)
PHILOX_ROUND_B: gl.constexpr = gl.constexpr(0xCD9E8D57)
PHILOX_KEY_A: gl.constexpr = gl.constexpr(0x9E3779B9)
PHILOX_KEY_B: gl.constexpr = gl.constexpr(0xBB67AE85)


@gluon.constexpr_function
def draw_layout(columns):
    """The layout of a [32, columns // 8] tile of counters, one per (row pair, 8 keys) of a consumer
    warpgroup's [64, columns] accumulator (``NVMMADistributedLayout`` version 3: warp w holds rows
    16w..16w+15, lane t rows t // 4 and t // 4 + 8 of them, and columns 2 · (t % 4) + {0, 1} + 8i).
    Row p is the pair of rows 16 · (p // 8) + p % 8 and 8 below it; column c the keys 32 · (c // 4)
    + 2 · (c % 4) + {0, 1, 8, 9, 16, 17, 24, 25}: p // 8 and p % 8 sit in the warps and lanes as the
    rows do, c % 4 in the lanes and c // 4 in the registers as the columns' bits 1-2 and 5 up, so
    each thread holds its scores' counters."""
    registers = [[0, 4 << bit] for bit in range((columns // 32).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=registers, lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[32, columns // 8])


@gluon.constexpr_function
def transposed_draw_layout(rows):
    """The layout of a [32, rows // 2] tile of counters for the backward's [64 keys, rows] accumulator
    (Sᵀ; the accumulator layout of :func:`draw_layout`, keys in place of rows). Row r is key
    16 · (r // 8) + r % 8 (and 8 below it), column p the query pair 16 · (p // 8) + p % 8 and 8
    below it; the four threads holding keys 2k and 2k + 1 of a 32-key block (lanes t and t ^ 4,
    warps w and w ^ 1) compute the same counter."""
    registers = [[0, 1]] + [[0, 8 << bit] for bit in range((rows // 16).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=registers, lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[32, rows // 2])


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
def philox(rows, groups, key0, key1):
    """The four words of Philox-4x32-7 for the counter ``(0, rows, 0, groups)`` (uint32 tensors) and
    the key ``(key0, key1)`` (uint32 scalars): ``triton.language.philox(..., PHILOX_ROUNDS)``'s
    result. Both varying words enter by an exclusive or, so a loop that keeps either fixed (the
    forward's rows, the backward's keys) multiplies one word fewer in rounds two and three."""
    # Round one: the products of c0 = c2 = 0 are zero.
    c0, c1, c2, c3 = rows ^ key0, gl.zeros_like(rows), groups ^ key1, gl.zeros_like(rows)
    for _ in gl.static_range(PHILOX_ROUNDS - 1):
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
def pair_rows(first_row, rng_row, PAIRS: gl.constexpr, layout: gl.constexpr):
    """uint32 [PAIRS] (``layout``, a slice of a draw layout): the counters' row word for each row
    pair of the rows from ``first_row`` (a multiple of 16): pair p holds rows 16 · (p // 8) + p % 8
    and 8 below, and its word is ``rng_row`` plus the pair's first row: that row's number in the call
    (:func:`fmha.backends.triton.scores.dropout_keep`)."""
    pairs = gl.arange(0, PAIRS, layout=layout)
    return (rng_row + first_row + 16 * (pairs // 8) + pairs % 8).to(gl.uint32)


@gluon.jit
def dropout_draws(key_start, dropout, BLOCK_N: gl.constexpr):
    """The Philox words of a consumer's [64, BLOCK_N] block of keys key_start.. (a multiple of 32),
    for :func:`dropped`: uint32 [32, BLOCK_N // 8, 2, 2] in :func:`draw_layout` (joined), counter
    (pair, group) by ((j // 16) % 2, (i // 8) % 2). ``dropout``: ``(key, row_words, thresholds)``,
    the Philox key, each row pair's counter row word (:func:`pair_rows`, ``gl.SliceLayout(1,
    draw_layout(BLOCK_N))``) and the threshold in both 16-bit halves of a word (``65537 ·
    threshold``, 1 <= threshold <= 256).

    Key j of row i takes byte 2 · ((j // 8) % 2) + j % 2 of word 2 · ((i // 8) % 2) + (j // 16) % 2
    of the counter ``(0, row, 0, group)``, the pair's row and the key group ``4 · (j // 32) + (j % 8) // 2``
    (:func:`philox`): column c of the [32, BLOCK_N // 8] counter tile is the block's group c, and its
    sixteen draws are the thread's own scores."""
    key, row_words, _ = dropout
    groups = (key_start // 8 + gl.arange(0, BLOCK_N // 8, layout=gl.SliceLayout(0, draw_layout(BLOCK_N))))
    groups, rows = gl.broadcast(groups.to(gl.uint32)[None, :], row_words[:, None])
    word0, word1, word2, word3 = philox(rows, groups, key[0], key[1])
    return gl.join(gl.join(word0, word1), gl.join(word2, word3))


@gluon.constexpr_function
def pair_conversion(dtype):
    """The PTX instruction that rounds two float32 values to one word of ``dtype`` (bf16 or fp16)
    pairs: ``cvt d, a, b`` puts a in the high half."""
    return "cvt.rn.bf16x2.f32" if dtype == gl.bfloat16 else "cvt.rn.f16x2.f32"


@gluon.constexpr_function
def _dropped_pair_asm(dtype):
    # Both draws of a key pair against the threshold (0xFFFF in each half that keeps), the pair's
    # probabilities rounded to one word of two 16-bit values ($1), and the mask applied to it ($0).
    return ("{\n.reg .b32 keep;\nset.ge.u32.f16x2 keep, $4, $6;\n" + pair_conversion(dtype)
            + " $1, $3, $2;\nand.b32 $0, $1, keep;\n}")


@gluon.jit
def _draw_halves(draws):
    """A word's bytes 0-1 (keys j, j + 1) and 2-3 (keys j + 8, j + 9) of :func:`dropout_draws`'s
    words as the 16-bit halves of a word each: [pair, group, (j // 16) % 2, (i // 8) % 2, (j // 8) % 2]."""
    near, far = gl.inline_asm_elementwise("prmt.b32 $0, $2, 0, 0x4140;\nprmt.b32 $1, $2, 0, 0x4342;", "=r,=r,r",
                                          [draws], dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)
    return gl.join(near, far)


@gluon.jit
def dropped(probs, draws, thresholds, dtype: gl.constexpr):
    """``probs`` ([64, BLOCK_N] in the wgmma accumulator layout) in ``dtype`` (bf16 or fp16, P·V's
    operand), the dropped ones zero: ``draws`` from :func:`dropout_draws` for the same keys,
    ``thresholds`` the threshold in both halves of a word. Returns ``(kept, whole)``: ``whole`` is
    ``probs`` in ``dtype`` with none dropped (one conversion makes both)."""
    ROWS: gl.constexpr = probs.shape[0]
    BLOCK_N: gl.constexpr = probs.shape[1]
    halves = _draw_halves(draws)
    halves = gl.join(halves, halves)  # [..., j % 2]: the key pair's two scores share the word
    # to row 16 · (pair // 8) + 8 · ((i // 8) % 2) + pair % 8, key 32 · (group // 4) + 16 · ((j // 16) % 2)
    # + 8 · ((j // 8) % 2) + 2 · (group % 4) + j % 2: the accumulator's own scores, no data moves
    halves = halves.reshape([ROWS // 16, 8, BLOCK_N // 32, 4, 2, 2, 2, 2]).permute((0, 5, 1, 2, 4, 6, 3, 7))
    halves = gl.convert_layout(halves.reshape([ROWS, BLOCK_N]), probs.type.layout, assert_trivial=True)
    # One instance per key pair (consecutive registers, the pair's halves in key order).
    operands = (probs, halves, gl.full(probs.shape, thresholds, gl.uint32, probs.type.layout))
    kept, whole = gl.inline_asm_elementwise(_dropped_pair_asm(dtype), "=r,=r,r,r,r,r,r,r", operands,
                                            dtype=(gl.int16, gl.int16), is_pure=True, pack=2)
    return kept.to(dtype, bitcast=True), whole.to(dtype, bitcast=True)


@gluon.jit
def dropped_words(words, draws, thresholds):
    """As :func:`dropped` for probabilities already rounded: ``words`` uint32 [64, BLOCK_N // 2], key
    pair m's two 16-bit values in word m (:func:`fmha.backends.gluon_sm90.forward._packed_probs`),
    returned with the dropped halves zero."""
    ROWS: gl.constexpr = words.shape[0]
    PAIRS: gl.constexpr = words.shape[1]
    halves = _draw_halves(draws)
    # to row 16 · (pair // 8) + 8 · ((i // 8) % 2) + pair % 8, key pair 16 · (group // 4) + 8 · ((j // 16) % 2)
    # + 4 · ((j // 8) % 2) + group % 4: the words' own pairs, no data moves
    halves = halves.reshape([ROWS // 16, 8, PAIRS // 16, 4, 2, 2, 2]).permute((0, 5, 1, 2, 4, 6, 3))
    halves = gl.convert_layout(halves.reshape([ROWS, PAIRS]), words.type.layout, assert_trivial=True)
    return gl.inline_asm_elementwise(
        "{\n.reg .b32 keep;\nset.ge.u32.f16x2 keep, $2, $3;\nand.b32 $0, $1, keep;\n}", "=r,r,r,r",
        [words, halves, gl.full(words.shape, thresholds, gl.uint32, words.type.layout)],
        dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def transposed_keep_bits(first_key, key_rows, row_words, key, high_bound, ROWS: gl.constexpr):
    """Which scores of Sᵀ (64 keys from ``first_key``, a multiple of 64, by ROWS query rows) survive
    dropout, the pattern of :func:`dropped`, as one word of flags per thread ([32, 4, 1]; uint32,
    or uint64 for 128 rows): the backward draws them before its products, when few registers are
    live, and :func:`unpack_keep` expands them where they are used. ``key_rows``: int32
    ``arange(32)`` in ``gl.SliceLayout(1, transposed_draw_layout(ROWS))`` (key 16 · (r // 8) + r % 8
    and 8 below it); ``row_words``: the query pairs' counter row words (:func:`pair_rows`,
    ``gl.SliceLayout(0, ...)``); ``high_bound``: ``2^24 · threshold - 1``.

    Each of the two query rows takes its word (by the keys' bit 4), and each key its byte by a
    shift to the top of the word. A counter's four flags (query row r, key + 8 · s: bit 2r + s) fill
    a nibble; the pairs a thread holds in registers (pair bit 0, then bits 3 and up) are folded into
    the word."""
    BITS: gl.constexpr = gl.uint32 if ROWS <= 64 else gl.uint64
    groups = first_key // 8 + 4 * (key_rows // 16) + (key_rows % 8) // 2
    near_shifts = (24 - 8 * (key_rows & 1)).to(gl.uint32)[:, None]  # byte j % 2 (key j), to the top
    far_shifts = (8 - 8 * (key_rows & 1)).to(gl.uint32)[:, None]  # byte 2 + j % 2 (key j + 8)
    upper = ((key_rows // 8) % 2 == 1)[:, None]  # (j // 16) % 2
    groups, rows = gl.broadcast(groups.to(gl.uint32)[:, None], row_words[None, :])
    word0, word1, word2, word3 = philox(rows, groups, key[0], key[1])
    first, second = gl.where(upper, word1, word0), gl.where(upper, word3, word2)  # query rows i, i + 8
    nibbles = (((first << near_shifts) > high_bound).to(BITS) | (((first << far_shifts) > high_bound).to(BITS) << 1)
               | (((second << near_shifts) > high_bound).to(BITS) << 2)
               | (((second << far_shifts) > high_bound).to(BITS) << 3))
    low, high = gl.split(nibbles.reshape([32, ROWS // 16, 4, 2]))  # pair bit 0
    bits = (low | (high << 4)).permute((0, 2, 1))  # [32, 4, ROWS // 16]: 8 flags each
    bits = _fold(bits, 8)
    bits = _fold(bits, 16)
    if ROWS > 64:
        bits = _fold(bits, 32)
    return bits


@gluon.jit
def _fold(bits, WIDTH: gl.constexpr):
    """[32, 4, n] words of WIDTH flags to [32, 4, n // 2] of twice as many: the last axis is in registers."""
    low, high = gl.split(bits.reshape([32, 4, bits.shape[2] // 2, 2]))
    return low | (high << WIDTH)


@gluon.jit
def _unfold(bits, WIDTH: gl.constexpr):
    """The inverse of :func:`_fold`."""
    mask: gl.constexpr = (1 << WIDTH) - 1
    return gl.join(bits & mask, bits >> WIDTH).reshape([32, 4, bits.shape[2] * 2])


@gluon.jit
def unpack_keep(bits, ROWS: gl.constexpr):
    """bool [64, ROWS]: the flags of :func:`transposed_keep_bits`, in the order of the [64 keys, ROWS]
    tile (convert to the wgmma accumulator layout with ``assert_trivial``)."""
    if ROWS > 64:
        bits = _unfold(bits, 32)
    bits = _unfold(bits, 16)
    bits = _unfold(bits, 8)
    bits = bits.permute((0, 2, 1))  # [32, ROWS // 16, 4]
    nibbles = gl.join(bits & 0xF, bits >> 4).reshape([32, ROWS // 2])
    keep = gl.join(gl.join((nibbles & 1) != 0, (nibbles & 2) != 0), gl.join((nibbles & 4) != 0, (nibbles & 8) != 0))
    # [key row, pair, word % 2, word // 2] to key 16 · (row // 8) + 8 · (word % 2) + row % 8, query 16 · (pair // 8)
    # + 8 · (word // 2) + pair % 8
    return keep.reshape([4, 8, ROWS // 16, 8, 2, 2]).permute((0, 4, 1, 2, 5, 3)).reshape([64, ROWS])
