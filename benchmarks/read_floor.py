"""What the bare read of a small decode's K/V costs in one launch (GPU).

The inference issue bounds the small decode cases (B1 H32/8 Sk4096 D128, B8 H32/8 Sk2048 D128) by
"copy floor + one launch": the K/V bytes at the device's copy rate plus one replayed one-element
kernel. This script times the least any kernel must do there: one launch that reads those bytes
once (a sum per program, nothing else), swept over grid sizes and tile widths, replayed from a
CUDA graph over rotating copies of the inputs as `benchmarks/kvcache.py` replays the decode (the
50 MB L2 does not serve them). If the best read is already past the bound, no attention kernel
meets it.

    PYTHONPATH=src python benchmarks/read_floor.py out.json [--heads]

``--heads`` reads the same bytes in the decode's pattern instead: a program per (KV head, chunk of
keys), each key's row of one head (256 bytes at D = 128) 2 KB from the next. ``--tma`` reads that
pattern both with pointer loads and through tensor descriptors (the bulk copy engine), a program
per (sequence, KV head, chunk) as the decode runs them.
"""

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcache import copy_tbps, gpu_us, launch_us, rotating  # noqa: E402

from fmha.tools.bench.runner import environment  # noqa: E402

KV_HEADS, HEAD_DIM = 8, 128
L2_BYTES = 50 * 2**20


@triton.jit
def read_sum_kernel(Source, Sums, numel, BLOCK: tl.constexpr):
    """Each program sums a contiguous run of ``Source`` (bf16) into one float."""
    per_program = tl.cdiv(tl.cdiv(numel, tl.num_programs(0)), BLOCK) * BLOCK
    start = tl.program_id(0) * per_program
    total = tl.zeros([BLOCK], tl.float32)
    for offset in range(start, tl.minimum(start + per_program, numel), BLOCK):
        index = offset + tl.arange(0, BLOCK)
        total += tl.load(Source + index, mask=index < numel, other=0.0).to(tl.float32)
    tl.store(Sums + tl.program_id(0), tl.sum(total, 0))


