"""GPU time of fmha's backward on the `std` cases, by the profiler (steadier than the wall clock
between processes, so that two source trees can be compared run against run).

    PYTHONPATH=src python benchmarks/backward_kernel_times.py out.json [--cases D64S1k,D128S4kc] [--rounds 3]

For each case: the summed GPU time of every kernel in one ``torch.autograd.grad`` of a saved forward
(the preparation kernel, the backward, the dQ conversion), the longest kernel alone, and TFLOP/s of
the whole backward (visible pairs, 10·D FLOPs per pair). H = 2048 / D, B = 16384 / S, bf16.
"""

import argparse
import json
import re
import statistics

import torch

import fmha
from hopper_schedule_ab import kernel_times, write_result  # benchmarks/ is the script's directory

DEFAULT_CASES = "D64S1k,D64S1kc,D64S4k,D64S4kc,D64S16k,D64S16kc,D128S1k,D128S1kc,D128S4k,D128S4kc,D128S16k,D128S16kc"


def parse_case(text):
    match = re.fullmatch(r"D(\d+)S(\d+)k(c?)", text)
    head_dim, seqlen, causal = int(match.group(1)), int(match.group(2)) * 1024, bool(match.group(3))
    return head_dim, seqlen, causal


def backward_times(run, repeats=10):
    """(total, longest kernel) GPU microseconds per call."""
    times = kernel_times(run, repeats)
    return sum(times.values()), max(times.values())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for name in args.cases.split(","):
        head_dim, seqlen, causal = parse_case(name)
        heads, batch = 2048 // head_dim, max(1, 16384 // seqlen)
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        out = fmha.attention(q, k, v, causal=causal)
        grad_out = torch.randn_like(out)

        def run():
            return torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)

        samples = [backward_times(run) for _ in range(args.rounds)]
        total = statistics.median(s[0] for s in samples)
        longest = statistics.median(s[1] for s in samples)
        pairs = seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen
        flops = 10 * head_dim * batch * heads * pairs
        row = {"case": name, "total_us": total, "kernel_us": longest, "tflops": flops / total / 1e6,
               "samples": samples}
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_result(args.out, rows)


if __name__ == "__main__":
    main()
