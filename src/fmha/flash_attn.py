"""FlashAttention-2's functions with its signatures and (B, S, H, D) layout, over :func:`fmha.attention`.

Code written for ``flash_attn`` runs unchanged: ``from fmha import flash_attn_func``. The tensors
are viewed as (B, H, S, D) without copies, and the output comes back in q's layout.
``window_size=(-1, -1)`` is unbounded; ``causal=True`` sets the right side to 0. The varlen
functions take packed sequences (THD layout, int32 ``cu_seqlens``) through
:func:`fmha.api.varlen_attention`, indexing the packed tensors directly.
"""

from __future__ import annotations

import torch

from .api import attention, packed_attention
from .kvcache import paged_varlen_attention
from .params import check_dropout, check_flag, check_flash_options, flash_window


def _check_bshd(fn: str, **tensors) -> None:
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.ndim != 4:
            raise ValueError(f"{fn}: {name} must be 4-D (batch, seqlen, heads, head_dim), "
                             f"got shape {tuple(tensor.shape)}")


def _flash(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
           return_attn_probs):
    _check_bshd(fn, q=q, k=k, v=v)
    softcap = check_flash_options(fn, softmax_scale, return_attn_probs, softcap)
    try:
        out, lse = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                             scale=softmax_scale, window=flash_window(fn, window_size), softcap=softcap,
                             alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic,
                             return_lse=True)
    except (TypeError, ValueError, NotImplementedError) as error:
        # attention's checks name attention: renamed here for the function the caller called, as
        # passing the name in would cost every attention call a wrapper (about 0.15 us)
        message = str(error)
        if not message.startswith("fmha.attention: "):
            raise
        raise type(error)(fn + message[len("fmha.attention"):]) from None
    out = out.transpose(1, 2)
    # FlashAttention returns (out, softmax_lse, S_dmask); S_dmask, a testing aid holding the
    # dropout pattern, is never materialised here (the bits live only in the kernels): None.
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention-2's ``flash_attn_func``: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), Hq % Hkv == 0.

    FlashAttention-2's semantics: ``softcap`` > 0 caps each scaled score at ``softcap * tanh(s /
    softcap)`` (0.0: off); ``alibi_slopes`` (Hq,) or (B, Hq) float32 add ``-slope * |i + Sk - Sq - j|``;
    ``dropout_p`` drops entries of P (kept ones scaled by 1 / (1 - p)) with bits drawn from torch's
    default generator of the device (``fmha.attention`` takes a ``generator``).

    v may have a head dim of its own, Dv, as FlashAttention-3 allows (DeepSeek's MLA: D = 192, Dv = 128).

    Returns out (B, Sq, Hq, Dv), or ``(out, softmax_lse, None)`` with ``return_attn_probs=True``:
    softmax_lse is (B, Hq, Sq) float32 in natural log; the third item, FlashAttention's ``S_dmask``
    (a testing aid holding the dropout pattern), is None: the pattern never exists in memory.
    """
    return _flash("fmha.flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_qkvpacked_func``: qkv (B, S, 3, H, D); as :func:`flash_attn_func` otherwise."""
    fn = "fmha.flash_attn_qkvpacked_func"
    if not isinstance(qkv, torch.Tensor) or qkv.ndim != 5 or qkv.shape[2] != 3:
        raise ValueError(f"{fn}: qkv must be a (batch, seqlen, 3, heads, head_dim) tensor, "
                         f"got {tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    q, k, v = qkv.unbind(2)
    return _flash(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_kvpacked_func``: q (B, Sq, Hq, D), kv (B, Sk, 2, Hkv, D); as :func:`flash_attn_func`."""
    fn = "fmha.flash_attn_kvpacked_func"
    if not isinstance(kv, torch.Tensor) or kv.ndim != 5 or kv.shape[2] != 2:
        raise ValueError(f"{fn}: kv must be a (batch, seqlen, 2, heads, head_dim) tensor, "
                         f"got {tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
    k, v = kv.unbind(2)
    return _flash(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs)


def _flash_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs):
    softcap = check_flash_options(fn, softmax_scale, return_attn_probs, softcap)
    out, lse = packed_attention(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                scale=softmax_scale, window=flash_window(fn, window_size), softcap=softcap,
                                alibi_slopes=alibi_slopes, dropout_p=dropout_p, return_lse=True,
                                deterministic=deterministic)
    return (out, lse, None) if return_attn_probs else out


def _paged_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table):
    if deterministic.__class__ is not bool or return_attn_probs.__class__ is not bool:  # the checks say why
        check_flag(fn, "deterministic", deterministic)
        check_flag(fn, "return_attn_probs", return_attn_probs)
    if dropout_p.__class__ is not float or dropout_p != 0.0:
        if check_dropout(fn, dropout_p) > 0.0:
            raise NotImplementedError(f"{fn}: dropout_p > 0 with block_table: attention over a paged cache is "
                                      "forward only (inference), as in FlashAttention")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        raise NotImplementedError(f"{fn}: gradients through block_table (a paged cache) are not supported, as in "
                                  "FlashAttention; call it under torch.no_grad() or on tensors that do not "
                                  "require grad")
    out, lse = paged_varlen_attention(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                                      softmax_scale, causal, window_size, softcap, alibi_slopes)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """``flash_attn_varlen_func``: packed sequences in the THD layout.

    q is (total_q, Hq, D), k and v (total_k, Hkv, D); sequence b is rows
    ``cu_seqlens[b]:cu_seqlens[b + 1]`` (int32, batch + 1 entries). Causal, window_size and ALiBi
    are per sequence, bottom-right aligned; softcap, alibi_slopes ((Hq,) or (B, Hq)) and dropout_p as
    in :func:`flash_attn_func`. Returns out (total_q, Hq, D), or ``(out, softmax_lse, None)``
    with ``return_attn_probs=True``: softmax_lse is (Hq, total_q) float32, as in FlashAttention-2.

    ``block_table`` (int32 (B, max_blocks)) reads the keys from a paged cache, as
    FlashAttention-2 does: k and v are then (pages, page_size, Hkv, D), any page size >= 1, and
    sequence b's keys are its first ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` positions in the
    pages its row names (lengths past the table are clamped to it). That call is forward only
    (no dropout, no gradients), and runs in :func:`fmha.flash_attn_with_kvcache`'s kernel.
    ``max_seqlen_q`` sizes its grid: as in FlashAttention it must be at least the longest query
    sequence (the lengths live on the device, so that is not checked); rows past it come out NaN.
    """
    fn = "fmha.flash_attn_varlen_func"
    if block_table is not None:
        return _paged_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, dropout_p, softmax_scale,
                             causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table)
    return _flash_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                         softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """``flash_attn_varlen_qkvpacked_func``: qkv (total, 3, H, D); as :func:`flash_attn_varlen_func`."""
    fn = "fmha.flash_attn_varlen_qkvpacked_func"
    if not isinstance(qkv, torch.Tensor) or qkv.ndim != 4 or qkv.shape[1] != 3:
        raise ValueError(f"{fn}: qkv must be a (total_tokens, 3, heads, head_dim) tensor, "
                         f"got {tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    q, k, v = qkv.unbind(1)
    return _flash_varlen(fn, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                         causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_varlen_kvpacked_func``: kv (total_k, 2, Hkv, D); as :func:`flash_attn_varlen_func`."""
    fn = "fmha.flash_attn_varlen_kvpacked_func"
    if not isinstance(kv, torch.Tensor) or kv.ndim != 4 or kv.shape[1] != 2:
        raise ValueError(f"{fn}: kv must be a (total_tokens, 2, heads, head_dim) tensor, "
                         f"got {tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
    k, v = kv.unbind(1)
    return _flash_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                         softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
