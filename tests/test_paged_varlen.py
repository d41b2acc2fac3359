"""flash_attn_varlen_func with a block table (packed queries over a paged K/V cache) on the CPU
through the interpreter, against the float64 reference (fmha.reference.paged_varlen_sequences)."""

import pytest
import torch

import fmha
from fmha import kvcache_ops
from fmha.backends.triton import config as triton_config
from fmha.testing import check_paged_varlen, random_paged_varlen

pytestmark = pytest.mark.interpreter

# Empty and one-token sequences, Sq_b != Sk_b, decode-like rows, sequences of several tiles.
LENGTHS = {
    "prefill": ([9, 0, 1, 23], [9, 5, 1, 23]),
    "chunked": ([4, 7, 1], [30, 12, 41]),
    "decode": ([1, 1, 1, 1], [17, 1, 0, 40]),
}


def case(name="chunked", q_heads=4, kv_heads=2, head_dim=32, page_size=16, **kwargs):
    kwargs.setdefault("dtype", torch.float16)
    return random_paged_varlen(*LENGTHS[name], q_heads, kv_heads, head_dim, page_size, **kwargs)


def check(case, **options):
    return check_paged_varlen(fmha.flash_attn_varlen_func, case, **options)


@pytest.fixture(autouse=True)
def fresh_signatures():
    kvcache_ops.forget()
    yield
    kvcache_ops.forget()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 24, 64], ids=lambda size: f"page{size}")
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_matches_float64_per_sequence(lengths, page_size, dtype):
    check(case(lengths, page_size=page_size, dtype=dtype), causal=lengths != "decode")


@pytest.mark.parametrize("lengths_q, lengths_k", [([0], [30]), ([0, 0], [0, 7])], ids=["keys", "empty"])
def test_no_query_tokens(lengths_q, lengths_k):
    out, lse = check(random_paged_varlen(lengths_q, lengths_k, 4, 2, 32, 16, dtype=torch.float16))
    assert out.shape == (0, 4, 32) and lse.shape == (4, 0)


@pytest.mark.parametrize("window_size, causal", [((5, 0), False), ((3, 2), False), ((-1, -1), True), ((4, -1), True)],
                         ids=str)
def test_windows_follow_each_sequences_lengths(window_size, causal):
    check(case("prefill", page_size=24), window_size=window_size, causal=causal)


@pytest.mark.parametrize("splits", [2, 3])
def test_split_keys_merge(monkeypatch, splits):
    """The chunks of split keys merge to the same answer (the heuristic picks one chunk for these
    small caches)."""
    choose = triton_config.kvcache_config

    def split_config(params, multiprocessors):
        return triton_config.KVCacheConfig(**{**vars(choose(params, multiprocessors)), "splits": splits})

    monkeypatch.setattr(kvcache_ops, "kvcache_config", split_config)
    check(case("chunked"), causal=True)
    assert [forward.splits for forward in kvcache_ops._signatures.values()] == [splits]
    check(case("decode", seed=1), softcap=5.0)


@pytest.mark.parametrize("max_seqlen_q", [1, 3])
def test_rows_past_a_max_seqlen_q_below_the_longest_sequence_are_nan(max_seqlen_q):
    """max_seqlen_q sizes the grid (the lengths are on the device): the rows it covers are right,
    the rest come out NaN, never stale memory."""
    inputs = case("prefill", page_size=16, dtype=torch.float32)
    exact = fmha.flash_attn_varlen_func(**inputs, causal=True)
    short = fmha.flash_attn_varlen_func(**{**inputs, "max_seqlen_q": max_seqlen_q}, causal=True)
    starts = inputs["cu_seqlens_q"].tolist()
    for b in range(len(starts) - 1):
        rows, expected_rows = short[starts[b]:starts[b + 1]], exact[starts[b]:starts[b + 1]]
        torch.testing.assert_close(rows[:max_seqlen_q], expected_rows[:max_seqlen_q])
        for row, expected in zip(rows[max_seqlen_q:], expected_rows[max_seqlen_q:]):
            # "right" to float32 rounding: another tile shape sums the products in another order
            assert row.isnan().all() or torch.allclose(row, expected, rtol=1e-5, atol=1e-6), \
                "a row past the grid is neither NaN nor right"
    assert short[starts[-1] - 1].isnan().all()


def test_score_features():
    alibi = torch.rand(3, 4) * 0.3  # (B, Hq)
    check(case("chunked", seed=2), causal=True, softcap=8.0, alibi_slopes=alibi)
    check(case("decode", seed=3), alibi_slopes=alibi[0])


