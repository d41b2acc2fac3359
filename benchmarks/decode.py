"""Decode forwards (few query rows, many keys) on the GPU: GPU time by CUDA-graph replay and host
time per call, fmha beside SDPA flash and cuDNN in the same run.

    PYTHONPATH=src python benchmarks/decode.py [out.json] [--sweep [--shapes B,Hq,Hkv,Sq,Sk,D:...]]

--sweep: instead, the split-KV forward's chunk counts, key blocks and pipeline stages per shape,
each call rotating over copies of K and V that together exceed three times the 50 MB L2 (a decode
step reads each layer's cache once), with SDPA cuDNN on the same copies.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

import fmha
from fmha.backends.triton.config import split_kv_config
from fmha.backends.triton.launch import SplitKVForward
from fmha.params import attention_params
from fmha.runtime import multiprocessors

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcache import rotating  # noqa: E402

# (batch, q heads, kv heads, Sq, Sk, head dim)
SHAPES = [(1, 32, 8, 1, 4096, 128), (8, 32, 8, 1, 2048, 128), (1, 32, 8, 1, 32768, 128), (16, 32, 8, 1, 8192, 128),
          (1, 64, 8, 1, 8192, 128), (4, 32, 32, 1, 4096, 128), (1, 32, 8, 4, 4096, 128), (1, 16, 16, 1, 16384, 64)]


def sweep_shape(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim) -> dict:
    """GPU µs of split-KV plans around the heuristic's, over rotating copies; SDPA cuDNN beside."""
    kv_bytes = 2 * batch * kv_heads * seqlen_k * head_dim * 2
    copies = max(2, -(-3 * 50 * 2**20 // kv_bytes))
    sets = [(torch.randn(batch, q_heads, seqlen_q, head_dim, device="cuda", dtype=torch.bfloat16),
             *(torch.randn(batch, kv_heads, seqlen_k, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)))
            for _ in range(copies)]
    params = attention_params("attention", *sets[0])
    heuristic = split_kv_config(params, multiprocessors(sets[0][0].device))
    if heuristic is None:  # the per-tile forward's call
        return {"shape": [batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim], "heuristic": None, "plans": []}
    out = torch.empty_like(sets[0][0])
    lse = torch.empty(batch, q_heads, seqlen_q, device="cuda", dtype=torch.float32)
    reference = fmha.attention(*sets[0]).float()
    # The rule before session 30: about two programs per multiprocessor, two blocks in flight.
    earlier = dataclasses.replace(heuristic, block_n=64 if head_dim <= 128 else 32, num_stages=2, splits=max(1, min(
        -(-2 * multiprocessors(sets[0][0].device) // (batch * kv_heads)), -(-seqlen_k // (2 * 64)))))
    counts = sorted({max(1, heuristic.splits * f // 4) for f in (2, 4, 8)} | {earlier.splits})
    plans = [dataclasses.replace(heuristic, block_n=n, splits=c, num_stages=st)
             for n in (32, 64, 128) for c in counts for st in (2, 3)]
    plans += [plan for plan in (heuristic, earlier) if plan not in plans]
    results = []
    for plan in plans:
        forward = SplitKVForward(params, plan)
        try:
            forward(*sets[0], out, lse)
            error = (out.float() - reference).abs().max().item()
            us = triton.testing.do_bench_cudagraph(
                rotating([lambda s=s: forward(*s, out, lse) for s in sets]), rep=60, return_mode="median") * 1e3
        except Exception as exc:  # a plan that does not build (registers, shared memory)
            results.append({"plan": dataclasses.asdict(plan), "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        results.append({"plan": dataclasses.asdict(plan), "us": us, "max_diff_vs_default": error})
    gqa = q_heads != kv_heads

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    cudnn_us = triton.testing.do_bench_cudagraph(rotating([lambda s=s: cudnn(*s) for s in sets]), rep=60,
                                                 return_mode="median") * 1e3
    return {"shape": [batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim], "copies": copies,
            "heuristic": dataclasses.asdict(heuristic), "earlier": dataclasses.asdict(earlier), "sdpa_cudnn_us": cudnn_us, "plans": results}


# More decode shapes for the sweep: full grids, mid-size batches, D 64 and 256, one query head per KV head.
SWEEP_SHAPES = SHAPES + [(32, 32, 8, 1, 8192, 128), (2, 32, 8, 1, 4096, 128), (4, 32, 8, 1, 8192, 128),
                         (1, 32, 32, 1, 4096, 128), (1, 8, 1, 1, 8192, 256), (2, 32, 8, 1, 8192, 64),
                         (64, 32, 8, 1, 2048, 128)]


def sweep():
    rows = []
    shapes = SWEEP_SHAPES
    if "--shapes" in sys.argv:  # e.g. --shapes 8,32,8,1,2048,64:1,32,8,1,4096,128
        shapes = [tuple(int(x) for x in spec.split(",")) for spec in sys.argv[sys.argv.index("--shapes") + 1].split(":")]
    for shape in shapes:
        row = sweep_shape(*shape)
        rows.append(row)
        if row["heuristic"] is None:
            print(f"{row['shape']}: not split-KV", flush=True)
            continue
        ranked = sorted((r for r in row["plans"] if "us" in r), key=lambda r: r["us"])
        default = next((r["us"] for r in ranked if r["plan"] == row["heuristic"]), float("nan"))
        before = next((r["us"] for r in ranked if r["plan"] == row["earlier"]), float("nan"))
        text = ", ".join(f"n{r['plan']['block_n']}x{r['plan']['splits']}s{r['plan']['num_stages']} {r['us']:.1f}"
                         for r in ranked[:6])
        worst = max((r["max_diff_vs_default"] for r in ranked), default=0.0)
        print(f"{row['shape']}: heuristic {default:.1f} us (earlier rule {before:.1f}), cuDNN {row['sdpa_cudnn_us']:.1f}; best {text}; "
              f"max diff {worst:.1e}", flush=True)
    return rows


def main():
    if "--sweep" in sys.argv:
        rows = sweep()
        paths = [arg for index, arg in enumerate(sys.argv[1:], 1)
                 if not arg.startswith("--") and sys.argv[index - 1] != "--shapes"]
        if paths:
            with open(paths[0], "w") as handle:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "triton": triton.__version__, "rows": rows}, handle, indent=1)
        return
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
