"""The validated form of a ``flash_attn_with_kvcache`` call: :class:`KVCacheParams`.

It holds everything the kernels are specialised on: shapes, dtype, device, which optional tensors
are given, and the options; strides and pointer alignment join it in the launch cache's key.
:func:`kvcache_params` raises ``TypeError`` / ``ValueError`` / ``NotImplementedError`` naming the
argument, before anything is launched. Values that live on the device (``cache_seqlens``,
``cache_batch_idx``, ``cache_leftpad``, the block table's entries) are never read on the host:
that would need a sync. The kernels clamp lengths and cache batch indices into the cache instead;
block table entries must name pages of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .params import (MAX_HEAD_DIM, SUPPORTED_DTYPES, check_alibi_slopes, check_cu_seqlens, check_flag, check_max_seqlen,
                     check_scale, check_sinks, check_softcap, flash_softcap, flash_window)
from .runtime import GRID_AXIS_LIMIT, INTERPRETED


@dataclass(frozen=True, slots=True)
class KVCacheParams:
    batch: int
    seqlen_q: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    capacity: int  # key positions one sequence can hold: S_cache, or max_blocks * page_size
    cache_batches: int  # k_cache.shape[0]: cache batches, or pages
    page_size: int  # 0: a contiguous cache
    new_keys: int  # S_new: rows of k and v to append (0: none)
    seqlens_on_device: bool  # cache_seqlens is a tensor; else an int, passed with each call
    has_batch_idx: bool
    has_leftpad: bool
    rotary_dim: int  # 0: no rotary embedding
    rotary_rows: int
    rotary_interleaved: bool
    scale: float
    window_left: int | None  # row i sees keys i + Sk_b - Sq - left <= j <= i + Sk_b - Sq + right
    window_right: int | None
    num_splits: int  # 0: the heuristic
    softcap: float = 0.0  # 0: off
    alibi: int = 0  # alibi_slopes: 0 none, 1 (Hq,), 2 (B, Hq)
    has_sinks: bool = False  # sinks, fp32 (Hq,)
    # Packed queries (flash_attn_varlen_func with block_table): q (total_q, Hq, D) cut by
    # cu_seqlens_q, seqlen_q the longest sequence, key lengths from cu_seqlens_k.
    varlen: bool = False
    total_q: int = 0

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def rotary_at_rows(self) -> bool:
        """FlashAttention rotates query i at cache_seqlens + i under a causal or local mask, else
        every query at cache_seqlens."""
        return self.window_left is not None or self.window_right is not None

    @property
    def no_output(self) -> bool:
        return (self.total_q if self.varlen else self.batch * self.seqlen_q) * self.q_heads == 0


def _tensor(fn: str, name: str, tensor, ndim: int, meaning: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.ndim != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D {meaning}, got shape {tuple(tensor.shape)}")
    return tensor


def _on_device(fn: str, name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise ValueError(f"{fn}: {name} is on {tensor.device}, q on {device}; they must be on the same device")


def _int32_per_sequence(fn: str, name: str, tensor, batch: int, device: torch.device) -> None:
    _tensor(fn, name, tensor, 1, "(batch,)")
    if tensor.dtype != torch.int32:
        raise TypeError(f"{fn}: {name} must be torch.int32, got {tensor.dtype}")
    if tensor.shape[0] != batch:
        raise ValueError(f"{fn}: {name} must have one entry per sequence ({batch}), got {tensor.shape[0]}")
    if batch > 1 and tensor.stride(0) != 1:  # the kernels read entry b at offset b
        raise ValueError(f"{fn}: {name} must be contiguous, got stride {tensor.stride(0)}")
    _on_device(fn, name, tensor, device)


def _cache(fn, q, k_cache, v_cache, block_table, batch, q_heads, head_dim, softcap, alibi_slopes, sinks,
           cache_batch_idx=None) -> dict:
    """Checks shared by both entry points: q's dtype and device, the caches, the block table and
    the score options. Returns those KVCacheParams fields."""
    if isinstance(softcap, bool):
        raise TypeError(f"{fn}: softcap must be a float (0.0: off), got bool")
    softcap = check_softcap(fn, flash_softcap(fn, softcap))
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if name != "q":
            _tensor(fn, name, tensor, 4, "(batch, seqlen, heads, head_dim), or (pages, page_size, heads, head_dim) "
                    "with block_table")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: {name} has dtype {tensor.dtype}; supported dtypes are torch.float16, "
                            "torch.bfloat16 and torch.float32")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise TypeError(f"{fn}: q, k_cache and v_cache must have the same dtype, got {q.dtype}, {k_cache.dtype} "
                        f"and {v_cache.dtype}")
    device = q.device
    if device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(f"{fn}: q is a CPU tensor, and fmha's kernels run on the GPU. To run them on the CPU "
                           "through Triton's interpreter, set TRITON_INTERPRET=1 before importing triton or fmha.")
    if device.type not in ("cuda", "cpu", "meta"):
        raise ValueError(f"{fn}: q is on device {device}; fmha runs on CUDA devices (or on the CPU under "
                         "TRITON_INTERPRET=1, or on meta tensors for shapes only)")
    _on_device(fn, "k_cache", k_cache, device)
    _on_device(fn, "v_cache", v_cache, device)
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{fn}: head dim (last dim of q) must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    if v_cache.shape[:3] == k_cache.shape[:3] and v_cache.shape[3] != k_cache.shape[3]:
        raise NotImplementedError(f"{fn}: v_cache's head dim ({v_cache.shape[3]}) differs from k_cache's "
                                  f"({k_cache.shape[3]}): the KV-cache kernels take one head dim (fmha.attention "
                                  "and flash_attn_varlen_func without a block_table take two)")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{fn}: k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"{fn}: k_cache's head dim ({k_cache.shape[3]}) differs from q's ({head_dim})")
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"{fn}: the number of query heads ({q_heads}, in q) must be a multiple of the number of "
                         f"key/value heads ({kv_heads}, in k_cache)")
    alibi = 0
    if check_alibi_slopes(fn, alibi_slopes, batch, q_heads, device):
        alibi = alibi_slopes.ndim
    has_sinks = check_sinks(fn, sinks, q_heads, device)

    if block_table is not None:
        _tensor(fn, "block_table", block_table, 2, "(batch, max_blocks_per_sequence)")
        if block_table.dtype != torch.int32:
            raise TypeError(f"{fn}: block_table must be torch.int32, got {block_table.dtype}")
        if block_table.shape[0] != batch:
            raise ValueError(f"{fn}: block_table must have one row per sequence ({batch}), got {block_table.shape[0]}")
        if block_table.shape[1] > 1 and block_table.stride(1) != 1:  # entry j of a row read at offset j
            raise ValueError(f"{fn}: block_table's rows must be contiguous, got stride {block_table.stride(1)}")
        _on_device(fn, "block_table", block_table, device)
        if cache_batch_idx is not None:
            raise ValueError(f"{fn}: cache_batch_idx cannot be used with block_table (the block table already "
                             "names each sequence's pages)")
        page_size = k_cache.shape[1]
        if page_size == 0:
            raise ValueError(f"{fn}: k_cache's page size (its dim 1, with block_table) must be at least 1")
        capacity = block_table.shape[1] * page_size
    else:
        page_size = 0
        capacity = k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] < batch:
            raise ValueError(f"{fn}: k_cache holds {k_cache.shape[0]} sequences, q has {batch}; pass "
                             "cache_batch_idx to pick cache rows")
    return dict(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=q.dtype, device=device,
                capacity=capacity, cache_batches=k_cache.shape[0], page_size=page_size, softcap=softcap, alibi=alibi,
                has_sinks=has_sinks)


def _scale_and_window(fn, softmax_scale, causal, window_size, capacity, head_dim) -> dict:
    scale = check_scale(fn, softmax_scale, head_dim, "softmax_scale")
    check_flag(fn, "causal", causal)
    left, right = flash_window(fn, window_size) or (None, None)
    if causal:
        right = 0
    # As FlashAttention: a side at least as long as the cache is unbounded (which also decides
    # where rotary puts the queries).
    left = None if left is not None and left >= capacity else left
    right = None if right is not None and right >= capacity else right
    return dict(scale=scale, window_left=left, window_right=right)


def kvcache_params(fn, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                   cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                   alibi_slopes, num_splits, sinks=None) -> KVCacheParams:
    """Check every argument of ``flash_attn_with_kvcache`` and reduce them to a KVCacheParams."""
    _tensor(fn, "q", q, 4, "(batch, seqlen, heads, head_dim)")
    batch, seqlen_q, q_heads, head_dim = q.shape
    fields = _cache(fn, q, k_cache, v_cache, block_table, batch, q_heads, head_dim, softcap, alibi_slopes, sinks,
                    cache_batch_idx)
    device, capacity, kv_heads = fields["device"], fields["capacity"], fields["kv_heads"]
    if cache_batch_idx is not None:
        _int32_per_sequence(fn, "cache_batch_idx", cache_batch_idx, batch, device)
    if cache_leftpad is not None:
        _int32_per_sequence(fn, "cache_leftpad", cache_leftpad, batch, device)

    seqlens_on_device = isinstance(cache_seqlens, torch.Tensor)
    if seqlens_on_device:
        _int32_per_sequence(fn, "cache_seqlens", cache_seqlens, batch, device)
    elif cache_seqlens is not None and (isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int)):
        raise TypeError(f"{fn}: cache_seqlens must be an int, an int32 tensor (batch,) or None, "
                        f"got {type(cache_seqlens).__name__}")

    new_keys = 0
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: k and v must be given together (new keys and values to append)")
    if k is not None:
        for name, tensor in (("k", k), ("v", v)):
            _tensor(fn, name, tensor, 4, "(batch, seqlen_new, kv_heads, head_dim)")
            if tensor.dtype != q.dtype:
                raise TypeError(f"{fn}: {name} must have q's dtype {q.dtype}, got {tensor.dtype}")
            _on_device(fn, name, tensor, device)
            if tensor.shape[0] != batch or tensor.shape[2:] != k_cache.shape[2:]:
                raise ValueError(f"{fn}: {name} must be (batch={batch}, seqlen_new, kv_heads={kv_heads}, "
                                 f"head_dim={head_dim}), got {tuple(tensor.shape)}")
        if v.shape != k.shape:
            raise ValueError(f"{fn}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if cache_seqlens is None:
            raise ValueError(f"{fn}: appending k and v needs cache_seqlens (where each sequence's new keys go)")
        new_keys = k.shape[1]
        if new_keys > capacity:
            raise ValueError(f"{fn}: k has {new_keys} new keys per sequence, more than the cache holds ({capacity})")

    rotary_dim = rotary_rows = 0
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{fn}: rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        for name, tensor in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _tensor(fn, name, tensor, 2, "(positions, rotary_dim / 2)")
            if not tensor.is_floating_point():
                raise TypeError(f"{fn}: {name} must be a floating-point tensor, got {tensor.dtype}")
            _on_device(fn, name, tensor, device)
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(f"{fn}: rotary_cos and rotary_sin must have the same shape, got "
                             f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        if k is None:
            raise ValueError(f"{fn}: rotary_cos and rotary_sin rotate the new keys: they need k and v")
        rotary_rows, rotary_dim = rotary_cos.shape[0], 2 * rotary_cos.shape[1]
        if not 0 < rotary_dim <= head_dim:
            raise ValueError(f"{fn}: the rotary dim (2 * rotary_cos.shape[1] = {rotary_dim}) must be between 2 and "
                             f"the head dim ({head_dim})")
        if rotary_rows < capacity:
            raise ValueError(f"{fn}: rotary_cos has {rotary_rows} positions, fewer than the cache holds ({capacity})")

    scale_and_window = _scale_and_window(fn, softmax_scale, causal, window_size, capacity, head_dim)
    check_flag(fn, "rotary_interleaved", rotary_interleaved)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"{fn}: num_splits must be an int >= 0 (0: chosen by a heuristic), got {num_splits!r}")
    _check_packed_rows(fn, "q.shape[1]", seqlen_q, q_heads, fields["kv_heads"])
    return KVCacheParams(
        seqlen_q=seqlen_q, new_keys=new_keys, seqlens_on_device=seqlens_on_device,
        has_batch_idx=cache_batch_idx is not None, has_leftpad=cache_leftpad is not None, rotary_dim=rotary_dim,
        rotary_rows=rotary_rows, rotary_interleaved=rotary_interleaved, num_splits=num_splits, **fields,
        **scale_and_window)


def paged_varlen_params(fn, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                        softmax_scale, causal, window_size, softcap, alibi_slopes, sinks=None) -> KVCacheParams:
    """Check a ``flash_attn_varlen_func`` call with ``block_table``: q (total_q, Hq, D) packed by
    ``cu_seqlens_q``; sequence b's keys are its first ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``
    positions in the pages that row b of the block table names."""
    _tensor(fn, "q", q, 3, "(total_q, heads, head_dim)")
    check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, q.device, q.shape[0], "q")
    check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, q.device, None, "k")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
                         f"got {cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    max_seqlen_q = check_max_seqlen(fn, "max_seqlen_q", max_seqlen_q)
    total_q, q_heads, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    fields = _cache(fn, q, k_cache, v_cache, block_table, batch, q_heads, head_dim, softcap, alibi_slopes, sinks)
    _check_packed_rows(fn, "max_seqlen_q", max_seqlen_q, q_heads, fields["kv_heads"])
    return KVCacheParams(
        seqlen_q=max_seqlen_q, new_keys=0, seqlens_on_device=True, has_batch_idx=False, has_leftpad=False,
        rotary_dim=0, rotary_rows=0, rotary_interleaved=False, num_splits=0, varlen=True, total_q=total_q,
        **fields, **_scale_and_window(fn, softmax_scale, causal, window_size, fields["capacity"], head_dim))


# Packed query rows (query heads per KV head x queries) one (sequence, KV head) can hold: the
# kernel's tiles of 64 or more such rows run on a grid axis of GRID_AXIS_LIMIT programs.
MAX_PACKED_ROWS = GRID_AXIS_LIMIT * 64


def _check_packed_rows(fn: str, name: str, seqlen_q: int, q_heads: int, kv_heads: int) -> None:
    packed = q_heads // kv_heads * seqlen_q
    if packed > MAX_PACKED_ROWS:
        raise NotImplementedError(f"{fn}: {name} = {seqlen_q} queries of {q_heads // kv_heads} heads per KV "
                                  f"head make {packed} rows per KV head, more than the {MAX_PACKED_ROWS} one call "
                                  "holds; split the queries over several calls")


def check_cache_seqlen(fn: str, cache_seqlens, params: KVCacheParams) -> int:
    """The per-call int form of ``cache_seqlens`` (None: the whole cache), checked against the cache."""
    if cache_seqlens is None:
        return params.capacity
    if not 0 <= cache_seqlens <= params.capacity - params.new_keys:
        raise ValueError(f"{fn}: cache_seqlens={cache_seqlens} with {params.new_keys} new keys does not fit the "
                         f"cache ({params.capacity} positions per sequence)")
    return cache_seqlens
