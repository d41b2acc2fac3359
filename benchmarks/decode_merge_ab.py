"""Variants of the KV-cache kernel's key loop and split merge, timed on the small decode cases (GPU).

``benchmarks/decode_timeline.py`` found the fused merge of ``flash_attn_with_kvcache`` waiting one
memory round trip per chunk, and Nsight Compute found a third of a B1 decode's warp time in code
that runs once per program. This script builds variants of the kernel module (source
transformations of ``fmha/backends/triton/kvcache.py``) and times each over chunk counts and
pipeline depths on the cases of ``benchmarks/kvcache.py`` (CUDA-graph replay over rotating copies,
median): B1 H32/8 Sk4096, B8 H32/8 Sk2048 (both also with every length 0), dense B32 Sk8192. Every
variant's output is checked against the tree's own kernel.

The transformations were written for the kernel as of commit 12348e2 (three key ranges per tile,
the merge loop not pipelined); the tree now ships ``one_loop`` (for decode tiles) and a merge that
loads groups of chunks at once, so rerun them on that commit's ``kvcache.py`` and ``split_kv.py``.
``prefetch_l2`` applies to the tree's kernel.

    PYTHONPATH=src python benchmarks/decode_merge_ab.py out.json [variant,variant,...]
"""

import importlib
import json
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcache import DTYPE, HEAD_DIM, HEADS, KV_HEADS, copy_tbps, gpu_us, launch_us, rotating  # noqa: E402

import fmha  # noqa: E402
from fmha import kvcache_ops  # noqa: E402
from fmha.backends.triton.config import KVCacheConfig  # noqa: E402
from fmha.backends.triton.kvcache_launch import KVCacheForward  # noqa: E402
from fmha.tools.bench.runner import environment  # noqa: E402

# The shipped fold, with the next chunk's loads issued before the current chunk's fold (one ahead).
PREFETCH = '''
@triton.jit
def merge_chunks(PartialOut, PartialLse, index, in_range, num_rows, num_splits, offs_d,
                 HEAD_DIM: tl.constexpr, CACHE_MODIFIER: tl.constexpr):
    mask = in_range[:, None] & (offs_d[None, :] < HEAD_DIM)
    row_max = tl.full(index.shape, float("-inf"), dtype=tl.float32)
    total = tl.zeros(index.shape, dtype=tl.float32)
    acc = tl.zeros([index.shape[0], offs_d.shape[0]], dtype=tl.float32)
    lse_next = tl.load(PartialLse + index, mask=in_range, other=float("-inf"), cache_modifier=CACHE_MODIFIER)
    part_next = tl.load(PartialOut + index[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0,
                        cache_modifier=CACHE_MODIFIER)
    for split in range(0, num_splits):
        lse = lse_next
        part = part_next
        more = split + 1 < num_splits
        rows = tl.cast(split + 1, tl.int64) * num_rows + index
        lse_next = tl.load(PartialLse + rows, mask=in_range & more, other=float("-inf"),
                           cache_modifier=CACHE_MODIFIER)
        part_next = tl.load(PartialOut + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask & more, other=0.0,
                            cache_modifier=CACHE_MODIFIER)
        new_max = tl.maximum(row_max, lse)
        new_max_safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.math.exp2(row_max - new_max_safe)
        weight = tl.math.exp2(lse - new_max_safe)
        total = total * rescale + weight
        acc = acc * rescale[:, None] + weight[:, None] * part
        row_max = new_max
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    max_safe = tl.where(row_max == float("-inf"), 0.0, row_max)
    lse = tl.where(seen, (max_safe + tl.math.log2(tl.where(seen, total, 1.0))) * LN_2, float("-inf"))
    return out, lse
'''

# Every chunk's LSE in one load (the row max first), then the weighted sum: no running rescale,
# each chunk's loads independent of the others', the loop unrolled.
TWO_PHASE = '''
@triton.jit
def merge_chunks(PartialOut, PartialLse, index, in_range, num_rows, num_splits, offs_d,
                 HEAD_DIM: tl.constexpr, CACHE_MODIFIER: tl.constexpr):
    mask = in_range[:, None] & (offs_d[None, :] < HEAD_DIM)
    offs_s = tl.arange(0, 64)
    lses = tl.load(PartialLse + offs_s[None, :].to(tl.int64) * num_rows + index[:, None],
                   mask=in_range[:, None] & (offs_s[None, :] < num_splits), other=float("-inf"),
                   cache_modifier=CACHE_MODIFIER)
    row_max = tl.max(lses, 1)
    max_safe = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(tl.math.exp2(lses - max_safe[:, None]), 1)
    acc = tl.zeros([index.shape[0], offs_d.shape[0]], dtype=tl.float32)
    for split in tl.range(0, num_splits, loop_unroll_factor=UNROLL):
        rows = tl.cast(split, tl.int64) * num_rows + index
        lse = tl.load(PartialLse + rows, mask=in_range, other=float("-inf"), cache_modifier=CACHE_MODIFIER)
        part = tl.load(PartialOut + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0,
                       cache_modifier=CACHE_MODIFIER)
        acc += tl.math.exp2(lse - max_safe)[:, None] * part
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    lse = tl.where(seen, (max_safe + tl.math.log2(tl.where(seen, total, 1.0))) * LN_2, float("-inf"))
    return out, lse
'''

