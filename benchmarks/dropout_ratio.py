"""Dropout's share of the plain forward's speed, the issue's measure, on one shape (GPU): the plain
and the dropout forward timed in alternation within one process (every other round in reverse), by
the profiler's kernel time (back to back) and by the suites' ``time_ms`` (L2 flushed before each
call), so that the clock's drift under sustained load falls on both alike.

    PYTHONPATH=src python benchmarks/dropout_ratio.py out.json [--rounds 6]
"""

import argparse
import json
import pathlib
import statistics
import sys

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import fmha  # noqa: E402
from fmha.testing import time_ms  # noqa: E402
from hopper_schedule_ab import kernel_times  # noqa: E402

# (name, B, H, S, D, causal): bf16, p = 0.1
SHAPES = [("D128 causal", 4, 16, 4096, 128, True), ("D64 causal", 4, 32, 4096, 64, True)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    rows = []
    for name, batch, heads, seqlen, head_dim, causal in SHAPES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        generator = torch.Generator(device="cuda").manual_seed(1)
        calls = {"plain": lambda: fmha.attention(q, k, v, causal=causal),
                 "dropout": lambda: fmha.attention(q, k, v, causal=causal, dropout_p=0.1, generator=generator)}
        kernel = {label: [] for label in calls}
        suite = {label: [] for label in calls}
        for round_index in range(args.rounds):
            for label, call in list(calls.items())[::-1 if round_index % 2 else 1]:
                kernel[label].append(max(kernel_times(call).values()))
                suite[label].append(time_ms(call)[0] * 1e3)
        row = {"shape": name, "kernel_us": kernel, "suite_us": suite,
               "kernel_ratio": statistics.median(kernel["plain"]) / statistics.median(kernel["dropout"]),
               "suite_ratio": statistics.median(suite["plain"]) / statistics.median(suite["dropout"]),
               "round_kernel_ratios": [p / d for p, d in zip(kernel["plain"], kernel["dropout"])],
               "round_suite_ratios": [p / d for p, d in zip(suite["plain"], suite["dropout"])]}
        rows.append(row)
        print(json.dumps({key: row[key] for key in ("shape", "kernel_ratio", "suite_ratio")}),
              json.dumps({"kernel_us": {k: [round(x, 1) for x in v] for k, v in kernel.items()},
                          "suite_us": {k: [round(x, 1) for x in v] for k, v in suite.items()}}), flush=True)
    with open(args.out, "w") as handle:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
