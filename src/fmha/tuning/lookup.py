"""Which tile config a call uses: the on-disk cache, then the shipped defaults, then a heuristic.

The forward (``fwd`` keys) and the backward (``bwd`` keys) are looked up the same way, each
with its own configs. The answer is memoised per (kernel, device, dtype, head dim, causal, GQA
ratio, length buckets), so a call pays one dict lookup. Nothing is searched implicitly, unless
``FMHA_AUTOTUNE=1``: then a key with no cached or shipped config is searched once, on inputs of
the call's shape, and stored.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from ..config import BackwardConfig, ForwardConfig, heuristic_backward_config, heuristic_forward_config
from . import store
from .key import ShapeKey, device_key, gpu_name, length_bucket
from .space import SPACES, Problem

# One file for every kernel: entries are keyed by ShapeKey text, which starts with the kernel.
SHIPPED_DEFAULTS = Path(__file__).parent / "defaults" / "forward.json"
DEFAULTS_FORMAT = "fmha-defaults/1"

_memo: dict[tuple, tuple[ForwardConfig, str]] = {}
_cache_entries: dict | None = None


# Tuned tiles assume the grid fills the GPU. When 128-row query tiles would leave
# multiprocessors idle, narrow heads run 64-row tiles that walk 128 keys at a time instead:
# (1, 16, 1024, 64) on the H100, 267 -> 309 TFLOP/s (docs/perf.md, "Small shapes").
UNDERFILLED_GRID_CONFIG = ForwardConfig(block_m=64, block_n=128, num_warps=4, num_stages=3)


def forward_config(q: torch.Tensor, k: torch.Tensor, causal: bool) -> ForwardConfig:
    """The forward's config for this call (hot path: one tuple and one dict lookup when memoised)."""
    config = _config("fwd", q, k, causal)
    if config.block_m >= 128 and q.shape[3] <= 64 and q.element_size() == 2 and q.is_cuda:
        tiles = q.shape[0] * q.shape[1] * -(-q.shape[2] // config.block_m)
        if tiles < _multiprocessors(q.device.index):
            return UNDERFILLED_GRID_CONFIG
    return config


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index if device_index is not None else 0).multi_processor_count


def backward_config(q: torch.Tensor, k: torch.Tensor, causal: bool) -> BackwardConfig:
    """The backward's config for this call, looked up like :func:`forward_config` under ``bwd`` keys."""
    return _config("bwd", q, k, causal)


def _config(kernel: str, q: torch.Tensor, k: torch.Tensor, causal: bool) -> ForwardConfig:
    memo_key = (kernel, q.device.index, q.dtype, q.shape[3], causal, q.shape[1] // k.shape[1],
                length_bucket(q.shape[2]), length_bucket(k.shape[2]))
    found = _memo.get(memo_key)
    if found is None:
        found = _memo[memo_key] = _resolve(kernel, q.device, q.dtype, q.shape[3], causal, q.shape[1], k.shape[1],
                                           q.shape[2], k.shape[2], q.shape[0])
    return found[0]


def explain_forward_config(device, dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k,
                           autotune: bool = False) -> tuple[ForwardConfig, str]:
    """``(config, source)`` with source ``cache``, ``shipped``, ``autotuned`` or ``heuristic``."""
    return _resolve("fwd", torch.device(device), dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k,
                    batch=1, autotune=autotune)


def explain_backward_config(device, dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k,
                            autotune: bool = False) -> tuple[BackwardConfig, str]:
    """``(config, source)`` for the backward, as :func:`explain_forward_config`."""
    return _resolve("bwd", torch.device(device), dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k,
                    batch=1, autotune=autotune)


def heuristic_config(kernel: str, head_dim: int, dtype: torch.dtype, seqlen_q: int) -> ForwardConfig:
    """The kernel's fallback when nothing is cached or shipped."""
    if kernel == "bwd":
        return heuristic_backward_config(head_dim, dtype)
    return heuristic_forward_config(head_dim, dtype, seqlen_q)


def _resolve(kernel, device, dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k, batch,
             autotune: bool | None = None) -> tuple[ForwardConfig, str]:
    shape = ShapeKey.of(kernel, dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k)
    config = _from_cache(device, shape)
    if config is not None:
        return config, "cache"
    config = shipped_config(gpu_name(device), shape)
    if config is not None:
        return config, "shipped"
    if autotune is None:
        autotune = os.environ.get("FMHA_AUTOTUNE") == "1"
    if autotune:
        from .search import tune_and_store

        config = tune_and_store(kernel, device, dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k,
                                batch)
        if config is not None:
            return config, "autotuned"
    return heuristic_config(kernel, head_dim, dtype, seqlen_q), "heuristic"


def _config_class(kernel: str) -> type[ForwardConfig] | None:
    space = SPACES.get(kernel)
    return space.config_class if space else None


def _from_cache(device, shape: ShapeKey) -> ForwardConfig | None:
    global _cache_entries
    if _cache_entries is None:
        _cache_entries = store.load()
    record = _cache_entries.get(device_key(device), {}).get(shape.text())
    return store.record_to_config(record, _config_class(shape.kernel)) if record else None


def forget() -> None:
    """Drop memoised answers (after the cache file or the shipped defaults changed)."""
    global _cache_entries
    _cache_entries = None
    _memo.clear()
    _shipped_entries.cache_clear()


@functools.lru_cache(maxsize=None)
def _shipped_entries(gpu: str) -> dict[ShapeKey, ForwardConfig]:
    try:
        data = json.loads(SHIPPED_DEFAULTS.read_text())
    except (OSError, ValueError):
        return {}
    if data.get("format") != DEFAULTS_FORMAT:
        return {}
    entries = data.get("gpus", {}).get(gpu, {}).get("entries", {})
    parsed = {}
    for text, record in entries.items():
        shape = ShapeKey.parse(text)
        config_class = _config_class(shape.kernel)
        config = store.record_to_config(record, config_class) if config_class else None
        if config is not None:
            parsed[shape] = config
    return parsed


def shipped_config(gpu: str, shape: ShapeKey) -> ForwardConfig | None:
    """The shipped config for this key, else the one tuned for the nearest length buckets.

    Nearest: same kernel, dtype, head dim and causality; distance in powers of two of the
    query and key lengths, then in GQA ratio. A neighbour whose tiles are longer than this
    key's lengths allow (the forward's BLOCK_M beyond the query, say) is not used.
    """
    entries = _shipped_entries(gpu)
    if shape in entries:
        return entries[shape]
    same_kind = [key for key in entries if (key.kernel, key.dtype, key.head_dim, key.causal)
                 == (shape.kernel, shape.dtype, shape.head_dim, shape.causal)]
    if not same_kind:
        return None

    def distance(key: ShapeKey) -> tuple:
        return (abs(key.seqlen_q_bucket.bit_length() - shape.seqlen_q_bucket.bit_length())
                + abs(key.seqlen_k_bucket.bit_length() - shape.seqlen_k_bucket.bit_length()),
                abs(key.group - shape.group))

    config = entries[min(same_kind, key=distance)]
    problem = Problem(shape.head_dim, 2, shape.seqlen_q_bucket, seqlen_k=shape.seqlen_k_bucket)
    return config if SPACES[shape.kernel].fits_lengths(config, problem) is None else None
