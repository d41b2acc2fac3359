"""dQ converted inside the Gluon backward (apply dq_convert_in_kernel.patch first): gradients on odd
shapes against float64, by the project's error rule (fmha.testing.assert_grads_close), with the
conversion forced on. GPU, sm_90."""
import dataclasses
import sys

import torch

import fmha
from fmha import dispatch, testing
from fmha.backends.gluon_sm90 import backward_launch

shipped = backward_launch.default_backward_schedule
backward_launch.default_backward_schedule = lambda d: dataclasses.replace(shipped(d), convert_rows=1 << 30)
dispatch.forget()
torch.manual_seed(0)
CASES = [(2, 4, 4, 777, 1500, 128, False), (2, 4, 4, 777, 1500, 128, True), (1, 8, 2, 300, 300, 64, True),
         (3, 6, 3, 1000, 640, 64, False), (2, 8, 8, 1024, 1024, 128, True), (1, 4, 1, 129, 257, 128, False),
         (2, 4, 2, 64, 2048, 64, True)]
failures = 0
for batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal in CASES:
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = testing.random_qkv(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, device="cuda",
                                     requires_grad=True)
        dout = torch.randn_like(q)
        grads = torch.autograd.grad(fmha.attention(q, k, v, causal=causal), (q, k, v), dout)
        label = f"B{batch} H{q_heads}/{kv_heads} Sq{seqlen_q} Sk{seqlen_k} D{head_dim} causal={causal} {dtype}"
        try:
            errors = testing.assert_grads_close(grads, q, k, v, dout,
                                                causal_offset=seqlen_k - seqlen_q if causal else None)
            print("ok ", label, " ".join(f"{e:.2e}" for e in errors), flush=True)
        except AssertionError as error:
            failures += 1
            print("BAD", label, error, flush=True)
print("failures", failures)
sys.exit(1 if failures else 0)
