"""Autograd and ``torch.compile`` support: the forward and backward as ``torch.library`` custom ops.

``fmha::forward`` returns ``(out, lse)``; its registered autograd formula calls
``fmha::backward``, which recomputes P from the saved LSE. Both have fake (meta)
implementations, so ``torch.compile(fullgraph=True)`` traces a model through them without
graph breaks. The LSE is non-differentiable. The backward uses no atomics: every gradient
element is written by one program, so gradients are bitwise reproducible run to run.
"""

from __future__ import annotations

from typing import Optional

import torch

from .config import ForwardConfig
from .ops import run_backward, run_forward


@torch.library.custom_op("fmha::forward", mutates_args=())
def attention_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: Optional[int],
                         scale: float, block_m: int, block_n: int, num_warps: int,
                         num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    config = ForwardConfig(block_m, block_n, num_warps, num_stages) if block_m else None
    return run_forward(q, k, v, causal_offset=causal_offset, scale=scale, config=config)


@attention_forward_op.register_fake
def _(q, k, v, causal_offset, scale, block_m, block_n, num_warps, num_stages):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fmha::backward", mutates_args=())
def attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, causal_offset: Optional[int],
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return run_backward(dout, q, k, v, out, lse, causal_offset=causal_offset, scale=scale)


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, causal_offset, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal_offset, scale, *_ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal_offset = causal_offset
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(grad_out, q, k, v, out, lse, ctx.causal_offset, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None


attention_forward_op.register_autograd(_backward, setup_context=_setup_context)


def differentiable_forward(q, k, v, *, causal_offset, scale, config: ForwardConfig | None):
    tiles = (config.block_m, config.block_n, config.num_warps, config.num_stages) if config else (0, 0, 0, 0)
    return attention_forward_op(q, k, v, causal_offset, scale, *tiles)
