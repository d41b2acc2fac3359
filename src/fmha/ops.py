"""Autograd and ``torch.compile`` support: the forward and backward as ``torch.library`` custom ops.

``fmha::forward(q, k, v, <options>) -> (out, lse)``; its autograd formula calls
``fmha::backward``, which recomputes P from the saved LSE. The options part of both schemas is
generated from :class:`fmha.params.AttentionOptions`, so the schemas are written once. Both ops
have fake implementations, so ``torch.compile(fullgraph=True)`` traces through them. The LSE is
not differentiable. The Hopper backward adds dQ with atomic adds; ``deterministic=True`` takes the
portable one, which has none (bitwise-reproducible gradients).
"""

from __future__ import annotations

import torch

from . import dispatch
from .params import AttentionOptions, AttentionParams, options_schema

_OPTIONS = options_schema()
_OPTION_COUNT = len(AttentionOptions.__dataclass_fields__)


def run_forward(q, k, v, options: AttentionOptions) -> tuple[torch.Tensor, torch.Tensor]:
    params = AttentionParams.of(q, k, options)
    return dispatch.prepared_forward(params, q, k, v)(q, k, v)


def _forward(q, k, v, *options):
    return run_forward(q, k, v, AttentionOptions.from_op_args(*options))


def _forward_fake(q, k, v, *options):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _backward_impl(dout, q, k, v, out, lse, *options):
    params = AttentionParams.of(q, k, AttentionOptions.from_op_args(*options))
    return dispatch.run_backward(dout, q, k, v, out, lse, params)


def _backward_fake(dout, q, k, v, out, lse, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


forward_op = torch.library.custom_op(
    "fmha::forward", _forward, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {_OPTIONS}) -> (Tensor, Tensor)")
forward_op.register_fake(_forward_fake)

backward_op = torch.library.custom_op(
    "fmha::backward", _backward_impl, mutates_args=(),
    schema=f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_OPTIONS}) -> (Tensor, Tensor, Tensor)")
backward_op.register_fake(_backward_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = backward_op(grad_out, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * _OPTION_COUNT


forward_op.register_autograd(_backward, setup_context=_setup_context)


def needs_op(q, k, v) -> bool:
    """The custom op (differentiable, traceable) when grads or compilation need it; else launch directly."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return True
    return torch.compiler.is_compiling()


def forward(q, k, v, params: AttentionParams) -> tuple[torch.Tensor, torch.Tensor]:
    if needs_op(q, k, v):
        return forward_op(q, k, v, *params.options.op_args())
    return dispatch.prepared_forward(params, q, k, v)(q, k, v)


# Packed sequences (varlen): q (total_q, Hq, D), k and v (total_k, Hkv, D), int32 cu_seqlens;
# the LSE is (Hq, total_q). max_seqlen_q/k are tile hints: the kernels read the lengths on the device.

def run_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       options: AttentionOptions) -> tuple[torch.Tensor, torch.Tensor]:
    params = AttentionParams.packed(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, options)
    return dispatch.prepared_forward(params, q, k, v, cu_seqlens_q, cu_seqlens_k)(q, k, v, cu_seqlens_q, cu_seqlens_k)


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options):
    return run_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              AttentionOptions.from_op_args(*options))


def _varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _varlen_backward_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options):
    params = AttentionParams.packed(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                                    AttentionOptions.from_op_args(*options))
    return dispatch.run_backward(dout, q, k, v, out, lse, params, seqlens=(cu_seqlens_q, cu_seqlens_k))


def _varlen_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_SEQLENS = "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k"
varlen_forward_op = torch.library.custom_op(
    "fmha::varlen_forward", _varlen_forward, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {_SEQLENS}, {_OPTIONS}) -> (Tensor, Tensor)")
varlen_forward_op.register_fake(_varlen_forward_fake)

varlen_backward_op = torch.library.custom_op(
    "fmha::varlen_backward", _varlen_backward_impl, mutates_args=(),
    schema=f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_SEQLENS}, {_OPTIONS}) "
           "-> (Tensor, Tensor, Tensor)")
varlen_backward_op.register_fake(_varlen_backward_fake)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = varlen_backward_op(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens,
                                    *ctx.options)
    return (dq, dk, dv) + (None,) * (4 + _OPTION_COUNT)


varlen_forward_op.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)

