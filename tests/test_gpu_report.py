"""``fmha report`` on a GPU, at one small custom shape (marker ``gpu``)."""

import json

import pytest
import torch

from fmha.tools.bench.runner import validate_results
from fmha.tools.cli import main

pytestmark = pytest.mark.gpu


def test_report_on_gpu_times_the_ladder_and_reads_kernel_resources(tmp_path, monkeypatch):
    # Other test processes may share the GPU: keep the chip limits measured here out of the user's cache.
    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path / "cache"))
    args = ["report", "--suite", "--shape", "2,4,2,256,256,64,causal",
            "--providers", "fmha", "naive", "fmha_tuned", "sdpa_flash", "--out", str(tmp_path)]
    assert main(args) == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    validate_results(payload)
    rows = {row["provider"]: row for row in payload["rows"]}
    assert rows["fmha"]["status"] == "ok" and rows["fmha"]["rel_err"] < 2e-2
    assert rows["naive"]["status"] == "ok"
    # Step 4 runs when this GPU has a tuned config (shipped or cached) for the key, else says why not.
    from fmha.tuning.lookup import explain_forward_config

    _, source = explain_forward_config("cuda", torch.bfloat16, 64, True, 4, 2, 256, 256)
    if source in ("cache", "shipped"):
        assert rows["fmha_tuned"]["status"] == "ok" and rows["fmha_tuned"]["rel_err"] < 2e-2
    else:
        assert rows["fmha_tuned"]["status"] == "unavailable" and "not tuned" in rows["fmha_tuned"]["error"]
    assert rows["fmha"]["method"] in ("do_bench", "cuda_graph") and rows["fmha"]["tflops"] > 0
    fused = next(k for k in payload["kernels"] if k["step"].startswith("fused"))
    assert fused["registers"] > 0 and fused["spills"] >= 0 and fused["shared_bytes"] > 0
    assert payload["chip_limits"]["matmul_tflops"] > 0
    assert "## Registers and spills" in (tmp_path / "report.md").read_text()
