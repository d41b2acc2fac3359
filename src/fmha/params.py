"""One validated description of an attention call: :class:`AttentionParams`.

Every entry point reduces its arguments to an ``AttentionParams``: the shapes, dtype and device
of q, k and v, plus :class:`AttentionOptions`, everything else about the call (scale, the key
window, the score modifiers, dropout, an explicit kernel choice). Options hold only values a
``torch.library`` schema can carry, and the custom ops' schemas are generated from its fields
(:func:`options_schema`), so a new feature adds a field here, its checks, and kernel code.

Checks raise ``TypeError`` / ``ValueError`` / ``NotImplementedError`` naming the argument,
before anything is launched.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from dataclasses import dataclass

import torch

from .masking import Window
from .runtime import INTERPRETED

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
LAYOUTS = ("dense", "varlen")  # "paged" comes with the KV-cache issue


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """Everything about a call except its tensors; the custom ops carry these fields by name."""

    scale: float
    # The key window (fmha.masking.Window): row i sees pos(i) - left <= j <= pos(i) + right, with
    # pos(i) = i + Sk - Sq, or i when top_left (SDPA's is_causal). None: unbounded side.
    window_left: int | None = None
    window_right: int | None = None
    top_left: bool = False
    layout: str = "dense"
    # What each score becomes (the design's order): scale, softcap * tanh(s / softcap), + ALiBi bias
    # -slope_h * |pos(i) - j| and SDPA's float attn_mask, masking (the window, a bool attn_mask),
    # softmax with a sink term exp(sinks[h]) in each row's denominator, dropout on P. The tensors
    # themselves travel beside the options (ScoreTensors); these fields say which are there.
    softcap: float = 0.0  # 0: off
    has_alibi: bool = False  # alibi_slopes, fp32 (Hq,) or (B, Hq)
    has_sinks: bool = False  # sinks, fp32 (Hq,)
    attn_mask_kind: str = ""  # SDPA's attn_mask: "" none, "bool", or the float mask's dtype ("float16", ...)
    attn_mask_grad: bool = False  # a float attn_mask that requires grad: the backward writes its gradient
    dropout_p: float = 0.0  # random bits from ScoreTensors.rng_state (a philox key drawn per call)
    deterministic: bool = False
    # An explicit kernel choice: "" lets dispatch decide; else the backend's name and its config
    # as integers (fmha.backends.*: ForwardConfig / HopperSchedule .to_ints()).
    backend: str = ""
    config: tuple[int, ...] = ()

    @property
    def masked(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    @property
    def scores_modified(self) -> bool:
        """Whether a score is more than ``scale * q.k`` (softcap, ALiBi, an attn_mask)."""
        return self.softcap > 0.0 or self.has_alibi or bool(self.attn_mask_kind)

    @property
    def score_features(self) -> bool:
        """Any of softcap, ALiBi, sinks, an attn_mask or dropout."""
        return self.scores_modified or self.has_sinks or self.dropout_p > 0.0

    def window(self, seqlen_q: int, seqlen_k: int) -> Window | None:
        if not self.masked:
            return None
        return Window.of(seqlen_q, seqlen_k, left=self.window_left, right=self.window_right, top_left=self.top_left)

    def op_args(self) -> tuple:
        return tuple(getattr(self, field.name) for field in _OPTION_FIELDS)

    @classmethod
    def from_op_args(cls, *args) -> "AttentionOptions":
        values = dict(zip((field.name for field in _OPTION_FIELDS), args))
        values["config"] = tuple(values["config"])
        return cls(**values)


_OPTION_FIELDS = dataclasses.fields(AttentionOptions)
_SCHEMA_TYPES = {"float": "float", "int | None": "int?", "bool": "bool", "str": "str", "float | None": "float?",
                 "tuple[int, ...]": "int[]"}


def options_schema() -> str:
    """The options as ``torch.library`` schema arguments: ``float scale, int? window_left, ...``."""
    return ", ".join(f"{_SCHEMA_TYPES[field.type]} {field.name}" for field in _OPTION_FIELDS)


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """A validated call: q is (batch, q_heads, seqlen_q, head_dim), k (batch, kv_heads, seqlen_k, head_dim)
    and v (batch, kv_heads, seqlen_k, value_head_dim); the output has v's head dim.

    Packed sequences (``options.layout == "varlen"``): q is (total_q, q_heads, head_dim), k
    (total_k, kv_heads, head_dim) and v (total_k, kv_heads, value_head_dim), ``batch`` sequences cut
    by ``cu_seqlens``; seqlen_q and seqlen_k are the caller's max_seqlen hints (tile choice only:
    the kernels read the lengths).
    """

    batch: int
    q_heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    options: AttentionOptions
    total_q: int = 0
    total_k: int = 0
    # v's head dim, and the output's, where it differs from q's and k's (DeepSeek's MLA: 192 and
    # 128); 0 where they are the same, as in most calls.
    head_dim_v: int = 0

    @property
    def value_head_dim(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def varlen(self) -> bool:
        return self.options.layout == "varlen"

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads if self.kv_heads else 1

    @property
    def window(self) -> Window | None:
        return self.options.window(self.seqlen_q, self.seqlen_k)

    @property
    def causal(self) -> bool:
        """Whether any key is hidden from some row (a causal mask or a window)."""
        return self.options.masked

    @property
    def empty(self) -> bool:
        rows = self.total_q if self.varlen else self.batch * self.seqlen_q
        return rows * self.q_heads * self.head_dim == 0

    @property
    def no_keys(self) -> bool:
        return (self.total_k if self.varlen else self.seqlen_k) == 0

    @property
    def lse_shape(self) -> tuple[int, ...]:
        """(B, Hq, Sq); packed sequences: (Hq, total_q), as FlashAttention's varlen functions."""
        if self.varlen:
            return (self.q_heads, self.total_q)
        return (self.batch, self.q_heads, self.seqlen_q)

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions) -> "AttentionParams":
        batch, q_heads, seqlen_q, head_dim = q.shape
        head_dim_v = v.shape[3]
        return cls(batch, q_heads, k.shape[1], seqlen_q, k.shape[2], head_dim, q.dtype, q.device, options,
                   head_dim_v=0 if head_dim_v == head_dim else head_dim_v)

    @classmethod
    def packed(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
               max_seqlen_k: int, options: AttentionOptions) -> "AttentionParams":
        """Packed sequences: q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv),
        ``options.layout == "varlen"``."""
        total_q, q_heads, head_dim = q.shape
        head_dim_v = v.shape[2]
        return cls(cu_seqlens_q.shape[0] - 1, q_heads, k.shape[1], max_seqlen_q, max_seqlen_k, head_dim, q.dtype,
                   q.device, options, total_q, k.shape[0], 0 if head_dim_v == head_dim else head_dim_v)


