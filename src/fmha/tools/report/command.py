"""``fmha bench`` and ``fmha report``: collect results with a progress bar, then write them."""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from fmha.tools.bench.cases import parse_shape, suite_cases
from fmha.tools.bench.peers import PEERS
from fmha.tools.bench.runner import write_results
from fmha.tools.console import make_console

from .ladder import build_payload, invariant_step, run_ladder_gpu, run_ladder_interpreter

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _runs(row: dict) -> str:
    if row.get("backend") in (None, "naive"):
        return row.get("backend") or ""
    return f"{row['backend']} {row.get('config', '')}"


def _case_table(label: str, rows: list[dict], timed: bool = True) -> Table:
    table = Table(title=label, title_justify="left", show_edge=False)
    columns = ["provider", "kernel"] + (["TFLOP/s", "µs", "µs/head", "timing"] if timed else []) + ["status"]
    for column in columns:
        table.add_column(column, justify="right" if column in ("TFLOP/s", "µs", "µs/head") else "left")
    for row in rows:
        cells = [row["provider"], _runs(row)]
        if timed:
            if row["status"] == "ok":
                cells += [f"{row['tflops']:.1f}", f"{row['us']:.1f}", f"{row['us_per_head']:.3f}", row["method"]]
            else:
                cells += ["—"] * 4
        status = "ok" if row["status"] == "ok" else f"{row['status']}: {row.get('error', '')}"[:120]
        if row["status"] == "ok" and row.get("rel_err") is not None:
            status += f" (rel. err {row['rel_err']:.1e})"
        table.add_row(*cells, status)
    return table


def summary_table(payload: dict) -> Table:
    table = Table(title="fmha (the default path) against the peers (TFLOP/s)", title_justify="left")
    table.add_column("case")
    table.add_column("fmha runs")
    for name in ("fmha", "triton_tuned", "naive", "sdpa_flash", "sdpa_cudnn", "best peer", "fmha/flash",
                 "fmha/cuDNN", "fmha/best"):
        table.add_column(name, justify="right")
    for line in payload["summary"]:
        def cell(key, digits=1, suffix=""):
            value = line.get(key)
            return "—" if value is None else f"{value:.{digits}f}{suffix}"
        table.add_row(line["label"], line.get("fmha_backend") or "—", cell("fmha"), cell("triton_tuned"),
                      cell("naive"), cell("sdpa_flash"), cell("sdpa_cudnn"), line.get("best_peer", "—"),
                      cell("fmha/sdpa_flash", 2, "×"), cell("fmha/sdpa_cudnn", 2, "×"), cell("fmha/best_peer", 2, "×"))
    return table


def collect(*, suites, modes, shapes, providers, dtype: str, memory: bool, console: Console,
            ignored_options=()) -> dict:
    """Run the invariant, then every case and provider; returns the results payload."""
    invariant = invariant_step()
    console.print(f"step 1 (invariant, NumPy): {invariant['status']}, max rel. error {invariant['max_rel_error']:.1e}")
    if not torch.cuda.is_available():
        console.print("[yellow]No CUDA device: fmha's rows run through Triton's interpreter at one tiny shape, one "
                      "call each; interpreter timings are not meaningful and the peers are skipped.[/yellow]")
        rows = run_ladder_interpreter()
        console.print(_case_table(rows[0]["label"], rows, timed=False))
        return build_payload(suites=[], modes=["fwd"], dtype="float32", providers=list(PEERS), rows=rows,
                             kernels=[], invariant=invariant, interpreter=True, ignored_options=ignored_options)

    from fmha.tools.bench.limits import chip_limits

    with console.status("chip limits (bf16 matmul, device copy)..."):
        limits, source = chip_limits()
    console.print(f"chip limits ({source}): bf16 matmul {limits.matmul_tflops:.0f} TFLOP/s, "
                  f"copy {limits.copy_gbps:.0f} GB/s")
    shapes = [parse_shape(shape) if isinstance(shape, str) else shape for shape in shapes]
    cases = suite_cases(suites, modes, shapes)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("left"), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("benchmark", total=len(cases) * len(providers))
        current: list[dict] = []

        def on_row(row):
            current.append(row)
            progress.update(task, advance=1, description=f"{row['label']} {row['provider']}")

        def on_case(case):
            progress.console.print(_case_table(case.label, current))
            current.clear()

        rows, kernels = run_ladder_gpu(cases, providers, DTYPES[dtype], limits=limits, on_row=on_row,
                                       on_case=on_case)
    memory_result = None
    if memory:
        from fmha.tools.bench.runner import memory_check

        with console.status("memory check (S = 131072)..."):
            memory_result = memory_check()
        console.print(f"memory check: {memory_result}")
    return build_payload(suites=suites, modes=modes, dtype=str(DTYPES[dtype]).removeprefix("torch."),
                         providers=providers, rows=rows, kernels=kernels, invariant=invariant, limits=limits,
                         limits_source=source, memory=memory_result, shapes=shapes)


def run_bench(args) -> int:
    console = make_console()
    if not torch.cuda.is_available():
        console.print("fmha bench needs a CUDA GPU; none is visible. `fmha report` runs fmha's rows "
                      "through the interpreter instead.")
        return 2
    payload = collect(suites=args.suite, modes=args.mode, shapes=args.shape, providers=args.providers,
                      dtype=args.dtype, memory=args.memory_check, console=console)
    path = Path(args.out) / "bench.json"
    write_results(path, payload)
    console.print(summary_table(payload))
    console.print(f"wrote {path}")
    return 0


def run_report(args) -> int:
    from .markdown import render_report
    from .plots import make_plots

    console = make_console()
    out = Path(args.out)
    ignored = [] if torch.cuda.is_available() else list(getattr(args, "explicit", ()))
    if ignored:
        console.print(f"[yellow]note: no CUDA device, so {', '.join(ignored)} "
                      f"{'is' if len(ignored) == 1 else 'are'} ignored: the interpreter runs one tiny fixed "
                      "shape (float32, forward).[/yellow]")
    payload = collect(suites=args.suite, modes=args.mode, shapes=args.shape, providers=args.providers,
                      dtype=args.dtype, memory=args.memory_check, console=console, ignored_options=ignored)
    write_results(out / "results.json", payload)
    plots = [path.name for path in make_plots(payload, out)]
    (out / "report.md").write_text(render_report(payload, plots))
    if payload["summary"] and not payload.get("interpreter"):
        console.print(summary_table(payload))
    console.print(f"wrote {out / 'report.md'}, {out / 'results.json'} and {len(plots)} plots")
    return 0
