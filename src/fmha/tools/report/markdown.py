"""``report.md`` from a results payload: the ladder, the peers, bytes moved, registers, analysis.

Pure formatting: it reads the payload (a dict, as written to JSON) and measures nothing.
"""

from __future__ import annotations

from fmha.tools.bench.cases import Case
from fmha.tools.bench.metrics import modelled_bytes

from .ladder import LADDER_PROVIDERS, STEPS

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
FMHA_PROVIDERS = ("fmha", "fmha_tuned", "naive")


def _number(value, digits=1, suffix="") -> str:
    if value is None:
        return "—"
    if 0 < abs(value) < 0.5 * 10.0**-digits:  # too small for the fixed digits (interpreter timings)
        return f"{value:.2g}{suffix}"
    return f"{value:,.{digits}f}{suffix}"


def _bytes(value) -> str:
    if value is None:
        return "—"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def _span(low: float, high: float, digits: int, suffix: str = "") -> str:
    low_text, high_text = f"{low:.{digits}f}", f"{high:.{digits}f}"
    return f"{low_text}{suffix}" if low_text == high_text else f"{low_text}–{high_text}{suffix}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell for cell in row) + " |" for row in rows]
    return lines


def _status(row: dict) -> str:
    if row["status"] == "ok":
        error = row.get("rel_err")
        return "pass" + (f" (rel. err {error:.1e})" if error is not None else "")
    return f"{row['status']}: {row.get('error', '')}"


def _by_case(payload: dict) -> dict[str, dict[str, dict]]:
    grouped: dict[str, dict[str, dict]] = {}
    for row in payload["rows"]:
        grouped.setdefault(row["label"], {})[row["provider"]] = row
    return grouped


def _best_peer(providers: dict[str, dict]) -> tuple[str | None, float | None]:
    peers = {name: row["tflops"] for name, row in providers.items()
             if name not in FMHA_PROVIDERS and row["status"] == "ok" and row.get("tflops")}
    if not peers:
        return None, None
    best = max(peers, key=peers.get)
    return best, peers[best]


def header_lines(payload: dict) -> list[str]:
    env = payload["environment"]
    lines = ["# fmha report", ""]
    device = env.get("device") or "no GPU (Triton interpreter on the CPU)"
    lines.append(f"- Device: {device}" + (f" (sm_{env['capability'].replace('.', '')}, {env['sm_count']} SMs, "
                                          f"driver {env.get('driver')})" if env.get("capability") else ""))
    lines.append(f"- Versions: fmha {env['fmha']}, torch {env['torch']}, triton {env['triton']}, "
                 f"CUDA {env.get('cuda')}, Python {env.get('python')}")
    lines.append(f"- Date: {env['date']}")
    cases = ", ".join(payload["suites"]) or ("one tiny shape" if payload.get("interpreter") else "custom shapes")
    lines.append(f"- Suites: {cases}; modes: {', '.join(payload['modes'])}; dtype: {payload['dtype']}")
    limits = payload.get("chip_limits")
    if limits:
        lines.append(f"- Chip limits ({limits.get('source')}): bf16 matmul {limits['matmul_tflops']:.0f} TFLOP/s, "
                     f"device copy {limits['copy_gbps']:.0f} GB/s")
    if payload.get("interpreter"):
        lines.append("- Timing: one call, CPU timer (`cpu_interpreter`).")
    else:
        lines.append("- Timing: `triton.testing.do_bench` median; calls under 0.2 ms by CUDA-graph replay "
                     "(the `timing` column says which). FLOPs = 4·B·Hq·Sq·Sk·D, ×0.5 causal, ×3.5 fwd+bwd.")
    if payload.get("interpreter"):
        lines += ["", "> **No GPU.** Steps 2 and 3 ran through Triton's interpreter on the CPU at one tiny shape. "
                      "They show that the kernels run and are correct; their timings are not meaningful. "
                      "The peers were skipped."]
    return lines


def ladder_lines(payload: dict) -> list[str]:
    invariant = payload["invariant"]
    rows = [[invariant["label"], "1", STEPS[0][2], _number(invariant.get("tflops"), 3), "—", "—",
             f"{invariant['status']} (max rel. err {invariant['max_rel_error']:.1e} vs direct softmax)"]]
    for label, providers in _by_case(payload).items():
        naive = providers.get("naive", {})
        naive_tflops = naive.get("tflops") if naive.get("status") == "ok" else None
        for number, provider, strategy in STEPS[1:]:
            row = providers.get(provider)
            if row is None:
                continue
            tflops = row.get("tflops") if row["status"] == "ok" else None
            speedup = _number(tflops / naive_tflops, 1, "×") if tflops and naive_tflops else "—"
            rows.append([label, number, strategy, _number(tflops), _number(row.get("us_per_head"), 3),
                         speedup, _status(row)])
    return ["## The ladder", ""] + _table(
        ["case", "step", "strategy", "TFLOP/s", "µs/head", "speedup over naive", "status"], rows)