def merge_variant(merge_source, unroll=0):
    """kvcache.py with ``merge_chunks`` defined in it, ``UNROLL`` in its source replaced by ``unroll``."""
    def transform(text):
        anchor = "from .split_kv import merge_chunks\n"
        assert text.count(anchor) == 1
        text = text.replace(anchor, "")
        at = text.index("@triton.jit\ndef _rotate(")
        return text[:at] + merge_source.replace("UNROLL", str(unroll)) + "\n\n" + text[at:]
    return transform


def merge_loop(loop):
    """The tree's own ``merge_chunks`` (fmha/backends/triton/split_kv.py) with its loop header
    replaced by ``loop``, e.g. ``tl.range(0, num_splits, num_stages=3)`` (read when applied: the
    merge of commit 12348e2 loops over ``split``)."""
    def transform(text):
        split_kv = (Path(fmha.__file__).parent / "backends" / "triton" / "split_kv.py").read_text()
        start = split_kv.index("@triton.jit\ndef merge_chunks(")
        source = split_kv[start:split_kv.index("\n\n\n", start)]
        header = re.search(r"\n    for split in .*:\n", source).group(0)
        return merge_variant(source.replace(header, f"\n    for split in {loop}:\n"))(text)
    return transform


FIRST_CALL = "    acc, row_sum, row_max = _attend_cache_blocks(\n"
LEFT_RANGE = "rows, offs_d, tl.maximum(kv_start, chunk_start), tl.minimum(full_start, chunk_end),"


def _tile_calls(text):
    """The three ``_attend_cache_blocks`` calls of ``_attend_tile``: (start, end) offsets of each."""
    starts = [i for i in range(len(text)) if text.startswith(FIRST_CALL, i)]
    assert len(starts) == 3, len(starts)
    ends = [text.index("SOFTCAP, ALIBI)\n", start) + len("SOFTCAP, ALIBI)\n") for start in starts]
    return list(zip(starts, ends))


def no_left_loop(text):
    """The first (left-masked) key range only in builds with a left window edge: without one it
    is always empty, but its pipelined loop's prologue and epilogue are code every program runs."""
    (start, end), _, _ = _tile_calls(text)
    call = text[start:end]
    assert LEFT_RANGE in call
    guarded = "    if HAS_LEFT:\n" + "".join("    " + line + "\n" for line in call.splitlines())
    return text[:start] + guarded + text[end:]


def one_loop(text):
    """One masked loop over the tile's keys instead of three ranges."""
    (start, _), _, (_, end) = _tile_calls(text)
    first = text[start:text.index("SOFTCAP, ALIBI)\n", start) + len("SOFTCAP, ALIBI)\n")]
    single = first.replace(LEFT_RANGE, "rows, offs_d, tl.maximum(kv_start, chunk_start), tl.minimum(kv_end, chunk_end),")
    return text[:start] + single + text[end:]


def plain_merge_loads(text):
    """The merge's loads through the L1 (the acquire already invalidated it) instead of ``.cg``."""
    anchor = 'offs_d, HEAD_DIM, ".cg")'
    assert text.count(anchor) == 1
    return text.replace(anchor, 'offs_d, HEAD_DIM, "")')


# The chunk's first two key blocks of K and V asked of the L2 before the lengths arrive (a
# contiguous cache; the loads wait for the lengths, which bound the keys).
PREFETCH_L2 = """
    if PAGE_SIZE == 0 and not HAS_BATCH_IDX and not HAS_LEFTPAD and not VARLEN_Q:
        _keys = split * chunk + tl.arange(0, 2 * BLOCK_N)
        _lines = tl.arange(0, 2) * 64
        _wanted = ((_keys < capacity)[:, None] & (_lines < HEAD_DIM)[None, :]).to(tl.int32)
        _k = (KCache + (batch.to(tl.int64) * stride_kb + _keys.to(tl.int64) * stride_kn
                        + kv_head.to(tl.int64) * stride_kh)[:, None] + _lines[None, :] * stride_kd)
        _v = (VCache + (batch.to(tl.int64) * stride_vb + _keys.to(tl.int64) * stride_vn
                        + kv_head.to(tl.int64) * stride_vh)[:, None] + _lines[None, :] * stride_vd)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p prefetch.global.L2 [$1]; @p prefetch.global.L2 [$2]; "
            "mov.u32 $0, 0; }", "=r,l,l,r", [_k, _v, _wanted], dtype=tl.int32, is_pure=False, pack=1)
"""


