"""Time the fused forward over a grid of tile configs on the std and seeds cases (GPU).

Used to choose fmha.config's heuristic until the autotuner ships tuned defaults.
    PYTHONPATH=src python benchmarks/sweep_forward.py --out sweep.json
"""

import argparse
import itertools
import json

import torch
import triton.testing

import fmha
from fmha.tools.bench import cases, metrics
from fmha.tools.bench.runner import environment, make_inputs


def candidates(head_dim):
    for block_m, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        if head_dim > 128 and (block_n > 64 or stages > 3):
            continue
        yield fmha.ForwardConfig(block_m, block_n, warps, stages)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="sweep.json")
    parser.add_argument("--head-dims", type=int, nargs="*", default=None)
    args = parser.parse_args()
    results = {"environment": environment(), "rows": []}
    for case in cases.seeds() + cases.std():
        if args.head_dims and case.head_dim not in args.head_dims:
            continue
        q, k, v = make_inputs(case, torch.bfloat16)
        best = None
        for config in candidates(case.head_dim):
            try:
                fn = lambda: fmha.attention(q, k, v, causal=case.causal, config=config)  # noqa: E731
                fn()
                ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
            except Exception as error:  # out of resources and the like: recorded, skipped
                results["rows"].append({"label": case.label, "config": config.__dict__, "error": str(error)[:100]})
                continue
            tflops = metrics.tflops(case, ms)
            results["rows"].append({"label": case.label, "config": config.__dict__, "tflops": tflops})
            if best is None or tflops > best[1]:
                best = (config, tflops)
        print(f"{case.label:<36} best {best[0]} {best[1]:.1f} TFLOP/s", flush=True)
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