def peer_lines(payload: dict) -> list[str]:
    lines = ["## Against the peers", "",
             "Ratio = TFLOP/s over the best peer's in the same case (peers: everything that is not fmha). "
             "% of limit = the roofline bound (matmul rate or copy bandwidth, whichever is slower for the "
             "modelled FLOPs and bytes) over the measured time."]
    for label, providers in _by_case(payload).items():
        best, best_tflops = _best_peer(providers)
        rows = []
        for name, row in providers.items():
            ok = row["status"] == "ok"
            ratio = _number(row["tflops"] / best_tflops, 2, "×") if ok and best_tflops else "—"
            percent = _number(row.get("percent_of_limit"), 0, "%") + (f" ({row['bound']})" if row.get("bound") else "")
            rows.append([name, _number(row.get("tflops")) if ok else "—", _number(row.get("us")) if ok else "—",
                         _number(row.get("us_per_head"), 3) if ok else "—", row.get("method", "—") if ok else "—",
                         ratio, percent if ok else "—", _bytes(row.get("peak_extra_bytes")) if ok else "—",
                         _status(row)])
        lines += ["", f"### {label}" + (f" (best peer: {best}, {best_tflops:.1f} TFLOP/s)" if best else ""), ""]
        lines += _table(["provider", "TFLOP/s", "µs", "µs/head", "timing", "ratio to best peer", "% of limit",
                         "peak extra memory", "status"], rows)
    return lines


def bytes_lines(payload: dict) -> list[str]:
    element_size = DTYPE_BYTES.get(payload["dtype"], 2)
    limits = payload.get("chip_limits") or {}
    copy = limits.get("copy_gbps")
    rows = []
    for label, providers in _by_case(payload).items():
        for name in ("naive", "fmha"):
            row = providers.get(name)
            if row is None:
                continue
            case = Case(**row["case"])
            if name == "naive" and case.mode != "fwd":
                continue
            step = "naive" if name == "naive" else "fused"
            bytes_moved = modelled_bytes(case, step, element_size)
            ok = row["status"] == "ok"
            gbps = bytes_moved / (row["ms"] * 1e-3) / 1e9 if ok else None
            flops_per_byte = 4.0 * case.batch * case.q_heads * case.seqlen_q * case.seqlen_k * case.head_dim
            flops_per_byte *= (0.5 if case.causal else 1.0) / bytes_moved
            rows.append([label, "2 naive" if name == "naive" else "3 fused", _bytes(bytes_moved),
                         _number(row.get("us")) if ok else "—", _number(gbps, 0),
                         _number(100 * gbps / copy, 0, "%") if gbps and copy else "—", _number(flops_per_byte, 0)])
    return (["## Bytes moved", "",
             "Analytic HBM traffic. Naive: read Q, K, write S (fp32); read S, write P; read P, V, write O. "
             "Fused: read Q, K, V once, write O and the LSE (K/V re-reads hit L2 and are not counted)."]
            + [""] + _table(["case", "step", "modelled bytes", "µs", "GB/s", "% of copy bandwidth", "FLOP/byte"],
                            rows))


def kernel_lines(payload: dict) -> list[str]:
    rows = [[k["label"], k["step"], f"`{k['kernel']}`" if k.get("kernel") else "—", k.get("config") or "—",
             _number(k.get("registers"), 0), _number(k.get("spills"), 0),
             _bytes(k.get("shared_bytes")), _number(k.get("num_warps"), 0)] for k in payload.get("kernels", [])]
    lines = ["## Registers and spills", ""]
    if not rows:
        return lines + ["Not available: Triton's interpreter compiles nothing."]
    return lines + _table(["case", "step", "kernel", "config", "registers/thread", "spills", "shared memory",
                           "warps"], rows)


