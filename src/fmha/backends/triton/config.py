"""Tile configurations: what a launch needs beyond the tensors.

The autotuner supplies a :class:`ForwardConfig` per shape; until one is known,
:func:`heuristic_forward_config` picks one from the head dim and dtype.
Under the Triton interpreter a single small tile is pinned: it does not autotune,
and small tiles keep CPU tests quick while still crossing block boundaries.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import triton

from ...runtime import GRID_AXIS_LIMIT


@dataclass(frozen=True)
class ForwardConfig:
    """Tiles of the portable forward: BLOCK_M query rows per program, BLOCK_N keys per step."""

    backend: ClassVar[str] = "triton"

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def to_ints(self) -> tuple[int, int, int, int]:
        return (self.block_m, self.block_n, self.num_warps, self.num_stages)

    @classmethod
    def from_ints(cls, values) -> "ForwardConfig":
        return cls(*values)

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"ForwardConfig.{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"ForwardConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"ForwardConfig.num_stages must be >= 1, got {self.num_stages}")


@dataclass(frozen=True)
class SplitKVConfig:
    """The split-KV forward (fmha.backends.triton.split_kv): BLOCK_M packed query rows (every query
    head of a KV head), BLOCK_N keys per step, the keys cut into ``splits`` chunks."""

    backend: ClassVar[str] = "triton"

    block_m: int
    block_n: int
    num_warps: int
    splits: int
    num_stages: int = 2

    def text(self) -> str:
        return (f"split-KV: {self.splits} chunks, {self.block_m} packed rows x {self.block_n} keys, {self.num_warps} warps, "
                f"{self.num_stages} stages")


def split_kv_config(params, multiprocessors: int) -> SplitKVConfig | None:
    """The split-KV plan for a decode-like call, or None.

    Decode-like: all query rows of a KV head fit one 64-row tile, so K and V are read once per
    KV head for all its query heads. Key blocks hold 16 KB of K (64 keys at D = 128); the chunks,
    each at least four blocks, bring the grid to about one program per multiprocessor (where that
    makes two chunks on nearly half the GPU, one chunk of 32 KB blocks), and a grid of at most two
    programs per multiprocessor reads three blocks deep. A call that needs neither the chunks (its
    KV heads fill the GPU) nor the packing (one query head per KV head) keeps the per-tile forward.
    (H100, K and V from DRAM: B1 Hq/Hkv 32/8 Sk4096 11.5 us against 13.1 with two programs per
    multiprocessor; docs/perf.md, "The split-KV forward's plan".)
    """
    packed_rows = params.group * params.seqlen_q
    if packed_rows > 64 or params.seqlen_k == 0 or params.head_dim_v:
        return None  # (a value head dim of its own runs the per-tile forward)
    programs = params.batch * params.kv_heads
    block_d = padded_head_dim(params.head_dim)
    interpreted = multiprocessors < 8  # the interpreter: small tiles, no rules from GPU timings
    block_n = 16 if interpreted else min(128, 8192 // block_d)
    if params.group == 1 and (programs >= 2 * multiprocessors or params.seqlen_k <= 2 * block_n):
        return None  # nothing to pack, and the grid is full or the keys few
    splits = max(1, min(multiprocessors // programs, -(-params.seqlen_k // (4 * block_n))))
    if splits == 2 and 16 * programs >= 7 * multiprocessors and not interpreted:
        # Programs on nearly half the GPU stream one chunk each in blocks twice as long, with no
        # combine kernel (H100: 64 programs, B8 Hq/Hkv 32/8 Sk2048, 26.3 us against 27.6 with two
        # chunks; 48 programs, B6 Sk4096, lose: 44.6 against 39.5; docs/perf.md, "The split-KV forward's plan").
        splits, block_n = 1, 2 * block_n
    stages = 3 if programs * splits <= 2 * multiprocessors else 2
    return SplitKVConfig(max(16, triton.next_power_of_2(packed_rows)), block_n, 4, splits, num_stages=stages)


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV-cache attention (fmha.backends.triton.kvcache): BLOCK_M packed query rows, BLOCK_N
    keys per step, the cache's positions cut into ``splits`` chunks."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    splits: int
    # Walk each tile's keys in one masked loop instead of masked edges around unmasked blocks.
    one_range: bool = False
    # Read a contiguous cache through tensor descriptors (bulk copies) where its strides allow.
    tma: bool = False

    def text(self) -> str:
        return (f"KV cache: {self.splits} chunks, {self.block_m} packed rows x {self.block_n} keys, "
                f"{self.num_warps} warps, {self.num_stages} stages")


# Chunks of about this many keys spread ragged lengths evenly over the GPU (H100, B32 Hkv8, lengths
# 1k-8k: 6 chunks of 1408 keys were best of 1-16 for contiguous, page-256 and page-16 caches).
KVCACHE_CHUNK_KEYS = 1536
# A grid under one program per multiprocessor is cut into chunks up to that count, and chunks of
# at most this many keys, each at least KVCACHE_MIN_CHUNK_BLOCKS key blocks (docs/perf.md, "chunk counts by grid").
KVCACHE_SMALL_GRID_CHUNK_KEYS = 4096
KVCACHE_MIN_CHUNK_BLOCKS = 4


def _kvcache_splits(programs: int, capacity: int, key_blocks: int, multiprocessors: int) -> int:
    """Chunks of the cache's capacity for ``programs`` (batch, KV head, packed block) tiles."""
    if programs >= multiprocessors:  # the GPU is full: chunks balance ragged lengths
        return -(-capacity // KVCACHE_CHUNK_KEYS)
    # At most one program per multiprocessor: a second wave ran behind the first (H100 B8 Sk2048:
    # 3 chunks 31.4 us, 2 chunks 28.4).
    splits = max(multiprocessors // programs, -(-capacity // KVCACHE_SMALL_GRID_CHUNK_KEYS))
    splits = min(splits, key_blocks // KVCACHE_MIN_CHUNK_BLOCKS)
    if splits == 2 and 3 * programs > multiprocessors and capacity <= KVCACHE_SMALL_GRID_CHUNK_KEYS:
        # A third of the GPU or more streams one chunk each: the merge costs more than the other
        # multiprocessors give (B8 Sk2048 / Sk4096: one chunk 26.7 / 48.8 us, two 28.4 / 50.2).
        splits = 1
    return max(1, splits)


def kvcache_config(params, multiprocessors: int) -> KVCacheConfig:
    """Tiles and chunks for a ``flash_attn_with_kvcache`` call (``params``: fmha.kvcache_params.KVCacheParams).

    The lengths live on the device, so the chunks are planned for the cache's capacity
    (:func:`_kvcache_splits`): a full GPU takes chunks of about KVCACHE_CHUNK_KEYS keys; a grid of
    fewer programs than multiprocessors is cut into up to one program per multiprocessor.
    Chunks past a sequence's length cost an empty program. ``params.num_splits`` > 0 asks for that
    many chunks. A grid under two programs per multiprocessor pipelines three key blocks deep
    instead of two (H100: B1 and B8 decode 5-15% faster), and one chunk per tile on at most half the
    multiprocessors streams 128-key blocks (more bytes in flight: B8 Sk2048 26.7 us, 64-key blocks
    35.1; B16 Sk4096 92.5 against 89.8). Small grids of decode tiles that do not append walk each
    tile's keys in one masked loop (``one_range``; docs/perf.md, "one key loop and a pipelined merge").
    """
    block_d = padded_head_dim(params.head_dim)
    packed_rows = params.group * params.seqlen_q
    block_m = max(16, min(64, triton.next_power_of_2(packed_rows)))
    num_warps = 4
    if multiprocessors < 8:  # the interpreter: small tiles
        block_n = 16
    else:
        block_n = 64 if block_d <= 128 else 32
        if params.dtype == torch.float32:
            block_n = max(16, block_n // 2)
        elif packed_rows >= 128 and block_d <= 128:
            # Chunked prefill: compute-bound, larger tiles (H100, 4 x 512 queries over 4096 keys:
            # 181 -> 262 TFLOP/s; docs/perf.md).
            block_m, block_n, num_warps = 128, 128, 8
    if block_d == 32 and params.rotary_dim:
        # Triton 3.6 builds D = 32 tiles of 64 and 128 rows that rotate wrong: outputs off by ~2 or
        # shared-memory reads out of bounds, moved by unrelated changes (rotary dim, pairing, warps,
        # a stride of 1); tiles of 16 and 32 rows never failed (docs/perf.md, sessions 45-46).
        block_m, num_warps = min(block_m, 32), 4
    key_blocks = max(1, -(-params.capacity // block_n))
    programs = max(1, params.batch * params.kv_heads * -(-packed_rows // block_m))  # no rows: one program
    if params.num_splits > 0:
        splits = params.num_splits
    else:
        splits = _kvcache_splits(programs, params.capacity, key_blocks, multiprocessors)
    splits = max(1, min(splits, key_blocks, GRID_AXIS_LIMIT))
    small_grid = programs * splits < 2 * multiprocessors
    if splits == 1 and 2 * programs <= multiprocessors and block_n == 64:  # a bf16/fp16 decode tile
        block_n = 128
    num_stages = 3 if small_grid or block_m == 128 else 2
    if block_m == 128 and block_d == 32:
        # ptxas 12.8 (Triton 3.6's) crashes (SIGSEGV) on some 3-stage 128-row prefill tiles at
        # D = 32: fp16 over paged or packed caches (docs/perf.md, "Random calls on the H100").
        num_stages = 2
    # One loop saves a short call the code of two more pipelined loops, run once per program; large
    # grids are bandwidth-bound, and there the masks cost paged caches. Prefill tiles (compute-bound)
    # and appends (a masked block also reads the new rows) keep the unmasked middle apart.
    one_range = small_grid and block_m < 128 and params.new_keys == 0
    # Those tiles, one chunk each, read a contiguous 16-bit cache with bulk copies: a program keeps
    # more bytes in flight than with pointer loads; chunked tiles (B1) were slower with them (H100,
    # docs/perf.md, "Small decode: bulk copies that read only the sequence").
    tma = (one_range and splits == 1 and params.page_size == 0 and not params.varlen
           and block_d == params.head_dim and params.dtype != torch.float32)
    return KVCacheConfig(block_m, block_n, num_warps, num_stages, splits, one_range, tma)


class BackwardConfig(ForwardConfig):
    """Tiles of the backward kernels: ``block_n`` resident rows, ``block_m`` streamed rows.

    The dK/dV kernel keeps ``block_n`` keys and streams ``block_m`` queries; the dQ kernel
    keeps ``block_n`` queries and streams ``block_m`` keys.
    """


@dataclass(frozen=True)
class KernelFeatures:
    """Compile-time choices of the forward kernel beyond its tiles (see fmha.backends.triton.forward).

    Each is a request: the launcher drops one that a call cannot use (tensor descriptors
    need 16-byte aligned rows and strides, the folded scale needs scale > 0).
    """

    tma: bool = False
    fused_scale: bool = True
    pipeline_qk: bool = False
    warp_specialize: bool = False
    persistent: bool = False


# Measured on the H100 (docs/perf.md, "Levers"): the folded scale pays on every shape. Tensor
# descriptors gain 1-4% of GPU time for head dims up to 64 but cost about 130 us of host time per
# launch (made and encoded on the host), so they stay off, as do QK pipelining, the persistent
# grid and Triton's warp specialisation, which lost or did not compile.
DEFAULT_FEATURES = KernelFeatures()

INTERPRETER_FORWARD_CONFIG = ForwardConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
INTERPRETER_BACKWARD_CONFIG = BackwardConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)


def padded_head_dim(head_dim: int) -> int:
    """Power-of-two register width for a head dim; tl.dot needs at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def heuristic_forward_config(head_dim: int, dtype: torch.dtype, seqlen_q: int) -> ForwardConfig:
    """A config that compiles everywhere and runs well on Hopper-class GPUs."""
    # Cached per power-of-two query-length bucket: the hot path pays a dict lookup.
    return _heuristic_forward_config(head_dim, dtype, min(128, triton.next_power_of_2(seqlen_q)))


@functools.lru_cache(maxsize=None)
def _heuristic_forward_config(head_dim: int, dtype: torch.dtype, seqlen_q_bucket: int) -> ForwardConfig:
    block_d = padded_head_dim(head_dim)
    if block_d <= 128:
        # In a 36-config H100 sweep over the seeds/std cases (D = 64 and 128) this was
        # best on 6 of 15 and within 9% of the best on the others
        # (benchmarks/results/h100_forward_config_sweep.json).
        config = ForwardConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    else:
        config = ForwardConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    block_n = config.block_n
    if dtype == torch.float32:
        # Twice the bytes per element: halve the K/V tile so shared memory still fits.
        block_n = max(16, block_n // 2)
    # No point in query tiles longer than the query.
    block_m = min(config.block_m, max(16, seqlen_q_bucket))
    return ForwardConfig(block_m, block_n, config.num_warps, config.num_stages)


# Fp32 row statistics (LSE and delta) a streamed query row of the dK/dV kernel brings along.
ROW_STATISTICS_BYTES = 2 * 4
# Wide heads where shared memory holds them (an H100 or H200's 227 KiB a block): 64 rows streamed
# past 32 resident keys, two stages. H200 sweep at D = 256 (benchmarks/results/d256_session39/):
# 1.75x the narrow tiles below, causal or not.
WIDE_HEAD_BACKWARD_CONFIG = BackwardConfig(64, 32, 4, 2)


def backward_shared_bytes(config: BackwardConfig, head_dim: int, element_size: int) -> int:
    """Shared memory of the dK/dV kernel: its resident K and V tiles, and the streamed Q and dO
    tiles with their row statistics per stage. The dQ kernel swaps the roles and streams no
    statistics, so this also bounds it."""
    block_d = padded_head_dim(head_dim)
    resident = 2 * config.block_n * block_d * element_size
    return resident + config.num_stages * config.block_m * (2 * block_d * element_size + ROW_STATISTICS_BYTES)


@functools.lru_cache(maxsize=None)
def heuristic_backward_config(head_dim: int, dtype: torch.dtype, shared_memory: int = 0) -> BackwardConfig:
    """The dK/dV kernel keeps K, V, dK and dV of BLOCK_N keys live: wide heads get small tiles, or
    :data:`WIDE_HEAD_BACKWARD_CONFIG` where the device's ``shared_memory`` a block holds them."""
    block_d = padded_head_dim(head_dim)
    if dtype == torch.float32:
        return BackwardConfig(32, 32, 4, 1) if block_d <= 128 else BackwardConfig(16, 16, 4, 1)
    if block_d <= 128:
        # H100 sweep at D=128 (benchmarks/results/h100_backward_config_sweep.json): 64x64 with
        # 4 warps and 2 stages was best of 16, at 2.1x the same tiles with 8 warps.
        return BackwardConfig(64, 64, 4, 2)
    element_size = torch.empty((), dtype=dtype).element_size()
    if backward_shared_bytes(WIDE_HEAD_BACKWARD_CONFIG, head_dim, element_size) <= shared_memory:
        return WIDE_HEAD_BACKWARD_CONFIG
    return BackwardConfig(32, 32, 4, 1)
