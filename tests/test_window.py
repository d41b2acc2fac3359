"""Sliding windows (``window=(left, right)``) on the CPU through the interpreter: forward on every
portable path (per-tile, split-KV, naive) and gradients, against float64 with the same rule."""

import pytest
import torch

import fmha
from fmha.backends.triton.config import SplitKVConfig
from fmha.masking import Window

from .helpers import assert_close_to_reference, assert_grads_close, random_qkv

pytestmark = pytest.mark.interpreter

# (left, right, causal): a window alone, with causal (right = 0), a right-only window, a window
# narrower than one tile, zero-width sides, and sides wider than the sequence.
WINDOWS = [(7, 3, False), (20, None, True), (None, 5, False), (0, 0, False), (5, 2, True), (0, None, True),
           (200, 200, False)]
SHAPES = [(1, 4, 2, 37, 53, 24), (1, 2, 2, 53, 37, 32), (2, 2, 1, 40, 40, 16)]


def window_of(seqlen_q, seqlen_k, left, right, causal):
    if causal:
        right = 0 if right is None else min(right, 0)
    return Window.of(seqlen_q, seqlen_k, left=left, right=right)


# The naive baseline masks every score of every tile (no tile is skipped): one shape covers its
# window rule; the interpreter spends about 2.5 s a call on its one-row softmax programs.
CASES = [(implementation, shape) for shape in SHAPES for implementation in ("attention", "naive_attention")
         if implementation == "attention" or shape == SHAPES[0]]


@pytest.mark.parametrize("left, right, causal", WINDOWS, ids=[f"left{l}-right{r}-causal{c}" for l, r, c in WINDOWS])
@pytest.mark.parametrize("implementation, shape", CASES, ids=lambda case: "x".join(map(str, case))
                         if isinstance(case, tuple) else case)
def test_forward_matches_float64(implementation, shape, left, right, causal):
    q, k, v = random_qkv(*shape, torch.float16)
    with torch.no_grad():
        out, lse = getattr(fmha, implementation)(q, k, v, causal=causal, window=(left, right), return_lse=True)
    assert_close_to_reference(out, q, k, v, window=window_of(shape[3], shape[4], left, right, causal), lse=lse)


@pytest.mark.parametrize("left, right, causal", [(9, None, True), (4, 4, False), (0, 0, False)], ids=str)
def test_split_kv_decode_with_a_window(left, right, causal):
    q, k, v = random_qkv(1, 8, 1, 2, 90, 32, torch.float16)
    assert isinstance(fmha.explain(q, k, v, causal=causal, window=(left, right)).config, SplitKVConfig)
    out, lse = fmha.attention(q, k, v, causal=causal, window=(left, right), return_lse=True)
    assert_close_to_reference(out, q, k, v, window=window_of(2, 90, left, right, causal), lse=lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("left, right, causal", [(7, 3, False), (20, None, True), (0, 0, False)], ids=str)
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda shape: "x".join(map(str, shape)))
def test_gradients_match_float64(dtype, shape, left, right, causal):
    q, k, v = (t.requires_grad_() for t in random_qkv(*shape, dtype))
    out = fmha.attention(q, k, v, causal=causal, window=(left, right))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close(grads, q, k, v, dout, window=window_of(shape[3], shape[4], left, right, causal))


def test_unbounded_window_is_the_plain_call():
    q, k, v = random_qkv(1, 2, 2, 30, 30, 16, torch.float32)
    assert torch.equal(fmha.attention(q, k, v, window=(None, None)), fmha.attention(q, k, v))
    assert torch.equal(fmha.attention(q, k, v, window=(None, 0)), fmha.attention(q, k, v, causal=True))


@pytest.mark.parametrize("window, error, pattern", [
    ((3,), TypeError, r"window must be a \(left, right\) pair"),
    ((-1, 0), ValueError, r"window's left side must be a non-negative int or None"),
    ((0, 1.5), ValueError, r"window's right side"),
    ((True, 0), ValueError, r"window's left side"),
])
def test_bad_windows_name_the_argument(window, error, pattern):
    q, k, v = random_qkv(1, 2, 2, 8, 8, 16, torch.float32)
    with pytest.raises(error, match=pattern):
        fmha.attention(q, k, v, window=window)


def test_torch_compile_fullgraph_with_a_window():
    def block(q, k, v):
        return (fmha.attention(q, k, v, causal=True, window=(5, None)) * 2).sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 1, 24, 30, 16, torch.float32))
    grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    eager = torch.autograd.grad(block(q, k, v), (q, k, v))
    for got, expected in zip(grads, eager):
        torch.testing.assert_close(got, expected)
