"""Public entry points: argument checks, layout handling and dispatch.

Supported
---------
* ``attention(q, k, v, *, causal=False, scale=None, return_lse=False)``:
  q is (B, Hq, Sq, D), k and v are (B, Hkv, Sk, D), Hq % Hkv == 0 (MHA, GQA, MQA).
* Any strides, including ``x.transpose(1, 2)`` of a BSHD tensor and stride 0 from
  ``expand``; nothing is copied. The output has q's memory layout when q is dense.
* ``causal=True`` is bottom-right aligned as in FlashAttention: query i sees keys
  j <= i + Sk - Sq. A row that sees no key returns zeros and LSE = -inf.
* ``scaled_dot_product_attention`` mirrors ``torch.nn.functional.scaled_dot_product_attention``
  (top-left ``is_causal``, ``enable_gqa``, 3-D or higher inputs).
* ``naive_attention``: the materialising baseline, same contract as ``attention``.
* dtypes float16 and bfloat16; float32 as a slow exact path.
* Head dims 1 to 256, including non-powers of two (40, 80, 96, 192...).
* Any Sq, Sk >= 1; empty batch, heads or sequences return empty (or zero) results.
* CUDA tensors, and CPU tensors when ``TRITON_INTERPRET=1`` was set before import
  (the same Triton kernels, run by Triton's interpreter).
* ``return_lse``: natural-log log-sum-exp, float32, shape (B, Hq, Sq); not differentiable.
* Backward: ``attention`` and ``scaled_dot_product_attention`` are differentiable in q, k
  and v (every case above). Gradients are deterministic: no atomics are used.
* ``torch.compile(fullgraph=True)``: the ops are ``torch.library`` custom ops (``fmha::forward``,
  ``fmha::backward``) with fake implementations.
* Kernels: on Hopper (sm_90), fp16/bf16 forwards with D = 64 or 128 of at least 2^32 FLOPs run a
  warp-specialised Gluon kernel (``fmha.kernels.forward_hopper``; at D = 64 with a causal mask
  only from 1k queries, below which it was not measured against the portable kernel); every
  other call, and every other GPU,
  runs the portable Triton kernel with tuned tiles. Both give the same results within the
  error rule.

Not yet supported (raise ``NotImplementedError``)
-------------------------------------------------
* Gradients of ``naive_attention`` (a forward-only baseline).
* SDPA ``attn_mask``, ``dropout_p > 0``, a value head dim different from the query's,
  and batch dims that differ between query and key/value (broadcasting).
* Varlen, KV-cache decode, sliding windows, softcap, ALiBi, dropout, FP8.
"""

from __future__ import annotations

import math
import numbers

import torch

from .autograd import differentiable_forward
from .config import ForwardConfig
from .launch import INTERPRETED, default_scale
from .ops import run_forward

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def _valid_qkv(q, k, v) -> bool:
    """The common case in one pass (the detailed checks below only run when this fails)."""
    if not (type(q) is type(k) is type(v) is torch.Tensor):
        return False
    dtype = q.dtype
    if k.dtype is not dtype or v.dtype is not dtype or dtype not in SUPPORTED_DTYPES:
        return False
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    if not (len(q_shape) == len(k_shape) == len(v_shape) == 4) or k_shape != v_shape:
        return False
    batch, q_heads, _, head_dim = q_shape
    kv_heads = k_shape[1]
    if k_shape[0] != batch or k_shape[3] != head_dim or not 1 <= head_dim <= MAX_HEAD_DIM:
        return False
    if not kv_heads or q_heads % kv_heads:
        return False
    device = q.device
    if device.type != "cuda" and not INTERPRETED:
        return False
    return k.device == device and v.device == device


