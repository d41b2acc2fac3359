"""Backward on the GPU (marker ``gpu``): the forward's shape grid, determinism, compile, memory."""

import itertools

import pytest
import torch

import fmha

from .helpers import assert_grads_close, random_qkv
from .test_gpu_forward import GROUPS, HEAD_DIMS, KV_HEADS, LENGTHS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", list(itertools.product(LENGTHS, LENGTHS)))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_backward_grid(dtype, head_dim, seqlen_q, seqlen_k, causal, group):
    batch = 1 if max(seqlen_q, seqlen_k) >= 4096 else 2
    layout = "bshd" if group == 4 else "bhsd"
    generator = torch.Generator(device="cuda").manual_seed(hash((head_dim, seqlen_q, seqlen_k, causal, group)) % 2**31)
    q, k, v = random_qkv(batch, KV_HEADS * group, KV_HEADS, seqlen_q, seqlen_k, head_dim, dtype,
                         device="cuda", layout=layout, generator=generator)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fmha.attention(q, k, v, causal=causal)
    dout = torch.randn(out.shape, device="cuda", dtype=dtype, generator=generator)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close(grads, q, k, v, dout, causal_offset=seqlen_k - seqlen_q if causal else None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gradients_identical_over_ten_runs(dtype):
    q, k, v = (t.requires_grad_() for t in random_qkv(2, 16, 4, 1000, 1500, 128, dtype, device="cuda"))
    dout = torch.randn(2, 16, 1000, 128, device="cuda", dtype=dtype)
    first = torch.autograd.grad(fmha.attention(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
    for _ in range(9):
        again = torch.autograd.grad(fmha.attention(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_compiled_block_fullgraph_matches_eager():
    torch._dynamo.reset()

    def block(x, wq, wk, wv):
        batch, seqlen, width = x.shape
        heads = width // 64

        def split(t):
            return t.view(batch, seqlen, heads, 64).transpose(1, 2)

        out = fmha.attention(split(x @ wq), split(x @ wk), split(x @ wv), causal=True)
        return out.transpose(1, 2).reshape(batch, seqlen, width).float().square().mean()

    x = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16)
    weights = [(torch.randn(256, 256, device="cuda", dtype=torch.bfloat16) / 16).requires_grad_() for _ in range(3)]
    compiled = torch.compile(block, fullgraph=True)
    loss = compiled(x, *weights)
    grads = torch.autograd.grad(loss, weights)
    eager_loss = block(x, *weights)
    eager = torch.autograd.grad(eager_loss, weights)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-3, atol=1e-3)
    for got, expected in zip(grads, eager):
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-3)


def test_backward_allocates_no_score_matrix():
    seqlen, head_dim = 65536, 128
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 1, 1, seqlen, seqlen, head_dim, torch.bfloat16, device="cuda"))
    out = fmha.attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    gradient_bytes = sum(g.numel() * g.element_size() for g in grads)
    # Per-row work: delta and the LSE (padded), and the Hopper backward's fp32 dQ buffer: O(S·D), never O(S²).
    row_bytes = 3 * (seqlen + 128) * 4 + q.numel() * 4
    assert extra <= gradient_bytes + row_bytes + (1 << 20), f"{extra} bytes; the gradients need {gradient_bytes}"
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("head_dim, deterministic", [(64, False), (64, True), (96, False)],
                         ids=["hopper_backward", "deterministic", "portable"])
def test_more_batch_heads_than_a_grid_axis_holds(head_dim, deterministic):
    """B·H = 65,600: past the 65,535 that a CUDA grid's second axis holds. The backward's kernels
    and passes over rows put every block of every (batch, head) on one axis."""
    generator = torch.Generator(device="cuda").manual_seed(head_dim)
    q, k, v = (t.requires_grad_() for t in random_qkv(4100, 16, 16, 32, 32, head_dim, torch.bfloat16, device="cuda",
                                                        generator=generator))
    out = fmha.attention(q, k, v, causal=True, deterministic=deterministic)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=generator)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = torch.cat([torch.arange(0, 8), torch.arange(4092, 4100)]).cuda()  # the first and last batches
    assert_grads_close([g[keep] for g in grads], q[keep], k[keep], v[keep], dout[keep], causal_offset=0)
