"""PNG plots from a results payload: the ladder as bars, TFLOP/s per family of cases.

Without a GPU the only plot is the ladder, of interpreter times, and it says so in its title.
"""

from __future__ import annotations

from pathlib import Path

from .ladder import STEPS

STEP_COLOURS = {"naive": "#999999", "triton_heuristic": "#1f77b4", "triton_tuned": "#17becf", "fmha": "#2ca02c"}
# One colour per provider in every plot, none shared with fmha's rows.
COLOURS = {**STEP_COLOURS, "sdpa_flash": "#ff7f0e", "sdpa_cudnn": "#d62728", "sdpa_efficient": "#9467bd",
           "sdpa_math": "#8c564b", "flex": "#e377c2", "fa2": "#bcbd22", "fa3": "#393b79", "fa4": "#637939"}
INTERPRETER_TITLE = "Triton interpreter on the CPU: one call each, not a GPU speed (not meaningful)"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def plot_ladder(payload: dict, path: Path) -> Path | None:
    """Grouped bars: one group per case, one bar per step 2-5 (absent bars were not measured).

    GPU: TFLOP/s. Interpreter: the one call's time in ms, titled as such.
    """
    interpreter = bool(payload.get("interpreter"))
    value_key = "ms" if interpreter else "tflops"
    labels = list(dict.fromkeys(row["label"] for row in payload["rows"]))
    values = {(row["label"], row["provider"]): row[value_key] for row in payload["rows"]
              if row["status"] == "ok" and row.get(value_key)}
    if not any(provider in STEP_COLOURS for _, provider in values):
        return None
    plt = _pyplot()
    steps = STEPS[1:]
    figure, axes = plt.subplots(figsize=(max(7.5, 1.8 * len(labels) + 2), 4.2))
    width = 0.8 / len(steps)
    for index, (number, provider, _) in enumerate(steps):
        heights = [values.get((label, provider), 0.0) for label in labels]
        positions = [i + (index - (len(steps) - 1) / 2) * width for i in range(len(labels))]
        label = f"step {number}: {provider}" + ("" if any(heights) else " (not measured)")
        axes.bar(positions, heights, width, label=label, color=STEP_COLOURS[provider])
    axes.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    if interpreter:
        axes.set_ylabel("interpreter time per call (ms)")
        axes.set_title(INTERPRETER_TITLE, fontsize=9)
    else:
        axes.set_ylabel("TFLOP/s")
        axes.set_title("The ladder: naive → portable kernel (heuristic, tuned tiles) → fmha (default path)",
                       fontsize=9)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(plt, figure, path)


def _family_key(case: dict) -> tuple:
    """Cases that differ only in sequence length, at a fixed number of query tokens (B·Sq)."""
    return (case["mode"], case["head_dim"], case["causal"], case["q_heads"], case["kv_heads"],
            case["batch"] * case["seqlen_q"])


def families(rows: list[dict]) -> tuple[dict[tuple, dict[str, list[tuple[int, float]]]], list[dict]]:
    """Split timed rows into line families (two or more distinct Sk) and the rest (drawn as bars).

    Returns ``({family key: {provider: [(Sk, TFLOP/s), ...]}}, rows for bars)``.
    """
    grouped: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["status"] == "ok" and row.get("tflops"):
            grouped.setdefault(_family_key(row["case"]), []).append(row)
    lines, bars = {}, []
    for key, members in grouped.items():
        cases = {tuple(sorted(row["case"].items())) for row in members}
        lengths = {dict(case)["seqlen_k"] for case in cases}
        if len(lengths) < 2 or len(lengths) != len(cases):  # one point, or two cases at one x
            bars += members
            continue
        providers: dict[str, list[tuple[int, float]]] = {}
        for row in members:
            providers.setdefault(row["provider"], []).append((row["case"]["seqlen_k"], row["tflops"]))
        lines[key] = {name: sorted(points) for name, points in providers.items()}
    return lines, bars


def _family_title(key: tuple) -> str:
    mode, head_dim, causal, q_heads, kv_heads, tokens = key
    heads = f"H{q_heads}" if q_heads == kv_heads else f"H{q_heads}/{kv_heads}"
    return f"{heads} D{head_dim} {'causal' if causal else 'non-causal'} {mode}, B·Sq = {tokens:,}"


def plot_families(payload: dict, out_dir: Path) -> list[Path]:
    """One plot per family: TFLOP/s against Sk, one line per provider."""
    lines, _ = families(payload["rows"])
    paths = []
    for key, providers in sorted(lines.items()):
        plt = _pyplot()
        figure, axes = plt.subplots(figsize=(7.5, 4.0))
        for provider, points in sorted(providers.items()):
            axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=provider,
                      color=COLOURS.get(provider), linewidth=2.5 if provider == "fmha" else 1.2)
        axes.set_xscale("log", base=2)
        lengths = sorted({x for points in providers.values() for x, _ in points})
        axes.set_xticks(lengths, [f"{x:,}" for x in lengths])
        axes.minorticks_off()
        axes.set_xlabel("sequence length Sk (batch B = tokens / Sq)")
        axes.set_ylabel("TFLOP/s")
        axes.set_title(_family_title(key), fontsize=10)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        mode, head_dim, causal, q_heads, kv_heads, tokens = key
        name = f"tflops_d{head_dim}_{'causal' if causal else 'full'}_{mode}_h{q_heads}-{kv_heads}_t{tokens}.png"
        paths.append(_save(plt, figure, out_dir / name))
    return paths


def plot_case_bars(payload: dict, path: Path) -> Path | None:
    """Grouped bars for the cases that belong to no line family: one group per case, one bar per provider."""
    _, rows = families(payload["rows"])
    if not rows:
        return None
    labels = list(dict.fromkeys(row["label"] for row in rows))
    providers = list(dict.fromkeys(row["provider"] for row in rows))
    tflops = {(row["label"], row["provider"]): row["tflops"] for row in rows}
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(max(6.0, 0.35 * len(labels) * len(providers) + 2), 4.2))
    width = 0.8 / len(providers)
    for index, provider in enumerate(providers):
        heights = [tflops.get((label, provider), 0.0) for label in labels]
        positions = [i + (index - (len(providers) - 1) / 2) * width for i in range(len(labels))]
        axes.bar(positions, heights, width, label=provider, color=COLOURS.get(provider))
    axes.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    axes.set_ylabel("TFLOP/s")
    axes.set_title("TFLOP/s per case")
    axes.grid(alpha=0.3, axis="y")
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(plt, figure, path)


def make_plots(payload: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    ladder = plot_ladder(payload, out_dir / "ladder.png")
    paths = [ladder] if ladder else []
    if payload.get("interpreter"):  # one tiny case and no peers: nothing to compare
        return paths
    bars = plot_case_bars(payload, out_dir / "tflops_cases.png")
    return paths + ([bars] if bars else []) + plot_families(payload, out_dir)
