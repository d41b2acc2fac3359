"""PNG plots from a results payload: the ladder as bars, TFLOP/s against sequence length."""

from __future__ import annotations

from pathlib import Path

from .ladder import STEPS

STEP_COLOURS = {"naive": "#999999", "fmha": "#1f77b4", "fmha_tuned": "#2ca02c"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ladder(payload: dict, path: Path) -> Path | None:
    """Grouped bars: one group per case, one bar per step 2-4 (absent bars were not measured)."""
    labels = list(dict.fromkeys(row["label"] for row in payload["rows"]))
    tflops = {(row["label"], row["provider"]): row["tflops"] for row in payload["rows"]
              if row["status"] == "ok" and row.get("tflops")}
    if not any(provider in STEP_COLOURS for _, provider in tflops):
        return None
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(max(6.0, 1.6 * len(labels)), 4.0))
    width = 0.8 / 3
    for index, (number, provider, _) in enumerate(STEPS[1:]):
        values = [tflops.get((label, provider), 0.0) for label in labels]
        positions = [i + (index - 1) * width for i in range(len(labels))]
        label = f"step {number}: {provider}" + ("" if any(values) else " (not measured)")
        axes.bar(positions, values, width, label=label, color=STEP_COLOURS[provider])
    axes.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    axes.set_ylabel("TFLOP/s")
    axes.set_title("The ladder: naive → fused → tuned")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def plot_scaling(payload: dict, out_dir: Path) -> list[Path]:
    """One plot per (D, causal, mode): TFLOP/s against Sk, one line per provider."""
    groups: dict[tuple, dict[str, list[tuple[int, float]]]] = {}
    for row in payload["rows"]:
        if row["status"] != "ok" or not row.get("tflops"):
            continue
        case = row["case"]
        key = (case["head_dim"], case["causal"], case["mode"])
        groups.setdefault(key, {}).setdefault(row["provider"], []).append((case["seqlen_k"], row["tflops"]))
    paths = []
    for (head_dim, causal, mode), providers in sorted(groups.items()):
        plt = _pyplot()
        figure, axes = plt.subplots(figsize=(6.0, 4.0))
        for provider, points in sorted(providers.items()):
            points.sort()
            axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=provider)
        axes.set_xscale("log", base=2)
        axes.set_xlabel("sequence length (keys)")
        axes.set_ylabel("TFLOP/s")
        axes.set_title(f"D={head_dim}, {'causal' if causal else 'non-causal'}, {mode}")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        path = out_dir / f"tflops_d{head_dim}_{'causal' if causal else 'full'}_{mode}.png"
        figure.savefig(path, dpi=120)
        plt.close(figure)
        paths.append(path)
    return paths


def make_plots(payload: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    ladder = plot_ladder(payload, out_dir / "ladder.png")
    return ([ladder] if ladder else []) + plot_scaling(payload, out_dir)