def analysis_lines(payload: dict) -> list[str]:
    """Sentences, each stating a measured number."""
    sentences = []
    invariant = payload["invariant"]
    sentences.append(f"Step 1: the online softmax matches the direct softmax to {invariant['max_rel_error']:.1e} "
                     f"relative error in float64 (block of {invariant['block_n']} keys).")
    grouped = _by_case(payload)
    if payload.get("interpreter"):
        for label, providers in grouped.items():
            for name in ("naive", "fmha"):
                row = providers.get(name, {})
                if row.get("rel_err") is not None:
                    sentences.append(f"{label}: {name} ran through the interpreter with relative error "
                                     f"{row['rel_err']:.1e} against float64 ({row['status']}).")
        sentences.append("No speed is claimed: interpreter timings measure Python, not a GPU.")
        return ["## Analysis", ""] + [f"- {sentence}" for sentence in sentences]
    flash_ratios, cudnn_ratios = [], []
    for label, providers in grouped.items():
        fused, naive = providers.get("fmha", {}), providers.get("naive", {})
        if fused.get("status") == "ok" and naive.get("status") == "ok":
            sentences.append(f"{label}: the fused kernel reaches {fused['tflops']:.1f} TFLOP/s, "
                             f"{fused['tflops'] / naive['tflops']:.1f}× the naive baseline "
                             f"({naive['tflops']:.1f} TFLOP/s).")
        best, best_tflops = _best_peer(providers)
        if fused.get("status") == "ok" and best:
            sentences.append(f"{label}: fmha is {fused['tflops'] / best_tflops:.2f}× the best peer, "
                             f"{best} at {best_tflops:.1f} TFLOP/s.")
        for peer, ratios in (("sdpa_flash", flash_ratios), ("sdpa_cudnn", cudnn_ratios)):
            if fused.get("status") == "ok" and providers.get(peer, {}).get("status") == "ok":
                ratios.append(fused["tflops"] / providers[peer]["tflops"])
        if fused.get("case", {}).get("per_head") and fused.get("status") == "ok":
            peers = ", ".join(f"{name} {row['us_per_head']:.3f}" for name, row in providers.items()
                              if name not in FMHA_PROVIDERS and row["status"] == "ok")
            sentences.append(f"{label}: fmha takes {fused['us_per_head']:.3f} µs per head ({fused['method']})"
                             + (f"; the peers take {peers} µs per head." if peers else "."))
    for peer, ratios in (("SDPA flash (FlashAttention-2)", flash_ratios), ("SDPA cuDNN", cudnn_ratios)):
        if ratios:
            sentences.append(f"Over {len(ratios)} cases fmha is {_span(min(ratios), max(ratios), 2, '×')} {peer}.")
    limits = payload.get("chip_limits")
    fused_rows = [row for row in payload["rows"] if row["provider"] == "fmha" and row["status"] == "ok"]
    if limits and fused_rows:
        best = max(fused_rows, key=lambda row: row["tflops"])
        sentences.append(f"The fused kernel's best, {best['tflops']:.1f} TFLOP/s on {best['label']}, is "
                         f"{100 * best['tflops'] / limits['matmul_tflops']:.0f}% of the measured bf16 matmul rate "
                         f"({limits['matmul_tflops']:.0f} TFLOP/s).")
    naive_rows = [row for row in payload["rows"] if row["provider"] == "naive" and row["status"] == "ok"]
    if limits and naive_rows:
        worst = max(naive_rows, key=lambda row: row["ms"])
        if worst.get("gbps"):
            sentences.append(f"The naive step on {worst['label']} moves {_bytes(worst['bytes_model'])} through HBM in "
                             f"{worst['us'] / 1e3:.2f} ms ({worst['gbps']:.0f} GB/s, "
                             f"{100 * worst['gbps'] / limits['copy_gbps']:.0f}% of the measured copy bandwidth).")
    fused_kernels = [k for k in payload.get("kernels", []) if k["step"].startswith("fused") and k.get("registers")]
    if fused_kernels:
        registers = sorted({k["registers"] for k in fused_kernels})
        spills = max(k["spills"] or 0 for k in fused_kernels)
        sentences.append(f"The fused kernel uses {_span(registers[0], registers[-1], 0)} registers per thread with at most "
                         f"{spills} spilled, as compiled for these cases.")
    tuned = [row for row in payload["rows"] if row["provider"] == "fmha_tuned"]
    if tuned and all(row["status"] != "ok" for row in tuned):
        sentences.append("Step 4 has no measurement: " + tuned[0].get("error", "not run") + ".")
    memory = payload.get("memory_check")
    if memory:
        sentences.append(f"At S = {memory['seqlen']:,} (D = {memory['head_dim']}) one fused call allocates "
                         f"{_bytes(memory['peak_extra_bytes'])} beyond its inputs (the output and LSE take "
                         f"{_bytes(memory['output_bytes'])}; S would take {_bytes(memory['score_matrix_bytes'])}).")
    return ["## Analysis", ""] + [f"- {sentence}" for sentence in sentences]


def render_report(payload: dict, plots: list[str] | None = None) -> str:
    lines = header_lines(payload)
    lines += [""] + ladder_lines(payload)
    if plots:
        ladder_plots = [p for p in plots if "ladder" in p]
        lines += [""] + [f"![ladder]({p})" for p in ladder_plots]
    lines += [""] + peer_lines(payload)
    lines += [""] + bytes_lines(payload)
    lines += [""] + kernel_lines(payload)
    lines += [""] + analysis_lines(payload)
    scaling = [p for p in (plots or []) if "ladder" not in p]
    if scaling:
        lines += ["", "## TFLOP/s against sequence length", ""] + [f"![{p}]({p})" for p in scaling]
    return "\n".join(lines) + "\n"


__all__ = ["render_report", "LADDER_PROVIDERS"]
