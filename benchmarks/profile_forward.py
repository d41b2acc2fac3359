"""Forward launches for Nsight Compute (GPU).

``--set long`` (default): the default path (``fmha.attention``) on two non-causal std shapes, and
the Hopper kernel at D=64 with the default ``HopperSchedule()`` (no emulated exponentials), for
comparison. ``--set short-causal``: the two causal S=1k std shapes, each on the default path and on
an alternative schedule (D=64: the two-consumer paired persistent schedule beside the default, one
consumer per CTA and three CTAs per multiprocessor; D=128: the per-tile grid beside the paired
persistent default). ``--set below-cudnn``: the default path on each case that stays below SDPA cuDNN. ``--set wide``: D = 192
(64-key blocks of the 256-wide tiles) and D = 128 in 64-key blocks.
The alternatives run only where the Hopper backend accepts the call (sm_90).

    ncu --clock-control none --kernel-name regex:attention_forward \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --metrics <list> python3 benchmarks/profile_forward.py [--set short-causal]

Each launch is profiled once (compilation happens on the host before it).
"""

import argparse

import torch

import fmha
from fmha.backends.gluon_sm90.backend import HopperBackend
from fmha.backends.gluon_sm90.schedule import HopperSchedule
from fmha.params import attention_params

SETS = {  # (B, H, S, D, causal, HopperSchedule to launch beside the default path, or None)
    "long": [(4, 16, 4096, 128, False, None), (4, 32, 4096, 64, False, HopperSchedule())],
    "short-causal": [(16, 32, 1024, 64, True, HopperSchedule(persistent=True, q_buffers=2, emulated_exp2=8)),
                     (16, 16, 1024, 128, True, HopperSchedule(persistent=False))],
    # the default path on every seeds/std case that stays below SDPA cuDNN in repeated runs
    "below-cudnn": [(8, 16, 1024, 64, False, None), (16, 16, 2048, 64, False, None), (4, 32, 4096, 64, False, None),
                    (16, 32, 1024, 64, True, None), (4, 32, 4096, 64, True, None), (16, 16, 1024, 128, True, None)],
    # head dims 136-192 on the 256-wide tiles, with D = 128 in 64-key blocks beside them
    "wide": [(4, 16, 4096, 192, False, None), (4, 16, 4096, 192, True, None),
             (4, 16, 4096, 128, False, HopperSchedule(block_n=64))],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="long", choices=sorted(SETS))
    args = parser.parse_args()
    for batch, heads, seqlen, head_dim, causal, schedule in SETS[args.set]:
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fmha.attention(q, k, v, causal=causal)
        if schedule is not None:
            params = attention_params("profile_forward", q, k, v, causal=causal)
            if HopperBackend().refusal(params, q, k, v) is None:
                fmha.attention(q, k, v, causal=causal, config=schedule)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
