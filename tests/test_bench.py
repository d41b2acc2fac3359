"""Benchmark plumbing that needs no GPU: cases, FLOP and byte models, limits, results schema."""

import copy
import json
from dataclasses import replace
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
    for case in suite_cases(["seeds", "std", "decode", "wide", "dims"]):
        assert parse_shape(case.shape_text) == Case(**{**case.to_dict(), "per_head": False})


def test_the_wide_suite_holds_the_std_tokens_at_head_dim_256():
    wide, std = suite_cases(["wide"]), suite_cases(["std"])
    assert {case.head_dim for case in wide} == {256} and len(wide) == len(std) // 2 == 6
    tokens = {case.batch * case.seqlen_q * case.q_heads * case.head_dim for case in wide + std}
    assert tokens == {16384 * 2048}


def test_the_dims_suite_holds_head_dims_between_the_tile_widths():
    cases = suite_cases(["dims"])
    assert len(cases) == 12 and {case.causal for case in cases} == {False, True}
    assert all(case.head_dim not in (64, 128, 256) and case.head_dim % 8 == 0 for case in cases)


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


# The features suite: windows, packed sequences (varlen) and score features.

def test_features_suite_holds_the_cases_of_the_issues():
    from fmha.tools.bench.cases import NINE_SEQUENCES, one_long_many_short

    cases = suite_cases(["features"], modes=("fwd", "fwdbwd"))
    assert {case.mode for case in cases} == {"fwd", "fwdbwd"} and len(cases) == 2 * len(suite_cases(["features"]))
    windows = [case for case in cases if case.window is not None]
    assert {case.window for case in windows} == {(1023, 0), (4095, 0)}
    assert all((case.batch, case.q_heads, case.seqlen_q, case.head_dim, case.causal) == (1, 16, 16384, 128, True)
               for case in windows)
    packed = [case for case in cases if case.lengths is not None]
    assert NINE_SEQUENCES == (862, 1654, 712, 3359, 1799, 1201, 2383, 3162, 1252)
    assert all(case.tokens == (16384, 16384) and case.causal and case.q_heads == 16 for case in packed)
    balance = one_long_many_short()
    assert balance == one_long_many_short()  # a fixed seed: the same case every run
    assert len(balance) == 64 and balance[-1] == 8192 and max(balance[:-1]) <= 300 and min(balance) >= 1
    assert NINE_SEQUENCES in {case.lengths for case in packed} and balance in {case.lengths for case in packed}
    scored = {(case.softcap, case.alibi, case.sinks, case.dropout, case.head_dim) for case in cases
              if case.scores_modified}
    assert scored == {(30.0, False, False, 0.0, 128), (0.0, True, False, 0.0, 128), (0.0, False, True, 0.0, 64),
                      (0.0, False, False, 0.1, 128)}
    assert len({case.label for case in cases}) == len(cases)


def _brute_force_pairs(seqlen_q, seqlen_k, window) -> int:
    from fmha.masking import visible_mask

    return seqlen_q * seqlen_k if window is None else int(visible_mask(seqlen_q, seqlen_k, window).sum())


@pytest.mark.parametrize("causal, window, seqlen_q, seqlen_k", [
    (True, (7, 0), 40, 56), (True, (7, 3), 56, 40), (False, (5, 9), 33, 33), (False, (None, 4), 20, 70),
    (True, (0, None), 17, 17), (False, (100, 100), 9, 12), (True, (3, None), 60, 8),
])
def test_window_flops_count_the_visible_pairs_exactly(causal, window, seqlen_q, seqlen_k):
    case = Case(2, 4, 2, seqlen_q, seqlen_k, 16, causal=causal, window=window)
    pairs = _brute_force_pairs(seqlen_q, seqlen_k, case.visible_window())
    assert attention_flops(case) == 4 * 16 * 2 * 4 * pairs
    assert attention_flops(replace(case, mode="fwdbwd")) == 3.5 * attention_flops(case)


def test_packed_flops_sum_their_sequences():
    from fmha.masking import Window

    lengths = (5, 0, 17, 1, 9)
    windowed = Case.packed(lengths, 4, 2, 16, causal=True, window=(3, 0))
    pairs = sum(_brute_force_pairs(n, n, Window(0, 3, 0)) for n in lengths)
    assert attention_flops(windowed) == 4 * 16 * 4 * pairs
    # Without a window the design's convention: every pair, halved when causal.
    assert attention_flops(Case.packed(lengths, 4, 2, 16)) == 4 * 16 * 4 * sum(n * n for n in lengths)
    assert attention_flops(Case.packed(lengths, 4, 2, 16, causal=True)) == 2 * 16 * 4 * sum(n * n for n in lengths)
    # Bytes follow the packed tokens, not B x the longest sequence.
    assert fused_bytes(Case.packed(lengths, 4, 2, 16), 2) == fused_bytes(Case(1, 4, 2, 32, 32, 16), 2)