def prefetch_l2(text):
    anchor = "    tile = tl.program_id(2)\n    offs_d = tl.arange(0, BLOCK_D)\n"
    assert text.count(anchor) == 1
    return text.replace(anchor, anchor + PREFETCH_L2)


VARIANTS = {"shipped": None, "prefetch_l2": prefetch_l2, "one_loop": one_loop, "plain_merge_loads": plain_merge_loads,
            "unrolled4": merge_loop("tl.range(0, num_splits, loop_unroll_factor=4)"),
            "unrolled8": merge_loop("tl.range(0, num_splits, loop_unroll_factor=8)"),
            "two_phase4": merge_variant(TWO_PHASE, 4), "two_phase8": merge_variant(TWO_PHASE, 8),
            "no_left_loop": no_left_loop}
for _stages in (2, 3, 4):
    VARIANTS[f"one_loop_pipelined{_stages}"] = (
        lambda text, stages=_stages: merge_loop(f"tl.range(0, num_splits, num_stages={stages})")(one_loop(text)))
VARIANTS["one_loop_prefetch"] = lambda text: merge_variant(PREFETCH)(one_loop(text))
VARIANTS["one_loop_two_phase8"] = lambda text: merge_variant(TWO_PHASE, 8)(one_loop(text))


def variant_module(name, transform):
    """kvcache.py changed by ``transform`` (text to text), imported as its own module."""
    source_path = Path(fmha.__file__).parent / "backends" / "triton" / "kvcache.py"
    text = source_path.read_text()
    if transform is not None:
        text = transform(text)
    text = text.replace("\nfrom .", "\nfrom fmha.backends.triton.")
    folder = Path(tempfile.mkdtemp())
    (folder / f"kvcache_{name}.py").write_text(text)
    sys.path.insert(0, str(folder))
    return importlib.import_module(f"kvcache_{name}")


def make_sets(batch, length, copies, empty):
    sets = []
    for _ in range(copies):
        q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        k_cache, v_cache = (torch.randn(batch, length, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
                            for _ in range(2))
        lengths = torch.full((batch,), 0 if empty else length, dtype=torch.int32, device="cuda")
        sets.append((q, k_cache, v_cache, lengths))
    return sets


def time_variant(module, sets, splits, stages):
    q, k_cache, v_cache, lengths = sets[0]
    shipped = kvcache_ops.prepared("ab", q, k_cache, v_cache, None, None, None, None, lengths, None, None, None,
                                   None, False, (-1, -1), 0.0, False, None, 0)
    chosen = shipped.config
    forward = KVCacheForward(shipped.params, KVCacheConfig(chosen.block_m, chosen.block_n, chosen.num_warps,
                                                           stages or chosen.num_stages, splits or chosen.splits))
    forward.attend_launch.kernel = module.kvcache_attention_kernel

    def call(s):
        return forward(s[0], s[1], s[2], None, None, None, None, s[3], 0, None, None, None)
    expected = fmha.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    out = call(sets[0])[0]
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-2)
    return {"splits": forward.splits, "stages": forward.attend_launch.num_stages,
            "us": gpu_us(rotating([lambda s=s: call(s) for s in sets])),
            "max_diff_vs_shipped": float((out.float() - expected.float()).abs().max())}


def main():
    out_path = sys.argv[1]
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARIANTS)
    modules = {name: variant_module(name, VARIANTS[name]) for name in names}
    results = {"environment": environment(), "copy_tbps": copy_tbps(), "launch_us": launch_us(), "rows": []}
    cases = [("B1 Sk4096", 1, 4096, 16, False, [(0, 0), (16, 0), (32, 0)]),
             ("B1 Sk4096 empty", 1, 4096, 16, True, [(0, 0), (32, 0)]),
             ("B8 Sk2048", 8, 2048, 4, False, [(0, 0), (1, 0), (4, 0)]),
             ("B8 Sk2048 empty", 8, 2048, 4, True, [(0, 0)]),
             ("B32 Sk8192", 32, 8192, 2, False, [(0, 0)])]
    for label, batch, length, copies, empty, configs in cases:
        sets = make_sets(batch, length, copies, empty)
        kv_bytes = 0 if empty else 2 * batch * length * KV_HEADS * HEAD_DIM * 2
        for repeat in range(2):
            for name, module in modules.items():
                for splits, stages in configs:
                    row = {"case": label, "variant": name, "repeat": repeat, "kv_bytes": kv_bytes,
                           **time_variant(module, sets, splits, stages)}
                    results["rows"].append(row)
                    print(json.dumps(row), flush=True)
        del sets
        torch.cuda.empty_cache()
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
