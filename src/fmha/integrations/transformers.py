"""fmha as a Hugging Face transformers attention implementation: ``attn_implementation="fmha"``.

    import fmha.integrations.transformers      # registers "fmha" (transformers 5)
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fmha")

Importing this module registers two functions under the name "fmha":

* :func:`fmha_mask` with transformers' ``AttentionMaskInterface``: it turns the causal mask a
  model asks for (a 2-D padding mask, the cache's offsets) into what fmha's kernels take.
* :func:`fmha_attention_forward` with its ``AttentionInterface``: the attention itself.

What the attention runs, by the mask it receives:

* ``None``: no padding, the queries are the last Sq keys. :func:`fmha.attention` with the module's
  ``is_causal`` (bottom-right aligned, as FlashAttention: prefill, or decode over a DynamicCache),
  GQA as is, ``sliding_window`` as a left window; differentiable.
* A *lengths mask* (:func:`lengths_mask`, int32 (B, 1, 1, 2 or 3)): per sequence, the run of real
  keys ``[first, stop)``, and where the queries end.
  - Left padding (the queries end at ``stop``): :func:`fmha.flash_attn_with_kvcache` with
    ``cache_leftpad`` and ``cache_seqlens`` read on the device: prefill and decode, DynamicCache
    and StaticCache (whose slots past the end are never read), no host sync, so a StaticCache
    decode step compiles and can be captured in a CUDA graph. A padded query row sees no key and
    gets zeros, as under SDPA.
  - Without a cache (the queries are the keys), with right padding or with gradients: the runs
    packed into :func:`fmha.varlen_attention` (differentiable; padded rows get zeros).
* Any other mask (a 4-D bool or float mask: holes in the padding, right padding with a cache,
  chunked or packed sequences, mask overlays, a user's custom mask): torch's SDPA with that mask,
  and a warning naming the reason once. So are calls fmha cannot run (attention dropout,
  gradients through a padded cache).

Sliding-window layers (Mistral, Gemma 2, gpt-oss) take the same paths: their causal mask with a
window becomes the same None or lengths mask, counted from the first key a sliding-window cache
still holds, and the window is the model's ``sliding_window`` argument, a left window of
``sliding_window - 1`` keys (as transformers' FlashAttention integration reads it).

Gemma 2's ``softcap`` and gpt-oss's attention sinks (``s_aux``, one logit per query head) go to
fmha's kernels on every path above; where the call would fall back to SDPA, which cannot run
them, it raises ``NotImplementedError`` instead.

The mask function returns a lengths mask only for transformers' plain or sliding-window causal
mask whose padding it has checked, a host sync per forward pass (transformers' own SDPA masks
sync there too).
Under ``torch.compile`` or tracing a padding mask cannot be checked, so it returns transformers'
SDPA mask (the fallback) instead; ``generate`` with a StaticCache builds its masks outside the
compiled forward, so compiled decode steps still run fmha.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import (
    AttentionMaskInterface,
    and_masks,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
    sliding_window_overlay,
)
from transformers.utils.import_utils import is_tracing

from ..api import attention, varlen_attention
from ..kvcache import flash_attn_with_kvcache

NAME = "fmha"

_warned: set[str] = set()
GENERAL_MASK = "a 4-D attention mask (one fmha's lengths cannot express)"


def _note_fallback(reason: str) -> None:
    """Warn once per reason that torch SDPA runs a call (not while compiling: dynamo would trace it)."""
    if reason not in _warned and not torch.compiler.is_compiling():
        _warned.add(reason)
        warnings.warn(f"fmha (transformers): {reason}; torch's scaled_dot_product_attention runs these calls",
                      stacklevel=3)


def lengths_mask(first: torch.Tensor, stop: torch.Tensor, end: torch.Tensor | None = None) -> torch.Tensor:
    """The masks fmha's attention reads as lengths, int32 (B, 1, 1, 2) or (B, 1, 1, 3): per
    sequence, its real keys are the run ``[first, stop)``, and the queries are the last Sq key
    positions before ``end`` (``[..., 2]``; without it ``end = stop``: no right padding). Built
    over a (2 or 3, B) tensor, so that each column is contiguous: the kernels read (B,) arrays."""
    rows = torch.stack([first, stop] if end is None else [first, stop, end]).to(torch.int32)
    return rows.t()[:, None, None, :]


def is_lengths_mask(mask) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dtype == torch.int32 and mask.ndim == 4 and \
        mask.shape[1:3] == (1, 1) and mask.shape[3] in (2, 3)


def _bounds(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(first, stop, end)`` of a lengths mask, each (B,) int32 and contiguous."""
    first, stop = mask[:, 0, 0, 0].contiguous(), mask[:, 0, 0, 1].contiguous()
    return first, stop, (mask[:, 0, 0, 2].contiguous() if mask.shape[3] == 3 else stop)


