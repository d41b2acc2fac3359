"""FlashAttention-2's functions (BSHD) on the CPU through the interpreter, against float64."""

import inspect

import pytest
import torch

import fmha
from fmha.masking import Window

from .helpers import assert_close_to_reference, assert_grads_close, random_qkv

pytestmark = pytest.mark.interpreter

# FlashAttention 2.6+'s parameter lists, so that code written for flash_attn binds the same way.
SIGNATURES = {
    "flash_attn_func": "q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                       "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False",
    "flash_attn_qkvpacked_func": "qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                                 "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False",
    "flash_attn_kvpacked_func": "q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                                "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False",
    "flash_attn_varlen_func": "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, "
                              "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
                              "alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None",
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures_are_flash_attentions(name):
    assert str(inspect.signature(getattr(fmha, name))) == f"({SIGNATURES[name]})"


def bshd(*shape, dtype=torch.float16):
    """q, k, v as (B, S, H, D) tensors, and their (B, H, S, D) views for the reference."""
    q, k, v = random_qkv(*shape, dtype, layout="bshd")
    return (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)), (q, k, v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window_size", [(-1, -1), (8, 0), (5, 3), (-1, 2)], ids=lambda w: f"{w[0]}_{w[1]}")
def test_flash_attn_func_matches_float64(causal, window_size):
    (q, k, v), heads_first = bshd(2, 4, 2, 37, 45, 32)
    assert q.shape == (2, 37, 4, 32)
    out, lse, probs = fmha.flash_attn_func(q, k, v, causal=causal, window_size=window_size, return_attn_probs=True)
    assert out.shape == q.shape and out.is_contiguous() and probs is None
    left, right = (None if side == -1 else side for side in window_size)
    if causal:
        right = 0 if right is None else min(right, 0)
    window = Window.of(37, 45, left=left, right=right) if (left, right) != (None, None) else None
    assert_close_to_reference(out.transpose(1, 2), *heads_first, window=window, lse=lse)


def test_packed_variants_and_their_gradients():
    qkv = torch.randn(2, 33, 3, 4, 16, dtype=torch.float32, requires_grad=True)
    out = fmha.flash_attn_qkvpacked_func(qkv, causal=True, softmax_scale=0.2)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    assert_close_to_reference(out.transpose(1, 2), q, k, v, causal_offset=0, scale=0.2)
    dout = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, dout)
    assert_grads_close([g.transpose(1, 2) for g in grad.unbind(2)], q, k, v, dout.transpose(1, 2), causal_offset=0,
                       scale=0.2)

    query = torch.randn(2, 20, 4, 16)
    kv = torch.randn(2, 30, 2, 2, 16)
    out = fmha.flash_attn_kvpacked_func(query, kv, window_size=(6, 6))
    k, v = (t.transpose(1, 2) for t in kv.unbind(2))
    assert_close_to_reference(out.transpose(1, 2), query.transpose(1, 2), k, v,
                              window=Window.of(20, 30, left=6, right=6))


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(window_size=(-2, 0)), ValueError, r"window_size's left side must be an int >= -1"),
    (dict(window_size=(3,)), TypeError, r"window_size must be a \(left, right\) pair"),
    (dict(softcap=-30.0), ValueError, r"softcap must be finite and > 0 \(0.0 turns it off\)"),
    (dict(softcap="30"), TypeError, r"softcap must be a real number > 0 or 0.0 \(off\)"),
    (dict(softcap=torch.ones(2)), TypeError, r"softcap must be a real number > 0 or 0.0 \(off\)"),
    (dict(dropout_p=1.5), ValueError, r"dropout_p must be a float in \[0, 1\]"),
    (dict(alibi_slopes=torch.ones(2)), ValueError, r"alibi_slopes must have shape \(4,\) or \(1, 4\)"),
    (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be finite"),
    (dict(softmax_scale="0.1"), TypeError, r"softmax_scale must be a real number"),
    (dict(return_attn_probs="yes"), TypeError, r"return_attn_probs must be a bool"),
    (dict(deterministic=1), TypeError, r"deterministic must be a bool"),
    (dict(causal=None), TypeError, r"causal must be a bool"),
    (dict(v_dtype=torch.float32), TypeError, r"must have the same dtype"),
    (dict(k_batch=2), ValueError, r"batch sizes differ"),
])
def test_unsupported_or_bad_arguments_are_named(kwargs, error, pattern):
    (q, k, v), _ = bshd(1, 4, 2, 8, 8, 16)
    kwargs = dict(kwargs)
    v = v.to(kwargs.pop("v_dtype", v.dtype))
    k = k.expand(kwargs.pop("k_batch", 1), *k.shape[1:])
    # every message names the function called, though most checks are fmha.attention's
    with pytest.raises(error, match=r"^fmha.flash_attn_func: .*" + pattern):
        fmha.flash_attn_func(q, k, v, **kwargs)


def test_varlen_names_its_own_arguments():
    q = torch.randn(8, 4, 16, dtype=torch.float16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"fmha.flash_attn_varlen_func: softmax_scale must be finite"):
        fmha.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5, softmax_scale=float("inf"))
    with pytest.raises(TypeError, match=r"fmha.flash_attn_varlen_func: return_attn_probs must be a bool"):
        fmha.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5, return_attn_probs=1)


def test_heads_first_tensors_are_refused_by_shape_checks():
    q = torch.randn(1, 8, 4, 16)
    with pytest.raises(ValueError, match=r"4-D \(batch, seqlen, heads, head_dim\)"):
        fmha.flash_attn_func(q, q, q[..., None])
    with pytest.raises(ValueError, match=r"q must be 3-D \(total_tokens, heads, head_dim\)"):
        fmha.flash_attn_varlen_func(q, q, q, None, None, 8, 8)
