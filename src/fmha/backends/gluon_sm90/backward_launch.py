"""Launcher of the Gluon Hopper backward: a row preparation kernel, the fused dK/dV/dQ kernel, and
dQ's conversion from the fp32 buffer."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
from triton.experimental.gluon import language as gl

from ...compat import COMPILE_OPTIONS, GluonASTSource
from ...params import AttentionParams
from ...runtime import CachedLaunch, KernelBuildError, multiprocessors, run_compiled, spans_wide_offsets
from ..triton.backward import sinks_grad_kernel
from ..triton.backward_rows import backward_rows_kernel, finish_dq_kernel
from ..triton.launch import TileList, tma_compatible, window_bounds
from .backward import CONSUMER_KEYS, attention_backward_hopper_kernel, backward_registers
from .launch import (_MASK_POINTER_TYPES, _MASK_STRIDE_ARGS, NO_FEATURES, ScoreFeatures, _HostDescriptor, _shared_layout,
                     aligned_rows, build_gluon, score_arguments)
from .schedule import product_columns, tile_head_dim

KEYS_PER_CONSUMER = CONSUMER_KEYS.value

ROWS_BLOCK = 64  # rows per program of the preparation and dQ conversion kernels


@dataclass(frozen=True)
class HopperBackwardSchedule:
    """How the Gluon backward runs (see :mod:`fmha.backends.gluon_sm90.backward`).

    ``consumers`` warpgroups of 64 keys each; ``block_m`` query rows per step through a ring of
    ``stages`` slots. The consumers split dQ's columns, 64 each, or where the head dim is too
    narrow for that (64), take turns computing the whole tile. ``dynamic``: persistent programs take
    key blocks one at a time from a counter (:mod:`fmha.backends.gluon_sm90.tile_queue`) instead of
    one program per key block. ``lse_early``: a step reads its rows' LSE from shared memory while
    its first products run, not after them (16 more registers live across them). ``dq_late``: a
    step's dQ tile is stored and added after the next step has issued its first products (its 32
    registers live across them; D = 64 only: the D = 128 consumer has no registers to spare).
    Builds with softcap, ALiBi or dropout, whose registers are already short, take neither.
    ``dq_early``: where each consumer computes its columns of dQ (D = 128), a step's dQ product is
    issued behind dK and dV instead of after waiting for them (calls with no causal mask or window
    only: with one, ptxas schedules the loops worse and the calls lose 2-5%). ``head_group``:
    causal calls of up to 8,192 keys take the key blocks of that many heads at a time, first keys
    first across them (:func:`fmha.backends.gluon_sm90.backward._program_block`), so that the last
    blocks to start are short ones.
    ``kv_registers``: each consumer holds its K and V rows in registers, the A operands of Sᵀ = K Qᵀ
    and dPᵀ = V dOᵀ, which then read only Qᵀ and dOᵀ from shared memory (D = 64 only: at D = 128
    the 64 registers spill; dropout builds, whose draws need the registers, keep them in shared
    memory).
    """

    backend: ClassVar[str] = "gluon_sm90"

    block_m: int = 64
    stages: int = 2
    consumers: int = 2
    dynamic: bool = False
    lse_early: bool = False
    dq_late: bool = False
    dq_early: bool = False
    kv_registers: bool = False
    head_group: int = 0

    def __post_init__(self):
        checks = {"block_m": self.block_m in (64, 128), "stages": 1 <= self.stages <= 4,
                  "consumers": self.consumers in (1, 2)}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"HopperBackwardSchedule.{name}: {getattr(self, name)!r} is not a valid choice")

    @property
    def block_n(self) -> int:
        return self.consumers * KEYS_PER_CONSUMER

    def dq_alternate(self, head_dim: int) -> bool:
        """Whether the consumers take turns computing dQ's tile (else each computes its columns)."""
        return head_dim // self.consumers < 64

    def dq_block(self, head_dim: int) -> tuple[int, int]:
        """(rows, columns) of dQ that one consumer adds per step."""
        return self.block_m, head_dim if self.dq_alternate(head_dim) else head_dim // self.consumers

    def text(self) -> str:
        return "HopperBackwardSchedule(" + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items()) + ")"


