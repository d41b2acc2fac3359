"""The Gluon Hopper forward (fmha.kernels.forward_hopper): correctness first, then speed (GPU).

Checks the kernel against the float64 truth with the project's error rule on odd shapes, then
times its tile variants beside the portable Triton kernel, SDPA flash and SDPA cuDNN on every
seeds and std case. Writes JSON rows and prints one table per case.

    PYTHONPATH=src python benchmarks/hopper_forward.py --out hopper.json
"""

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention
from triton.tools.disasm import get_sass

from fmha.tools.bench import cases, metrics
from fmha.tools.bench.runner import environment, make_inputs, time_ms
from fmha.config import heuristic_forward_config
from fmha.launch import default_scale, launch_forward, launch_forward_hopper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.helpers import assert_close_to_reference, random_qkv  # noqa: E402


def check_correctness(variants):
    shapes = [  # (batch, q_heads, kv_heads, Sq, Sk, D, layout)
        (2, 4, 2, 1, 1, 64, "bhsd"), (2, 4, 4, 17, 17, 128, "bhsd"), (1, 8, 2, 1000, 1000, 64, "bshd"),
        (1, 4, 1, 1000, 17, 128, "bhsd"), (1, 4, 4, 17, 1000, 128, "bshd"), (2, 2, 2, 300, 257, 64, "bhsd"),
        (1, 2, 2, 4096, 4096, 128, "bhsd"), (1, 4, 2, 129, 4096, 64, "bhsd"),
        # more tiles than multiprocessors: persistent programs walk several tiles
        (8, 16, 4, 1000, 1000, 64, "bshd"), (4, 16, 16, 777, 1500, 128, "bhsd"),
    ]
    failures = 0
    for (batch, hq, hkv, sq, sk, d, layout), causal, dtype, (name, options) in itertools.product(
            shapes, [False, True], [torch.bfloat16, torch.float16], variants):
        if not fits(options, d):
            continue
        generator = torch.Generator(device="cuda").manual_seed(sq * 7 + sk)
        q, k, v = random_qkv(batch, hq, hkv, sq, sk, d, dtype, device="cuda", layout=layout, generator=generator)
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"), device="cuda")
        offset = sk - sq if causal else None
        label = f"{name} {dtype} B{batch} H{hq}/{hkv} {sq}x{sk} D{d} {layout} causal={causal}"
        try:
            launch_forward_hopper(q, k, v, out, lse, causal_offset=offset, scale=default_scale(d), **options)
            torch.cuda.synchronize()
            assert_close_to_reference(out, q, k, v, causal_offset=offset, lse=lse, atol=1e-5)
        except Exception as exc:
            failures += 1
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    print(f"correctness: {failures} failures", flush=True)
    return failures


def sdpa(backend, q, k, v, causal):
    def run():
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return run


def variants_for(head_dim, causal):
    """(name, launch_forward_hopper options): the default path's choices, then the alternatives."""
    if head_dim == 128:
        default = [("grid", {"persistent": False}), ("persistent paired q2", {"persistent": True, "q_buffers": 2})] \
            if causal else [("persistent", {"persistent": True}), ("persistent q2", {"persistent": True, "q_buffers": 2})]
        return default + [
            ("1c n64 2 CTAs q2", {"consumers": 1, "block_n": 64, "q_buffers": 2, "ctas_per_sm": 2}),
            ("1c n64 2 CTAs q1", {"consumers": 1, "block_n": 64, "ctas_per_sm": 2}),
            ("1c n64 2 CTAs grid", {"consumers": 1, "block_n": 64, "ctas_per_sm": 2, "persistent": False})]
    emulated = {"emulated_exp2": 8}
    if causal:
        short = {"consumers": 1, "block_n": 64, "ctas_per_sm": 3}
        return [
            ("persistent paired q2", {"q_buffers": 2, **emulated}),
            ("1c n64 3 CTAs", {**short, "q_buffers": 2, **emulated}),
            ("1c n64 3 CTAs no FMA exp2", {**short, "q_buffers": 2}),
            ("1c n64 3 CTAs q1", {**short, **emulated}),
            ("1c n64 3 CTAs grid", {**short, "persistent": False, **emulated}),
            ("1c n128 2 CTAs", {"consumers": 1, "q_buffers": 2, "ctas_per_sm": 2, **emulated})]
    return [
        ("emulated exp2 1/8 q2", {"q_buffers": 2, **emulated}),
        ("1c n128 2 CTAs", {"consumers": 1, "q_buffers": 2, "ctas_per_sm": 2, **emulated}),
        ("1c n64 3 CTAs s3", {"consumers": 1, "block_n": 64, "stages": 3, "q_buffers": 2, "ctas_per_sm": 3,
                              **emulated})]


