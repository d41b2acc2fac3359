"""Autograd and ``torch.compile`` support: the forward and backward as ``torch.library`` custom ops.

``fmha::forward(q, k, v, alibi_slopes?, sinks?, attn_mask?, rng_state?, <options>) -> (out, lse)``;
its autograd formula calls ``fmha::backward``, which recomputes P from the saved LSE and returns
the sinks' gradient beside dq, dk and dv. The options part of both schemas is generated from
:class:`fmha.params.AttentionOptions`, so the schemas are written once; the score features'
tensors (:class:`fmha.params.ScoreTensors`) are optional tensor arguments. Both ops have fake
implementations, so ``torch.compile(fullgraph=True)`` traces through them. Eager calls that need
gradients take :class:`_EagerAttention` instead, the same formula without the ops' per-call
dispatch (:func:`launch`). The LSE is not
differentiable, nor are the ALiBi slopes and the attn_mask (as in FlashAttention). The Hopper
backward adds dQ with atomic adds; ``deterministic=True`` takes the portable one, which has none
(bitwise-reproducible gradients).

Dropout: :func:`dropout_seed` draws each call's philox key with one torch random op on the
device, before the custom op. It advances the generator as torch's own random ops do, it is
recorded by CUDA graphs (a replay draws a fresh key on the device) and traced by torch.compile
(no host read of the generator, which a graph capture forbids), and activation checkpointing,
which restores torch's RNG state before recomputing, draws the same key again. The forward saves
the key for the backward, which regenerates the same bits.
"""

from __future__ import annotations

import torch

from . import dispatch
from .params import NO_SCORE_TENSORS, AttentionOptions, AttentionParams, ScoreTensors, options_schema

_OPTIONS = options_schema()
_OPTION_COUNT = len(AttentionOptions.__dataclass_fields__)
_SCORES = "Tensor? alibi_slopes, Tensor? sinks, Tensor? attn_mask, Tensor? rng_state"


def dropout_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The philox key of one call's dropout: int64 (1,) on ``device``, from ``generator`` (None:
    torch's default generator of the device)."""
    # 62 random bits: a range every lowering of randint (eager, inductor) takes without overflow.
    return torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=device, generator=generator)


def score_tensors(alibi_slopes, sinks, attn_mask, rng_state) -> ScoreTensors:
    if alibi_slopes is None and sinks is None and attn_mask is None and rng_state is None:
        return NO_SCORE_TENSORS
    return ScoreTensors(alibi_slopes, sinks, attn_mask, rng_state)


def _launch_forward(prepared, q, k, v, scores: ScoreTensors, *seqlens):
    if scores is NO_SCORE_TENSORS:
        return prepared(q, k, v, *seqlens)
    return prepared(q, k, v, *seqlens, scores=scores)


def run_forward(q, k, v, options: AttentionOptions, scores: ScoreTensors = NO_SCORE_TENSORS):
    params = AttentionParams.of(q, k, v, options)
    return _launch_forward(dispatch.prepared_forward(params, q, k, v), q, k, v, scores)


def _forward(q, k, v, alibi_slopes, sinks, attn_mask, rng_state, *options):
    return run_forward(q, k, v, AttentionOptions.from_op_args(*options),
                       score_tensors(alibi_slopes, sinks, attn_mask, rng_state))


def _forward_fake(q, k, v, alibi_slopes, sinks, attn_mask, rng_state, *options):
    return dispatch.empty_output(q, v.shape[-1]), q.new_empty(q.shape[:3], dtype=torch.float32)


def _run_backward(dout, q, k, v, out, lse, params, alibi_slopes, sinks, attn_mask, rng_state, seqlens=()):
    """``(dq, dk, dv, dsinks, dmask)``; dsinks is None without sinks, dmask (the (B, Hq, Sq, Sk)
    attn_mask view's gradient, in its dtype) None unless the options ask for it."""
    sinks_grad = None if sinks is None else torch.zeros_like(sinks, memory_format=torch.contiguous_format)
    mask_grad = None
    if params.options.attn_mask_grad:  # key blocks a program skips keep their zeros
        mask_grad = torch.zeros(attn_mask.shape, dtype=torch.float32, device=attn_mask.device)
    scores = score_tensors(alibi_slopes, sinks, attn_mask, rng_state)
    if scores is NO_SCORE_TENSORS:
        grads = dispatch.run_backward(dout, q, k, v, out, lse, params, seqlens=seqlens)
    else:
        grads = dispatch.run_backward(dout, q, k, v, out, lse, params, seqlens=seqlens,
                                      scores=ScoreTensors(alibi_slopes, sinks, attn_mask, rng_state, sinks_grad,
                                                          mask_grad))
    return (*grads, sinks_grad, None if mask_grad is None else mask_grad.to(attn_mask.dtype))


