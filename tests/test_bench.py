"""Benchmark plumbing that needs no GPU: cases, FLOP and byte models, limits, results schema."""

import copy
import json
from pathlib import Path

import pytest

from fmha.tools.bench.cases import Case, parse_shape, suite_cases
from fmha.tools.bench.metrics import ChipLimits, attention_flops, fused_bytes, naive_bytes, tflops
from fmha.tools.bench.runner import validate_results
from fmha.cache import read_json, write_json_atomic

FIXTURE = Path(__file__).parent / "fixtures" / "h100_seeds_results.json"


def test_flops_follow_the_design_formula():
    case = Case(2, 8, 2, 128, 256, 64)
    assert attention_flops(case) == 4 * 2 * 8 * 128 * 256 * 64
    assert attention_flops(Case(2, 8, 2, 128, 256, 64, causal=True)) == attention_flops(case) / 2
    assert attention_flops(Case(2, 8, 2, 128, 256, 64, mode="fwdbwd")) == 3.5 * attention_flops(case)
    assert tflops(case, 1.0) == pytest.approx(attention_flops(case) / 1e-3 / 1e12)


def test_fused_bytes_read_qkv_and_write_o_and_lse_once():
    case = Case(2, 8, 2, 128, 256, 64)
    q = o = 2 * 8 * 128 * 64 * 2
    k = v = 2 * 2 * 256 * 64 * 2
    lse = 2 * 8 * 128 * 4
    assert fused_bytes(case, 2) == q + k + v + o + lse
    # Causal masking does not change what must be read and written.
    assert fused_bytes(Case(2, 8, 2, 128, 256, 64, causal=True), 2) == fused_bytes(case, 2)


def test_naive_bytes_count_s_and_p_twice():
    case = Case(1, 2, 1, 16, 32, 8)
    scores = 1 * 2 * 16 * 32
    q = o = 2 * 16 * 8 * 2
    k = v = 1 * 32 * 8 * 2
    rows = 2 * 16 * 4
    expected = (q + k + 4 * scores) + (4 * scores + 2 * scores + 2 * rows) + (2 * scores + v + rows + o)
    assert naive_bytes(case, 2) == expected
    assert naive_bytes(case, 2) > 10 * fused_bytes(case, 2) / 2


def test_roofline_bound_picks_the_slower_limit():
    limits = ChipLimits(matmul_tflops=1000.0, copy_gbps=1000.0)
    assert limits.bound_ms(1e12, 1e6) == (pytest.approx(1.0), "compute")
    assert limits.bound_ms(1e6, 1e9) == (pytest.approx(1.0), "memory")
    percent, bound = limits.percent_of_limit(1e12, 1e6, 2.0)
    assert percent == pytest.approx(50.0) and bound == "compute"


def test_suites_and_modes():
    assert len(suite_cases(["seeds"])) == 3
    std = suite_cases(["std"], modes=("fwd", "fwdbwd"))
    assert len(std) == 24 and {case.mode for case in std} == {"fwd", "fwdbwd"}
    assert all(case.batch * case.seqlen_q == 16384 and case.q_heads * case.head_dim == 2048 for case in std)
    (decode,) = suite_cases(["decode"])
    assert (decode.batch, decode.q_heads, decode.kv_heads, decode.seqlen_q, decode.seqlen_k) == (32, 32, 8, 1, 8192)
    custom = suite_cases([], shapes=["2,8,2,100,300,80,causal"])
    assert custom == [Case(2, 8, 2, 100, 300, 80, True)]
    with pytest.raises(ValueError, match="mode"):
        suite_cases(["seeds"], modes=("bwd!",))
    assert suite_cases([], modes=("fwd", "bwd"), shapes=[parse_shape("1,4,2,64,64,32")]) == [
        Case(1, 4, 2, 64, 64, 32, mode="fwd"), Case(1, 4, 2, 64, 64, 32, mode="bwd")]


