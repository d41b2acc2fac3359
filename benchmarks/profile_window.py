"""The window-1024 forward (issue 18's case) for Nsight Compute's source view (GPU, sm_90): where
in the Gluon kernel the warps stall, instruction by instruction.

    ncu --clock-control none --kernel-name regex:attention_forward_hopper --launch-skip 1 --launch-count 1 \
        --section SourceCounters --section WarpStateStats -o window python3 benchmarks/profile_window.py
    ncu --import window.ncu-rep --page source --csv --print-source sass > window_sass.csv

Causal B1 H16 S16k D128 bf16, window (1023, 0), on the default path; two calls (the first compiles).
"""

import torch

import fmha

q, k, v = (torch.randn(1, 16, 16384, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(2):
    fmha.attention(q, k, v, causal=True, window=(1023, 0))
torch.cuda.synchronize()
