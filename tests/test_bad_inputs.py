"""One argument of a valid call made wrong, at random: the call must raise TypeError, ValueError or
NotImplementedError naming the function called, before any kernel launch and with its tensors
unchanged, or else be a valid call (reach a launch, or return without one)."""

import random
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fmha

BATCH, SEQLEN_Q, SEQLEN_K, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 3, 5, 4, 2, 16


def randn(*shape):
    return torch.randn(*shape).to(torch.float16)


KINDS = ["attention", "sdpa", "flash", "qkvpacked", "kvpacked", "varlen", "varlen_attention", "varlen_kvpacked",
         "varlen_qkvpacked", "kvcache", "paged"]


def valid_call(kind):
    """(function, its name in messages, args, kwargs): a call that is valid as it stands."""
    q, kv = (BATCH, SEQLEN_Q, Q_HEADS, HEAD_DIM), (BATCH, SEQLEN_K, KV_HEADS, HEAD_DIM)
    if kind == "attention":
        return fmha.attention, "fmha.attention", [randn(BATCH, Q_HEADS, SEQLEN_Q, HEAD_DIM),
                                                  randn(BATCH, KV_HEADS, SEQLEN_K, HEAD_DIM),
                                                  randn(BATCH, KV_HEADS, SEQLEN_K, HEAD_DIM)], dict(
            causal=True, window=(2, 0), softcap=30.0, alibi_slopes=torch.rand(Q_HEADS), sinks=torch.randn(Q_HEADS),
            dropout_p=0.1, return_lse=True)
    if kind == "sdpa":
        return fmha.scaled_dot_product_attention, "fmha.scaled_dot_product_attention", [
            randn(BATCH, Q_HEADS, SEQLEN_Q, HEAD_DIM), randn(BATCH, KV_HEADS, SEQLEN_K, HEAD_DIM),
            randn(BATCH, KV_HEADS, SEQLEN_K, HEAD_DIM)], dict(
            attn_mask=torch.rand(SEQLEN_Q, SEQLEN_K) < 0.8, dropout_p=0.0, is_causal=False, scale=0.3,
            enable_gqa=True)
    if kind == "flash":
        return fmha.flash_attn_func, "fmha.flash_attn_func", [randn(*q), randn(*kv), randn(*kv)], dict(
            dropout_p=0.0, softmax_scale=0.2, causal=True, window_size=(3, 0), softcap=20.0,
            alibi_slopes=torch.rand(BATCH, Q_HEADS), deterministic=False, return_attn_probs=True)
    if kind == "qkvpacked":
        return fmha.flash_attn_qkvpacked_func, "fmha.flash_attn_qkvpacked_func", [
            randn(BATCH, SEQLEN_K, 3, KV_HEADS, HEAD_DIM)], dict(causal=False, window_size=(-1, 2), dropout_p=0.2)
    if kind == "kvpacked":
        return fmha.flash_attn_kvpacked_func, "fmha.flash_attn_kvpacked_func", [
            randn(*q), randn(BATCH, SEQLEN_K, 2, KV_HEADS, HEAD_DIM)], dict(causal=True, softcap=5.0,
                                                                           alibi_slopes=torch.rand(Q_HEADS))
    cu_seqlens_q, cu_seqlens_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 2, 5], [0, 4, 9]))
    if kind == "varlen":
        return fmha.flash_attn_varlen_func, "fmha.flash_attn_varlen_func", [
            randn(5, Q_HEADS, HEAD_DIM), randn(9, KV_HEADS, HEAD_DIM), randn(9, KV_HEADS, HEAD_DIM), cu_seqlens_q,
            cu_seqlens_k, 3, 5], dict(causal=True, window_size=(2, 1), softcap=0.0)
    if kind == "varlen_attention":
        return fmha.varlen_attention, "fmha.varlen_attention", [
            randn(5, Q_HEADS, HEAD_DIM), randn(9, KV_HEADS, HEAD_DIM), randn(9, KV_HEADS, HEAD_DIM), cu_seqlens_q,
            cu_seqlens_k, 3, 5], dict(causal=False, window=(None, 1), sinks=torch.randn(Q_HEADS),
                                      alibi_slopes=torch.rand(2, Q_HEADS), dropout_p=0.1, return_lse=True)
    if kind == "varlen_kvpacked":
        return fmha.flash_attn_varlen_kvpacked_func, "fmha.flash_attn_varlen_kvpacked_func", [
            randn(5, Q_HEADS, HEAD_DIM), randn(9, 2, KV_HEADS, HEAD_DIM), cu_seqlens_q, cu_seqlens_k, 3, 5], dict(
            causal=True, softcap=3.0)
    if kind == "varlen_qkvpacked":
        return fmha.flash_attn_varlen_qkvpacked_func, "fmha.flash_attn_varlen_qkvpacked_func", [
            randn(9, 3, KV_HEADS, HEAD_DIM), cu_seqlens_k, 5], dict(window_size=(1, 1), return_attn_probs=True)
    capacity = 12
    kwargs = dict(k=randn(BATCH, 2, KV_HEADS, HEAD_DIM), v=randn(BATCH, 2, KV_HEADS, HEAD_DIM),
                  cache_seqlens=torch.tensor([3, 7], dtype=torch.int32), causal=True, num_splits=2,
                  return_softmax_lse=True, softcap=10.0)
    if kind == "kvcache":
        caches = randn(BATCH, capacity, KV_HEADS, HEAD_DIM), randn(BATCH, capacity, KV_HEADS, HEAD_DIM)
        kwargs.update(rotary_cos=torch.randn(capacity, 4), rotary_sin=torch.randn(capacity, 4),
                      cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32),
                      cache_leftpad=torch.tensor([0, 1], dtype=torch.int32), window_size=(4, 0))
    else:  # paged
        caches = randn(10, 3, KV_HEADS, HEAD_DIM), randn(10, 3, KV_HEADS, HEAD_DIM)
        kwargs.update(block_table=torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32),
                      alibi_slopes=torch.rand(Q_HEADS), sinks=torch.randn(Q_HEADS))
    return fmha.flash_attn_with_kvcache, "fmha.flash_attn_with_kvcache", [randn(BATCH, 1, Q_HEADS, HEAD_DIM),
                                                                          *caches], kwargs


