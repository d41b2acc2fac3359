"""A value head dim of its own (DeepSeek's MLA prefill and training: q and k 192 wide, v 128): fmha's
native call against the same call with v zero-padded to q's head dim and the output sliced (the
workaround with FlashAttention-2, which takes one head dim), and SDPA's backends that take two head
dims, measured in one process.

Prints a table and writes JSON (``--json``): µs by ``triton.testing.do_bench`` (median), forward and
forward+backward, and TFLOP/s over 2·Sq·Sk·(D + Dv) forward and 2·Sq·Sk·(3·D + 2·Dv) backward
FLOPs per head (halved for causal).
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha


def padded_v(q, k, v, causal):
    """The one-head-dim workaround: v zero-padded to q's head dim, the output's extra columns cut."""
    wide = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
    return fmha.attention(q, k, wide, causal=causal)[..., :v.shape[-1]]


def sdpa(backend):
    def call(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


PROVIDERS = {"fmha": lambda q, k, v, causal: fmha.attention(q, k, v, causal=causal),
             "fmha, v padded": padded_v,
             "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
             "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION)}


def measure(call, q, k, v, causal, backward):
    if not backward:
        with torch.no_grad():
            return triton.testing.do_bench(lambda: call(q, k, v, causal), warmup=30, rep=200) * 1e3
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device=q.device, dtype=q.dtype)

    def step():
        out = call(*leaves, causal)
        torch.autograd.grad(out, leaves, dout)
    return triton.testing.do_bench(step, warmup=20, rep=200) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for batch, heads, seqlen, head_dim, head_dim_v, causal in [
            (2, 16, 4096, 192, 128, True), (1, 16, 8192, 192, 128, True), (4, 16, 2048, 192, 128, False),
            (4, 16, 4096, 128, 64, True)]:
        q, k = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(batch, heads, seqlen, head_dim_v, device="cuda", dtype=torch.bfloat16)
        pairs = batch * heads * seqlen * seqlen / (2 if causal else 1)
        flops = {"fwd": 2 * pairs * (head_dim + head_dim_v),
                 "fwdbwd": 2 * pairs * (head_dim + head_dim_v) + 2 * pairs * (3 * head_dim + 2 * head_dim_v)}
        reference = fmha.reference.dense_attention(q[:1, :2], k[:1, :2], v[:1, :2],
                                                   causal_offset=0 if causal else None)[0]
        row = {"shape": [batch, heads, seqlen, head_dim, head_dim_v], "causal": causal,
               "explain": str(fmha.explain(q, k, v, causal=causal)), "us": {}, "tflops": {}, "max_error": {}}
        for name, call in PROVIDERS.items():
            try:
                with torch.no_grad():
                    out = call(q, k, v, causal)
                row["max_error"][name] = (out[:1, :2].double() - reference).abs().max().item()
                for mode in ("fwd", "fwdbwd"):
                    us = measure(call, q, k, v, causal, mode == "fwdbwd")
                    row["us"][f"{name} {mode}"] = us
                    row["tflops"][f"{name} {mode}"] = flops[mode] / us / 1e6
            except RuntimeError as error:  # a backend that refuses the shapes
                row["us"][name] = f"refused: {str(error).splitlines()[0][:160]}"
        rows.append(row)
        print(f"B{batch} H{heads} S{seqlen} D{head_dim}/{head_dim_v} causal={causal}:", flush=True)
        for key, value in row["us"].items():
            text = value if isinstance(value, str) else f"{value:9.1f} µs {row['tflops'][key]:6.1f} TFLOP/s"
            print(f"  {key:24s} {text}", flush=True)
        print("  errors vs float64:", {name: f"{error:.2e}" for name, error in row["max_error"].items()}, flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
