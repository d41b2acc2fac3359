"""SDPA's attn_mask in the backward: the Gluon backward against the portable one, side by side in
one run, with SDPA cuDNN and efficient as peers where they take the mask.

    PYTHONPATH=src python benchmarks/attn_mask_backward.py out.json

bf16, B4 H16 S4096, forward+backward and forward alone through ``fmha.scaled_dot_product_attention``
(the backward alone is their difference); the portable arm refuses masks in the Gluon backward for
the run, so only the backward differs between the two fmha arms.
"""

import json
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha
from fmha import dispatch
from fmha.backends.gluon_sm90.backend import HopperBackend
from fmha.tools.bench.runner import environment

CASES = [("padding (B,1,1,S)", 128), ("bool (S,S)", 128), ("bf16 bias (1,H,S,S)", 128), ("no mask", 128),
         ("padding (B,1,1,S)", 64), ("bool (S,S)", 64), ("bf16 bias (1,H,S,S)", 64), ("no mask", 64)]


def make_mask(name, batch, heads, seqlen, generator):
    if name.startswith("padding"):
        mask = torch.ones(batch, 1, 1, seqlen, dtype=torch.bool, device="cuda")
        mask[1, ..., seqlen // 2:] = False
        return mask
    dense = torch.rand(seqlen, seqlen, device="cuda", generator=generator)
    if name.startswith("bool"):
        return dense > 0.3
    if name.startswith("bf16"):
        return ((torch.rand(1, heads, seqlen, seqlen, device="cuda", generator=generator) - 0.5) * 4).bfloat16()
    return None


def portable_backward(enabled: bool):
    """Refuse masks in the Gluon backward (the portable backward runs them) while enabled."""
    original = HopperBackend.backward_refusal
    if enabled:
        def refusal(self, params, *tensors, attn_mask=None):
            return "benchmark: the portable backward" if attn_mask is not None else original(self, params, *tensors)
        HopperBackend.backward_refusal = refusal
    dispatch.forget()
    return original


def main(path):
    generator = torch.Generator(device="cuda").manual_seed(1)
    batch, heads, seqlen = 4, 16, 4096
    rows = []
    for name, head_dim in CASES:
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                               generator=generator).requires_grad_() for _ in range(3))
        dout = torch.randn_like(q)
        mask = make_mask(name, batch, heads, seqlen, generator)

        def fmha_call():
            return fmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        def sdpa(backend):
            def call():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return call

        providers = [("fmha, Gluon backward", fmha_call, False), ("fmha, portable backward", fmha_call, True),
                     ("sdpa_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION), False),
                     ("sdpa_efficient", sdpa(SDPBackend.EFFICIENT_ATTENTION), False)]
        for provider, call, portable in providers:
            if mask is None and portable:
                continue
            original = portable_backward(portable)
            try:
                def both(call=call):
                    torch.autograd.backward(call(), dout)

                def forward(call=call):
                    with torch.no_grad():
                        return call()
                both()
                both_ms = triton.testing.do_bench(both, warmup=25, rep=200, grad_to_none=[q, k, v])
                fwd_ms = triton.testing.do_bench(forward, warmup=25, rep=200)
                row = {"case": f"D{head_dim} {name}", "provider": provider, "fwdbwd_ms": both_ms, "fwd_ms": fwd_ms,
                       "bwd_ms": both_ms - fwd_ms}
            except Exception as error:  # noqa: BLE001 - a peer that refuses this mask
                row = {"case": f"D{head_dim} {name}", "provider": provider,
                       "error": f"{type(error).__name__}: {str(error)[:160]}"}
            finally:
                HopperBackend.backward_refusal = original
                dispatch.forget()
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(path, "w") as handle:
        json.dump({**environment(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