@pytest.mark.parametrize("text, message", [
    ("1,2,3", "has 3 fields"),
    ("1,2,2,8,8,8,causal,x", "has 8 fields"),
    ("1,2,2,8,8.5,8", "must be integers"),
    ("1,6,4,128,128,64", "Hq must be a multiple of Hkv"),
    ("1,2,2,8,8,300", "D must be 1..256"),
    ("1,2,2,8,8,0", "D must be a positive integer"),
    ("0,2,2,8,8,64", "B must be a positive integer"),
    ("1,2,2,-8,8,64", "Sq must be a positive integer"),
    ("1,2,2,8,8,64,casual", "'causal' or 'full'"),
])
def test_parse_shape_rejects_impossible_shapes_naming_the_form(text, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_shape(text)
    assert text in str(error.value)
    if "7th field" not in str(error.value):
        assert "B,Hq,Hkv,Sq,Sk,D[,causal]" in str(error.value)


def test_parse_shape_reads_the_causal_field_and_round_trips():
    assert parse_shape("2,8,2,100,300,80") == Case(2, 8, 2, 100, 300, 80)
    assert parse_shape(" 2, 8, 2, 100, 300, 80, Causal ").causal is True
    assert parse_shape("2,8,2,100,300,80,full").causal is False
    for case in suite_cases(["seeds", "std", "decode"]):
        assert parse_shape(case.shape_text) == Case(**{**case.to_dict(), "per_head": False})


def test_cases_validate_themselves():
    with pytest.raises(ValueError, match="Hq must be a multiple of Hkv"):
        Case(1, 3, 2, 8, 8, 8)
    with pytest.raises(ValueError, match="mode"):
        Case(1, 2, 2, 8, 8, 8, mode="backward")


def test_fmha_rows_come_first_and_the_headline_is_the_default_path():
    from fmha.tools.bench.peers import FMHA_PROVIDERS, PEERS

    assert FMHA_PROVIDERS == ("fmha", "naive", "triton_heuristic", "triton_tuned")
    assert list(PEERS)[:4] == list(FMHA_PROVIDERS)
    assert "default path" in PEERS["fmha"].description
    assert not any(PEERS[name].is_fmha for name in ("sdpa_flash", "sdpa_cudnn", "flex", "fa3"))


def test_summary_ratios_are_the_headline_rows():
    from fmha.tools.bench.runner import summarize

    case = {"per_head": True}
    rows = [{"label": "c", "provider": "fmha", "tflops": 400.0, "backend": "gluon_sm90", "case": case,
             "us_per_head": 1.5},
            {"label": "c", "provider": "triton_heuristic", "tflops": 300.0, "backend": "triton", "case": case},
            {"label": "c", "provider": "naive", "tflops": 50.0, "case": case},
            {"label": "c", "provider": "sdpa_cudnn", "tflops": 500.0, "case": case},
            {"label": "c", "provider": "sdpa_flash", "tflops": 250.0, "case": case}]
    (line,) = summarize(rows)
    assert line["best_peer"] == "sdpa_cudnn" and line["fmha_backend"] == "gluon_sm90"
    assert line["fmha/sdpa_cudnn"] == pytest.approx(0.8) and line["fmha/sdpa_flash"] == pytest.approx(1.6)
    assert line["fmha/naive"] == pytest.approx(8.0) and line["fmha_us_per_head"] == 1.5


def test_fixture_results_follow_the_schema():
    payload = json.loads(FIXTURE.read_text())
    validate_results(payload)
    assert payload["environment"]["device"].startswith("NVIDIA H100")


def _first(payload, ok: bool) -> dict:
    return next(row for row in payload["rows"] if (row["status"] == "ok") == ok)


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.pop("rows"), "rows"),
    (lambda p: p["environment"].pop("triton"), "triton"),
    (lambda p: p.update(schema="other/9"), "schema"),
    (lambda p: _first(p, ok=True).pop("tflops"), "tflops"),
    (lambda p: _first(p, ok=False).pop("error"), "no error"),
])
def test_schema_violations_are_named(damage, message):
    payload = copy.deepcopy(json.loads(FIXTURE.read_text()))
    damage(payload)
    with pytest.raises(ValueError, match=message):
        validate_results(payload)


def test_cache_json_round_trip_and_corrupt_file(tmp_path):
    path = tmp_path / "sub" / "limits.json"
    assert read_json(path) == {}
    write_json_atomic(path, {"gpu": {"matmul_tflops": 1.5}})
    assert read_json(path) == {"gpu": {"matmul_tflops": 1.5}}
    assert [p.name for p in path.parent.iterdir()] == ["limits.json"]  # no temporary left behind
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        assert read_json(path) == {}