def test_the_window_1024_case_has_the_expected_flops():
    case = Case(1, 16, 16, 16384, 16384, 128, causal=True, window=(1023, 0))
    pairs = 16384 * 1024 - 1023 * 1024 // 2  # row i sees min(i, 1023) + 1 keys
    assert attention_flops(case) == 4 * 128 * 16 * pairs


def test_feature_cases_round_trip_through_shape_text_and_json():
    cases = suite_cases(["features"], modes=("fwd", "fwdbwd"))
    cases.append(Case(1, 2, 1, 8, 12, 16, window=(None, 3), softcap=2.5, alibi=True, sinks=True))
    for case in cases:
        assert parse_shape(case.shape_text) == replace(case, mode="fwd")
        assert Case(**json.loads(json.dumps(case.to_dict()))) == case  # results files hold lists
    window = parse_shape("1,16,16,16384,16384,128,causal,window=1023:0")
    assert window.label == "B1 H16 S16384 D128 causal window=1023:0 fwd" and window.features == ("window=1023:0",)
    packed = parse_shape("3,8,2,7,7,64,causal,lengths=4:7:0")
    assert packed.lengths == (4, 7, 0) and packed.label == "varlen N3 T11 max7 H8/2 D64 causal fwd"
    assert packed.shape_text == "3,8,2,7,7,64,causal,lengths=4:7:0" and packed.features == ("varlen",)
    scored = parse_shape("4,16,16,4096,4096,64,causal,sinks,softcap=30,dropout=0.1,ALIBI")
    assert scored.label == "B4 H16 S4096 D64 causal softcap=30 alibi sinks dropout=0.1 fwd"
    assert parse_shape("2,2,2,8,8,8,window=-1:-1").window is None  # unbounded on both sides: no window


@pytest.mark.parametrize("text, message", [
    ("1,2,2,8,8,8,window=3", "window must be LEFT:RIGHT"),
    ("1,2,2,8,8,8,window=a:0", "window must be LEFT:RIGHT"),
    ("1,2,2,8,8,8,window=-2:0", "window must be LEFT:RIGHT"),
    ("1,2,2,8,8,8,lengths=3:4", "B = their number \\(2\\) and Sq = Sk = the longest \\(4\\)"),
    ("1,2,2,8,8,8,lengths=", "lengths must be integers"),
    ("1,2,2,8,8,8,softcap=x", "softcap must be a number"),
    ("1,2,2,8,8,8,dropout=1.5", "dropout must be a number in \\[0, 1\\)"),
    ("1,2,2,8,8,8,alibi=2", "alibi takes no value"),
    ("1,2,2,8,8,8,sinks,sinks", "sinks is given twice"),
    ("1,2,2,8,8,8,bias=1", "unknown option 'bias=1'"),
    ("1,2,2,8,8,8,causal,window=1:0,x", "has 8 fields"),
])
def test_shape_options_name_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_shape(text)
    assert text in str(error.value)


