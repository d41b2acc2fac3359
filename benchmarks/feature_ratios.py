"""Each score feature's forward against the same shape without it, on fmha's default path, in one
process: profiler kernel time, the cases round-robin (a short burst each, so the clock moves
less between them), median of the rounds.

    PYTHONPATH=src python benchmarks/feature_ratios.py out.json [--rounds 5] [--cases NAME ...]

``--cases`` keeps those cases (and the plain ones they are compared with).
"""

import argparse
import statistics

import torch

import fmha
from hopper_schedule_ab import feature_arguments, kernel_us, write_result  # benchmarks/ is the script's directory

# (name, plain case it is compared with, B, H, S, D, keyword arguments): causal, bf16.
CASES = [("plain D128", None, 4, 16, 4096, 128, {}), ("softcap 30", "plain D128", 4, 16, 4096, 128, {"softcap": 30.0}),
         ("ALiBi", "plain D128", 4, 16, 4096, 128, {"alibi": True}),
         ("dropout 0.1", "plain D128", 4, 16, 4096, 128, {"dropout_p": 0.1}),
         ("plain D64", None, 4, 16, 4096, 64, {}), ("sinks D64", "plain D64", 4, 16, 4096, 64, {"sinks": True}),
         ("ALiBi D64", "plain D64", 4, 16, 4096, 64, {"alibi": True}),
         ("softcap 30 D64", "plain D64", 4, 16, 4096, 64, {"softcap": 30.0}),
         ("dropout 0.1 D64", "plain D64", 4, 16, 4096, 64, {"dropout_p": 0.1}),
         ("softcap 50 + sinks", "plain D128", 4, 16, 4096, 128, {"softcap": 50.0, "sinks": True}),
         ("softcap 30 full", "plain D128 full", 4, 16, 4096, 128, {"softcap": 30.0, "causal": False}),
         ("plain D128 full", None, 4, 16, 4096, 128, {"causal": False})]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", nargs="+", help="case names to run (default: all)")
    args = parser.parse_args()
    cases = CASES
    if args.cases:
        wanted = set(args.cases) | {plain for name, plain, *_ in CASES if name in args.cases and plain}
        cases = [case for case in CASES if case[0] in wanted]
    calls = {}
    for name, _, batch, heads, seqlen, head_dim, kwargs in cases:
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        features = feature_arguments(heads, kwargs)
        generator = torch.Generator(device="cuda").manual_seed(1) if "dropout_p" in features else None
        extra = {"generator": generator} if generator is not None else {}

        causal = features.pop("causal", True)

        def call(q=q, k=k, v=v, features=features, extra=extra, causal=causal):
            return fmha.attention(q, k, v, causal=causal, **features, **extra)

        calls[name] = call
    samples = {name: [] for name in calls}
    with torch.no_grad():
        for round_index in range(args.rounds):
            for name, call in list(calls.items())[::-1 if round_index % 2 else 1]:
                samples[name].append(kernel_us(call))
    rows = []
    for name, plain, batch, heads, seqlen, head_dim, kwargs in cases:
        us = statistics.median(samples[name])
        row = {"case": name, "kernel_us": us, "samples_us": samples[name]}
        if plain:
            row["vs_plain"] = statistics.median(samples[plain]) / us
        rows.append(row)
        print(f"{name:16} {us:8.1f} us" + (f"  {row['vs_plain']:.3f}x of {plain}" if plain else ""), flush=True)
    write_result(args.out, rows)


if __name__ == "__main__":
    main()
