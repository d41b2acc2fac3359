"""Packed calls against dense calls on the same tokens (GPU): the profiler's time of every kernel of
a forward and of the backward of a saved forward, D128 H16 causal bf16, two rounds each.

    PYTHONPATH=src python benchmarks/varlen_vs_dense.py > out.jsonl
"""

import itertools
import json

import torch

import fmha
from fmha.tools.bench.cases import NINE_SEQUENCES
from hopper_schedule_ab import kernel_times  # benchmarks/ is the script's directory

HEADS, HEAD_DIM = 16, 128


def _with_backward(forward, inputs):
    out = forward()
    grad_out = torch.randn_like(out)
    return forward, lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True)


def packed_calls(lengths):
    q, k, v = (torch.randn(sum(lengths), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    longest = max(lengths)
    return _with_backward(lambda: fmha.varlen_attention(q, k, v, cu, cu, longest, longest, causal=True), (q, k, v))


def dense_calls(batch, seqlen):
    q, k, v = (torch.randn(batch, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    return _with_backward(lambda: fmha.attention(q, k, v, causal=True), (q, k, v))


CASES = {"varlen 8x2048": lambda: packed_calls([2048] * 8), "dense B8 S2k": lambda: dense_calls(8, 2048),
         "varlen 9": lambda: packed_calls(list(NINE_SEQUENCES)), "varlen 16x1024": lambda: packed_calls([1024] * 16),
         "dense B16 S1k": lambda: dense_calls(16, 1024), "varlen 4x4096": lambda: packed_calls([4096] * 4),
         "dense B4 S4k": lambda: dense_calls(4, 4096)}


def main():
    for name, make in CASES.items():
        forward, backward = make()
        for mode, fn in (("fwd", forward), ("bwd", backward)):
            for round_index in range(2):
                times = kernel_times(fn, 20)
                print(json.dumps({"case": name, "mode": mode, "round": round_index,
                                  "kernels": {kernel[:60]: round(us, 1) for kernel, us in times.items()}}), flush=True)


if __name__ == "__main__":
    main()
