"""fmha: exact fused multi-head attention in Triton and Gluon."""

from . import integrations, reference  # integrations: registers "FMHA" with torch's flash-attention registry
from ._version import __version__
from .api import attention, explain, naive_attention, scaled_dot_product_attention, varlen_attention
from .backends.gluon_sm90.schedule import HopperSchedule
from .backends.triton.config import BackwardConfig, ForwardConfig
from .flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .kvcache import flash_attn_with_kvcache
from .params import AttentionOptions, AttentionParams

__all__ = [
    "AttentionOptions",
    "AttentionParams",
    "BackwardConfig",
    "ForwardConfig",
    "HopperSchedule",
    "attention",
    "explain",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "naive_attention",
    "reference",
    "scaled_dot_product_attention",
    "varlen_attention",
    "__version__",
]
