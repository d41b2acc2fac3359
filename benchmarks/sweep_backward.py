"""Time backward tile configs (bwd mode: one saved forward, then its backward) on the device.

For each case the forward runs once on the default path; then every ``BackwardConfig`` candidate
runs the portable backward (``fmha.dispatch.run_backward``), is compared with small safe tiles'
gradients, and is timed. Prints one row per config and the best per case; writes JSON if given a path.

    PYTHONPATH=src python benchmarks/sweep_backward.py [out.json] [--head-dim 256]

``--head-dim`` picks the cases (B4 S4k, H = 2048 / D, causal and not) and, at D = 256, the wide
heads' candidates. Compiling dominates a wide sweep: ``--shard i/n --compile-only`` in n processes
first fills Triton's cache, so that the timing run after them only times.
"""

import argparse
import dataclasses
import itertools
import json

import torch
import triton.testing

from fmha import dispatch
from fmha.backends.triton.config import BackwardConfig, heuristic_backward_config
from fmha.params import attention_params
from fmha.tools.bench.cases import Case
from fmha.tools.bench.metrics import tflops

CASES = [Case(4, 16, 16, 4096, 4096, 128, mode="bwd"),
         Case(4, 16, 16, 4096, 4096, 128, causal=True, mode="bwd")]
CANDIDATES = [BackwardConfig(m, n, w, s) for m, n, w, s in itertools.product((32, 64), (64, 128), (4, 8), (1, 2))]
# D = 256: dK and dV of BLOCK_N keys take 2 · BLOCK_N · 256 fp32 of a CTA's registers
WIDE_CANDIDATES = [BackwardConfig(m, n, w, s) for (m, n), w, s in itertools.product(
    ((16, 32), (16, 64), (32, 32), (32, 64), (64, 32), (64, 64), (128, 64)), (4, 8), (1, 2))]
REFERENCE = BackwardConfig(32, 32, 4, 1)
WIDE_REFERENCE = BackwardConfig(16, 16, 4, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", help="JSON file for the rows")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--shard", default="0/1", help="i/n: only every n-th candidate from the i-th")
    parser.add_argument("--compile-only", action="store_true", help="run each candidate once, untimed")
    args = parser.parse_args()
    index, count = map(int, args.shard.split("/"))
    wide = args.head_dim > 128
    candidates = (WIDE_CANDIDATES if wide else CANDIDATES)[index::count]
    reference_config = WIDE_REFERENCE if wide else REFERENCE
    cases = CASES if args.head_dim == 128 else [
        dataclasses.replace(case, q_heads=2048 // args.head_dim, kv_heads=2048 // args.head_dim,
                            head_dim=args.head_dim) for case in CASES]
    results = []
    for case in cases:
        q, k, v, dout = (torch.randn(case.batch, case.q_heads, case.seqlen_q, case.head_dim, device="cuda",
                                     dtype=torch.bfloat16) for _ in range(4))
        params = attention_params("sweep_backward", q, k, v, causal=case.causal)
        out, lse = dispatch.prepared_forward(params, q, k, v)(q, k, v)

        def backward(config):
            return dispatch.run_backward(dout, q, k, v, out, lse, params, config=config)

        reference = None if args.compile_only else backward(reference_config)
        heuristic = heuristic_backward_config(case.head_dim, torch.bfloat16)
        for config in candidates:
            row = {"case": case.label, "config": dataclasses.asdict(config), "heuristic": config == heuristic}
            try:
                grads = backward(config)
                if args.compile_only:
                    torch.cuda.synchronize()
                    continue
                error = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(grads, reference))
                ms = triton.testing.do_bench(lambda: backward(config), warmup=10, rep=50, return_mode="median")
                row.update(ms=ms, tflops=tflops(case, ms), rel_diff=error)
            except Exception as exc:  # out of resources, compile failure
                row.update(error=f"{type(exc).__name__}: {str(exc)[:100]}")
            results.append(row)
            print(row, flush=True)
        timed = [r for r in results if r["case"] == case.label and "tflops" in r]
        if timed:
            print("BEST", case.label, max(timed, key=lambda r: r["tflops"]), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
