"""``report.md`` from a results payload: the ladder, the peers, bytes moved, registers, analysis.

Pure formatting: it reads the payload (a dict, as written to JSON) and measures nothing. The row
``fmha`` is the headline: what ``fmha.attention`` runs by default, compared with the peers.
Interpreter timings (no GPU) are kept in the JSON but never shown as speeds.
"""

from __future__ import annotations

from fmha.tools.bench.cases import Case
from fmha.tools.bench.metrics import modelled_bytes
from fmha.tools.bench.peers import FMHA_PROVIDERS, PEERS

from .ladder import LADDER_PROVIDERS, STEPS

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
HEADLINE = "fmha"
NOT_MEANINGFUL = "Interpreter timings measure Python running the kernels, not a GPU: they are not meaningful."


def _number(value, digits=1, suffix="") -> str:
    if value is None:
        return "—"
    if 0 < abs(value) < 0.5 * 10.0**-digits:  # too small for the fixed digits
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
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def _status(row: dict) -> str:
    if row["status"] == "ok":
        error = row.get("rel_err")
        return "pass" + (f" (rel. err {error:.1e})" if error is not None else "")
    return f"{row['status']}: {row.get('error', '')}"


def _runs(row: dict) -> str:
    """Which kernel a row ran: fmha's backend, config and its source; a peer's description."""
    backend = row.get("backend")
    if backend is None:
        peer = PEERS.get(row["provider"])
        return peer.description if peer and not peer.is_fmha else "—"
    if backend == "naive":
        return "naive"
    text = f"{backend} {row.get('config', '')} ({row.get('config_source', '?')})"
    return text + (f"; backward: {row['backward']}" if row.get("backward") else "")


def _timed(payload: dict) -> bool:
    """Whether the timings are GPU timings (speeds may be stated)."""
    return not payload.get("interpreter")


def _ok(row: dict | None) -> bool:
    return bool(row) and row["status"] == "ok" and bool(row.get("tflops"))


def _by_case(payload: dict) -> dict[str, dict[str, dict]]:
    grouped: dict[str, dict[str, dict]] = {}
    for row in payload["rows"]:
        grouped.setdefault(row["label"], {})[row["provider"]] = row
    return grouped


def _best_peer(providers: dict[str, dict]) -> tuple[str | None, float | None]:
    peers = {name: row["tflops"] for name, row in providers.items() if name not in FMHA_PROVIDERS and _ok(row)}
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
    if payload.get("interpreter"):
        cases = "one tiny fixed shape"
    else:
        cases = ", ".join(payload["suites"] + payload.get("shapes", [])) or "none"
    lines.append(f"- Cases: {cases}; modes: {', '.join(payload['modes'])}; dtype: {payload['dtype']}")
    limits = payload.get("chip_limits")
    if limits:
        lines.append(f"- Chip limits ({limits.get('source')}): bf16 matmul {limits['matmul_tflops']:.0f} TFLOP/s, "
                     f"device copy {limits['copy_gbps']:.0f} GB/s")
    if payload.get("interpreter"):
        lines.append("- Timing: none reported. " + NOT_MEANINGFUL)
    else:
        lines.append("- Timing: `triton.testing.do_bench` median; calls under 0.2 ms by CUDA-graph replay "
                     "(the `timing` column says which). FLOPs = 4·B·Hq·Sq·Sk·D, ×0.5 causal, ×3.5 fwd+bwd.")
    lines.append(f"- Rows: `{HEADLINE}` is what `fmha.attention` runs by default, the row compared with the peers; "
                 "`naive`, `triton_heuristic` and `triton_tuned` are the ladder's steps 2-4. The `kernel` column "
                 "says which backend and config each ran, and where the config came from.")
    if payload.get("ignored_options"):
        lines.append(f"- Ignored without a GPU: {', '.join(payload['ignored_options'])}.")
    if payload.get("interpreter"):
        lines += ["", "> **No GPU.** fmha's rows ran through Triton's interpreter on the CPU at one tiny shape, "
                      "one call each. They show that the kernels run and are correct. " + NOT_MEANINGFUL
                  + " The peers were skipped."]
    return lines