@dataclass(frozen=True, slots=True)
class ScoreTensors:
    """The tensors of a call's score features, beside its :class:`AttentionOptions` (which say
    which are there). Each is None when its feature is off.

    * ``alibi_slopes``: float32 (Hq,) or (B, Hq);
    * ``sinks``: float32 (Hq,);
    * ``attn_mask``: SDPA's mask as a (B, Hq, Sq, Sk) view, stride 0 where it broadcasts;
    * ``rng_state``: int64 (1,) on the device, the philox key of this call's dropout (fmha.ops.dropout_seed);
    * ``sinks_grad``: float32 (Hq,), written by the backward when sinks are there;
    * ``attn_mask_grad``: float32 (B, Hq, Sq, Sk), the gradient of each score that the attn_mask
      adds to, written by the backward when the options ask for it (``attn_mask_grad``).
    """

    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    rng_state: torch.Tensor | None = None
    sinks_grad: torch.Tensor | None = None
    attn_mask_grad: torch.Tensor | None = None


NO_SCORE_TENSORS = ScoreTensors()


def check_qkv(fn: str, q, k, v, names=("q", "k", "v")) -> None:
    """Raise TypeError/ValueError naming the argument unless q, k, v can be attended."""
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
    head_dim, head_dim_v = q.shape[3], v.shape[3]
    if k.shape[3] != head_dim:
        raise ValueError(f"{fn}: head dim mismatch: {qn} has {head_dim} and {kn} {k.shape[3]} (they must match; "
                         f"{vn}'s may differ)")
    if head_dim == 0 or head_dim_v == 0:
        raise ValueError(f"{fn}: {qn} and {kn} have head dim {head_dim} and {vn} {head_dim_v} (their last dims); "
                         "attention needs at least one feature per head")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{fn}: head dim (last dim of {qn}) must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    if not 1 <= head_dim_v <= MAX_HEAD_DIM:
        raise ValueError(f"{fn}: value head dim (last dim of {vn}) must be between 1 and {MAX_HEAD_DIM}, "
                         f"got {head_dim_v}")
    if q.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(f"{fn}: {qn} is a CPU tensor, and fmha's kernels run on the GPU. To run them on "
                           "the CPU through Triton's interpreter, set TRITON_INTERPRET=1 before importing "
                           "triton or fmha.")
    if q.device.type not in ("cuda", "cpu", "meta"):
        raise ValueError(f"{fn}: {qn} is on device {q.device}; fmha runs on CUDA devices "
                         "(or on the CPU under TRITON_INTERPRET=1, or on meta tensors for shapes only)")


