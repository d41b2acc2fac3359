"""What each score becomes, in Gluon: softcap and ALiBi for the Hopper kernels.

The contract of :mod:`fmha.backends.triton.scores` (the design's order: ``scale · q·kᵀ``, then
``softcap · tanh(s / softcap)``, then ALiBi's ``-slope_h · |pos(i) - j|`` with ``pos(i) = i + Sk - Sq``;
results in log2 units for exp2), written again because a Gluon kernel cannot call ``triton.jit``
helpers. Sinks join each row's denominator where the kernels normalise it; the attn_mask and
dropout are not built here (the backend refuses them).

The softcap's tanh is one ``tanh.approx.f32`` (MUFU, maximum relative error about 2^-11, as in
FlashAttention-3) instead of an exp2 and a division: the softmax's exp2 already keeps that unit
busy. Positions enter as float vectors, so ALiBi costs a subtraction and an FMA per score (no
integer-to-float conversion per score, which would run on the same slow unit).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


# The ALIBI constexpr: off, the distance both ways, or only keys at or before each row's position
# (causal without a right window), where the bias is linear in the key.
ALIBI_OFF: gl.constexpr = gl.constexpr(0)
ALIBI_ANY: gl.constexpr = gl.constexpr(1)
ALIBI_CAUSAL: gl.constexpr = gl.constexpr(2)


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
