"""Sliding windows on the GPU (marker ``gpu``): forward and backward over windows, causal, GQA,
head dims and lengths, with bf16 against float64 (the project's error rule)."""

import warnings

import pytest
import torch

import fmha
from fmha.masking import Window

from .helpers import assert_close_to_reference, assert_grads_close, random_qkv

pytestmark = pytest.mark.gpu

# (left, right): the widths as causal-style windows, a symmetric window, a right-only and a
# left-only one
WINDOWS = [(0, 0), (1, 0), (63, 0), (256, 0), (1024, 0), (4096, 0), (100, 100), (None, 7), (300, None)]
LENGTHS = [(1, 4096), (1000, 1000), (1000, 4096), (4096, 1000)]


def visible_window(seqlen_q, seqlen_k, left, right, causal):
    if causal:
        right = 0 if right is None else min(right, 0)
    return Window.of(seqlen_q, seqlen_k, left=left, right=right)


def inputs(seqlen_q, seqlen_k, head_dim, seed, grad=False):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = random_qkv(1, 8, 2, seqlen_q, seqlen_k, head_dim, torch.bfloat16, device="cuda", generator=generator)
    return (t.requires_grad_(grad) for t in (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", LENGTHS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda window: f"left{window[0]}-right{window[1]}")
def test_window_forward_gpu(window, head_dim, seqlen_q, seqlen_k, causal):
    q, k, v = inputs(seqlen_q, seqlen_k, head_dim, hash((window, head_dim, seqlen_q, seqlen_k, causal)) % 2**31)
    out, lse = fmha.attention(q, k, v, causal=causal, window=window, return_lse=True)
    assert_close_to_reference(out, q, k, v, window=visible_window(seqlen_q, seqlen_k, *window, causal), lse=lse,
                              atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1000, 1000), (1000, 4096)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda window: f"left{window[0]}-right{window[1]}")
def test_window_backward_gpu(window, head_dim, seqlen_q, seqlen_k, causal):
    q, k, v = inputs(seqlen_q, seqlen_k, head_dim, hash((window, head_dim, seqlen_q, causal, 1)) % 2**31, grad=True)
    out = fmha.attention(q, k, v, causal=causal, window=window)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close(grads, q, k, v, dout, window=visible_window(seqlen_q, seqlen_k, *window, causal))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_left_only_windows_run_the_gluon_forward_gpu(head_dim):
    """A left bound and none on the right, not causal: the Gluon forward builds it (its masked blocks
    then test each row against the end of K alone on the right) and runs it, with no fallback."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is built for sm_90")
    q, k, v = inputs(2000, 2000, head_dim, 11)
    assert fmha.explain(q, k, v, window=(300, None)).backend == "gluon_sm90"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a build failure would warn and run the portable kernel
        out, lse = fmha.attention(q, k, v, window=(300, None), return_lse=True)
    assert_close_to_reference(out, q, k, v, window=Window.of(2000, 2000, left=300), lse=lse, atol=1e-5)


def test_window_gradients_are_deterministic_gpu():
    """deterministic=True: every gradient bitwise equal run to run. The default path: dK and dV too
    (each key block sums its rows in a fixed order), dQ up to the order of its atomic adds."""
    q, k, v = inputs(1500, 2000, 128, 7, grad=True)
    dout = torch.randn(1, 8, 1500, 128, device="cuda", dtype=torch.bfloat16)
    for deterministic in (True, False):
        def grads():
            out = fmha.attention(q, k, v, causal=True, window=(255, 0), deterministic=deterministic)
            return torch.autograd.grad(out, (q, k, v), dout)
        first = grads()
        for _ in range(4):
            dq, dk, dv = grads()
            assert torch.equal(dk, first[1]) and torch.equal(dv, first[2])
            if deterministic:
                assert torch.equal(dq, first[0])
            else:
                torch.testing.assert_close(dq, first[0], rtol=1e-2, atol=1e-2)
