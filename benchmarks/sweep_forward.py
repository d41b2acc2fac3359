"""Time the portable forward over a grid of tile configs on the seeds and std cases (GPU).

Each ``ForwardConfig`` runs through ``fmha.attention(..., config=config)`` (the portable Triton
kernel with those tiles, on any GPU); prints the best config per case and writes every timing.
Used to choose ``fmha.backends.triton.config.heuristic_forward_config``.

    PYTHONPATH=src python benchmarks/sweep_forward.py --out sweep.json [--head-dims 64 128]
"""

import argparse
import dataclasses
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
                results["rows"].append({"label": case.label, "config": dataclasses.asdict(config),
                                        "error": str(error)[:100]})
                continue
            tflops = metrics.tflops(case, ms)
            results["rows"].append({"label": case.label, "config": dataclasses.asdict(config), "tflops": tflops})
            if best is None or tflops > best[1]:
                best = (config, tflops)
        if best is None:
            print(f"{case.label:<36} no config ran", flush=True)
        else:
            print(f"{case.label:<36} best {best[0]} {best[1]:.1f} TFLOP/s", flush=True)
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
