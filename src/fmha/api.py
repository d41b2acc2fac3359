"""Public entry points. The docstring of this module is fmha's feature list.

Supported
---------
* ``attention(q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None,
  sinks=None, dropout_p=0.0, generator=None, return_lse=False, deterministic=False, config=None)``:
  q is (B, Hq, Sq, D), k and v are (B, Hkv, Sk, D), Hq % Hkv == 0 (MHA, GQA, MQA).
* Any strides, including ``x.transpose(1, 2)`` of a BSHD tensor and stride 0 from
  ``expand``; nothing is copied. k and v expanded over their heads (one head repeated with
  stride 0) run the Hopper forward as that one KV head (MQA). The output has q's memory layout
  when q is dense. Any batch x heads, and rows that span 2^31 elements or more within one
  (batch, head) (kernels built with 64-bit row offsets for those calls).
* ``causal=True`` is bottom-right aligned as in FlashAttention: query i sees keys
  j <= i + Sk - Sq. A row that sees no key returns zeros and LSE = -inf.
* ``window=(left, right)``: query i sees keys pos(i) - left <= j <= pos(i) + right with
  pos(i) = i + Sk - Sq; ``None`` for a side leaves it unbounded; with ``causal=True`` the right
  side is min(right, 0). Forward (the Hopper kernel included) and backward, with GQA, Sq != Sk and
  every head dim; key blocks outside the window are skipped, so the cost follows the visible
  pairs. Also in ``naive_attention``.
* What each score becomes, in this order: ``scale``, ``softcap`` (``softcap * tanh(s / softcap)``),
  ``alibi_slopes`` ((Hq,) or (B, Hq) float32: ``- slope * |i + Sk - Sq - j|``), masking, softmax with
  ``sinks`` ((Hq,) float32, learnable: ``exp(sinks[h])`` joins each row's denominator), and
  ``dropout_p`` on P (FlashAttention's semantics). Forward and backward (the sinks' gradient
  included) on the portable kernels, dense and varlen, with causal, windows and GQA; on sm_90 the
  Gluon forward and backward run all of them; decode-like calls keep
  the per-tile forward. Dropout's bits are
  made in the kernels from a philox key drawn per call by one torch random op (``generator``, or
  torch's default generator): no mask in memory, the backward regenerates the same bits, a
  generator state gives bitwise the same output and gradients, and the call works under
  ``torch.compile`` and CUDA graphs. ALiBi slopes are not differentiated (as in FlashAttention).
* ``scaled_dot_product_attention`` mirrors ``torch.nn.functional.scaled_dot_product_attention``
  (top-left ``is_causal``, ``enable_gqa``, 3-D or higher inputs), with ``attn_mask`` (bool or
  float, float32 or the query's dtype, broadcast over batch and heads and read through its
  strides: stride-0 expanded masks are never materialised; on sm_90 the Gluon forward reads bool
  masks and the Gluon backward both kinds; a float mask that requires grad gets its gradient from
  the portable backward, dS for every score in float32, summed over the dims it broadcasts over)
  and ``dropout_p``; a row the mask hides entirely returns zeros, as torch's kernels do.
* ``naive_attention``: the materialising baseline, same contract as ``attention``.
* Packed variable-length sequences (varlen): ``varlen_attention(q, k, v, cu_seqlens_q,
  cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, scale, window, softcap, alibi_slopes, sinks,
  dropout_p, generator, return_lse)`` with q
  (total_q, Hq, D), k and v (total_k, Hkv, D) and int32 ``cu_seqlens``; causal and windows per
  sequence (bottom-right), Sq_i != Sk_i, GQA, sequences of length 0 and 1; LSE (Hq, total_q).
  Forward and backward (the Hopper kernels included) index the packed tensors directly (no
  padding copies); tiles run from a longest-first list made on the device, so one long sequence
  among many short ones does not run alone at the end. ``cu_seqlens`` values are checked on the
  CPU only (on a GPU that costs a synchronisation); the kernels clamp every sequence into the
  tensors. ``torch.compile(fullgraph=True)`` traces it (``fmha::varlen_forward``,
  ``fmha::varlen_backward``).
* FlashAttention-2's ``flash_attn_func``, ``flash_attn_qkvpacked_func``,
  ``flash_attn_kvpacked_func``, ``flash_attn_varlen_func``, ``flash_attn_varlen_qkvpacked_func``
  and ``flash_attn_varlen_kvpacked_func`` (``fmha.flash_attn``): its signatures, (B, S, H, D) and
  THD layouts, ``window_size`` (-1 unbounded), ``softcap``, ``alibi_slopes``, ``dropout_p`` and
  ``return_attn_probs`` (``(out, softmax_lse, None)``: the third item, FlashAttention's dropout
  pattern, is never materialised); no copies.
* FlashAttention-2's ``flash_attn_with_kvcache`` (``fmha.kvcache``), its signature and semantics:
  in-place append of new k/v at ``cache_seqlens`` (only those rows are written), contiguous caches
  or paged ones (``block_table``, any page size >= 1), ``cache_batch_idx``, ``cache_leftpad``,
  rotary on q and the new keys (interleaved or not, partial rotary dims), causal and
  ``window_size`` relative to each sequence's length after the append, GQA, any Sq >= 1,
  ``num_splits`` (0: heuristic), ``return_softmax_lse``. Lengths are read on the device (no host
  sync), so a decode step can be captured in a CUDA graph; ``torch.compile(fullgraph=True)``
  traces it (custom ops ``fmha::kvcache_append_attention``, ``fmha::kvcache_attention``). Forward
  only.
* ``explain(q, k, v, **kwargs)``: which backend, schedule and config a call would run, where the
  config comes from, and why the other backends refused.
* PyTorch's flash-attention registry (``fmha.integrations.sdpa``, torch 2.11 or later):
  ``torch.nn.attention.activate_flash_attention_impl("FMHA")`` (or ``sdpa.activate()``) runs
  ``aten::_scaled_dot_product_flash_attention``, ``aten::_flash_attention_forward`` (dense and
  ``cum_seq`` varlen, ``window_size``) and their backwards on fmha: ``F.scaled_dot_product_attention``
  under the flash backend, ``torch.nn.attention.varlen.varlen_attn`` and PyTorch's context
  parallelism. A call fmha refuses (dropout, ALiBi, debug mask, paged K/V) runs torch's own
  kernel, or raises ``NotImplementedError`` with ``strict=True``.
* Context parallelism on PyTorch's engine (``fmha.distributed``): ``context_parallel`` (torch's,
  with load balancing set from ``causal``), ``unshard``, and ``attention`` (the ring on local
  shards, also on CPU tensors with gloo). No sliding windows or varlen there: PyTorch's ring has neither.
* dtypes float16 and bfloat16; float32 as a slow exact path.
* Head dims 1 to 256, including non-powers of two (40, 80, 96, 192...). v's head dim may differ
  from q's and k's (DeepSeek's MLA: 192 and 128) in ``attention``, ``varlen_attention``,
  ``scaled_dot_product_attention`` (as torch's) and ``flash_attn_func`` / ``flash_attn_varlen_func``
  (as FlashAttention-3's): the output takes v's; forward and backward, with every feature above.
  On sm_90 the Gluon forward reads V and writes the output at their width where Dv is a multiple
  of 8 within the columns its products read at D, and the Gluon backward runs such calls with
  every tensor zero-padded to the wider head dim. The KV-cache functions need one head dim.
* Any Sq, Sk >= 1; empty batch, heads or sequences return empty (or zero) results, as torch's
  SDPA does (also through ``scaled_dot_product_attention`` with 3-D to 5-D inputs).
* CUDA tensors, and CPU tensors when ``TRITON_INTERPRET=1`` was set before import
  (the same Triton kernels, run by Triton's interpreter; bfloat16 computes in float32 there,
  because the interpreter's bfloat16 ``tl.dot`` is wrong, and is stored as bfloat16).
* Meta tensors: shapes and dtypes only, forward and backward (what ``torch.compile`` and
  ``torch.export`` trace with); nothing is launched.
* ``return_lse``: natural-log log-sum-exp, float32, shape (B, Hq, Sq); not differentiable.
* Backward: ``attention`` and ``scaled_dot_product_attention`` are differentiable in q, k
  and v (every case above). On Hopper (sm_90, fp16/bf16, head dims that are multiples of 8, dense or
  packed, every score feature) a warp-specialised Gluon kernel runs it and adds dQ with atomic adds, so dQ may differ in the last bits run to run;
  ``deterministic=True`` runs the portable backward, which uses none (bitwise reproducible).
* ``torch.compile(fullgraph=True)``: the ops are ``torch.library`` custom ops (``fmha::forward``,
  ``fmha::backward``) with fake implementations.
* Kernels (``fmha.dispatch``): on Hopper (sm_90), fp16/bf16 calls whose head dim is a multiple of 8
  run warp-specialised Gluon kernels, forward and backward, at the next tile width of 64, 128 or
  256, where the shipped tuning data (``fmha.tuning.schedules``) or the
  ``fmha tune`` cache picks one of its schedules; every other call, and every other GPU, runs the
  portable Triton kernel with tuned tiles. Decode-like calls (all query rows of a KV head fit
  one 64-row tile, and the KV heads fill less than half the GPU) run the split-KV forward: keys
  cut into chunks across the GPU, merged by their LSE. All give the same results within the
  error rule. A Hopper kernel that fails to compile (a triton outside the verified 3.6.0-3.9.0)
  falls back to the portable kernel with one warning.
  ``config=`` takes a ``ForwardConfig`` (the portable kernel's tiles) or a ``HopperSchedule``.

Not yet supported (raise ``NotImplementedError``)
-------------------------------------------------
* Gradients of ``naive_attention`` (a forward-only baseline).
* Dropout and gradients over a paged cache (``block_table`` in ``flash_attn_varlen_func``), as in
  FlashAttention.
* FP8.
"""

