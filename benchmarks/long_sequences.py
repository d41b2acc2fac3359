"""Forward and backward TFLOP/s of one long sequence (GPU): how the rate moves with S, for fmha
and SDPA cuDNN side by side, in the shapes of a context-parallel ring's steps.

    PYTHONPATH=src python benchmarks/long_sequences.py out.json [--shapes 16384x16384 65536x32768c ...]

A shape is ``SQxSK`` (``c``: causal); B1, H16, D128 unless given. Times by ``triton.testing.do_bench``.
"""

import argparse
import json

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha
from fmha.tools.bench.runner import environment


def parse_shape(text):
    causal = text.endswith("c")
    seqlen_q, seqlen_k = (int(part) for part in text.rstrip("c").split("x"))
    return seqlen_q, seqlen_k, causal


def visible_pairs(seqlen_q, seqlen_k, causal):
    if not causal:
        return seqlen_q * seqlen_k
    offset = seqlen_k - seqlen_q  # bottom-right alignment: row i sees keys up to i + offset
    return sum(max(0, min(seqlen_k, i + offset + 1)) for i in range(seqlen_q))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--shapes", nargs="+", default=["16384x16384", "65536x65536", "131072x131072"])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    rows = []
    for text in args.shapes:
        seqlen_q, seqlen_k, causal = parse_shape(text)
        q = torch.randn(1, args.heads, seqlen_q, args.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, args.heads, seqlen_k, args.head_dim, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        flops = 4 * args.head_dim * args.heads * visible_pairs(seqlen_q, seqlen_k, causal)
        row = {"shape": text, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "causal": causal}

        def run_cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        providers = {"fmha": lambda: fmha.attention(q, k, v, causal=causal), "cudnn": run_cudnn}
        for name, forward in providers.items():
            with torch.no_grad():
                fwd_ms = triton.testing.do_bench(forward, warmup=5, rep=30)
            out = forward()
            grad = torch.randn_like(out)
            bwd_ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
                                             warmup=5, rep=30)
            row[name] = {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "fwd_tflops": flops / fwd_ms / 1e9,
                         "bwd_tflops": 2.5 * flops / bwd_ms / 1e9,
                         "fwdbwd_tflops": 3.5 * flops / (fwd_ms + bwd_ms) / 1e9}
            del out, grad
        rows.append(row)
        print(text, {name: {key: round(value, 1) for key, value in row[name].items()} for name in providers},
              flush=True)
    with open(args.out, "w") as handle:
        json.dump({"environment": environment(), "heads": args.heads, "head_dim": args.head_dim, "rows": rows},
                  handle, indent=1)


if __name__ == "__main__":
    main()
