"""Host-side cost per call: CPU time around N calls, then one synchronize (min and median of rounds).

    PYTHONPATH=src python benchmarks/host_overhead.py [out.json]

Shapes: a tiny forward (1,1,128,64), the seeds' small case (1,16,1024,64) and two decode shapes
(B1 H32/8 Sq1 Sk4096 D128; B8 H32/8 Sq1 Sk2048 D128), each against SDPA flash and cuDNN in the
same interleaved rounds; and packed sequences (4 x 256 tokens, H16 D64, causal) through
``flash_attn_varlen_func`` against ``torch.nn.attention.varlen.varlen_attn``, when both exist.
Works with this tree and with older ones (``fmha.attention`` only).
"""

import inspect
import json
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

import fmha

SHAPES = {"tiny (1,1,128,64)": (1, 1, 1, 128, 128, 64), "seeds (1,16,1024,64)": (1, 16, 16, 1024, 1024, 64),
          "decode B1 H32/8 Sk4096 D128": (1, 32, 8, 1, 4096, 128), "decode B8 H32/8 Sk2048 D128": (8, 32, 8, 1, 2048, 128)}


def host_us_per_call(fns: dict, calls=1000, rounds=7) -> dict:
    """Per function: mean time per call over ``calls`` calls, min and median over ``rounds`` rounds,
    interleaved so that the VM host's slow spells hit them all alike."""
    samples = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: {"min_us": min(values), "median_us": statistics.median(values)} for name, values in samples.items()}


def varlen_host_us() -> dict:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return {}
    if not hasattr(fmha, "flash_attn_varlen_func"):
        return {}
    lengths = [256] * 4
    cu = torch.tensor([0, 256, 512, 768, 1024], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    causal = ({"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters
              else {"is_causal": True})
    fns = {"fmha.flash_attn_varlen_func": lambda: fmha.flash_attn_varlen_func(q, k, v, cu, cu, 256, 256, causal=True),
           "varlen_attn": lambda: varlen_attn(q, k, v, cu, cu, 256, 256, **causal)}
    return {f"varlen 4x256 H16 D64 causal | {name}": result for name, result in host_us_per_call(fns).items()}


def main():
    results = {}
    for label, (batch, hq, hkv, sq, sk, d) in SHAPES.items():
        q = torch.randn(batch, hq, sq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, hkv, sk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        gqa = hq != hkv

        def sdpa(backend):
            def run():
                with sdpa_kernel(backend):
                    return scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
            return run

        fns = {"fmha.attention": lambda: fmha.attention(q, k, v),
               "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
        for name, result in host_us_per_call(fns).items():
            results[f"{label} | {name}"] = result
    results.update(varlen_host_us())
    print(f"{'':<60} {'min':>7} {'median':>7}  µs per call ({fmha.__version__}, {fmha.__file__})")
    for name, result in results.items():
        print(f"{name:<60} {result['min_us']:7.1f} {result['median_us']:7.1f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
