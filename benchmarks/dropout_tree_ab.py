"""Dropout's kernel times on one fmha tree (GPU): the forward's kernel, and every kernel of one
forward+backward, by the profiler (median of 3). Run it once per tree, alternating, to compare two:

    PYTHONPATH=src python benchmarks/dropout_tree_ab.py out.json new
    PYTHONPATH=../old/src python benchmarks/dropout_tree_ab.py out.json old
"""

import json
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import fmha  # noqa: E402
from hopper_schedule_ab import kernel_times  # noqa: E402

# (name, B, H, S, D, causal), bf16, dropout_p 0.1
CASES = [("dropout D128 causal", 4, 16, 4096, 128, True), ("dropout D64 causal", 4, 32, 4096, 64, True),
         ("dropout D128", 4, 16, 4096, 128, False), ("dropout D64", 4, 32, 4096, 64, False)]


def main():
    rows = []
    for name, batch, heads, seqlen, head_dim, causal in CASES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)

        def call():
            generator = torch.Generator(device="cuda").manual_seed(1)
            return fmha.attention(q, k, v, causal=causal, dropout_p=0.1, generator=generator)

        def forward():
            with torch.no_grad():
                return call()

        def forward_backward():
            return torch.autograd.grad(call(), (q, k, v), dout)

        row = {"tree": sys.argv[2], "case": name,
               "forward_us": statistics.median(max(kernel_times(forward).values()) for _ in range(3)),
               "forward_backward_us": statistics.median(sum(kernel_times(forward_backward).values()) for _ in range(3))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(sys.argv[1], "w") as handle:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
