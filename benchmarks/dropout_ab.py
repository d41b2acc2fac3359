"""Dropout's cost on fmha's default path: forward and forward+backward GPU time of causal calls with
and without dropout, one fmha tree per process (run it once per tree, alternating, to compare two).

    PYTHONPATH=src python benchmarks/dropout_ab.py out.json [label]

TFLOP/s count visible (query, key) pairs: 4·D per pair forward, ×3.5 forward+backward.
"""

import json
import sys

import torch
import triton

import fmha
from fmha.testing import time_ms

# (name, B, H, S, D, causal, dropout_p), bf16
CASES = [("plain D128", 4, 16, 4096, 128, True, 0.0), ("dropout D128", 4, 16, 4096, 128, True, 0.1),
         ("plain D64", 4, 16, 4096, 64, True, 0.0), ("dropout D64", 4, 16, 4096, 64, True, 0.1),
         ("plain D128 full", 4, 16, 4096, 128, False, 0.0), ("dropout D128 full", 4, 16, 4096, 128, False, 0.1)]


def visible_pairs(seqlen, causal):
    return seqlen * (seqlen + 1) / 2 if causal else seqlen * seqlen


def main():
    results = {"label": sys.argv[2] if len(sys.argv) > 2 else "", "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "triton": triton.__version__, "cases": {}}
    for name, batch, heads, seqlen, head_dim, causal, dropout_p in CASES:
        generator = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        dout = torch.randn_like(q)

        def forward():
            return fmha.attention(q, k, v, causal=causal, dropout_p=dropout_p, generator=generator)

        def forward_backward():
            return torch.autograd.grad(forward(), (q, k, v), dout)

        with torch.no_grad():
            forward_ms, _ = time_ms(forward)
        both_ms, _ = time_ms(forward_backward)
        flops = 4 * head_dim * batch * heads * visible_pairs(seqlen, causal)
        results["cases"][name] = {"forward_ms": forward_ms, "forward_backward_ms": both_ms,
                                  "forward_tflops": flops / forward_ms / 1e9,
                                  "forward_backward_tflops": 3.5 * flops / both_ms / 1e9}
        print(f"{results['label']:>4} {name:18} fwd {forward_ms * 1e3:8.1f} us {flops / forward_ms / 1e9:6.1f} TFLOP/s"
              f"   fwd+bwd {both_ms * 1e3:8.1f} us {3.5 * flops / both_ms / 1e9:6.1f} TFLOP/s", flush=True)
    with open(sys.argv[1], "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
