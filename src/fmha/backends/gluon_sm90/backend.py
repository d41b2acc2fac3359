"""The Hopper backend: the warp-specialised Gluon forward and backward on sm_90 (H100, H200)."""

from __future__ import annotations

import functools

import torch

from ...params import AttentionParams
from ...runtime import INTERPRETED, compute_capability
from ...tuning import lookup
from .schedule import HopperSchedule, head_dim_refusal, product_columns, tile_head_dim

WIDE_TILE_HEAD_DIM = 256  # the backward's widest tiles: backward_wide.py


@functools.lru_cache(maxsize=None)
def gluon_unavailable() -> str | None:
    """Why the Gluon kernel cannot be built with this triton (None: it can)."""
    import triton

    from ...compat import GLUON_IMPORT_ERROR

    if GLUON_IMPORT_ERROR is not None:
        return f"Gluon's Hopper API is not importable with triton {triton.__version__} ({GLUON_IMPORT_ERROR})"
    try:
        from . import launch  # noqa: F401
    except ImportError as error:
        return f"the Gluon forward does not import with triton {triton.__version__} ({error})"
    return None


def _tma_strides_ok(tensor: torch.Tensor) -> bool:
    """The bulk copy engine needs a unit last stride and 16-byte multiples for the others (and the base)."""
    from ..triton.launch import tma_compatible

    return tma_compatible(tensor)


def attn_mask_refusal(attn_mask: torch.Tensor | None) -> str | None:
    """Why the Gluon backward cannot read this (B, Hq, Sq, Sk) attn_mask view, or None: it adds
    32-bit offsets within one (batch, head), so they must stay under 2^31 elements."""
    if attn_mask is None:
        return None
    _, _, rows, keys = attn_mask.shape
    furthest = (rows - 1) * abs(attn_mask.stride(2)) + (keys - 1) * abs(attn_mask.stride(3))
    if furthest >= 2**31:
        return "the attn_mask spans 2^31 elements or more within one (batch, head): its offsets are 32-bit here"
    return None


def value_head_dim_refusal(params: AttentionParams, backward: bool = False) -> str | None:
    """Why a Gluon kernel cannot take v's head dim (None: it can). The forward reads V and writes
    the output through descriptors of their own width: the bulk copies zero-fill V's columns past
    it and leave the output's out, so a value head dim within the columns the products read at q's
    head dim runs as it is. The backward takes one head dim."""
    head_dim_v = params.head_dim_v
    if not head_dim_v:
        return None
    differs = f"v's head dim ({head_dim_v}) differs from q's and k's ({params.head_dim})"
    if backward:
        return f"{differs}: the Gluon backward takes one head dim"
    if head_dim_v % 8:
        return f"{differs} and is not a multiple of 8 (the bulk copies step rows in 16-byte multiples)"
    columns = product_columns(params.head_dim)
    if columns is not None and head_dim_v > columns:
        return f"{differs} and is wider than the {columns} columns the products read at q's"
    return None


class HopperBackend:
    name = "gluon_sm90"
    description = "warp-specialised Gluon kernels for sm_90 (TMA, wgmma)"
    config_class = HopperSchedule

    def refusal(self, params: AttentionParams, q, k, v) -> str | None:
        options = params.options
        if options.backend and options.backend != self.name:
            return f"config= is a {options.backend} config"
        if INTERPRETED:
            return "Gluon kernels run compiled only (TRITON_INTERPRET=1 is set)"
        if params.device.type != "cuda":
            return f"needs a CUDA device, got {params.device}"
        major, minor = compute_capability(params.device)
        if major != 9:
            return f"needs sm_90 (Hopper); this GPU is sm_{major}{minor}"
        if params.dtype not in (torch.float16, torch.bfloat16):
            return f"needs float16 or bfloat16, got {params.dtype}"
        reason = head_dim_refusal(params.head_dim) or value_head_dim_refusal(params)
        if reason is not None:
            return reason
        if options.scale <= 0:
            return "needs a positive scale (it is folded into exp2 after the row max)"
        if options.layout not in ("dense", "varlen"):
            return f"layout {options.layout!r} is not built yet"
        for name, tensor in zip("qkv", (q, k, v)):  # (B, H, S, D), or packed (total, H, D)
            if not _tma_strides_ok(tensor):
                return f"{name}'s strides or base address cannot be described to TMA (16-byte multiples, unit last stride)"
        if options.backend == self.name:
            reason = HopperSchedule.from_ints(options.config).build_refusal(tile_head_dim(params.head_dim))
            if reason is not None:
                return reason
        return gluon_unavailable()

    def forward_config(self, params: AttentionParams) -> tuple[HopperSchedule | None, str]:
        if params.options.backend == self.name:
            return HopperSchedule.from_ints(params.options.config), "explicit config="
        return lookup.hopper_schedule(params)

    def prepare_forward(self, params: AttentionParams, schedule: HopperSchedule, first_kv_head: bool = False):
        """``first_kv_head``: k and v will come expanded over their heads (stride 0) and are read as
        ``params.kv_heads`` = 1 head (:class:`fmha.backends.gluon_sm90.launch.HopperForward`)."""
        from .launch import HopperForward

        return HopperForward(params, schedule, first_kv_head)

    def backward_refusal(self, params: AttentionParams, *tensors: torch.Tensor,
                         attn_mask: torch.Tensor | None = None) -> str | None:
        """Why the Gluon backward cannot run this call (None: it can). ``tensors``: dout, q, k, v,
        dq, dk, dv, each (B, H, S, D), or (total, H, D) for packed sequences; ``attn_mask``: SDPA's
        mask as its (B, Hq, Sq, Sk) view."""
        options = params.options
        if options.backend and options.backend != self.name:
            return f"config= is a {options.backend} config"
        if options.deterministic:
            return "deterministic=True: dQ is summed with atomic adds here; the portable backward has none"
        if options.attn_mask_grad:
            return "the attn_mask requires grad: the portable backward writes its gradient"
        if options.layout not in ("dense", "varlen"):
            return f"layout {options.layout!r} is not built yet"
        reason = head_dim_refusal(params.head_dim) or value_head_dim_refusal(params, backward=True)
        if reason is not None:
            return reason
        reason = attn_mask_refusal(attn_mask) or self.refusal(params, *tensors[1:4])
        if reason is not None:
            return reason
        from .backward_launch import backward_tensors_ok

        if not backward_tensors_ok(*tensors):
            return "a gradient's strides or base address cannot be described to TMA"
        return None

    def prepare_backward(self, params: AttentionParams):
        from .backward_launch import HopperBackward, HopperWideBackward, default_backward_schedule

        tile_dim = tile_head_dim(params.head_dim)
        if tile_dim == WIDE_TILE_HEAD_DIM:
            return HopperWideBackward(params)
        return HopperBackward(params, default_backward_schedule(tile_dim))
