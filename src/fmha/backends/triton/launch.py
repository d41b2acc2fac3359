"""Launchers of the portable Triton kernels: grids, strides and constexprs from one AttentionParams.

They take tensors that :mod:`fmha.params` has checked (4-D, one dtype, one device, Hq % Hkv == 0,
non-empty) and an explicit tile config. :class:`PortableForward` is the forward prepared once per
call signature: the first call compiles through Triton's JIT, later calls launch the compiled
kernel directly with the integer arguments computed once.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from ...compat import COMPILE_OPTIONS
from ...params import NO_SCORE_TENSORS, AttentionParams, ScoreTensors
from ...runtime import (INTERPRETED, TensorDescriptor, chains_launches, compiles_to_ptx, compute_capability,
                        multiprocessors, run_compiled, spans_wide_offsets)
from .backward import backward_dkdv_kernel, backward_dq_kernel, backward_preprocess_kernel, sinks_grad_kernel
from .config import DEFAULT_FEATURES, BackwardConfig, ForwardConfig, KernelFeatures, SplitKVConfig, padded_head_dim
from .forward import LOG2_E, attention_forward_kernel
from .scores import (BOOL_MASK, DRAW_BITS, EXACT_TANH, FAST_TANH, FLOAT_MASK, NO_MASK, NO_SOFTCAP,
                     dropout_mask_kernel)
from .split_kv import attention_split_kv_kernel, merge_group, split_kv_combine_kernel
from .varlen import varlen_schedule_kernel

SPLIT_KV_COMBINE_ROWS = 4  # few rows a program: many chunks of each loaded at once
DRAW_LEVELS = 1 << DRAW_BITS.value  # the values of a dropout draw


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products, like PyTorch's default matmul (no TF32).
    return "ieee" if dtype == torch.float32 else "tf32"


def window_bounds(params: AttentionParams) -> tuple[bool, bool, int, int]:
    """``(HAS_LEFT, HAS_RIGHT, lo, hi)``: row i sees keys i + lo <= j <= i + hi (fmha.backends.triton.masking)."""
    options = params.options
    # Packed sequences: each sequence's own Sk - Sq is added in the kernel.
    offset = 0 if options.top_left or params.varlen else params.seqlen_k - params.seqlen_q
    has_left, has_right = options.window_left is not None, options.window_right is not None
    return (has_left, has_right, offset - options.window_left if has_left else 0,
            offset + options.window_right if has_right else 0)


def softcap_tanh(params: AttentionParams) -> int:
    """The SOFTCAP constexpr of a call with a softcap: one ``tanh.approx.f32`` per score for 16-bit
    inputs on NVIDIA GPUs from sm_75 (its relative error, about 2^-11, is of the order of their
    rounding); the exact formula for float32 inputs, under the interpreter (no inline assembly
    there) and on other GPUs."""
    if (params.dtype in (torch.float16, torch.bfloat16) and compiles_to_ptx(params.device)
            and compute_capability(params.device) >= (7, 5)):
        return FAST_TANH
    return EXACT_TANH


def dropout_threshold(dropout_p: float) -> int:
    """A score's 8-bit draw (fmha.backends.triton.scores.dropout_keep) >= this keeps it: ``p · 256``
    to the nearest integer, from 0 (p <= 0: keep all) to 256 (p >= 1: drop all), and between 1 and
    255 for every 0 < p < 1, so a call with dropout always drops and keeps some scores."""
    if dropout_p <= 0:
        return 0
    if dropout_p >= 1:
        return DRAW_LEVELS
    return min(max(math.floor(dropout_p * DRAW_LEVELS + 0.5), 1), DRAW_LEVELS - 1)


def kernel_dropout_p(dropout_p: float) -> float:
    """The drop probability the kernels realise: p to a multiple of 1/256, as FlashAttention-2's
    8-bit draws do (:func:`dropout_threshold`). The kept probabilities are scaled by
    ``1 / (1 - kernel_dropout_p(p))``, so each stays unbiased."""
    return dropout_threshold(dropout_p) / DRAW_LEVELS


def dropout_scale(dropout_p: float) -> float:
    """What the kernels scale kept probabilities by: ``1 / (1 - kernel_dropout_p(p))``, and 0 where
    every probability is dropped (p >= 1) rather than 1/0."""
    kept = 1.0 - kernel_dropout_p(dropout_p)
    return 1.0 / kept if kept > 0 else 0.0


def dropout_keep_mask(rng_state: torch.Tensor, rows: int, keys: int, dropout_p: float, seqlen_q: int | None = None,
                      cu_seqlens_q: torch.Tensor | None = None, block_keys: int = 16) -> torch.Tensor:
    """The (rows, keys) bool pattern the kernels keep for the philox key ``rng_state`` (a testing aid):
    the portable kernels' and the Gluon Hopper kernels', which draw the same bits.

    Rows are numbered as the kernels number them: (batch, head, row) flattened for dense calls,
    ``seqlen_q`` rows each, so the pattern is ``.view(B, Hq, Sq, Sk)``; (head, packed token) for
    packed sequences (``cu_seqlens_q``), with keys the packed total: ``.view(Hq, total_q, total_k)``,
    sequence b's keys counted from its start. Without either, the rows are one sequence.
    ``block_keys`` (a power of two >= 16) is the tile width it is made with; the pattern is the same
    for every width.
    """
    keep = torch.empty((rows, keys), dtype=torch.bool, device=rng_state.device)
    if keep.numel() == 0:
        return keep
    if cu_seqlens_q is not None:
        cu = cu_seqlens_q.to(device=rng_state.device, dtype=torch.int64)
        total = int(cu[-1])
        heads = torch.arange(rows // total, device=cu.device, dtype=torch.int64)[:, None] * total
        starts, lengths = (heads + cu[None, :-1]).flatten(), (cu[1:] - cu[:-1]).repeat(rows // total)
    else:
        seqlen_q = rows if seqlen_q is None else seqlen_q
        starts = torch.arange(0, rows, seqlen_q, device=rng_state.device, dtype=torch.int64)
        lengths = torch.full_like(starts, seqlen_q)
    block = 16
    grid = (starts.numel(), triton.cdiv(max(int(lengths.max()), 1), block), triton.cdiv(keys, block_keys))
    dropout_mask_kernel[grid](rng_state, keep, starts, lengths, keys, dropout_threshold(dropout_p), BLOCK_M=block,
                              BLOCK_N=block_keys, **COMPILE_OPTIONS)
    return keep


class ScoreLaunch:
    """The score features' kernel arguments for one call signature (fmha.backends.triton.scores).

    ``constants``: the SOFTCAP (:func:`softcap_tanh`), ALIBI, MASK, SINKS and DROPOUT constexprs;
    ``scalars``: qk_scale (``scale / softcap`` with a softcap, else ``scale · log2 e``), softcap_scale,
    dropout_threshold and dropout_scale. :meth:`tensors` gives a call's pointers and strides, and the
    key of what Triton specialises on them (a compiled kernel is reused only for the same key).
    """

    __slots__ = ("constants", "scalars", "fused_scale_ok")

    def __init__(self, params: AttentionParams):
        options = params.options
        softcap, p = options.softcap, options.dropout_p
        mask = {"": NO_MASK, "bool": BOOL_MASK}.get(options.attn_mask_kind, FLOAT_MASK)
        self.constants = dict(SOFTCAP=softcap_tanh(params) if softcap > 0 else NO_SOFTCAP, ALIBI=options.has_alibi,
                              MASK=mask, SINKS=options.has_sinks, DROPOUT=p > 0)
        qk_scale = options.scale / softcap if softcap > 0 else options.scale * LOG2_E
        self.scalars = (qk_scale, softcap * LOG2_E, dropout_threshold(p), dropout_scale(p))
        # The forward may fold the scores' last factor into the exponent if it is positive: the scale,
        # or softcap · log2 e after a softcap's tanh. A bias must be added before the row max.
        self.fused_scale_ok = not (options.has_alibi or options.attn_mask_kind) and (softcap > 0 or options.scale > 0)

    @staticmethod
    def tensors(scores: ScoreTensors) -> tuple[tuple, tuple[int, ...], tuple]:
        """``(pointers, strides, key)``: AlibiSlopes, Sinks, Mask, RngState; stride_ab, stride_ah,
        stride_sh, stride_mb, stride_mh, stride_mm, stride_mn (0 for what is off)."""
        alibi, sinks, mask = scores.alibi_slopes, scores.sinks, scores.attn_mask
        strides = [0] * 7
        if alibi is not None:
            strides[0:2] = alibi.stride() if alibi.ndim == 2 else (0, alibi.stride(0))
        if sinks is not None:
            strides[2] = sinks.stride(0)
        if mask is not None:
            strides[3:7] = mask.stride()
        pointers = (alibi, sinks, mask, scores.rng_state)
        key = (tuple(strides), tuple(t is None or t.data_ptr() % 16 == 0 for t in pointers),
               None if mask is None else mask.dtype)
        return pointers, tuple(strides), key


def tma_compatible(tensor: torch.Tensor) -> bool:
    """Whether a (B, H, S, D) tensor, or a packed (total, H, D) one (described as (1, H, total, D)),
    can be described to the bulk tensor copy engine.

    The base and every stride but the last (which must be 1) have to be 16-byte multiples and
    non-zero; a dimension of size 1 is never stepped, so its stride does not matter.
    """
    strides = tensor.stride()
    if strides[-1] != 1 or tensor.data_ptr() % 16:
        return False
    return _strides_tma_compatible(tensor.shape[:-1], strides[:-1], tensor.element_size())


@functools.lru_cache(maxsize=1024)
def _strides_tma_compatible(shape: torch.Size, strides: tuple[int, ...], item: int) -> bool:
    return all(size == 1 or (stride > 0 and stride * item % 16 == 0) for size, stride in zip(shape, strides))


@functools.lru_cache(maxsize=1024)
def descriptor_strides(shape: torch.Size, strides: tuple[int, ...]) -> list[int]:
    # Any 16-byte multiple will do for a dimension that is never stepped. (Cached: callers only read it.)
    return [16 if size == 1 and dim < 3 else stride for dim, (size, stride) in enumerate(zip(shape, strides))]


def _descriptor(tensor: torch.Tensor, block_rows: int, block_d: int):
    return TensorDescriptor(tensor, list(tensor.shape), descriptor_strides(tensor.shape, tensor.stride()),
                            [1, 1, block_rows, block_d])


def packed_strides(tensor: torch.Tensor) -> tuple[int, int, int, int]:
    """A packed (total, H, D) tensor's strides as one batch of (1, H, total, D), batch stride 0."""
    tokens, heads, features = tensor.stride()
    return (0, heads, tokens, features)


