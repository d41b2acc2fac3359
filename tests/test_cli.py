"""The ``fmha`` command line."""

import subprocess
import sys

import torch

import fmha
from fmha.tools.cli import NO_CUDA_MESSAGE, info_lines, main


def test_info_lists_versions_and_peers(capsys):
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"fmha {fmha.__version__}" in text and f"torch {torch.__version__}" in text and "triton " in text
    assert "sdpa flash_attention" in text and "flash_attn (FA2)" in text
    if not torch.cuda.is_available():
        assert NO_CUDA_MESSAGE in text


def test_info_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "fmha", "info"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"fmha {fmha.__version__}"


def test_info_lines_have_one_gpu_line_or_the_no_cuda_message():
    lines = info_lines()
    gpu_lines = [line for line in lines if line.startswith("GPU ")]
    assert gpu_lines or NO_CUDA_MESSAGE in lines
