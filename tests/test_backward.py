"""Gradients through the interpreter (CPU, fp16/fp32, and bf16 computed in fp32): against float64
autograd of the formula."""

import pytest
import torch

import fmha

from .helpers import assert_grads_close, random_qkv

pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.float16]
SHAPES = [
    # batch, q heads, kv heads, Sq, Sk, head dim, causal
    (1, 2, 1, 37, 53, 24, False),   # MQA, lengths not multiples of the tile, D not a power of two
    (2, 4, 2, 40, 29, 32, True),    # GQA, causal bottom-right with Sq > Sk
    (1, 2, 2, 29, 61, 16, True),    # causal bottom-right with Sk > Sq
    (1, 3, 3, 17, 17, 40, False),
    (1, 2, 2, 1, 33, 8, True),      # one query row
]


def grads_of(out, leaves, generator_seed=0):
    dout = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(generator_seed))
    return torch.autograd.grad(out, leaves, dout), dout


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_attention_gradients(dtype, shape):
    batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal = shape
    q, k, v = (t.requires_grad_() for t in random_qkv(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype))
    out = fmha.attention(q, k, v, causal=causal)
    grads, dout = grads_of(out, (q, k, v))
    assert_grads_close(grads, q, k, v, dout, causal_offset=seqlen_k - seqlen_q if causal else None)


def test_bfloat16_gradients_on_the_cpu_are_right():
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 4, 2, 37, 29, 24, torch.bfloat16))
    out = fmha.attention(q, k, v, causal=True)
    grads, dout = grads_of(out, (q, k, v))
    assert all(grad.dtype == torch.bfloat16 for grad in grads)
    assert_grads_close(grads, q, k, v, dout, causal_offset=29 - 37)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sdpa_top_left_causal_gradients_with_bshd_strides_and_scale(dtype):
    q, k, v = (t.requires_grad_() for t in random_qkv(2, 4, 2, 30, 45, 32, dtype, layout="bshd"))
    # leaves are BSHD views; gradients come back with the leaves' shapes
    out = fmha.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    grads, dout = grads_of(out, (q, k, v))
    assert_grads_close(grads, q, k, v, dout, causal_offset=0, scale=0.3)


def test_rows_that_see_no_key_get_zero_finite_gradients():
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 40, 10, 16, torch.float32))
    out = fmha.attention(q, k, v, causal=True)  # offset -30: rows 0..29 see no key
    (dq, dk, dv), dout = grads_of(out, (q, k, v))
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert (dq[:, :, :30] == 0).all()
    assert_grads_close((dq, dk, dv), q, k, v, dout, causal_offset=-30)


def test_lse_is_returned_but_not_differentiable():
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 20, 20, 16, torch.float32))
    out, lse = fmha.attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    assert torch.autograd.grad(out.sum(), q)[0].shape == q.shape


def test_expanded_kv_get_summed_gradients():
    q = torch.randn(1, 4, 20, 16, requires_grad=True)
    k_one = torch.randn(1, 1, 24, 16, requires_grad=True)
    v_one = torch.randn(1, 1, 24, 16, requires_grad=True)
    out = fmha.attention(q, k_one.expand(1, 4, 24, 16), v_one.expand(1, 4, 24, 16))
    (dk,) = torch.autograd.grad(out.sum(), k_one)
    reference = fmha.attention(q, k_one, v_one)  # the same keys as MQA
    (dk_mqa,) = torch.autograd.grad(reference.sum(), k_one)
    torch.testing.assert_close(dk, dk_mqa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("deterministic", [False, True])
def test_gradients_are_bitwise_reproducible(deterministic):
    q, k, v = (t.requires_grad_() for t in random_qkv(2, 4, 2, 33, 47, 32, torch.float16))
    runs = []
    for _ in range(3):
        out = fmha.attention(q, k, v, causal=True, deterministic=deterministic)
        runs.append(grads_of(out, (q, k, v))[0])
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_eager_gradients_skip_the_custom_ops_and_equal_theirs():
    # Eager calls run the launchers under a plain autograd.Function (no per-call op dispatch); the
    # custom ops, which torch.compile traces, must give the same gradients bit for bit.
    from fmha import ops
    from fmha.params import attention_params

    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 1, 19, 27, 16, torch.float32))
    sinks = torch.randn(2, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25])
    out = fmha.attention(q, k, v, causal=True, sinks=sinks, alibi_slopes=slopes, softcap=3.0)
    assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"
    eager, dout = grads_of(out, (q, k, v, sinks))
    params = attention_params("t", q, k, v, causal=True, sinks=sinks, alibi_slopes=slopes, softcap=3.0)
    op_out, _ = ops.forward_op(q, k, v, slopes, sinks, None, None, *params.options.op_args())
    assert torch.equal(op_out, out)
    for got, expected in zip(torch.autograd.grad(op_out, (q, k, v, sinks), dout), eager):
        assert torch.equal(got, expected)


def test_torch_compile_fullgraph_forward_and_backward():
    def block(q, k, v):
        return (fmha.attention(q, k, v, causal=True) * 2).sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 24, 24, 16, torch.float32))
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    eager = torch.autograd.grad(block(q, k, v), (q, k, v))
    for got, expected in zip(grads, eager):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("block_m, block_n", [(32, 16), (16, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_tiles_of_unequal_sides(block_m, block_n, causal):
    """The dK/dV kernel keeps block_n keys and the dQ kernel block_n rows resident; each finds its
    (block, batch, head) from its own block count, so tiles with block_m != block_n (as ``fmha tune``
    may pick them) cover every block of every head, and nothing past them."""
    from fmha import dispatch
    from fmha.backends.triton.config import BackwardConfig
    from fmha.params import attention_params

    q, k, v = random_qkv(2, 4, 2, 45, 70, 16, torch.float16)
    params = attention_params("test", q, k, v, causal=causal)
    out, lse = dispatch.prepared_forward(params, q, k, v)(q, k, v)
    dout = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    grads = dispatch.run_backward(dout, q, k, v, out, lse, params, config=BackwardConfig(block_m, block_n, 4, 1))
    assert_grads_close(grads, q, k, v, dout, causal_offset=70 - 45 if causal else None)
