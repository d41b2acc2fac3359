"""What a call runs: the on-disk cache, then the shipped defaults, then a heuristic.

The forward (``fwd`` keys) and the backward (``bwd`` keys) are looked up the same way, each
with its own configs. A forward key's answer is a kernel choice: a tile config of the portable
kernel (``ForwardConfig``) or a schedule of the Hopper kernel (``HopperSchedule``); Hopper
schedules ship as rules per GPU architecture (:mod:`fmha.tuning.schedules`), the portable
kernel's configs per GPU and key. Answers are memoised per key, so a call pays one dict lookup.
Nothing is searched implicitly unless ``FMHA_AUTOTUNE=1`` (:mod:`fmha.tuning.autotune`).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import NamedTuple

import torch

from ..backends.gluon_sm90.schedule import HopperSchedule
from ..backends.triton.config import BackwardConfig, ForwardConfig, heuristic_backward_config, heuristic_forward_config
from ..params import AttentionOptions, AttentionParams
from ..runtime import compute_capability, multiprocessors, shared_memory_per_block
from . import store
from .autotune import tune_and_store
from .key import ShapeKey, device_key, gpu_name, length_bucket
from .schedules import shipped_schedule
from .space import SPACES, Problem

# One file for every kernel: entries are keyed by ShapeKey text, which starts with the kernel.
SHIPPED_DEFAULTS = Path(__file__).parent / "defaults" / "forward.json"
DEFAULTS_FORMAT = "fmha-defaults/1"

_memo: dict[tuple, tuple[ForwardConfig, str]] = {}
_cache_entries: dict | None = None


class Choice(NamedTuple):
    """A forward kernel choice and where it came from (``cache``, ``shipped``, ``autotuned``, ...)."""

    backend: str
    config: ForwardConfig | HopperSchedule
    source: str


# Tuned tiles assume the grid fills the GPU. When 128-row query tiles would leave
# multiprocessors idle, narrow heads run 64-row tiles that walk 128 keys at a time instead:
# (1, 16, 1024, 64) on the H100, 267 -> 309 TFLOP/s (docs/perf.md, "Small shapes").
UNDERFILLED_GRID_CONFIG = ForwardConfig(block_m=64, block_n=128, num_warps=4, num_stages=3)


def forward_key(params: AttentionParams, kernel: str = "fwd") -> ShapeKey:
    return ShapeKey.of(kernel, params.dtype, params.head_dim, params.causal, params.q_heads, params.kv_heads,
                       params.seqlen_q, params.seqlen_k)


def hopper_schedule(params: AttentionParams) -> tuple[HopperSchedule | None, str]:
    """The Hopper schedule for this call (None: the portable kernel is the tuned choice), and why."""
    cached = _from_cache(params.device, forward_key(params))
    if isinstance(cached, HopperSchedule):
        return cached, "cache"
    if isinstance(cached, ForwardConfig):
        return None, "the cache holds a portable config for this key (fmha tune)"
    shipped = _shipped_entries(gpu_name(params.device)).get(forward_key(params))
    if isinstance(shipped, HopperSchedule):
        return shipped, "shipped"
    major, minor = compute_capability(params.device)
    schedule, rule = shipped_schedule(params, f"sm_{major}{minor}", multiprocessors(params.device))
    return schedule, rule


def portable_config(params: AttentionParams, autotune=None) -> tuple[ForwardConfig, str]:
    """The portable forward's config for this call, and its source; narrowed when the grid would not fill the GPU."""
    config, source = _config("fwd", params, autotune)
    if (config.block_m >= 128 and params.head_dim <= 64 and params.dtype != torch.float32
            and params.device.type == "cuda"):
        tiles = params.batch * params.q_heads * -(-params.seqlen_q // config.block_m)
        if tiles < multiprocessors(params.device):
            return UNDERFILLED_GRID_CONFIG, source + ", narrowed for a grid under one wave"
    return config, source


def backward_config(params: AttentionParams) -> tuple[BackwardConfig, str]:
    """The backward's config for this call, looked up like the forward's under ``bwd`` keys."""
    return _config("bwd", params, None)


def _config(kernel: str, params: AttentionParams, autotune) -> tuple[ForwardConfig, str]:
    memo_key = (kernel, params.device, params.dtype, params.head_dim, params.causal, params.group,
                length_bucket(params.seqlen_q), length_bucket(params.seqlen_k))
    found = _memo.get(memo_key)
    if found is None:
        found = _memo[memo_key] = _resolve(kernel, params, autotune)
    return found


def explain_forward_config(device, dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k,
                           autotune: bool = False) -> tuple[ForwardConfig, str]:
    """``(config, source)`` of the portable forward with source ``cache``, ``shipped``, ``autotuned`` or ``heuristic``."""
    return _resolve("fwd", params_of(device, dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k),
                    autotune)


def explain_backward_config(device, dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k,
                            autotune: bool = False) -> tuple[BackwardConfig, str]:
    """``(config, source)`` for the backward, as :func:`explain_forward_config`."""
    return _resolve("bwd", params_of(device, dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k),
                    autotune)


def params_of(device, dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k, batch=1) -> AttentionParams:
    """The parameters of a default call of this shape (default scale, bottom-right causal)."""
    options = AttentionOptions(scale=head_dim ** -0.5, window_right=0 if causal else None)
    return AttentionParams(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, torch.device(device), options)


def heuristic_config(kernel: str, head_dim: int, dtype: torch.dtype, seqlen_q: int, device=None) -> ForwardConfig:
    """The kernel's fallback when nothing is cached or shipped (the backward's depends on the
    ``device``'s shared memory at wide heads)."""
    if kernel == "bwd":
        return heuristic_backward_config(head_dim, dtype, shared_memory_per_block(device))
    return heuristic_forward_config(head_dim, dtype, seqlen_q)


def _resolve(kernel: str, params: AttentionParams, autotune=None) -> tuple[ForwardConfig, str]:
    shape = forward_key(params, kernel)
    config = _from_cache(params.device, shape)
    if isinstance(config, ForwardConfig):
        return config, "cache"
    config = shipped_config(gpu_name(params.device), shape)
    if config is not None:
        return config, "shipped"
    if autotune is None:
        autotune = os.environ.get("FMHA_AUTOTUNE") == "1"
    if autotune:
        config = tune_and_store(kernel, params)
        if config is not None:
            return config, "autotuned"
    return heuristic_config(kernel, params.head_dim, params.dtype, params.seqlen_q, params.device), "heuristic"


def _config_class(kernel: str) -> type[ForwardConfig] | None:
    space = SPACES.get(kernel)
    return space.config_class if space else None


def _from_cache(device, shape: ShapeKey) -> ForwardConfig | HopperSchedule | None:
    global _cache_entries
    if _cache_entries is None:
        _cache_entries = store.load()
    record = _cache_entries.get(device_key(device), {}).get(shape.text())
    if not record:
        return None
    if record.get("kernel") == HopperSchedule.backend:
        return store.record_to_schedule(record)
    return store.record_to_config(record, _config_class(shape.kernel))


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
        if record.get("kernel") == HopperSchedule.backend:
            config = store.record_to_schedule(record)
        else:
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
    entries = {key: config for key, config in _shipped_entries(gpu).items() if isinstance(config, ForwardConfig)}
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
