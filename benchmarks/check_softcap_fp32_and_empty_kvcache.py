"""GPU check of two CPU-found fixes: float32 scores under softcap 30 and 50 (the exact tanh) against
float64 by the error rule, and KV-cache calls without query rows that append (num_splits 0 and 3)."""

import torch

import fmha
from fmha.testing import assert_close_to_reference, check_kvcache, random_kvcache, random_qkv

torch.manual_seed(0)
for softcap in (30.0, 50.0):
    q, k, v = random_qkv(2, 8, 2, 300, 333, 64, torch.float32, device="cuda")
    out = fmha.attention(q, k, v, causal=True, softcap=softcap)
    error, torch_error = assert_close_to_reference(out, q, k, v, causal_offset=33, softcap=softcap)
    print(f"fp32 softcap {softcap}: max error {error:.3g}, torch's {torch_error:.3g}", flush=True)
for num_splits in (0, 3):
    for page_size in (None, 16):
        case = random_kvcache(3, 0, 4, 2, 64, 80, new_keys=2, dtype=torch.bfloat16, device="cuda", page_size=page_size)
        out, lse = check_kvcache(fmha.flash_attn_with_kvcache, case, num_splits=num_splits)
        print(f"Sq 0 append, num_splits {num_splits}, page {page_size}: out {tuple(out.shape)}, caches as expected",
              flush=True)
