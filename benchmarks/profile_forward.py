"""Forward launches for Nsight Compute (GPU).

``--set long`` (default): the default path on two non-causal std shapes, and the Hopper kernel at
D=64 without the emulated exponentials, for comparison. ``--set short-causal``: the two causal
S=1k std shapes, each on the default path and on an alternative (D=64: the Hopper kernel's
two-consumer paired persistent schedule beside the default, one consumer per CTA and three CTAs
per multiprocessor; D=128: the per-tile grid beside the paired persistent default).
``--set below-cudnn``: the default path on each case that stays below SDPA cuDNN.

    ncu --clock-control none --kernel-name regex:attention_forward \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --metrics <list> python3 benchmarks/profile_forward.py [--set short-causal]

Each launch is profiled once (compilation happens on the host before it).
"""

import argparse

import torch

import fmha
from fmha.launch import default_scale, hopper_forward_applies, launch_forward_hopper

SETS = {  # (B, H, S, D, causal, Hopper options to launch beside the default path, or None)
    "long": [(4, 16, 4096, 128, False, None), (4, 32, 4096, 64, False, {})],
    "short-causal": [(16, 32, 1024, 64, True, {"persistent": True, "q_buffers": 2, "emulated_exp2": 8}),
                     (16, 16, 1024, 128, True, {"persistent": False})],
    # the default path on every seeds/std case that stays below SDPA cuDNN in repeated runs
    "below-cudnn": [(8, 16, 1024, 64, False, None), (16, 16, 2048, 64, False, None), (4, 32, 4096, 64, False, None),
                    (16, 32, 1024, 64, True, None), (4, 32, 4096, 64, True, None), (16, 16, 1024, 128, True, None)],
}

parser = argparse.ArgumentParser()
parser.add_argument("--set", default="long", choices=sorted(SETS))
for batch, heads, seqlen, head_dim, causal, options in SETS[parser.parse_args().set]:
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fmha.attention(q, k, v, causal=causal)
    if options is not None and hopper_forward_applies(q, k, v, q, 1.0):
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
        launch_forward_hopper(q, k, v, out, lse, causal_offset=0 if causal else None,
                              scale=default_scale(head_dim), **options)
    torch.cuda.synchronize()