def _backward_impl(dout, q, k, v, out, lse, alibi_slopes, sinks, attn_mask, rng_state, *options):
    params = AttentionParams.of(q, k, v, AttentionOptions.from_op_args(*options))
    dq, dk, dv, dsinks, dmask = _run_backward(dout, q, k, v, out, lse, params, alibi_slopes, sinks, attn_mask,
                                              rng_state)
    return (*_op_grads((dq, dk, dv, dsinks)), _none_as_empty(dmask, dq.device))


def _none_as_empty(grad, device):
    """An op returns no None: an empty float32 tensor stands for a gradient that is not there."""
    return torch.zeros(0, dtype=torch.float32, device=device) if grad is None else grad


def _op_grads(grads):
    """A backward op's dq, dk, dv and dsinks (empty without sinks)."""
    dq, dk, dv, dsinks = grads
    return dq, dk, dv, _none_as_empty(dsinks, dq.device)


def _grads_fake(q, k, v, sinks):
    sinks_grad = q.new_zeros(0 if sinks is None else sinks.shape[0], dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), sinks_grad


def _backward_fake(dout, q, k, v, out, lse, alibi_slopes, sinks, attn_mask, rng_state, *options):
    if AttentionOptions.from_op_args(*options).attn_mask_grad:
        mask_grad = attn_mask.new_empty(attn_mask.shape)
    else:
        mask_grad = q.new_zeros(0, dtype=torch.float32)
    return (*_grads_fake(q, k, v, sinks), mask_grad)


forward_op = torch.library.custom_op(
    "fmha::forward", _forward, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {_SCORES}, {_OPTIONS}) -> (Tensor, Tensor)")
forward_op.register_fake(_forward_fake)

backward_op = torch.library.custom_op(
    "fmha::backward", _backward_impl, mutates_args=(),
    schema=f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_SCORES}, {_OPTIONS}) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
backward_op.register_fake(_backward_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, alibi_slopes, sinks, attn_mask, rng_state, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks, attn_mask, rng_state)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, alibi_slopes, sinks, attn_mask, rng_state = ctx.saved_tensors
    dq, dk, dv, dsinks, dmask = backward_op(grad_out, q, k, v, out, lse, alibi_slopes, sinks, attn_mask, rng_state,
                                            *ctx.options)
    mask_grad = AttentionOptions.from_op_args(*ctx.options).attn_mask_grad
    return ((dq, dk, dv, None, None if sinks is None else dsinks, dmask if mask_grad else None, None)
            + (None,) * _OPTION_COUNT)


forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """Autograd of an eager call: the prepared forward and the backward launched directly.

    The custom ops above carry the same formula for torch.compile, which traces their fakes. Eager
    calls skip them: torch.library's autograd wrapper rebuilds the op's schema arguments once per
    argument on every call (quadratic in their number) and dispatches twice, host time that a short
    forward+backward waits for (docs/perf.md, "Host time of a forward+backward")."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, attn_mask, params, prepared, scores, seqlens):
        out, lse = _launch_forward(prepared, q, k, v, scores, *seqlens)
        ctx.save_for_backward(q, k, v, out, lse, sinks, attn_mask)
        ctx.params, ctx.scores, ctx.seqlens = params, scores, seqlens
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # else every backward first fills a zero gradient of the LSE
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        if grad_out is None:  # the output did not reach what was differentiated
            return (None,) * 9
        q, k, v, out, lse, sinks, attn_mask = ctx.saved_tensors
        scores = ctx.scores
        dq, dk, dv, dsinks, dmask = _run_backward(grad_out, q, k, v, out, lse, ctx.params, scores.alibi_slopes, sinks,
                                                  attn_mask, scores.rng_state, ctx.seqlens)
        return dq, dk, dv, dsinks, dmask, None, None, None, None


def needs_grad(q, k, v, sinks=None, attn_mask=None) -> bool:
    """Whether a call records autograd: grad mode on and an input that requires grad."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or sinks is not None and sinks.requires_grad
                                        or attn_mask is not None and attn_mask.requires_grad)