def ladder_lines(payload: dict) -> list[str]:
    timed = _timed(payload)
    invariant = payload["invariant"]
    lines = ["## The ladder", ""] + _table(["step", "row", "what it runs"],
                                          [[number, f"`{name}`", text] for number, name, text in STEPS])
    header = ["case", "step", "row", "kernel"] + (["TFLOP/s", "µs/head", "speedup over naive"] if timed else [])
    rows = [[invariant["label"], "1", "`invariant`", "NumPy float64"] + (["—"] * 3 if timed else [])
            + [f"{invariant['status']} (max rel. err {invariant['max_rel_error']:.1e} vs direct softmax)"]]
    for label, providers in _by_case(payload).items():
        naive = providers.get("naive")
        for number, provider, _ in STEPS[1:]:
            row = providers.get(provider)
            if row is None:
                continue
            cells = [label, number, f"`{provider}`", _runs(row)]
            if timed:
                tflops = row["tflops"] if _ok(row) else None
                speedup = _number(tflops / naive["tflops"], 1, "×") if tflops and _ok(naive) else "—"
                cells += [_number(tflops), _number(row.get("us_per_head") if tflops else None, 3), speedup]
            rows.append(cells + [_status(row)])
    return lines + [""] + _table(header + ["status"], rows)


def peer_lines(payload: dict) -> list[str]:
    lines = ["## Against the peers", ""]
    if not _timed(payload):
        lines += ["No GPU: the peers were skipped. Every row's status:", ""]
        rows = [[f"`{row['provider']}`", _runs(row), _status(row)] for row in payload["rows"]]
        return lines + _table(["row", "kernel", "status"], rows)
    lines.append(f"Ratio = TFLOP/s over the best peer's in the same case (peers: every row but fmha's own: "
                 f"{', '.join(FMHA_PROVIDERS)}). % of limit = the roofline bound (matmul rate or copy bandwidth, "
                 "whichever is slower for the modelled FLOPs and bytes) over the measured time.")
    for label, providers in _by_case(payload).items():
        best, best_tflops = _best_peer(providers)
        rows = []
        for name, row in providers.items():
            ok = _ok(row)
            ratio = _number(row["tflops"] / best_tflops, 2, "×") if ok and best_tflops else "—"
            percent = _number(row.get("percent_of_limit"), 0, "%") + (f" ({row['bound']})" if row.get("bound") else "")
            rows.append([f"**{name}**" if name == HEADLINE else name, _runs(row),
                         _number(row.get("tflops")) if ok else "—", _number(row.get("us")) if ok else "—",
                         _number(row.get("us_per_head"), 3) if ok else "—", row.get("method", "—") if ok else "—",
                         ratio, percent if ok else "—", _bytes(row.get("peak_extra_bytes")) if ok else "—",
                         _status(row)])
        lines += ["", f"### {label}" + (f" (best peer: {best}, {best_tflops:.1f} TFLOP/s)" if best else ""), ""]
        lines += _table(["row", "kernel", "TFLOP/s", "µs", "µs/head", "timing", "ratio to best peer", "% of limit",
                         "peak extra memory", "status"], rows)
    return lines


