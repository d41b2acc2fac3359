"""K and V expanded over their heads (stride 0, as ``repeat_kv`` leaves an MQA model's): the
Hopper forward reading them as one KV head, against the portable forward that ran such calls
before, a call with the one head itself, and SDPA on the same expanded tensors.

Prints a table and writes JSON (``--json``): forward µs by ``triton.testing.do_bench`` (median),
and host µs per call (median of 300 calls, each started on an idle GPU).
"""

import argparse
import json
import time

import torch
import triton

import fmha
from fmha import dispatch


def host_us(call, calls=300):
    """Median host time of one call, each started on an idle GPU (the kernel's time is not waited for)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for batch, heads, seqlen, head_dim, causal in [(4, 32, 4096, 128, True), (4, 32, 4096, 128, False),
                                                  (8, 16, 2048, 64, True), (2, 16, 8192, 256, True)]:
        q = torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
        k1, v1 = (torch.randn(batch, 1, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = k1.expand(-1, heads, -1, -1), v1.expand(-1, heads, -1, -1)
        flops = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
        times = {"one KV head (expanded)": lambda: fmha.attention(q, k, v, causal=causal),
                 "one KV head (Hkv = 1)": lambda: fmha.attention(q, k1, v1, causal=causal),
                 "sdpa (expanded)": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)}
        measured = {name: triton.testing.do_bench(call, warmup=50, rep=300) * 1e3 for name, call in times.items()}
        shares = dispatch.shares_one_kv_head
        dispatch.shares_one_kv_head = lambda *_: False  # the route such calls took before: per-head reads
        dispatch.forget()
        try:
            before = fmha.explain(q, k, v, causal=causal).backend
            measured["portable (before)"] = triton.testing.do_bench(lambda: fmha.attention(q, k, v, causal=causal),
                                                                     warmup=50, rep=300) * 1e3
        finally:
            dispatch.shares_one_kv_head = shares
            dispatch.forget()
        now = fmha.explain(q, k, v, causal=causal)
        row = {"shape": [batch, heads, seqlen, head_dim], "causal": causal, "backend": now.backend,
               "backend_before": before, "us": measured,
               "tflops": {name: flops / us / 1e6 for name, us in measured.items()}}
        rows.append(row)
        print(f"B{batch} H{heads} S{seqlen} D{head_dim} causal={causal}: {now.backend} (was {before}); "
              + ", ".join(f"{name} {us:.1f} µs ({row['tflops'][name]:.0f} TFLOP/s)" for name, us in measured.items()),
              flush=True)
    # Host time per call at a small shape that the Hopper forward still takes.
    q = torch.randn(1, 16, 2048, 128, device="cuda", dtype=torch.bfloat16)
    k1, v1 = (torch.randn(1, 1, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = k1.expand(-1, 16, -1, -1), v1.expand(-1, 16, -1, -1)
    host = {"expanded": host_us(lambda: fmha.attention(q, k, v)), "Hkv = 1": host_us(lambda: fmha.attention(q, k1, v1))}
    print("host µs per call, B1 H16 S2048 D128:", {name: round(us, 2) for name, us in host.items()}, flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d"), "rows": rows, "host_us": host}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