@triton.jit
def read_heads_kernel(K, V, Sums, seqlen, chunk, row_stride, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """The decode's access pattern: program (sequence and KV head, chunk) reads its head's keys
    [chunk_start, chunk_start + chunk) of K and V, rows of HEAD_DIM elements ``row_stride`` apart
    (a (B, S, Hkv, D) cache), and sums them."""
    head_base = tl.program_id(0).to(tl.int64) * HEAD_DIM  # batch and head folded: rows of all heads interleave
    start = tl.program_id(1) * chunk
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    total = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for first in range(start, tl.minimum(start + chunk, seqlen), BLOCK_N):
        keys = first + offs_n
        offsets = head_base + keys.to(tl.int64)[:, None] * row_stride + offs_d[None, :]
        mask = (keys < seqlen)[:, None]
        total += tl.load(K + offsets, mask=mask, other=0.0).to(tl.float32)
        total += tl.load(V + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(Sums + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(total, 1), 0))


@triton.jit
def read_heads_tma_kernel(K, V, Sums, seqlen, chunk, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    """read_heads_kernel's pattern through tensor descriptors over the (B·S, Hkv·D) cache: program
    (sequence · Hkv + head, chunk) reads keys [chunk_start, chunk_start + chunk) of its sequence."""
    sequence_head = tl.program_id(0)
    row0 = (sequence_head // HEADS) * seqlen
    column = (sequence_head % HEADS) * HEAD_DIM
    start = tl.program_id(1) * chunk
    total = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for first in tl.range(start, tl.minimum(start + chunk, seqlen), BLOCK_N, num_stages=STAGES):
        total += K.load([row0 + first, column]).to(tl.float32)
        total += V.load([row0 + first, column]).to(tl.float32)
    tl.store(Sums + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(total, 1), 0))


def tma_pattern(copy_rate, launch):
    """The decode's pattern, a program per (sequence, KV head, chunk), with pointer loads and with
    tensor descriptors, B1 Sk4096 and B8 Sk2048."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = []
    for batch, seqlen in ((1, 4096), (8, 2048)):
        kv_bytes = 2 * batch * seqlen * KV_HEADS * HEAD_DIM * 2
        copies = max(2, -(-3 * L2_BYTES // kv_bytes))
        caches = [tuple(torch.randn(batch * seqlen, KV_HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2)) for _ in range(copies)]
        floor_and_launch = kv_bytes / copy_rate / 1e6 + launch
        for chunks in (1, 2, 4, 8, 16, 32):
            chunk = -(-seqlen // chunks)
            programs = batch * KV_HEADS * chunks
            if programs > 2048:
                continue
            for block_n, warps, stages in ((64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 8, 3),
                                           (64, 4, 6)):
                if chunk < block_n:
                    continue
                sums = torch.empty(programs, device="cuda", dtype=torch.float32)
                reference = None
                for kind in ("pointers", "tma"):
                    if kind == "tma":
                        descriptors = [tuple(TensorDescriptor.from_tensor(t, [block_n, HEAD_DIM]) for t in pair)
                                       for pair in caches]
                        calls = [lambda k=k, v=v: read_heads_tma_kernel[(batch * KV_HEADS, chunks)](
                            k, v, sums, seqlen, chunk, HEADS=KV_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_N=block_n, STAGES=stages,
                            num_warps=warps) for k, v in descriptors]
                    else:
                        calls = [lambda k=k, v=v: read_heads_kernel[(KV_HEADS, chunks * batch)](
                            k, v, sums, seqlen * batch, chunk, KV_HEADS * HEAD_DIM, HEAD_DIM=HEAD_DIM,
                            BLOCK_N=block_n, num_warps=warps, num_stages=stages) for k, v in caches]
                    for call in calls:
                        call()
                    total = sums.sum().item()
                    reference = total if reference is None else reference
                    us = gpu_us(rotating(calls))
                    rows.append({"pattern": kind, "batch": batch, "seqlen": seqlen, "programs": programs,
                                 "block_n": block_n, "warps": warps, "stages": stages, "us": us,
                                 "vs_floor_and_launch": us / floor_and_launch,
                                 "sum_matches": abs(total - reference) <= 1e-3 * abs(reference) + 1.0})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def heads_pattern(copy_rate, launch):
    """read_heads_kernel over B1 Sk4096 and B8 Sk2048 (Hkv 8, D 128): chunk counts, key blocks, warps, stages."""
    rows = []
    for batch, seqlen in ((1, 4096), (8, 2048)):
        kv_bytes = 2 * batch * seqlen * KV_HEADS * HEAD_DIM * 2
        copies = max(2, -(-3 * L2_BYTES // kv_bytes))
        caches = [tuple(torch.randn(batch * seqlen * KV_HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2)) for _ in range(copies)]
        floor_and_launch = kv_bytes / copy_rate / 1e6 + launch
        for chunks in (2, 4, 8, 16, 32, 64):
            if batch * KV_HEADS * chunks > 4096:
                continue
            chunk = -(-seqlen // chunks)
            for block_n, warps, stages in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 3)):
                if chunk < block_n:
                    continue
                sums = torch.empty(batch * KV_HEADS * chunks, device="cuda", dtype=torch.float32)
                # (B, S, Hkv, D): batch b's head h starts at (b * S * Hkv + h) * D; fold b into the head
                # index only for B1, where it is exact; B8 reads each head's rows of every sequence
                # as one longer sequence (the same bytes and pattern).
                calls = [lambda k=k, v=v: read_heads_kernel[(KV_HEADS, chunks * batch)](
                    k, v, sums, seqlen * batch, chunk, KV_HEADS * HEAD_DIM, HEAD_DIM=HEAD_DIM, BLOCK_N=block_n,
                    num_warps=warps, num_stages=stages) for k, v in caches]
                for call in calls:
                    call()
                us = gpu_us(rotating(calls))
                rows.append({"pattern": "heads", "batch": batch, "seqlen": seqlen, "programs": KV_HEADS * chunks * batch,
                             "block_n": block_n, "warps": warps, "stages": stages, "us": us,
                             "vs_floor_and_launch": us / floor_and_launch})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    out_path = sys.argv[1]
    pattern = tma_pattern if "--tma" in sys.argv else heads_pattern if "--heads" in sys.argv else None
    if pattern is not None:
        copy_rate, launch = copy_tbps(), launch_us()
        Path(out_path).write_text(json.dumps({"environment": environment(), "copy_tbps": copy_rate,
                                              "launch_us": launch, "rows": pattern(copy_rate, launch)}, indent=1))
        return
    copy_rate = copy_tbps()
    launch = launch_us()
    rows = []
    for batch, seqlen in ((1, 4096), (8, 2048)):
        numel = 2 * batch * seqlen * KV_HEADS * HEAD_DIM  # K and V
        kv_bytes = 2 * numel
        copies = max(2, -(-3 * L2_BYTES // kv_bytes))
        sources = [torch.randn(numel, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        floor_and_launch = kv_bytes / copy_rate / 1e6 + launch
        best = None
        for programs in (132, 264, 528, 1056, 2112):
            for block, warps in ((2048, 4), (4096, 8), (8192, 8)):
                sums = torch.empty(programs, device="cuda", dtype=torch.float32)
                calls = [lambda source=source: read_sum_kernel[(programs,)](source, sums, numel, BLOCK=block,
                                                                             num_warps=warps)
                         for source in sources]
                for call in calls:
                    call()
                torch.testing.assert_close(sums.sum(), sources[-1].float().sum(), rtol=1e-3, atol=1.0)
                us = gpu_us(rotating(calls))
                row = {"batch": batch, "seqlen": seqlen, "kv_bytes": kv_bytes, "programs": programs, "block": block,
                       "warps": warps, "us": us, "floor_and_launch_us": floor_and_launch,
                       "vs_floor_and_launch": us / floor_and_launch}
                rows.append(row)
                if best is None or us < best["us"]:
                    best = row
        print(json.dumps({"best": best, "copy_tbps": copy_rate, "launch_us": launch}), flush=True)
    Path(out_path).write_text(json.dumps({"environment": environment(), "copy_tbps": copy_rate,
                                          "launch_us": launch, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
