"""Every kernel of one backward call, fmha's and SDPA cuDNN's, by the profiler (GPU, sm_90): where a
short backward's time goes beside its main kernel (the rows pass, the dQ conversion). Shapes may
add ``dropout`` (p = 0.1), ``softcap`` (30) or ``alibi`` (fmha alone), or ``mask`` (SDPA's bool
attn_mask, both).

    PYTHONPATH=src python benchmarks/backward_kernel_split.py out.json --shapes 16,8,1024,256 16,8,1024,256,causal
"""

import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

import fmha
from hopper_schedule_ab import kernel_times, write_result  # benchmarks/ is the script's directory


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--shapes", nargs="+", default=["16,8,1024,256", "16,8,1024,256,causal", "1,8,16384,256"],
                        help="B,H,S,D[,causal][,dropout][,softcap][,alibi][,mask]")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rows = []
    for text in args.shapes:
        parts = text.split(",")
        batch, heads, seqlen, head_dim = map(int, parts[:4])
        options = parts[4:]
        causal = "causal" in options
        features = {"dropout_p": 0.1} if "dropout" in options else {}
        if "softcap" in options:
            features["softcap"] = 30.0
        if "alibi" in options:
            features["alibi_slopes"] = torch.exp2(-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        mask = None
        if "mask" in options:  # SDPA's bool mask, (Sq, Sk), a random quarter of the keys hidden
            mask = torch.rand(seqlen, seqlen, device="cuda") > 0.25
        for provider in ("fmha",) if features else ("fmha", "sdpa_cudnn"):
            if provider == "fmha" and mask is not None:
                out = fmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            elif provider == "fmha":
                out = fmha.attention(q, k, v, causal=causal, **features)
            elif mask is not None:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = scaled_dot_product_attention(q, k, v, is_causal=causal)
            grad_out = torch.randn_like(out)

            def backward():
                return torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)

            times = kernel_times(backward, args.repeats)
            row = {"shape": text, "provider": provider, "total_us": sum(times.values()),
                   "kernels_us": {name[:90]: round(us, 1) for name, us in sorted(times.items(), key=lambda x: -x[1])}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_result(args.out, rows)


if __name__ == "__main__":
    main()
