"""One fused forward per std shape of interest, for Nsight Compute (GPU).

    ncu --clock-control none --kernel-name regex:attention_forward --launch-skip 1 --launch-count 2 \
        --metrics <list> python3 benchmarks/profile_forward.py

Each shape runs twice (a warm-up that compiles, then the profiled launch).
"""

import torch

import fmha

SHAPES = [(4, 16, 4096, 128), (4, 32, 4096, 64)]  # (B, H, S, D), non-causal

for batch, heads, seqlen, head_dim in SHAPES:
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(2):
        fmha.attention(q, k, v)
    torch.cuda.synchronize()
