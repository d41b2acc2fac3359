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
    with pytest.raises(ValueError, match="--shape"):
        parse_shape("1,2,3")


def test_fixture_results_follow_the_schema():
    payload = json.loads(FIXTURE.read_text())
    validate_results(payload)
    assert payload["environment"]["device"].startswith("NVIDIA H100")


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.pop("rows"), "rows"),
    (lambda p: p["environment"].pop("triton"), "triton"),
    (lambda p: p.update(schema="other/9"), "schema"),
    (lambda p: p["rows"][0].pop("tflops"), "tflops"),
    (lambda p: p["rows"][1].pop("error"), "no error"),
])
def test_schema_violations_are_named(damage, message):
    payload = copy.deepcopy(json.loads(FIXTURE.read_text()))
    assert payload["rows"][0]["status"] == "ok" and payload["rows"][1]["status"] != "ok"
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
