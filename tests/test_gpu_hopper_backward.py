"""The Gluon Hopper backward on the GPU (marker ``gpu``): chosen by default on sm_90, exact on the
shapes the grid of tests/test_gpu_backward.py does not reach (large GQA groups, windows,
expanded output gradients), and the portable backward under ``deterministic=True``."""

import pytest
import torch

import fmha
from fmha.masking import Window

from .helpers import assert_grads_close, random_qkv

pytestmark = pytest.mark.gpu

needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                  reason="needs an sm_90 GPU")


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_default_backward_is_the_hopper_kernel(dtype, head_dim):
    q, k, v = random_qkv(1, 4, 2, 256, 256, head_dim, dtype, device="cuda")
    assert str(fmha.explain(q, k, v, causal=True)).count("backward: gluon_sm90") == 1
    assert "not gluon_sm90: deterministic" in str(fmha.explain(q, k, v, deterministic=True))


@needs_hopper
@pytest.mark.parametrize("case", [
    dict(batch=2, q_heads=16, kv_heads=2, seqlen_q=1536, seqlen_k=1536, head_dim=128, causal=True, layout="bshd"),
    dict(batch=1, q_heads=8, kv_heads=1, seqlen_q=700, seqlen_k=2100, head_dim=64, causal=True, layout="bhsd"),
    dict(batch=1, q_heads=4, kv_heads=4, seqlen_q=2000, seqlen_k=2000, head_dim=128, window=(255, 0), layout="bhsd"),
    dict(batch=1, q_heads=4, kv_heads=2, seqlen_q=1000, seqlen_k=1000, head_dim=64, window=(100, 300), layout="bhsd"),
    # causal heads of more than 64 key blocks: head after head, the last four together
    dict(batch=1, q_heads=12, kv_heads=6, seqlen_q=8300, seqlen_k=8400, head_dim=64, causal=True, layout="bhsd"),
    dict(batch=2, q_heads=3, kv_heads=3, seqlen_q=8320, seqlen_k=8320, head_dim=128, causal=True, layout="bshd"),
], ids=lambda case: "-".join(f"{name}={value}" for name, value in case.items()).replace(" ", ""))
def test_hopper_backward_cases(case):
    case = dict(case)
    causal, window, layout = case.pop("causal", False), case.pop("window", None), case.pop("layout")
    q, k, v = random_qkv(*case.values(), torch.bfloat16, device="cuda", layout=layout)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fmha.attention(q, k, v, causal=causal, window=window)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    seqlen_q, seqlen_k = case["seqlen_q"], case["seqlen_k"]
    if window is not None:
        assert_grads_close(grads, q, k, v, dout, window=Window.of(seqlen_q, seqlen_k, left=window[0], right=window[1]))
    else:
        assert_grads_close(grads, q, k, v, dout, causal_offset=seqlen_k - seqlen_q if causal else None)


@needs_hopper
def test_expanded_output_gradient():
    """out.sum() hands the backward a stride-0 gradient, which TMA cannot describe."""
    q, k, v = (t.requires_grad_() for t in random_qkv(2, 4, 4, 300, 300, 128, torch.bfloat16, device="cuda"))
    fmha.attention(q, k, v, causal=True).float().sum().backward()
    dout = torch.ones(2, 4, 300, 128, device="cuda", dtype=torch.bfloat16)
    assert_grads_close((q.grad, k.grad, v.grad), q, k, v, dout, causal_offset=0)


@needs_hopper
def test_deterministic_gradients_match_the_default_ones():
    q, k, v = (t.requires_grad_() for t in random_qkv(2, 8, 2, 1024, 1024, 128, torch.bfloat16, device="cuda"))
    dout = torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
    default = torch.autograd.grad(fmha.attention(q, k, v, causal=True), (q, k, v), dout)
    deterministic = torch.autograd.grad(fmha.attention(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
    for fast, exact in zip(default, deterministic):
        torch.testing.assert_close(fast, exact, atol=2e-2, rtol=2e-2)
