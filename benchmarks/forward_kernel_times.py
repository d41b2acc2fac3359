"""Kernel times of the shipped Gluon forward schedules on sliding windows and causal `std` shapes (GPU),
for trees side by side: run it under each tree's PYTHONPATH, alternating.

    PYTHONPATH=src python benchmarks/forward_kernel_times.py out.json
"""

import json
import sys

import torch

from hopper_schedule_ab import write_result  # benchmarks/ is the script's directory
from tile_overhead import measure

# (label, B, H, S, D, keyword arguments of fmha.attention)
CASES = [("window 1024", 1, 16, 16384, 128, {"causal": True, "window": (1023, 0)}),
         ("window 4096", 1, 16, 16384, 128, {"causal": True, "window": (4095, 0)}),
         ("window 256", 4, 16, 4096, 128, {"causal": True, "window": (255, 0)}),
         ("window 1024 D64", 1, 32, 16384, 64, {"causal": True, "window": (1023, 0)})] + [
        (f"causal D{D} S{S}", 16384 // S, 2048 // D, S, D, {"causal": True}) for D in (64, 128) for S in (1024, 4096, 16384)]


def main():
    torch.manual_seed(0)
    rows = []
    for label, batch, heads, seqlen, head_dim, kwargs in CASES:
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        row = measure(label, q, k, v, **kwargs)
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_result(sys.argv[1], rows)


if __name__ == "__main__":
    main()
