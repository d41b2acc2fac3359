"""dQ converted inside the Gluon backward: gradients against float64 on odd shapes, with the conversion forced on."""
import dataclasses, sys
import torch
import fmha
from fmha import dispatch
from fmha.backends.gluon_sm90 import backward_launch

shipped = backward_launch.default_backward_schedule
backward_launch.default_backward_schedule = lambda d: dataclasses.replace(shipped(d), convert_rows=1 << 30)
dispatch.forget()
torch.manual_seed(0)
failures = 0
for (b, hq, hkv, sq, sk, d, causal) in [(2, 4, 4, 777, 1500, 128, False), (2, 4, 4, 777, 1500, 128, True),
                                        (1, 8, 2, 300, 300, 64, True), (3, 6, 3, 1000, 640, 64, False),
                                        (2, 8, 8, 1024, 1024, 128, True), (1, 4, 1, 129, 257, 128, False),
                                        (2, 4, 2, 64, 2048, 64, True)]:
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype, requires_grad=True)
        dout = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
        out = fmha.attention(q, k, v, causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
        g = hq // hkv
        ke, ve = kr.repeat_interleave(g, 1), vr.repeat_interleave(g, 1)
        s = qr @ ke.transpose(-1, -2) / d ** 0.5
        if causal:
            mask = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(sk - sq)
            s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        ref_out = p @ ve
        refs = torch.autograd.grad(ref_out, (qr, kr, vr), dout.double())
        # PyTorch's own same-precision error: the math backend in dtype
        qm, km, vm = (t.detach().requires_grad_() for t in (q, k, v))
        om = torch.nn.functional.scaled_dot_product_attention(
            qm, km.repeat_interleave(g, 1), vm.repeat_interleave(g, 1), attn_mask=mask if causal else None)
        torch_grads = torch.autograd.grad(om, (qm, km, vm), dout)
        for name, got, ref, tg in zip("qkv", grads, refs, torch_grads):
            err = (got.double() - ref).abs().max().item()
            terr = (tg.double() - ref).abs().max().item()
            ok = torch.isfinite(got).all().item() and err <= 2 * terr + 1e-3
            failures += not ok
            print(f"{'ok ' if ok else 'BAD'} B{b} H{hq}/{hkv} Sq{sq} Sk{sk} D{d} causal={causal} {dtype} d{name} "
                  f"err {err:.2e} torch {terr:.2e}", flush=True)
print("failures", failures)
sys.exit(1 if failures else 0)