def test_gqa_mqa_and_a_head_dim_not_a_power_of_two():
    check(case("chunked", q_heads=6, kv_heads=1, head_dim=40, page_size=5), causal=True)


def test_unused_table_entries_and_pages_are_never_read():
    inputs = case("chunked", spare_blocks=2)
    inputs["block_table"][:, -2:] = 10 ** 6  # past the cache: reading one would fault or show
    check(inputs, causal=True)


def test_same_answer_as_the_contiguous_varlen_call():
    """The paged call and the packed (contiguous) call read the same keys."""
    inputs = case("prefill", page_size=8, dtype=torch.float32)
    page_size = inputs["k"].shape[1]
    keys, values = [], []
    for b, seqlen_k in enumerate(inputs["cu_seqlens_k"].diff().tolist()):
        positions = torch.arange(seqlen_k)
        pages = inputs["block_table"][b].long()[positions // page_size]
        keys.append(inputs["k"][pages, positions % page_size])
        values.append(inputs["v"][pages, positions % page_size])
    contiguous = fmha.flash_attn_varlen_func(
        inputs["q"], torch.cat(keys), torch.cat(values), inputs["cu_seqlens_q"], inputs["cu_seqlens_k"],
        inputs["max_seqlen_q"], inputs["max_seqlen_k"], causal=True)
    paged = fmha.flash_attn_varlen_func(**inputs, causal=True)
    torch.testing.assert_close(paged, contiguous, rtol=1e-5, atol=1e-5)


def test_a_repeated_call_reuses_its_launches():
    inputs = case("decode")
    fmha.flash_attn_varlen_func(**inputs)
    assert len(kvcache_ops._signatures) == 1
    forward = next(iter(kvcache_ops._signatures.values()))
    inputs["q"] = torch.randn_like(inputs["q"])
    fmha.flash_attn_varlen_func(**inputs)
    assert list(kvcache_ops._signatures.values()) == [forward]


def test_torch_compile_fullgraph_matches_eager():
    inputs = case("chunked")
    eager = fmha.flash_attn_varlen_func(**inputs, causal=True)
    compiled = torch.compile(fmha.flash_attn_varlen_func, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(**inputs, causal=True), eager, rtol=0, atol=0)


def test_meta_tensors_give_shapes():
    inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in case("chunked").items()}
    out, lse, _ = fmha.flash_attn_varlen_func(**inputs, return_attn_probs=True)
    assert out.shape == inputs["q"].shape and lse.shape == (4, inputs["q"].shape[0])


@pytest.mark.parametrize("change, error, pattern", [
    (dict(dropout_p=0.1), NotImplementedError, "dropout_p > 0 with block_table"),
    (dict(block_table=torch.zeros(3, 2, dtype=torch.int64)), TypeError, "block_table must be torch.int32"),
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int32)), ValueError, r"one row per sequence \(3\)"),
    (dict(block_table=torch.zeros(2, 3, dtype=torch.int32).t()), ValueError, "block_table's rows must be contiguous"),
    (dict(k=torch.randn(10, 16, 2, 32, dtype=torch.float16)), ValueError, "k_cache and v_cache must have the same"),
    (dict(q=torch.randn(12, 4, 32, dtype=torch.float32)), TypeError, "same dtype"),
    (dict(q=torch.randn(1, 12, 4, 32, dtype=torch.float16)), ValueError, r"q must be 3-D \(total_q"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 3, 9], dtype=torch.int32)), ValueError, "cu_seqlens_k must start at 0 and"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 11, 13], dtype=torch.int32)), ValueError, r"end at 12 \(the tokens in q\)"),
    (dict(cu_seqlens_k=torch.tensor([0, 30, 42], dtype=torch.int32)), ValueError, "same number of sequences"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be a non-negative int"),
    (dict(window_size=(-2, 0)), ValueError, "window_size's left side"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool"),
])
def test_bad_arguments_are_named_before_any_launch(change, error, pattern):
    inputs = case("chunked")
    inputs.update(change)
    with pytest.raises(error, match=pattern):
        fmha.flash_attn_varlen_func(**inputs)


def test_gradients_are_refused_with_a_reason():
    inputs = case("chunked")
    inputs["q"].requires_grad_(True)
    with pytest.raises(NotImplementedError, match="gradients through block_table"):
        fmha.flash_attn_varlen_func(**inputs)
    with torch.no_grad():
        fmha.flash_attn_varlen_func(**inputs)
