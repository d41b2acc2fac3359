"""Host-side cost per call: CPU time around N calls of a tiny attention, then one synchronize.

    PYTHONPATH=src python benchmarks/host_overhead.py
"""

import cProfile
import json
import pstats
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

import fmha
from fmha import ops
from fmha.config import heuristic_forward_config
from fmha.launch import hopper_forward_applies, launch_forward, launch_forward_hopper


def host_us_per_call(fns: dict, calls=1000, rounds=7) -> dict:
    """Per function: mean time per call over ``calls`` calls, as the minimum and the median over
    ``rounds`` rounds. The rounds interleave the functions, so that the VM host's slow spells
    hit them all alike."""
    samples = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: {"min_us": min(values), "median_us": statistics.median(values)} for name, values in samples.items()}


def main():
    q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, 1, 128, device="cuda")
    config = heuristic_forward_config(64, q.dtype, 128)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(q, k, v)
        return run

    def default_path_on_hopper_kernel():
        minimum, ops.HOPPER_MIN_FLOPS = ops.HOPPER_MIN_FLOPS, 0  # this tiny call takes the Hopper kernel
        fmha.attention(q, k, v)
        ops.HOPPER_MIN_FLOPS = minimum

    fns = {
        "fmha.attention (default path)": lambda: fmha.attention(q, k, v),
        "fmha.attention (portable kernel, explicit config)": lambda: fmha.attention(q, k, v, config=config),
        "launch_forward (no checks, preallocated)": lambda: launch_forward(
            q, k, v, out, lse, causal_offset=None, scale=0.125, config=config),
        "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "torch.empty_like (one allocation)": lambda: torch.empty_like(q),
    }
    if hopper_forward_applies(q, k, v, out, 0.125):
        fns["launch_forward_hopper (no checks, preallocated)"] = lambda: launch_forward_hopper(
            q, k, v, out, lse, causal_offset=None, scale=0.125)
        fns["fmha.attention (default path, Hopper kernel)"] = default_path_on_hopper_kernel
    results = host_us_per_call(fns)
    print(f"{'':<52} {'min':>7} {'median':>7}  µs per call")
    for name, result in results.items():
        print(f"{name:<52} {result['min_us']:7.1f} {result['median_us']:7.1f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as handle:
            json.dump(results, handle, indent=1)
    # Where the default path's host time goes (on the Hopper kernel where it applies).
    profiled = fns.get("fmha.attention (default path, Hopper kernel)", fns["fmha.attention (default path)"])
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [profiled() for _ in range(2000)])
    pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