def default_backward_schedule(head_dim: int) -> HopperBackwardSchedule:
    """On the H100 (docs/perf.md, "The Hopper backward" and the sections after it): at D = 64 tiles taken one at a time
    (1.02-1.07x), dQ stored late (1.02-1.05x) and K and V in registers (1.03-1.08x); at D = 128 one
    program per key block (shared memory holds one K/V block, so the next tile's cannot load early;
    dynamic tiles lose 4-11% on causal, window and packed cases), the LSE read early
    (1.01-1.03x; at D = 64 it loses 1-3%) and, without a causal mask or window, dQ's product issued
    early (1.05x); causal heads of up to 8k keys in groups of four (1.02-1.03x at 4k-8k)."""
    if head_dim <= 64:
        return HopperBackwardSchedule(dynamic=True, dq_late=True, kv_registers=True, head_group=4)
    return HopperBackwardSchedule(lse_early=True, dq_early=True, head_group=4)


@functools.lru_cache(maxsize=None)
def _accumulator_layout(rows: int, columns: int):
    """Shared layout of an fp32 dQ tile on its way to the bulk reduce-add."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, columns], gl.float32)


# Row statistics: a flat fp32 vector, copied in blocks of BLOCK_M without a swizzle.
_ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)

_STRIDE_ARGS = ("stride_kn", "stride_kh", "stride_ab", "stride_ah")
_INTEGER_ARGS = ("padded_q", "num_q_heads", "num_kv_heads", "group_size", "seqlen_q", "seqlen_k", "lo", "hi", "num_tiles")


def hopper_backward_source(dtype: torch.dtype, head_dim: int, has_left: bool, has_right: bool,
                           schedule: HopperBackwardSchedule, compute_dq: bool = True,
                           features: ScoreFeatures = NO_FEATURES, varlen: bool = False):
    """The Gluon backward's compile source for one static configuration, and its constexpr values
    (``head_dim``: the tiles' width, :func:`fmha.backends.gluon_sm90.schedule.tile_head_dim`; ``features.sinks`` changes nothing in the kernel: the LSE counts them; ``varlen``: packed
    sequences; ``features.dropout``: the forward's pattern, regenerated)."""
    element = "bf16" if dtype == torch.bfloat16 else "fp16"

    def descriptor_type(rows: int) -> str:
        return f"tensordesc<{element}[1,1,{rows},{head_dim}],{_shared_layout(rows, head_dim, dtype)!r}>"

    dq_block = schedule.dq_block(head_dim)
    constants = {"BLOCK_M": schedule.block_m, "STAGES": schedule.stages, "HAS_LEFT": has_left,
                 "HAS_RIGHT": has_right, "CONSUMERS": schedule.consumers, "COMPUTE_DQ": compute_dq,
                 "DQ_ALTERNATE": schedule.dq_alternate(head_dim),
                 "LSE_EARLY": schedule.lse_early and not features.modifies_scores,
                 "DQ_LATE": schedule.dq_late and compute_dq and not features.modifies_scores,
                 "DQ_EARLY": schedule.dq_early and compute_dq and not (has_left or has_right),
                 "SOFTCAP": features.softcap, "ALIBI": features.alibi, "VARLEN": varlen, "DROPOUT": features.dropout,
                 "DYNAMIC": schedule.dynamic, "MASK": features.mask_constexpr,
                 "KV_REGISTERS": schedule.kv_registers and not features.dropout,
                 "HEAD_GROUP": schedule.head_group if has_right and not has_left and not varlen else 0}
    signature = {"q_desc": descriptor_type(schedule.block_m), "k_desc": descriptor_type(schedule.block_n),
                 "v_desc": descriptor_type(schedule.block_n), "do_desc": descriptor_type(schedule.block_m),
                 "dk_desc": descriptor_type(KEYS_PER_CONSUMER), "dv_desc": descriptor_type(KEYS_PER_CONSUMER),
                 "dq_desc": f"tensordesc<fp32[1,1,{dq_block[0]},{dq_block[1]}],"
                            f"{_accumulator_layout(*dq_block)!r}>",
                 "lse_desc": f"tensordesc<fp32[{schedule.block_m}],{_ROW_LAYOUT!r}>",
                 "delta_desc": f"tensordesc<fp32[{schedule.block_m}],{_ROW_LAYOUT!r}>", "AlibiSlopes": "*fp32",
                 "RngState": "*i64",
                 "CuSeqlensQ": "*i32", "CuSeqlensK": "*i32", "Tiles": "*i32", "DK": f"*{element}", "DV": f"*{element}",
                 "Lse2": "*fp32", "Delta": "*fp32", "TileCounter": "*i32", "Mask": _MASK_POINTER_TYPES[features.mask],
                 **dict.fromkeys(_STRIDE_ARGS, "i32"), **dict.fromkeys(_MASK_STRIDE_ARGS, "i64"),
                 **dict.fromkeys(_INTEGER_ARGS, "i32"), "dropout_threshold": "i32", "scale": "fp32", "qk_scale": "fp32",
                 "softcap_scale": "fp32", "dropout_scale": "fp32",
                 **dict.fromkeys(constants, "constexpr")}
    assert list(signature) == attention_backward_hopper_kernel.arg_names
    return (GluonASTSource(attention_backward_hopper_kernel, signature, constants,
                           aligned_rows(signature, ("DK", "DV"), ("stride_kn", "stride_kh"), dtype)),
            tuple(constants.values()))


def hopper_backward_options(schedule: HopperBackwardSchedule) -> dict:
    return {"num_warps": 4, "maxnreg": backward_registers(schedule.consumers)[0], **COMPILE_OPTIONS}


@functools.lru_cache(maxsize=None)
def compiled_hopper_backward(device: torch.device, dtype: torch.dtype, head_dim: int, has_left: bool,
                             has_right: bool, schedule: HopperBackwardSchedule, compute_dq: bool = True,
                             features: ScoreFeatures = NO_FEATURES, varlen: bool = False):
    """Compiled once per device and static configuration; a failed build returns a
    :class:`fmha.runtime.KernelBuildError` (remembered), and the portable backward runs."""
    return build_gluon(device, lambda: hopper_backward_source(dtype, head_dim, has_left, has_right, schedule, compute_dq,
                                                              features, varlen),
                       hopper_backward_options(schedule), "backward")


def backward_tensors_ok(*tensors: torch.Tensor) -> bool:
    """Whether every (B, H, S, D) tensor, or packed (total, H, D) one, can be described to TMA."""
    return all(tma_compatible(tensor) for tensor in tensors)


def as_batch_of_one(tensor: torch.Tensor) -> torch.Tensor:
    """A packed (total, H, D) tensor as the (1, H, total, D) view the kernels index."""
    return tensor.unsqueeze(0).transpose(1, 2)


@dataclass(frozen=True)
class _RowLaunches:
    """The backward's passes over rows: the preparation (LSE in log2 units, delta, dQ's buffer
    zeroed), the sinks' gradient and dQ's conversion."""

    rows: CachedLaunch
    sinks_grad: CachedLaunch
    finish_dq: CachedLaunch


def _row_launches(head_dim: int, wide_offsets: bool) -> _RowLaunches:
    """New handles per call signature (HopperBackward), whose integers stay fixed: a few keys each;
    ``wide_offsets``: 64-bit row strides (:func:`fmha.runtime.spans_wide_offsets`)."""
    per_row = dict(HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=ROWS_BLOCK,
                   WIDE_OFFSETS=wide_offsets)
    return _RowLaunches(CachedLaunch(backward_rows_kernel, per_row, num_warps=4, **COMPILE_OPTIONS),
                        CachedLaunch(sinks_grad_kernel, dict(BLOCK=1024, LSE_LOG2=True), **COMPILE_OPTIONS),
                        CachedLaunch(finish_dq_kernel, per_row, num_warps=4, **COMPILE_OPTIONS))


def _row_passes(row_launches: dict, rows_grid: tuple, p: AttentionParams, batch: int, seqlen_q: int, padded_q: int,
                dout, out, lse, dq, scores):
    """The passes before a Gluon backward: the LSE in log2 units, delta and the zeroed dQ buffer
    (and the sinks' gradient, which needs only those). Returns ``(launches, lse2, delta, dq_accum,
    counter)``; ``row_launches`` keeps the launch handles by dout's strides."""
    rows = batch * p.q_heads * padded_q
    # One allocation: the LSE (log2), delta, the dQ buffer and the tile counter, which the rows
    # pass zeroes; rows is a multiple of 128, so every part starts 16-byte aligned for TMA.
    scratch = torch.empty(rows * (2 + p.head_dim) + 4, device=dout.device, dtype=torch.float32)
    lse2, delta, dq_accum = scratch[:rows], scratch[rows:2 * rows], scratch[2 * rows:-4]
    counter = scratch[-4:].view(torch.int32)
    launches = row_launches.get(dout.stride())
    if launches is None:
        launches = row_launches[dout.stride()] = _row_launches(p.head_dim, spans_wide_offsets(out, dout, dq))
    launches.rows(rows_grid, dout.device, out, dout, lse, delta, lse2, dq_accum, counter, *out.stride(),
                  *dout.stride(), *lse.stride()[:2], p.q_heads, seqlen_q, padded_q)
    if scores is not None and scores.sinks is not None:
        launches.sinks_grad((p.q_heads,), dout.device, lse2, delta, scores.sinks, scores.sinks_grad,
                            p.q_heads * padded_q, padded_q, scores.sinks.stride(0), batch, seqlen_q)
    return launches, lse2, delta, dq_accum, counter


class HopperBackward:
    """The Gluon backward for one call signature; calling it writes dq, dk and dv, and with sinks
    ``scores.sinks_grad`` (``scores=ScoreTensors(...)`` for calls with score features)."""

    __slots__ = ("schedule", "compiled", "grid", "integers", "device", "padded_q", "rows_grid", "params", "batch",
                 "seqlen_q", "tile_list", "row_launches")

    def __init__(self, params: AttentionParams, schedule: HopperBackwardSchedule):
        has_left, has_right, lo, hi = window_bounds(params)
        features = ScoreFeatures.of(params.options)
        tile_dim = tile_head_dim(params.head_dim)
        built = compiled_hopper_backward(params.device, params.dtype, tile_dim, has_left, has_right, schedule,
                                         features=features, varlen=params.varlen)
        if isinstance(built, KernelBuildError):
            raise built
        self.params, self.schedule, self.device = params, schedule, params.device
        self.compiled, constants = built
        if params.varlen:  # one batch of the packed rows; programs take key blocks from the list
            self.batch, self.seqlen_q, seqlen_k = 1, params.total_q, params.total_k
            self.tile_list = TileList(params.batch, params.total_k, schedule.block_n, from_end=True, device=params.device)
            self.grid = self.tile_list.entries * params.kv_heads
        else:
            self.batch, self.seqlen_q, seqlen_k = params.batch, params.seqlen_q, params.seqlen_k
            self.tile_list = None
            self.grid = -(-seqlen_k // schedule.block_n) * params.batch * params.kv_heads
        num_tiles = self.grid
        if schedule.dynamic:  # persistent programs take the tiles from a counter
            self.grid = min(num_tiles, multiprocessors(params.device))
        self.padded_q = -(-self.seqlen_q // 128) * 128
        self.row_launches = {}  # by dout's strides: out and dq are fmha's, dout comes with each call
        self.rows_grid = (self.padded_q // ROWS_BLOCK * self.batch * params.q_heads,)
        threshold, dropout_factor = features.dropout_scalars(params.options)
        self.integers = (self.padded_q, params.q_heads, params.kv_heads, params.group, self.seqlen_q,
                         seqlen_k, lo, hi, num_tiles, threshold, params.options.scale,
                         *features.scalars(params.options), dropout_factor, *constants)

    def text(self) -> str:
        return self.schedule.text()

    def __call__(self, dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q=None, cu_seqlens_k=None,
                 scores=None) -> None:
        p = self.params
        if p.varlen:  # every tensor as its (1, H, total, D) view; the LSE (Hq, total) as (1, Hq, total)
            tiles = self.tile_list(cu_seqlens_k)
            sequences = (cu_seqlens_q, cu_seqlens_k, tiles)
            packed_strides = dk.stride()[:2]
            dout, q, k, v, out, dq, dk, dv = (as_batch_of_one(t) for t in (dout, q, k, v, out, dq, dk, dv))
            lse = lse.unsqueeze(0)
        else:
            sequences, packed_strides = (lse, lse, lse), (0, 0)  # not read
        batch, seqlen_q = self.batch, self.seqlen_q
        rows = batch * p.q_heads * self.padded_q
        head_dim = p.head_dim
        launches, lse2, delta, dq_accum, counter = _row_passes(self.row_launches, self.rows_grid, p, batch, seqlen_q,
                                                               self.padded_q, dout, out, lse, dq, scores)
        alibi, _, (stride_ab, stride_ah, _) = score_arguments(scores, lse2)
        rng_state = lse2 if scores is None or scores.rng_state is None else scores.rng_state
        accum = dq_accum.view(batch, p.q_heads, self.padded_q, head_dim)
        descriptors = tuple(_HostDescriptor(t) for t in (q, k, v, dout, dk, dv, accum))
        row_stats = (_HostDescriptor(lse2, [rows], [1]), _HostDescriptor(delta, [rows], [1]))
        mask = None if scores is None else scores.attn_mask
        mask, mask_strides = (lse2, (0, 0, 0, 0)) if mask is None else (mask, mask.stride())  # (B, Hq, Sq, Sk)
        run_compiled(self.compiled, self.grid, self.device,
                     (*descriptors, *row_stats, alibi, rng_state, *sequences, dk, dv, lse2, delta, counter, mask,
                      *packed_strides, stride_ab, stride_ah, *mask_strides, *self.integers))
        launches.finish_dq((-(-seqlen_q // ROWS_BLOCK) * batch * p.q_heads,), q.device, dq_accum, dq, *dq.stride(),
                           p.q_heads, seqlen_q, self.padded_q, p.options.scale)


# The backward of the 256-wide tiles (fmha.backends.gluon_sm90.backward_wide): 64 keys a program,
# two consumers of 128 columns each, one CTA a multiprocessor.
WIDE_TILE_HEAD_DIM = 256
WIDE_BLOCK_M = 64
WIDE_DQ_COLUMNS = 64


def hopper_wide_backward_source(dtype: torch.dtype, has_left: bool, has_right: bool, head_group: int,
                                features: ScoreFeatures = NO_FEATURES, varlen: bool = False,
                                columns: int = WIDE_TILE_HEAD_DIM):
    """The 256-wide backward's compile source for one static configuration, and its constexpr values."""
    from .backward_wide import attention_backward_wide_kernel

    element = "bf16" if dtype == torch.bfloat16 else "fp16"

    def descriptor_type(rows: int) -> str:
        return (f"tensordesc<{element}[1,1,{rows},{WIDE_TILE_HEAD_DIM}],"
                f"{_shared_layout(rows, WIDE_TILE_HEAD_DIM, dtype)!r}>")

    constants = {"BLOCK_M": WIDE_BLOCK_M, "HAS_LEFT": has_left, "HAS_RIGHT": has_right, "SOFTCAP": features.softcap,
                 "ALIBI": features.alibi, "VARLEN": varlen, "DROPOUT": features.dropout,
                 "MASK": features.mask_constexpr, "HEAD_GROUP": 0 if varlen else head_group, "COLUMNS": columns}
    signature = {"q_desc": descriptor_type(WIDE_BLOCK_M), "k_desc": descriptor_type(KEYS_PER_CONSUMER),
                 "v_desc": descriptor_type(KEYS_PER_CONSUMER), "do_desc": descriptor_type(WIDE_BLOCK_M),
                 "dq_desc": f"tensordesc<fp32[1,1,{WIDE_BLOCK_M},{WIDE_DQ_COLUMNS}],"
                            f"{_accumulator_layout(WIDE_BLOCK_M, WIDE_DQ_COLUMNS)!r}>",
                 "DK": f"*{element}", "DV": f"*{element}", "Lse2": "*fp32", "Delta": "*fp32", "AlibiSlopes": "*fp32",
                 "RngState": "*i64", "CuSeqlensQ": "*i32", "CuSeqlensK": "*i32", "Tiles": "*i32",
                 "Mask": _MASK_POINTER_TYPES[features.mask],
                 **dict.fromkeys(("stride_dkb", "stride_dkh", "stride_dkn", "stride_dvb", "stride_dvh", "stride_dvn"),
                                 "i64"),
                 "stride_ab": "i32", "stride_ah": "i32", **dict.fromkeys(_MASK_STRIDE_ARGS, "i64"),
                 **dict.fromkeys(("padded_q", "num_q_heads", "num_kv_heads", "group_size", "seqlen_q", "seqlen_k", "lo",
                                  "hi", "num_tiles", "head_dim", "dropout_threshold"), "i32"),
                 **dict.fromkeys(("scale", "qk_scale", "softcap_scale", "dropout_scale"), "fp32"),
                 **dict.fromkeys(constants, "constexpr")}
    assert list(signature) == attention_backward_wide_kernel.arg_names
    # dK and dV pass backward_tensors_ok, and the head dim is a multiple of 8 (head_dim_refusal).
    attrs = aligned_rows(signature, ("DK", "DV"), ("stride_dkb", "stride_dkh", "stride_dkn", "stride_dvb", "stride_dvh",
                                                   "stride_dvn"), dtype)
    attrs[(list(signature).index("head_dim"),)] = [["tt.divisibility", 8]]
    return (GluonASTSource(attention_backward_wide_kernel, signature, constants, attrs),
            tuple(constants.values()))


@functools.lru_cache(maxsize=None)
def compiled_hopper_wide_backward(device: torch.device, dtype: torch.dtype, has_left: bool, has_right: bool,
                                  head_group: int, features: ScoreFeatures = NO_FEATURES, varlen: bool = False,
                                  columns: int = WIDE_TILE_HEAD_DIM):
    """Compiled once per device and static configuration; a failed build returns a
    :class:`fmha.runtime.KernelBuildError` (remembered), and the portable backward runs."""
    return build_gluon(device, lambda: hopper_wide_backward_source(dtype, has_left, has_right, head_group, features,
                                                                   varlen, columns),
                       hopper_backward_options(HopperBackwardSchedule()), "backward of 256-wide tiles")


class HopperWideBackward:
    """The 256-wide tiles' Gluon backward for one call signature; calling it writes dq, dk and dv,
    and with sinks ``scores.sinks_grad`` (``scores=ScoreTensors(...)`` for calls with score features)."""

    __slots__ = ("compiled", "grid", "integers", "device", "padded_q", "rows_grid", "params", "batch", "seqlen_q",
                 "tile_list", "row_launches", "columns")

    def __init__(self, params: AttentionParams):
        has_left, has_right, lo, hi = window_bounds(params)
        head_group = 4 if has_right and not has_left else 0
        features = ScoreFeatures.of(params.options)
        self.columns = product_columns(params.head_dim)
        built = compiled_hopper_wide_backward(params.device, params.dtype, has_left, has_right, head_group, features,
                                              params.varlen, self.columns)
        if isinstance(built, KernelBuildError):
            raise built
        self.params, self.device = params, params.device
        self.compiled, constants = built
        if params.varlen:  # one batch of the packed rows; program i takes entry i of the key blocks' list
            self.batch, self.seqlen_q, seqlen_k = 1, params.total_q, params.total_k
            self.tile_list = TileList(params.batch, params.total_k, KEYS_PER_CONSUMER, from_end=True,
                                      device=params.device)
            self.grid = self.tile_list.entries * params.kv_heads
        else:
            self.batch, self.seqlen_q, seqlen_k = params.batch, params.seqlen_q, params.seqlen_k
            self.tile_list = None
            self.grid = -(-seqlen_k // KEYS_PER_CONSUMER) * params.batch * params.kv_heads
        self.padded_q = -(-self.seqlen_q // 128) * 128
        self.row_launches = {}  # by dout's strides
        self.rows_grid = (self.padded_q // ROWS_BLOCK * self.batch * params.q_heads,)
        threshold, dropout_factor = features.dropout_scalars(params.options)
        qk_scale, softcap_scale = features.scalars(params.options)
        self.integers = (self.padded_q, params.q_heads, params.kv_heads, params.group, self.seqlen_q, seqlen_k, lo, hi,
                         self.grid, params.head_dim, threshold, params.options.scale, qk_scale, softcap_scale,
                         dropout_factor, *constants)

    def text(self) -> str:
        return (f"backward of 256-wide tiles ({self.columns} columns read; 64 keys a program, two consumers of 128 "
                f"and {self.columns - 128} columns)")

    def __call__(self, dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q=None, cu_seqlens_k=None,
                 scores=None) -> None:
        p = self.params
        if p.varlen:  # every tensor as its (1, H, total, D) view; the LSE (Hq, total) as (1, Hq, total)
            sequences = (cu_seqlens_q, cu_seqlens_k, self.tile_list(cu_seqlens_k))
            dout, q, k, v, out, dq, dk, dv = (as_batch_of_one(t) for t in (dout, q, k, v, out, dq, dk, dv))
            lse = lse.unsqueeze(0)
        batch, seqlen_q = self.batch, self.seqlen_q
        launches, lse2, delta, dq_accum, _ = _row_passes(self.row_launches, self.rows_grid, p, batch, seqlen_q,
                                                         self.padded_q, dout, out, lse, dq, scores)
        if not p.varlen:
            sequences = (lse2, lse2, lse2)  # not read
        alibi, _, (stride_ab, stride_ah, _) = score_arguments(scores, lse2)
        rng_state = lse2 if scores is None or scores.rng_state is None else scores.rng_state
        mask = None if scores is None else scores.attn_mask
        mask, mask_strides = (lse2, (0, 0, 0, 0)) if mask is None else (mask, mask.stride())  # (B, Hq, Sq, Sk)
        accum = dq_accum.view(batch, p.q_heads, self.padded_q, p.head_dim)
        descriptors = tuple(_HostDescriptor(t) for t in (q, k, v, dout, accum))
        run_compiled(self.compiled, self.grid, self.device,
                     (*descriptors, dk, dv, lse2, delta, alibi, rng_state, *sequences, mask, *dk.stride()[:3],
                      *dv.stride()[:3], stride_ab, stride_ah, *mask_strides, *self.integers))
        launches.finish_dq((-(-seqlen_q // ROWS_BLOCK) * batch * p.q_heads,), q.device, dq_accum, dq, *dq.stride(),
                           p.q_heads, seqlen_q, self.padded_q, p.options.scale)
