"""``flash_attn_with_kvcache``'s prepared launches, and the call as ``torch.library`` custom ops.

:func:`prepared` maps a call's signature (shapes, strides, dtypes, devices, pointer alignment,
options) to its validated :class:`KVCacheForward`: a repeated decode step skips every check.

Two custom ops with one schema, so that only a call that appends mutates:
``fmha::kvcache_append_attention`` writes k and v into k_cache and v_cache (declared mutated) and
returns ``(out, lse)``; ``fmha::kvcache_attention`` (k and v None) only reads the cache. They take
the call's arguments in FlashAttention's order, with ``cache_seqlens`` as an optional tensor plus
its int form (-1: none) and ``window_size`` as two ints. Their fakes give shapes, so
``torch.compile(fullgraph=True)`` traces a decode step whole. A third,
``fmha::paged_varlen_attention``, is ``flash_attn_varlen_func`` with a block table: packed queries
over a paged cache, through the same kernel.
"""

from __future__ import annotations

import torch

from .backends.triton.config import kvcache_config
from .backends.triton.kvcache_launch import KVCacheForward
from .kvcache_params import kvcache_params, paged_varlen_params
from .runtime import multiprocessors

MAX_SIGNATURES = 4096
_signatures: dict = {}


def _signature(tensor):
    if tensor is None or tensor.__class__ is int:
        return tensor.__class__
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.data_ptr() & 15 == 0)


def _remember(key, params) -> KVCacheForward:
    """The launches of validated ``params``, kept under ``key`` (None: not kept)."""
    forward = KVCacheForward(params, kvcache_config(params, multiprocessors(params.device)))
    if key is not None:
        if len(_signatures) >= MAX_SIGNATURES:  # a server that sees ever new shapes starts over
            _signatures.clear()
        _signatures[key] = forward
    return forward


def prepared(fn, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
             num_splits, sinks=None) -> KVCacheForward:
    """The launches of this call's signature, validated once (an int cache_seqlens is not part of it)."""
    try:
        key = (_signature(q), _signature(k_cache), _signature(v_cache), _signature(k), _signature(v),
               _signature(rotary_cos), _signature(rotary_sin), _signature(cache_seqlens),
               _signature(cache_batch_idx), _signature(cache_leftpad), _signature(block_table),
               softmax_scale, softmax_scale.__class__, causal, causal.__class__, window_size, softcap,
               softcap.__class__, rotary_interleaved, rotary_interleaved.__class__, _signature(alibi_slopes),
               _signature(sinks), num_splits, num_splits.__class__)
        forward = _signatures.get(key)
    except (AttributeError, TypeError, RuntimeError):  # not tensors, unhashable arguments: the checks say why
        key = forward = None
    if forward is None:
        forward = _remember(key, kvcache_params(
            fn, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
            sinks))
    return forward


def prepared_paged_varlen(fn, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                          softmax_scale, causal, window_size, softcap, alibi_slopes) -> KVCacheForward:
    """The launches of a ``flash_attn_varlen_func`` call over a paged cache, validated once per signature."""
    try:
        key = ("paged_varlen", _signature(q), _signature(k_cache), _signature(v_cache), _signature(cu_seqlens_q),
               _signature(cu_seqlens_k), max_seqlen_q, max_seqlen_q.__class__, _signature(block_table),
               softmax_scale, softmax_scale.__class__, causal, causal.__class__, window_size, softcap,
               softcap.__class__, _signature(alibi_slopes))
        forward = _signatures.get(key)
    except (AttributeError, TypeError, RuntimeError):
        key = forward = None
    if forward is None:
        forward = _remember(key, paged_varlen_params(fn, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                     block_table, softmax_scale, causal, window_size, softcap,
                                                     alibi_slopes))
    return forward


def forget() -> None:
    _signatures.clear()


def _run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen, cache_batch_idx, cache_leftpad,
         block_table, softmax_scale, causal, window_left, window_right, rotary_interleaved, num_splits, softcap,
         alibi_slopes, sinks):
    """Both ops' implementation: the prepared launches of these arguments."""
    lengths = cache_seqlens if cache_seqlens is not None else (None if cache_seqlen < 0 else cache_seqlen)
    forward = prepared("fmha.flash_attn_with_kvcache", q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, lengths,
                       cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                       (window_left, window_right), softcap, rotary_interleaved, alibi_slopes, num_splits, sinks)
    if cache_seqlens is None and cache_seqlen < 0:  # no lengths: the whole cache
        cache_seqlen = forward.params.capacity
    return forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, max(cache_seqlen, 0),
                   cache_batch_idx, cache_leftpad, block_table, alibi_slopes, sinks)


def _fake(q, *args):
    batch, seqlen_q, q_heads, head_dim = q.shape
    return q.new_empty((batch, seqlen_q, q_heads, head_dim)), q.new_empty((batch, q_heads, seqlen_q),
                                                                           dtype=torch.float32)


_SCHEMA = ("(Tensor q, Tensor{mutated_k} k_cache, Tensor{mutated_v} v_cache, Tensor? k, Tensor? v, Tensor? rotary_cos, "
           "Tensor? rotary_sin, Tensor? cache_seqlens, SymInt cache_seqlen, Tensor? cache_batch_idx, "
           "Tensor? cache_leftpad, Tensor? block_table, float? softmax_scale, bool causal, int window_left, "
           "int window_right, bool rotary_interleaved, int num_splits, float softcap, Tensor? alibi_slopes, "
           "Tensor? sinks) -> (Tensor, Tensor)")

# Attention over the cache as it is (k and v None).
kvcache_attention = torch.library.custom_op("fmha::kvcache_attention", _run, mutates_args=(),
                                            schema=_SCHEMA.format(mutated_k="", mutated_v=""))
kvcache_attention.register_fake(_fake)
# Append k and v to the cache (in place), then attention.
kvcache_append_attention = torch.library.custom_op(
    "fmha::kvcache_append_attention", _run, mutates_args=("k_cache", "v_cache"),
    schema=_SCHEMA.format(mutated_k="(a!)", mutated_v="(b!)"))
kvcache_append_attention.register_fake(_fake)


def run_paged_varlen(fn, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, softmax_scale,
                     causal, window_size, softcap, alibi_slopes) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a ``flash_attn_varlen_func`` call over a paged cache: its prepared launch,
    with cu_seqlens_k as the key lengths."""
    forward = prepared_paged_varlen(fn, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                                    softmax_scale, causal, window_size, softcap, alibi_slopes)
    return forward(q, k_cache, v_cache, None, None, None, None, cu_seqlens_k, 0, None, None, block_table, alibi_slopes,
                   None, cu_seqlens_q)


def _run_paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, softmax_scale,
                      causal, window_left, window_right, softcap, alibi_slopes):
    return run_paged_varlen("fmha.flash_attn_varlen_func", q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
                            max_seqlen_q, block_table, softmax_scale, causal, (window_left, window_right), softcap,
                            alibi_slopes)


def _fake_paged_varlen(q, *args):
    total_q, q_heads, head_dim = q.shape
    return q.new_empty((total_q, q_heads, head_dim)), q.new_empty((q_heads, total_q), dtype=torch.float32)


# flash_attn_varlen_func with block_table: packed queries over a paged cache, forward only.
paged_varlen_attention = torch.library.custom_op(
    "fmha::paged_varlen_attention", _run_paged_varlen, mutates_args=(),
    schema="(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
           "Tensor block_table, float? softmax_scale, bool causal, int window_left, int window_right, float softcap, "
           "Tensor? alibi_slopes) -> (Tensor, Tensor)")
paged_varlen_attention.register_fake(_fake_paged_varlen)