def made_wrong(value, rng):
    """(what was done, the value made wrong): a change of type, dtype, shape, layout or range."""
    if isinstance(value, torch.Tensor):
        how = rng.choice(["dtype", "fewer_dims", "more_dims", "one_size", "list", "transposed", "empty", "meta"])
    elif isinstance(value, bool):
        how = rng.choice(["int", "str", "none"])
    elif isinstance(value, (int, float)):
        how = rng.choice(["negative", "huge", "nan", "str", "tensor", "none", "zero"])
    elif isinstance(value, tuple):
        how = rng.choice(["short", "long", "negative", "str", "floats"])
    else:
        how = rng.choice(["tensor", "int"])
    if how == "dtype":
        return how, value.to(rng.choice([torch.int64, torch.int32, torch.float32, torch.float64, torch.bfloat16,
                                         torch.bool, torch.float16]))
    if how == "one_size" and value.dim():
        shape = list(value.shape)
        dim = rng.randrange(value.dim())
        shape[dim] = max(0, shape[dim] + rng.choice([-1, 1, 3]))
        return how, torch.randn(shape).to(value.dtype) if value.is_floating_point() else torch.ones(shape, dtype=value.dtype)
    changes = {
        "fewer_dims": lambda: value.reshape(-1) if value.dim() > 1 else value.sum(),
        "more_dims": lambda: value.unsqueeze(0),
        "one_size": lambda: value,
        "list": lambda: value.tolist(),
        "transposed": lambda: value.transpose(0, -1),
        "empty": lambda: value[:0] if value.dim() else value,
        "meta": lambda: value.to("meta"),
        "int": lambda: 3,
        "str": lambda: "abc",
        "none": lambda: None,
        "negative": lambda: tuple(-5 for _ in value) if isinstance(value, tuple) else -value,
        "huge": lambda: 10**12,
        "nan": lambda: float("nan"),
        "tensor": lambda: torch.tensor(value) if isinstance(value, (int, float)) else torch.randn(3),
        "zero": lambda: 0,
        "short": lambda: value[:1],
        "long": lambda: value + (1,),
        "floats": lambda: tuple(float(side or 0) + 0.5 for side in value),
    }
    return how, changes[how]()


class Launched(Exception):
    """Raised in place of a kernel launch: the call got past its checks."""


def no_launches():
    """Kernels raise Launched instead of running (CPU tests run them through Triton's interpreter)."""
    from triton.runtime.interpreter import InterpretedFunction

    def launch(*args, **kwargs):
        raise Launched()
    return mock.patch.object(InterpretedFunction, "run", launch)


def tensors_of(args, kwargs):
    return [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor) and t.device.type != "meta"]


@pytest.mark.interpreter
@settings(max_examples=1000, deadline=None, derandomize=True)
@given(kind=st.sampled_from(KINDS),
       seed=st.integers(0, 2**32 - 1))
def test_one_wrong_argument_is_named_before_any_launch(kind, seed):
    rng = random.Random(seed)
    fn, name, args, kwargs = valid_call(kind)
    target = rng.choice(range(len(args) + len(kwargs)))
    if target < len(args):
        how, args[target] = made_wrong(args[target], rng)
        argument = f"argument {target}"
    else:
        argument = list(kwargs)[target - len(args)]
        how, kwargs[argument] = made_wrong(kwargs[argument], rng)
    before = [t.clone() for t in tensors_of(args, kwargs)]
    try:
        with no_launches():
            fn(*args, **kwargs)
    except Launched:
        return  # still a valid call
    except (TypeError, ValueError, NotImplementedError) as error:
        assert str(error).startswith(f"{name}: "), f"{kind}, {argument} made wrong ({how}): {error!r}"
        for t, original in zip(tensors_of(args, kwargs), before):
            assert torch.equal(t.nan_to_num(7.0), original.nan_to_num(7.0)), f"{kind}: {argument} ({how}) wrote a tensor"
