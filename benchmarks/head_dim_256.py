"""The Gluon Hopper forward at head dim 256 (GPU, sm_90): correctness first, then speed.

Checks the D = 256 schedules against the float64 truth (the project's error rule) on odd shapes,
GQA, causal, bf16 and fp16, and the default path (``fmha.attention``) with Gemma 2's softcap and
window; then times, per case, the default path, each schedule, the portable kernel (heuristic
tiles), SDPA flash and SDPA cuDNN, forward, and forward+backward of the default path against
SDPA's. Cases: H = 2048 / D, B = 16384 / S as in the ``std`` suite, and Gemma 2's attention
(Hq 16, Hkv 8, softcap 50, window 4096). Writes JSON and prints one table per case.

    PYTHONPATH=src python benchmarks/head_dim_256.py --out d256.json [--skip-check] [--rounds 3]
"""

import argparse
import itertools
import json
import statistics

import torch

import fmha
from fmha.backends.gluon_sm90.backend import HopperBackend
from fmha.backends.gluon_sm90.launch import HopperForward
from fmha.backends.gluon_sm90.schedule import HopperSchedule
from fmha.backends.triton.config import heuristic_forward_config
from fmha.backends.triton.launch import PortableForward
from fmha.masking import Window
from fmha.params import attention_params
from fmha.testing import assert_close_to_reference, random_qkv, time_ms
from fmha.tools.bench.cases import Case
from fmha.tools.bench.metrics import visible_pairs
from fmha.tools.bench.peers import PEERS
from fmha.tools.bench.runner import environment

