"""Fresh-process spread of the S1k D=128 training calls (GPU): do_bench medians against the profiler's kernels.

Each process times the backward of one saved forward and a whole forward+backward, causal and
not, three do_bench medians each, then sums every kernel's time over ten calls under the profiler.
One JSON line per process:

    for i in 1 2 3 4 5 6; do PYTHONPATH=src python benchmarks/s1k_training_spread.py >> out.jsonl; done
"""

import json

import torch

import fmha
from fmha.testing import time_ms
from hopper_schedule_ab import kernel_times  # benchmarks/ is the script's directory


def longest_kernels(fn, count=5) -> dict:
    """Device microseconds per call of the ``count`` longest kernels ``fn`` launches."""
    times = sorted(kernel_times(fn, repeats=10).items(), key=lambda item: -item[1])[:count]
    return {name[:60]: round(us, 1) for name, us in times}


def main():
    rows = []
    for causal in (False, True):
        torch.manual_seed(0)
        q, k, v = (torch.randn(16, 16, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        out = fmha.attention(q, k, v, causal=causal)

        def backward():
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        def forward_backward():
            torch.autograd.grad(fmha.attention(q, k, v, causal=causal), (q, k, v), dout)

        for mode, fn in (("bwd", backward), ("fwdbwd", forward_backward)):
            medians = [round(time_ms(fn)[0] * 1e3, 1) for _ in range(3)]
            rows.append({"causal": causal, "mode": mode, "do_bench_us": medians, "kernels_us": longest_kernels(fn)})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
