"""The shared test helpers live in :mod:`fmha.testing` (the tools and the autotuner use them too)."""

from fmha.testing import (  # noqa: F401
    assert_close_to_reference,
    assert_grads_close,
    random_qkv,
    torch_math_attention,
)
