"""Rotary embeddings in ``flash_attn_with_kvcache`` (GPU).

``--matrix``: calls around head dim 32 with the whole head rotated, and partial rotary dims
(interleaved or halves, 1-16 queries over 8 query heads per KV head, so tiles of 16-128 packed rows; paged or
contiguous), each in its own process, since a kernel that reads out of bounds loses the process's
CUDA context. Each is checked against float64 (``benchmarks/random_calls.py``'s KV-cache check).

Without it: a decode step that appends one rotated key, B32 H32/8 Sk8192 D128 (and H64/8 D32),
interleaved or not, over the whole head or part of it, and one without rotary, kernel time by
``triton.testing.do_bench``; run it once per tree, alternating:

    PYTHONPATH=src python benchmarks/kvcache_rotary.py new
    PYTHONPATH=../old/src python benchmarks/kvcache_rotary.py old
    PYTHONPATH=src python benchmarks/kvcache_rotary.py --matrix
"""

import concurrent.futures
import itertools
import json
import pathlib
import subprocess
import sys

BASE = {"kind": "kvcache", "batch": 1, "seqlen_q": 7, "kv_heads": 8, "q_heads": 64, "head_dim": 32, "capacity": 100,
        "new_keys": 7, "page_size": 16, "dtype": "float16", "causal": True, "window": [-1, 0], "softcap": 0.0,
        "alibi": False, "num_splits": 0, "rotary_dim": 32, "rotary_interleaved": True, "batch_idx": False,
        "leftpad": False, "seed": 908038747}


def matrix_cases():
    cases = [{**BASE, "seqlen_q": sq, "new_keys": max(sq, 7), "rotary_interleaved": interleaved, "page_size": page}
             for sq, interleaved, page in itertools.product([1, 2, 4, 7, 16], [True, False], [16, None])]
    cases += [{**BASE, "head_dim": d, "rotary_dim": r, "seqlen_q": sq, "new_keys": max(sq, 7),
               "rotary_interleaved": interleaved}
              for (d, r), sq, interleaved in itertools.product([(16, 16), (64, 64), (128, 32), (128, 128), (80, 32), (128, 24), (32, 2), (32, 4), (32, 6), (32, 16)], [1, 7, 16],
                                                                 [True, False])]
    return cases


def check_one(case) -> str:
    script = pathlib.Path(__file__).parent / "random_calls.py"
    run = subprocess.run([sys.executable, str(script), "--replay", json.dumps(case)], capture_output=True, text=True,
                         timeout=300)
    lines = (run.stdout + run.stderr).strip().splitlines()
    ok = run.returncode == 0 and lines and lines[-1] == "ok"
    why = "" if ok else next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")[:120]
    return (f"{'ok  ' if ok else 'FAIL'} D{case['head_dim']} rotary {case['rotary_dim']} queries {case['seqlen_q']} "
            f"interleaved {int(case['rotary_interleaved'])} page {case['page_size']} {why}")


def decode_steps(tree: str) -> None:
    import torch
    import triton

    import fmha

    times = {}
    for head_dim, heads, kv_heads in ((128, 32, 8), (32, 64, 8)):
        batch, capacity = 32, 8192
        generator = torch.Generator(device="cuda").manual_seed(0)
        k_cache, v_cache = (torch.randn(batch, capacity, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16,
                                        generator=generator) for _ in range(2))
        q = torch.randn(batch, 1, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        k, v = (torch.randn(batch, 1, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
                for _ in range(2))
        angle = torch.rand(capacity, head_dim // 2, device="cuda", generator=generator) * 6.28
        seqlens = torch.full((batch,), capacity - 1, dtype=torch.int32, device="cuda")
        variants = [(head_dim, False, True), (head_dim, True, True), (head_dim, True, False), (0, True, False)]
        if head_dim == 128:  # partial rotary with halves (GPT-NeoX, Phi): a power of two, and not
            variants += [(64, True, False), (48, True, False)]
        for rotary_dim, causal, interleaved in variants:
            cos, sin = (f(angle[:, :rotary_dim // 2]).to(torch.bfloat16) if rotary_dim else None
                        for f in (torch.cos, torch.sin))

            def step():
                return fmha.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=seqlens,
                                                    causal=causal, rotary_interleaved=interleaved)
            step()
            times[f"D{head_dim} rotary {rotary_dim} causal={causal} interleaved={interleaved}"] = round(
                triton.testing.do_bench(step, warmup=50, rep=300) * 1e3, 1)
    print(tree, json.dumps(times), flush=True)


def main():
    if "--matrix" in sys.argv:
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            for line in pool.map(check_one, matrix_cases()):
                print(line, flush=True)
    else:
        decode_steps(sys.argv[1] if len(sys.argv) > 1 else "tree")


if __name__ == "__main__":
    main()
