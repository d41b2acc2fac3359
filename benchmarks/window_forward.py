"""Sliding-window forward on the GPU: fmha beside FlexAttention (block mask) in the same run.

The issue's cases: causal windows of 1024 and 4096 keys at B1 H16 S16k D128, bf16. TFLOP/s count
only the visible pairs; each output is checked against FlexAttention's first.
    PYTHONPATH=src python benchmarks/window_forward.py [out.json]
"""

import json
import sys

import torch
import triton
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fmha

BATCH, HEADS, SEQLEN, HEAD_DIM = 1, 16, 16384, 128


def main():
    flex = torch.compile(flex_attention)
    rows = []
    for width in (1024, 4096):
        left = width - 1
        q, k, v = (torch.randn(BATCH, HEADS, SEQLEN, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        mask = create_block_mask(lambda b, h, row, key: (key <= row) & (row - key <= left), BATCH, HEADS, SEQLEN, SEQLEN)
        pairs = sum(min(row, left) + 1 for row in range(SEQLEN)) * BATCH * HEADS
        flops = 4 * pairs * HEAD_DIM
        error = (fmha.attention(q, k, v, causal=True, window=(left, 0)).float()
                 - flex(q, k, v, block_mask=mask).float()).abs().max().item()
        times = {"fmha": triton.testing.do_bench(lambda: fmha.attention(q, k, v, causal=True, window=(left, 0))),
                 "flex": triton.testing.do_bench(lambda: flex(q, k, v, block_mask=mask)),
                 "fmha_dense_causal": triton.testing.do_bench(lambda: fmha.attention(q, k, v, causal=True))}
        row = {"window": width, "max_diff_vs_flex": error,
               "fmha_backend": fmha.explain(q, k, v, causal=True, window=(left, 0)).backend,
               **{f"{name}_us": ms * 1e3 for name, ms in times.items()},
               **{f"{name}_tflops": flops / ms / 1e9 for name, ms in times.items() if name != "fmha_dense_causal"}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
