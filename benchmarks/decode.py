"""Decode forwards (few query rows, many keys) on the GPU: GPU time by CUDA-graph replay and host
time per call, fmha beside SDPA flash and cuDNN in the same run.

    PYTHONPATH=src python benchmarks/decode.py [out.json]
"""

import json
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

import fmha

# (batch, q heads, kv heads, Sq, Sk, head dim)
SHAPES = [(1, 32, 8, 1, 4096, 128), (8, 32, 8, 1, 2048, 128), (1, 32, 8, 1, 32768, 128), (16, 32, 8, 1, 8192, 128),
          (1, 64, 8, 1, 8192, 128), (4, 32, 32, 1, 4096, 128), (1, 32, 8, 4, 4096, 128), (1, 16, 16, 1, 16384, 64)]


def main():
    rows = []
    for batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim in SHAPES:
        q = torch.randn(batch, q_heads, seqlen_q, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, seqlen_k, head_dim, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        gqa = q_heads != kv_heads

        def sdpa(backend):
            def run():
                with sdpa_kernel(backend):
                    return scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
            return run

        expected = sdpa(SDPBackend.MATH)()
        fns = {"fmha": lambda: fmha.attention(q, k, v), "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
               "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
        error = (fns["fmha"]().float() - expected.float()).abs().max().item()
        kv_bytes = 2 * k.numel() * k.element_size()
        row = {"shape": [batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim], "fmha_max_error": error,
               "fmha_config": str(fmha.explain(q, k, v).config)}
        for name, fn in fns.items():
            try:
                gpu_ms = triton.testing.do_bench_cudagraph(fn, rep=100)
                host_ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                row[name] = {"gpu_us": gpu_ms * 1e3, "do_bench_us": host_ms * 1e3, "kv_TBps": kv_bytes / gpu_ms / 1e9}
            except Exception as error:  # a peer that cannot take the shape
                row[name] = {"error": f"{type(error).__name__}: {str(error)[:120]}"}
        rows.append(row)
        cells = "  ".join(f"{name} {row[name].get('gpu_us', float('nan')):7.1f} us ({row[name].get('kv_TBps', 0):.2f} TB/s)"
                          for name in fns)
        print(f"B{batch} H{q_heads}/{kv_heads} Sq{seqlen_q} Sk{seqlen_k} D{head_dim}: {cells}  err {error:.1e}  "
              f"[{row['fmha_config']}]", flush=True)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "fmha": fmha.__version__, "rows": rows}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as handle:
            json.dump(info, handle, indent=1)


if __name__ == "__main__":
    main()
