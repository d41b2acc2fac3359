"""flash_attn_with_kvcache with several query rows per sequence (speculative decoding, chunked
prefill) on the GPU: GPU time by CUDA-graph replay (median) as the rows grow, B8 Hq/Hkv 32/8
D128 bf16, causal, 4,096 cached keys (contiguous). Compares tile rules across trees.

    PYTHONPATH=src python benchmarks/kvcache_query_rows.py [out.json]
"""

import json
import sys
import time

import torch
import triton

import fmha

BATCH, HEADS, KV_HEADS, HEAD_DIM, CACHED = 8, 32, 8, 128, 4096


def main():
    rows = []
    k_cache, v_cache = (torch.randn(BATCH, CACHED, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    seqlens = torch.full((BATCH,), CACHED, dtype=torch.int32, device="cuda")
    for seqlen_q in (4, 16, 32, 64, 128, 512):
        q = torch.randn(BATCH, seqlen_q, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        us = triton.testing.do_bench_cudagraph(
            lambda: fmha.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True),
            rep=40, return_mode="median") * 1e3
        pairs = BATCH * HEADS * sum(CACHED - seqlen_q + i + 1 for i in range(seqlen_q))
        rows.append({"seqlen_q": seqlen_q, "us": us, "TFLOPs": 4 * pairs * HEAD_DIM / us / 1e6})
        print(json.dumps(rows[-1]), flush=True)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as handle:
            json.dump(info, handle, indent=1)


if __name__ == "__main__":
    main()
