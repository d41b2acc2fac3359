"""Random calls on the GPU, each held to the float64 reference by the project's error rule.

The test grids cover chosen shapes; this draws the arguments at random (shapes that are not tile
multiples, head dims 16-256 (v's own for some calls), GQA, windows, the score features, dropout
with the kernels' own keep pattern, BSHD views, packed sequences, KV caches and paged caches) and
checks every call: the output, the LSE, the gradients, and for ``deterministic=True`` bitwise-equal
gradients on a second run. Several worker processes share the GPU so that kernel builds overlap.

    PYTHONPATH=src python benchmarks/random_calls.py --seconds 300 --workers 8 --log $OUT/random_calls.log
    PYTHONPATH=src python benchmarks/random_calls.py --kinds kvcache,paged_varlen ...  # some kinds only
    TRITON_INTERPRET=1 FMHA_RANDOM_CALLS_DEVICE=cpu PYTHONPATH=src python benchmarks/random_calls.py \
        --workers 2 ...  # the portable kernels under the interpreter, small shapes, no bf16

Each failure is printed with the arguments that reproduce it (``--replay`` takes its JSON). Rows
that see one key, where torch's same-dtype answer is exact, are held to the two roundings the
kernels document there: gradients get the term of delta = rowsum(dO · O) taken from the rounded
output (``assert_grads_close(out=...)``), and the Hopper forward's bounded softcap one more half
unit in the last place (:func:`output_roundings`; docs/perf.md, session 47).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import traceback

import torch

import fmha
from fmha import ops
from fmha.backends.gluon_sm90.schedule import softcap_kind, tile_head_dim
from fmha.backends.triton.launch import dropout_keep_mask, kernel_dropout_p
from fmha.masking import Window
from fmha.params import attention_params
from fmha.testing import (assert_close_to_reference, assert_grads_close, assert_sdpa_grads_close, check_kvcache,
                          check_paged_varlen, random_kvcache, random_paged_varlen, random_qkv)

LENGTHS = [1, 2, 17, 64, 127, 128, 129, 300, 640, 1000, 1536, 2049]
HEAD_DIMS = [64, 64, 64, 128, 128, 128, 256, 256, 8, 16, 24, 32, 40, 48, 80, 96, 112, 136, 160, 192, 200, 256]
# the other kinds' own head dims (the KV-cache kernels' tile widths, the models' sizes); --head-dims sets them all
KVCACHE_HEAD_DIMS = [64, 128, 128, 32, 80, 256]
PAGED_VARLEN_HEAD_DIMS = [64, 128, 32, 96]
SDPA_HEAD_DIMS = [64, 128, 40]
# v's own head dim, drawn for a fifth of the dense, packed and SDPA calls (MLA's 128 at D = 192 among them)
VALUE_HEAD_DIMS = [128, 128, 64, 16, 40, 96, 136, 192, 256]
WINDOW_SIDES = [None, None, None, 0, 1, 63, 256, 1024]
MAX_PAIRS = 6e7  # B * Hq * Sq * Sk, so that the float64 reference stays small
DEVICE = os.environ.get("FMHA_RANDOM_CALLS_DEVICE", "cuda")  # "cpu": the interpreter, to try a replay


def draw_scores(rng):
    return dict(softcap=rng.choice([None, None, None, 30.0, 50.0]),
                alibi=rng.choice([None, None, None, None, "heads", "batch_heads"]),
                sinks=rng.random() < 0.2,
                dropout_p=rng.choice([0.0] * 6 + [0.1, 0.3]))


def score_tensors(case, batch, q_heads):
    generator = torch.Generator(device=DEVICE).manual_seed(case["seed"] + 1)
    scores = {}
    if case["softcap"]:
        scores["softcap"] = case["softcap"]
    if case["alibi"]:
        shape = (q_heads,) if case["alibi"] == "heads" else (batch, q_heads)
        scores["alibi_slopes"] = torch.rand(shape, device=DEVICE, generator=generator) * 0.3 + 0.01
    if case["sinks"]:
        scores["sinks"] = torch.randn(q_heads, device=DEVICE, generator=generator)
    return scores


def output_roundings(q, k, v, scores, on_hopper_forward):
    """Half-units in the last place that the output may be off beyond torch's error: 2 where the
    Hopper forward softmaxes a softcap against a fixed max (``softcap_kind`` "bounded", bf16). There
    P·V takes each probability rounded to bf16 and the row sum the float32 one, and no probability
    is exactly 1, so each row is off by up to 2^-9 before the output's own rounding: one unit in the
    last place in a row that sees one key, where torch's bf16 formula returns V's row exactly."""
    features = {name: scores[name] for name in ("softcap", "alibi_slopes") if name in scores}
    bounded = softcap_kind(attention_params("random_calls", q, k, v, **features)) == "bounded"
    return 2 if bounded and on_hopper_forward else 1


def detached(scores):
    """The score arguments for the reference: tensors detached, floats as they are."""
    return {name: value.detach() if torch.is_tensor(value) else value for name, value in scores.items()}


def draw_dense(rng):
    kv_heads, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 4, 8])
    batch = rng.choice([1, 2, 3])
    seqlen_q = rng.choice(LENGTHS)
    seqlen_k = seqlen_q if rng.random() < 0.5 else rng.choice(LENGTHS)
    while batch * kv_heads * group * seqlen_q * seqlen_k > MAX_PAIRS:
        seqlen_q = max(1, seqlen_q // 2)
    case = dict(kind="dense", batch=batch, kv_heads=kv_heads, q_heads=kv_heads * group, seqlen_q=seqlen_q,
                seqlen_k=seqlen_k, head_dim=rng.choice(HEAD_DIMS),
                dtype=rng.choice(["bfloat16", "bfloat16", "float16"]), layout=rng.choice(["bhsd", "bshd"]),
                causal=rng.random() < 0.5, left=rng.choice(WINDOW_SIDES), right=rng.choice(WINDOW_SIDES),
                backward=rng.random() < 0.5, deterministic=rng.random() < 0.15,
                views=[rng.choice(VIEWS) for _ in "qkv"])
    case.update(draw_scores(rng))
    # Half the calls the Gluon kernels could run name a Hopper schedule (the default picks the
    # portable forward for short calls).
    case["schedule"] = rng.choice([None, None, None, {}, {"q_buffers": 2}, {"q_buffers": 2, "pack_p": True},
                                   {"q_buffers": 2, "row_sum_mma": True}, {"q_buffers": 2, "pingpong": 0},
                                   {"consumers": 3, "q_buffers": 2, "row_sum_mma": True},
                                   {"block_n": 64, "pack_p": True}, {"block_n": 64, "dynamic": True, "pack_p": True}])
    case["head_dim_v"] = draw_value_head_dim(rng)
    return case


def draw_value_head_dim(rng):
    """v's head dim where it differs from q's, else None."""
    return rng.choice(VALUE_HEAD_DIMS) if rng.random() < 0.2 else None


# How each of q, k and v is laid out beyond `layout`: mostly as drawn; else every second row of a
# wider buffer (rows not 16-byte aligned), one element past a 16-byte boundary, the heads (or,
# with one head, the batch) expanded from one with stride 0, or the dimensions stored in a random order.
VIEWS = [None] * 6 + ["rows_apart", "unaligned", "expanded", "permuted"]


def restrided(tensor, view, rng):
    """``tensor``'s values (or, for "expanded", those of its first head or batch) in the view
    ``view``; the memory around a view holds NaN, so that reading past it shows."""
    batch, heads, seqlen, head_dim = tensor.shape
    if view == "rows_apart":
        wider = torch.full((batch, heads, 2 * seqlen, head_dim + 3), float("nan"), dtype=tensor.dtype,
                           device=tensor.device)
        wider[:, :, ::2, 1:head_dim + 1] = tensor
        return wider[:, :, ::2, 1:head_dim + 1]
    if view == "unaligned":
        flat = torch.full((tensor.numel() + 1,), float("nan"), dtype=tensor.dtype, device=tensor.device)
        flat[1:] = tensor.reshape(-1)
        return flat[1:].view(tensor.shape)
    if view == "expanded":
        return tensor[:, :1].expand(tensor.shape) if heads > 1 else tensor[:1].expand(tensor.shape)
    if view == "permuted":
        order = list(range(4))
        rng.shuffle(order)
        return tensor.permute(order).contiguous().permute([order.index(d) for d in range(4)])
    return tensor


def reference_window(seqlen_q, seqlen_k, left, right, causal):
    if causal:
        right = 0 if right is None else min(right, 0)
    return Window.of(seqlen_q, seqlen_k, left=left, right=right)


def run_dense(case):
    dtype = getattr(torch, case["dtype"])
    generator = torch.Generator(device=DEVICE).manual_seed(case["seed"])
    q, k, v = random_qkv(case["batch"], case["q_heads"], case["kv_heads"], case["seqlen_q"], case["seqlen_k"],
                         case["head_dim"], dtype, device=DEVICE, layout=case["layout"], generator=generator,
                         head_dim_v=case.get("head_dim_v"))
    views_rng = random.Random(case["seed"])
    q, k, v = (restrided(t, view, views_rng) for t, view in zip((q, k, v), case.get("views", [None] * 3)))
    scores = score_tensors(case, case["batch"], case["q_heads"])
    window = (case["left"], case["right"]) if case["left"] is not None or case["right"] is not None else None
    kwargs = dict(causal=case["causal"], window=window, deterministic=case["deterministic"], **scores)
    if case["dropout_p"]:
        kwargs["dropout_p"] = case["dropout_p"]
    if case.get("schedule") is not None and torch.cuda.get_device_capability() == (9, 0):
        schedule = fmha.HopperSchedule(**case["schedule"])
        if tile_head_dim(case["head_dim"]) and not schedule.build_refusal(tile_head_dim(case["head_dim"])):
            try:
                fmha.explain(q, k, v, config=schedule, **kwargs)
                kwargs["config"] = schedule
            except ValueError:  # the Gluon kernel refuses this call: the default runs it
                pass
    explanation = fmha.explain(q, k, v, **kwargs)
    case["backend"] = f"{explanation.backend} / {explanation.backward}"
    leaves = (q, k, v) + ((scores["sinks"],) if "sinks" in scores else ())
    if case["backward"]:
        for leaf in leaves:
            leaf.requires_grad_()
    dropout_generator = torch.Generator(device=DEVICE)

    def call():
        dropout_generator.manual_seed(case["seed"] + 2)
        out, lse = fmha.attention(q, k, v, return_lse=True, generator=dropout_generator, **kwargs)
        return out, lse

    out, lse = call()
    reference = detached(scores)
    if case["dropout_p"]:
        dropout_generator.manual_seed(case["seed"] + 2)
        keep = dropout_keep_mask(ops.dropout_seed(dropout_generator, q.device),
                                 case["batch"] * case["q_heads"] * case["seqlen_q"], case["seqlen_k"],
                                 case["dropout_p"], seqlen_q=case["seqlen_q"])
        reference.update(dropout_p=kernel_dropout_p(case["dropout_p"]),
                         keep=keep.view(case["batch"], case["q_heads"], case["seqlen_q"], case["seqlen_k"]))
    window_rule = reference_window(case["seqlen_q"], case["seqlen_k"], case["left"], case["right"], case["causal"])
    inputs = [t.detach() for t in (q, k, v)]
    lse_tol = None
    if "config" in kwargs and kwargs["config"].row_sum_mma and dtype != torch.float32:
        # The row sums count P as P·V takes it, rounded to 16 bits: one more unit roundoff of the LSE.
        lse_tol = 1e-3 + torch.finfo(dtype).eps / 2
    assert_close_to_reference(out.detach(), *inputs, window=window_rule, lse=lse, lse_tol=lse_tol,
                              roundings=output_roundings(*inputs, reference,
                                                         explanation.backend.startswith("gluon_sm90")),
                              **reference)
    if not case["backward"]:
        return
    dout = torch.randn(out.shape, device=DEVICE, dtype=dtype, generator=generator)
    grads = torch.autograd.grad(out, leaves, dout)
    assert_grads_close(grads, *inputs, dout, window=window_rule, out=out.detach(), **reference)
    if case["deterministic"]:
        again = torch.autograd.grad(call()[0], leaves, dout)
        assert all(torch.equal(a, b) for a, b in zip(grads, again)), "deterministic gradients differ between runs"


def draw_varlen(rng):
    count = rng.choice([1, 2, 3, 5, 8])
    pool = [0, 1, 2, 63, 64, 65, 200, 777, 1500]
    lengths_q = [rng.choice(pool) for _ in range(count)]
    lengths_k = list(lengths_q) if rng.random() < 0.5 else [rng.choice(pool) for _ in range(count)]
    kv_heads, group = rng.choice([1, 2]), rng.choice([1, 2, 4])
    case = dict(kind="varlen", lengths_q=lengths_q, lengths_k=lengths_k, kv_heads=kv_heads,
                q_heads=kv_heads * group, head_dim=rng.choice(HEAD_DIMS), dtype=rng.choice(["bfloat16", "float16"]),
                causal=rng.random() < 0.5, left=rng.choice(WINDOW_SIDES), right=rng.choice(WINDOW_SIDES),
                backward=rng.random() < 0.5)
    case.update(draw_scores(rng))
    case["head_dim_v"] = draw_value_head_dim(rng)
    return case


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)


def run_varlen(case):
    dtype = getattr(torch, case["dtype"])
    generator = torch.Generator(device=DEVICE).manual_seed(case["seed"])
    lengths_q, lengths_k = case["lengths_q"], case["lengths_k"]
    q = torch.randn(sum(lengths_q), case["q_heads"], case["head_dim"], device=DEVICE, dtype=dtype, generator=generator)
    head_dims = (case["head_dim"], case.get("head_dim_v") or case["head_dim"])
    k, v = (torch.randn(sum(lengths_k), case["kv_heads"], head_dim, device=DEVICE, dtype=dtype, generator=generator)
            for head_dim in head_dims)
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    scores = score_tensors(case, len(lengths_q), case["q_heads"])
    leaves = (q, k, v) + ((scores["sinks"],) if "sinks" in scores else ())
    if case["backward"]:
        for leaf in leaves:
            leaf.requires_grad_()
    window = (case["left"], case["right"]) if case["left"] is not None or case["right"] is not None else None
    dropout_generator = torch.Generator(device=DEVICE).manual_seed(case["seed"] + 2)
    out, lse = fmha.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=case["causal"],
                                     window=window, dropout_p=case["dropout_p"], generator=dropout_generator,
                                     return_lse=True, **scores)
    keep = None
    if case["dropout_p"]:
        dropout_generator.manual_seed(case["seed"] + 2)
        keep = dropout_keep_mask(ops.dropout_seed(dropout_generator, q.device), case["q_heads"] * q.shape[0],
                                 k.shape[0], case["dropout_p"], cu_seqlens_q=cu_q)
        keep = keep.view(case["q_heads"], q.shape[0], k.shape[0])
    dout = torch.randn(out.shape, device=DEVICE, dtype=dtype, generator=generator)
    grads = torch.autograd.grad(out, leaves, dout) if case["backward"] else None
    # packed calls have no explain(): where the Hopper forward could have run them
    on_hopper = (q.is_cuda and torch.cuda.get_device_capability() == (9, 0)
                 and tile_head_dim(case["head_dim"]) is not None)
    for b, (length_q, length_k) in enumerate(zip(lengths_q, lengths_k)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        q_b, k_b, v_b, out_b, dout_b = (t.detach()[s].transpose(0, 1)[None] for t, s in
                                        ((q, rows), (k, keys), (v, keys), (out, rows), (dout, rows)))
        reference = detached(scores)
        if "alibi_slopes" in reference and reference["alibi_slopes"].ndim == 2:
            reference["alibi_slopes"] = reference["alibi_slopes"][b]
        if keep is not None:
            reference.update(dropout_p=kernel_dropout_p(case["dropout_p"]), keep=keep[:, rows, :length_k][None])
        window_rule = reference_window(length_q, length_k, case["left"], case["right"], case["causal"])
        assert_close_to_reference(out_b, q_b, k_b, v_b, window=window_rule, lse=lse[:, rows][None],
                                  roundings=output_roundings(q_b, k_b, v_b, reference, on_hopper), **reference)
        if grads is not None and length_q and length_k:
            # dq, dk, dv only: the sinks' gradient sums over every sequence (the dense calls check it)
            grads_b = [g[s].transpose(0, 1)[None] for g, s in zip(grads, (rows, keys, keys))]
            assert_grads_close(grads_b, q_b, k_b, v_b, dout_b, window=window_rule, out=out_b, **reference)


def draw_kvcache(rng):
    kv_heads, group = rng.choice([1, 2, 8]), rng.choice([1, 2, 4, 8])
    capacity = rng.choice([16, 100, 1000, 4096, 5000])
    new_keys = min(rng.choice([0, 0, 1, 1, 2, 7, 64]), capacity)
    seqlen_q = rng.choice([1, 1, 1, 2, 4, 7, 64])
    head_dim = rng.choice(KVCACHE_HEAD_DIMS)
    case = dict(kind="kvcache", batch=rng.choice([1, 2, 5, 8]), seqlen_q=seqlen_q, kv_heads=kv_heads,
                q_heads=kv_heads * group, head_dim=head_dim, capacity=capacity, new_keys=new_keys,
                page_size=rng.choice([None, None, 1, 16, 64, 100, 256]), dtype=rng.choice(["bfloat16", "float16"]),
                causal=rng.random() < 0.5, window=[rng.choice([-1, -1, 0, 5, 300]), rng.choice([-1, -1, 0, 3])],
                softcap=rng.choice([0.0, 0.0, 30.0]), alibi=rng.random() < 0.2,
                num_splits=rng.choice([0, 0, 0, 1, 3, 8]),
                rotary_dim=rng.choice([0, 0, 0, 32, head_dim]) if new_keys and seqlen_q <= new_keys else 0,
                rotary_interleaved=rng.random() < 0.5, batch_idx=rng.random() < 0.3, leftpad=rng.random() < 0.3)
    if case["page_size"] == 1 and capacity > 1000:
        case["page_size"] = 16
    return case


def run_kvcache(case):
    dtype = getattr(torch, case["dtype"])
    inputs = random_kvcache(case["batch"], case["seqlen_q"], case["q_heads"], case["kv_heads"], case["head_dim"],
                            case["capacity"], new_keys=case["new_keys"], dtype=dtype, device=DEVICE,
                            page_size=case["page_size"], rotary_dim=case["rotary_dim"], seed=case["seed"])
    generator = torch.Generator().manual_seed(case["seed"] + 1)
    if case.get("batch_idx") and case["page_size"] is None:  # the sequences in a shuffled order of cache rows
        inputs["cache_batch_idx"] = torch.randperm(case["batch"], generator=generator).to(DEVICE, torch.int32)
    if case.get("leftpad"):  # each sequence starts somewhere in its cached keys
        lengths = inputs["cache_seqlens"].cpu()
        pads = (torch.rand(case["batch"], generator=generator) * (lengths + 1)).long().clamp(max=lengths)
        inputs["cache_leftpad"] = pads.to(DEVICE, torch.int32)
    options = dict(causal=case["causal"], window_size=tuple(case["window"]), softcap=case["softcap"],
                   num_splits=case["num_splits"])
    if case["alibi"]:
        options["alibi_slopes"] = torch.rand(case["q_heads"], device=DEVICE) * 0.3 + 0.01
    if case["rotary_dim"]:
        options["rotary_interleaved"] = case["rotary_interleaved"]
    check_kvcache(fmha.flash_attn_with_kvcache, inputs, **options)


def draw_paged_varlen(rng):
    count = rng.choice([1, 2, 4, 7])
    lengths_q = [rng.choice([0, 1, 1, 3, 40, 300]) for _ in range(count)]
    lengths_k = [rng.choice([0, 1, 50, 700, 2000]) for _ in range(count)]
    kv_heads = rng.choice([1, 2, 4])
    return dict(kind="paged_varlen", lengths_q=lengths_q, lengths_k=lengths_k, kv_heads=kv_heads,
                q_heads=kv_heads * rng.choice([1, 2, 4]), head_dim=rng.choice(PAGED_VARLEN_HEAD_DIMS),
                page_size=rng.choice([1, 16, 64, 100, 256]), dtype=rng.choice(["bfloat16", "float16"]),
                causal=rng.random() < 0.5, window=[rng.choice([-1, -1, 0, 100]), rng.choice([-1, -1, 0, 7])],
                softcap=rng.choice([0.0, 0.0, 30.0]), spare_blocks=rng.choice([0, 2]))


def run_paged_varlen(case):
    inputs = random_paged_varlen(case["lengths_q"], case["lengths_k"], case["q_heads"], case["kv_heads"],
                                 case["head_dim"], case["page_size"], dtype=getattr(torch, case["dtype"]),
                                 device=DEVICE, spare_blocks=case["spare_blocks"], seed=case["seed"])
    check_paged_varlen(fmha.flash_attn_varlen_func, inputs, causal=case["causal"],
                       window_size=tuple(case["window"]), softcap=case["softcap"])


def draw_sdpa(rng):
    batch, kv_heads, group = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([1, 4])
    seqlen_q, seqlen_k = rng.choice([1, 17, 128, 300, 1000]), rng.choice([1, 64, 129, 700])
    return dict(kind="sdpa", batch=batch, kv_heads=kv_heads, q_heads=kv_heads * group, seqlen_q=seqlen_q,
                seqlen_k=seqlen_k, head_dim=rng.choice(SDPA_HEAD_DIMS), dtype=rng.choice(["bfloat16", "float16"]),
                mask_shape=[rng.choice([1, batch]), rng.choice([1, kv_heads * group]), rng.choice([1, seqlen_q]),
                            seqlen_k],
                mask_dtype=rng.choice(["bool", "float32", "same"]), expand=rng.random() < 0.3,
                is_causal=rng.random() < 0.2,
                # leading dims that broadcast, as torch's SDPA takes them: a key/value batch of one,
                # and one key/value head for every query head without enable_gqa
                kv_batch=1 if rng.random() < 0.25 else batch,
                broadcast_heads=kv_heads == 1 and group > 1 and rng.random() < 0.5,
                head_dim_v=draw_value_head_dim(rng),
                # gradients (where no row is hidden entirely: float masks or none), a float mask's too
                backward=rng.random() < 0.4)


def run_sdpa(case):
    import torch.nn.functional as F

    dtype = getattr(torch, case["dtype"])
    generator = torch.Generator(device=DEVICE).manual_seed(case["seed"])
    q, k, v = random_qkv(case["batch"], case["q_heads"], case["kv_heads"], case["seqlen_q"], case["seqlen_k"],
                         case["head_dim"], dtype, device=DEVICE, generator=generator, head_dim_v=case.get("head_dim_v"))
    kv_batch = case.get("kv_batch", case["batch"])
    k, v = k[:kv_batch], v[:kv_batch]
    shape = case["mask_shape"]
    if case["mask_dtype"] == "bool":
        mask = torch.rand(shape, device=DEVICE, generator=generator) < 0.8
    else:
        mask = (torch.randn(shape, device=DEVICE, generator=generator) * 2).to(
            torch.float32 if case["mask_dtype"] == "float32" else dtype)
    backward = case.get("backward", False) and (case["is_causal"] or mask.dtype != torch.bool)
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    if backward and not case["is_causal"]:
        mask.requires_grad_()
        leaves.append(mask)
    q, k, v = leaves[:3]
    if case["expand"]:
        mask = mask.expand(case["batch"], case["q_heads"], case["seqlen_q"], case["seqlen_k"])
    if case["is_causal"]:
        mask = None
    gqa = case["kv_heads"] != case["q_heads"] and not case.get("broadcast_heads")
    got = fmha.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=case["is_causal"], enable_gqa=gqa)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with torch.no_grad():
        ref_mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=ref_mask,
                                             is_causal=case["is_causal"], enable_gqa=gqa)
        same_mask = mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)
        with sdpa_kernel(SDPBackend.MATH):
            same = F.scaled_dot_product_attention(q, k, v, attn_mask=same_mask, is_causal=case["is_causal"],
                                                  enable_gqa=gqa)
    assert torch.equal(got.isnan(), ref.isnan()), "NaN rows differ from torch's"
    error = (got.double() - ref).nan_to_num().abs().max().item()
    torch_error = (same.double() - ref).nan_to_num().abs().max().item()
    atol = {torch.float16: 1e-4, torch.bfloat16: 1e-3, torch.float32: 1e-6}[dtype]
    assert error <= 2 * torch_error + atol, f"max error {error:.3g} > 2 * torch's {torch_error:.3g}"
    if backward:
        dout = torch.randn(got.shape, device=DEVICE, dtype=dtype, generator=generator)
        grads = torch.autograd.grad(got, leaves, dout)
        assert_sdpa_grads_close(grads, *leaves[:3], leaves[3] if len(leaves) == 4 else mask, dout, got.detach(),
                                enable_gqa=gqa, is_causal=case["is_causal"])


FAMILIES = {"dense": (draw_dense, run_dense, 5), "varlen": (draw_varlen, run_varlen, 2),
            "kvcache": (draw_kvcache, run_kvcache, 2), "paged_varlen": (draw_paged_varlen, run_paged_varlen, 1),
            "sdpa": (draw_sdpa, run_sdpa, 1)}


def interpreter_case(case):
    """The case as Triton's interpreter on the CPU runs it (``FMHA_RANDOM_CALLS_DEVICE=cpu``): no
    bf16 (its products are wrong there: float32 for the attention kinds, float16 for the others,
    whose checks know the 16-bit types), no Hopper schedule, and lengths cut to at most 130 with
    their odd tails kept, batches to 2."""
    def small(length):
        return length if length <= 130 else 64 + length % 67

    if case.get("dtype") == "bfloat16":
        case["dtype"] = "float32" if case["kind"] in ("dense", "varlen") else "float16"
    case["schedule"] = None
    for name in ("lengths_q", "lengths_k"):
        if name in case:
            case[name] = [small(length) for length in case[name]]
    if "mask_shape" in case:  # SDPA's mask spans the keys and, unless broadcast, the queries
        case["mask_shape"][2] = small(case["mask_shape"][2])
        case["mask_shape"][3] = small(case["mask_shape"][3])
    for name in ("seqlen_q", "seqlen_k", "capacity"):
        if name in case:
            case[name] = small(case[name])
    if "batch" in case:
        case["batch"] = min(case["batch"], 2)
    if case["kind"] == "kvcache":
        case["new_keys"] = min(case["new_keys"], case["capacity"])
        if case["rotary_dim"] and case["seqlen_q"] > case["new_keys"]:
            case["rotary_dim"] = 0
    if case["kind"] == "sdpa" and case["mask_shape"][0] > case["batch"]:
        case["mask_shape"][0] = case["batch"]
    return case


def run_case(case):
    torch.manual_seed(case["seed"])
    FAMILIES[case["kind"]][1](case)


def worker(seed: int, seconds: float, kinds=None) -> None:
    rng = random.Random(seed)
    names = [name for name, (_, _, weight) in FAMILIES.items() for _ in range(weight) if not kinds or name in kinds]
    deadline = time.time() + seconds
    while time.time() < deadline:
        case = FAMILIES[rng.choice(names)][0](rng)
        case["seed"] = rng.randrange(1 << 30)
        if DEVICE == "cpu":
            case = interpreter_case(case)
        started = time.time()
        try:
            run_case(case)
            status = "ok"
        except Exception as error:  # every failure is reported with its arguments
            status = f"FAIL {type(error).__name__}: {str(error)[:400]}"
            print(json.dumps(case), file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
        print(json.dumps(dict(status=status, seconds=round(time.time() - started, 2), **case)), flush=True)
        if "CUDA error" in status:  # the process's CUDA context is lost: every later call would fail too
            return
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default="random_calls.log")
    parser.add_argument("--head-dims", help="comma-separated head dims that every kind draws from "
                        "(default for dense and varlen: %s)"
                        % ",".join(map(str, sorted(set(HEAD_DIMS)))))
    parser.add_argument("--kinds", help="comma-separated call kinds to draw (default: all of %s)" % ",".join(FAMILIES))
    parser.add_argument("--worker-seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--replay", help="a failure's JSON line: run that case alone")
    args = parser.parse_args()
    if args.head_dims:
        for choices in (HEAD_DIMS, KVCACHE_HEAD_DIMS, PAGED_VARLEN_HEAD_DIMS, SDPA_HEAD_DIMS):
            choices[:] = [int(d) for d in args.head_dims.split(",")]
    if args.replay:
        run_case(json.loads(args.replay))
        print("ok")
        return
    kinds = args.kinds.split(",") if args.kinds else None
    if kinds and not set(kinds) <= set(FAMILIES):
        parser.error(f"--kinds: unknown kinds {sorted(set(kinds) - set(FAMILIES))}")
    if args.worker_seed is not None:
        worker(args.worker_seed, args.seconds, kinds)
        return
    started = time.time()
    with open(args.log, "w") as log, open(args.log + ".err", "w") as errors:
        processes = [subprocess.Popen([sys.executable, __file__, "--worker-seed", str(args.seed * 1000 + i),
                                       "--seconds", str(args.seconds),
                                       *(["--head-dims", args.head_dims] if args.head_dims else []),
                                       *(["--kinds", args.kinds] if args.kinds else [])],
                                      stdout=log, stderr=errors)
                     for i in range(args.workers)]
        for process in processes:
            process.wait()
    lines = [json.loads(line) for line in open(args.log) if line.startswith("{")]
    failures = [line for line in lines if line["status"] != "ok"]
    by_kind = {}
    for line in lines:
        by_kind.setdefault(line["kind"], [0, 0])[line["status"] != "ok"] += 1
    print(f"{len(lines)} calls in {time.time() - started:.0f} s, {len(failures)} failures; "
          f"by kind (ok, failed): {by_kind}")
    for line in failures:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