def bytes_lines(payload: dict) -> list[str]:
    timed = _timed(payload)
    element_size = DTYPE_BYTES.get(payload["dtype"], 2)
    copy = (payload.get("chip_limits") or {}).get("copy_gbps")
    rows = []
    for label, providers in _by_case(payload).items():
        for name in ("naive", HEADLINE):
            row = providers.get(name)
            if row is None:
                continue
            case = Case(**row["case"])
            if name == "naive" and case.mode != "fwd":
                continue
            bytes_moved = modelled_bytes(case, "naive" if name == "naive" else "fused", element_size)
            flops_per_byte = 4.0 * case.batch * case.q_heads * case.seqlen_q * case.seqlen_k * case.head_dim
            flops_per_byte *= (0.5 if case.causal else 1.0) / bytes_moved
            cells = [label, f"`{name}`", _bytes(bytes_moved)]
            if timed:
                ok = _ok(row)
                gbps = bytes_moved / (row["ms"] * 1e-3) / 1e9 if ok else None
                cells += [_number(row.get("us")) if ok else "—", _number(gbps, 0),
                          _number(100 * gbps / copy, 0, "%") if gbps and copy else "—"]
            rows.append(cells + [_number(flops_per_byte, 0)])
    header = ["case", "row", "modelled bytes"] + (["µs", "GB/s", "% of copy bandwidth"] if timed else []) + ["FLOP/byte"]
    return (["## Bytes moved", "",
             "Analytic HBM traffic. Naive: read Q, K, write S (fp32); read S, write P; read P, V, write O. "
             "Fused (every other fmha row): read Q, K, V once, write O and the LSE (K/V re-reads hit L2 and are "
             "not counted)."] + [""] + _table(header, rows))


def kernel_lines(payload: dict) -> list[str]:
    rows = [[k["label"], k["step"], f"`{k['kernel']}`" if k.get("kernel") else "—", k.get("config") or "—",
             _number(k.get("registers"), 0), _number(k.get("spills"), 0),
             _bytes(k.get("shared_bytes")), _number(k.get("num_warps"), 0)] for k in payload.get("kernels", [])]
    lines = ["## Registers and spills", ""]
    if not rows:
        return lines + ["Not available: Triton's interpreter compiles nothing."]
    return lines + ["The portable Triton kernels of steps 2-4 as compiled for each case (the Hopper Gluon kernel "
                    "that `fmha` runs on sm_90 is not read here).", ""] + _table(
        ["case", "step", "kernel", "config", "registers/thread", "spills", "shared memory", "warps"], rows)


def _not_run_sentences(payload: dict) -> list[str]:
    """One sentence per fmha row that ran in no case, with its reason."""
    sentences = []
    for number, provider, _ in STEPS[1:]:
        rows = [row for row in payload["rows"] if row["provider"] == provider]
        if rows and all(row["status"] != "ok" for row in rows):
            sentences.append(f"Step {number} (`{provider}`) has no measurement: {rows[0].get('error', 'not run')}.")
    return sentences


def _interpreter_analysis(payload: dict) -> list[str]:
    sentences = []
    for label, providers in _by_case(payload).items():
        for name in LADDER_PROVIDERS:
            row = providers.get(name, {})
            if row.get("rel_err") is not None:
                sentences.append(f"{label}: `{name}` ran {_runs(row)} through the interpreter; relative error "
                                 f"{row['rel_err']:.1e} against float64 ({_status(row).split(' ')[0]}).")
    sentences += _not_run_sentences(payload)
    sentences.append("No speed is claimed. " + NOT_MEANINGFUL)
    return sentences