CHECKED_VARIANTS = [
    ("persistent q2", {"persistent": True, "q_buffers": 2}),
    ("persistent q2 exp2", {"persistent": True, "q_buffers": 2, "emulated_exp2": 8}),
    ("grid", {"persistent": False}),
    ("3 consumers", {"persistent": True, "consumers": 3, "block_n": 64, "stages": 3}),
    ("1 consumer n128 2 CTAs", {"consumers": 1, "q_buffers": 2, "ctas_per_sm": 2, "emulated_exp2": 8}),
    ("1 consumer n64 2 CTAs", {"consumers": 1, "block_n": 64, "q_buffers": 2, "ctas_per_sm": 2}),
    ("1 consumer n64 3 CTAs", {"consumers": 1, "block_n": 64, "stages": 3, "q_buffers": 2, "ctas_per_sm": 3,
                               "emulated_exp2": 8}),
]


def fits(options, head_dim):
    """Whether the registers and shared memory allow these options at this head dim."""
    if head_dim == 64:
        return True
    return options.get("consumers", 2) == 2 and options.get("ctas_per_sm", 1) == 1 or (
        options.get("consumers") == 1 and options.get("block_n") == 64 and options.get("ctas_per_sm") == 2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="hopper.json")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--rounds", type=int, default=1, help="timing rounds, variants interleaved; the median is kept")
    parser.add_argument("--case", action="append", default=[], metavar="B,H,S,D[,causal]",
                        help="time this shape too (bf16, Sk = Sq)")
    parser.add_argument("--only", nargs="*", default=[""], help="time only the cases whose label contains one of these")
    args = parser.parse_args()
    payload = {"environment": environment(), "rows": []}
    if not args.skip_check:
        payload["correctness_failures"] = check_correctness(CHECKED_VARIANTS)
    extra = [cases.Case(int(b), int(h), int(h), int(sq), int(sq), int(d), causal=bool(rest))
             for b, h, sq, d, *rest in (spec.split(",") for spec in args.case)]
    for case in cases.seeds() + cases.std() + extra:
        if not any(part in case.label for part in args.only):
            continue
        q, k, v = make_inputs(case, torch.bfloat16)
        offset = case.seqlen_k - case.seqlen_q if case.causal else None
        scale = default_scale(case.head_dim)
        runs = {"sdpa_flash": (sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, case.causal), None),
                "sdpa_cudnn": (sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, case.causal), None)}
        expected = runs["sdpa_flash"][0]().float()
        out = torch.full_like(q, float("nan"))
        lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        config = heuristic_forward_config(case.head_dim, q.dtype, case.seqlen_q)
        runs["triton"] = (lambda: launch_forward(q, k, v, out, lse, causal_offset=offset, scale=scale,
                                                 config=config), out)
        for name, options in variants_for(case.head_dim, case.causal):
            runs[name] = (lambda options=options: launch_forward_hopper(
                q, k, v, out, lse, causal_offset=offset, scale=scale, **options), out)
        rows = []
        for name, (run, output) in runs.items():
            row = {"variant": name}
            try:
                if output is not None:
                    output.fill_(float("nan"))
                    started = time.perf_counter()
                    compiled = run()
                    torch.cuda.synchronize()
                    row["compile_s"] = time.perf_counter() - started
                    error = ((output.float() - expected).norm() / expected.norm()).item()
                    row["error_vs_flash"] = error
                    if not error < 1e-2:
                        raise AssertionError(f"relative error {error:.2e} against SDPA flash")
                    if case.seqlen_q == 4096 and compiled is not None:
                        sass = get_sass(compiled.asm["cubin"])
                        row["sass"] = {op: sass.count(op) for op in ("HGMMA", "UTMALDG", "LDL", "STL", "MUFU.EX2")}
                row["tflops_rounds"] = []
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
        for _ in range(args.rounds):  # variants interleaved within each round
            for row, (run, _output) in zip(rows, runs.values()):
                if "error" not in row:
                    row["ms"], row["method"] = time_ms(run)
                    row["tflops_rounds"].append(metrics.tflops(case, row["ms"]))
        for row in rows:
            if row.get("tflops_rounds"):
                row["tflops"] = statistics.median(row["tflops_rounds"])
        cudnn = rows[1].get("tflops", float("nan"))
        print(f"\n{case.label}  (flash {rows[0].get('tflops', 0):.0f}, cuDNN {cudnn:.0f} TFLOP/s)", flush=True)
        for row in rows[2:]:
            if "tflops" in row:
                print(f"  {row['variant']:<24} {row['tflops']:6.0f}  {row['tflops'] / cudnn:5.2f}x cuDNN", flush=True)
            else:
                print(f"  {row['variant']:<24} {row.get('error')}", flush=True)
        payload["rows"] += [{"case": case.to_dict(), "label": case.label, **row} for row in rows]
        del q, k, v
        with open(args.out, "w") as handle:  # after every case: a run cut short keeps what it measured
            json.dump(payload, handle, indent=1)


if __name__ == "__main__":
    main()
