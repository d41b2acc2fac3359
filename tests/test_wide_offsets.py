"""Rows 2^31 elements or more apart: the kernels' 32-bit ``row * stride`` would wrap.

A 512k-token sequence of 32 heads of 128 (BSHD) puts its last query row 2^31 elements past its
first. The views here reach as far with 520 rows spread over a storage of 4 GiB that is
never touched beyond those rows (the allocation is virtual), so the interpreter runs them in
seconds. Before the kernels took 64-bit row strides for such tensors (WIDE_OFFSETS), these calls
read outside the storage.
"""

import torch

import fmha
from fmha.backends.triton.config import ForwardConfig, SplitKVConfig
from fmha.runtime import spans_wide_offsets

from .helpers import assert_close_to_reference, assert_grads_close

ROWS, ROW_STRIDE = 520, 2 ** 22 + 8  # the last row 2^31 + 7 · 2^22 + 4152 elements past the first


def far_rows(heads, head_dim, dtype=torch.float16, generator=None):
    """(1, heads, ROWS, head_dim) with rows ROW_STRIDE elements apart, random where it is read."""
    # empty_strided: the tests' torch.empty fills with NaN, which would touch all 4 GiB
    storage = torch.empty_strided(((ROWS - 1) * ROW_STRIDE + heads * head_dim,), (1,), dtype=dtype)
    view = storage.as_strided((1, heads, ROWS, head_dim), (0, head_dim, ROW_STRIDE, 1))
    view.copy_(torch.randn(view.shape, generator=generator).to(dtype))
    return view


def test_wide_rows_are_recognised():
    assert spans_wide_offsets(far_rows(1, 16))
    assert not spans_wide_offsets(torch.empty(2, 4, 1000, 64), None)
    # batch and head offsets are 64-bit already: only the rows of one (batch, head) count
    many_batches = torch.empty(2 ** 33, device="meta").as_strided((2 ** 12, 2, 1000, 64), (2 ** 21, 64_000, 64, 1))
    assert not spans_wide_offsets(many_batches)


def test_forward_and_gradients_over_keys_far_apart():
    generator = torch.Generator().manual_seed(0)
    k = far_rows(1, 16, generator=generator).requires_grad_()
    q = torch.randn(1, 2, 32, 16, generator=generator).half().requires_grad_()
    v = torch.randn(1, 1, ROWS, 16, generator=generator).half().requires_grad_()
    out = fmha.attention(q, k, v, config=ForwardConfig(16, 16, 4, 1))
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach())
    dout = torch.randn(out.shape, generator=generator).half()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close(grads, q.detach(), k.detach(), v.detach(), dout)


def test_split_kv_decode_over_values_far_apart():
    generator = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 1, ROWS, 16, generator=generator).half(), far_rows(1, 16, generator=generator)
    q = torch.randn(1, 4, 1, 16, generator=generator).half()
    assert isinstance(fmha.explain(q, k, v).config, SplitKVConfig)
    out, lse = fmha.attention(q, k, v, return_lse=True)
    assert_close_to_reference(out, q, k, v, lse=lse)


def test_forward_over_queries_far_apart():
    generator = torch.Generator().manual_seed(2)
    q = far_rows(1, 16, generator=generator)
    k, v = (torch.randn(1, 1, 40, 16, generator=generator).half() for _ in range(2))
    out = fmha.attention(q, k, v, causal=True, config=ForwardConfig(16, 16, 4, 1))
    assert_close_to_reference(out, q, k, v, causal_offset=40 - ROWS)
