"""Kernel times of the shipped Gluon forward schedules on sliding windows and causal `std` shapes (GPU),
for trees side by side: run it under each tree's PYTHONPATH, alternating.

    PYTHONPATH=src python benchmarks/forward_kernel_times.py out.json
"""

import json
import sys

import torch

from tile_overhead import measure  # benchmarks/ is the script's directory

torch.manual_seed(0)
rows = []


def run(label, B, H, S, D, **kw):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    row = measure(label, q, k, v, **kw)
    rows.append(row)
    print(json.dumps(row), flush=True)


run("window 1024", 1, 16, 16384, 128, causal=True, window=(1023, 0))
run("window 4096", 1, 16, 16384, 128, causal=True, window=(4095, 0))
run("window 256", 4, 16, 4096, 128, causal=True, window=(255, 0))
run("window 1024 D64", 1, 32, 16384, 64, causal=True, window=(1023, 0))
for D in (64, 128):
    for S in (1024, 4096, 16384):
        run(f"causal D{D} S{S}", 16384 // S, 2048 // D, S, D, causal=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
