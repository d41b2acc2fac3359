"""Host cost of the bulk-copy decode's per-call descriptors (session 26)."""
import sys, time, torch, triton
sys.path.insert(0, "benchmarks")
import fmha
from fmha import kvcache_ops
from triton.backends.nvidia import driver as nv

def per_call(fn, n=2000, rounds=7):
    best = []
    for _ in range(rounds):
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(n): fn()
        torch.cuda.synchronize(); best.append((time.perf_counter() - t) / n * 1e6)
    return min(best), sorted(best)[len(best)//2]

B, S = 8, 2048
q = torch.randn(B, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
kc, vc = (torch.randn(B, S, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
seq = torch.full((B,), S - 1, dtype=torch.int32, device="cuda")
call = lambda: fmha.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seq)
call()
print("flash_attn_with_kvcache B8", per_call(call))
fwd = kvcache_ops.prepared("x", q, kc, vc, None, None, None, None, seq, None, None, None, None, False, (-1, -1), 0.0, True, None, 0)
print("TMA", fwd.attend_launch.constants.get("TMA"))
if fwd.attend_launch.constants.get("TMA"):
    kd, vd = fwd._descriptors(kc, vc)
    meta = fwd.attend_launch.compiled.metadata.tensordesc_meta
    print("make_tensordesc_arg x2", per_call(lambda: (nv.make_tensordesc_arg(kd, meta[0]), nv.make_tensordesc_arg(vd, meta[1])), n=5000))
    print("_descriptors", per_call(lambda: fwd._descriptors(kc, vc), n=5000))
