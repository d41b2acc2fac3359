"""Time backward tile configs (bwd mode: one saved forward, then its backward) on the device.

    PYTHONPATH=src python benchmarks/sweep_backward.py out.json
"""

import itertools
import json
import sys

import torch
import triton.testing

from fmha.tools.bench.cases import Case
from fmha.tools.bench.metrics import tflops
from fmha.config import BackwardConfig, heuristic_backward_config
from fmha.launch import default_scale
from fmha.ops import run_backward, run_forward

CASES = [Case(4, 16, 16, 4096, 4096, 128, mode="bwd"),
         Case(4, 16, 16, 4096, 4096, 128, causal=True, mode="bwd")]
CANDIDATES = [BackwardConfig(m, n, w, s) for m, n, w, s in itertools.product((32, 64), (64, 128), (4, 8), (1, 2))]


def main():
    results = []
    for case in CASES:
        q, k, v, dout = (torch.randn(case.batch, case.q_heads, case.seqlen_q, case.head_dim, device="cuda",
                                     dtype=torch.bfloat16) for _ in range(4))
        offset = 0 if case.causal else None
        scale = default_scale(case.head_dim)
        out, lse = run_forward(q, k, v, causal_offset=offset, scale=scale)
        reference = run_backward(dout, q, k, v, out, lse, causal_offset=offset, scale=scale,
                                 config=BackwardConfig(32, 32, 4, 1))
        heuristic = heuristic_backward_config(case.head_dim, torch.bfloat16)
        for config in CANDIDATES:
            row = {"case": case.label, "config": config.__dict__, "heuristic": config == heuristic}
            try:
                grads = run_backward(dout, q, k, v, out, lse, causal_offset=offset, scale=scale, config=config)
                error = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(grads, reference))
                ms = triton.testing.do_bench(lambda: run_backward(dout, q, k, v, out, lse, causal_offset=offset,
                                                                  scale=scale, config=config),
                                             warmup=10, rep=50, return_mode="median")
                row.update(ms=ms, tflops=tflops(case, ms), rel_diff=error)
            except Exception as error:  # out of resources, compile failure
                row.update(error=f"{type(error).__name__}: {str(error)[:100]}")
            results.append(row)
            print(row, flush=True)
        best = max((r for r in results if r["case"] == case.label and "tflops" in r), key=lambda r: r["tflops"])
        print("BEST", case.label, best, flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
