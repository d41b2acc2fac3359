"""A value head dim of its own (v is (..., Dv), q and k (..., D), the output (..., Dv); DeepSeek's MLA
attends with D = 192 and Dv = 128) on the CPU through the interpreter: the portable forward and
backward against float64, dense and packed, with masks and score features, and every entry point
that takes separate k and v."""

import itertools

import pytest
import torch

import fmha
from fmha import ops
from fmha.backends.gluon_sm90.backend import value_head_dim_refusal
from fmha.backends.triton.launch import dropout_keep_mask, kernel_dropout_p
from fmha.masking import Window
from fmha.params import attention_params

from .helpers import assert_close_to_reference, assert_grads_close, random_qkv

pytestmark = pytest.mark.interpreter

# (D, Dv): narrower values (MLA's shape, scaled down), wider ones, and widths off the powers of two.
HEAD_DIMS = [(32, 16), (16, 40), (24, 8)]


def check(q, k, v, reference: dict, **options):
    """Forward and gradients of fmha.attention against float64 (``reference``: the window arguments)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = fmha.attention(*leaves, return_lse=True, **options)
    assert out.shape == (*q.shape[:-1], v.shape[-1])
    assert_close_to_reference(out.detach(), q, k, v, lse=lse, **reference)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    assert_grads_close(grads, q, k, v, dout, out=out.detach(), **reference)


@pytest.mark.parametrize("dtype, head_dims, causal", [
    (torch.float16, HEAD_DIMS[0], False), (torch.float16, HEAD_DIMS[1], True), (torch.float16, HEAD_DIMS[2], True),
    (torch.float32, HEAD_DIMS[0], True), (torch.float32, HEAD_DIMS[1], False)], ids=str)
def test_forward_and_gradients(dtype, head_dims, causal):
    head_dim, head_dim_v = head_dims
    q, k, v = random_qkv(2, 4, 2, 21, 37, head_dim, dtype, head_dim_v=head_dim_v)
    check(q, k, v, dict(causal_offset=37 - 21) if causal else {}, causal=causal)


def test_window_and_rows_that_see_nothing():
    # Sq > Sk, causal: the first rows see no key (zeros, LSE -inf); a window on both sides.
    q, k, v = random_qkv(1, 2, 1, 30, 19, 32, torch.float16, head_dim_v=16)
    check(q, k, v, dict(causal_offset=19 - 30), causal=True)
    q, k, v = random_qkv(1, 2, 2, 33, 40, 16, torch.float16, head_dim_v=48)
    check(q, k, v, dict(window=Window.of(33, 40, left=6, right=3)), window=(6, 3))


def test_bshd_views_keep_their_layout():
    q, k, v = random_qkv(2, 4, 2, 17, 23, 32, torch.float16, layout="bshd", head_dim_v=16)
    out = fmha.attention(q, k, v)
    assert out.shape == (2, 4, 17, 16) and out.transpose(1, 2).is_contiguous()
    assert_close_to_reference(out, q, k, v)


def test_score_features():
    q, k, v = random_qkv(1, 4, 2, 25, 31, 24, torch.float32, head_dim_v=40)
    slopes = torch.rand(4) * 0.3
    sinks = torch.randn(4)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    out = fmha.attention(*leaves[:3], causal=True, softcap=3.0, alibi_slopes=slopes, sinks=leaves[3])
    scores = dict(softcap=3.0, alibi_slopes=slopes, sinks=sinks)
    assert_close_to_reference(out.detach(), q, k, v, causal_offset=31 - 25, **scores)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    assert_grads_close(grads, q, k, v, dout, causal_offset=31 - 25, **scores)


def test_dropout_with_the_kernels_pattern():
    q, k, v = random_qkv(1, 2, 2, 29, 33, 32, torch.float32, head_dim_v=16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fmha.attention(*leaves, dropout_p=0.25, generator=torch.Generator().manual_seed(3))
    key = ops.dropout_seed(torch.Generator().manual_seed(3), q.device)
    keep = dropout_keep_mask(key, 2 * 29, 33, 0.25, seqlen_q=29).view(1, 2, 29, 33)
    dropout = dict(dropout_p=kernel_dropout_p(0.25), keep=keep)
    assert_close_to_reference(out.detach(), q, k, v, **dropout)
    dout = torch.randn_like(out)
    assert_grads_close(torch.autograd.grad(out, leaves, dout), q, k, v, dout, **dropout)


def cu_seqlens(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@pytest.mark.parametrize("head_dims", [(32, 16), (16, 24)], ids=str)
def test_packed_sequences(head_dims):
    """flash_attn_varlen_func with lengths 0 and 1 and Sq_i != Sk_i, causal, GQA: each sequence
    against float64, gradients included."""
    head_dim, head_dim_v = head_dims
    lengths_q, lengths_k = [5, 0, 1, 19, 7], [9, 4, 1, 17, 7]
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    q = torch.randn(sum(lengths_q), 4, head_dim, dtype=torch.float16, requires_grad=True)
    k = torch.randn(sum(lengths_k), 2, head_dim, dtype=torch.float16, requires_grad=True)
    v = torch.randn(sum(lengths_k), 2, head_dim_v, dtype=torch.float16, requires_grad=True)
    out, lse, _ = fmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, 17, causal=True, return_attn_probs=True)
    assert out.shape == (sum(lengths_q), 4, head_dim_v) and lse.shape == (4, sum(lengths_q))
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    def as_bhsd(tensor, rows):
        return tensor.detach()[rows].transpose(0, 1)[None]

    for b, (length_q, length_k) in enumerate(zip(lengths_q, lengths_k)):
        rows_q = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rows_k = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if length_q == 0:
            continue
        inputs = [as_bhsd(t, rows) for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k))]
        reference = dict(causal_offset=length_k - length_q)
        assert_close_to_reference(as_bhsd(out, rows_q), *inputs, lse=lse[:, rows_q][None], **reference)
        grads = [as_bhsd(g, rows) for g, rows in ((dq, rows_q), (dk, rows_k), (dv, rows_k))]
        assert_grads_close(grads, *inputs, as_bhsd(dout, rows_q), out=as_bhsd(out, rows_q), **reference)


def test_flash_attn_func_returns_bshd_with_the_value_head_dim():
    q = torch.randn(2, 11, 4, 32, dtype=torch.float16)
    k = torch.randn(2, 14, 2, 32, dtype=torch.float16)
    v = torch.randn(2, 14, 2, 48, dtype=torch.float16)
    out = fmha.flash_attn_func(q, k, v, causal=True, window_size=(5, -1))
    assert out.shape == (2, 11, 4, 48) and out.is_contiguous()
    assert_close_to_reference(out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              window=Window.of(11, 14, left=5, right=0))


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_matches_torch(is_causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    query, key, value = (torch.randn(2, 3, length, dim, requires_grad=True)
                         for length, dim in ((10, 32), (13, 32), (13, 16)))
    mask = None if is_causal else torch.rand(10, 13) > 0.3
    out = fmha.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal)
    with sdpa_kernel(SDPBackend.MATH):
        expected = scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal)
    torch.testing.assert_close(out, expected.nan_to_num(0.0), atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (query, key, value), dout)
    expected_grads = torch.autograd.grad(expected, (query, key, value), dout)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want.nan_to_num(0.0), atol=1e-5, rtol=1e-5)
    # 3-D and 5-D inputs keep their leading dims, with the value head dim last
    assert fmha.scaled_dot_product_attention(query[0], key[0], value[0]).shape == (3, 10, 16)
    assert fmha.scaled_dot_product_attention(query[None], key[None], value[None]).shape == (1, 2, 3, 10, 16)


def test_torch_compile_fullgraph():
    q, k, v = random_qkv(1, 4, 2, 12, 20, 32, torch.float32, head_dim_v=16, requires_grad=True)
    compiled = torch.compile(lambda q, k, v: fmha.attention(q, k, v, causal=True), fullgraph=True)
    out = compiled(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach(), causal_offset=8)
    assert_grads_close(grads, q.detach(), k.detach(), v.detach(), dout, causal_offset=8, out=out.detach())


def test_meta_tensors_give_shapes():
    q, k, v = (torch.empty(shape, device="meta", dtype=torch.bfloat16, requires_grad=True)
               for shape in ((2, 8, 64, 192), (2, 2, 80, 192), (2, 2, 80, 128)))
    out = fmha.attention(q, k, v, causal=True)
    assert out.shape == (2, 8, 64, 128)
    out.sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


def test_naive_baseline():
    q, k, v = random_qkv(1, 2, 1, 19, 24, 32, torch.float16, head_dim_v=16)
    out = fmha.naive_attention(q, k, v, causal=True)
    assert_close_to_reference(out, q, k, v, causal_offset=24 - 19)


def test_the_hopper_kernels_say_when_they_refuse():
    def params(head_dim, head_dim_v):
        q, k, v = random_qkv(1, 2, 1, 8, 8, head_dim, torch.bfloat16, head_dim_v=head_dim_v)
        return attention_params("fmha.attention", q, k, v)

    mla = params(192, 128)
    assert mla.head_dim == 192 and mla.value_head_dim == 128
    # the forward reads V and writes the output at their own width; the backward takes one head dim
    assert value_head_dim_refusal(mla) is None
    assert "the Gluon backward takes one head dim" in value_head_dim_refusal(mla, backward=True)
    assert "not a multiple of 8" in value_head_dim_refusal(params(192, 100))
    assert "wider than the 64 columns" in value_head_dim_refusal(params(64, 128))
    same = params(64, 64)
    assert same.head_dim_v == 0 and value_head_dim_refusal(same, backward=True) is None


def test_kvcache_says_it_needs_one_head_dim():
    q = torch.randn(1, 1, 2, 32, dtype=torch.float16)
    k_cache = torch.randn(1, 16, 2, 32, dtype=torch.float16)
    v_cache = torch.randn(1, 16, 2, 16, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match=r"v_cache's head dim \(16\) differs from k_cache's \(32\)"):
        fmha.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([5], dtype=torch.int32))


@pytest.mark.parametrize("head_dims", [(32, 16), (16, 40)], ids=str)
def test_the_backward_through_one_head_dim(monkeypatch, head_dims):
    """On sm_90 the Gluon backward, which takes one head dim, runs these calls with every tensor
    zero-padded to the wider one. Here a stand-in for it (the portable backward at the padded width)
    checks what it is given, and the gradients cut back from the padded ones."""
    from fmha import dispatch
    from fmha.backends.triton.backend import TritonBackend

    given = []

    def hopper_backward(params, dout, q, k, v, dq, dk, dv, attn_mask=None):
        def run(dout, q, k, v, out, lse, dq, dk, dv, *seqlens, **scores):
            given.append((params.head_dim, params.head_dim_v, *(t.shape[-1] for t in (dout, q, k, v, out, dq, dk, dv))))
            TritonBackend().backward(dout, q, k, v, out, lse, dq, dk, dv, params, None, seqlens, **scores)
        return run, None

    monkeypatch.setattr(dispatch, "hopper_backward", hopper_backward)
    head_dim, head_dim_v = head_dims
    q, k, v = random_qkv(2, 4, 2, 21, 30, head_dim, torch.float16, head_dim_v=head_dim_v)
    out, lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    dout = torch.randn_like(out)
    params = attention_params("test", q, k, v, causal=True)
    grads = dispatch._one_head_dim_backward(dout, q, k, v, out, lse, params, (), None,
                                            *(torch.empty_like(t) for t in (q, k, v)))
    width = max(head_dims)
    assert given == [(width, 0, *[width] * 8)]
    assert_grads_close(grads, q, k, v, dout, causal_offset=30 - 21, out=out)
