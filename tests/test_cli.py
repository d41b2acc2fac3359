"""The ``fmha`` command line."""

import argparse
import re
import subprocess
import sys

import pytest
import torch

import fmha
from fmha.tools.bench.cases import SUITES, suite_cases
from fmha.tools.bench.peers import PEERS
from fmha.tools.cli import NO_CUDA_MESSAGE, build_parser, info_lines, main, parse_args
from fmha.tools.console import LOG_WIDTH, make_console


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


# Options: one shape parser, --shape replacing the default suites, help for everything.

BAD_SHAPES = [("1,2,3", "has 3 fields"), ("1,6,4,128,128,64", "Hq must be a multiple of Hkv"),
              ("1,2,2,8,8,300", "D must be 1..256"), ("0,2,2,8,8,64", "B must be a positive integer")]


@pytest.mark.parametrize("command", ["bench", "report", "tune"])
@pytest.mark.parametrize("shape, message", BAD_SHAPES)
def test_every_command_rejects_a_bad_shape_like_argparse(command, shape, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--shape", shape])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"fmha {command}: error: argument --shape" in error and message in error
    assert "B,Hq,Hkv,Sq,Sk,D[,causal]" in error and "Traceback" not in error


def test_shape_replaces_the_default_suites_unless_suite_is_given():
    shape = "2,32,8,4096,4096,128,causal"
    for command, default in (("bench", ["seeds", "std"]), ("report", ["seeds"]), ("tune", ["seeds", "std"])):
        assert parse_args([command]).suite == default
        args = parse_args([command, "--shape", shape])
        assert args.suite == [] and [case.shape_text for case in args.shape] == [shape]
        assert parse_args([command, "--suite", "seeds", "--shape", shape]).suite == ["seeds"]
        assert parse_args([command, "--suite"]).suite == []


def test_tune_with_a_shape_tunes_that_key_only(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # pytest-xdist's workers set it to 80: rich would wrap
    assert main(["tune", "--dry-run", "--shape", "2,32,8,4096,4096,128,causal"]) == 0
    keys = [line for line in capsys.readouterr().out.splitlines() if "candidates," in line]
    assert len(keys) == 1 and keys[0].startswith("fwd|bfloat16|d128|causal|g4|q4096|k4096")


def test_explicit_options_are_recorded_for_the_no_gpu_note():
    args = parse_args(["report", "--suite", "std", "--dtype", "fp16", "--out", "x"])
    assert args.explicit == ["--suite", "--dtype"]
    assert args.mode == ["fwd"] and args.dtype == "fp16" and args.providers[0] == "fmha"
    assert parse_args(["report"]).explicit == []


def _options(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from ((f"{name} {option}", help) for option, help in _options(subparser))
        elif action.option_strings:
            yield "/".join(action.option_strings), action.help


def test_every_option_has_help():
    options = dict(_options(build_parser()))
    assert "tune --shape" in options and "report --providers" in options and "bench --list" in options
    assert not [option for option, help in options.items() if not help]


@pytest.mark.parametrize("command", ["bench", "report"])
def test_help_explains_suites_and_providers(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name in (*SUITES, *PEERS):
        assert re.search(rf"^  {name} ", text, re.MULTILINE), name
    assert "default path" in text and "replaces the" in text


def test_list_prints_every_suite_case_and_provider(capsys):
    assert main(["bench", "--list"]) == 0
    text = capsys.readouterr().out
    assert "--shape 32,32,8,1,8192,128" in text  # decode
    assert all(f"--shape {case.shape_text}" in text for case in suite_cases(["seeds", "std"]))
    assert "triton_heuristic" in text and "sdpa_cudnn" in text
    assert main(["tune", "--list"]) == 0
    assert "sdpa_cudnn" not in capsys.readouterr().out  # tune times fmha's own kernels only


# Output: logs (no terminal) get whole lines.

def test_console_is_wide_without_a_terminal(capsys, monkeypatch):
    from rich.table import Table

    monkeypatch.delenv("COLUMNS", raising=False)
    console = make_console()
    assert console.width == LOG_WIDTH
    table = Table("provider", "status")
    reason = "unavailable:" + " a long reason" * 8
    table.add_row("triton_tuned", reason)
    console.print(table)
    console.print("x" * 300)
    lines = capsys.readouterr().out.splitlines()
    assert any("triton_tuned" in line and reason in line for line in lines)  # one row, one line
    assert "x" * 300 in lines


def test_the_features_suite_runs_through_bench_and_report_but_not_tune(capsys):
    args = parse_args(["bench", "--suite", "features", "--mode", "fwd", "fwdbwd"])
    assert args.suite == ["features"] and args.mode == ["fwd", "fwdbwd"] and "varlen_attn" in args.providers
    window = "1,16,16,16384,16384,128,causal,window=1023:0"
    assert [case.window for case in parse_args(["report", "--shape", window]).shape] == [(1023, 0)]
    assert main(["bench", "--list"]) == 0
    text = capsys.readouterr().out
    assert f"--shape {window}" in text and "lengths=862:1654:712:3359:1799:1201:2383:3162:1252" in text
    assert main(["tune", "--list"]) == 0
    assert "features" not in capsys.readouterr().out  # tune keys on plain attention
    for argv in (["tune", "--suite", "features"], ["tune", "--shape", window]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    assert "fmha tune tunes plain attention; drop window=1023:0" in capsys.readouterr().err


def test_bench_help_names_the_shape_options(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "window=LEFT:RIGHT" in capsys.readouterr().out