def test_unsupported_features_are_reported_not_crashed_on():
    import torch

    from fmha.tools.bench.runner import run_case

    # fmha's own rows run every one of these (test_fmha_rows_run_the_features_and_match_float64).
    providers = ["naive", "sdpa_math", "varlen_attn", "fa2"]
    for case in (Case(1, 2, 2, 16, 16, 16, causal=True, softcap=30.0), Case(1, 2, 2, 16, 16, 16, sinks=True),
                 Case(1, 2, 2, 16, 16, 16, alibi=True), Case(1, 2, 2, 16, 16, 16, dropout=0.1, mode="fwdbwd"),
                 Case.packed((3, 5), 2, 2, 16, causal=True, sinks=True)):
        # FlexAttention has softcap and ALiBi (it would compile and run them); it lacks sinks and dropout.
        names = providers + (["flex"] if case.sinks or case.dropout else [])
        rows = {row["provider"]: row for row in run_case(case, names, torch.float32, device="cpu")}
        assert list(rows) == names
        for name, row in rows.items():
            assert row["status"] in ("unsupported", "unavailable") and row["error"], (case.label, name, row)
        assert rows["sdpa_math"]["status"] == "unsupported" and "SDPA has no" in rows["sdpa_math"]["error"]
        assert rows["varlen_attn"]["status"] == "unsupported"
        if "flex" in rows:
            assert rows["flex"]["status"] == "unsupported" and "FlexAttention has no" in rows["flex"]["error"]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", [
    Case(1, 2, 1, 40, 56, 16, causal=True, window=(7, 0)),
    Case(2, 2, 2, 33, 33, 16, window=(3, 5)),
    Case.packed((5, 0, 17, 9), 2, 1, 16, causal=True),
    Case.packed((5, 1, 40, 9), 2, 2, 16, window=(4, 2)),
    Case(1, 2, 2, 30, 40, 16, causal=True, softcap=5.0),
    Case(1, 4, 2, 30, 40, 16, alibi=True, sinks=True, window=(9, None)),
    Case.packed((5, 0, 17, 9), 2, 1, 16, causal=True, softcap=3.0, alibi=True, sinks=True),
], ids=lambda case: case.label)
def test_fmha_rows_run_the_features_and_match_float64(case):
    import torch

    from fmha.tools.bench.peers import PEERS
    from fmha.tools.bench.runner import make_inputs, relative_error

    q, k, v = make_inputs(case, torch.float32, "cpu")
    prepared = PEERS["fmha"].prepare(case, q, k, v)
    with torch.no_grad():
        out = prepared.run()
    assert out.shape == q.shape
    assert relative_error(case, q, k, v, out) < 1e-5
    assert relative_error(case, q, k, v, torch.zeros_like(out)) == pytest.approx(1.0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", [
    Case(1, 2, 1, 40, 56, 16, causal=True, window=(7, 0)),
    Case.packed((5, 0, 17, 9), 2, 2, 16, causal=True),
    Case.packed((5, 1, 130, 9), 2, 2, 16, window=(4, 2)),
    Case(1, 2, 2, 48, 64, 16, causal=True, softcap=5.0),
    Case(1, 4, 2, 48, 64, 16, alibi=True, window=(9, None)),
    Case(1, 4, 2, 48, 64, 16, causal=True, alibi=True, softcap=3.0),
], ids=lambda case: case.label)
def test_flex_masks_and_score_mods_match_the_float64_reference(case, monkeypatch):
    """FlexAttention's block masks and score mods against the benchmark's own float64 reference."""
    import torch

    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from fmha.tools.bench import peers
    from fmha.tools.bench.runner import make_inputs, relative_error

    monkeypatch.setattr(peers, "_compiled_flex", flex.flex_attention)  # eager: no compiler needed on the CPU
    q, k, v = make_inputs(case, torch.float32, "cpu")
    prepared = peers.PEERS["flex"].prepare(case, q, k, v)
    with torch.no_grad():
        out = prepared.run()
    assert relative_error(case, q, k, v, out) < 1e-5


def test_scored_reference_reduces_to_plain_attention_and_sinks_take_mass():
    import torch

    from fmha.reference import dense_attention
    from fmha.tools.bench.runner import make_inputs, scored_reference

    case = Case(1, 2, 2, 30, 50, 16, causal=True, window=(5, 0), sinks=True)
    q, k, v = make_inputs(case, torch.float64, "cpu")
    plain, _ = dense_attention(q, k, v, window=case.visible_window())
    window = case.visible_window()
    assert torch.allclose(scored_reference(q, k, v, window, case, {}), plain, atol=1e-12)
    no_sink = {"sinks": torch.full((2,), float("-inf"))}
    assert torch.allclose(scored_reference(q, k, v, window, case, no_sink), plain, atol=1e-12)
    assert scored_reference(q, k, v, window, case, {"sinks": torch.full((2,), 1e4)}).abs().max() == 0


def test_varlen_attn_options_follow_torchs_signature():
    from fmha.tools.bench.peers import Unsupported, varlen_attn_options

    def older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        pass

    def newer(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
              window_size=(-1, -1), enable_gqa=False):
        pass

    causal = Case.packed((3, 5), 4, 4, 16, causal=True)
    assert varlen_attn_options(older, causal) == {"is_causal": True}
    assert varlen_attn_options(newer, causal) == {"window_size": (-1, 0)}
    assert varlen_attn_options(newer, Case.packed((3, 5), 4, 4, 16)) == {"window_size": (-1, -1)}
    assert varlen_attn_options(newer, replace(causal, window=(63, 9))) == {"window_size": (63, 0)}
    assert varlen_attn_options(newer, Case.packed((3, 5), 4, 2, 16)) == {"window_size": (-1, -1), "enable_gqa": True}
    with pytest.raises(Unsupported, match="window_size"):
        varlen_attn_options(older, replace(causal, window=(63, 0)))
    with pytest.raises(Unsupported, match="enable_gqa"):
        varlen_attn_options(older, Case.packed((3, 5), 4, 2, 16))


def test_feature_cases_get_no_kernel_resource_rows():
    from fmha.tools.bench.kernels import kernel_resources

    assert kernel_resources(Case(1, 2, 2, 64, 64, 16, causal=True, window=(7, 0)), None, None, None) == []