class TileList:
    """The longest-first list of tiles of packed sequences (:mod:`fmha.backends.triton.varlen`).

    ``entries`` bounds the tiles of any lengths adding up to ``total``; calling it with the
    cu_seqlens tensor returns the list as 2 · entries int32 (sequence, block) followed by one
    zeroed int32, a tile counter for the kernels that draw tiles (:meth:`counter`), all made on
    the device by one small kernel.
    """

    __slots__ = ("entries", "integers", "constants", "compiled")

    def __init__(self, num_seqs: int, total: int, block: int, from_end: bool, device: torch.device):
        self.entries = max(1, min(total // block + num_seqs, num_seqs * triton.cdiv(total, block)))
        self.integers = (num_seqs, total, self.entries)
        block_seqs = min(1024, max(16, triton.next_power_of_2(num_seqs)))
        # a (depths, sequences) tile of 2,048 entries: 16 int32 a thread in each of the kernel's tensors
        self.constants = dict(BLOCK=block, FROM_END=from_end, BLOCK_SEQS=block_seqs,
                              BLOCK_DEPTHS=max(1, 2048 // block_seqs), PDL=chains_launches(device))
        self.compiled = None

    def __call__(self, cu_seqlens: torch.Tensor) -> torch.Tensor:
        tiles = torch.empty(2 * self.entries + 1, dtype=torch.int32, device=cu_seqlens.device)
        args = (cu_seqlens, tiles, *self.integers)
        if self.compiled is not None:
            run_compiled(self.compiled, 1, cu_seqlens.device, (*args, *self.constants.values()))
            return tiles
        compiled = varlen_schedule_kernel[(1,)](*args, **self.constants, num_warps=4, num_stages=1,
                                                 **COMPILE_OPTIONS)
        if not INTERPRETED:
            assert varlen_schedule_kernel.arg_names[-len(self.constants):] == list(self.constants)
            self.compiled = compiled
        return tiles

    def counter(self, tiles: torch.Tensor) -> torch.Tensor:
        """The zeroed int32 after the list."""
        return tiles[2 * self.entries:]


class PortableForward:
    """The portable forward for one call signature (shapes, strides, dtype, options) and config.

    Calling it writes ``out`` and ``lse``; it returns Triton's compiled kernel (None under the
    interpreter), for resource reports. Packed sequences (varlen) also pass ``cu_seqlens_q`` and
    ``cu_seqlens_k``, and a tile list is made before each launch; score features pass their
    tensors as ``scores``.
    """

    __slots__ = ("params", "config", "features", "constants", "grid", "scores", "window", "compiled", "integers",
                 "tile_list", "score_key")

    def __init__(self, params: AttentionParams, config: ForwardConfig, features: KernelFeatures = DEFAULT_FEATURES):
        has_left, has_right, lo, hi = window_bounds(params)
        varlen = params.varlen
        if varlen:  # tiles come from the list: no persistent loop; rows of one tile may cross sequences: no TMA
            features = KernelFeatures(fused_scale=features.fused_scale, pipeline_qk=features.pipeline_qk,
                                      warp_specialize=features.warp_specialize)
        self.params, self.config, self.features = params, config, features
        self.window = (lo, hi)
        self.scores = ScoreLaunch(params)
        self.constants = dict(
            HEAD_DIM=params.head_dim, BLOCK_D=padded_head_dim(params.head_dim),
            HEAD_DIM_V=params.value_head_dim, BLOCK_DV=padded_head_dim(params.value_head_dim),
            BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            HAS_LEFT=has_left, HAS_RIGHT=has_right, DOT_PRECISION=dot_precision(params.dtype),
            USE_TMA=False, FUSED_SCALE=features.fused_scale and self.scores.fused_scale_ok,
            PIPELINE_QK=features.pipeline_qk, WARP_SPECIALIZE=features.warp_specialize,
            PERSISTENT=features.persistent, VARLEN=varlen, **self.scores.constants, WIDE_OFFSETS=False,
        )
        if varlen:
            self.tile_list = TileList(params.batch, params.total_q, config.block_m, from_end=False, device=params.device)
            self.grid = self.tile_list.entries * params.q_heads
        else:
            self.tile_list = None
            num_tiles = triton.cdiv(params.seqlen_q, config.block_m) * params.batch * params.q_heads
            self.grid = min(num_tiles, multiprocessors(params.device)) if features.persistent else num_tiles
        self.compiled = None
        self.integers = None
        self.score_key = None

    def _integers(self, q, k, v, out, lse) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(the tensors' strides, the sizes and window): the arguments before and after the score strides."""
        p = self.params
        if p.varlen:
            return ((*packed_strides(q), *packed_strides(k), *packed_strides(v), *packed_strides(out),
                     0, lse.stride(0)), (p.batch * p.q_heads, p.q_heads, p.group, p.total_q, p.total_k, *self.window))
        return ((*q.stride(), *k.stride(), *v.stride(), *out.stride(), lse.stride(0), lse.stride(1)),
                (p.batch * p.q_heads, p.q_heads, p.group, p.seqlen_q, p.seqlen_k, *self.window))

    def __call__(self, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, scores=NO_SCORE_TENSORS):
        if self.integers is None:
            self.integers = self._integers(q, k, v, out, lse)
        strides, sizes = self.integers
        tiles = None if self.tile_list is None else self.tile_list(cu_seqlens_q)
        score_pointers, score_strides, score_key = ScoreLaunch.tensors(scores)
        if self.compiled is not None and score_key == self.score_key:
            run_compiled(self.compiled, self.grid, q.device,
                         (q, k, v, out, lse, None, None, None, None, cu_seqlens_q, cu_seqlens_k, tiles,
                          *score_pointers, *strides, *score_strides, *sizes, *self.scores.scalars,
                          *self.constants.values()))
            return self.compiled
        # Through the JIT (the first call, or other score tensors): 64-bit row strides if needed.
        self.constants["WIDE_OFFSETS"] = spans_wide_offsets(q, k, v, out, scores.attn_mask)
        constants = self.constants
        descriptors = (None, None, None, None)
        use_tma = (self.features.tma and TensorDescriptor is not None
                   and all(tma_compatible(t) for t in (q, k, v, out)))
        if use_tma:  # host descriptors vary per call: always through the JIT
            block_m, block_n, block_d, block_dv = (self.config.block_m, self.config.block_n, constants["BLOCK_D"],
                                                   constants["BLOCK_DV"])
            descriptors = (_descriptor(q, block_m, block_d), _descriptor(k, block_n, block_d),
                           _descriptor(v, block_n, block_dv), _descriptor(out, block_m, block_dv))
            constants = {**constants, "USE_TMA": True}
        compiled = attention_forward_kernel[(self.grid,)](
            q, k, v, out, lse, *descriptors, cu_seqlens_q, cu_seqlens_k, tiles, *score_pointers, *strides,
            *score_strides, *sizes, *self.scores.scalars,
            **constants, num_warps=self.config.num_warps, num_stages=self.config.num_stages, **COMPILE_OPTIONS)
        if not (INTERPRETED or use_tma) and self.compiled is None:
            # Later calls of this signature launch it directly (same specialisation: the
            # signature fixes every integer, and the pointers' 16-byte alignment is in its key;
            # the score tensors' strides and alignment are checked per call).
            assert attention_forward_kernel.arg_names[-len(constants):] == list(constants)
            self.compiled, self.score_key = compiled, score_key
        return compiled


class SplitKVForward:
    """The split-KV forward for one call signature: the chunk kernel, then the combine kernel (none
    where one chunk holds every key: the chunk kernel then writes the output itself).

    Both compile through the JIT on the first call and launch directly afterwards.
    """

    __slots__ = ("params", "config", "chunk", "grid", "combine_grid", "constants", "integers", "compiled",
                 "partial_shape", "one_chunk", "combine_options")

    def __init__(self, params: AttentionParams, config: SplitKVConfig):
        has_left, has_right, lo, hi = window_bounds(params)
        p = params
        self.params, self.config = params, config
        blocks = -(-p.seqlen_k // config.block_n)
        self.chunk = -(-blocks // config.splits) * config.block_n
        splits = -(-p.seqlen_k // self.chunk)
        packed_blocks = -(-(p.group * p.seqlen_q) // config.block_m)
        # Chunks and (batch, KV head) pairs share the first axis: the others stop at 65,535.
        self.grid = (splits * p.batch * p.kv_heads, 1, packed_blocks)
        num_rows = p.batch * p.q_heads * p.seqlen_q
        self.combine_grid = (-(-num_rows // SPLIT_KV_COMBINE_ROWS), 1, 1)
        self.partial_shape = (splits, num_rows)
        self.one_chunk = splits == 1  # the chunk kernel writes the output; no combine kernel
        block_d = padded_head_dim(p.head_dim)
        pdl = chains_launches(p.device) and not self.one_chunk
        self.constants = (
            dict(HEAD_DIM=p.head_dim, BLOCK_D=block_d, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                 HAS_LEFT=has_left, HAS_RIGHT=has_right, DOT_PRECISION=dot_precision(p.dtype), ONE_CHUNK=self.one_chunk,
                 PDL=pdl, WIDE_OFFSETS=False),
            dict(HEAD_DIM=p.head_dim, BLOCK_D=block_d, BLOCK_ROWS=SPLIT_KV_COMBINE_ROWS,
                 CHUNKS=merge_group(SPLIT_KV_COMBINE_ROWS, block_d, 4, splits, registers=128), PDL=pdl))
        self.combine_options = {"launch_pdl": True} if pdl else {}
        self.integers = ((num_rows, p.kv_heads, p.group, p.seqlen_q, p.seqlen_k, lo, hi,
                          p.options.scale * LOG2_E, self.chunk), (num_rows, p.q_heads, p.seqlen_q, splits))
        self.compiled = None

    def __call__(self, q, k, v, out, lse):
        splits, num_rows = self.partial_shape
        if self.one_chunk:  # the partials are not read: any fp32 pointer stands in
            partial_out = partial_lse = lse
        else:
            partial_out = torch.empty((splits, num_rows, self.params.head_dim), device=q.device, dtype=torch.float32)
            partial_lse = torch.empty((splits, num_rows), device=q.device, dtype=torch.float32)
        out_strides = out.stride()
        chunk_args = (q, k, v, out, lse, partial_out, partial_lse, *q.stride(), *k.stride(), *v.stride(), *out_strides,
                      *self.integers[0])
        if self.compiled is not None:
            chunk_kernel, combine_kernel = self.compiled
            run_compiled(chunk_kernel, self.grid, q.device, (*chunk_args, *self.constants[0].values()))
            if not self.one_chunk:
                run_compiled(combine_kernel, self.combine_grid, q.device,
                             (partial_out, partial_lse, out, lse, *out_strides, *self.integers[1],
                              *self.constants[1].values()))
            return chunk_kernel
        self.constants[0]["WIDE_OFFSETS"] = spans_wide_offsets(q, k, v, out)
        chunk_kernel = attention_split_kv_kernel[self.grid](
            *chunk_args, **self.constants[0], num_warps=self.config.num_warps, num_stages=self.config.num_stages,
            **COMPILE_OPTIONS)
        combine_kernel = None
        if not self.one_chunk:
            combine_kernel = split_kv_combine_kernel[self.combine_grid](
                partial_out, partial_lse, out, lse, *out_strides, *self.integers[1], **self.constants[1], num_warps=4,
                num_stages=1, **self.combine_options, **COMPILE_OPTIONS)
        if not INTERPRETED:
            assert attention_split_kv_kernel.arg_names[-len(self.constants[0]):] == list(self.constants[0])
            assert split_kv_combine_kernel.arg_names[-len(self.constants[1]):] == list(self.constants[1])
            self.compiled = (chunk_kernel, combine_kernel)
        return chunk_kernel


def launch_forward(q, k, v, out, lse, params: AttentionParams, config: ForwardConfig,
                   features: KernelFeatures = DEFAULT_FEATURES):
    """One forward launch into preallocated ``out`` (B, Hq, Sq, D) and ``lse`` (B, Hq, Sq) fp32."""
    return PortableForward(params, config, features)(q, k, v, out, lse)


def launch_backward(q, k, v, out, dout, lse, dq, dk, dv, params: AttentionParams, config: BackwardConfig,
                    cu_seqlens_q=None, cu_seqlens_k=None, scores: ScoreTensors = NO_SCORE_TENSORS) -> None:
    """Writes dq, dk, dv (shapes and dtypes of q, k, v) from the forward's out and LSE, and the sinks'
    gradient into ``scores.sinks_grad`` when the call has sinks, and the attn_mask's into
    ``scores.attn_mask_grad`` when that is given. v, out, dout and dv have the value head dim.

    Packed sequences (varlen) pass their cu_seqlens; the tensors are then (total, H, D).
    """
    p = params
    head_dim, head_dim_v, num_q_heads, num_kv_heads = p.head_dim, p.value_head_dim, p.q_heads, p.kv_heads
    block_d, block_dv = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    has_left, has_right, lo, hi = window_bounds(params)
    scale = params.options.scale
    delta = torch.empty_like(lse)  # the LSE's layout, so the kernels index both alike
    if p.varlen:
        strides = [packed_strides(t) for t in (q, k, v, out, dout, dk, dv, dq)]
        rows, keys, batch, lse_strides = p.total_q, p.total_k, 1, (0, lse.stride(0))
    else:
        strides = [t.stride() for t in (q, k, v, out, dout, dk, dv, dq)]
        rows, keys, batch, lse_strides = p.seqlen_q, p.seqlen_k, p.batch, lse.stride()[:2]
    q_strides, k_strides, v_strides, out_strides, dout_strides, dk_strides, dv_strides, dq_strides = strides
    wide = spans_wide_offsets(q, k, v, out, dout, dq, dk, dv, scores.attn_mask)
    preprocess_block = 16 if INTERPRETED else 64
    # The preprocess is per row: packed sequences are one batch of total_q rows.
    backward_preprocess_kernel[(triton.cdiv(rows, preprocess_block) * batch * num_q_heads,)](
        out, dout, delta, *out_strides, *dout_strides, num_q_heads, rows,
        HEAD_DIM=head_dim_v, BLOCK_D=block_dv, BLOCK_M=preprocess_block, WIDE_OFFSETS=wide, **COMPILE_OPTIONS,
    )
    if scores.sinks is not None:  # the LSE counts the sinks: their gradient needs only it and delta
        sinks_grad_kernel[(num_q_heads,)](
            lse, delta, scores.sinks, scores.sinks_grad, *lse_strides, scores.sinks.stride(0), batch, rows,
            BLOCK=preprocess_block * 16, **COMPILE_OPTIONS)
    score_launch = ScoreLaunch(params)
    (alibi, _, mask, rng_state), score_strides, _ = ScoreLaunch.tensors(scores)
    stride_ab, stride_ah, _, *mask_strides = score_strides
    qk_scale, softcap_scale, threshold, dropout_scale = score_launch.scalars
    score_constants = dict(score_launch.constants)
    del score_constants["SINKS"]  # the LSE counts them: the backward kernels never see them
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv,
                  HAS_LEFT=has_left, HAS_RIGHT=has_right, DOT_PRECISION=dot_precision(q.dtype), VARLEN=p.varlen,
                  **score_constants, WIDE_OFFSETS=wide,
                  num_warps=config.num_warps, num_stages=config.num_stages, **COMPILE_OPTIONS)
    group_size = num_q_heads // num_kv_heads
    # Each kernel keeps block_n rows resident (keys for dK/dV, queries for dQ) and streams
    # block_m rows of the other side past them.
    if p.varlen:
        key_tiles = TileList(p.batch, keys, config.block_n, from_end=True, device=p.device)
        query_tiles = TileList(p.batch, rows, config.block_n, from_end=False, device=p.device)
        dkdv_tiles, dq_tiles = key_tiles(cu_seqlens_k), query_tiles(cu_seqlens_q)
        dkdv_grid = (key_tiles.entries * num_kv_heads, 1)
        dq_grid = (query_tiles.entries * num_q_heads, 1)
    else:
        dkdv_tiles = dq_tiles = None
        dkdv_grid = (triton.cdiv(keys, config.block_n) * batch * num_kv_heads, 1)
        dq_grid = (triton.cdiv(rows, config.block_n) * batch * num_q_heads, 1)
    backward_dkdv_kernel[dkdv_grid](
        q, k, v, dout, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, dkdv_tiles, alibi, mask, rng_state,
        *q_strides, *k_strides, *v_strides, *dout_strides, *dk_strides, *dv_strides, *lse_strides,
        stride_ab, stride_ah, *mask_strides,
        num_q_heads, num_kv_heads, group_size, rows, keys, lo, hi, scale, qk_scale,
        softcap_scale, threshold, dropout_scale,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, **common,
    )
    mask_grad = scores.attn_mask_grad  # (B, Hq, Sq, Sk) float32, contiguous, or None
    backward_dq_kernel[dq_grid](
        q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, dq_tiles, alibi, mask, rng_state,
        delta if mask_grad is None else mask_grad,
        *q_strides, *k_strides, *v_strides, *dout_strides, *dq_strides, *lse_strides,
        stride_ab, stride_ah, *mask_strides, *((0, 0, 0) if mask_grad is None else mask_grad.stride()[:3]),
        num_q_heads, group_size, rows, keys, lo, hi, scale, qk_scale,
        softcap_scale, threshold, dropout_scale,
        BLOCK_M=config.block_n, BLOCK_N=config.block_m, MASK_GRAD=mask_grad is not None, **common,
    )

