"""fmha.scaled_dot_product_attention against torch's, on the CPU through the interpreter."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as torch_sdpa

import fmha

from .helpers import assert_close_to_reference, assert_sdpa_grads_close, random_qkv

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("seqlens", [(9, 30), (30, 9), (16, 16)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_top_left_causal_matches_torch(seqlens, is_causal):
    q, k, v = random_qkv(2, 4, 2, *seqlens, 32, torch.float32)
    out = fmha.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    with sdpa_kernel(SDPBackend.MATH):
        expected = torch_sdpa(q, k, v, is_causal=is_causal, enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    assert_close_to_reference(out, q, k, v, causal_offset=0 if is_causal else None)


def test_three_dim_inputs():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 11, 16, generator=generator, dtype=torch.float16) for _ in range(3))
    out = fmha.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert out.shape == q.shape
    expected = torch_sdpa(q.float(), k.float(), v.float(), scale=0.3)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


def test_five_dim_inputs():
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 2, 7, 16, generator=generator) for _ in range(3))
    out = fmha.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == q.shape
    torch.testing.assert_close(out, torch_sdpa(q, k, v, is_causal=True), atol=2e-6, rtol=1e-5)


# (query shape, key/value shape): empty sequences, heads and batches, as 3-, 4- and 5-D inputs
EMPTY = [((1, 2, 0, 8), (1, 2, 5, 8)), ((1, 2, 3, 8), (1, 2, 0, 8)), ((1, 0, 3, 8), (1, 0, 5, 8)),
         ((0, 2, 3, 8), (0, 2, 5, 8)), ((2, 3, 8), (2, 0, 8)), ((2, 1, 0, 3, 8), (2, 1, 0, 5, 8)),
         ((0, 1, 2, 3, 8), (0, 1, 2, 5, 8))]


@pytest.mark.parametrize("shapes", EMPTY, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_empty_inputs_match_torch(shapes, is_causal):
    query_shape, key_shape = shapes
    q = torch.randn(query_shape)
    k, v = torch.randn(key_shape), torch.randn(key_shape)
    out = fmha.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    torch.testing.assert_close(out, torch_sdpa(q, k, v, is_causal=is_causal), atol=0, rtol=0)


def test_head_dim_zero_is_a_clear_error():
    q = torch.randn(1, 2, 3, 0)
    with pytest.raises(ValueError, match=r"head dim 0"):
        fmha.scaled_dot_product_attention(q, q, q)


@pytest.mark.parametrize("entry", ["attention", "scaled_dot_product_attention"])
def test_meta_tensors_give_shapes_and_gradients(entry):
    q = torch.randn(2, 4, 7, 16, device="meta", requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 16, device="meta", requires_grad=True) for _ in range(2))
    kwargs = {"enable_gqa": True} if entry == "scaled_dot_product_attention" else {}
    out = getattr(fmha, entry)(q, k, v, **kwargs)
    assert out.device.type == "meta" and out.shape == q.shape
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    with torch.no_grad():
        out, lse = fmha.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 4, 7) and lse.dtype == torch.float32


# (query, key, value shapes, keywords): batch dims that broadcast either way, fewer dims, heads of
# size 1 without enable_gqa (key and value both: one KV head; one of them: expanded), (N, L, E)
# inputs whose N broadcasts, batch broadcast with grouped heads, and a padding mask beside it.
BROADCASTS = [((2, 4, 8, 16), (1, 4, 9, 16), (1, 4, 9, 16), {}),
              ((1, 4, 8, 16), (2, 4, 9, 16), (2, 4, 9, 16), {"is_causal": True}),
              ((3, 2, 4, 8, 16), (1, 2, 4, 9, 16), (2, 4, 9, 16), {}),
              ((2, 4, 8, 16), (2, 1, 9, 16), (2, 1, 9, 16), {}),
              ((2, 1, 8, 16), (2, 4, 9, 16), (2, 4, 9, 16), {}),
              ((2, 4, 8, 16), (2, 4, 9, 16), (2, 1, 9, 16), {}),
              ((2, 8, 16), (1, 9, 16), (1, 9, 16), {}),
              ((3, 2, 8, 8, 16), (1, 2, 2, 9, 16), (1, 2, 2, 9, 16), {"enable_gqa": True}),
              ((2, 4, 8, 16), (1, 1, 9, 16), (1, 1, 9, 16), {"attn_mask": "padding"})]


@pytest.mark.parametrize("shapes", BROADCASTS, ids=str)
def test_leading_dims_broadcast_as_in_torch(shapes):
    query_shape, key_shape, value_shape, keywords = shapes
    generator = torch.Generator().manual_seed(len(query_shape) + query_shape[0])
    q, k, v = (torch.randn(shape, generator=generator, dtype=torch.float64).float().requires_grad_()
               for shape in (query_shape, key_shape, value_shape))
    if keywords.get("attn_mask") == "padding":  # (B, 1, 1, S), as Hugging Face passes it
        keywords = {"attn_mask": torch.arange(9).expand(2, 1, 1, 9) < torch.tensor([9, 5]).view(2, 1, 1, 1)}
    out = fmha.scaled_dot_product_attention(q, k, v, **keywords)
    with sdpa_kernel(SDPBackend.MATH):
        expected = torch_sdpa(*(x.double() for x in (q, k, v)), **keywords)
    assert out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)
    dout = torch.randn(out.shape, generator=generator)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected_grads = torch.autograd.grad(expected, (q, k, v), dout.double())
    for got, want in zip(grads, expected_grads):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_leading_dims_that_do_not_broadcast_are_named():
    q = torch.randn(2, 4, 8, 16)
    with pytest.raises(ValueError, match="do not broadcast"):
        fmha.scaled_dot_product_attention(q, torch.randn(3, 4, 9, 16), torch.randn(3, 4, 9, 16))
    with pytest.raises(ValueError, match="enable_gqa=True"):
        fmha.scaled_dot_product_attention(q, torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16))


def check_attn_mask_gradient(dtype, mask_shape, gqa, device="cpu", lengths=(10, 13), head_dim=16, expand=False):
    """A float attn_mask that requires grad gets its gradient, dS summed over the dims it broadcasts
    over, held to the error rule (fmha.testing.assert_sdpa_grads_close). ``expand``: the caller
    expands the mask to every batch, head and row first (stride 0)."""
    generator = torch.Generator(device=device).manual_seed(sum(mask_shape))
    seqlen_q, seqlen_k = lengths
    kv_heads = 2 if gqa else 4
    query, key, value = (torch.randn(shape, generator=generator, device=device).to(dtype).requires_grad_()
                         for shape in ((2, 4, seqlen_q, head_dim), (2, kv_heads, seqlen_k, head_dim),
                                       (2, kv_heads, seqlen_k, head_dim)))
    mask = (torch.randn(mask_shape, generator=generator, device=device) * 2).to(dtype).requires_grad_()
    passed = mask.expand(2, 4, seqlen_q, seqlen_k) if expand else mask
    out = fmha.scaled_dot_product_attention(query, key, value, attn_mask=passed, enable_gqa=gqa)
    dout = torch.randn(out.shape, generator=generator, device=device).to(dtype)
    grads = torch.autograd.grad(out, (query, key, value, mask), dout)
    assert_sdpa_grads_close(grads, query, key, value, mask, dout, out.detach(), enable_gqa=gqa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("mask_shape, gqa", [((2, 4, 10, 13), False), ((10, 13), False), ((2, 1, 1, 13), True),
                                             ((1, 4, 10, 1), False)], ids=str)
def test_attn_mask_gradient_matches_torch(dtype, mask_shape, gqa):
    check_attn_mask_gradient(dtype, mask_shape, gqa)


def test_gradient_of_a_mask_the_caller_expanded():
    # the gradient reaches the caller's (1, 1, 1, Sk) mask through its expand
    check_attn_mask_gradient(torch.float16, (1, 1, 1, 13), False, expand=True)


def test_attn_mask_gradient_under_torch_compile():
    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(1, 2, length, 16, generator=generator, requires_grad=True)
                         for length in (9, 12, 12))
    mask = torch.randn(1, 1, 9, 12, generator=generator, requires_grad=True)
    compiled = torch.compile(lambda q, k, v, m: fmha.scaled_dot_product_attention(q, k, v, attn_mask=m),
                             fullgraph=True)
    out = compiled(query, key, value, mask)
    dout = torch.randn(out.shape, generator=generator)
    with sdpa_kernel(SDPBackend.MATH):
        expected = torch_sdpa(query, key, value, attn_mask=mask)
    expected_grads = torch.autograd.grad(expected, (query, mask), dout)
    for got, want in zip(torch.autograd.grad(out, (query, mask), dout), expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_hopper_backward_leaves_the_mask_gradient_to_the_portable_one():
    from fmha.backends.gluon_sm90.backend import HopperBackend

    q, k, v = random_qkv(1, 2, 2, 8, 8, 64, torch.bfloat16)
    params = fmha.params.attention_params("test", q, k, v, attn_mask_kind="float32", attn_mask_grad=True)
    assert "the attn_mask requires grad" in HopperBackend().backward_refusal(params, q, q, k, v, q, k, v)
