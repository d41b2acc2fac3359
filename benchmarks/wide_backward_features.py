"""Score features and packed sequences in the 256-wide tiles' Gluon backward (GPU, sm_90): speed.

For head dims over 128 (the 256-wide tiles), times forward+backward with the Gluon backward
(the default path) and with ``deterministic=True`` (the portable backward, which has no atomics),
per score feature, interleaved in rounds; SDPA cuDNN is the peer where it takes the call (no
score feature). TFLOP/s count the visible pairs at the call's head dim (3.5 forwards' FLOPs).
Correctness is the GPU tests' (tests/test_gpu_scores.py, tests/test_gpu_head_dims.py).

    PYTHONPATH=src python benchmarks/wide_backward_features.py --out wide_features.json [--rounds 3]
"""

import argparse
import json

import torch

import fmha
from fmha.masking import Window
from fmha.testing import random_qkv
from fmha.tools.bench.cases import Case
from fmha.tools.bench.metrics import visible_pairs
from fmha.tools.bench.peers import PEERS
from fmha.tools.bench.runner import environment

from head_dim_256 import report_rows, timed_rows, with_backward

# The 9 causal sequences of the `features` suite's packed case (16,384 tokens).
PACKED_LENGTHS = [862, 1654, 712, 3359, 1799, 1201, 2383, 3162, 1252]
FEATURES = {
    "plain": {},
    "softcap 30": {"softcap": 30.0},
    "ALiBi": {"alibi": True},
    "sinks": {"sinks": True},
    "dropout 0.1": {"dropout_p": 0.1},
    "softcap 50, window 4096": {"softcap": 50.0, "window": (4095, 0)},
}


def feature_arguments(spec: dict, heads: int) -> dict:
    arguments = {key: value for key, value in spec.items() if key in ("softcap", "dropout_p", "window")}
    if spec.get("alibi"):
        arguments["alibi_slopes"] = torch.exp2(-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)
    if spec.get("sinks"):
        arguments["sinks"] = torch.randn(heads, device="cuda").requires_grad_()
    return arguments


def dense_case(head_dim: int, name: str, rounds: int) -> dict:
    batch, q_heads, kv_heads, seqlen = 2, 16, 8, 4096
    if "window" in FEATURES[name]:
        batch, seqlen = 1, 8192
    q, k, v = random_qkv(batch, q_heads, kv_heads, seqlen, seqlen, head_dim, torch.bfloat16, device="cuda",
                         layout="bshd", requires_grad=True)
    arguments = feature_arguments(FEATURES[name], q_heads)
    left = arguments.get("window", (None, 0))[0]
    flops = 4 * batch * q_heads * head_dim * visible_pairs(seqlen, seqlen, Window.of(seqlen, seqlen, left=left, right=0))
    grad = torch.randn_like(q)
    leaves = (q, k, v, *([arguments["sinks"]] if "sinks" in arguments else []))

    def training(deterministic: bool):
        def run():
            out = fmha.attention(q, k, v, causal=True, deterministic=deterministic, **arguments)
            return torch.autograd.grad(out, leaves, grad)
        return run

    runs = {"gluon fwd+bwd": training(False), "portable bwd fwd+bwd": training(True)}
    if not arguments:
        case = Case(batch, q_heads, kv_heads, seqlen, seqlen, head_dim, causal=True)
        runs["sdpa_cudnn fwd+bwd"] = with_backward(PEERS["sdpa_cudnn"].prepare(case, q, k, v).run, q, k, v)
    explanation = fmha.explain(q, k, v, causal=True, **arguments)
    label = f"D{head_dim} B{batch} H{q_heads}/{kv_heads} S{seqlen} causal, {name}"
    return report_rows(label, f"{explanation.backend} / {explanation.backward}", timed_rows(runs, flops, rounds))


def packed_case(head_dim: int, name: str, rounds: int) -> dict:
    q_heads = 16
    generator = torch.Generator(device="cuda").manual_seed(0)
    total = sum(PACKED_LENGTHS)
    q, k, v = (torch.randn(total, q_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
               .requires_grad_() for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    longest = max(PACKED_LENGTHS)
    arguments = feature_arguments(FEATURES[name], q_heads)
    flops = 4 * q_heads * head_dim * sum(visible_pairs(n, n, Window.of(n, n, right=0)) for n in PACKED_LENGTHS)
    grad = torch.randn_like(q)

    def training(deterministic: bool):
        def run():
            out = fmha.varlen_attention(q, k, v, cu, cu, longest, longest, causal=True, deterministic=deterministic,
                                        **arguments)
            return torch.autograd.grad(out, (q, k, v), grad)
        return run

    runs = {"gluon fwd+bwd": training(False), "portable bwd fwd+bwd": training(True)}
    label = f"D{head_dim} packed 9 causal sequences (16k tokens) H{q_heads}, {name}"
    return report_rows(label, "varlen", timed_rows(runs, flops, rounds))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="wide_features.json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dims", default="192,256")
    args = parser.parse_args()
    payload = {"environment": environment(), "rows": []}
    for head_dim in map(int, args.head_dims.split(",")):
        for name in FEATURES:
            payload["rows"].append(dense_case(head_dim, name, args.rounds))
        for name in ("plain", "softcap 30"):
            payload["rows"].append(packed_case(head_dim, name, args.rounds))
    with open(args.out, "w") as handle:
        json.dump(payload, handle, indent=1)


if __name__ == "__main__":
    main()
