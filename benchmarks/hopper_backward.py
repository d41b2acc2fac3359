"""The Hopper backward on the GPU: a correctness smoke test, then the `std` cases side by side with
SDPA cuDNN and fmha's portable backward (deterministic=True), backward alone and forward+backward.

    PYTHONPATH=src python benchmarks/hopper_backward.py out.json [--cases D64S1k,D128S128k,...] [--check-only]
        [--no-portable]

``--cases`` takes any head dim and length (``c`` after the length: causal); H = 2048 / D and
B = max(1, 16384 / S), as in the `std` suite.

TFLOP/s count visible (query, key) pairs: 4·D per pair forward, ×2.5 backward, ×3.5 both.
"""

import argparse
import json
import re
import sys
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

import fmha
from fmha import dispatch
from fmha.masking import Window
from fmha.testing import assert_grads_close, time_ms

SMOKE = [  # (B, Hq, Hkv, Sq, Sk, D, causal, window)
    (2, 4, 4, 256, 256, 128, False, None), (2, 4, 4, 256, 256, 128, True, None),
    (1, 8, 2, 333, 517, 128, True, None), (2, 4, 1, 517, 333, 64, False, None),
    (1, 4, 4, 1000, 1000, 64, True, None), (1, 4, 2, 700, 900, 128, False, (100, 50)),
    (1, 4, 4, 64, 1, 64, False, None), (1, 2, 2, 1, 200, 128, True, None),
]


def smoke(dtype) -> list[str]:
    failures = []
    for batch, hq, hkv, sq, sk, d, causal, window in SMOKE:
        generator = torch.Generator(device="cuda").manual_seed(sq * 31 + sk)
        q = torch.randn(batch, hq, sq, d, device="cuda", dtype=dtype, generator=generator).requires_grad_()
        k = torch.randn(batch, hkv, sk, d, device="cuda", dtype=dtype, generator=generator).requires_grad_()
        v = torch.randn(batch, hkv, sk, d, device="cuda", dtype=dtype, generator=generator).requires_grad_()
        dout = torch.randn(batch, hq, sq, d, device="cuda", dtype=dtype, generator=generator)
        params = fmha.params.attention_params("smoke", q, k, v, causal=causal, window=window)
        hopper, reason = dispatch.hopper_backward(params, dout, q, k, v, q, k, v)
        out = fmha.attention(q, k, v, causal=causal, window=window)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        offset = sk - sq if causal and window is None else None
        if window is not None:
            window = Window.of(sq, sk, left=window[0], right=0 if causal else window[1])
        name = f"{dtype} B{batch} H{hq}/{hkv} {sq}x{sk} D{d} causal={causal} window={window}"
        try:
            errors = assert_grads_close(grads, q, k, v, dout, causal_offset=offset, window=window)
            print("ok", name, "hopper" if hopper else f"portable ({reason})", [f"{e:.2e}" for e in errors], flush=True)
        except AssertionError as error:
            failures.append(f"{name}: {error}")
            print("FAIL", name, error, flush=True)
    return failures


STD = [(d, s, causal) for d in (64, 128) for s in (1024, 4096, 16384) for causal in (False, True)]


def pairs(s: int, causal: bool) -> int:
    return s * (s + 1) // 2 if causal else s * s


def bench(cases, dtype=torch.bfloat16, portable=True) -> list[dict]:
    rows = []
    for d, s, causal in cases:
        heads, batch = 2048 // d, max(1, 16384 // s)
        q, k, v = (torch.randn(batch, heads, s, d, device="cuda", dtype=dtype).requires_grad_() for _ in range(3))
        dout = torch.randn(batch, heads, s, d, device="cuda", dtype=dtype)
        flops = 4 * d * pairs(s, causal) * batch * heads
        providers = {
            "fmha": lambda deterministic: fmha.attention(q, k, v, causal=causal, deterministic=deterministic),
            "cudnn": None,
        }
        row = {"case": f"D{d} S{s // 1024}k{' causal' if causal else ''}", "head_dim": d, "seqlen": s,
               "causal": causal, "batch": batch, "heads": heads}

        def run_cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return scaled_dot_product_attention(q, k, v, is_causal=causal)

        runs = [("fmha", lambda: providers["fmha"](False)), ("cudnn", run_cudnn)]
        if portable:
            runs.insert(1, ("fmha_portable_bwd", lambda: providers["fmha"](True)))
        for name, forward in runs:
            out = forward()
            bwd = time_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))[0]
            both = time_ms(lambda: torch.autograd.grad(forward(), (q, k, v), dout))[0]
            row[name] = {"bwd_ms": bwd, "fwdbwd_ms": both, "bwd_tflops": 2.5 * flops / bwd / 1e9,
                         "fwdbwd_tflops": 3.5 * flops / both / 1e9}
        print(row["case"], {k: (round(v["bwd_tflops"]), round(v["fwdbwd_tflops"])) for k, v in row.items()
                             if isinstance(v, dict)}, flush=True)
        rows.append(row)
        del q, k, v, dout
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--cases", default="")
    parser.add_argument("--no-portable", action="store_true", help="skip the deterministic (portable) backward")
    args = parser.parse_args()
    failures = smoke(torch.bfloat16) + smoke(torch.float16)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d"), "smoke_failures": failures}
    if not args.check_only:
        cases = STD
        if args.cases:
            cases = [(int(d), int(s) * 1024, causal == "c")
                     for d, s, causal in re.findall(r"D(\d+)S(\d+)k(c?)", args.cases)]
        result["std"] = bench(cases, portable=not args.no_portable)
    with open(args.out, "w") as file:
        json.dump(result, file, indent=1)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