HEAD_DIM = 256
SCHEDULES = {
    "persistent packed P": HopperSchedule(block_n=64, pack_p=True),
    "persistent": HopperSchedule(block_n=64),
    "grid packed P": HopperSchedule(block_n=64, pack_p=True, persistent=False),
    "dynamic packed P": HopperSchedule(block_n=64, pack_p=True, dynamic=True),
}
CHECKED = {name: SCHEDULES[name] for name in ("persistent packed P", "dynamic packed P")}
# (label, batch, q_heads, kv_heads, seqlen, causal, keyword arguments of fmha.attention)
CASES = [(f"B{16384 // s} H8 S{s}{' causal' if c else ''}", 16384 // s, 8, 8, s, c, {})
         for s in (1024, 4096, 16384) for c in (False, True)]
CASES += [("Gemma 2: B1 H16/8 S8k causal, softcap 50, window 4096", 1, 16, 8, 8192, True,
           {"softcap": 50.0, "window": (4095, 0)}),
          ("B1 H16/8 S8k causal", 1, 16, 8, 8192, True, {})]


def check_schedules() -> int:
    shapes = [  # (batch, q_heads, kv_heads, Sq, Sk, layout)
        (2, 4, 2, 1, 1, "bhsd"), (2, 4, 4, 17, 17, "bshd"), (1, 8, 2, 1000, 1000, "bshd"),
        (1, 4, 1, 1000, 17, "bhsd"), (1, 4, 4, 17, 1000, "bshd"), (2, 2, 2, 300, 257, "bhsd"),
        (1, 2, 2, 4096, 4096, "bhsd"), (4, 16, 4, 777, 1500, "bshd")]
    failures = 0
    for (batch, hq, hkv, sq, sk, layout), causal, dtype, (name, schedule) in itertools.product(
            shapes, [False, True], [torch.bfloat16, torch.float16], CHECKED.items()):
        generator = torch.Generator(device="cuda").manual_seed(sq * 7 + sk)
        q, k, v = random_qkv(batch, hq, hkv, sq, sk, HEAD_DIM, dtype, device="cuda", layout=layout,
                             generator=generator)
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"), device="cuda")
        label = f"{name} {dtype} B{batch} H{hq}/{hkv} {sq}x{sk} {layout} causal={causal}"
        try:
            params = attention_params("head_dim_256", q, k, v, causal=causal)
            reason = HopperBackend().refusal(params, q, k, v)
            if reason is not None:
                raise RuntimeError(f"refused: {reason}")
            HopperForward(params, schedule)(q, k, v, out, lse)
            torch.cuda.synchronize()
            assert_close_to_reference(out, q, k, v, causal_offset=sk - sq if causal else None, lse=lse, atol=1e-5)
        except Exception as exc:  # noqa: BLE001 - every failure is reported and counted
            failures += 1
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    for softcap, window, causal in [(50.0, (4095, 0), True), (50.0, None, False), (None, (255, 0), True)]:
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v = random_qkv(1, 8, 4, 5000, 5000, HEAD_DIM, dtype, device="cuda", layout="bshd")
            label = f"default path {dtype} softcap={softcap} window={window} causal={causal}"
            try:
                out, lse = fmha.attention(q, k, v, causal=causal, softcap=softcap, window=window, return_lse=True)
                assert fmha.explain(q, k, v, causal=causal, softcap=softcap, window=window).backend == "gluon_sm90"
                left, right = window if window is not None else (None, None)
                scores = {} if softcap is None else {"softcap": softcap}
                assert_close_to_reference(out, q, k, v, window=Window.of(5000, 5000, left=left, right=0 if causal else right),
                                          lse=lse, atol=1e-5, **scores)
            except Exception as exc:  # noqa: BLE001
                failures += 1
                print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    print(f"correctness: {failures} failures", flush=True)
    return failures


def with_backward(forward, q, k, v):
    grad = torch.randn_like(q)

    def run():
        return torch.autograd.grad(forward(), (q, k, v), grad)
    return run


def timed_rows(runs: dict, flops: float, rounds: int) -> dict:
    """TFLOP/s of each run per round, the runs interleaved; a run named "... fwd+bwd" counts 3.5
    times the forward's FLOPs; a run that raises is reported by its error."""
    rows = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            if isinstance(rows[name], str):
                continue
            try:
                ms, _ = time_ms(run)
                rows[name].append((3.5 if name.endswith("fwd+bwd") else 1.0) * flops / ms / 1e9)
            except Exception as exc:  # noqa: BLE001 - a peer that refuses the shape is reported
                rows[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return rows


def report_rows(label: str, default: str, rows: dict) -> dict:
    """Print one case's table; its JSON record (medians, and the errors of runs that raised)."""
    print(f"\n{label}  (default: {default})", flush=True)
    for name, values in rows.items():
        text = values if isinstance(values, str) else (
            f"{statistics.median(values):6.1f} TFLOP/s  ({', '.join(f'{x:.1f}' for x in values)})")
        print(f"  {name:<28} {text}", flush=True)
    return {"case": label, "default": default,
            "tflops": {name: None if isinstance(values, str) else statistics.median(values)
                       for name, values in rows.items()},
            "errors": {name: values for name, values in rows.items() if isinstance(values, str)}}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="d256.json")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds, providers interleaved; the median is kept")
    args = parser.parse_args()
    payload = {"environment": environment(), "rows": []}
    if not args.skip_check:
        payload["correctness_failures"] = check_schedules()
    for label, batch, hq, hkv, seqlen, causal, extra in CASES:
        q, k, v = random_qkv(batch, hq, hkv, seqlen, seqlen, HEAD_DIM, torch.bfloat16, device="cuda", layout="bshd")
        left = extra.get("window", (None, None))[0]
        window = Window.of(seqlen, seqlen, left=left, right=0) if causal else None
        flops = 4 * batch * hq * HEAD_DIM * visible_pairs(seqlen, seqlen, window)
        params = attention_params("head_dim_256", q, k, v, causal=causal, **extra)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        runs = {"fmha": lambda: fmha.attention(q, k, v, causal=causal, **extra)}
        if not extra:
            case = Case(batch, hq, hkv, seqlen, seqlen, HEAD_DIM, causal=causal)
            runs["sdpa_flash"] = PEERS["sdpa_flash"].prepare(case, q, k, v).run
            runs["sdpa_cudnn"] = PEERS["sdpa_cudnn"].prepare(case, q, k, v).run
            config = heuristic_forward_config(HEAD_DIM, q.dtype, seqlen)
            portable = PortableForward(params, config)
            runs["portable"] = lambda: portable(q, k, v, out, lse)
            for name, schedule in SCHEDULES.items():
                forward = HopperForward(params, schedule)
                runs[name] = lambda forward=forward: forward(q, k, v, out, lse)
        q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
        training = {f"{name} fwd+bwd": with_backward(runs[name], q, k, v)
                    for name in ("fmha", "sdpa_flash", "sdpa_cudnn") if name in runs}
        explanation = fmha.explain(q, k, v, causal=causal, **extra)
        record = report_rows(label, f"{explanation.backend} {explanation.config}",
                             timed_rows({**runs, **training}, flops, args.rounds))
        payload["rows"].append({**record, "batch": batch, "q_heads": hq, "kv_heads": hkv, "seqlen": seqlen,
                                "causal": causal, "extra": {key: str(value) for key, value in extra.items()}})
        del q, k, v
        with open(args.out, "w") as handle:
            json.dump(payload, handle, indent=1)


if __name__ == "__main__":
    main()
