"""What the bare read of a small decode's K/V costs in one launch (GPU).

The inference issue bounds the small decode cases (B1 H32/8 Sk4096 D128, B8 H32/8 Sk2048 D128) by
"copy floor + one launch": the K/V bytes at the device's copy rate plus one replayed one-element
kernel. This script times the least any kernel must do there: one launch that reads those bytes
once (a sum per program, nothing else), swept over grid sizes and tile widths, replayed from a
CUDA graph over rotating copies of the inputs as `benchmarks/kvcache.py` replays the decode (the
50 MB L2 does not serve them). If the best read is already past the bound, no attention kernel
meets it.

    PYTHONPATH=src python benchmarks/read_floor.py out.json
"""

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcache import copy_tbps, gpu_us, launch_us, rotating  # noqa: E402

from fmha.tools.bench.runner import environment  # noqa: E402

KV_HEADS, HEAD_DIM = 8, 128
L2_BYTES = 50 * 2**20


@triton.jit
def read_sum_kernel(Source, Sums, numel, BLOCK: tl.constexpr):
    """Each program sums a contiguous run of ``Source`` (bf16) into one float."""
    per_program = tl.cdiv(tl.cdiv(numel, tl.num_programs(0)), BLOCK) * BLOCK
    start = tl.program_id(0) * per_program
    total = tl.zeros([BLOCK], tl.float32)
    for offset in range(start, tl.minimum(start + per_program, numel), BLOCK):
        index = offset + tl.arange(0, BLOCK)
        total += tl.load(Source + index, mask=index < numel, other=0.0).to(tl.float32)
    tl.store(Sums + tl.program_id(0), tl.sum(total, 0))


def main():
    out_path = sys.argv[1]
    copy_rate = copy_tbps()
    launch = launch_us()
    rows = []
    for batch, seqlen in ((1, 4096), (8, 2048)):
        numel = 2 * batch * seqlen * KV_HEADS * HEAD_DIM  # K and V
        kv_bytes = 2 * numel
        copies = max(2, -(-3 * L2_BYTES // kv_bytes))
        sources = [torch.randn(numel, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        floor_and_launch = kv_bytes / copy_rate / 1e6 + launch
        best = None
        for programs in (132, 264, 528, 1056, 2112):
            for block, warps in ((2048, 4), (4096, 8), (8192, 8)):
                sums = torch.empty(programs, device="cuda", dtype=torch.float32)
                calls = [lambda source=source: read_sum_kernel[(programs,)](source, sums, numel, BLOCK=block,
                                                                             num_warps=warps)
                         for source in sources]
                for call in calls:
                    call()
                torch.testing.assert_close(sums.sum(), sources[-1].float().sum(), rtol=1e-3, atol=1.0)
                us = gpu_us(rotating(calls))
                row = {"batch": batch, "seqlen": seqlen, "kv_bytes": kv_bytes, "programs": programs, "block": block,
                       "warps": warps, "us": us, "floor_and_launch_us": floor_and_launch,
                       "vs_floor_and_launch": us / floor_and_launch}
                rows.append(row)
                if best is None or us < best["us"]:
                    best = row
        print(json.dumps({"best": best, "copy_tbps": copy_rate, "launch_us": launch}), flush=True)
    Path(out_path).write_text(json.dumps({"environment": environment(), "copy_tbps": copy_rate,
                                          "launch_us": launch, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