def is_finite(value) -> bool:
    """Whether a real number is finite (NaN is not), by comparisons alone: they also hold for
    torch.compile's symbolic floats, which ``math.isfinite`` cannot take."""
    return -math.inf < value < math.inf


def check_scale(fn: str, scale, head_dim: int, name: str = "scale") -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{fn}: {name} must be a real number or None, got {type(scale).__name__}")
    if not is_finite(scale):
        raise ValueError(f"{fn}: {name} must be finite, got {scale}")
    return float(scale)


def check_flash_options(fn: str, softmax_scale, return_attn_probs, softcap):
    """The FlashAttention functions' own argument names and conventions, checked before fmha's
    entry points (whose errors say ``scale``, and None for no softcap) see them. Returns the
    softcap as those take it (:func:`flash_softcap`). A float scale, a bool flag and a float
    softcap cost three class tests and no call."""
    if softmax_scale is not None and (softmax_scale.__class__ is not float or not is_finite(softmax_scale)):
        check_scale(fn, softmax_scale, 1, "softmax_scale")
    if return_attn_probs.__class__ is not bool:
        check_flag(fn, "return_attn_probs", return_attn_probs)
    if softcap.__class__ is float and (softcap == 0.0 or 0.0 < softcap < math.inf):
        return softcap or None
    return flash_softcap(fn, softcap)


def flash_softcap(fn: str, softcap):
    """FlashAttention's ``softcap``: 0.0 (or 0) turns it off, returned as fmha's None; else a finite
    real > 0, returned as it is (a symbolic float under torch.compile stays symbolic)."""
    if softcap.__class__ is float and (softcap == 0.0 or 0.0 < softcap < math.inf):
        return softcap or None
    if not isinstance(softcap, (bool, torch.Tensor)) and softcap == 0:
        return None
    check_softcap(fn, softcap, off="0.0")
    return softcap


