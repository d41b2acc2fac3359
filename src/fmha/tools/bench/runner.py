"""Time providers over cases and collect one row per (case, provider); results JSON."""

from __future__ import annotations

import datetime
import json
import math
import platform
import subprocess
from pathlib import Path

import torch
import triton
import triton.testing

import fmha
from fmha import testing
from fmha.reference import dense_attention
from fmha.testing import time_ms

from . import metrics
from .cases import Case
from .peers import PEERS, PeerUnavailable, Unsupported, score_inputs

RESULTS_SCHEMA = "fmha-results/1"
# Heads checked against the float64 reference (a (1, 2, Sq, Sk) float64 score matrix).
CHECK_HEADS = 2
# Relative L2 error above which a provider's output counts as wrong (bf16 rounding is ~4e-3).
MAX_RELATIVE_ERROR = 2e-2


def environment() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "fmha": fmha.__version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    sm_count=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            info["driver"] = None
    return info


def make_inputs(case: Case, dtype: torch.dtype, device="cuda", seed: int = 0):
    """Fresh normal inputs (never zeros), BHSD, or THD (total tokens, H, D) for packed sequences;
    they require grad in the modes with a backward."""
    generator = torch.Generator(device=device).manual_seed(seed)
    requires_grad = case.mode != "fwd"

    def randn(heads, seqlen):
        if case.lengths is not None:  # packed: queries and keys share the lengths
            shape = (case.tokens[0], heads, case.head_dim)
        else:
            shape = (case.batch, heads, seqlen, case.head_dim)
        return torch.randn(shape, device=device, dtype=dtype, generator=generator).requires_grad_(requires_grad)

    return randn(case.q_heads, case.seqlen_q), randn(case.kv_heads, case.seqlen_k), randn(case.kv_heads, case.seqlen_k)


def as_case_layout(case: Case, out: torch.Tensor) -> torch.Tensor:
    """A provider's output in the layout of the case's inputs: THD for packed sequences (from a
    (1, H, T, D) batch), BHSD otherwise (from BSHD)."""
    if case.lengths is not None:
        return out[0].transpose(0, 1) if out.ndim == 4 else out
    if out.shape[1:3] == (case.q_heads, case.seqlen_q):
        return out
    return out.transpose(1, 2)


def scored_reference(q, k, v, window, case: Case, inputs: dict) -> torch.Tensor:
    """float64 attention of (1, h, Sq, D) inputs with the design's order of operations: scale,
    softcap, the ALiBi bias -slope·|pos(i) - j|, the window, then softmax with the sink term."""
    heads = q.shape[1]
    q, k, v = (t.detach().double() for t in (q, k, v))
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * case.head_dim ** -0.5
    if case.softcap:
        scores = case.softcap * torch.tanh(scores / case.softcap)
    rows = torch.arange(q.shape[2], device=q.device)
    keys = torch.arange(k.shape[2], device=q.device)
    if "alibi_slopes" in inputs:
        offset = window.offset if window is not None else k.shape[2] - q.shape[2]
        distance = (rows[:, None] + offset - keys[None, :]).abs().double()
        scores = scores - inputs["alibi_slopes"][:heads, None, None].double() * distance
    if window is not None:
        scores = scores.masked_fill(~window.visible(rows, keys), float("-inf"))
    top = scores.amax(-1, keepdim=True)
    if "sinks" in inputs:
        sinks = inputs["sinks"].detach()[:heads, None, None].double()
        top = torch.maximum(top, sinks)
    top = top.nan_to_num(0.0, neginf=0.0)  # a row that sees nothing
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    if "sinks" in inputs:
        total = total + torch.exp(sinks - top)
    return torch.where(total > 0, (weights @ v) / total, 0.0)


def _reference_pairs(case: Case, q, k, v, out):
    """(q, k, v, out, window) pieces that are checked: batch 0 as (1, H, S, D), or every packed sequence."""
    if case.lengths is None:
        yield q[:1], k[:1], v[:1], out[:1], case.visible_window()
        return
    start = 0
    for length in case.lengths:
        if length:
            yield (*(t[start:start + length].transpose(0, 1).unsqueeze(0) for t in (q, k, v, out)),
                   case.visible_window(length, length))
        start += length


