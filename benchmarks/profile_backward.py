"""Backward launches for Nsight Compute (GPU, sm_90): the Gluon backward on the `std` cases at
S = 4k (B4, H = 2048 / D), causal and not, D = 64 and 128, the `std` S = 16k cases, and one long
sequence (B1 H16 D128, S = 32k and 64k), bf16, on the default path; ``--cudnn``: SDPA cuDNN's
backward on the same cases instead (its kernel's name matches ``bprop``).

    ncu --clock-control none --kernel-name regex:attention_backward_hopper \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section InstructionStats --metrics <pipe and stall list> python3 benchmarks/profile_backward.py

One forward and one backward per case; only the backward kernel is profiled.
"""

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

import fmha

CASES = {"d128": (4, 16, 4096, 128, False), "d128-causal": (4, 16, 4096, 128, True),
         "d64": (4, 32, 4096, 64, False), "d64-causal": (4, 32, 4096, 64, True),
         "d128-s16k": (1, 16, 16384, 128, False), "d64-s16k": (1, 32, 16384, 64, False),
         # one long sequence: L2's hit rate falls from S = 32k to 64k (docs/perf.md, session 13)
         "d128-s32k": (1, 16, 32768, 128, False), "d128-s64k": (1, 16, 65536, 128, False),
         # the `wide` suite's D = 256 backward (the 256-wide tiles' kernel, attention_backward_wide)
         "d256-s1k": (16, 8, 1024, 256, False), "d256-s1k-causal": (16, 8, 1024, 256, True),
         "d256-s16k": (1, 8, 16384, 256, False)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=sorted(CASES), choices=sorted(CASES))
    parser.add_argument("--cudnn", action="store_true", help="SDPA cuDNN's backward instead of fmha's")
    args = parser.parse_args()
    for name in args.cases:
        batch, heads, seqlen, head_dim, causal = CASES[name]
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        if args.cudnn:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            out = fmha.attention(q, k, v, causal=causal)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
