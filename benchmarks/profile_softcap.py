"""The Gluon forward with and without softcap, one launch each, for Nsight Compute (GPU, sm_90).

    ncu --clock-control none --kernel-name regex:attention_forward_hopper \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section InstructionStats python3 benchmarks/profile_softcap.py

Causal B4 H16 S4k D128 bf16 (the scores issue's softcap case), on the default path.
"""

import torch

import fmha

q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for softcap in (None, 30.0):
    fmha.attention(q, k, v, causal=True, softcap=softcap)
torch.cuda.synchronize()
