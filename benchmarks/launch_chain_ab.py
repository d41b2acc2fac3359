"""Calls of several kernels, timed three ways: the A/B of chained launches (GPU).

A packed call runs the tile list's kernel before the attention kernel; a split-KV decode runs the
chunk kernel, then the combine. With programmatic dependent launch the second kernel launches as
the first starts. The script times the same calls on whichever tree ``PYTHONPATH`` names, so that two trees
can alternate in separate processes:

* ``suite_us``: ``fmha.testing.time_ms`` (do_bench, L2 flushed before each call), as the suites;
* ``events_us``: CUDA events around calls issued back to back, no flush (median of 200);
* ``graph_us``: CUDA-graph replay (``do_bench_cudagraph``);
* ``kernels``, ``kernel_sum_us``: how many kernels one call runs, and their summed time (profiler).

``--training`` times forward+backward and the backward of S1k training calls instead.

    PYTHONPATH=src python benchmarks/launch_chain_ab.py out.json [label] [--training]
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
from hopper_schedule_ab import kernel_times  # benchmarks/ is the script's directory
from timing_regimes import events_back_to_back

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
# --training: the short training calls, whose backward launches the most small kernels
TRAINING_CASES = [Case(16, heads, heads, 1024, 1024, head_dim, causal=causal, mode=mode)
                  for mode in ("fwdbwd", "bwd") for heads, head_dim, causal in ((32, 64, True), (16, 128, True),
                                                                               (16, 128, False))]


def main():
    arguments = [argument for argument in sys.argv[1:] if argument != "--training"]
    out_path, label = arguments[0], (arguments[1] if len(arguments) > 1 else "")
    rows = []
    for case in TRAINING_CASES if "--training" in sys.argv else CASES:
        q, k, v = make_inputs(case, torch.bfloat16)
        fn = timed_callable(case, PEERS["fmha"].prepare(case, q, k, v))
        suite_ms, method = time_ms(fn)
        row = {"case": case.label, "mode": case.mode, "tree": label, "suite_us": round(suite_ms * 1e3, 2),
               "suite_method": method, "events_us": round(events_back_to_back(fn, calls=200) * 1e3, 2),
               "graph_us": round(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3, 2)
               if case.mode != "bwd" else None}  # a saved forward's backward does not replay
        row["suite_tflops"] = round(metrics.tflops(case, suite_ms), 1)
        kernels = kernel_times(fn, 20)
        row["kernels"], row["kernel_sum_us"] = len(kernels), round(sum(kernels.values()), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, fn
        torch.cuda.empty_cache()
    with open(out_path, "w") as handle:
        json.dump({"environment": environment(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
