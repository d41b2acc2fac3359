"""Shared test helpers: random inputs, the float64 truth and PyTorch's same-dtype error."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from fmha.reference import dense_attention


def random_qkv(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, device="cpu",
               layout="bhsd", generator=None):
    """Fresh normal inputs; ``layout='bshd'`` returns transposed views of BSHD storage."""

    def make(heads, seqlen):
        if layout == "bshd":
            return torch.randn(batch, seqlen, heads, head_dim, dtype=dtype, device=device,
                               generator=generator).transpose(1, 2)
        return torch.randn(batch, heads, seqlen, head_dim, dtype=dtype, device=device, generator=generator)

    return make(q_heads, seqlen_q), make(kv_heads, seqlen_k), make(kv_heads, seqlen_k)


def visible_mask(seqlen_q, seqlen_k, causal_offset, device):
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    return cols <= rows + causal_offset


def torch_math_attention(q, k, v, *, causal_offset=None, scale=None):
    """PyTorch's own attention (SDPA MATH backend) in the inputs' dtype.

    Rows that see no key come back NaN from SDPA; they are set to 0, the defined answer.
    """
    mask = None
    if causal_offset is not None:
        mask = visible_mask(q.shape[2], k.shape[2], causal_offset, q.device)
    with sdpa_kernel(SDPBackend.MATH):
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
    return out.nan_to_num(0.0)


def assert_close_to_reference(out, q, k, v, *, causal_offset=None, scale=None, lse=None, atol=None):
    """The project's error rule.

    max|out - ref64| <= 2 * max|torch_math - ref64| + atol, with ref64 the float64 truth,
    torch_math PyTorch's same-dtype attention on the same inputs. NaN never passes.
    """
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "output contains NaN (unwritten or invalid elements)"
    ref, ref_lse = dense_attention(q, k, v, scale=scale, causal_offset=causal_offset)
    torch_out = torch_math_attention(q, k, v, causal_offset=causal_offset, scale=scale)
    torch_error = (torch_out.double() - ref).abs().max().item() if ref.numel() else 0.0
    error = (out.double() - ref).abs().max().item() if ref.numel() else 0.0
    if atol is None:
        atol = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}[q.dtype]
    assert error <= 2 * torch_error + atol, f"max error {error:.3g} > 2 * torch's {torch_error:.3g} + {atol:g}"
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
        assert not torch.isnan(lse).any(), "LSE contains NaN"
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "LSE -inf rows differ"
        finite = torch.isfinite(ref_lse)
        lse_tol = 1e-5 if q.dtype == torch.float32 else 1e-3
        if finite.any():
            lse_error = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
            assert lse_error <= lse_tol * max(1.0, ref_lse[finite].abs().max().item()), f"LSE error {lse_error:.3g}"
    return error, torch_error


def assert_grads_close(grads, q, k, v, dout, *, causal_offset=None, scale=None, atol=None):
    """The error rule for dq, dk, dv: at most 2x the error of torch's own same-dtype autograd.

    Both are measured against float64 autograd of the same formula; NaN never passes.
    """
    def autograd_of(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, _ = dense_attention(*leaves, scale=scale, causal_offset=causal_offset, dtype=dtype)
        return torch.autograd.grad(out, leaves, dout.to(dtype))

    truth = autograd_of(torch.float64)
    same_dtype = autograd_of(q.dtype)
    if atol is None:
        atol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[q.dtype]
    errors = []
    for name, got, ref, torch_grad, leaf in zip(("dq", "dk", "dv"), grads, truth, same_dtype, (q, k, v)):
        assert got.shape == leaf.shape and got.dtype == leaf.dtype, name
        assert not torch.isnan(got).any(), f"{name} contains NaN"
        error = (got.double() - ref).abs().max().item() if ref.numel() else 0.0
        torch_error = (torch_grad.double() - ref).abs().max().item() if ref.numel() else 0.0
        assert error <= 2 * torch_error + atol, f"{name}: max error {error:.3g} > 2 * torch's {torch_error:.3g} + {atol:g}"
        errors.append(error)
    return errors