def _check_qkv(fn: str, q, k, v, names=("q", "k", "v")) -> None:
    """Raise TypeError/ValueError naming the argument; runs before any launch."""
    if _valid_qkv(q, k, v):
        return
    for name, tensor in zip(names, (q, k, v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: {name} has dtype {tensor.dtype}; supported dtypes are "
                            "torch.float16, torch.bfloat16 and torch.float32")
        if tensor.ndim != 4:
            raise ValueError(f"{fn}: {name} must be 4-D (batch, heads, seqlen, head_dim), "
                             f"got {tensor.ndim}-D with shape {tuple(tensor.shape)}")
    qn, kn, vn = names
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: {qn}, {kn} and {vn} must have the same dtype, "
                        f"got {q.dtype}, {k.dtype} and {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: {qn}, {kn} and {vn} must be on the same device, "
                         f"got {q.device}, {k.device} and {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"{fn}: batch sizes differ: {qn} has {q.shape[0]}, {kn} {k.shape[0]}, {vn} {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"{fn}: {kn} and {vn} must have the same number of heads, got {k.shape[1]} and {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{fn}: {kn} and {vn} must have the same sequence length, "
                         f"got {k.shape[2]} and {v.shape[2]}")
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_kv_heads == 0 and num_q_heads != 0 or num_kv_heads and num_q_heads % num_kv_heads:
        raise ValueError(f"{fn}: the number of query heads ({num_q_heads}, in {qn}) must be a multiple "
                         f"of the number of key/value heads ({num_kv_heads}, in {kn})")
    head_dim = q.shape[3]
    if k.shape[3] != head_dim or v.shape[3] != head_dim:
        raise ValueError(f"{fn}: head dim mismatch: {qn} has {head_dim}, {kn} {k.shape[3]}, {vn} {v.shape[3]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{fn}: head dim (last dim of {qn}) must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    if q.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(f"{fn}: {qn} is a CPU tensor, and fmha's kernels run on the GPU. To run them on "
                           "the CPU through Triton's interpreter, set TRITON_INTERPRET=1 before importing "
                           "triton or fmha.")


def _check_scale(fn: str, scale, head_dim: int) -> float:
    if scale is None:
        return default_scale(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{fn}: scale must be a real number or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"{fn}: scale must be finite, got {scale}")
    return float(scale)


def _check_flag(fn: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be a bool, got {type(value).__name__}")
    return value


def _needs_autograd_op(q, k, v) -> bool:
    """The custom op (differentiable, traceable) when grads or compilation need it; else launch directly."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return True
    return torch.compiler.is_compiling()


def _forward(q, k, v, *, causal_offset, scale, config):
    if _needs_autograd_op(q, k, v):
        return differentiable_forward(q, k, v, causal_offset=causal_offset, scale=scale, config=config)
    return run_forward(q, k, v, causal_offset=causal_offset, scale=scale, config=config)


def attention(q, k, v, *, causal=False, scale=None, return_lse=False, deterministic=False,
              config: ForwardConfig | None = None):
    """Exact fused attention softmax(q k^T * scale) v.

    Args:
        q: (B, Hq, Sq, D) float16, bfloat16 or float32, any strides.
        k, v: (B, Hkv, Sk, D), same dtype and device, Hq % Hkv == 0.
        causal: bottom-right aligned causal mask (query i sees keys j <= i + Sk - Sq).
        scale: score scale, default D**-0.5.
        return_lse: also return the natural-log LSE, float32 (B, Hq, Sq); not differentiable.
        deterministic: require bitwise-reproducible gradients. Accepted for FlashAttention
            compatibility; the backward never uses atomics, so gradients are reproducible either way.
        config: an explicit tile config; default: the tuned one for this GPU and shape (the
            on-disk cache, then the shipped defaults), else a heuristic. See :mod:`fmha.tuning`.

    Returns:
        out (B, Hq, Sq, D) in q's dtype, or ``(out, lse)`` when ``return_lse``.
    """
    fn = "fmha.attention"
    _check_qkv(fn, q, k, v)
    causal = _check_flag(fn, "causal", causal)
    _check_flag(fn, "return_lse", return_lse)
    _check_flag(fn, "deterministic", deterministic)
    scale = _check_scale(fn, scale, q.shape[3])
    if config is not None and not isinstance(config, ForwardConfig):
        raise TypeError(f"{fn}: config must be a fmha.ForwardConfig or None, got {type(config).__name__}")
    offset = k.shape[2] - q.shape[2] if causal else None
    out, lse = _forward(q, k, v, causal_offset=offset, scale=scale, config=config)
    return (out, lse) if return_lse else out


def naive_attention(q, k, v, *, causal=False, scale=None, return_lse=False):
    """Step 2 of the ladder: the same contract as :func:`attention`, with S and P materialised.

    Allocates B * Hq * Sq * Sk * (4 + element size) bytes for the score and probability matrices.
    """
    fn = "fmha.naive_attention"
    _check_qkv(fn, q, k, v)
    causal = _check_flag(fn, "causal", causal)
    _check_flag(fn, "return_lse", return_lse)
    scale = _check_scale(fn, scale, q.shape[3])
    offset = k.shape[2] - q.shape[2] if causal else None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError(f"{fn}: the naive baseline is forward only; use fmha.attention for gradients "
                                  "or call it under torch.no_grad()")
    out, lse = run_forward(q, k, v, causal_offset=offset, scale=scale, naive=True)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Same semantics: inputs (..., H, L, E) or (N, L, E), ``is_causal`` aligned top-left
    (query i sees keys 0..i), ``scale`` default E**-0.5, ``enable_gqa`` to let query
    heads be a multiple of key/value heads. Unsupported arguments raise NotImplementedError.
    """
    fn = "fmha.scaled_dot_product_attention"
    names = ("query", "key", "value")
    for name, tensor in zip(names, (query, key, value)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.ndim < 3:
            raise ValueError(f"{fn}: {name} must have at least 3 dims (N, L, E), got shape {tuple(tensor.shape)}")
    if attn_mask is not None:
        raise NotImplementedError(f"{fn}: attn_mask is not supported yet; use is_causal for causal masking")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{fn}: dropout_p must be a float in [0, 1], got {dropout_p!r}")
    if dropout_p > 0.0:
        raise NotImplementedError(f"{fn}: dropout_p > 0 is not supported yet")
    is_causal = _check_flag(fn, "is_causal", is_causal)
    enable_gqa = _check_flag(fn, "enable_gqa", enable_gqa)
    if value.shape[-1] != query.shape[-1] and key.shape[-1] == query.shape[-1]:
        raise NotImplementedError(f"{fn}: a value head dim ({value.shape[-1]}) different from the query's "
                                  f"({query.shape[-1]}) is not supported yet")
    if not (query.ndim == key.ndim == value.ndim):
        raise ValueError(f"{fn}: query, key and value must have the same number of dims, "
                         f"got {query.ndim}, {key.ndim} and {value.ndim}")
    if not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
        raise NotImplementedError(f"{fn}: broadcasting batch dims is not supported yet; query has "
                                  f"{tuple(query.shape[:-3])}, key {tuple(key.shape[:-3])}, "
                                  f"value {tuple(value.shape[:-3])}")
    if query.ndim == 3:
        q, k, v = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    else:  # fold extra leading dims into the batch (a view for contiguous inputs)
        q, k, v = (t.reshape(-1, *t.shape[-3:]) for t in (query, key, value))
    _check_qkv(fn, q, k, v, names)
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(f"{fn}: query has {q.shape[1]} heads and key {k.shape[1]}; "
                         "pass enable_gqa=True for grouped-query attention")
    scale = _check_scale(fn, scale, q.shape[3])
    out, _ = _forward(q, k, v, causal_offset=0 if is_causal else None, scale=scale, config=None)
    return out.reshape(query.shape) if query.ndim != 4 else out