# transformers' sliding-window causal mask function is and_masks(sliding_window_overlay(w),
# causal_mask_function): closures of these two code objects.
_AND_MASKS_CODE = and_masks(causal_mask_function).__code__
_SLIDING_OVERLAY_CODE = sliding_window_overlay(1).__code__


def _closure_value(function, name: str):
    code = getattr(function, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    return function.__closure__[code.co_freevars.index(name)].cell_contents


def sliding_window_of(mask_function) -> int | None:
    """The window w of transformers' sliding-window causal mask function (query q sees keys
    q - w < k <= q), or None for any other function."""
    if getattr(mask_function, "__code__", None) is not _AND_MASKS_CODE:
        return None
    parts = _closure_value(mask_function, "mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not causal_mask_function:
        return None
    if getattr(parts[0], "__code__", None) is not _SLIDING_OVERLAY_CODE:
        return None
    window = _closure_value(parts[0], "sliding_window")
    return window if isinstance(window, int) and not isinstance(window, bool) and window >= 1 else None


def fmha_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
              mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None, device="cpu",
              **kwargs):
    """transformers' mask function for "fmha" (AttentionMaskInterface): None, a lengths mask, or
    (for what lengths cannot say) transformers' 4-D boolean SDPA mask.

    A lengths mask needs each sequence's real keys to be one run. It ends where the queries end
    (left padding), except without a cache (the queries are the keys), where it may end earlier
    (right padding: the attention then packs the sequences, as FlashAttention's varlen).

    A sliding-window causal mask gives the same masks: the window itself reaches the attention as
    the model's ``sliding_window`` argument (as it reaches FlashAttention's integration), and
    mask positions count from the first key the cache still holds (``kv_offset``)."""
    reason = None
    sliding = mask_function is not causal_mask_function and sliding_window_of(mask_function) is not None
    if mask_function is not causal_mask_function and not sliding:
        reason = "the mask is not plain or sliding-window causal (chunks, packed sequences or a mask overlay)"
    elif not isinstance(kv_offset, int) or kv_offset < 0 or (kv_offset and not sliding):
        reason = "the keys start past position 0 without a sliding window"
    elif attention_mask is not None and is_tracing(attention_mask):
        reason = "a padding mask under torch.compile or tracing cannot be checked"
    if reason is not None:
        return _sdpa_mask(reason, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                          attention_mask, device, kwargs)

    # The queries are key positions [end - q_length, end) of the keys the layer holds, the first
    # of which is position kv_offset; a StaticCache's slots past the end are empty.
    end = q_offset + q_length - kv_offset
    if attention_mask is None:
        if isinstance(end, int) and end == kv_length:
            return None
        first = torch.zeros(batch_size, dtype=torch.int32, device=device)
        return lengths_mask(first, first + end)

    positions = torch.arange(kv_length, device=device)
    inside = positions < end
    keys = prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset:kv_offset + kv_length]
    keys = keys.to(device=device, dtype=torch.bool)
    keys = keys & inside
    count = keys.sum(-1)
    first = torch.where(count > 0, keys.int().argmax(-1), end)  # argmax: the first True
    stop = first + count
    one_run = keys == ((positions >= first[:, None]) & (positions < stop[:, None]))
    # The one host sync: one run per row? ending at the queries' end? no padding at all?
    one_run, left_padded, unpadded = torch.stack([one_run.all(), (stop == end).all(), (count == end).all()]).tolist()
    if not one_run:
        reason = "the padding mask has holes (real tokens on both sides of padding)"
    elif not left_padded and not (isinstance(q_offset, int) and q_offset == 0 and kv_length == q_length):
        reason = "right padding with a cache"
    if reason is not None:
        return _sdpa_mask(reason, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                          attention_mask, device, kwargs)
    if unpadded and isinstance(end, int) and end == kv_length:
        return None
    # Right padding (no cache): [first, stop, end], end = Sq.
    return lengths_mask(first, stop, None if left_padded else torch.full_like(first, end))


def _sdpa_mask(reason, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, device,
               kwargs):
    """transformers' SDPA mask, always materialised (a None would read as "no mask" here)."""
    _note_fallback(reason)
    _warned.add(GENERAL_MASK)  # the attention's own note would only repeat this one
    kwargs = dict(kwargs, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, device=device,
                     **kwargs)


