"""Launcher of the Gluon Hopper forward: compiled once per static configuration, launched directly."""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

import torch
import triton
from triton.experimental.gluon import language as gl

from ...compat import COMPILE_OPTIONS, GluonASTSource, load_compiled, triton_version_problem
from ...params import AttentionParams
from ...runtime import HostDescriptor, KernelBuildError, StreamCounters, multiprocessors, run_compiled
from ..triton.launch import TileList, descriptor_strides, dropout_scale, dropout_threshold, window_bounds
from ..triton.forward import LOG2_E
from .forward import WIDE_LEFT, attention_forward_hopper_kernel
from .scores import (ALIBI_ANY, ALIBI_CAUSAL, ALIBI_OFF, BOOL_MASK, FLOAT_MASK, NO_MASK, PAIRED_MASK_KEYS,
                     SOFTCAP_BOUNDED, SOFTCAP_OFF, SOFTCAP_RUNNING, STRIDED_MASK_KEYS, UNIT_MASK_KEYS)
from .schedule import (CONSUMER_ROWS, PINGPONG_LONG_SOFTMAX, PINGPONG_ON, HopperSchedule, register_budget,
                       product_columns, softcap_kind, tile_head_dim)


@functools.lru_cache(maxsize=None)
def _shared_layout(block_rows: int, head_dim: int, dtype: torch.dtype):
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([1, 1, block_rows, head_dim], element)


class _HostDescriptor(HostDescriptor):
    """A host tensor descriptor of a whole tensor by default, built per call without Gluon's
    TensorDescriptor checks: the backend's support check made them."""

    __slots__ = ()

    def __init__(self, tensor: torch.Tensor, shape=None, strides=None):
        self.base, self.padding = tensor, "zero"
        self.shape = list(tensor.shape) if shape is None else shape
        self.strides = descriptor_strides(tensor.shape, tensor.stride()) if strides is None else strides

    @classmethod
    def packed(cls, tensor: torch.Tensor) -> "_HostDescriptor":
        """A packed (total, H, D) tensor as one batch of (1, H, total, D)."""
        tokens, heads, _ = tensor.stride()
        return cls(tensor, [1, tensor.shape[1], tensor.shape[0], tensor.shape[2]], [16, heads, tokens, 1])

    @classmethod
    def first_head(cls, tensor: torch.Tensor) -> "_HostDescriptor":
        """The first head of a (B, H, S, D) tensor, as (B, 1, S, D) (the heads of k and v expanded
        with stride 0 are one head)."""
        batch, _, rows, dim = tensor.shape
        shape = torch.Size((batch, 1, rows, dim))
        return cls(tensor, list(shape), descriptor_strides(shape, tensor.stride()))

    @classmethod
    def first_head_packed(cls, tensor: torch.Tensor) -> "_HostDescriptor":
        """The first head of a packed (total, H, D) tensor, as (1, 1, total, D)."""
        return cls(tensor, [1, 1, tensor.shape[0], tensor.shape[2]], [16, 16, tensor.stride(0), 1])


