"""Launcher of the KV-cache kernels (fmha.backends.triton.kvcache) for one call signature.

:class:`KVCacheForward` is prepared once per signature (shapes, strides, options, pointer
alignment): grids, constexprs, and every integer argument, strides included, so a call passes
only its tensors and the int form of cache_seqlens. The first call compiles through Triton's JIT;
later calls launch the compiled kernels directly. Nothing here reads a device value or allocates
outside torch's caching allocator, so calls can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton

from ...compat import COMPILE_OPTIONS, TensorDescriptor
from ...kvcache_params import KVCacheParams
from ...runtime import INTERPRETED, HostDescriptor, StreamCounters, interpreter_upcasts, run_compiled
from .config import KVCacheConfig, padded_head_dim
from .forward import LOG2_E
from .kvcache import kvcache_attention_kernel
from .launch import dot_precision, softcap_tanh
from .scores import NO_SOFTCAP
from .split_kv import merge_group


class _Launch:
    """One kernel of a signature: its grid, the arguments fixed by the signature (after the
    per-call ones) and its constexprs; compiled by the first call, launched directly after. A
    build that needs more shared memory than the GPU has is retried with fewer pipeline stages."""

    __slots__ = ("kernel", "grid", "fixed", "constants", "num_warps", "num_stages", "compiled", "compiled_tail")

    def __init__(self, kernel, grid, constants, num_warps, num_stages):
        self.kernel, self.grid, self.constants = kernel, grid, constants
        self.num_warps, self.num_stages = num_warps, num_stages
        self.fixed = self.compiled = self.compiled_tail = None

    def __call__(self, device, *args):
        if self.compiled is not None:
            run_compiled(self.compiled, self.grid, device, args + self.compiled_tail)
            return
        while True:
            try:
                compiled = self.kernel[self.grid](*args, *self.fixed, **self.constants, num_warps=self.num_warps,
                                                  num_stages=self.num_stages, **COMPILE_OPTIONS)
                break
            except triton.OutOfResources:  # raised before anything runs: a shallower pipeline fits
                if self.num_stages == 1:
                    raise
                self.num_stages -= 1
        if not INTERPRETED:
            # The signature fixes every specialised integer and the pointers' alignment.
            assert self.kernel.arg_names[-len(self.constants):] == list(self.constants)
            self.compiled, self.compiled_tail = compiled, (*self.fixed, *self.constants.values())


def _rows_view(cache: torch.Tensor) -> tuple[list[int], list[int]]:
    """(shape, strides) of a (B, S, H, D) cache as (B · S, H · D): a row per position, heads side by side."""
    batches, positions, heads, features = cache.shape
    return [batches * positions, heads * features], [cache.stride(1), 1]


def _tma_compatible(cache: torch.Tensor) -> bool:
    """Whether bulk copies can read ``cache`` (B, S, H, D) as (B · S, H · D) rows: 16-byte aligned,
    heads and features contiguous in a row, positions one row stride apart across batches, that
    stride a multiple of 16 bytes, and row indices within int32."""
    batches, positions, heads, features = cache.shape
    return (cache.data_ptr() % 16 == 0 and cache.stride(3) == 1 and (heads == 1 or cache.stride(2) == features)
            and (batches == 1 or cache.stride(0) == positions * cache.stride(1))
            and cache.stride(1) >= heads * features and cache.stride(1) * cache.element_size() % 16 == 0
            and batches * positions < 2**31)


def _strides(tensor, count: int) -> tuple[int, ...]:
    return tensor.stride() if tensor is not None else (0,) * count


class KVCacheForward:
    """``flash_attn_with_kvcache`` for one signature: calling it appends the new keys and values
    (when given) and returns ``(out, lse)``: out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq)
    float32. Tensors come in FlashAttention's order; ``cache_seqlen`` is the int form of
    cache_seqlens (ignored when it is a tensor)."""

    __slots__ = ("params", "config", "chunk", "splits", "attend_launch", "arrivals", "device_index",
                 "out_shape", "lse_shape", "partial_out_shape", "partial_lse_shape", "skip", "cache_views")

    def __init__(self, params: KVCacheParams, config: KVCacheConfig):
        p = self.params = params
        self.config = config
        blocks = max(1, -(-p.capacity // config.block_n))
        self.chunk = -(-blocks // config.splits) * config.block_n
        self.splits = max(1, -(-p.capacity // self.chunk))
        packed_rows = p.group * p.seqlen_q
        if p.varlen:  # packed queries: (total_q, Hq, D), LSE (Hq, total_q)
            num_rows = p.q_heads * p.total_q
            self.out_shape = (p.total_q, p.q_heads, p.head_dim)
            self.lse_shape = (p.q_heads, p.total_q)
        else:
            num_rows = p.batch * p.q_heads * p.seqlen_q
            self.out_shape = (p.batch, p.seqlen_q, p.q_heads, p.head_dim)
            self.lse_shape = (p.batch, p.q_heads, p.seqlen_q)
        self.partial_out_shape = (self.splits, num_rows, p.head_dim)
        self.partial_lse_shape = (self.splits, num_rows)
        # No query rows: nothing to attend; a call that appends still launches, to write the new keys.
        self.skip = p.device.type == "meta" or p.batch == 0 or (num_rows == 0 and p.new_keys == 0)
        self.device_index = p.device.index if p.device.type == "cuda" else None

        block_d = padded_head_dim(p.head_dim)
        merge_rows = min(config.block_m, triton.next_power_of_2(max(packed_rows, 1)))  # a tile's packed rows
        self.attend_launch = _Launch(
            kvcache_attention_kernel, (p.batch * p.kv_heads, self.splits, max(1, -(-packed_rows // config.block_m))),
            dict(HEAD_DIM=p.head_dim, BLOCK_D=block_d, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                 PAGE_SIZE=p.page_size, HAS_SEQLENS=p.seqlens_on_device, HAS_BATCH_IDX=p.has_batch_idx,
                 HAS_LEFTPAD=p.has_leftpad, APPEND=p.new_keys > 0,
                 HAS_LEFT=p.window_left is not None, HAS_RIGHT=p.window_right is not None,
                 ROTARY_DIM=p.rotary_dim, ROTARY_INTERLEAVED=p.rotary_interleaved, ROTARY_AT_ROWS=p.rotary_at_rows,
                 SPLIT=self.splits > 1, DOT_PRECISION=dot_precision(p.dtype),
                 FUSED_SCALE=p.scale > 0 and not p.softcap and not p.alibi, DOT_FP32=interpreter_upcasts(p.dtype),
                 SOFTCAP=softcap_tanh(p) if p.softcap else NO_SOFTCAP, ALIBI=bool(p.alibi), SINKS=p.has_sinks,
                 VARLEN_Q=p.varlen, ONE_RANGE=config.one_range, MERGE_ROWS=merge_rows,
                 MERGE_CHUNKS=merge_group(merge_rows, block_d, config.num_warps, self.splits), TMA=False),
            config.num_warps, config.num_stages)
        # Split: one arrival counter per (batch and KV head, packed block), zeros between launches
        # (the last chunk to arrive resets its own): one buffer per stream, and one for CUDA graphs,
        # whose small decodes would otherwise pay a fill kernel on every replay (1 us at B1).
        self.arrivals = None if self.splits == 1 else StreamCounters(
            self.attend_launch.grid[0] * self.attend_launch.grid[2], p.device, graph_buffer=True)
        # With bulk copies: the (shape, strides) of the K and V caches' descriptors, set by the first call.
        self.cache_views = None

    def _prepare(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, block_table, alibi_slopes, sinks):
        """The first call's strides (fixed by the signature) join the integer arguments."""
        p = self.params
        # qk_scale: log2 units, or the softcap's tanh argument (the softcap_scale multiplies the tanh)
        qk_scale = p.scale / p.softcap if p.softcap else p.scale * LOG2_E
        alibi_strides = (0, 0) if alibi_slopes is None else ((0,) + alibi_slopes.stride())[-2:]
        if p.varlen:  # sequences are rows of the packed tensors: batch strides 0
            q_strides = (0, *q.stride())
            out_strides = (0, p.q_heads * p.head_dim, p.head_dim, 1)
            lse_strides = (0, p.total_q)
        else:
            q_strides = q.stride()
            out_strides = (p.seqlen_q * p.q_heads * p.head_dim, p.q_heads * p.head_dim, p.head_dim, 1)
            lse_strides = (p.q_heads * p.seqlen_q, p.seqlen_q)
        # Bulk copies: the cache's strides and alignment (part of the signature) must suit them.
        tma = (self.config.tma and TensorDescriptor is not None
               and _tma_compatible(k_cache) and _tma_compatible(v_cache))
        self.attend_launch.constants["TMA"] = tma
        self.cache_views = (_rows_view(k_cache), _rows_view(v_cache)) if tma else None
        self.attend_launch.fixed = (
            *q_strides, *k_cache.stride(), *v_cache.stride(), *_strides(k, 4), *_strides(v, 4),
            *out_strides, *lse_strides, block_table.stride(0) if block_table is not None else 0,
            *_strides(rotary_cos, 2), *_strides(rotary_sin, 2), p.new_keys, p.capacity, p.cache_batches,
            p.rotary_rows, p.kv_heads, p.group, p.seqlen_q, p.total_q, self.partial_lse_shape[1], self.chunk,
            p.window_left or 0, p.window_right or 0, qk_scale, *alibi_strides,
            sinks.stride(0) if sinks is not None else 0, p.softcap * LOG2_E)

    def __call__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen,
                 cache_batch_idx, cache_leftpad, block_table, alibi_slopes=None, sinks=None,
                 cu_seqlens_q=None) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(self.out_shape, device=q.device, dtype=q.dtype)
        lse = torch.empty(self.lse_shape, device=q.device, dtype=torch.float32)
        if self.skip:
            return out, lse
        if self.attend_launch.fixed is None:
            self._prepare(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, block_table, alibi_slopes, sinks)
        index = self.device_index
        if index is not None and index != torch.cuda.current_device():
            with torch.cuda.device(index):
                self._launch(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen,
                             cache_batch_idx, cache_leftpad, block_table, alibi_slopes, sinks, cu_seqlens_q, out, lse)
        else:
            self._launch(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen,
                         cache_batch_idx, cache_leftpad, block_table, alibi_slopes, sinks, cu_seqlens_q, out, lse)
        return out, lse

    def _descriptors(self, k_cache, v_cache):
        """The cache's tensor descriptors (with TMA). A compiled kernel's launch reads only their
        tensors, shapes, strides and padding; the JIT (the first call, and every call under the
        interpreter) takes Triton's own."""
        (k_shape, k_strides), (v_shape, v_strides) = self.cache_views
        if self.attend_launch.compiled is None:
            block = [self.config.block_n, self.params.head_dim]
            return (TensorDescriptor(k_cache, k_shape, k_strides, block),
                    TensorDescriptor(v_cache, v_shape, v_strides, block))
        return HostDescriptor(k_cache, k_shape, k_strides), HostDescriptor(v_cache, v_shape, v_strides)

    def _launch(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen,
                cache_batch_idx, cache_leftpad, block_table, alibi_slopes, sinks, cu_seqlens_q, out, lse):
        k_descriptor = v_descriptor = None
        if self.cache_views is not None:
            k_descriptor, v_descriptor = self._descriptors(k_cache, v_cache)
        if self.splits == 1:
            self.attend_launch(q.device, q, k_cache, v_cache, k_descriptor, v_descriptor, k, v, out, lse, None, None,
                               None, cache_seqlens,
                               cache_batch_idx, cache_leftpad, block_table, rotary_cos, rotary_sin, alibi_slopes,
                               sinks, cu_seqlens_q, cache_seqlen)
            return
        partial_out = torch.empty(self.partial_out_shape, device=q.device, dtype=torch.float32)
        partial_lse = torch.empty(self.partial_lse_shape, device=q.device, dtype=torch.float32)
        # One launch: the last chunk of each tile merges the chunks (fmha.backends.triton.kvcache).
        self.attend_launch(q.device, q, k_cache, v_cache, k_descriptor, v_descriptor, k, v, out, lse, partial_out,
                           partial_lse, self.arrivals.get(q.device),
                           cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_cos, rotary_sin,
                           alibi_slopes, sinks, cu_seqlens_q, cache_seqlen)
