"""Host-side cost per call: CPU time around N calls of a tiny attention, then one synchronize.

    PYTHONPATH=src python benchmarks/host_overhead.py
"""

import json
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

import fmha
from fmha.config import heuristic_forward_config
from fmha.launch import hopper_forward_applies, launch_forward, launch_forward_hopper


def host_us_per_call(fn, calls=1000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, 1, 128, device="cuda")
    config = heuristic_forward_config(64, q.dtype, 128)

    def sdpa_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return scaled_dot_product_attention(q, k, v)

    results = {
        "fmha.attention (default path)": host_us_per_call(lambda: fmha.attention(q, k, v)),
        "fmha.attention (portable kernel, explicit config)": host_us_per_call(
            lambda: fmha.attention(q, k, v, config=config)),
        "launch_forward (no checks, preallocated)": host_us_per_call(
            lambda: launch_forward(q, k, v, out, lse, causal_offset=None, scale=0.125, config=config)),
        "sdpa flash": host_us_per_call(sdpa_flash),
    }
    if hopper_forward_applies(q, k, v, out, 0.125):
        results["launch_forward_hopper (no checks, preallocated)"] = host_us_per_call(
            lambda: launch_forward_hopper(q, k, v, out, lse, causal_offset=None, scale=0.125))
    for name, us in results.items():
        print(f"{name:<45} {us:7.1f} µs per call")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
