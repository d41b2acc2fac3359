"""Calls of several kernels, timed three ways: the A/B of chained launches (GPU).

A packed call runs the tile list's kernel before the attention kernel; a split-KV decode runs the
chunk kernel, then the combine. With programmatic dependent launch the second kernel launches as
the first starts. The script times the same calls on whichever tree ``PYTHONPATH`` names, so that two trees
can alternate in separate processes:

* ``suite_us``: ``fmha.testing.time_ms`` (do_bench, L2 flushed before each call), as the suites;
* ``events_us``: CUDA events around calls issued back to back, no flush (median of 200);
* ``graph_us``: CUDA-graph replay (``do_bench_cudagraph``).

    PYTHONPATH=src python benchmarks/launch_chain_ab.py out.json [label]
"""

import json
import sys

import torch
import triton

from fmha.testing import time_ms
from fmha.tools.bench import metrics
from fmha.tools.bench.cases import EQUAL_SEQUENCES, NINE_SEQUENCES, Case, one_long_many_short
from fmha.tools.bench.peers import PEERS
from fmha.tools.bench.runner import environment, make_inputs, timed_callable
from timing_regimes import events_back_to_back  # benchmarks/ is the script's directory

CASES = [
    *(Case.packed(lengths, 16, 16, 128, causal=True, mode="fwd")
      for lengths in (NINE_SEQUENCES, EQUAL_SEQUENCES, one_long_many_short())),
    Case.packed(NINE_SEQUENCES, 16, 16, 128, causal=True, mode="fwdbwd"),
    Case(1, 32, 8, 1, 4096, 128),  # decode: split-KV chunks and the combine
    Case(1, 64, 8, 1, 8192, 128),
    Case(4, 32, 8, 1, 8192, 128),
    Case(1, 16, 16, 1, 16384, 64),
    Case(1, 8, 1, 1, 8192, 256),
    Case(16, 16, 16, 1024, 1024, 128, causal=True, mode="fwdbwd"),
]


def main():
    out_path, label = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    rows = []
    for case in CASES:
        q, k, v = make_inputs(case, torch.bfloat16)
        fn = timed_callable(case, PEERS["fmha"].prepare(case, q, k, v))
        suite_ms, method = time_ms(fn)
        row = {"case": case.label, "mode": case.mode, "tree": label, "suite_us": round(suite_ms * 1e3, 2),
               "suite_method": method, "events_us": round(events_back_to_back(fn, calls=200) * 1e3, 2),
               "graph_us": round(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3, 2)
               if case.mode != "bwd" else None}  # a saved forward's backward does not replay
        row["suite_tflops"] = round(metrics.tflops(case, suite_ms), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, fn
        torch.cuda.empty_cache()
    with open(out_path, "w") as handle:
        json.dump({"environment": environment(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