def fmha_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                           sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers' attention function for "fmha": query (B, Hq, Sq, D), key and value
    (B, Hkv, Sk, D), GQA when Hq > Hkv. Returns ``(attn_output (B, Sq, Hq, D), None)``."""
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("fmha (transformers): position_bias is not supported; use attn_implementation='eager'")
    softcap = softcap or None  # transformers' 0.0 / None: off
    sinks = kwargs.get("s_aux")
    if sinks is not None:  # one logit per query head, in the model's dtype; fmha takes float32 (differentiable)
        sinks = sinks.reshape(-1).float()
    scores = dict(softcap=softcap, sinks=sinks)
    left = None if sliding_window is None else sliding_window - 1
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]

    if dropout > 0.0:
        reason = "attention dropout"
    elif attention_mask is None:
        out = attention(query, key, value, causal=bool(is_causal), scale=scaling,
                        window=None if left is None else (left, None), **scores)
        return out.transpose(1, 2), None
    elif not is_lengths_mask(attention_mask):
        reason = GENERAL_MASK
    elif attention_mask.shape[3] == 3 or (needs_grad and seqlen_q == seqlen_k):
        # No cache: the queries are the keys. Pack each sequence's run (differentiable).
        first, stop, _ = _bounds(attention_mask)
        return _packed(query, key, value, first, stop, scaling, left, scores), None
    elif needs_grad:
        reason = "gradients through a padded cache (flash_attn_with_kvcache is inference only)"
    else:
        first, end, _ = _bounds(attention_mask)
        # (B, H, S, D) -> FlashAttention's (B, S, H, D): views, any strides.
        out = flash_attn_with_kvcache(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                      cache_seqlens=end, cache_leftpad=first, softmax_scale=scaling, causal=True,
                                      window_size=(-1 if left is None else left, -1), softcap=softcap or 0.0,
                                      sinks=sinks)
        return out, None
    if softcap or sinks is not None:
        what = " and ".join(name for name, value in scores.items() if value is not None)
        raise NotImplementedError(f"fmha (transformers): {what} with {reason}: torch's SDPA, the fallback, cannot "
                                  "run them; use attn_implementation='eager'")
    _note_fallback(reason)
    return _sdpa(query, key, value, attention_mask, scaling, dropout, bool(is_causal), left), None


def _packed(query, key, value, first, stop, scale, left, scores):
    """Causal attention of each sequence's run of tokens ``[first, stop)`` (queries and keys at
    the same positions) through fmha.varlen_attention; padded rows get zeros. Two host syncs
    (the packed sizes), as FlashAttention's unpadding."""
    batch, q_heads, seqlen, _ = query.shape
    positions = torch.arange(seqlen, device=query.device)
    real = ((positions >= first[:, None]) & (positions < stop[:, None])).flatten()
    index = real.nonzero().squeeze(1)
    lengths = (stop - first).clamp(min=0)
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths.max())

    def packed(x):  # (B, H, S, D) -> (tokens, H, D)
        return x.transpose(1, 2).reshape(batch * seqlen, x.shape[1], x.shape[3]).index_select(0, index)

    out = varlen_attention(packed(query), packed(key), packed(value), cu_seqlens, cu_seqlens, longest, longest,
                           causal=True, scale=scale, window=None if left is None else (left, None), **scores)
    head_dim_v = out.shape[-1]  # v's head dim, which may differ from q's
    full = out.new_zeros(batch * seqlen, q_heads, head_dim_v).index_copy(0, index, out)
    return full.view(batch, seqlen, q_heads, head_dim_v)


def _sdpa(query, key, value, mask, scale, dropout, is_causal, left):
    """torch SDPA with fmha's meaning of each mask: None and lengths masks bottom-right aligned."""
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    if mask is None or is_lengths_mask(mask):
        if mask is None:
            first = torch.zeros(1, device=query.device, dtype=torch.int32)
            stop = end = first + seqlen_k
        else:
            first, stop, end = _bounds(mask)
        keys = torch.arange(seqlen_k, device=query.device)
        # Query i sits at key position i + end - Sq.
        position = (torch.arange(seqlen_q, device=query.device)[None, :] + (end - seqlen_q)[:, None])[:, :, None]
        visible = (keys >= first[:, None, None]) & (keys < stop[:, None, None])
        if is_causal:
            visible &= keys <= position
        if left is not None:
            visible &= keys >= position - left
        mask = visible[:, None]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale,
                                          enable_gqa=query.shape[1] != key.shape[1]).transpose(1, 2)

def register() -> None:
    """Register "fmha" with transformers' attention and mask interfaces (done on import)."""
    AttentionInterface.register(NAME, fmha_attention_forward)
    AttentionMaskInterface.register(NAME, fmha_mask)


register()
