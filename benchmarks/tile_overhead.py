"""What a forward tile costs beyond its key blocks, by a linear fit over blocks per tile (GPU).

The same number of query tiles run with more or fewer key blocks each: sliding windows of 512 to
8,192 keys (B1 H16 S16k D128, causal; every tile past the first few has the same count, two of its
blocks masked), and non-causal calls over Sk = 1k to 16k keys with Sq fixed (no masks). The
profiler's kernel time per tile against blocks per tile is a line: its slope is a block's time,
its intercept what a tile costs besides (prologue, epilogue, the first block's softmax with no
product to hide under, the masks). Shipped schedules, bf16.

    PYTHONPATH=src python benchmarks/tile_overhead.py out.json
"""

import json
import sys

import numpy as np
import torch

import fmha
from fmha.params import attention_params
from fmha.tools.bench.metrics import visible_pairs
from fmha.masking import Window
from fmha.tuning import lookup

from hopper_schedule_ab import kernel_us, write_result  # benchmarks/ is the script's directory

BLOCK_N = 128


def measure(label, q, k, v, **kwargs):
    params = attention_params("attention", q, k, v, **kwargs)
    schedule, _ = lookup.hopper_schedule(params)
    schedule = schedule or fmha.HopperSchedule()
    fmha.attention(q, k, v, config=schedule, **kwargs)
    us = kernel_us(lambda: fmha.attention(q, k, v, config=schedule, **kwargs))
    tiles = q.shape[0] * q.shape[1] * -(-q.shape[2] // schedule.block_m)
    return {"case": label, "schedule": schedule.text(), "kernel_us": us, "tiles": tiles, "block_m": schedule.block_m}


def mean_window_blocks(seqlen, keys, block_m):
    """Key blocks a tile of block_m rows walks under a causal window of ``keys`` keys, averaged
    over the tiles (the first ones see fewer keys)."""
    counts = []
    for first_row in range(0, seqlen, block_m):
        last_row = min(seqlen, first_row + block_m) - 1
        first_key = max(0, first_row - (keys - 1))
        counts.append(last_row // BLOCK_N - first_key // BLOCK_N + 1)
    return sum(counts) / len(counts)


def fit(rows, key):
    blocks = np.array([row[key] for row in rows], dtype=float)
    per_tile = np.array([row["kernel_us"] / row["tiles"] for row in rows])
    slope, intercept = np.polyfit(blocks, per_tile, 1)
    return {"block_us_per_tile": slope, "overhead_us_per_tile": intercept, "overhead_blocks": intercept / slope}


def main():
    torch.manual_seed(0)
    windows = []
    seqlen = 16384
    q, k, v = (torch.randn(1, 16, seqlen, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for keys in (512, 1024, 2048, 4096, 8192):
        row = measure(f"window {keys}", q, k, v, causal=True, window=(keys - 1, 0))
        row["blocks"] = mean_window_blocks(seqlen, keys, row["block_m"])
        row["tflops"] = 4 * 128 * 16 * visible_pairs(seqlen, seqlen, Window.of(seqlen, seqlen, left=keys - 1, right=0)) \
            / row["kernel_us"] / 1e6
        windows.append(row)
        print(json.dumps(row), flush=True)
    dense = []
    q = torch.randn(4, 16, 2048, 128, device="cuda", dtype=torch.bfloat16)
    for keys in (1024, 2048, 4096, 8192, 16384):
        k, v = (torch.randn(4, 16, keys, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        row = measure(f"non-causal Sq 2048 Sk {keys}", q, k, v)
        row["blocks"] = keys // BLOCK_N
        dense.append(row)
        print(json.dumps(row), flush=True)
    summary = {"windows": fit(windows, "blocks"), "non_causal": fit(dense, "blocks")}
    print(json.dumps(summary), flush=True)
    write_result(sys.argv[1], windows + dense + [summary])


if __name__ == "__main__":
    main()
