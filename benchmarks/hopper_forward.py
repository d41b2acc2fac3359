"""The Gluon Hopper forward (fmha.backends.gluon_sm90): correctness first, then speed (GPU, sm_90).

Checks a set of ``HopperSchedule`` variants against the float64 truth with the project's error
rule on odd shapes, then times the schedules that matter at each case's head dim and causality
beside the portable Triton kernel (heuristic tiles), SDPA flash and SDPA cuDNN on every seeds
and std case. Writes JSON rows and prints one table per case.

    PYTHONPATH=src python benchmarks/hopper_forward.py --out hopper.json [--skip-check] [--rounds 3]
        [--case B,H,S,D[,causal]] [--only "S1024 D64"]
"""

import argparse
import dataclasses
import itertools
import json
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention
from triton.tools.disasm import get_sass

from fmha.backends.gluon_sm90.backend import HopperBackend
from fmha.backends.gluon_sm90.launch import HopperForward
from fmha.backends.gluon_sm90.schedule import HopperSchedule
from fmha.backends.triton.config import heuristic_forward_config
from fmha.backends.triton.launch import PortableForward
from fmha.params import attention_params
from fmha.testing import assert_close_to_reference, random_qkv, time_ms
from fmha.tools.bench import cases, metrics
from fmha.tools.bench.runner import environment, make_inputs


def hopper_forward(params, schedule, q, k, v) -> HopperForward:
    """The Gluon forward for this call and schedule (compiled here); raises if the backend refuses the call."""
    reason = HopperBackend().refusal(params, q, k, v)
    if reason is not None:
        raise RuntimeError(f"the Hopper backend refuses this call: {reason}")
    return HopperForward(params, schedule)


def check_correctness(variants):
    shapes = [  # (batch, q_heads, kv_heads, Sq, Sk, D, layout)
        (2, 4, 2, 1, 1, 64, "bhsd"), (2, 4, 4, 17, 17, 128, "bhsd"), (1, 8, 2, 1000, 1000, 64, "bshd"),
        (1, 4, 1, 1000, 17, 128, "bhsd"), (1, 4, 4, 17, 1000, 128, "bshd"), (2, 2, 2, 300, 257, 64, "bhsd"),
        (1, 2, 2, 4096, 4096, 128, "bhsd"), (1, 4, 2, 129, 4096, 64, "bhsd"),
        # more tiles than multiprocessors: persistent programs walk several tiles
        (8, 16, 4, 1000, 1000, 64, "bshd"), (4, 16, 16, 777, 1500, 128, "bhsd"),
    ]
    failures = 0
    for (batch, hq, hkv, sq, sk, d, layout), causal, dtype, (name, schedule) in itertools.product(
            shapes, [False, True], [torch.bfloat16, torch.float16], variants):
        if not fits(schedule, d):
            continue
        generator = torch.Generator(device="cuda").manual_seed(sq * 7 + sk)
        q, k, v = random_qkv(batch, hq, hkv, sq, sk, d, dtype, device="cuda", layout=layout, generator=generator)
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"), device="cuda")
        offset = sk - sq if causal else None
        label = f"{name} {dtype} B{batch} H{hq}/{hkv} {sq}x{sk} D{d} {layout} causal={causal}"
        try:
            params = attention_params("hopper_forward", q, k, v, causal=causal)
            hopper_forward(params, schedule, q, k, v)(q, k, v, out, lse)
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
    """(name, HopperSchedule): the shipped rules' choices for the std cases, then the alternatives."""
    if head_dim == 128:
        default = [("grid", HopperSchedule(persistent=False)),
                   ("persistent paired q2", HopperSchedule(q_buffers=2))] \
            if causal else [("persistent", HopperSchedule()), ("persistent q2", HopperSchedule(q_buffers=2))]
        return default + [
            ("1c n64 2 CTAs q2", HopperSchedule(consumers=1, block_n=64, q_buffers=2, ctas_per_sm=2)),
            ("1c n64 2 CTAs q1", HopperSchedule(consumers=1, block_n=64, ctas_per_sm=2)),
            ("1c n64 2 CTAs grid", HopperSchedule(consumers=1, block_n=64, ctas_per_sm=2, persistent=False))]
    if causal:
        short = dict(consumers=1, block_n=64, ctas_per_sm=3)
        return [
            ("persistent paired q2", HopperSchedule(q_buffers=2, emulated_exp2=8)),
            ("1c n64 3 CTAs", HopperSchedule(**short, q_buffers=2, emulated_exp2=8)),
            ("1c n64 3 CTAs no FMA exp2", HopperSchedule(**short, q_buffers=2)),
            ("1c n64 3 CTAs q1", HopperSchedule(**short, emulated_exp2=8)),
            ("1c n64 3 CTAs grid", HopperSchedule(**short, persistent=False, emulated_exp2=8)),
            ("1c n128 2 CTAs", HopperSchedule(consumers=1, q_buffers=2, ctas_per_sm=2, emulated_exp2=8))]
    return [
        ("emulated exp2 1/8 q2", HopperSchedule(q_buffers=2, emulated_exp2=8)),
        ("1c n128 2 CTAs", HopperSchedule(consumers=1, q_buffers=2, ctas_per_sm=2, emulated_exp2=8)),
        ("1c n64 3 CTAs s3", HopperSchedule(consumers=1, block_n=64, stages=3, q_buffers=2, ctas_per_sm=3,
                                            emulated_exp2=8))]


