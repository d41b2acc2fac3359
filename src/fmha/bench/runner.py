"""Time providers over cases; print a table; write results JSON."""

from __future__ import annotations

import datetime
import json
import math
import platform
from pathlib import Path

import torch
import triton
import triton.testing

import fmha
from fmha.reference import dense_attention

from . import metrics
from .cases import Case
from .peers import PEERS, PeerUnavailable

# Below this, host-side launch time can show up in stream timing (the GPU waits for
# the CPU): replay a CUDA graph instead, which measures the GPU alone.
CUDA_GRAPH_THRESHOLD_MS = 0.2
# Heads checked against the float64 reference (a (1, 2, Sq, Sk) float64 score matrix).
CHECK_HEADS = 2


def environment() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "fmha": fmha.__version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    sm_count=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
        try:
            import subprocess
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    return info


def make_inputs(case: Case, dtype: torch.dtype, device="cuda", seed: int = 0):
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(heads, seqlen):
        return torch.randn(case.batch, heads, seqlen, case.head_dim, device=device, dtype=dtype,
                           generator=generator)

    return randn(case.q_heads, case.seqlen_q), randn(case.kv_heads, case.seqlen_k), randn(case.kv_heads, case.seqlen_k)


def check_output(case: Case, q, k, v, out) -> float:
    """Relative L2 error of the first heads of batch 0 against float64."""
    heads = min(CHECK_HEADS, case.q_heads)
    group = case.q_heads // case.kv_heads
    kv_heads = slice(0, math.ceil(heads / group))
    offset = case.seqlen_k - case.seqlen_q if case.causal else None
    ref, _ = dense_attention(q[:1, :heads], k[:1, kv_heads], v[:1, kv_heads], causal_offset=offset)
    got = out[:1, :heads].double()
    if not torch.isfinite(got).all():
        return float("nan")
    return ((got - ref).norm() / ref.norm()).item()


def time_ms(fn) -> tuple[float, str]:
    """Median milliseconds, with CUDA-graph replay for launch-bound calls."""
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    if ms < CUDA_GRAPH_THRESHOLD_MS:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"), "cuda_graph"
    return ms, "do_bench"


def run_case(case: Case, providers: list[str], dtype: torch.dtype, log=print) -> list[dict]:
    q, k, v = make_inputs(case, dtype)
    rows = []
    for name in providers:
        row = {"case": case.to_dict(), "label": case.label, "provider": name, "dtype": str(dtype).split(".")[-1]}
        try:
            fn = PEERS[name].make(case, q, k, v)
            out = fn()
            torch.cuda.synchronize()
            if name in ("fmha", "naive"):
                row["rel_err"] = check_output(case, q, k, v, out)
                if not row["rel_err"] < 2e-2:
                    raise PeerUnavailable(f"wrong result: relative error {row['rel_err']:.3g}")
            del out
            ms, method = time_ms(fn)
            row.update(status="ok", ms=ms, method=method, tflops=metrics.tflops(case, ms),
                       us_per_head=metrics.microseconds_per_head(case, ms))
        except PeerUnavailable as reason:
            row.update(status="unavailable", error=str(reason))
        except (RuntimeError, triton.CompilationError, torch.OutOfMemoryError) as error:
            row.update(status="failed", error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
        torch.cuda.empty_cache()
        rows.append(row)
        log(_row_line(row))
    return rows


def _row_line(row: dict) -> str:
    if row["status"] != "ok":
        return f"  {row['label']:<36} {row['provider']:<15} {row['status']}: {row.get('error', '')}"
    return (f"  {row['label']:<36} {row['provider']:<15} {row['tflops']:8.1f} TFLOP/s "
            f"{row['ms'] * 1e3:10.1f} µs {row['us_per_head']:8.3f} µs/head ({row['method']})")


def memory_check(seqlen: int = 131072, head_dim: int = 128, dtype=torch.bfloat16) -> dict:
    """Peak extra memory of one fused forward at B = H = 1: must be O(S), not O(S^2)."""
    case = Case(1, 1, 1, seqlen, seqlen, head_dim)
    q, k, v = make_inputs(case, dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fmha.attention(q, k, v)
    torch.cuda.synchronize()
    peak_extra = torch.cuda.max_memory_allocated() - before
    finite = bool(torch.isfinite(out).all())
    ms = triton.testing.do_bench(lambda: fmha.attention(q, k, v), warmup=1, rep=20, return_mode="median")
    return {"seqlen": seqlen, "head_dim": head_dim, "peak_extra_bytes": peak_extra,
            "output_bytes": out.numel() * out.element_size() + seqlen * 4,
            "score_matrix_bytes": seqlen * seqlen * 4, "finite": finite, "ms": ms,
            "tflops": metrics.tflops(case, ms)}


def summarize(rows: list[dict], against=("sdpa_flash", "sdpa_cudnn")) -> list[dict]:
    """One line per case: fmha TFLOP/s and its ratio to each named peer."""
    by_case: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault(row["label"], {})[row["provider"]] = row
    summary = []
    for label, providers in by_case.items():
        line = {"label": label}
        for name, row in providers.items():
            line[name] = row.get("tflops")
        fused = providers.get("fmha", {}).get("tflops")
        for peer in against:
            peer_tflops = providers.get(peer, {}).get("tflops")
            line[f"fmha/{peer}"] = fused / peer_tflops if fused and peer_tflops else None
        naive = providers.get("naive", {}).get("tflops")
        line["fmha/naive"] = fused / naive if fused and naive else None
        if providers.get("fmha", {}).get("case", {}).get("per_head"):
            line["fmha_us_per_head"] = providers["fmha"].get("us_per_head")
        summary.append(line)
    return summary


def format_summary(summary: list[dict], providers: list[str]) -> str:
    ratio_columns = [key for key in summary[0] if key.startswith("fmha/")] if summary else []
    header = f"{'case':<36}" + "".join(f"{p:>15}" for p in providers) + "".join(f"{r:>18}" for r in ratio_columns)
    lines = [header, "-" * len(header)]
    for line in summary:
        text = f"{line['label']:<36}"
        text += "".join(f"{line[p]:>15.1f}" if line.get(p) else f"{'—':>15}" for p in providers)
        text += "".join(f"{line[r]:>17.2f}x" if line.get(r) else f"{'—':>18}" for r in ratio_columns)
        lines.append(text)
    return "\n".join(lines)


def write_results(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
