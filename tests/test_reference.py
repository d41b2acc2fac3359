"""Step 1: the blockwise online softmax equals the direct softmax, in float64; the error rule's
rounding allowance."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmha.reference import causal_offset, dense_attention, direct_attention, online_attention


@st.composite
def attention_problems(draw):
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 4]))
    seqlen_q = draw(st.integers(1, 40))
    seqlen_k = draw(st.integers(1, 70))
    head_dim = draw(st.sampled_from([1, 8, 16, 24, 40]))
    block_n = draw(st.sampled_from([1, 7, 16, 64]))
    alignment = draw(st.sampled_from([None, "bottom_right", "top_left"]))
    magnitude = draw(st.sampled_from([1.0, 30.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, kv_heads * group, seqlen_q, head_dim)) * magnitude
    k = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)) * magnitude
    v = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim))
    offset = None if alignment is None else causal_offset(seqlen_q, seqlen_k, alignment)
    return q, k, v, offset, block_n


def assert_same(online, direct):
    (out_a, lse_a), (out_b, lse_b) = online, direct
    assert np.isfinite(out_a).all() and np.isfinite(out_b).all()
    assert not np.isnan(lse_a).any()
    np.testing.assert_array_equal(np.isneginf(lse_a), np.isneginf(lse_b))
    scale = max(1.0, np.abs(out_b).max())
    assert np.abs(out_a - out_b).max() <= 1e-12 * scale
    finite = np.isfinite(lse_b)
    assert np.abs(lse_a[finite] - lse_b[finite]).max(initial=0.0) <= 1e-12 * max(1.0, np.abs(lse_b[finite]).max(initial=0))


@settings(max_examples=150, deadline=None)
@given(attention_problems())
def test_online_matches_direct(problem):
    q, k, v, offset, block_n = problem
    assert_same(online_attention(q, k, v, causal_offset=offset, block_n=block_n),
                direct_attention(q, k, v, causal_offset=offset))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 30), st.integers(1, 30), st.sampled_from([1e4, -1e4]), st.integers(0, 2**32 - 1))
def test_huge_logits_do_not_overflow(seqlen_q, seqlen_k, magnitude, seed):
    rng = np.random.default_rng(seed)
    q = np.full((1, 1, seqlen_q, 4), 1.0) + rng.standard_normal((1, 1, seqlen_q, 4)) * 1e-3
    k = np.sign(rng.standard_normal((1, 1, seqlen_k, 4))) * magnitude  # logits of about +-2e4
    v = rng.standard_normal((1, 1, seqlen_k, 4))
    online = online_attention(q, k, v, block_n=8)
    direct = direct_attention(q, k, v)
    assert np.isfinite(online[0]).all() and np.isfinite(online[1]).all()
    assert_same(online, direct)


def test_rows_that_see_no_key_are_zero_with_lse_minus_inf():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 2, 10, 8)), rng.standard_normal((1, 2, 4, 8)), rng.standard_normal((1, 2, 4, 8))
    offset = causal_offset(10, 4, "bottom_right")  # -6: rows 0..5 see nothing
    for out, lse in (online_attention(q, k, v, causal_offset=offset, block_n=3),
                     direct_attention(q, k, v, causal_offset=offset)):
        assert np.all(out[:, :, :6] == 0.0) and np.all(np.isneginf(lse[:, :, :6]))
        assert np.isfinite(lse[:, :, 6:]).all() and np.abs(out[:, :, 6:]).sum() > 0


def test_causal_alignments():
    assert causal_offset(3, 5, "bottom_right") == 2
    assert causal_offset(3, 5, "top_left") == 0
    with pytest.raises(ValueError, match="alignment"):
        causal_offset(3, 5, "diagonal")


def test_lse_is_log_of_softmax_normaliser():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 1, n, 16)) for n in (5, 9, 9))
    _, lse = direct_attention(q, k, v, scale=0.5)
    expected = np.log(np.exp(q[0, 0] @ k[0, 0].T * 0.5).sum(-1))
    np.testing.assert_allclose(lse[0, 0], expected, rtol=1e-13)


def test_dense_torch_reference_matches_numpy():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 13, 24, generator=generator)
    k = torch.randn(2, 2, 21, 24, generator=generator)
    v = torch.randn(2, 2, 21, 24, generator=generator)
    for offset in (None, 8, -3):
        out, lse = dense_attention(q, k, v, causal_offset=offset)
        ref_out, ref_lse = direct_attention(q.numpy(), k.numpy(), v.numpy(), causal_offset=offset)
        np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(lse.numpy()), np.isneginf(ref_lse))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("value", [1e-3, 0.3, 0.7, 1.0, 1.9, 37.0])
def test_half_ulp_is_half_the_spacing_of_the_dtypes_numbers(value, dtype):
    """The error rule's output allowance: half the gap between the dtype's numbers around value."""
    from fmha.testing import half_ulp

    below = torch.tensor(value, dtype=dtype)
    above = torch.nextafter(below, torch.tensor(float("inf"), dtype=dtype))
    spacing = (above.double() - below.double()).item()
    assert half_ulp(below.item(), dtype) == pytest.approx(spacing / 2, rel=1e-9)
    assert half_ulp(0.0, dtype) == 0.0


def _gradients_with_delta_from(out, q, k, v, dout, keep, dropout_p, softcap, window):
    """dq, dk, dv in float64 by FlashAttention's backward: delta = rowsum(dO · out) from the given
    output, P recomputed, dS = P (dP - delta), written out by hand (one KV head per query head)."""
    scale = q.shape[-1] ** -0.5
    raw = (q @ k.transpose(-1, -2)) * scale
    capped = softcap * torch.tanh(raw / softcap) if softcap else raw
    rows, keys = torch.arange(q.shape[2]), torch.arange(k.shape[2])
    scores = capped.masked_fill(~window.visible(rows, keys), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    kept = torch.where(keep, probs / (1 - dropout_p), 0.0)
    dprobs = torch.where(keep, (dout @ v.transpose(-1, -2)) / (1 - dropout_p), 0.0)
    delta = (dout * out).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta)
    if softcap:
        dscores = dscores * (1 - torch.tanh(raw / softcap) ** 2)
    return dscores @ k * scale, dscores.transpose(-1, -2) @ q * scale, kept.transpose(-1, -2) @ dout


@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("left, dropout_p", [(0, 0.0), (0, 0.3), (5, 0.0), (None, 0.3)])
def test_grads_rule_allows_the_outputs_rounding_through_delta(left, dropout_p, softcap):
    """The backward's delta comes from the output the forward returned. Gradients computed exactly
    from a rounded output differ from the truth by what ``assert_grads_close(out=...)`` allows, and
    fail the rule without it: with ``left = 0`` every row sees one key, where torch's own error is 0."""
    from fmha.masking import Window
    from fmha.testing import assert_grads_close

    generator = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 2, 24, 16, dtype=torch.float64, generator=generator) for _ in range(4))
    keep = torch.rand(1, 2, 24, 24, generator=generator) >= dropout_p
    window = Window.of(24, 24, left=left, right=0)
    scores = dict(softcap=softcap, dropout_p=dropout_p, keep=keep) if dropout_p else dict(softcap=softcap)
    exact, _ = dense_attention(q, k, v, window=window, **scores)
    rounded = exact.to(torch.float16).double()  # a 16-bit forward's output, read back
    grads = _gradients_with_delta_from(rounded, q, k, v, dout, keep if dropout_p else torch.ones_like(keep),
                                       dropout_p, softcap, window)
    inputs = [t.float() for t in (q, k, v, dout)]
    grads = [g.float() for g in grads]
    assert_grads_close(grads, *inputs, window=window, out=rounded.float(), **scores)
    with pytest.raises(AssertionError, match="dq: max error"):
        assert_grads_close(grads, *inputs, window=window, **scores)


def test_output_rule_allows_more_roundings_only_when_asked():
    """``roundings=2`` widens the default allowance to one unit in the last place of the largest
    output; the default is half of one. A row that sees one key: torch's own error is zero there."""
    from fmha.masking import Window
    from fmha.testing import assert_close_to_reference

    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, 8, 16, generator=generator).to(torch.bfloat16) for _ in range(3))
    v[0, 0, 3, 0] = 3.5  # the largest output: its unit in the last place is 2^-6
    window = Window.of(8, 8, left=0, right=0)
    one_ulp_off = v.clone()
    one_ulp_off[0, 0, 3, 0] = torch.nextafter(v[0, 0, 3, 0], torch.tensor(4.0, dtype=torch.bfloat16))
    assert_close_to_reference(v.clone(), q, k, v, window=window)
    assert_close_to_reference(one_ulp_off, q, k, v, window=window, roundings=2)
    with pytest.raises(AssertionError, match="max error"):
        assert_close_to_reference(one_ulp_off, q, k, v, window=window)
