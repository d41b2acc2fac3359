"""flash_attn_varlen_func with a block table (packed queries over a paged cache) on the GPU, beside
flash_attn_with_kvcache on the same pages (decode) and the contiguous varlen call on the same keys
(chunked prefill). GPU time by CUDA-graph replay, median.

    PYTHONPATH=src python benchmarks/paged_varlen.py [out.json] [--sweep]   (--sweep: tiles for the prefill)

Cases (bf16, Hq/Hkv = 32/8, D = 128):
* ragged decode: B32, one query per sequence, cache lengths 1k-8k (benchmarks/kvcache.py's), pages
  of 16 and 256: GB/s of K/V read;
* chunked prefill: B4, 512 new queries per sequence at the end of a 4096-key paged cache (page 16
  and 256), causal: TFLOP/s of visible pairs, against ``flash_attn_varlen_func`` on the same keys
  packed contiguously.
A tree without the block table path (an older fmha) gives the with_kvcache numbers only.
"""

import json
import sys
import time
from pathlib import Path

import torch
import triton

import fmha
from fmha import kvcache_ops
from fmha.backends.triton.config import KVCacheConfig, kvcache_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcache import DTYPE, HEAD_DIM, HEADS, KV_HEADS, RAGGED_SEED, copy_tbps, gpu_us, paged  # noqa: E402


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def paged_varlen(q, k_pages, v_pages, lengths_q, lengths_k, table, causal):
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    return lambda: fmha.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                               causal=causal, block_table=table)


def decode(lengths, page_size) -> dict:
    batch, capacity = len(lengths), max(lengths)
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k_cache, v_cache = (torch.randn(batch, capacity, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
                        for _ in range(2))
    k_pages, v_pages, table = paged(k_cache, v_cache, lengths, page_size, torch.Generator().manual_seed(0))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * sum(lengths) * KV_HEADS * HEAD_DIM * 2
    row = {"case": f"ragged decode B{batch} page{page_size}", "kv_bytes": kv_bytes}
    with_kvcache = lambda: fmha.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,  # noqa: E731
                                                        block_table=table)
    row["with_kvcache_us"] = gpu_us(with_kvcache)
    try:
        varlen = paged_varlen(q.view(batch, HEADS, HEAD_DIM), k_pages, v_pages, [1] * batch, lengths, table, False)
        row["max_abs_difference"] = (varlen().float() - with_kvcache()[:, 0].float()).abs().max().item()
        row["paged_varlen_us"] = gpu_us(varlen)
    except NotImplementedError as error:
        row["paged_varlen"] = str(error)
    for name in ("with_kvcache", "paged_varlen"):
        if f"{name}_us" in row:
            row[f"{name}_GBps"] = kv_bytes / row[f"{name}_us"] / 1e3
    return row


def chunked_prefill(batch, new, context, page_size) -> dict:
    lengths_q, lengths_k = [new] * batch, [context] * batch
    q = torch.randn(batch * new, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k_cache, v_cache = (torch.randn(batch, context, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
                        for _ in range(2))
    k_pages, v_pages, table = paged(k_cache, v_cache, lengths_k, page_size, torch.Generator().manual_seed(0))
    pairs = batch * HEADS * (new * (context - new) + new * (new + 1) // 2)
    flops = 4 * pairs * HEAD_DIM
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    packed_k, packed_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    contiguous = lambda: fmha.flash_attn_varlen_func(q, packed_k, packed_v, cu_q, cu_k, new, context,  # noqa: E731
                                                     causal=True)
    row = {"case": f"chunked prefill B{batch} {new} new over {context} page{page_size}", "flops": flops}
    row["contiguous_varlen_us"] = gpu_us(contiguous)
    # The same call through flash_attn_with_kvcache on a contiguous cache (the same kernel as the paged call).
    q_bshd, seqlens = q.view(batch, new, HEADS, HEAD_DIM), torch.full((batch,), context, dtype=torch.int32,
                                                                       device="cuda")
    row["with_kvcache_contiguous_us"] = gpu_us(lambda: fmha.flash_attn_with_kvcache(
        q_bshd, k_cache, v_cache, cache_seqlens=seqlens, causal=True))
    try:
        varlen = paged_varlen(q, k_pages, v_pages, lengths_q, lengths_k, table, True)
        row["max_abs_difference"] = (varlen().float() - contiguous().float()).abs().max().item()
        row["paged_varlen_us"] = gpu_us(varlen)
    except NotImplementedError as error:
        row["paged_varlen"] = str(error)
    for name in ("contiguous_varlen", "with_kvcache_contiguous", "paged_varlen"):
        if f"{name}_us" in row:
            row[f"{name}_TFLOPs"] = flops / row[f"{name}_us"] / 1e6
    return row


def sweep_prefill_tiles(batch, new, context, page_size) -> list:
    """The chunked prefill case under other tiles (block_m, block_n, warps, stages): the
    heuristic's choice replaced for the measurement."""
    results = []
    for block_m, block_n, num_warps, num_stages in SWEEP:
        def forced(params, multiprocessors, tiles=(block_m, block_n, num_warps, num_stages)):
            return KVCacheConfig(*tiles, kvcache_config(params, multiprocessors).splits)
        kvcache_ops.kvcache_config, original = forced, kvcache_ops.kvcache_config
        kvcache_ops.forget()
        try:
            row = chunked_prefill(batch, new, context, page_size)
            results.append({"tiles": [block_m, block_n, num_warps, num_stages],
                            **{key: row[key] for key in ("paged_varlen_us", "paged_varlen_TFLOPs",
                                                          "max_abs_difference") if key in row}})
        except Exception as error:
            results.append({"tiles": [block_m, block_n, num_warps, num_stages],
                            "error": f"{type(error).__name__}: {str(error)[:100]}"})
        finally:
            kvcache_ops.kvcache_config = original
            kvcache_ops.forget()
        print(json.dumps(results[-1]), flush=True)
    return results


SWEEP = [(64, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 4, 2), (256, 64, 8, 2)]


def main():
    torch.manual_seed(0)
    copy_rate = copy_tbps()
    ragged = torch.randint(1024, 8193, (32,), generator=torch.Generator().manual_seed(RAGGED_SEED)).tolist()
    rows = [decode(ragged, 16), decode(ragged, 256), chunked_prefill(4, 512, 4096, 16),
            chunked_prefill(4, 512, 4096, 256), chunked_prefill(16, 128, 2048, 16)]
    if "--sweep" in sys.argv:
        rows.append({"case": "chunked prefill B4 512 new over 4096 page16, tiles",
                     "sweep": sweep_prefill_tiles(4, 512, 4096, 16)})
    for row in rows:
        print(json.dumps({key: round(value, 3) if isinstance(value, float) else value for key, value in row.items()}),
              flush=True)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "copy_TBps": copy_rate, "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    paths = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    if paths:
        with open(paths[0], "w") as handle:
            json.dump(info, handle, indent=1)


if __name__ == "__main__":
    main()
