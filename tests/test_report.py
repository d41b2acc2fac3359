"""``fmha report``: the markdown writer from a fixture results file, plots, and the no-GPU path."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fmha
from fmha.testing import random_qkv

from fmha.tools.bench.cases import suite_cases
from fmha.tools.bench.peers import FMHA_PROVIDERS
from fmha.tools.bench.runner import validate_results
from fmha.tools.cli import main
from fmha.tools.report.ladder import INTERPRETER_CASE
from fmha.tools.report.markdown import render_report
from fmha.tools.report.plots import families, make_plots

FIXTURE = Path(__file__).parent / "fixtures" / "h100_seeds_results.json"


@pytest.fixture
def payload():
    return json.loads(FIXTURE.read_text())


def section(text: str, title: str) -> str:
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_report_has_every_section(payload):
    text = render_report(payload)
    for title in ("The ladder", "Against the peers", "Bytes moved", "Registers and spills", "Analysis"):
        assert f"## {title}" in text
    assert "NVIDIA H100" in text and f"triton {payload['environment']['triton']}" in text


def rows_of(payload, label):
    return {r["provider"]: r for r in payload["rows"] if r["label"] == label}


def test_ladder_table_has_each_step_and_names_the_kernel(payload):
    ladder = section(render_report(payload), "The ladder")
    assert "| case | step | row | kernel | TFLOP/s | µs/head | speedup over naive | status |" in ladder
    for number, name in (("2", "naive"), ("3", "triton_heuristic"), ("4", "triton_tuned"), ("5", "fmha")):
        assert f"| {number} | `{name}` |" in ladder
    label = payload["rows"][0]["label"]
    rows = rows_of(payload, label)
    fmha_row, naive = rows["fmha"], rows["naive"]
    assert f"| {label} | 5 | `fmha` | {fmha_row['backend']} {fmha_row['config']} ({fmha_row['config_source']}) |" in ladder
    assert f"{fmha_row['tflops'] / naive['tflops']:.1f}×" in ladder
    heuristic = rows["triton_heuristic"]
    assert f"| {label} | 3 | `triton_heuristic` | triton {heuristic['config']} (heuristic) |" in ladder


def test_peer_table_ratios_are_the_default_path_to_the_best_peer(payload):
    peers = section(render_report(payload), "Against the peers")
    label = payload["rows"][0]["label"]
    rows = rows_of(payload, label)
    best = max((r for n, r in rows.items() if n not in FMHA_PROVIDERS and r["status"] == "ok"),
               key=lambda r: r["tflops"])
    assert f"best peer: {best['provider']}" in peers
    headline = next(line for line in peers.splitlines() if line.startswith("| **fmha** |"))
    assert f"| {rows['fmha']['tflops'] / best['tflops']:.2f}× |" in headline
    assert rows["fmha"]["backend"] in headline
    assert "| 1.00× |" in peers  # the best peer itself


def test_analysis_compares_the_default_path_with_the_peers(payload):
    analysis = section(render_report(payload), "Analysis")
    cases = [rows_of(payload, label) for label in dict.fromkeys(r["label"] for r in payload["rows"])]
    ratios = [rows["fmha"]["tflops"] / rows["sdpa_cudnn"]["tflops"] for rows in cases]
    low, high = f"{min(ratios):.2f}", f"{max(ratios):.2f}"
    assert f"Over {len(ratios)} cases fmha is {low}–{high}× SDPA cuDNN." in analysis
    backend = payload["rows"][0]["backend"]
    assert f"The default path ran {backend} on " in analysis


def test_registers_table_lists_compiled_kernels(payload):
    registers = section(render_report(payload), "Registers and spills")
    kernel = payload["kernels"][0]
    assert f"`{kernel['kernel']}`" in registers and f"| {kernel['registers']} |" in registers


def test_every_analysis_sentence_states_a_number(payload):
    analysis = section(render_report(payload), "Analysis")
    sentences = [line for line in analysis.splitlines() if line.startswith("- ")]
    assert len(sentences) >= 5
    for sentence in sentences:
        if "no measurement" in sentence:
            continue
        assert re.search(r"\d", sentence), sentence


def test_plots_are_written(payload, tmp_path):
    paths = make_plots(payload, tmp_path)
    assert (tmp_path / "ladder.png") in paths and len(paths) >= 2
    assert all(path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG" for path in paths)


def _timed_rows(cases, providers=("fmha", "sdpa_cudnn")):
    return [{"case": case.to_dict(), "label": case.label, "provider": name, "status": "ok",
             "tflops": 100.0 + index} for index, case in enumerate(cases) for name in providers]


def test_plot_lines_join_only_cases_that_differ_in_sequence_length():
    lines, bars = families(_timed_rows(suite_cases(["seeds", "std"], modes=("fwd", "fwdbwd"))))
    # std: per (mode, D, causal) one family of B·S = 16384 tokens over S = 1k, 4k, 16k.
    assert len(lines) == 2 * 2 * 2
    for key, providers in lines.items():
        assert key[-1] == 16384 and set(providers) == {"fmha", "sdpa_cudnn"}
        assert [x for x, _ in providers["fmha"]] == [1024, 4096, 16384]
    # seeds: B8 and B1 at S1024 (and B16 at S2048) share no line: each is a bar.
    assert sorted({row["label"] for row in bars}) == sorted(case.label for case in suite_cases(["seeds"], ("fwd", "fwdbwd")))


def test_plot_families_never_draw_two_cases_at_one_x():
    cases = suite_cases([], shapes=["2,8,8,512,1024,64", "1,8,8,1024,1024,64", "1,8,8,1024,2048,64"])
    lines, bars = families(_timed_rows(cases))
    # The same B·Sq (1024) but two cases at Sk = 1024: bars, not a vertical line.
    assert lines == {} and len({row["label"] for row in bars}) == 3


def check_no_gpu_report(out: Path, stdout: str):
    payload = json.loads((out / "results.json").read_text())
    validate_results(payload)
    assert payload["interpreter"] is True
    rows = {row["provider"]: row for row in payload["rows"]}
    for name in ("fmha", "naive", "triton_heuristic"):
        assert rows[name]["status"] == "ok" and rows[name]["rel_err"] < 1e-5
    case = INTERPRETER_CASE
    explained = fmha.explain(*random_qkv(case.batch, case.q_heads, case.kv_heads, case.seqlen_q, case.seqlen_k,
                                         case.head_dim, torch.float32), causal=case.causal)
    assert rows["fmha"]["backend"] == "triton" and rows["fmha"]["config_source"] == explained.source
    assert rows["triton_heuristic"]["config_source"] == "heuristic"
    assert rows["triton_tuned"]["status"] == "unavailable" and "does not autotune" in rows["triton_tuned"]["error"]
    assert all(rows[name]["status"] == "skipped" for name in ("sdpa_flash", "sdpa_cudnn", "flex"))
    text = (out / "report.md").read_text()
    assert "No GPU" in text and "not meaningful" in text and "peers were skipped" in text
    assert "not built yet" not in text
    # No speed from interpreter timings: no rates, ratios or speed-ups anywhere in the report.
    assert "TFLOP/s" not in text and "GB/s" not in text and "speedup" not in text
    assert not re.search(r"\d\.\d+×", text)  # ratios (tile sizes such as 64×32 are not)
    assert "| 4 | `triton_tuned` | — | unavailable: Triton's interpreter does not autotune" in text
    assert [path.name for path in out.glob("*.png")] == ["ladder.png"]
    # The log is not wrapped at 80 columns: each row of the case table is one line.
    assert any("triton_tuned" in line and "does not autotune; row fmha shows what fmha.attention runs there" in line
               for line in stdout.splitlines())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
@pytest.mark.interpreter
def test_report_without_gpu_runs_the_ladder_and_names_ignored_options(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["report", "--suite", "std", "--dtype", "fp16", "--out", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    check_no_gpu_report(tmp_path, stdout)
    assert "note: no CUDA device, so --suite, --dtype are ignored" in stdout
    assert "- Ignored without a GPU: --suite, --dtype." in (tmp_path / "report.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_report_command_sets_the_interpreter_itself(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "COLUMNS")}
    result = subprocess.run([sys.executable, "-m", "fmha", "report", "--out", str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    check_no_gpu_report(tmp_path, result.stdout)
    assert "note:" not in result.stdout  # nothing was ignored


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_bench_without_gpu_says_so(capsys):
    assert main(["bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
