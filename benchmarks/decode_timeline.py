"""Where a small decode's time goes inside the KV-cache kernel (GPU): a timeline per program.

The inference issue bounds the small decode cases (B1 H32/8 Sk4096 D128, B8 H32/8 Sk2048 D128)
by the copy floor plus one launch. This script builds an instrumented copy of
``fmha/backends/triton/kvcache.py``'s kernel (the same source, with reads of ``%globaltimer`` and
``%clock64`` added; each read waits for a value of the step before it) and records, per program,
when it started, when its lengths arrived, when its keys were done, when its arrival was counted
and, for the last chunk of a tile, when the merge was done. The timer buffer is passed as the
``Sinks`` pointer, which these calls (no sinks) do not read.

    PYTHONPATH=src python benchmarks/decode_timeline.py out.json [variant,...] [--cases B:Sk:block_n:warps:stages:splits,...]

Variants are ``benchmarks/decode_merge_ab.py``'s (default: the tree's kernel). Cases: B1 Sk4096 at the heuristic's chunks and at 32, B8 Sk2048, each also with every
length 0. The timer reads come every 256 ns (``%globaltimer``); the per-step cycle counts
(``%clock64``, one multiprocessor each) are exact.
"""

import importlib
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_merge_ab import VARIANTS, make_sets  # noqa: E402
from kvcache import copy_tbps, gpu_us, launch_us, rotating  # noqa: E402

import fmha  # noqa: E402
from fmha import kvcache_ops  # noqa: E402
from fmha.backends.triton.config import KVCacheConfig  # noqa: E402
from fmha.tools.bench.runner import environment  # noqa: E402

SLOTS = 16  # per program: 5 global times, 5 clocks, the multiprocessor
L2_BYTES = 50 * 2**20

CLOCKS = '''

@triton.jit
def _clock(dep):
    """(%globaltimer, %clock64, %smid) once ``dep`` (an int32 scalar) is available."""
    d = dep + tl.zeros([1], tl.int32)
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [d], dtype=tl.int64, is_pure=False, pack=1)
    c = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [d], dtype=tl.int64, is_pure=False, pack=1)
    s = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [d], dtype=tl.int32, is_pure=False, pack=1)
    return t, c, s

'''

def instrumented_module(name="shipped", transform=None):
    """The KV-cache kernel module (changed by ``transform``, text to text) with timer reads, imported."""
    source_path = Path(fmha.__file__).parent / "backends" / "triton" / "kvcache.py"
    text = source_path.read_text()
    if transform is not None:
        text = transform(text)

    def insert_after(anchor, addition):
        nonlocal text
        at = text.index(anchor) + len(anchor)
        assert text.count(anchor) == 1, anchor
        text = text[:at] + addition + text[at:]

    def insert_before(anchor, addition):
        nonlocal text
        assert text.count(anchor) == 1, anchor
        at = text.index(anchor)
        text = text[:at] + addition + text[at:]

    insert_before("@triton.jit\ndef _rotate(", CLOCKS)
    insert_after("    tile = tl.program_id(2)\n", "    _t0, _c0, _sm = _clock(tile)\n")
    insert_after("HAS_SEQLENS, HAS_BATCH_IDX, VARLEN_Q)\n", "    _t1, _c1, _ = _clock(end)\n")
    insert_before("    if SINKS and not SPLIT:  # split keys: after the merge\n",
                  "    _t2, _c2, _ = _clock(tl.max(lse, 0).to(tl.int32, bitcast=True))\n")
    insert_after('        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")\n',
                 "        _t3, _c3, _ = _clock(arrived)\n        _t4 = _t3 * 0\n        _c4 = _c3 * 0\n")
    insert_after("            tl.store(Lse + merge_index, merged_lse, mask=merge_in_range)\n",
                 "            _t4, _c4, _ = _clock(tl.max(merged_lse, 0).to(tl.int32, bitcast=True))\n")
    insert_before("    else:\n        tl.store(o_rows[:, None] + offs_d[None, :] * stride_od, out.to(Out.dtype.element_ty), "
                  "mask=q_mask)\n",
                  "        _program = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tile\n"
                  "        _slot = Sinks + _program * 16 + tl.arange(0, 1)\n"
                  "        tl.store(_slot + 0, _t0)\n        tl.store(_slot + 1, _t1)\n        tl.store(_slot + 2, _t2)\n"
                  "        tl.store(_slot + 3, _t3)\n        tl.store(_slot + 4, _t4)\n"
                  "        tl.store(_slot + 5, _c0)\n        tl.store(_slot + 6, _c1)\n        tl.store(_slot + 7, _c2)\n"
                  "        tl.store(_slot + 8, _c3)\n        tl.store(_slot + 9, _c4)\n"
                  "        tl.store(_slot + 10, _sm.to(tl.int64))\n")
    text = text.replace("\nfrom .", "\nfrom fmha.backends.triton.")
    folder = Path(tempfile.mkdtemp())
    (folder / f"kvcache_timeline_{name}.py").write_text(text)
    sys.path.insert(0, str(folder))
    return importlib.import_module(f"kvcache_timeline_{name}")