def differentiable(params: AttentionParams, prepared, q, k, v, scores: ScoreTensors = NO_SCORE_TENSORS, seqlens=()):
    """``(out, lse)`` of a validated eager call whose inputs require grad, recorded for autograd
    (``seqlens``: the packed sequences' cu_seqlens)."""
    return _EagerAttention.apply(q, k, v, scores.sinks, scores.attn_mask, params, prepared, scores, seqlens)


def launch(params: AttentionParams, prepared, q, k, v, scores: ScoreTensors = NO_SCORE_TENSORS, seqlens=()):
    """``(out, lse)`` of a validated eager call and its prepared forward, differentiable when an
    input requires grad."""
    if needs_grad(q, k, v, scores.sinks, scores.attn_mask):
        return differentiable(params, prepared, q, k, v, scores, seqlens)
    return _launch_forward(prepared, q, k, v, scores, *seqlens)


def forward(q, k, v, params: AttentionParams, scores: ScoreTensors = NO_SCORE_TENSORS):
    """``(out, lse)`` of a validated call: the custom op when traced, else :func:`launch`."""
    if torch.compiler.is_compiling():
        return forward_op(q, k, v, scores.alibi_slopes, scores.sinks, scores.attn_mask, scores.rng_state,
                          *params.options.op_args())
    return launch(params, dispatch.prepared_forward(params, q, k, v), q, k, v, scores)


# Packed sequences (varlen): q (total_q, Hq, D), k and v (total_k, Hkv, D), int32 cu_seqlens;
# the LSE is (Hq, total_q). max_seqlen_q/k are tile hints: the kernels read the lengths on the device.

def run_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       options: AttentionOptions, scores: ScoreTensors = NO_SCORE_TENSORS):
    params = AttentionParams.packed(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, options)
    prepared = dispatch.prepared_forward(params, q, k, v, cu_seqlens_q, cu_seqlens_k)
    return _launch_forward(prepared, q, k, v, scores, cu_seqlens_q, cu_seqlens_k)


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, attn_mask,
                    rng_state, *options):
    return run_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              AttentionOptions.from_op_args(*options),
                              score_tensors(alibi_slopes, sinks, attn_mask, rng_state))


def _varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks,
                         attn_mask, rng_state, *options):
    return dispatch.empty_output(q, v.shape[-1]), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _varlen_backward_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          alibi_slopes, sinks, attn_mask, rng_state, *options):
    params = AttentionParams.packed(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                                    AttentionOptions.from_op_args(*options))
    return _op_grads(_run_backward(dout, q, k, v, out, lse, params, alibi_slopes, sinks, attn_mask, rng_state,
                                   seqlens=(cu_seqlens_q, cu_seqlens_k))[:4])


def _varlen_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          alibi_slopes, sinks, attn_mask, rng_state, *options):
    return _grads_fake(q, k, v, sinks)


_SEQLENS = "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k"
varlen_forward_op = torch.library.custom_op(
    "fmha::varlen_forward", _varlen_forward, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {_SEQLENS}, {_SCORES}, {_OPTIONS}) -> (Tensor, Tensor)")
varlen_forward_op.register_fake(_varlen_forward_fake)

varlen_backward_op = torch.library.custom_op(
    "fmha::varlen_backward", _varlen_backward_impl, mutates_args=(),
    schema=f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_SEQLENS}, {_SCORES}, {_OPTIONS}) "
           "-> (Tensor, Tensor, Tensor, Tensor)")
varlen_backward_op.register_fake(_varlen_backward_fake)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, attn_mask, rng_state, \
        *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, attn_mask, rng_state)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, attn_mask, rng_state = ctx.saved_tensors
    dq, dk, dv, dsinks = varlen_backward_op(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                            *ctx.max_seqlens, alibi_slopes, sinks, attn_mask, rng_state,
                                            *ctx.options)
    return (dq, dk, dv) + (None,) * 4 + (None, None if sinks is None else dsinks, None, None) + (None,) * _OPTION_COUNT


varlen_forward_op.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)
