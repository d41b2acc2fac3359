"""SM clock and power while fmha and cuDNN run the same forward+backward back to back (nvidia-smi sampled)."""
import json
import subprocess
import sys
import time

import torch
import fmha
from torch.nn.attention import SDPBackend, sdpa_kernel

out_dir = sys.argv[1]
results = {}
for name, (b, h, s, d, causal) in {"D128 S16k": (1, 16, 16384, 128, False), "D64 S16k": (1, 32, 16384, 64, False),
                                   "D128 S1k": (16, 16, 1024, 128, False)}.items():
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    def run_fmha():
        return torch.autograd.grad(fmha.attention(q, k, v, causal=causal), (q, k, v), grad)
    def run_cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                       (q, k, v), grad)
    for provider, fn in (("fmha", run_fmha), ("cudnn", run_cudnn), ("fmha again", run_fmha)):
        fn()
        torch.cuda.synchronize()
        sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                                    "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        calls = max(20, int(3000 / (s * s * b * h * d / 1e9)))
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        sampler.terminate()
        samples = [line.split(", ") for line in sampler.communicate()[0].strip().splitlines()]
        clocks = [float(x[0]) for x in samples[3:]]
        power = [float(x[1]) for x in samples[3:]]
        ms = start.elapsed_time(end) / calls
        flops = 3.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        results[f"{name} {provider}"] = {"ms": ms, "tflops": flops / ms / 1e9, "calls": calls,
                                         "sm_clock_mhz": clocks, "power_w": power}
        print(name, provider, f"{ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s clock median "
              f"{sorted(clocks)[len(clocks) // 2] if clocks else 0} min {min(clocks, default=0)} "
              f"power median {sorted(power)[len(power) // 2] if power else 0}", flush=True)
json.dump(results, open(f"{out_dir}/clocks.json", "w"))