def flush_l2(buffer):
    buffer.zero_()
    torch.cuda.synchronize()


def summarise(times):
    """Quantiles (µs) of the steps of every program, relative to the first program's start."""
    t = times.double()
    origin = t[:, 0].min()
    starts = (t[:, 0] - origin) / 1e3
    steps = {"start": starts, "lengths": (t[:, 1] - t[:, 0]) / 1e3, "keys": (t[:, 2] - t[:, 1]) / 1e3,
             "count": (t[:, 3] - t[:, 2]) / 1e3}
    merging = t[:, 4] > 0
    steps["merge"] = (t[merging, 4] - t[merging, 3]) / 1e3
    steps["keys_done"] = (t[:, 2] - origin) / 1e3
    result = {name: {q: float(values.quantile(q)) for q in (0.0, 0.5, 0.9, 1.0)} for name, values in steps.items()}
    end = torch.where(merging, t[:, 4], t[:, 3])
    result["span_us"] = float((end.max() - origin) / 1e3)
    result["programs"] = int(t.shape[0])
    result["multiprocessors_used"] = int(times[:, 10].unique().numel())
    # clock64 cycles of the same steps (one multiprocessor each: exact), medians
    result["cycles"] = {"lengths": float((t[:, 6] - t[:, 5]).median()), "keys": float((t[:, 7] - t[:, 6]).median()),
                        "count": float((t[:, 8] - t[:, 7]).median()),
                        "merge": float((t[merging, 9] - t[merging, 8]).median()) if merging.any() else None}
    return result


def case(module, batch, length, copies, empty=False, splits=0, tiles=None):
    """Shipped kernel time, instrumented kernel time, and the instrumented timeline (median of 5 cold calls)."""
    sets = make_sets(batch, length, copies, empty)
    shipped = gpu_us(rotating([lambda s=s: fmha.flash_attn_with_kvcache(s[0], s[1], s[2], cache_seqlens=s[3])
                               for s in sets]))
    q, k_cache, v_cache, lengths = sets[0]
    forward = kvcache_ops.prepared("timeline", q, k_cache, v_cache, None, None, None, None, lengths, None, None, None,
                                   None, False, (-1, -1), 0.0, False, None, 0)
    config = forward.config
    if splits or tiles:  # tiles: (block_n, warps, stages)
        block_n, warps, stages = tiles or (config.block_n, config.num_warps, config.num_stages)
        config = KVCacheConfig(config.block_m, block_n, warps, stages, splits or config.splits, config.one_range)
    instrumented = type(forward)(forward.params, config)  # a fresh copy, not the shared one
    instrumented.attend_launch.kernel = module.kvcache_attention_kernel
    grid = instrumented.attend_launch.grid
    programs = grid[0] * grid[1] * grid[2]
    times = torch.zeros(programs, SLOTS, dtype=torch.int64, device="cuda")

    def call(s):
        return instrumented(s[0], s[1], s[2], None, None, None, None, s[3], 0, None, None, None, None, times)
    reference = fmha.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    torch.testing.assert_close(call(sets[0])[0], reference, rtol=0, atol=2e-2)
    instrumented_us = gpu_us(rotating([lambda s=s: call(s) for s in sets]))
    flush = torch.empty(2 * L2_BYTES, dtype=torch.uint8, device="cuda")
    timelines = []
    for index in range(5):
        flush_l2(flush)
        call(sets[index % copies])
        torch.cuda.synchronize()
        timelines.append(summarise(times.cpu()))
    return {"batch": batch, "length": length, "empty": empty, "grid": list(grid),
            "config": config.text(), "shipped_us": shipped, "instrumented_us": instrumented_us,
            "timelines": timelines}


def main():
    out_path = sys.argv[1]
    names = sys.argv[2].split(",") if len(sys.argv) > 2 and not sys.argv[2].startswith("--") else ["shipped"]
    cases = [(1, 4096, 16, 0, None), (1, 4096, 16, 32, None), (8, 2048, 4, 0, None)]
    if "--cases" in sys.argv:  # batch:length:block_n:warps:stages:splits, comma-separated
        cases = []
        for spec in sys.argv[sys.argv.index("--cases") + 1].split(","):
            batch, length, block_n, warps, stages, splits = (int(x) for x in spec.split(":"))
            cases.append((batch, length, max(2, -(-3 * L2_BYTES // (4 * batch * length * 8 * 128))), splits,
                          (block_n, warps, stages)))
    results = {"environment": environment(), "copy_tbps": copy_tbps(), "launch_us": launch_us(), "cases": []}
    for name in names:
        module = instrumented_module(name, VARIANTS[name])
        for batch, length, copies, splits, tiles in cases:
            for empty in (False, True):
                row = case(module, batch, length, copies, empty, splits, tiles)
                row["variant"] = name
                results["cases"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "timelines"}), flush=True)
                print(json.dumps(row["timelines"][2]), flush=True)
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
