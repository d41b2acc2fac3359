import torch, fmha, traceback
def attempt(name, fn):
    try:
        fn(); torch.cuda.synchronize(); print(name, "ok", flush=True)
    except Exception as e:
        print(name, "FAIL", type(e).__name__, str(e)[:200], flush=True)
        return
def fwd_bwd(b, h, s, d, causal=False, **kw):
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    print("  ", fmha.explain(q, k, v, causal=causal, **kw).backend, fmha.explain(q, k, v, causal=causal, **kw).backward[:60])
    out = fmha.attention(q, k, v, causal=causal, **kw)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    print("   fwd err", (out.float() - ref).abs().max().item())
    out.backward(torch.ones_like(out))
    print("   grad finite", all(t.grad.isfinite().all().item() for t in (q, k, v)), q.grad.abs().max().item())
attempt("bwd B4100 H16 S32 D64", lambda: fwd_bwd(4100, 16, 32, 64))
attempt("bwd B4100 H16 S32 D64 deterministic", lambda: fwd_bwd(4100, 16, 32, 64, deterministic=True))
attempt("bwd B4100 H16 S32 D96", lambda: fwd_bwd(4100, 16, 32, 96))
def decode(b, hq, hkv, sk, d=128):
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    print("  ", fmha.explain(q, k, v).backend)
    out = fmha.attention(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    print("   err", (out.float() - ref).abs().max().item())
attempt("decode B8200 H32/8 Sk256", lambda: decode(8200, 32, 8, 256))
attempt("decode B70000 H1/1 Sk64", lambda: decode(70000, 1, 1, 64))
def kvc(b, hq, hkv, sk, d=128):
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = fmha.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.full((b,), sk, dtype=torch.int32, device="cuda"))
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2).float(), kc.transpose(1, 2).float(), vc.transpose(1, 2).float(), enable_gqa=True)
    print("   err", (out.transpose(1, 2).float() - ref).abs().max().item())
attempt("kvcache B8200 H32/8 Sk256", lambda: kvc(8200, 32, 8, 256))
