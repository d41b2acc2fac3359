"""Step 1 of the ladder: the math, checked in float64 before any kernel exists.

Two NumPy implementations of the same function:

* :func:`online_attention` walks K/V in blocks and keeps, per query row, a running
  max ``m``, a running sum ``l`` and an accumulator rescaled whenever ``m`` grows.
  It never holds the Sq x Sk matrix: this is the invariant the fused kernel relies on.
* :func:`direct_attention` materialises softmax(Q K^T * scale) V.

Shapes follow the library: q is (B, Hq, Sq, D), k and v are (B, Hkv, Sk, D) with
Hq % Hkv == 0. Which keys a row sees is :class:`fmha.masking.Window` (``window=``), or, for the
causal case, ``causal_offset``: query i sees key j iff j <= i + causal_offset
(:func:`causal_offset` gives it for both alignments).
Both functions return ``(out, lse)`` with the natural-log LSE of shape (B, Hq, Sq);
a row that sees no key gets zeros and LSE = -inf.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .masking import Window, window_of

__all__ = ["causal_offset", "online_attention", "direct_attention", "dense_attention", "rotary_embedding",
           "kvcache_sequences", "kvcache_attention", "paged_varlen_sequences"]


def causal_offset(seqlen_q: int, seqlen_k: int, alignment: str = "bottom_right") -> int:
    """Diagonal offset d such that query i sees key j iff j <= i + d.

    ``bottom_right`` is FlashAttention's convention (the last query sees the last key),
    ``top_left`` is PyTorch SDPA's ``is_causal`` (query i sees keys 0..i).
    """
    if alignment == "bottom_right":
        return seqlen_k - seqlen_q
    if alignment == "top_left":
        return 0
    raise ValueError(f"alignment must be 'bottom_right' or 'top_left', got {alignment!r}")


def _prepare(q, k, v, scale):
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k and v must be 4-D (B, H, S, D)")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"Hq={q.shape[1]} is not a multiple of Hkv={k.shape[1]}")
    group = q.shape[1] // k.shape[1]
    # GQA: query head h reads kv head h // group.
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return q, k, v, float(scale)


def _visible(seqlen_q: int, key_index: np.ndarray, window: Window | None) -> np.ndarray:
    """Boolean (Sq, len(key_index)) mask of the keys each query row may see."""
    if window is None:
        return np.ones((seqlen_q, key_index.size), dtype=bool)
    return window.visible(np.arange(seqlen_q), key_index)


def online_attention(q, k, v, *, scale=None, causal_offset=None, window: Window | None = None, block_n: int = 64):
    """Blockwise online-softmax attention in float64: holds at most Sq x block_n scores."""
    q, k, v, scale = _prepare(q, k, v, scale)
    window = window_of(causal_offset, window)
    batch, heads, seqlen_q, _ = q.shape
    seqlen_k = k.shape[2]
    running_max = np.full((batch, heads, seqlen_q), -np.inf)
    running_sum = np.zeros((batch, heads, seqlen_q))
    acc = np.zeros((batch, heads, seqlen_q, v.shape[-1]))
    for start in range(0, seqlen_k, block_n):
        keys = np.arange(start, min(start + block_n, seqlen_k))
        scores = np.einsum("bhqd,bhkd->bhqk", q, k[:, :, keys]) * scale  # [B, H, Sq, block_n]
        scores = np.where(_visible(seqlen_q, keys, window), scores, -np.inf)
        new_max = np.maximum(running_max, scores.max(axis=-1))
        # Rows that have seen nothing yet keep max = -inf; exp(-inf - 0) = 0 avoids inf - inf.
        safe_max = np.where(np.isneginf(new_max), 0.0, new_max)
        probs = np.exp(scores - safe_max[..., None])
        rescale = np.exp(running_max - safe_max)
        running_sum = running_sum * rescale + probs.sum(axis=-1)
        acc = acc * rescale[..., None] + np.einsum("bhqk,bhkd->bhqd", probs, v[:, :, keys])
        running_max = new_max
    return _finish(acc, running_max, running_sum)


def direct_attention(q, k, v, *, scale=None, causal_offset=None, window: Window | None = None):
    """softmax(Q K^T * scale) V in float64, materialising the full score matrix."""
    q, k, v, scale = _prepare(q, k, v, scale)
    window = window_of(causal_offset, window)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) * scale  # [B, H, Sq, Sk]
    scores = np.where(_visible(seqlen_q, np.arange(seqlen_k), window), scores, -np.inf)
    row_max = scores.max(axis=-1, initial=-np.inf)
    safe_max = np.where(np.isneginf(row_max), 0.0, row_max)
    probs = np.exp(scores - safe_max[..., None])
    return _finish(probs @ v, row_max, probs.sum(axis=-1))


def _finish(acc, row_max, row_sum):
    seen = row_sum > 0
    out = np.where(seen[..., None], acc / np.where(seen, row_sum, 1.0)[..., None], 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, row_max + np.log(np.where(seen, row_sum, 1.0)), -np.inf)
    return out, lse


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale=None,
                    causal_offset=None, window: Window | None = None, dtype=torch.float64,
                    max_score_elements=1 << 26, softcap=None, alibi_slopes=None, sinks=None, attn_mask=None,
                    dropout_p=0.0, keep=None):
    """The direct formula in torch, on the inputs' device, computed in ``dtype``.

    The float64 ground truth for GPU tests and the benchmark's correctness gate,
    where NumPy on the host would be too slow. Returns ``(out, lse)`` like the others.
    Query rows go in chunks of at most ``max_score_elements`` scores (512 MiB in float64),
    so that several test processes can share one GPU.

    Score features, in the design's order: ``softcap`` (float), ``alibi_slopes`` ((Hq,) or (B, Hq):
    ``-slope · |i + Sk - Sq - j|``), ``attn_mask`` (bool: True takes part; float: added; broadcast
    to (B, Hq, Sq, Sk)), the window, then the softmax with ``sinks`` ((Hq,): ``exp(sink)`` joins each
    row's denominator) and dropout: ``keep`` is the (B, Hq, Sq, Sk) bool pattern of kept entries,
    which are scaled by 1 / (1 - dropout_p). The LSE counts the sink and ignores dropout; a row that
    sees no key gets zeros and LSE -inf (with sinks too). Differentiable in q, k, v and sinks.
    """
    window = window_of(causal_offset, window)
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    batch, heads, seqlen_q, _ = q.shape
    seqlen_k = k.shape[2]
    if attn_mask is not None:
        attn_mask = attn_mask.expand(batch, heads, seqlen_q, seqlen_k)
    if keep is not None:
        keep = keep.expand(batch, heads, seqlen_q, seqlen_k)
    if alibi_slopes is not None:  # (B, H, 1, 1)
        slopes = alibi_slopes.to(dtype).expand(batch, heads)[:, :, None, None]
    rows_per_chunk = max(1, max_score_elements // max(1, batch * heads * seqlen_k))
    outs, lses = [], []
    for start in range(0, seqlen_q, rows_per_chunk):
        q_chunk = q[:, :, start:start + rows_per_chunk]
        chunk = slice(start, start + q_chunk.shape[2])
        rows = torch.arange(start, start + q_chunk.shape[2], device=q.device)
        keys = torch.arange(seqlen_k, device=q.device)
        scores = (q_chunk @ k.transpose(-1, -2)) * scale  # [B, H, chunk, Sk]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if alibi_slopes is not None:
            distance = (rows[:, None] + seqlen_k - seqlen_q - keys[None, :]).abs().to(dtype)
            scores = scores - slopes * distance
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask[:, :, chunk], float("-inf"))
            else:
                scores = scores + attn_mask[:, :, chunk].to(dtype)
        if window is not None:
            seen = window.visible(rows, keys)
            scores = scores.masked_fill(~seen, float("-inf"))
        sees_nothing = torch.isneginf(scores).all(dim=-1)
        if sinks is not None:
            sink_scores = sinks.to(dtype)[None, :, None, None].expand(batch, heads, q_chunk.shape[2], 1)
            lse = torch.logsumexp(torch.cat((scores, sink_scores), dim=-1), dim=-1)
        else:
            lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
        if keep is not None:
            probs = torch.where(keep[:, :, chunk], probs / (1.0 - dropout_p) if dropout_p < 1 else 0.0, 0.0)
        outs.append(probs @ v)
        lses.append(torch.where(sees_nothing, float("-inf"), lse))
    if not outs:  # Sq == 0
        return q.new_zeros(batch, heads, 0, v.shape[-1]), q.new_zeros(batch, heads, 0)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                     interleaved: bool) -> torch.Tensor:
    """``x`` (S, H, D) rotated at ``positions`` (S,) in float64: FlashAttention's rotary embedding.

    cos and sin are (rows, R / 2); the first R features rotate in pairs (2i, 2i + 1) when
    ``interleaved``, else (i, i + R / 2) (GPT-NeoX); the rest pass through.
    """
    half = cos.shape[1]
    cos = cos[positions].double()[:, None, :]  # (S, 1, R / 2)
    sin = sin[positions].double()[:, None, :]
    x = x.double()
    rotated, rest = x[..., :2 * half], x[..., 2 * half:]
    if interleaved:
        first, second = rotated[..., 0::2], rotated[..., 1::2]
        pairs = torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1)
        rotated = pairs.flatten(-2)
    else:
        first, second = rotated[..., :half], rotated[..., half:]
        rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return torch.cat((rotated, rest), dim=-1)


def kvcache_sequences(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                      cache_batch_idx=None, cache_leftpad=None, block_table=None, causal=False,
                      window_size=(-1, -1), rotary_interleaved=True):
    """What ``fmha.flash_attn_with_kvcache`` attends, spelled out one sequence at a time.

    Returns ``(k_cache, v_cache, sequences)``: copies of the caches after the append, and per
    sequence ``(q, k, v, window)``: q (1, Hq, Sq, D) after rotary, k and v (1, Hkv, Sk_b, D) read
    from the cache, in the inputs' dtype (rotated values rounded to it, as stored), and the
    :class:`Window` of its keys. Sequence b holds cache positions [leftpad_b, cache_seqlens_b + S_new);
    query i sits at key position i + Sk_b - Sq.
    """
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    device = k_cache.device
    batch, seqlen_q = q.shape[:2]
    new_keys = 0 if k is None else k.shape[1]
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if block_table is not None else k_cache.shape[1]
    if cache_seqlens is None:
        cached = [capacity] * batch
    elif isinstance(cache_seqlens, int):
        cached = [cache_seqlens] * batch
    else:
        cached = cache_seqlens.tolist()
    left, right = (None if side == -1 else side for side in window_size)
    if causal:
        right = 0
    left = None if left is not None and left >= capacity else left
    right = None if right is not None and right >= capacity else right

    def slots(b, positions):
        if block_table is not None:
            return block_table[b].long()[positions // page_size], positions % page_size
        cache_b = b if cache_batch_idx is None else int(cache_batch_idx[b])
        return torch.full_like(positions, cache_b), positions

    sequences = []
    for b in range(batch):
        if k is not None:
            positions = torch.arange(cached[b], cached[b] + new_keys, device=device)
            k_new = k[b] if rotary_cos is None else rotary_embedding(k[b], rotary_cos, rotary_sin, positions,
                                                                     rotary_interleaved)
            major, minor = slots(b, positions)
            k_cache[major, minor] = k_new.to(k_cache.dtype)
            v_cache[major, minor] = v[b]
        q_b = q[b]
        if rotary_cos is not None:
            rows = torch.arange(seqlen_q, device=device)
            if left is None and right is None:  # FlashAttention puts every query at cache_seqlens
                rows = torch.zeros_like(rows)
            q_b = rotary_embedding(q_b, rotary_cos, rotary_sin, cached[b] + rows, rotary_interleaved).to(q.dtype)
        leftpad = 0 if cache_leftpad is None else int(cache_leftpad[b])
        major, minor = slots(b, torch.arange(leftpad, cached[b] + new_keys, device=device))
        keys, values = k_cache[major, minor], v_cache[major, minor]
        window = Window(keys.shape[0] - seqlen_q, left, right)
        sequences.append((q_b.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], window))
    return k_cache, v_cache, sequences


def kvcache_attention(q, k_cache, v_cache, *, softmax_scale=None, **kwargs):
    """The float64 truth of ``fmha.flash_attn_with_kvcache``: ``(out (B, Sq, Hq, D), lse (B, Hq, Sq),
    k_cache, v_cache)``, the caches after the append (copies). Keyword arguments as
    :func:`kvcache_sequences`."""
    k_cache, v_cache, sequences = kvcache_sequences(q, k_cache, v_cache, **kwargs)
    outs, lses = [], []
    for q_b, k_b, v_b, window in sequences:
        out, lse = dense_attention(q_b, k_b, v_b, scale=softmax_scale, window=window)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses), k_cache, v_cache


def paged_varlen_sequences(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, causal=False,
                           window_size=(-1, -1)):
    """What ``fmha.flash_attn_varlen_func`` with ``block_table`` attends, one sequence at a time:
    ``(q, k, v, window)`` per sequence, q (1, Hq, Sq_b, D) from the packed rows, k and v (1, Hkv,
    Sk_b, D) gathered from the pages of its block table row, ``Sk_b = cu_seqlens_k[b + 1] -
    cu_seqlens_k[b]``; query i sits at key position i + Sk_b - Sq_b."""
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size
    left, right = (None if side == -1 else side for side in window_size)
    if causal:
        right = 0
    left = None if left is not None and left >= capacity else left
    right = None if right is not None and right >= capacity else right
    starts, ends = cu_seqlens_q.tolist(), cu_seqlens_k.diff().tolist()
    sequences = []
    for b, seqlen_k in enumerate(ends):
        positions = torch.arange(seqlen_k, device=k_cache.device)
        pages, rows = block_table[b].long()[positions // page_size], positions % page_size
        q_b = q[starts[b]:starts[b + 1]].transpose(0, 1)[None]
        keys, values = (cache[pages, rows].transpose(0, 1)[None] for cache in (k_cache, v_cache))
        sequences.append((q_b, keys, values, Window(seqlen_k - q_b.shape[2], left, right)))
    return sequences
