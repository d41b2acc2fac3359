"""SDPA's attn_mask on the Hopper forward: correctness against float64, then speed side by side.

    PYTHONPATH=src python benchmarks/attn_mask_hopper.py OUT.json [--check-only | --bench-only]

Correctness: each mask form (bool, float32/bf16/fp16 biases, broadcast and stride-0 views, a
transposed mask, rows hidden entirely) through ``fmha.scaled_dot_product_attention`` on shapes with
even and odd key counts, against a float64 reference; the forward must run on the Gluon kernel.
Speed (bf16, B4 H16 S4096): fmha's default path, fmha with each Hopper block width, the portable
kernel, SDPA's memory-efficient and cuDNN backends with the same mask, and fmha without a mask.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha
from fmha import ops
from fmha.backends.gluon_sm90.schedule import HopperSchedule
from fmha.params import attention_params, sdpa_attn_mask


def make_mask(name: str, batch: int, heads: int, seqlen_q: int, seqlen_k: int, dtype, generator):
    dense = torch.rand(batch, heads, seqlen_q, seqlen_k, device="cuda", generator=generator)
    if name == "bool":
        return dense > 0.3
    if name == "bool_hidden_rows":  # some rows see nothing
        mask = dense > 0.3
        mask[:, :, ::7] = False
        return mask
    if name in ("float32", "bfloat16", "float16"):
        bias = (dense - 0.5) * 8
        bias[..., ::5] = float("-inf")
        return bias.to(getattr(torch, name))
    if name == "padding_stride0":
        keep = torch.arange(seqlen_k, device="cuda")[None, :] < torch.tensor([seqlen_k, seqlen_k // 3], device="cuda")[:batch, None]
        return keep[:, None, None, :]
    if name == "shared_2d":  # (Sq, Sk), broadcast over batch and heads
        return dense[0, 0] > 0.5
    if name == "per_head_bias":  # (H, Sq, Sk) broadcast over batch, the query's dtype
        return ((dense[0] - 0.5) * 4).to(dtype)
    if name == "transposed":  # keys not contiguous
        return (dense[0] > 0.5).transpose(-1, -2).contiguous().transpose(-1, -2)
    raise ValueError(name)


def reference(q, k, v, mask):
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.double()
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows that see nothing: zeros
    return probs @ v.double()


def gluon_forward(q, k, v, mask, schedule):
    """The Gluon forward with ``schedule`` (config=, so that nothing else runs it)."""
    view, kind = sdpa_attn_mask("check", mask, q.shape, k.shape[-2], q.shape, q.dtype, q.device)
    params = attention_params("check", q, k, v, top_left=True, attn_mask_kind=kind, config=schedule)
    return ops.forward(q, k, v, params, ops.score_tensors(None, None, view, None))[0]


def check(results: dict) -> bool:
    generator = torch.Generator(device="cuda").manual_seed(0)
    ok = True
    names = ["bool", "bool_hidden_rows", "float32", "bfloat16", "float16", "padding_stride0", "shared_2d",
             "per_head_bias", "transposed"]
    for head_dim in (64, 128):
        schedules = {"block128": HopperSchedule(q_buffers=2, emulated_exp2=8 if head_dim == 64 else 0),
                     "block64": HopperSchedule(block_n=64, stages=3, q_buffers=2)}
        for seqlen_q, seqlen_k in ((777, 1025), (1024, 2048), (300, 64), (129, 190)):
            q, k, v = (torch.randn(2, 4, s, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
                       for s in (seqlen_q, seqlen_k, seqlen_k))
            for name in names:
                if name == "float16":  # a float mask is float32 or the query's dtype
                    q, k, v = (t.half() for t in (q, k, v))
                mask = make_mask(name, 2, 4, seqlen_q, seqlen_k, q.dtype, generator)
                expected = reference(q, k, v, mask)
                with sdpa_kernel(SDPBackend.MATH):  # torch's own error in the same dtype is the yardstick
                    torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask if mask.dtype == torch.bool
                                                               or mask.dtype == q.dtype else mask.to(q.dtype))
                torch_error = (torch_out.double() - expected).abs().nan_to_num(0.0).max().item()
                outs = {"default": fmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)}
                for label, schedule in schedules.items():
                    outs[label] = gluon_forward(q, k, v, mask, schedule)
                for label, out in outs.items():
                    error = (out.double() - expected).abs().max().item()
                    passed = bool(torch.isfinite(out).all()) and error <= 2 * torch_error + 1e-5
                    ok &= passed
                    key = f"D{head_dim} {seqlen_q}x{seqlen_k} {name} {label}"
                    results.setdefault("check", {})[key] = {"error": error, "torch_error": torch_error,
                                                            "passed": passed}
                    print(f"{'ok  ' if passed else 'FAIL'} {key}: error {error:.2e} (torch {torch_error:.2e})",
                          flush=True)
                q, k, v = (t.bfloat16() for t in (q, k, v))
    return ok


def bench(results: dict) -> None:
    generator = torch.Generator(device="cuda").manual_seed(1)
    batch, heads, seqlen = 4, 16, 4096
    cases = [("padding_stride0", 128), ("shared_2d", 128), ("per_head_bias", 128), ("padding_stride0", 64),
             ("shared_2d", 64), ("per_head_bias", 64)]
    for name, head_dim in cases:
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                               generator=generator) for _ in range(3))
        mask = make_mask(name, batch, heads, seqlen, seqlen, q.dtype, generator)
        if name == "padding_stride0":
            mask = torch.ones(batch, 1, 1, seqlen, dtype=torch.bool, device="cuda")
            mask[1, ..., seqlen // 2:] = False
        visible = (mask.expand(batch, heads, seqlen, seqlen) if mask.dtype == torch.bool else None)
        pairs = visible.sum().item() if visible is not None else batch * heads * seqlen * seqlen
        flops = 4 * pairs * head_dim
        view, kind = sdpa_attn_mask("b", mask, q.shape, seqlen, q.shape, q.dtype, q.device)
        scores = ops.score_tensors(None, None, view, None)

        def fmha_with(config):
            params = attention_params("b", q, k, v, top_left=True, attn_mask_kind=kind, config=config)
            return lambda: ops.forward(q, k, v, params, scores)

        providers = {
            "fmha": lambda: fmha.scaled_dot_product_attention(q, k, v, attn_mask=mask),
            "fmha_block64": fmha_with(HopperSchedule(block_n=64, stages=3, q_buffers=2)),
            "fmha_block128": fmha_with(HopperSchedule(block_n=128, stages=2, q_buffers=2,
                                                      emulated_exp2=8 if head_dim == 64 else 0)),
            "portable": fmha_with(fmha.ForwardConfig(128, 64, 8, 3) if head_dim == 128 else fmha.ForwardConfig(128, 64, 4, 3)),
            "sdpa_efficient": lambda: _sdpa(SDPBackend.EFFICIENT_ATTENTION, q, k, v, mask),
            "sdpa_cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, mask),
            "fmha_no_mask": lambda: fmha.scaled_dot_product_attention(q, k, v),
        }
        row = {}
        for provider, fn in providers.items():
            try:
                fn()
                ms = triton.testing.do_bench(fn, warmup=50, rep=300)
                row[provider] = {"ms": ms, "tflops": flops / ms / 1e9}
            except Exception as error:  # noqa: BLE001 - a peer that refuses this mask
                row[provider] = {"error": f"{type(error).__name__}: {str(error)[:160]}"}
            print(f"D{head_dim} {name} {provider}: {row[provider]}", flush=True)
        results.setdefault("bench", {})[f"D{head_dim} {name}"] = row


def _sdpa(backend, q, k, v, mask):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--bench-only", action="store_true")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    ok = args.bench_only or check(results)
    if not args.check_only:
        bench(results)
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
