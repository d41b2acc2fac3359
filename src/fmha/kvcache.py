"""``flash_attn_with_kvcache``: FlashAttention-2's inference entry point, with its signature and semantics.

A repeated call signature (a decode step) costs a key lookup, the output allocations and one
launch (the chunks of split keys are merged inside it): the kernel reads the lengths on the
device, so nothing waits for the GPU and the step can be captured in a CUDA graph. Under ``torch.compile`` the call is a custom op
(:mod:`fmha.kvcache_ops`).
"""

from __future__ import annotations

import torch

from . import kvcache_ops
from .kvcache_params import check_cache_seqlen, kvcache_params, paged_varlen_params
from .params import check_flag

_FN = "fmha.flash_attn_with_kvcache"


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            sinks=None):
    """Attention of q over a KV cache, after appending k and v to it in place (FlashAttention-2's API).

    Args:
        q: (B, Sq, Hq, D), float16, bfloat16 or float32; any Sq >= 1 (decode, speculative
            decoding, chunked prefill).
        k_cache, v_cache: (B_cache, S_cache, Hkv, D), or (pages, page_size, Hkv, D) with
            ``block_table``; q's dtype, Hq % Hkv == 0.
        k, v: optional (B, S_new, Hkv, D): written into the cache at positions
            ``cache_seqlens[b] + t`` (only those rows change), then attended with the rest.
        rotary_cos, rotary_sin: optional (rows >= the cache's positions, R / 2), R <= D: rotary
            embedding of the new keys at positions ``cache_seqlens[b] + t`` and of the queries at
            ``cache_seqlens[b] + i`` when causal or windowed, else all at ``cache_seqlens[b]``;
            pairs (2i, 2i + 1) with ``rotary_interleaved``, else (i, i + R / 2). Needs k and v.
        cache_seqlens: int32 (B,) tensor or int: each sequence's cached length before the append.
            None: the whole cache (without k and v).
        cache_batch_idx: int32 (B,): the cache batch of each sequence (default b). Not with
            ``block_table``.
        cache_leftpad: int32 (B,): each sequence starts at this cache position (default 0).
        block_table: int32 (B, max_blocks): page of each sequence's positions
            [j * page_size, (j + 1) * page_size); any page size >= 1. Entries must name pages of
            the cache (not checked: that would need a sync).
        softmax_scale: default D ** -0.5.
        causal, window_size: bottom-right aligned to each sequence's keys after the append:
            query i sits at key position ``i + Sk_b - Sq`` with ``Sk_b = cache_seqlens[b] + S_new
            - leftpad_b``, and sees keys within ``window_size = (left, right)`` of it (-1:
            unbounded); causal sets right = 0.
        softcap: > 0 caps each scaled score at ``softcap * tanh(s / softcap)`` (0.0: off).
        alibi_slopes: float32 (Hq,) or (B, Hq): adds ``-slope * |i + Sk_b - Sq - j|`` to the scores.
        num_splits: chunks of the keys (split-KV); 0 lets a heuristic pick from B * Hkv, the
            cache's length and the GPU's multiprocessors; at most the key blocks and 65,535.
            More than 4,194,240 query rows per KV head ((Hq / Hkv) * Sq) raise NotImplementedError.
        return_softmax_lse: also return the natural-log LSE (B, Hq, Sq), float32.
        sinks: float32 (Hq,), learnable sinks (beyond FlashAttention-2's signature): each row's
            softmax denominator gets ``+ exp(sinks[h])``, as in ``fmha.attention``.

    Returns:
        out (B, Sq, Hq, D) in q's dtype, or ``(out, softmax_lse)``. A query that sees no key gets
        zeros and LSE -inf. Not differentiable (as FlashAttention's).

    Lengths and indices on the device are clamped into the cache: a length past the cache's end
    or a cache batch index outside it never reads or writes outside the cache.
    """
    if return_softmax_lse.__class__ is not bool:
        check_flag(_FN, "return_softmax_lse", return_softmax_lse)
    if torch.compiler.is_compiling():  # traced: the custom ops, whose fakes dynamo reads
        params = kvcache_params(_FN, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size,
                                softcap, rotary_interleaved, alibi_slopes, num_splits, sinks)
        on_device = params.seqlens_on_device
        if not on_device and cache_seqlens is not None:
            check_cache_seqlen(_FN, cache_seqlens, params)
        args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens if on_device else None,
                -1 if on_device or cache_seqlens is None else cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, softmax_scale, causal, *window_size, rotary_interleaved, num_splits,
                float(softcap), alibi_slopes, sinks)
        op = kvcache_ops.kvcache_attention if k is None else kvcache_ops.kvcache_append_attention
        out, lse = op(*args)
    else:
        forward = kvcache_ops.prepared(_FN, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                       cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                       window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, sinks)
        if forward.params.seqlens_on_device:
            lengths, cache_seqlen = cache_seqlens, 0
        else:
            lengths, cache_seqlen = None, check_cache_seqlen(_FN, cache_seqlens, forward.params)
        out, lse = forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, lengths, cache_seqlen, cache_batch_idx,
                           cache_leftpad, block_table, alibi_slopes, sinks)
    return (out, lse) if return_softmax_lse else out


def paged_varlen_attention(fn, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                           softmax_scale, causal, window_size, softcap, alibi_slopes):
    """Packed queries over a paged cache (``flash_attn_varlen_func`` with ``block_table``), in the
    kernel of :func:`flash_attn_with_kvcache`: ``(out (total_q, Hq, D), lse (Hq, total_q))``."""
    if torch.compiler.is_compiling():
        paged_varlen_params(fn, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                            softmax_scale, causal, window_size, softcap, alibi_slopes)
        return kvcache_ops.paged_varlen_attention(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                  block_table, softmax_scale, causal, *window_size, float(softcap),
                                                  alibi_slopes)
    return kvcache_ops.run_paged_varlen(fn, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                                        softmax_scale, causal, window_size, softcap, alibi_slopes)
