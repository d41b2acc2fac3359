"""Bad input raises a clear TypeError/ValueError naming the argument, before any launch."""

import pytest
import torch

import fmha
from fmha import ForwardConfig


def qkv(q_shape=(1, 4, 8, 16), k_shape=(1, 2, 8, 16), v_shape=None, dtype=torch.float16):
    v_shape = v_shape or k_shape
    return torch.randn(q_shape).to(dtype), torch.randn(k_shape).to(dtype), torch.randn(v_shape).to(dtype)


ENTRY_POINTS = [fmha.attention, fmha.naive_attention]


@pytest.mark.parametrize("fn", ENTRY_POINTS)
@pytest.mark.parametrize("bad, error, pattern", [
    (dict(q_shape=(4, 8, 16)), ValueError, r"q must be 4-D"),
    (dict(k_shape=(1, 2, 8, 16, 1)), ValueError, r"k must be 4-D"),
    (dict(k_shape=(1, 3, 8, 16)), ValueError, r"multiple of the number of key/value heads"),
    (dict(k_shape=(1, 2, 8, 32)), ValueError, r"head dim mismatch"),
    (dict(q_shape=(1, 4, 8, 320), k_shape=(1, 2, 8, 320)), ValueError, r"head dim .* between 1 and 256"),
    (dict(v_shape=(1, 2, 8, 300)), ValueError, r"value head dim \(last dim of v\) must be between 1 and 256"),
    (dict(v_shape=(1, 2, 8, 0)), ValueError, r"v 0 \(their last dims\)"),
    (dict(v_shape=(1, 2, 9, 16)), ValueError, r"k and v must have the same sequence length"),
    (dict(v_shape=(1, 1, 8, 16)), ValueError, r"k and v must have the same number of heads"),
    (dict(k_shape=(2, 2, 8, 16)), ValueError, r"batch sizes differ"),
])
def test_shape_errors(fn, bad, error, pattern):
    q, k, v = qkv(**bad)
    with pytest.raises(error, match=pattern):
        fn(q, k, v)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_integer_tensors(fn):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k has dtype torch.int32"):
        fn(q, k.to(torch.int32), v)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_float64_is_rejected(fn):
    q, k, v = qkv(dtype=torch.float64)
    with pytest.raises(TypeError, match=r"q has dtype torch.float64"):
        fn(q, k, v)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_mismatched_dtypes(fn):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"same dtype"):
        fn(q, k, v.float())


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_mismatched_devices(fn):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"same device"):
        fn(q, k, v.to("meta"))


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_not_a_tensor(fn):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"v must be a torch.Tensor"):
        fn(q, k, v.numpy())


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(scale="0.1"), TypeError, r"scale must be a real number"),
    (dict(scale=float("nan")), ValueError, r"scale must be finite"),
    (dict(causal=1), TypeError, r"causal must be a bool"),
    (dict(return_lse="yes"), TypeError, r"return_lse must be a bool"),
    (dict(deterministic=1), TypeError, r"deterministic must be a bool"),
    (dict(config=(64, 64, 4, 3)), TypeError, r"config must be a fmha.ForwardConfig"),
    (dict(softcap=0.0), ValueError, r"softcap must be finite and > 0"),
    (dict(softcap=float("inf")), ValueError, r"softcap must be finite and > 0"),
    (dict(softcap="30"), TypeError, r"softcap must be a real number"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError, r"alibi_slopes must be float32"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(4,\) or \(1, 4\)"),
    (dict(alibi_slopes=[1.0] * 4), TypeError, r"alibi_slopes must be a torch.Tensor or None"),
    (dict(alibi_slopes=torch.ones(4, device="meta")), ValueError, r"alibi_slopes is on meta"),
    (dict(sinks=torch.ones(2)), ValueError, r"sinks must have shape \(4,\)"),
    (dict(sinks=torch.ones(4, dtype=torch.float64)), TypeError, r"sinks must be float32"),
    (dict(dropout_p=-0.1), ValueError, r"dropout_p must be a float in \[0, 1\]"),
    (dict(dropout_p=True), ValueError, r"dropout_p must be a float"),
    (dict(dropout_p=0.1, generator=1), TypeError, r"generator must be a torch.Generator"),
])
def test_keyword_errors(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        fmha.attention(*qkv(), **kwargs)


def test_config_validation():
    with pytest.raises(ValueError, match=r"block_m must be a power of two"):
        ForwardConfig(block_m=48, block_n=64, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match=r"num_warps"):
        ForwardConfig(block_m=64, block_n=64, num_warps=3, num_stages=2)


def test_naive_baseline_has_no_backward():
    q, k, v = qkv(dtype=torch.float32)
    q.requires_grad_(True)
    with pytest.raises(NotImplementedError, match=r"naive baseline is forward only"):
        fmha.naive_attention(q, k, v)


@pytest.mark.interpreter
def test_no_grad_inputs_that_require_grad_are_fine():
    q, k, v = qkv(dtype=torch.float32)
    q.requires_grad_(True)
    with torch.no_grad():
        assert fmha.attention(q, k, v).shape == q.shape


class TestSdpaEntryPoint:
    @pytest.mark.parametrize("mask, error, pattern", [
        (torch.ones(8, 8, dtype=torch.int32), TypeError, r"attn_mask must be bool, float32 or the query's dtype"),
        (torch.ones(8, 8, dtype=torch.float64), TypeError, r"attn_mask must be bool"),
        (torch.ones(8, 9, dtype=torch.bool), ValueError, r"attn_mask of shape \(8, 9\) does not broadcast"),
        (torch.ones(8, dtype=torch.bool), ValueError, r"attn_mask of shape \(8,\) does not broadcast"),
        (torch.ones(2, 1, 4, 8, 8, dtype=torch.bool), ValueError, r"does not broadcast"),
        (torch.ones(8, 8, dtype=torch.bool, device="meta"), ValueError, r"attn_mask is on meta"),
        ("mask", TypeError, r"attn_mask must be a torch.Tensor"),
    ])
    def test_bad_attn_masks_are_named(self, mask, error, pattern):
        q, k, v = qkv(k_shape=(1, 4, 8, 16))
        with pytest.raises(error, match=pattern):
            fmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def test_attn_mask_and_is_causal_together(self):
        q, k, v = qkv(k_shape=(1, 4, 8, 16))
        with pytest.raises(ValueError, match=r"attn_mask or is_causal=True, not both"):
            fmha.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True)

    def test_dropout_out_of_range(self):
        q, k, v = qkv(k_shape=(1, 4, 8, 16))
        with pytest.raises(ValueError, match=r"dropout_p must be a float in \[0, 1\]"):
            fmha.scaled_dot_product_attention(q, k, v, dropout_p=1.5)

    def test_gqa_needs_enable_gqa(self):
        q, k, v = qkv()
        with pytest.raises(ValueError, match=r"enable_gqa=True"):
            fmha.scaled_dot_product_attention(q, k, v)

    def test_value_head_dim_out_of_range(self):
        q, k, v = qkv(k_shape=(1, 4, 8, 16), v_shape=(1, 4, 8, 512))
        with pytest.raises(ValueError, match=r"value head dim \(last dim of value\)"):
            fmha.scaled_dot_product_attention(q, k, v)

    def test_batch_dims_that_do_not_broadcast(self):
        q, k, v = qkv(q_shape=(2, 4, 8, 16), k_shape=(3, 4, 8, 16))
        with pytest.raises(ValueError, match=r"leading dims .* do not broadcast"):
            fmha.scaled_dot_product_attention(q, k, v)

    def test_too_few_dims(self):
        with pytest.raises(ValueError, match=r"query must have at least 3 dims"):
            fmha.scaled_dot_product_attention(torch.randn(8, 16), torch.randn(8, 16), torch.randn(8, 16))
