"""``fmha report`` on a GPU, at one small custom shape (marker ``gpu``)."""

import json

import pytest
import torch

import fmha
from fmha.tools.bench.runner import validate_results
from fmha.tools.cli import main

pytestmark = pytest.mark.gpu


def test_report_on_gpu_times_the_ladder_and_reads_kernel_resources(tmp_path, monkeypatch):
    # Other test processes may share the GPU: keep the chip limits measured here out of the user's cache.
    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path / "cache"))
    args = ["report", "--shape", "2,4,2,256,256,64,causal",
            "--providers", "fmha", "naive", "triton_heuristic", "triton_tuned", "sdpa_flash", "--out", str(tmp_path)]
    assert main(args) == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    validate_results(payload)
    assert payload["suites"] == [] and payload["shapes"] == ["2,4,2,256,256,64,causal"]  # --shape replaced seeds
    rows = {row["provider"]: row for row in payload["rows"]}
    assert set(rows) == {"fmha", "naive", "triton_heuristic", "triton_tuned", "sdpa_flash"}
    for name in ("fmha", "triton_heuristic", "naive"):
        assert rows[name]["status"] == "ok" and rows[name]["rel_err"] < 2e-2, rows[name]
        assert rows[name]["method"] in ("do_bench", "cuda_graph") and rows[name]["tflops"] > 0
    # The headline row is exactly the default path, and says which kernel that is.
    q = torch.empty(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    explanation = fmha.explain(q, k, k, causal=True)
    assert rows["fmha"]["backend"] == explanation.backend and rows["fmha"]["config_source"] == explanation.source
    assert rows["triton_heuristic"]["backend"] == "triton" and rows["triton_heuristic"]["config_source"] == "heuristic"
    # Step 4 runs when this GPU has tuned tiles (shipped or cached) for the key, else says why not.
    from fmha.params import attention_params
    from fmha.tuning.lookup import portable_config

    _, source = portable_config(attention_params("test", q, k, k, causal=True), autotune=False)
    if source.startswith("heuristic"):
        assert rows["triton_tuned"]["status"] == "unavailable" and "not tuned" in rows["triton_tuned"]["error"]
    else:
        assert rows["triton_tuned"]["status"] == "ok" and rows["triton_tuned"]["rel_err"] < 2e-2
        assert rows["triton_tuned"]["backend"] == "triton" and rows["triton_tuned"]["config_source"] == source
    (line,) = payload["summary"]
    assert line["fmha"] == rows["fmha"]["tflops"] and line["fmha_backend"] == explanation.backend
    fused = next(k for k in payload["kernels"] if k["step"].startswith("fused"))
    assert fused["registers"] > 0 and fused["spills"] >= 0 and fused["shared_bytes"] > 0
    assert payload["chip_limits"]["matmul_tflops"] > 0
    text = (tmp_path / "report.md").read_text()
    assert "## Registers and spills" in text and f"| **fmha** | {explanation.backend} " in text
    assert "not meaningful" not in text