def relative_error(case: Case, q, k, v, out) -> float:
    """Relative L2 error of the first heads against float64: batch 0, or every packed sequence; NaN if not finite."""
    if case.lengths is None and not case.scores_modified:
        return testing.relative_error(q, k, v, out, window=case.visible_window(), max_heads=CHECK_HEADS)
    out = as_case_layout(case, out)
    inputs = score_inputs(case, q.device)
    heads = min(CHECK_HEADS, case.q_heads)
    kv_heads = -(-heads // (case.q_heads // case.kv_heads))
    error = norm = 0.0
    for q_part, k_part, v_part, out_part, window in _reference_pairs(case, q, k, v, out):
        q_part, k_part, v_part = (t[:, :h].detach() for t, h in ((q_part, heads), (k_part, kv_heads),
                                                                  (v_part, kv_heads)))
        if case.scores_modified:
            ref = scored_reference(q_part, k_part, v_part, window, case, inputs)
        else:
            ref, _ = dense_attention(q_part, k_part, v_part, window=window)
        got = out_part[:, :heads].detach().double()
        if not torch.isfinite(got).all():
            return float("nan")
        error += (got - ref).square().sum().item()
        norm += ref.square().sum().item()
    return math.sqrt(error / norm) if norm else math.sqrt(error)


def timed_callable(case: Case, prepared):
    """What is timed: the forward alone, the backward of one saved forward, or both."""
    if case.mode == "fwd":
        def forward():
            with torch.no_grad():
                return prepared.run()
        return forward
    out = prepared.run()
    grad_out = torch.randn_like(out)
    if case.mode == "bwd":
        def backward():
            return torch.autograd.grad(out, prepared.inputs, grad_out, retain_graph=True)
        return backward
    del out

    def forward_backward():
        return torch.autograd.grad(prepared.run(), prepared.inputs, grad_out)
    return forward_backward


def peak_extra_bytes(fn) -> int:
    """Memory a call allocates beyond what was allocated before it (outputs included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    del result
    return torch.cuda.max_memory_allocated() - before


def step_of(provider: str) -> str:
    return "naive" if provider == "naive" else "fused"


def _check(case: Case, name: str, row: dict, q, k, v, out, fmha_out):
    """Record the forward's error against float64 (and the largest difference from fmha's output)."""
    if case.dropout:
        row["check"] = "none: dropout is random"
        return
    row["rel_err"] = relative_error(case, q, k, v, out)
    if fmha_out is not None and name != "fmha":
        row["max_abs_diff_vs_fmha"] = (as_case_layout(case, out).float() - fmha_out).abs().max().item()
    if not row["rel_err"] <= MAX_RELATIVE_ERROR:  # NaN fails too
        row.update(status="wrong", error=f"relative error {row['rel_err']:.3g} vs float64")


def run_case(case: Case, providers: list[str], dtype: torch.dtype, limits: metrics.ChipLimits | None = None,
             on_row=None, device="cuda") -> list[dict]:
    """One row per provider; a provider that is missing, lacks a feature of the case or fails is
    recorded (``unavailable``, ``unsupported`` or ``failed``, with the reason) and skipped."""
    q, k, v = make_inputs(case, dtype, device)
    rows = []
    fmha_out = None  # the headline's forward output, which the peers' outputs are compared with
    for name in providers:
        row = {"case": case.to_dict(), "label": case.label, "provider": name,
               "dtype": str(dtype).removeprefix("torch."), "status": "ok"}
        try:
            prepared = PEERS[name].prepare(case, q, k, v)
            row.update(prepared.kernel or {})
            if case.mode == "fwd":
                with torch.no_grad():
                    out = prepared.run()
                if out.is_cuda:
                    torch.cuda.synchronize()
                _check(case, name, row, q, k, v, out, fmha_out)
                if name == "fmha" and row["status"] == "ok":
                    fmha_out = as_case_layout(case, out).float()
                del out
            if row["status"] == "ok":
                fn = timed_callable(case, prepared)
                row["peak_extra_bytes"] = peak_extra_bytes(fn)
                ms, method = time_ms(fn)
                row.update(_rates(case, name, ms, q.element_size(), limits), ms=ms, method=method)
        except (Unsupported, NotImplementedError) as reason:
            row.update(status="unsupported", error=str(reason))
        except PeerUnavailable as reason:
            row.update(status="unavailable", error=str(reason))
        except Exception as error:  # a provider that breaks (a compiler error, a refused shape) is one row's story
            first_line = (str(error).splitlines() or [""])[0]
            row.update(status="failed", error=f"{type(error).__name__}: {first_line[:200]}")
        torch.cuda.empty_cache()
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _rates(case: Case, provider: str, ms: float, element_size: int, limits) -> dict:
    bytes_moved = metrics.modelled_bytes(case, step_of(provider), element_size)
    rates = {"tflops": metrics.tflops(case, ms), "us": ms * 1e3,
             "us_per_head": metrics.microseconds_per_head(case, ms),
             "bytes_model": bytes_moved, "gbps": bytes_moved / (ms * 1e-3) / 1e9}
    if limits is not None:
        percent, bound = limits.percent_of_limit(metrics.attention_flops(case), bytes_moved, ms)
        rates.update(percent_of_limit=percent, bound=bound)
    return rates


def row_line(row: dict) -> str:
    if row["status"] != "ok":
        return f"  {row['label']:<36} {row['provider']:<15} {row['status']}: {row.get('error', '')}"
    return (f"  {row['label']:<36} {row['provider']:<15} {row['tflops']:8.1f} TFLOP/s "
            f"{row['us']:10.1f} µs {row['us_per_head']:8.3f} µs/head ({row['method']})")


def memory_check(seqlen: int = 131072, head_dim: int = 128, dtype=torch.bfloat16) -> dict:
    """Peak extra memory of one fused forward at B = H = 1: must be O(S), not O(S^2)."""
    case = Case(1, 1, 1, seqlen, seqlen, head_dim)
    q, k, v = make_inputs(case, dtype)
    peak_extra = peak_extra_bytes(lambda: fmha.attention(q, k, v))
    out = fmha.attention(q, k, v)
    finite = bool(torch.isfinite(out).all())
    ms = triton.testing.do_bench(lambda: fmha.attention(q, k, v), warmup=1, rep=20, return_mode="median")
    return {"seqlen": seqlen, "head_dim": head_dim, "peak_extra_bytes": peak_extra,
            "output_bytes": out.numel() * out.element_size() + seqlen * metrics.LSE_BYTES,
            "score_matrix_bytes": seqlen * seqlen * 4, "finite": finite, "ms": ms,
            "tflops": metrics.tflops(case, ms)}


def summarize(rows: list[dict], against=("sdpa_flash", "sdpa_cudnn")) -> list[dict]:
    """One line per case: each provider's TFLOP/s, the headline ``fmha`` row's ratios, and the best peer."""
    by_case: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault(row["label"], {})[row["provider"]] = row
    summary = []
    for label, providers in by_case.items():
        line = {"label": label}
        for name, row in providers.items():
            line[name] = row.get("tflops")
        headline = providers.get("fmha", {})
        line["fmha_backend"] = headline.get("backend")
        peers = {name: row["tflops"] for name, row in providers.items()
                 if row.get("tflops") and not PEERS[name].is_fmha}
        if peers:
            line["best_peer"] = max(peers, key=peers.get)
        fused = headline.get("tflops")
        for peer in (*against, "best_peer"):
            peer_tflops = peers.get(line.get("best_peer")) if peer == "best_peer" else providers.get(peer, {}).get("tflops")
            line[f"fmha/{peer}"] = fused / peer_tflops if fused and peer_tflops else None
        naive = providers.get("naive", {}).get("tflops")
        line["fmha/naive"] = fused / naive if fused and naive else None
        if headline.get("case", {}).get("per_head"):
            line["fmha_us_per_head"] = headline.get("us_per_head")
        summary.append(line)
    return summary


def validate_results(payload: dict) -> None:
    """Raise ValueError unless ``payload`` follows the results schema."""
    if payload.get("schema") != RESULTS_SCHEMA:
        raise ValueError(f"results: schema must be {RESULTS_SCHEMA!r}, got {payload.get('schema')!r}")
    for key in ("environment", "rows", "dtype", "suites", "modes"):
        if key not in payload:
            raise ValueError(f"results: missing key {key!r}")
    for key in ("date", "fmha", "torch", "triton", "device"):
        if key not in payload["environment"]:
            raise ValueError(f"results: environment lacks {key!r}")
    for index, row in enumerate(payload["rows"]):
        for key in ("case", "label", "provider", "status"):
            if key not in row:
                raise ValueError(f"results: row {index} lacks {key!r}")
        if row["status"] == "ok":
            for key in ("ms", "tflops", "method"):
                if not isinstance(row.get(key), (int, float, str)):
                    raise ValueError(f"results: ok row {index} ({row['label']}, {row['provider']}) lacks {key!r}")
        elif "error" not in row:
            raise ValueError(f"results: row {index} has status {row['status']!r} but no error")


def write_results(path: Path, payload: dict) -> None:
    validate_results(payload)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
