"""The Gluon forward with and without one score feature, one launch each, for Nsight Compute (GPU, sm_90).

    ncu --clock-control none --kernel-name regex:attention_forward_hopper \
        --section SpeedOfLight --section WarpStateStats --section InstructionStats \
        python3 benchmarks/profile_feature.py dropout

Causal B4 H16 S4k D128 bf16 (the scores issue's case), on the default path; features: softcap
(30), alibi, dropout (0.1).
"""

import sys

import torch

import fmha

FEATURES = {"softcap": {"softcap": 30.0}, "dropout": {"dropout_p": 0.1},
            "alibi": {"alibi_slopes": torch.exp2(-8.0 * torch.arange(1, 17) / 16).cuda()}}

q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for kwargs in ({}, FEATURES[sys.argv[1]]):
    fmha.attention(q, k, v, causal=True, **kwargs)
torch.cuda.synchronize()