@dataclass(frozen=True)
class ScoreFeatures:
    """The score features a Gluon kernel is built with (fmha.backends.gluon_sm90.scores): ``softcap``
    is the SOFTCAP constexpr (0 off, 1 with the running max, 2 (forward only) bounded); ``alibi``
    is the ALIBI constexpr: 0 off, 1 any window, 2 (forward only) no key after a row's position;
    ``dropout``: some probability can be dropped (a p that rounds to 0 drops none: built without);
    ``mask``: SDPA's attn_mask kind (fmha.params.AttentionOptions.attn_mask_kind; forward only),
    ``mask_keys``: how its keys lie (the MASK_KEYS constexpr, :func:`mask_keys_layout`; a call's
    mask picks the build, :class:`HopperForward`)."""

    softcap: int = SOFTCAP_OFF.value
    alibi: int = 0
    sinks: bool = False
    dropout: bool = False
    mask: str = ""
    mask_keys: int = PAIRED_MASK_KEYS.value

    @classmethod
    def of(cls, options) -> "ScoreFeatures":
        softcap = SOFTCAP_RUNNING.value if options.softcap > 0 else SOFTCAP_OFF.value
        return cls(softcap, ALIBI_ANY.value if options.has_alibi else ALIBI_OFF.value, options.has_sinks,
                   dropout_threshold(options.dropout_p) > 0, options.attn_mask_kind)

    @classmethod
    def forward_of(cls, params: AttentionParams) -> "ScoreFeatures":
        """As :meth:`of`, with ALiBi's causal form where every visible key j of row i has
        j <= i + Sk - Sq (ALiBi's position of the row): a right bound at or before it; and the
        softcap's bounded form (a fixed max) where :func:`softcap_kind` allows it."""
        features = cls.of(params.options)
        if features.alibi:
            has_left, has_right, lo, hi = window_bounds(params)
            # Packed sequences add their own Sk - Sq to hi in the kernel; dense bounds include it.
            alibi_offset = 0 if params.varlen else params.seqlen_k - params.seqlen_q
            if has_right and hi <= alibi_offset:
                features = dataclasses.replace(features, alibi=ALIBI_CAUSAL.value)
        if softcap_kind(params) == "bounded":
            features = dataclasses.replace(features, softcap=SOFTCAP_BOUNDED.value)
        return features

    @property
    def modifies_scores(self) -> bool:
        """Whether the kernel computes more per score than the plain softmax (the sinks change only the LSE)."""
        return bool(self.softcap or self.alibi or self.dropout or self.mask)

    @property
    def mask_constexpr(self) -> int:
        """The MASK constexpr (fmha.backends.gluon_sm90.scores): 0 none, 1 bool, 2 float."""
        return {"": NO_MASK.value, "bool": BOOL_MASK.value}.get(self.mask, FLOAT_MASK.value)

    def scalars(self, options) -> tuple[float, float]:
        """``(qk_scale, softcap_scale)``: ``scale / softcap`` and ``softcap · log2 e`` with a softcap,
        else ``scale · log2 e`` (and an unread 0)."""
        if self.softcap:
            return options.scale / options.softcap, options.softcap * LOG2_E
        return options.scale * LOG2_E, 0.0

    @staticmethod
    def dropout_scalars(options) -> tuple[int, float]:
        """``(dropout_threshold, dropout_scale)``: the draw that keeps a probability, and the output's
        factor ``1 / (1 - p)`` (fmha.backends.triton.launch); unread without dropout."""
        return dropout_threshold(options.dropout_p), dropout_scale(options.dropout_p)


NO_FEATURES = ScoreFeatures()


def mask_keys_layout(mask: torch.Tensor) -> int:
    """The MASK_KEYS constexpr of a (B, H, Sq, Sk) attn_mask: paired where Sk is even and every row
    of every (batch, head) starts at a multiple of two elements (strides of dimensions of size 1
    are never multiplied by more than 0)."""
    strides = mask.stride()
    if strides[3] != 1 and mask.shape[3] > 1:
        return STRIDED_MASK_KEYS.value
    pair = 2 * mask.element_size()
    if mask.shape[3] % 2 == 0 and mask.data_ptr() % pair == 0 and all(
            stride % 2 == 0 or size == 1 for size, stride in zip(mask.shape[:3], strides[:3])):
        return PAIRED_MASK_KEYS.value
    return UNIT_MASK_KEYS.value


def takes_turns(schedule: HopperSchedule, features: ScoreFeatures) -> bool:
    """Whether the forward's two consumers take turns issuing their products (HopperSchedule.pingpong).
    Measured on the H100: 4-6% faster with softcap, dropout or two-sided ALiBi, whose softmax
    outlasts the other consumer's products; 1-2% slower on plain D = 128 (docs/perf.md)."""
    if schedule.pingpong == PINGPONG_LONG_SOFTMAX:
        long_softmax = features.softcap or features.dropout or features.alibi == ALIBI_ANY.value
        return long_softmax and schedule.turns_fit
    return schedule.pingpong == PINGPONG_ON


def score_arguments(scores, placeholder: torch.Tensor) -> tuple:
    """``(alibi_slopes, sinks, (stride_ab, stride_ah, stride_sh))`` of a call's ScoreTensors; a
    feature that is off gets ``placeholder`` (never read) and stride 0."""
    alibi = sinks = None
    if scores is not None:
        alibi, sinks = scores.alibi_slopes, scores.sinks
    strides = [0, 0, 0]
    if alibi is not None:
        strides[0:2] = alibi.stride() if alibi.ndim == 2 else (0, alibi.stride(0))
    if sinks is not None:
        strides[2] = sinks.stride(0)
    return (placeholder if alibi is None else alibi, placeholder if sinks is None else sinks, tuple(strides))