def check_flag(fn: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be a bool, got {type(value).__name__}")
    return value


def check_window(fn: str, window) -> tuple[int | None, int | None]:
    """``window=(left, right)``: non-negative ints or None (unbounded)."""
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"{fn}: window must be a (left, right) pair, got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window):
        if side is not None and (isinstance(side, bool) or not isinstance(side, numbers.Integral) or side < 0):
            raise ValueError(f"{fn}: window's {name} side must be a non-negative int or None, got {side!r}")
        sides.append(None if side is None else int(side))
    return sides[0], sides[1]


def flash_window(fn: str, window_size) -> tuple[int | None, int | None] | None:
    """FlashAttention's ``window_size=(left, right)`` (-1: unbounded) as fmha's window (None: none)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"{fn}: window_size must be a (left, right) pair, got {window_size!r}")
    sides = []
    for name, side in zip(("left", "right"), window_size):
        if isinstance(side, bool) or not isinstance(side, int) or side < -1:
            raise ValueError(f"{fn}: window_size's {name} side must be an int >= -1 (-1: unbounded), got {side!r}")
        sides.append(None if side == -1 else side)
    return None if sides == [None, None] else (sides[0], sides[1])


def check_softcap(fn: str, softcap, off: str = "None") -> float:
    """``softcap``: None (off) or a finite real > 0; 0.0 stands for off in the options. ``off``: what
    turns it off in the entry point's own convention, for the messages."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"{fn}: softcap must be a real number > 0 or {off} (off), got {type(softcap).__name__}")
    if not 0 < softcap < math.inf:  # comparisons: they also take torch.compile's symbolic floats
        raise ValueError(f"{fn}: softcap must be finite and > 0 ({off} turns it off), got {softcap}")
    return float(softcap)


def _check_float32_tensor(fn: str, name: str, tensor, device: torch.device, shapes: tuple, described: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor or None, got {type(tensor).__name__}")
    if tensor.dtype != torch.float32:
        raise TypeError(f"{fn}: {name} must be float32, got {tensor.dtype}")
    # Then size by size: tuple membership does not compare torch.compile's symbolic sizes
    if tuple(tensor.shape) not in shapes and not any(
            tensor.dim() == len(shape) and all(size == expected for size, expected in zip(tensor.shape, shape))
            for shape in shapes):
        raise ValueError(f"{fn}: {name} must have shape {described}, got {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{fn}: {name} is on {tensor.device} and q on {device}; they must share a device")


def check_alibi_slopes(fn: str, alibi_slopes, batch: int, q_heads: int, device: torch.device) -> bool:
    """``alibi_slopes``: float32 (Hq,) or (B, Hq) on q's device, any strides; not differentiated."""
    if alibi_slopes is None:
        return False
    _check_float32_tensor(fn, "alibi_slopes", alibi_slopes, device, ((q_heads,), (batch, q_heads)),
                          f"({q_heads},) or ({batch}, {q_heads}) (query heads, or batch and query heads)")
    return True


def check_sinks(fn: str, sinks, q_heads: int, device: torch.device) -> bool:
    """``sinks``: float32 (Hq,) on q's device, any strides; differentiable."""
    if sinks is None:
        return False
    _check_float32_tensor(fn, "sinks", sinks, device, ((q_heads,),), f"({q_heads},) (one per query head)")
    return True


def check_dropout(fn: str, dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{fn}: dropout_p must be a float in [0, 1], got {dropout_p!r}")
    return float(dropout_p)


def check_generator(fn: str, generator, device: torch.device) -> None:
    """``generator``: None (torch's default for the device) or a torch.Generator of q's device type."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"{fn}: generator must be a torch.Generator or None, got {type(generator).__name__}")
    if device.type != "meta" and generator.device.type != device.type:
        raise ValueError(f"{fn}: generator is a {generator.device.type} generator and q is on {device}; "
                         f"dropout on {device.type} tensors draws from a {device.type} generator")


ATTN_MASK_DTYPES = {torch.bool: "bool", torch.float16: "float16", torch.bfloat16: "bfloat16",
                    torch.float32: "float32"}


def sdpa_attn_mask(fn: str, attn_mask, query_shape: torch.Size, seqlen_k: int, folded: torch.Size,
                   dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, str]:
    """SDPA's ``attn_mask`` as a (B, H, Sq, Sk) view of itself (stride 0 where it broadcasts) and its kind.

    As ``torch.nn.functional``: bool (True takes part) or float (added to the scores), float32 or the
    query's dtype, broadcastable to ``query.shape[:-1] + (Sk,)``. ``folded`` is the query's
    (B, H, Sq, D) shape after the entry point folded its batch dims.
    """
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"{fn}: attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype not in (torch.bool, torch.float32, dtype):
        raise TypeError(f"{fn}: attn_mask must be bool, float32 or the query's dtype ({dtype}), got {attn_mask.dtype}")
    weights = (*query_shape[:-1], seqlen_k)
    if attn_mask.ndim < 2 or attn_mask.ndim > len(weights):
        raise ValueError(f"{fn}: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the attention "
                         f"weights' shape {weights} (query.shape[:-1] + (key length,))")
    try:
        mask = attn_mask.expand(weights)  # a view: broadcast dims get stride 0, nothing is copied
    except RuntimeError:
        raise ValueError(f"{fn}: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the attention "
                         f"weights' shape {weights} (query.shape[:-1] + (key length,))") from None
    if attn_mask.device != device:
        raise ValueError(f"{fn}: attn_mask is on {attn_mask.device} and query on {device}; they must share a device")
    if mask.ndim == 3:
        mask = mask.unsqueeze(1)
    elif mask.ndim > 4:  # a view where the batch dims' strides merge, else a copy over them
        mask = mask.reshape(*folded[:3], seqlen_k)
    return mask, ATTN_MASK_DTYPES[attn_mask.dtype]


def explicit_choice(fn: str, config) -> tuple[str, tuple[int, ...]]:
    """``config=``: a backend's config object (``ForwardConfig``, ``HopperSchedule``) or None."""
    if config is None:
        return "", ()
    backend = getattr(type(config), "backend", None)
    if not isinstance(backend, str) or not hasattr(config, "to_ints"):
        raise TypeError(f"{fn}: config must be a fmha.ForwardConfig, a fmha.HopperSchedule or None, "
                        f"got {type(config).__name__}")
    return backend, config.to_ints()


def attention_params(fn: str, q, k, v, *, causal=False, scale=None, window=None, softcap=None,
                     alibi_slopes=None, sinks=None, dropout_p=0.0, generator=None, deterministic=False,
                     config=None, top_left=False, names=("q", "k", "v"), backend: str = "",
                     attn_mask_kind: str = "", attn_mask_grad: bool = False) -> AttentionParams:
    """Validate a call's arguments and reduce them to one :class:`AttentionParams`.

    ``attn_mask_kind``: the kind of an SDPA mask that :func:`sdpa_attn_mask` has checked ("" for none);
    ``attn_mask_grad``: that mask is float and requires grad.
    """
    check_qkv(fn, q, k, v, names)
    causal = check_flag(fn, "causal", causal)
    check_flag(fn, "deterministic", deterministic)
    left, right = check_window(fn, window)
    if causal:
        right = 0 if right is None else min(right, 0)
    batch, q_heads = q.shape[:2]
    options = AttentionOptions(
        scale=check_scale(fn, scale, q.shape[3]), window_left=left, window_right=right, top_left=top_left,
        softcap=check_softcap(fn, softcap), has_alibi=check_alibi_slopes(fn, alibi_slopes, batch, q_heads, q.device),
        has_sinks=check_sinks(fn, sinks, q_heads, q.device), attn_mask_kind=attn_mask_kind,
        attn_mask_grad=attn_mask_grad,
        dropout_p=check_dropout(fn, dropout_p), deterministic=deterministic, **_explicit(fn, config, backend))
    check_generator(fn, generator, q.device)
    return AttentionParams.of(q, k, v, options)


def _explicit(fn: str, config, backend: str) -> dict:
    chosen, config_ints = explicit_choice(fn, config)
    return dict(backend=backend or chosen, config=config_ints)


def check_cu_seqlens(fn: str, name: str, cu_seqlens, device: torch.device, total: int | None, tokens: str) -> None:
    """int32 (batch + 1,) offsets on ``device``; on the CPU their values too: from 0, never
    decreasing, ending at ``total`` (the tokens in ``tokens``; None: any end)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{fn}: {name} must be int32 (as in FlashAttention), got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() == 0:
        raise ValueError(f"{fn}: {name} must be 1-D with batch + 1 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.numel() > 1 and cu_seqlens.stride(0) != 1:  # the kernels read entry b at offset b
        raise ValueError(f"{fn}: {name} must be contiguous, got stride {cu_seqlens.stride(0)}")
    if cu_seqlens.device != device:
        raise ValueError(f"{fn}: {name} is on {cu_seqlens.device} and {tokens} on {device}; they must share a device")
    if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
        # The values can be read for free here (the interpreter); on a GPU that would cost a
        # synchronisation per call, and the kernels clamp every sequence into the tensor instead.
        values = cu_seqlens.tolist()
        if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or total not in (None, values[-1]):
            end = "" if total is None else f" and end at {total} (the tokens in {tokens})"
            raise ValueError(f"{fn}: {name} must start at 0{',' if end else ' and'} never decrease{end}, got {values}")


def check_max_seqlen(fn: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{fn}: {name} must be a non-negative int, got {value!r}")
    return int(value)


def varlen_params(fn: str, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                  scale=None, window=None, softcap=None, alibi_slopes=None, sinks=None, dropout_p=0.0, generator=None,
                  deterministic=False, names=("q", "k", "v")) -> AttentionParams:
    """Validate a packed-sequence call: q (total_q, Hq, D), k and v (total_k, Hkv, D), int32 cu_seqlens."""
    for name, tensor in zip(names, (q, k, v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.ndim != 3:
            raise ValueError(f"{fn}: {name} must be 3-D (total_tokens, heads, head_dim), "
                             f"got {tensor.ndim}-D with shape {tuple(tensor.shape)}")
    # The packed tensors viewed as one batch of (1, H, total, D): the dense checks apply.
    check_qkv(fn, *(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)), names=names)
    check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, q.device, q.shape[0], names[0])
    check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, q.device, k.shape[0], names[1])
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
                         f"got {cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    max_seqlen_q = check_max_seqlen(fn, "max_seqlen_q", max_seqlen_q)
    max_seqlen_k = check_max_seqlen(fn, "max_seqlen_k", max_seqlen_k)
    causal = check_flag(fn, "causal", causal)
    check_flag(fn, "deterministic", deterministic)
    left, right = check_window(fn, window)
    if causal:
        right = 0 if right is None else min(right, 0)
    batch, q_heads = cu_seqlens_q.numel() - 1, q.shape[1]
    options = AttentionOptions(
        scale=check_scale(fn, scale, q.shape[2]), window_left=left, window_right=right, layout="varlen",
        softcap=check_softcap(fn, softcap), has_alibi=check_alibi_slopes(fn, alibi_slopes, batch, q_heads, q.device),
        has_sinks=check_sinks(fn, sinks, q_heads, q.device), dropout_p=check_dropout(fn, dropout_p),
        deterministic=deterministic)
    check_generator(fn, generator, q.device)
    return AttentionParams.packed(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, options)


# The annotations above are strings (``from __future__ import annotations``); the schema map reads them.
assert all(isinstance(field.type, str) and field.type in _SCHEMA_TYPES for field in _OPTION_FIELDS), \
    typing.get_type_hints(AttentionOptions)
