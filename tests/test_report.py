"""``fmha report``: the markdown writer from a fixture results file, plots, and the no-GPU path."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fmha.tools.bench.runner import validate_results
from fmha.tools.cli import main
from fmha.tools.report.markdown import render_report
from fmha.tools.report.plots import make_plots

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


def test_ladder_table_has_each_step_with_speedup_over_naive(payload):
    ladder = section(render_report(payload), "The ladder")
    assert "| case | step | strategy | TFLOP/s | µs/head | speedup over naive | status |" in ladder
    fused = next(r for r in payload["rows"] if r["provider"] == "fmha" and r["status"] == "ok")
    naive = next(r for r in payload["rows"] if r["provider"] == "naive" and r["label"] == fused["label"])
    assert f"{fused['tflops'] / naive['tflops']:.1f}×" in ladder
    assert "| 1 |" in ladder and "| 2 |" in ladder and "| 3 |" in ladder
    assert "not tuned" in ladder  # step 4 until the autotuner exists


def test_peer_table_ratios_are_to_the_best_peer(payload):
    peers = section(render_report(payload), "Against the peers")
    label = payload["rows"][0]["label"]
    rows = {r["provider"]: r for r in payload["rows"] if r["label"] == label}
    best = max((r for n, r in rows.items() if n not in ("fmha", "naive", "fmha_tuned") and r["status"] == "ok"),
               key=lambda r: r["tflops"])
    assert f"best peer: {best['provider']}" in peers
    assert f"| {rows['fmha']['tflops'] / best['tflops']:.2f}× |" in peers
    assert "| 1.00× |" in peers  # the best peer itself


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


def check_no_gpu_report(out: Path):
    payload = json.loads((out / "results.json").read_text())
    validate_results(payload)
    assert payload["interpreter"] is True
    rows = {row["provider"]: row for row in payload["rows"]}
    assert rows["fmha"]["status"] == "ok" and rows["naive"]["status"] == "ok"
    assert rows["fmha"]["rel_err"] < 1e-5
    assert rows["sdpa_flash"]["status"] == "skipped"
    text = (out / "report.md").read_text()
    assert "No GPU" in text and "not meaningful" in text and "peers were skipped" in text
    assert (out / "ladder.png").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
@pytest.mark.interpreter
def test_report_without_gpu_runs_the_ladder_through_the_interpreter(tmp_path):
    assert main(["report", "--out", str(tmp_path)]) == 0
    check_no_gpu_report(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_report_command_sets_the_interpreter_itself(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "fmha", "report", "--out", str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    check_no_gpu_report(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_bench_without_gpu_says_so(capsys):
    assert main(["bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
