"""fmha: exact fused multi-head attention in Triton."""

__version__ = "0.1.0"  # first: submodules record it in tuning keys

from . import reference
from .config import ForwardConfig
from .interface import attention, naive_attention, scaled_dot_product_attention

__all__ = [
    "ForwardConfig",
    "attention",
    "naive_attention",
    "reference",
    "scaled_dot_product_attention",
    "__version__",
]
