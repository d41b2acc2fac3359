"""A small decode's KV-cache kernel for Nsight Compute's source view (GPU): where its warps stall,
instruction by instruction.

    ncu --clock-control none --kernel-name regex:kvcache_attention --launch-skip 2 --launch-count 1 \
        --warp-sampling-interval 0 --section SourceCounters --section WarpStateStats -o decode \
        python3 benchmarks/profile_decode.py BATCH LENGTH [empty]
    ncu --import decode.ncu-rep --page source --csv --print-source sass > decode_sass.csv

bf16, Hq/Hkv 32/8, D 128, one query per sequence, cache_seqlens all LENGTH (or 0 with ``empty``:
the call without its key stream); three calls (the first compiles).
"""

import sys

import torch

import fmha

batch, length = int(sys.argv[1]), int(sys.argv[2])
empty = len(sys.argv) > 3 and sys.argv[3] == "empty"
q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k_cache, v_cache = (torch.randn(batch, length, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
lengths = torch.full((batch,), 0 if empty else length, dtype=torch.int32, device="cuda")
for _ in range(3):
    fmha.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
torch.cuda.synchronize()