CHECKED_VARIANTS = [
    ("persistent q2", HopperSchedule(q_buffers=2)),
    ("persistent q2 exp2", HopperSchedule(q_buffers=2, emulated_exp2=8)),
    ("grid", HopperSchedule(persistent=False)),
    ("3 consumers", HopperSchedule(consumers=3, block_n=64, stages=3)),
    ("1 consumer n128 2 CTAs", HopperSchedule(consumers=1, q_buffers=2, ctas_per_sm=2, emulated_exp2=8)),
    ("1 consumer n64 2 CTAs", HopperSchedule(consumers=1, block_n=64, q_buffers=2, ctas_per_sm=2)),
    ("1 consumer n64 3 CTAs", HopperSchedule(consumers=1, block_n=64, stages=3, q_buffers=2, ctas_per_sm=3,
                                             emulated_exp2=8)),
]


def fits(schedule, head_dim):
    """Whether the registers and shared memory allow this schedule at this head dim."""
    if head_dim == 64:
        return True
    return schedule.consumers == 2 and schedule.ctas_per_sm == 1 or (
        schedule.consumers == 1 and schedule.block_n == 64 and schedule.ctas_per_sm == 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        params = attention_params("hopper_forward", q, k, v, causal=case.causal)
        out = torch.full_like(q, float("nan"))
        lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        peers = {"sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, case.causal),
                 "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, case.causal)}
        expected = peers["sdpa_flash"]().float()
        # Kernels are built (and compiled) inside the timing loop's error handling: (name, schedule, build).
        config = heuristic_forward_config(case.head_dim, q.dtype, case.seqlen_q)
        kernels = [("triton", None, lambda: PortableForward(params, config))]
        kernels += [(name, schedule, lambda schedule=schedule: hopper_forward(params, schedule, q, k, v))
                    for name, schedule in variants_for(case.head_dim, case.causal)]
        rows, runs = [], []
        for name, run in peers.items():
            rows.append({"variant": name, "tflops_rounds": []})
            runs.append(run)
        for name, schedule, build in kernels:
            row = {"variant": name}
            if schedule is not None:
                row["schedule"] = dataclasses.asdict(schedule)
            run = None
            try:
                out.fill_(float("nan"))
                started = time.perf_counter()
                forward = build()
                compiled = forward(q, k, v, out, lse)
                torch.cuda.synchronize()
                row["compile_s"] = time.perf_counter() - started
                error = ((out.float() - expected).norm() / expected.norm()).item()
                row["error_vs_flash"] = error
                if not error < 1e-2:
                    raise AssertionError(f"relative error {error:.2e} against SDPA flash")
                if case.seqlen_q == 4096 and compiled is not None:
                    sass = get_sass(compiled.asm["cubin"])
                    row["sass"] = {op: sass.count(op) for op in ("HGMMA", "UTMALDG", "LDL", "STL", "MUFU.EX2")}
                row["tflops_rounds"] = []
                run = lambda forward=forward: forward(q, k, v, out, lse)  # noqa: E731
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            runs.append(run)
        for _ in range(args.rounds):  # variants interleaved within each round
            for row, run in zip(rows, runs):
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
