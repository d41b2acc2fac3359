"""FlashAttention-2's functions with its signatures and (B, S, H, D) layout, over :func:`fmha.attention`.

Code written for ``flash_attn`` runs unchanged: ``from fmha import flash_attn_func``. The tensors
are viewed as (B, H, S, D) without copies, and the output comes back in q's layout.
``window_size=(-1, -1)`` is unbounded; ``causal=True`` sets the right side to 0. The varlen
functions (packed sequences) are not built yet and raise ``NotImplementedError``.
"""

from __future__ import annotations

import torch

from .api import attention


def _window(fn: str, window_size) -> tuple[int | None, int | None] | None:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"{fn}: window_size must be a (left, right) pair, got {window_size!r}")
    sides = []
    for name, side in zip(("left", "right"), window_size):
        if isinstance(side, bool) or not isinstance(side, int) or side < -1:
            raise ValueError(f"{fn}: window_size's {name} side must be an int >= -1 (-1: unbounded), got {side!r}")
        sides.append(None if side == -1 else side)
    return None if sides == [None, None] else (sides[0], sides[1])


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
    softcap = None if softcap == 0.0 else softcap
    out, lse = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                         scale=softmax_scale, window=_window(fn, window_size), softcap=softcap,
                         alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic,
                         return_lse=True)
    out = out.transpose(1, 2)
    # FlashAttention returns (out, softmax_lse, S_dmask); S_dmask holds the dropout pattern only
    # when dropout is on, which fmha does not build yet: None.
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention-2's ``flash_attn_func``: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), Hq % Hkv == 0.

    Returns out (B, Sq, Hq, D), or ``(out, softmax_lse, None)`` with ``return_attn_probs=True``:
    softmax_lse is (B, Hq, Sq) float32 in natural log; the third item, FlashAttention's dropout
    pattern ``S_dmask``, is None (no dropout yet). ``softcap`` and ``alibi_slopes`` other than
    their defaults and ``dropout_p > 0`` raise ``NotImplementedError`` for now.
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


def _varlen_not_built(fn: str):
    raise NotImplementedError(f"{fn}: packed variable-length sequences (cu_seqlens) are not supported yet")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """``flash_attn_varlen_func`` (THD layout, int32 ``cu_seqlens``): not built yet."""
    _varlen_not_built("fmha.flash_attn_varlen_func")


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """``flash_attn_varlen_qkvpacked_func``: not built yet."""
    _varlen_not_built("fmha.flash_attn_varlen_qkvpacked_func")


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_varlen_kvpacked_func``: not built yet."""
    _varlen_not_built("fmha.flash_attn_varlen_kvpacked_func")
