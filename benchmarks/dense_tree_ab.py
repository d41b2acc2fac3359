"""Dense calls' kernel times on one fmha tree (GPU): the forward's kernel, and every kernel of the
backward of a saved forward, by the profiler (median of 3). Run it once per tree, alternating, to
compare two; the output's checksum shows whether the trees compute the same:

    PYTHONPATH=src python benchmarks/dense_tree_ab.py out.jsonl new
    PYTHONPATH=../old/src python benchmarks/dense_tree_ab.py out.jsonl old
    PYTHONPATH=src python benchmarks/dense_tree_ab.py out.jsonl new "D64 S16k causal,D128 S16k"  # some cases
"""

import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import fmha  # noqa: E402
from hopper_schedule_ab import tree_row  # noqa: E402

# (name, B, H, S, D, causal, window left), bf16
CASES = [("D64 S16k causal", 1, 32, 16384, 64, True, None),
         ("D128 S16k causal", 1, 16, 16384, 128, True, None),
         ("D64 S8k causal", 2, 32, 8192, 64, True, None),
         ("D128 S8k causal", 2, 16, 8192, 128, True, None),
         ("D128 S4k causal", 4, 16, 4096, 128, True, None),
         ("D64 S4k causal", 4, 32, 4096, 64, True, None),
         ("D128 S16k", 1, 16, 16384, 128, False, None),
         ("D64 S16k", 1, 32, 16384, 64, False, None),
         ("D128 S4k", 4, 16, 4096, 128, False, None),
         ("window 1024", 1, 16, 16384, 128, True, 1023),
         ("window 4096", 1, 16, 16384, 128, True, 4095),
         ("window 1024 B4 S4k", 4, 16, 4096, 128, True, 1023),
         ("window 1024 D64", 1, 32, 16384, 64, True, 1023),
         ("window 256 B4 S4k", 4, 16, 4096, 128, True, 255)]


def main():
    chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    with open(sys.argv[1], "a") as log:
        for name, batch, heads, seqlen, head_dim, causal, left in CASES:
            if chosen and name not in chosen:
                continue
            torch.manual_seed(0)
            q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            window = {"window": (left, 0)} if left is not None else {}

            def forward():
                return fmha.attention(q, k, v, causal=causal, **window)

            row = tree_row(sys.argv[2], name, forward, (q, k, v))
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
