"""Packed (varlen) calls' kernel times on one fmha tree (GPU): the forward's kernel, and every kernel
of the backward of a saved forward, by the profiler (median of 3). Run it once per tree,
alternating, to compare two; the output's checksum shows whether the trees compute the same:

    PYTHONPATH=src python benchmarks/varlen_tree_ab.py out.jsonl new ["9 sequences,8 x 2048"]
    PYTHONPATH=../old/src python benchmarks/varlen_tree_ab.py out.jsonl old
"""

import itertools
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import fmha  # noqa: E402
from fmha.tools.bench.cases import EQUAL_SEQUENCES, NINE_SEQUENCES, one_long_many_short  # noqa: E402
from hopper_schedule_ab import tree_row  # noqa: E402

# (name, lengths, query heads, KV heads, head dim, causal), bf16
CASES = [("9 sequences", NINE_SEQUENCES, 16, 16, 128, True),
         ("8 x 2048", EQUAL_SEQUENCES, 16, 16, 128, True),
         ("16 x 1024", (1024,) * 16, 16, 16, 128, True),
         ("4 x 4096", (4096,) * 4, 16, 16, 128, True),
         ("8192 + 63 short", one_long_many_short(), 16, 16, 128, True),
         ("9 sequences D64", NINE_SEQUENCES, 32, 32, 64, True),
         ("9 sequences GQA 32/8", NINE_SEQUENCES, 32, 8, 128, True),
         ("9 sequences non-causal", NINE_SEQUENCES, 16, 16, 128, False)]


def main():
    chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else [case[0] for case in CASES]  # optional: case names
    with open(sys.argv[1], "a") as log:
        for name, lengths, q_heads, kv_heads, head_dim, causal in (case for case in CASES if case[0] in chosen):
            torch.manual_seed(0)
            total = sum(lengths)
            q = torch.randn(total, q_heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(total, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(2))
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
            longest = max(lengths)

            def forward():
                return fmha.varlen_attention(q, k, v, cu, cu, longest, longest, causal=causal)

            row = tree_row(sys.argv[2], name, forward, (q, k, v))
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
