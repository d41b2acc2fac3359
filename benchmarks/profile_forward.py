"""Forward launches for Nsight Compute (GPU): the default path on two std shapes, and the Hopper
kernel at D=64 without the emulated exponentials, for comparison.

    ncu --clock-control none --kernel-name regex:attention_forward \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --metrics <list> python3 benchmarks/profile_forward.py

Each launch is profiled once (compilation happens on the host before it).
"""

import torch

import fmha
from fmha.launch import default_scale, hopper_forward_applies, launch_forward_hopper

SHAPES = [(4, 16, 4096, 128), (4, 32, 4096, 64)]  # (B, H, S, D), non-causal

for batch, heads, seqlen, head_dim in SHAPES:
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fmha.attention(q, k, v)
    if head_dim == 64 and hopper_forward_applies(q, k, v, q, 1.0):
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
        launch_forward_hopper(q, k, v, out, lse, causal_offset=None, scale=default_scale(head_dim))
    torch.cuda.synchronize()