def _gpu_analysis(payload: dict) -> list[str]:
    sentences = []
    grouped = _by_case(payload)
    flash_ratios, cudnn_ratios, backends = [], [], {}
    for label, providers in grouped.items():
        headline, naive = providers.get(HEADLINE), providers.get("naive")
        if _ok(headline):
            backends[headline.get("backend")] = backends.get(headline.get("backend"), 0) + 1
            steps = ", ".join(f"{name} {providers[name]['tflops']:.1f}" for name in ("triton_heuristic", "triton_tuned")
                              if _ok(providers.get(name)))
            sentences.append(f"{label}: fmha ({headline.get('backend')}) reaches {headline['tflops']:.1f} TFLOP/s"
                             + (f", {headline['tflops'] / naive['tflops']:.1f}× the naive baseline "
                                f"({naive['tflops']:.1f} TFLOP/s)" if _ok(naive) else "")
                             + (f"; the portable kernel: {steps} TFLOP/s." if steps else "."))
            best, best_tflops = _best_peer(providers)
            if best:
                sentences.append(f"{label}: fmha is {headline['tflops'] / best_tflops:.2f}× the best peer, "
                                 f"{best} at {best_tflops:.1f} TFLOP/s.")
            for peer, ratios in (("sdpa_flash", flash_ratios), ("sdpa_cudnn", cudnn_ratios)):
                if _ok(providers.get(peer)):
                    ratios.append(headline["tflops"] / providers[peer]["tflops"])
            if headline["case"].get("per_head"):
                peers = ", ".join(f"{name} {row['us_per_head']:.3f}" for name, row in providers.items()
                                  if name not in FMHA_PROVIDERS and _ok(row))
                sentences.append(f"{label}: fmha takes {headline['us_per_head']:.3f} µs per head "
                                 f"({headline['method']})" + (f"; the peers take {peers} µs per head." if peers else "."))
    if backends:
        total = sum(backends.values())
        sentences.append("The default path ran " + ", ".join(f"{name} on {count} of {total} cases"
                                                             for name, count in backends.items()) + ".")
    for peer, ratios in (("SDPA flash (FlashAttention-2)", flash_ratios), ("SDPA cuDNN", cudnn_ratios)):
        if ratios:
            sentences.append(f"Over {len(ratios)} cases fmha is {_span(min(ratios), max(ratios), 2, '×')} {peer}.")
    limits = payload.get("chip_limits")
    headline_rows = [row for row in payload["rows"] if row["provider"] == HEADLINE and _ok(row)]
    if limits and headline_rows:
        best = max(headline_rows, key=lambda row: row["tflops"])
        sentences.append(f"fmha's best, {best['tflops']:.1f} TFLOP/s on {best['label']}, is "
                         f"{100 * best['tflops'] / limits['matmul_tflops']:.0f}% of the measured bf16 matmul rate "
                         f"({limits['matmul_tflops']:.0f} TFLOP/s).")
    naive_rows = [row for row in payload["rows"] if row["provider"] == "naive" and _ok(row)]
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
        sentences.append(f"The portable fused kernel uses {_span(registers[0], registers[-1], 0)} registers per thread "
                         f"with at most {spills} spilled, as compiled for these cases.")
    sentences += _not_run_sentences(payload)
    memory = payload.get("memory_check")
    if memory:
        sentences.append(f"At S = {memory['seqlen']:,} (D = {memory['head_dim']}) one fmha.attention call allocates "
                         f"{_bytes(memory['peak_extra_bytes'])} beyond its inputs (the output and LSE take "
                         f"{_bytes(memory['output_bytes'])}; S would take {_bytes(memory['score_matrix_bytes'])}).")
    return sentences


def analysis_lines(payload: dict) -> list[str]:
    """Sentences, each stating a measured number (or why a row has none)."""
    invariant = payload["invariant"]
    sentences = [f"Step 1: the online softmax matches the direct softmax to {invariant['max_rel_error']:.1e} "
                 f"relative error in float64 (block of {invariant['block_n']} keys)."]
    sentences += _gpu_analysis(payload) if _timed(payload) else _interpreter_analysis(payload)
    return ["## Analysis", ""] + [f"- {sentence}" for sentence in sentences]


def render_report(payload: dict, plots: list[str] | None = None) -> str:
    lines = header_lines(payload)
    lines += [""] + ladder_lines(payload)
    if plots:
        lines += [""] + [f"![ladder]({p})" for p in plots if "ladder" in p]
    lines += [""] + peer_lines(payload)
    lines += [""] + bytes_lines(payload)
    lines += [""] + kernel_lines(payload)
    lines += [""] + analysis_lines(payload)
    by_case = [p for p in (plots or []) if "ladder" not in p]
    if by_case:
        lines += ["", "## TFLOP/s by case", "",
                  "One line per family of cases that differ only in sequence length (at a fixed number of query "
                  "tokens, B·Sq); cases without such a family are bars.", ""]
        lines += [f"![{p}]({p})" for p in by_case]
    return "\n".join(lines) + "\n"


__all__ = ["render_report", "LADDER_PROVIDERS"]