_STRIDE_ARGS = ("stride_lh", "stride_om", "stride_oh", "stride_ab", "stride_ah", "stride_sh")
_MASK_STRIDE_ARGS = ("stride_mb", "stride_mh", "stride_mm", "stride_mn")
# The attn_mask's element type by its kind (bool is read as bytes); without a mask, an unread pointer.
_MASK_POINTER_TYPES = {"": "*i8", "bool": "*i8", "float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}
_INTEGER_ARGS = ("num_q_heads", "group_size", "seqlen_q", "seqlen_k", "lo", "hi")


def hopper_forward_source(dtype: torch.dtype, head_dim: int, causal: bool, schedule: HopperSchedule,
                          has_left: int = 0, varlen: bool = False, features: ScoreFeatures = NO_FEATURES,
                          columns: int | None = None):
    """The Gluon forward's compile source for one static configuration, and its constexpr values.

    ``head_dim``: the tiles' width (:func:`fmha.backends.gluon_sm90.schedule.tile_head_dim`); ``causal``: the window has a right bound (HAS_RIGHT); ``has_left``: and a left one (HAS_LEFT,
    :func:`left_bound`: 1, or WIDE_LEFT for a wide window);
    ``varlen``: packed sequences; ``features``: softcap, ALiBi, sinks, dropout and the attn_mask;
    ``columns``: the columns the products read (:func:`fmha.backends.gluon_sm90.schedule.product_columns`;
    None: the tiles' width).

    The integer arguments carry no value specialisation, so one binary serves every shape.
    """
    element = "bf16" if dtype == torch.bfloat16 else "fp16"

    def descriptor_type(rows: int, columns: int = head_dim) -> str:
        return f"tensordesc<{element}[1,1,{rows},{columns}],{_shared_layout(rows, columns, dtype)!r}>"

    output_columns = schedule.output_columns(head_dim)

    constants = {"HEAD_DIM": head_dim, "BLOCK_N": schedule.block_n, "STAGES": schedule.stages,
                 "HAS_LEFT": has_left, "HAS_RIGHT": causal,
                 "CONSUMERS": schedule.consumers, "EMULATED_EXP2": schedule.emulated_exp2,
                 "Q_BUFFERS": schedule.q_buffers, "CTAS_PER_SM": schedule.ctas_per_sm, "VARLEN": varlen,
                 "SOFTCAP": features.softcap, "ALIBI": features.alibi, "SINKS": features.sinks,
                 "DROPOUT": features.dropout, "DYNAMIC": schedule.dynamic,
                 "PINGPONG": takes_turns(schedule, features), "PACK_P": schedule.pack_p,
                 "MASK": features.mask_constexpr,
                 "MASK_KEYS": features.mask_keys,
                 "ROW_SUM_MMA": schedule.row_sum_mma, "OUTPUT_COLUMNS": output_columns,
                 "COLUMNS": head_dim if columns is None else columns}
    signature = {"q_desc": descriptor_type(CONSUMER_ROWS), "k_desc": descriptor_type(schedule.block_n),
                 "v_desc": descriptor_type(schedule.block_n), "o_desc": descriptor_type(CONSUMER_ROWS, output_columns or head_dim),
                 "Lse": "*fp32", "Out": f"*{element}", "CuSeqlensQ": "*i32", "CuSeqlensK": "*i32", "Tiles": "*i32",
                 "AlibiSlopes": "*fp32", "Sinks": "*fp32", "RngState": "*i64", "TileCounter": "*i32",
                 "Mask": _MASK_POINTER_TYPES[features.mask], **dict.fromkeys(_STRIDE_ARGS, "i32"),
                 **dict.fromkeys(_MASK_STRIDE_ARGS, "i64"),
                 **dict.fromkeys(_INTEGER_ARGS, "i32"), "qk_scale": "fp32", "softcap_scale": "fp32",
                 "dropout_threshold": "i32", "dropout_scale": "fp32", "num_tiles": "i32",
                 **dict.fromkeys(constants, "constexpr")}
    assert list(signature) == attention_forward_hopper_kernel.arg_names
    return (GluonASTSource(attention_forward_hopper_kernel, signature, constants,
                           aligned_rows(signature, ("Out",), ("stride_om", "stride_oh"), dtype)),
            tuple(constants.values()))


def aligned_rows(signature: dict, pointers: tuple, strides: tuple, dtype: torch.dtype) -> dict:
    """Compile attributes that say ``pointers`` are 16-byte aligned and ``strides`` (elements)
    16-byte multiples, so that rows stored through them leave in 16-byte pieces. Their tensors
    also have bulk-copy descriptors, which ask the same (:func:`fmha.backends.triton.launch.tma_compatible`;
    a stride of 0 stands for an unused one)."""
    names = list(signature)
    aligned = {**dict.fromkeys(pointers, 16), **dict.fromkeys(strides, 16 // dtype.itemsize)}
    return {(names.index(name),): [["tt.divisibility", value]] for name, value in aligned.items()}


def hopper_compile_options(schedule: HopperSchedule, varlen: bool = False) -> dict:
    """Compile options of the Gluon forward: the launch register count lets ``ctas_per_sm`` CTAs
    share a multiprocessor (:func:`fmha.backends.gluon_sm90.schedule.register_budget`); packed
    sequences launch as the tile list's kernel starts (programmatic dependent launch)."""
    registers = register_budget(schedule.consumers, schedule.ctas_per_sm, schedule.row_sum_mma)[0]
    return {"num_warps": 4, "maxnreg": registers, **({"launch_pdl": True} if varlen else {}), **COMPILE_OPTIONS}


def left_bound(params: AttentionParams, schedule: HopperSchedule) -> int:
    """The HAS_LEFT constexpr: 0 without a left bound; WIDE_LEFT (2) for a causal-style window (right
    bound at or left of the diagonal, bottom-right aligned) at least a tile's rows plus a key block
    wide, so that the masked key blocks at a tile's right end (the right bound's, or K's end) lie
    right of every row's left bound and check only the right side; else 1. (Windows reaching past
    the diagonal would need the width to grow by that reach too; they keep the two-sided mask, as
    they were not measured.)"""
    options = params.options
    if options.window_left is None:
        return 0
    if options.window_right is None or options.window_right > 0 or options.top_left:
        return 1
    wide = options.window_left + options.window_right >= schedule.block_m + schedule.block_n
    return WIDE_LEFT.value if wide else 1


@functools.lru_cache(maxsize=None)
def compiled_hopper_forward(device: torch.device, dtype: torch.dtype, head_dim: int, causal: bool,
                            schedule: HopperSchedule, has_left: int = 0, varlen: bool = False,
                            features: ScoreFeatures = NO_FEATURES, columns: int | None = None):
    """Compiled once per device and static configuration (Triton's disk cache still applies).

    A failed build is remembered too, and raises :class:`fmha.runtime.KernelBuildError` (the
    dispatcher then falls back to the portable kernel) on every later request.
    """
    return build_gluon(device, lambda: hopper_forward_source(dtype, head_dim, causal, schedule, has_left, varlen,
                                                             features, columns),
                       hopper_compile_options(schedule, varlen), "forward")


def build_gluon(device: torch.device, make_source, options: dict, what: str):
    """``(compiled, constexpr values)`` of ``make_source()``'s kernel on ``device``, or the
    :class:`fmha.runtime.KernelBuildError` that says why it failed to build."""
    try:
        source, constants = make_source()
        with torch.cuda.device(device):
            compiled = triton.compile(source, target=triton.runtime.driver.active.get_current_target(), options=options)
            load_compiled(compiled)
    except Exception as error:  # noqa: BLE001 - any compiler failure means: not this kernel
        outside = triton_version_problem()
        return KernelBuildError(f"the Gluon Hopper {what} failed to build with triton {triton.__version__}"
                                f"{f' ({outside})' if outside else ''}: {build_error_summary(error)}")
    return compiled, constants


def build_error_summary(error: BaseException) -> str:
    """The compiler's own message: the innermost cause's first line (Triton wraps it in context),
    and ptxas's first fatal line (which says, say, that a schedule leaves too few registers)."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    fatal = next((line for line in lines[1:] if re.match(r"ptxas\S*\s+fatal", line)), "")  # or ptxas-blackwell
    return f"{type(error).__name__}: {lines[0] if lines else ''}" + (f" ({fatal})" if fatal else "")


class HopperForward:
    """The Gluon forward for one call signature and schedule; calling it writes ``out`` and ``lse``.

    Packed sequences (varlen) also pass ``cu_seqlens_q`` and ``cu_seqlens_k``; their tile list is
    made before each launch. Calls with score features pass ``scores=ScoreTensors(...)``.
    """

    __slots__ = ("schedule", "compiled", "grid", "integers", "scalars", "device", "tile_list", "varlen", "build",
                 "mask_builds", "tile_counters", "kv_descriptor")

    def __init__(self, params: AttentionParams, schedule: HopperSchedule, first_kv_head: bool = False):
        """``first_kv_head``: the calls pass k and v with more heads than ``params.kv_heads`` = 1, all
        one head expanded with stride 0 (which the bulk copy engine cannot step); it reads the first."""
        has_left, has_right, lo, hi = window_bounds(params)
        self.schedule, self.device, self.varlen = schedule, params.device, params.varlen
        if first_kv_head:
            self.kv_descriptor = _HostDescriptor.first_head_packed if params.varlen else _HostDescriptor.first_head
        else:
            self.kv_descriptor = _HostDescriptor.packed if params.varlen else _HostDescriptor
        features = ScoreFeatures.forward_of(params)
        self.build = (params.device, params.dtype, tile_head_dim(params.head_dim), has_right, schedule,
                      left_bound(params, schedule), params.varlen, features, product_columns(params.head_dim))
        built = compiled_hopper_forward(*self.build)
        if isinstance(built, KernelBuildError):
            raise built
        compiled, constants = built
        self.compiled = compiled
        self.mask_builds = {features.mask_keys: compiled}  # by MASK_KEYS
        # dense calls with DYNAMIC (packed ones take the counter zeroed with their tile list)
        self.tile_counters = StreamCounters(1, params.device) if schedule.dynamic and not params.varlen else None
        if params.varlen:
            self.tile_list = TileList(params.batch, params.total_q, schedule.block_m, from_end=False, device=params.device)
            num_tiles = self.tile_list.entries * params.q_heads
            seqlen_q, seqlen_k = params.total_q, params.total_k
        else:
            self.tile_list = None
            num_tiles = -(-params.seqlen_q // schedule.block_m) * params.batch * params.q_heads
            seqlen_q, seqlen_k = params.seqlen_q, params.seqlen_k
        if not schedule.persistent:
            self.grid = num_tiles
        elif has_right and not params.varlen and not schedule.dynamic:  # programs walk pairs of tiles
            self.grid = min((num_tiles + 1) // 2, schedule.ctas_per_sm * multiprocessors(params.device))
        else:
            self.grid = min(num_tiles, schedule.ctas_per_sm * multiprocessors(params.device))
        self.integers = (params.q_heads, params.group, seqlen_q, seqlen_k, lo, hi, *features.scalars(params.options),
                         *features.dropout_scalars(params.options), num_tiles, *constants)

    def __call__(self, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, scores=None):
        kv = self.kv_descriptor
        if self.varlen:
            tiles = self.tile_list(cu_seqlens_q)
            descriptors = (_HostDescriptor.packed(q), kv(k), kv(v), _HostDescriptor.packed(out))
            strides = (lse.stride(0), out.stride(0), out.stride(1))
            sequences = (cu_seqlens_q, cu_seqlens_k, tiles)
        else:  # the sequence arguments are not read: any pointer and integer will do
            descriptors = (_HostDescriptor(q), kv(k), kv(v), _HostDescriptor(out))
            strides = (0, 0, 0)
            sequences = (lse, lse, lse)
        alibi, sinks, score_strides = score_arguments(scores, lse)
        rng_state = lse if scores is None or scores.rng_state is None else scores.rng_state
        if not self.schedule.dynamic:
            counter = lse
        elif self.varlen:  # zeroed with the list
            counter = self.tile_list.counter(tiles)
        else:  # zero again when a launch ends: one per stream
            counter = self.tile_counters.get(q.device)
        compiled = self.compiled
        mask = None if scores is None else scores.attn_mask
        if mask is None:
            mask, mask_strides = lse, (0, 0, 0, 0)
        else:  # (B, Hq, Sq, Sk), stride 0 where it broadcasts
            mask_strides = mask.stride()
            layout = mask_keys_layout(mask)
            compiled = self.mask_builds.get(layout) or self._mask_build(layout)
        run_compiled(compiled, self.grid, self.device,
                     (*descriptors, lse, out, *sequences, alibi, sinks, rng_state, counter, mask, *strides,
                      *score_strides, *mask_strides, *self.integers))
        return compiled

    def _mask_build(self, mask_keys: int):
        """The build for an attn_mask whose keys lie otherwise than the first call's."""
        *build, features, columns = self.build
        built = compiled_hopper_forward(*build, dataclasses.replace(features, mask_keys=mask_keys), columns)
        if isinstance(built, KernelBuildError):
            raise built
        self.mask_builds[mask_keys] = built[0]
        return built[0]