from __future__ import annotations

import dataclasses

import torch

from . import dispatch, ops
from .params import attention_params, check_flag, sdpa_attn_mask, varlen_params


def _described(value):
    """What validation reads of a score argument, for a call-signature key (a tensor's shape,
    strides, dtype and device; a generator's device); other values as they are."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.stride(), value.dtype, value.device)
    if isinstance(value, torch.Generator):
        return ("generator", value.device)
    return value


def _run(params, prepared, q, k, v, alibi_slopes, sinks, generator, *seqlens):
    """``(out, lse)`` of a validated call: the prepared launch, or the custom op when gradients need it.

    Dropout draws this call's philox key here (ops.dropout_seed), so that the forward and its
    backward read the same one.
    """
    rng_state = ops.dropout_seed(generator, q.device) if params.options.dropout_p > 0.0 else None
    return ops.launch(params, prepared, q, k, v, ops.score_tensors(alibi_slopes, sinks, None, rng_state), seqlens)


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, sinks=None,
              dropout_p=0.0, generator=None, return_lse=False, deterministic=False, config=None):
    """Exact fused attention softmax(q k^T * scale) v.

    Args:
        q: (B, Hq, Sq, D) float16, bfloat16 or float32, any strides.
        k, v: (B, Hkv, Sk, D) and (B, Hkv, Sk, Dv), same dtype and device, Hq % Hkv == 0. v's head
            dim may differ from q's and k's (DeepSeek's MLA: D = 192, Dv = 128); the output has Dv.
        causal: bottom-right aligned causal mask (query i sees keys j <= i + Sk - Sq).
        scale: score scale, default D**-0.5.
        window: ``(left, right)`` key window around each query's position ``i + Sk - Sq``;
            ``None`` for a side is unbounded; intersected with ``causal``.
        softcap: each score s (after the scale) becomes ``softcap * tanh(s / softcap)``; a float > 0,
            or None (off).
        alibi_slopes: float32 (Hq,) or (B, Hq); adds ``-slope[b, h] * |i + Sk - Sq - j|`` to each
            score after the softcap. Not differentiated (as in FlashAttention).
        sinks: float32 (Hq,), learnable: each row's softmax denominator gains ``exp(sinks[h])``, mass
            that goes to no key (gpt-oss). Differentiable.
        dropout_p: probability of dropping each entry of P (kept ones scaled by 1 / (1 - p)), as in
            FlashAttention-2, with p rounded to a multiple of 1/256 (8 random bits per entry; any
            0 < p < 1 stays between 1/256 and 255/256, and the scale is that of the rounded p); the
            random bits come from ``generator`` (None: torch's default generator of q's device), one
            key drawn per call, so the same generator state gives the same output and gradients.
        return_lse: also return the natural-log LSE, float32 (B, Hq, Sq); not differentiable. With
            sinks it counts the sink's term; dropout does not change it.
        deterministic: require bitwise-reproducible gradients: the portable backward (no atomics)
            instead of the Hopper one, which adds dQ with atomic adds (0.55-0.81x its speed on the H100).
        config: an explicit kernel choice, a ``fmha.ForwardConfig`` (the portable kernel's tiles)
            or a ``fmha.HopperSchedule`` (the Gluon kernel on sm_90); default: the tuned choice
            for this GPU and shape. A config whose kernel cannot run the call raises ValueError.

    Returns:
        out (B, Hq, Sq, Dv) in q's dtype, or ``(out, lse)`` when ``return_lse``.
    """
    if return_lse.__class__ is not bool:
        check_flag("fmha.attention", "return_lse", return_lse)
    if torch.compiler.is_compiling():  # traced: the custom op, whose fake implementation dynamo reads
        params = attention_params("fmha.attention", q, k, v, causal=causal, scale=scale, window=window,
                                  softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                                  generator=generator, deterministic=deterministic, config=config)
        rng_state = ops.dropout_seed(generator, q.device) if params.options.dropout_p > 0.0 else None
        out, lse = ops.forward_op(q, k, v, alibi_slopes, sinks, None, rng_state, *params.options.op_args())
        return (out, lse) if return_lse else out
    # A repeated call signature skips validation and dispatch: everything they read is in the key.
    try:
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, causal, causal.__class__, scale, scale.__class__, deterministic,
               deterministic.__class__, config, window, softcap, softcap.__class__, dropout_p, dropout_p.__class__,
               alibi_slopes is None and sinks is None and generator is None
               or (_described(alibi_slopes), _described(sinks), _described(generator)),
               (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15 == 0)
        found = dispatch.signatures.get(key)
    except (AttributeError, TypeError, RuntimeError):  # not tensors, unhashable arguments: the checks say why
        key = found = None
    if found is None:
        params = attention_params("fmha.attention", q, k, v, causal=causal, scale=scale, window=window,
                                  softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                                  generator=generator, deterministic=deterministic, config=config)
        found = (params, dispatch.prepared_forward(params, q, k, v))
        if key is not None:
            dispatch.remember(dispatch.signatures, key, found)
    if alibi_slopes is None and sinks is None and not dropout_p:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            out, lse = ops.differentiable(*found, q, k, v)  # the grad check is just above
        else:
            out, lse = found[1](q, k, v)
    else:
        out, lse = _run(*found, q, k, v, alibi_slopes, sinks, generator)
    return (out, lse) if return_lse else out


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
                     window=None, softcap=None, alibi_slopes=None, sinks=None, dropout_p=0.0, generator=None,
                     return_lse=False, deterministic=False):
    """Attention over packed variable-length sequences (FlashAttention's varlen layout).

    Args:
        q: (total_q, Hq, D); sequence b is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``.
        k, v: (total_k, Hkv, D) and (total_k, Hkv, Dv), cut by ``cu_seqlens_k``; Hq % Hkv == 0.
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,) on q's device, starting at 0, ending at the totals.
            Their values are read on the device and not checked there (that would cost a
            synchronisation); sequences are clamped into the tensors, so nothing outside them is
            read or written.
        max_seqlen_q, max_seqlen_k: the longest sequences (ints), used as tile hints only.
        causal, window, scale: as in :func:`attention`, per sequence (bottom-right aligned).
        softcap, alibi_slopes, sinks, dropout_p, generator: as in :func:`attention`; the ALiBi slopes
            are (Hq,) or (B, Hq) with B the number of sequences, each query at ``i + Sk_b - Sq_b``.

    Returns:
        out (total_q, Hq, Dv), or ``(out, lse)`` with lse (Hq, total_q) float32 when ``return_lse``.
    """
    return packed_attention("fmha.varlen_attention", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, causal=causal, scale=scale, window=window, softcap=softcap,
                            alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, generator=generator,
                            return_lse=return_lse, deterministic=deterministic)


def packed_attention(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, scale, window,
                     softcap, alibi_slopes, dropout_p, return_lse, deterministic, sinks=None, generator=None):
    """:func:`varlen_attention` for an entry point named ``fn`` (errors name it)."""
    if return_lse.__class__ is not bool:
        check_flag(fn, "return_lse", return_lse)
    if torch.compiler.is_compiling():  # traced: the custom op, whose fake implementation dynamo reads
        params = varlen_params(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                               scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                               dropout_p=dropout_p, generator=generator, deterministic=deterministic)
        rng_state = ops.dropout_seed(generator, q.device) if params.options.dropout_p > 0.0 else None
        out, lse = ops.varlen_forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k, params.seqlen_q, params.seqlen_k,
                                         alibi_slopes, sinks, None, rng_state, *params.options.op_args())
        return (out, lse) if return_lse else out
    # A repeated call signature skips validation and dispatch, as in attention(); CPU calls re-check
    # the cu_seqlens values every time.
    try:
        key = found = None
        if q.device.type != "cpu":
            key = ("varlen", q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
                   v.dtype, q.device, k.device, v.device, cu_seqlens_q.shape, cu_seqlens_k.shape,
                   cu_seqlens_q.stride(), cu_seqlens_k.stride(),
                   cu_seqlens_q.dtype, cu_seqlens_k.dtype, cu_seqlens_q.device, cu_seqlens_k.device,
                   max_seqlen_q, max_seqlen_q.__class__, max_seqlen_k, max_seqlen_k.__class__,
                   causal, causal.__class__, scale, scale.__class__, deterministic, deterministic.__class__,
                   window, softcap, softcap.__class__, dropout_p, dropout_p.__class__,
                   alibi_slopes is None and sinks is None and generator is None
                   or (_described(alibi_slopes), _described(sinks), _described(generator)),
                   (q.data_ptr() | k.data_ptr() | v.data_ptr() | cu_seqlens_q.data_ptr()
                    | cu_seqlens_k.data_ptr()) & 15 == 0)
            found = dispatch.signatures.get(key)
    except (AttributeError, TypeError, RuntimeError):  # not tensors, unhashable arguments: the checks say why
        key = found = None
    if found is None:
        params = varlen_params(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                               scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                               dropout_p=dropout_p, generator=generator, deterministic=deterministic)
        found = (params, dispatch.prepared_forward(params, q, k, v, cu_seqlens_q, cu_seqlens_k))
        if key is not None:
            dispatch.remember(dispatch.signatures, key, found)
    out, lse = _run(*found, q, k, v, alibi_slopes, sinks, generator, cu_seqlens_q, cu_seqlens_k)
    return (out, lse) if return_lse else out


def explain(q, k, v, **kwargs) -> dispatch.Explanation:
    """Which backend, schedule and config ``fmha.attention(q, k, v, **kwargs)`` would run, and why.

    ``print(fmha.explain(q, k, v, causal=True))`` lists the chosen kernel, where its config comes
    from (the ``fmha tune`` cache, the shipped defaults, a heuristic) and each backend that
    refused, with its reason. Nothing is launched (a Hopper kernel may be compiled).
    """
    kwargs.pop("return_lse", None)
    params = attention_params("fmha.explain", q, k, v, **kwargs)
    explanation = dispatch.prepared_forward(params, q, k, v).explanation
    if explanation.launch_free:
        return explanation
    backward, source = dispatch.BACKWARD_BACKEND.backward_config(params)
    portable = f"triton {backward} (from {source})"
    if params.device.type == "cuda":
        padding = ""
        if params.head_dim_v:  # the Gluon backward runs it with every tensor padded to one head dim
            params = dispatch.one_head_dim_params(params)
            q, k = (torch.empty((*t.shape[:-1], params.head_dim), dtype=t.dtype, device=t.device) for t in (q, k))
            v = k
            padding = f" (v, the output and the gradients zero-padded to head dim {params.head_dim})"
        # The gradients are allocated like q, k and v, and dout like the output.
        hopper, reason = dispatch.hopper_backward(params, q, q, k, v, q, k, v)
        if hopper is not None:
            return dataclasses.replace(explanation, backward=f"gluon_sm90 {hopper.text()}{padding}")
        portable += f"; not gluon_sm90: {reason}"
    return dataclasses.replace(explanation, backward=portable)


def naive_attention(q, k, v, *, causal=False, scale=None, window=None, return_lse=False):
    """Step 2 of the ladder: the same contract as :func:`attention`, with S and P materialised.

    Allocates B * Hq * Sq * Sk * (4 + element size) bytes for the score and probability matrices.
    """
    fn = "fmha.naive_attention"
    check_flag(fn, "return_lse", return_lse)
    params = attention_params(fn, q, k, v, causal=causal, scale=scale, window=window, backend="naive")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError(f"{fn}: the naive baseline is forward only; use fmha.attention for gradients "
                                  "or call it under torch.no_grad()")
    out, lse = dispatch.prepared_forward(params, q, k, v)(q, k, v)
    return (out, lse) if return_lse else out


def _broadcasts(query_shape, key_shape, value_shape, enable_gqa) -> bool:
    """Whether SDPA's inputs differ in leading dims (torch broadcasts them). Sizes are compared one
    by one where they can be: slicing a torch.Size costs more than the rest of the check."""
    if len(query_shape) == len(key_shape) == len(value_shape) == 4 and query_shape[0] == key_shape[0] == value_shape[0]:
        heads = query_shape[1], key_shape[1], value_shape[1]
    elif not query_shape[:-3] == key_shape[:-3] == value_shape[:-3]:
        return True
    else:
        heads = query_shape[-3], key_shape[-3], value_shape[-3]
    return not enable_gqa and not heads[0] == heads[1] == heads[2] and 1 in heads


def _broadcast_sdpa_inputs(fn, query, key, value, enable_gqa):
    """query, key and value expanded to common leading dims, as torch's SDPA broadcasts them (stride
    0, nothing copied here). Without ``enable_gqa`` heads broadcast too, and key and value that both
    have one head keep it: one KV head (MQA), for every query head."""
    try:
        if enable_gqa:  # heads are grouped, not broadcast
            batch = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
            heads = (query.shape[-3], key.shape[-3], value.shape[-3])
        else:
            *batch, query_heads = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
            # (N, L, E) inputs: dim -3 is their batch, which broadcasts like any other
            kv_heads = 1 if key.shape[-3] == value.shape[-3] == 1 and batch else query_heads
            heads = (query_heads, kv_heads, kv_heads)
    except RuntimeError:
        raise ValueError(f"{fn}: the leading dims of query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                         f"{tuple(value.shape)} do not broadcast"
                         + ("" if enable_gqa or query.shape[-3] == key.shape[-3]
                            else " (for grouped-query attention pass enable_gqa=True)")) from None
    return tuple(tensor.expand(*batch, tensor_heads, *tensor.shape[-2:])
                 for tensor, tensor_heads in zip((query, key, value), heads))


def _float_mask(attn_mask):
    """A 16-bit attn_mask that requires grad, read as float32, so that its gradient is summed over
    the dims it broadcasts over in float32 and rounded to its dtype once, as torch's is. A mask
    expanded by the caller (stride 0, not a leaf) stays a broadcast: its first element along those
    dims is converted and expanded again, and its gradient (the sum) lands there, which the
    caller's expand sums unchanged; a leaf keeps one gradient per element."""
    strides = attn_mask.stride()
    if attn_mask.grad_fn is None or 0 not in strides:
        return attn_mask.float()
    first = tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None)
                  for size, stride in zip(attn_mask.shape, strides))
    return attn_mask[first].float().expand(attn_mask.shape)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Same semantics: inputs (..., H, L, E) or (N, L, E), ``is_causal`` aligned top-left
    (query i sees keys 0..i), ``scale`` default E**-0.5, ``enable_gqa`` to let query
    heads be a multiple of key/value heads. Leading dims broadcast as in torch (stride-0 views:
    batch dims, and heads of size 1 without ``enable_gqa``). ``attn_mask``: bool (True takes part)
    or float (added to the scores), float32 or the query's dtype, broadcastable to (..., H, L, S);
    it is read through its strides (stride 0 where it broadcasts: nothing is expanded in memory). A
    float mask that requires grad gets its gradient (the backward writes dS for every score in
    float32, (B, H, L, S), then sums it over the dims the mask broadcasts over). A row that the mask
    hides entirely returns zeros, as torch's own kernels (2.5+) do.
    ``dropout_p`` draws from torch's default generator of the device. Unsupported arguments raise
    NotImplementedError.
    """
    fn = "fmha.scaled_dot_product_attention"
    names = ("query", "key", "value")
    for name, tensor in zip(names, (query, key, value)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.ndim < 3:
            raise ValueError(f"{fn}: {name} must have at least 3 dims (N, L, E), got shape {tuple(tensor.shape)}")
    is_causal = check_flag(fn, "is_causal", is_causal)
    if attn_mask is not None and is_causal:
        raise ValueError(f"{fn}: give attn_mask or is_causal=True, not both (as torch's SDPA)")
    enable_gqa = check_flag(fn, "enable_gqa", enable_gqa)
    grouped = enable_gqa
    if _broadcasts(query.shape, key.shape, value.shape, enable_gqa):
        query, key, value = _broadcast_sdpa_inputs(fn, query, key, value, enable_gqa)
        grouped = True  # key and value heads that broadcast stay one KV head
    if query.ndim == 3:
        q, k, v = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    elif query.ndim == 4:
        q, k, v = query, key, value
    else:  # fold extra leading dims into the batch (a view for contiguous inputs)
        batch = query.shape[:-3].numel()
        q, k, v = (t.reshape(batch, *t.shape[-3:]) for t in (query, key, value))
    mask_kind, mask_grad = "", False
    if attn_mask is not None:
        mask_grad = isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad and torch.is_grad_enabled()
        if mask_grad and attn_mask.dtype == query.dtype != torch.float32:
            attn_mask = _float_mask(attn_mask)
        attn_mask, mask_kind = sdpa_attn_mask(fn, attn_mask, query.shape, key.shape[-2], q.shape, query.dtype,
                                              query.device)
    params = attention_params(fn, q, k, v, causal=is_causal, scale=scale, dropout_p=dropout_p, top_left=True,
                              names=names, attn_mask_kind=mask_kind, attn_mask_grad=mask_grad)
    if q.shape[1] != k.shape[1] and not grouped:
        raise ValueError(f"{fn}: query has {q.shape[1]} heads and key {k.shape[1]}; "
                         "pass enable_gqa=True for grouped-query attention")
    rng_state = ops.dropout_seed(None, q.device) if params.options.dropout_p > 0.0 else None
    out, _ = ops.forward(q, k, v, params, ops.score_tensors(None, None, attn_mask, rng_state))
    return out.reshape(*query.shape[:-1], out.shape[-1]) if query.ndim != 4 else out
