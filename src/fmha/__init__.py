"""fmha: exact fused multi-head attention in Triton."""

from . import reference
from .config import ForwardConfig
from .interface import attention, naive_attention, scaled_dot_product_attention

__version__ = "0.1.0"

__all__ = [
    "ForwardConfig",
    "attention",
    "naive_attention",
    "reference",
    "scaled_dot_product_attention",
    "__version__",
]
