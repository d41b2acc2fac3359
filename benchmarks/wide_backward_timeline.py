"""Where a program of the 256-wide backward spends its time (GPU, sm_90): a timeline per program.

Builds an instrumented copy of ``fmha/backends/gluon_sm90/backward_wide.py`` (the same source, with
reads of ``%globaltimer`` by consumer 0 at its tile's start, once K and V have landed, after its
first query step, after its last, and once dK and dV are stored) and runs one backward of each
case. The times go to a buffer passed as the ALiBi slopes' pointer, which calls without ALiBi do
not read. Per multiprocessor the programs run one after another; the gap between one program's
end and the next one's start is the launch's share.

    PYTHONPATH=src python benchmarks/wide_backward_timeline.py out.json --shapes 16,8,1024,256 4,8,4096,256
"""

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

import fmha
from fmha.backends.gluon_sm90 import backward_launch

SLOTS = 8  # per program: start, K/V landed, first step done, steps done, stores done, multiprocessor

STAMP = '''

@gluon.jit
def _stamp(buffer, slot, dep):
    """%globaltimer (and %smid at slot + 4) into the program's slots once ``dep`` is available."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    d = gl.full([1], 0, gl.int32, layout) + dep
    t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [d], dtype=gl.int64, is_pure=False, pack=1)
    base = buffer.to(gl.pointer_type(gl.int64), bitcast=True) + gl.program_id(0).to(gl.int64) * 8 + slot
    gl.store(base + gl.arange(0, 1, layout), t)
    if slot == 0:
        s = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [d], dtype=gl.int32, is_pure=False, pack=1)
        gl.store(base + 5 + gl.arange(0, 1, layout), s.to(gl.int64))

'''


def instrumented_module():
    path = Path(backward_launch.__file__).parent / "backward_wide.py"
    text = path.read_text()

    def replace(old, new):
        nonlocal text
        assert text.count(old) == 1, old
        text = text.replace(old, new)

    replace("WIDE_KEYS = gl.constexpr(64)", STAMP + "WIDE_KEYS = gl.constexpr(64)")
    # the tile's start and K/V's arrival (consumer 0)
    replace("    mbarrier.wait(kv_ready, 0)\n    for member in range(group_size):",
            "    if CONSUMER == 0:\n        _stamp(score_args[0], 0, first_key)\n"
            "    mbarrier.wait(kv_ready, 0)\n"
            "    if CONSUMER == 0:\n        _stamp(score_args[0], 1, first_key)\n"
            "    for member in range(group_size):")
    # the end of the program's first query step
    replace("        _add_dq_tile(dq_t, own_dq, dq_desc, [batch, head, q_start + m, DQ_LAST])\n    return dk, dv",
            "        _add_dq_tile(dq_t, own_dq, dq_desc, [batch, head, q_start + m, DQ_LAST])\n"
            "        if CONSUMER == 0:\n            if position == 0:\n"
            "                _stamp(mods[7], 2, m)\n    return dk, dv")
    replace("        mods = (softcap_scale, slope, seqlen_k - seqlen_q, keys.to(gl.float32), mask_base, mask_columns, stride_mm)",
            "        mods = (softcap_scale, slope, seqlen_k - seqlen_q, keys.to(gl.float32), mask_base, mask_columns, stride_mm,\n"
            "                AlibiSlopes)")
    replace("    if DROPOUT:  # P·dO summed the kept probabilities\n        dv = dv * dropout_scale",
            "    if CONSUMER == 0:\n        _stamp(AlibiSlopes, 3, first_key)\n"
            "    if DROPOUT:  # P·dO summed the kept probabilities\n        dv = dv * dropout_scale")
    stores = ("    _store_block(dv.to(dtype), staging, dv_base, dv_strides[2], k_start, first_key, seqlen_k,\n"
              "                 CONSUMER * HALF_COLUMNS, head_dim)\n")
    replace(stores, stores + "    if CONSUMER == 0:\n        cta_barrier()\n        _stamp(AlibiSlopes, 4, first_key)\n")
    handle = tempfile.NamedTemporaryFile("w", suffix="_backward_wide.py", delete=False)
    handle.write(text)
    handle.close()
    name = "fmha.backends.gluon_sm90.backward_wide"
    spec = importlib.util.spec_from_file_location(name, handle.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--shapes", nargs="+", default=["16,8,1024,256", "4,8,4096,256"], help="B,H,S,D[,causal]")
    args = parser.parse_args()
    instrumented_module()
    results = []
    for text in args.shapes:
        parts = text.split(",")
        batch, heads, seqlen, head_dim = map(int, parts[:4])
        causal = parts[4:] == ["causal"]
        programs = -(-seqlen // 64) * batch * heads
        buffer = torch.zeros(programs * SLOTS, dtype=torch.int64, device="cuda")
        original = backward_launch.score_arguments
        backward_launch.score_arguments = lambda scores, placeholder: (buffer, placeholder, (0, 0, 0))
        try:
            q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            out = fmha.attention(q, k, v, causal=causal)
            grad = torch.randn_like(out)
            for _ in range(3):  # the last run's times stay
                torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
            torch.cuda.synchronize()
        finally:
            backward_launch.score_arguments = original
        stamps = buffer.view(programs, SLOTS).cpu().tolist()
        start = min(row[0] for row in stamps)
        by_sm = {}
        for row in stamps:
            by_sm.setdefault(row[5], []).append(row)
        gaps = []
        for rows in by_sm.values():
            rows.sort(key=lambda row: row[0])
            gaps += [b[0] - a[4] for a, b in zip(rows, rows[1:])]

        def median(values):
            return round(statistics.median(values) / 1000, 2)

        summary = {"shape": text, "programs": programs, "multiprocessors": len(by_sm),
                   "kernel_us": round((max(row[4] for row in stamps) - start) / 1000, 1),
                   "median_us": {"K/V wait": median([r[1] - r[0] for r in stamps]),
                                 "first step": median([r[2] - r[1] for r in stamps]),
                                 "other steps": median([r[3] - r[2] for r in stamps]),
                                 "dK/dV stores": median([r[4] - r[3] for r in stamps]),
                                 "program": median([r[4] - r[0] for r in stamps]),
                                 "gap to the next program": median(gaps)},
                   "first_programs_start_spread_us": round((sorted(r[0] for r in stamps)[131] - start) / 1000, 2)}
        results.append(summary)
        print(json.dumps(summary), flush=True)
    with open(args.out, "w") as handle:
        json.dump({"device": torch.cuda.get_device_name(), "rows": results}, handle, indent=1)


if __name__ == "__main__":
    main()
