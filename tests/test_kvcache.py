"""flash_attn_with_kvcache on the CPU through the interpreter, against the float64 reference
(fmha.reference.kvcache_sequences: what each sequence attends, spelled out)."""

import dataclasses

import pytest
import torch
import triton

import fmha
from fmha import kvcache_ops
from fmha.backends.triton.config import KVCacheConfig, kvcache_config
from fmha.backends.triton.kvcache_launch import _Launch
from fmha.kvcache_params import kvcache_params
from fmha.testing import check_kvcache, random_kvcache

pytestmark = pytest.mark.interpreter


def kvcache_case(batch=3, seqlen_q=1, q_heads=4, kv_heads=2, head_dim=32, capacity=80, **kwargs):
    kwargs.setdefault("dtype", torch.float16)
    return random_kvcache(batch, seqlen_q, q_heads, kv_heads, head_dim, capacity, **kwargs)


def check(case, **options):
    return check_kvcache(fmha.flash_attn_with_kvcache, case, **options)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("page_size", [None, 1, 16, 24, 64],
                         ids=lambda size: "contiguous" if size is None else f"page{size}")
def test_decode_with_append(dtype, page_size):
    """Ragged lengths, GQA, one new key per sequence, appended and attended in one call."""
    case = kvcache_case(dtype=dtype, page_size=page_size, capacity=100)
    check(case, num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_several_queries_and_splits(num_splits, causal):
    """Speculative decoding / chunked prefill: Sq > 1 bottom-right aligned to each sequence's keys."""
    case = kvcache_case(seqlen_q=5, new_keys=5, q_heads=6, kv_heads=2, dtype=torch.float32, lengths=[0, 17, 60])
    check(case, causal=causal, num_splits=num_splits)


@pytest.mark.parametrize("batch, capacity, splits, block_n", [
    (1, 4096, 16, 64), (4, 8192, 4, 64), (8, 2048, 1, 128), (8, 8192, 2, 64), (16, 4096, 1, 64), (32, 8192, 6, 64)])
def test_decode_plans_for_an_h100(batch, capacity, splits, block_n):
    """Bf16 decode, Hq/Hkv 32/8, D 128, on 132 multiprocessors: up to one program per multiprocessor
    (never a second wave); one chunk of 128-key blocks where a chunk each fills a third to a half of
    them; a full GPU cuts the capacity into chunks of about 1,536 keys for ragged lengths."""
    params = kvcache_params("test", torch.empty(batch, 1, 32, 128, dtype=torch.bfloat16),
                            *(torch.empty(batch, capacity, 8, 128, dtype=torch.bfloat16) for _ in range(2)),
                            None, None, None, None, torch.full((batch,), capacity, dtype=torch.int32), None, None,
                            None, None, False, (-1, -1), 0.0, False, None, 0)
    config = kvcache_config(params, 132)
    assert (config.splits, config.block_n) == (splits, block_n)
    # one chunk per tile on a small grid: bulk copies from the contiguous cache
    assert config.tma == (splits == 1 and batch * 8 < 2 * 132)


@pytest.mark.parametrize("head_dim, rotary_dim, block_m", [(32, 32, 32), (32, 2, 32), (32, 0, 128), (64, 32, 128)])
def test_rotary_tiles_at_head_dim_32(head_dim, rotary_dim, block_m):
    """A 16-query chunk over 8 query heads per KV head (128 packed rows) at D = 32 with rotary runs
    in tiles of 32 rows, which triton 3.6 builds right; without rotary, or at D = 64, in 128."""
    q = torch.empty(1, 16, 64, head_dim, device="meta", dtype=torch.float16)
    cache = torch.empty(1, 4096, 8, head_dim, device="meta", dtype=torch.float16)
    new = torch.empty(1, 16, 8, head_dim, device="meta", dtype=torch.float16)
    table = torch.empty(4096, rotary_dim // 2, device="meta", dtype=torch.float16) if rotary_dim else None
    lengths = torch.empty(1, device="meta", dtype=torch.int32)
    params = kvcache_params("test", q, cache, cache, new, new, table, table, lengths, None, None, None, None, True,
                            (-1, 0), 0.0, False, None, 0)
    assert kvcache_config(params, 132).block_m == block_m


def test_a_merge_over_several_groups_of_chunks():
    """D = 128 with 16 packed rows loads four chunks' partials at a time, so nine chunks merge in three
    groups, some of them seen by no row (the first sequence is empty, the second shorter than a chunk)."""
    case = kvcache_case(seqlen_q=4, new_keys=4, q_heads=8, kv_heads=2, head_dim=128, capacity=144,
                        dtype=torch.float32, lengths=[0, 9, 130])
    forward = _prepared(case, causal=True, num_splits=9)
    assert forward.attend_launch.constants["MERGE_CHUNKS"] == 4 and forward.splits == 9
    check(case, causal=True, num_splits=9)


@pytest.mark.parametrize("page_size", [None, 24])
def test_a_long_append_read_back_in_the_same_call(page_size):
    """Chunked prefill: 24 new keys span several key blocks and chunks; every program reads them
    from k and v while one per sequence and KV head writes them."""
    case = kvcache_case(batch=2, seqlen_q=24, new_keys=24, capacity=80, page_size=page_size, rotary_dim=16,
                        lengths=[0, 37], dtype=torch.float32)
    check(case, causal=True, num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("features", [
    dict(softcap=2.0),
    dict(alibi_slopes="heads"),
    dict(alibi_slopes="batch"),
    dict(sinks=True),
    dict(softcap=5.0, alibi_slopes="batch", sinks=True),
], ids=["softcap", "alibi", "alibi-per-batch", "sinks", "all"])
def test_score_features(features, num_splits):
    """Softcap, ALiBi ((Hq,) or (B, Hq): a slope per row's head inside a GQA tile) and sinks (in the
    denominator after the split keys' merge), with an append, a paged cache and a window; an empty
    sequence keeps zeros and LSE -inf."""
    batch, q_heads = 3, 4
    generator = torch.Generator().manual_seed(len(features) + num_splits)
    options = {}
    if "softcap" in features:
        options["softcap"] = features["softcap"]
    if "alibi_slopes" in features:
        shape = (q_heads,) if features["alibi_slopes"] == "heads" else (batch, q_heads)
        options["alibi_slopes"] = torch.rand(shape, generator=generator) * 0.5
    if "sinks" in features:
        options["sinks"] = torch.randn(q_heads, generator=generator)
    case = kvcache_case(batch=batch, q_heads=q_heads, seqlen_q=3, new_keys=2, capacity=90, page_size=16,
                        lengths=[0, 40, 70], dtype=torch.float32)
    check(case, causal=True, window_size=(50, -1), num_splits=num_splits, **options)
    empty = kvcache_case(batch=batch, q_heads=q_heads, seqlen_q=2, capacity=48, lengths=[0, 5, 30], new_keys=0,
                         dtype=torch.float16)
    out, lse = check(empty, num_splits=num_splits, **options)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()


def test_score_features_change_the_output():
    """Each feature moves the output away from the plain call's: the options reach the kernel."""
    case = kvcache_case(batch=2, seqlen_q=2, capacity=40, lengths=[20, 33], dtype=torch.float32)
    plain = fmha.flash_attn_with_kvcache(**case)
    for options in (dict(softcap=1.0), dict(alibi_slopes=torch.full((4,), 0.3)), dict(sinks=torch.full((4,), 2.0))):
        assert (fmha.flash_attn_with_kvcache(**case, **options) - plain).abs().max() > 1e-3, options


@pytest.mark.parametrize("block_n", [32, 64])
def test_the_gpus_key_blocks(monkeypatch, block_n):
    """The GPU's tiles (the interpreter pins 16 keys per block): rotated new keys read back inside
    wider masked blocks, several chunks."""
    monkeypatch.setattr(kvcache_ops, "kvcache_config",
                        lambda params, multiprocessors: KVCacheConfig(16, block_n, 4, 2, 3))
    kvcache_ops.forget()
    case = kvcache_case(seqlen_q=3, new_keys=3, capacity=200, page_size=24, rotary_dim=16, lengths=[0, 90, 197])
    check(case, causal=True)
    kvcache_ops.forget()


@pytest.mark.parametrize("one_range", [False, True], ids=["three_ranges", "one_range"])
@pytest.mark.parametrize("page_size", [None, 16], ids=lambda size: "contiguous" if size is None else f"page{size}")
def test_one_masked_key_loop(monkeypatch, one_range, page_size):
    """Small GPU grids walk each tile's keys in one masked loop, larger ones mask only the edges
    around whole blocks; both are exact over windows, causal rows, empty sequences and chunks."""
    chosen = kvcache_ops.kvcache_config
    monkeypatch.setattr(kvcache_ops, "kvcache_config", lambda params, multiprocessors: dataclasses.replace(
        chosen(params, multiprocessors), splits=3, one_range=one_range))
    kvcache_ops.forget()
    case = kvcache_case(seqlen_q=2, new_keys=0, capacity=120, page_size=page_size, lengths=[0, 57, 117],
                        dtype=torch.float32)
    check(case)
    check(case, causal=True, window_size=(20, 0))
    kvcache_ops.forget()


def test_a_build_short_of_shared_memory_retries_with_fewer_stages():
    class Kernel:  # stands in for a JIT function whose builds need more than 2 stages' worth
        arg_names = ["X", "BLOCK"]
        stages = []

        def __getitem__(self, grid):
            def launch(*args, num_stages, **options):
                self.stages.append(num_stages)
                if num_stages > 2:
                    raise triton.OutOfResources(300_000, 232_448, "shared memory")
            return launch

    launch = _Launch(Kernel(), (1, 1, 1), {"BLOCK": 16}, 4, 4)
    launch.fixed = ()
    launch(torch.device("cpu"), torch.zeros(1))
    assert Kernel.stages == [4, 3, 2] and launch.num_stages == 2


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary(page_size, interleaved, causal):
    """Rotary on the new keys (at cache_seqlens + t) and the queries (at cache_seqlens + i when
    causal, all at cache_seqlens otherwise), on a partial rotary dim."""
    case = kvcache_case(seqlen_q=3, new_keys=3, head_dim=40, rotary_dim=24, page_size=page_size)
    check(case, causal=causal, rotary_interleaved=interleaved, num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_of_the_whole_head(interleaved, dtype):
    """Every column rotated: the pairs (neighbours, or the tile's two halves) split in registers."""
    case = kvcache_case(head_dim=32, rotary_dim=32, dtype=dtype, new_keys=2, seqlen_q=2)
    check(case, causal=True, rotary_interleaved=interleaved)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("head_dim, rotary_dim", [(40, 16), (64, 32), (32, 2)], ids=str)
def test_rotary_dims(head_dim, rotary_dim, interleaved):
    """Partial rotary dims that are powers of two: with halves, the tile splits into groups of
    rotary_dim columns in registers and only the first group turns."""
    case = kvcache_case(head_dim=head_dim, rotary_dim=rotary_dim, new_keys=2, seqlen_q=2, page_size=16)
    check(case, causal=True, rotary_interleaved=interleaved)


def test_cache_batch_idx():
    """Sequences read and append to the cache batches that cache_batch_idx names; others stay."""
    case = kvcache_case(batch=3, capacity=48, new_keys=2)
    extra = torch.randn(2, *case["k_cache"].shape[1:]).to(case["k_cache"].dtype)
    case["k_cache"] = torch.cat([case["k_cache"], extra])
    case["v_cache"] = torch.cat([case["v_cache"], extra.flip(0)])
    case["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32)
    check(case, num_splits=2)


@pytest.mark.parametrize("page_size", [None, 24])
def test_leftpad_with_a_window(page_size):
    """Sequence b starts at cache position leftpad_b: key j is position leftpad_b + j."""
    case = kvcache_case(seqlen_q=2, new_keys=2, capacity=72, page_size=page_size, lengths=[30, 5, 50])
    case["cache_leftpad"] = torch.tensor([4, 5, 0], dtype=torch.int32)
    check(case, causal=True, window_size=(9, -1), num_splits=2)


@pytest.mark.parametrize("window_size", [(7, 0), (5, 3), (-1, 2)], ids=str)
def test_windows_follow_each_sequences_length(window_size):
    case = kvcache_case(seqlen_q=4, new_keys=0, dtype=torch.float32, lengths=[70, 9, 33])
    check(case, window_size=window_size, num_splits=3)


def test_only_the_appended_rows_change():
    case = kvcache_case(new_keys=3, page_size=16, capacity=64, lengths=[0, 13, 61])
    k_before, v_before = case["k_cache"].clone(), case["v_cache"].clone()
    fmha.flash_attn_with_kvcache(**case)
    changed = (case["k_cache"] != k_before).any(-1).any(-1) | (case["v_cache"] != v_before).any(-1).any(-1)
    expected = torch.zeros_like(changed)
    for b, length in enumerate([0, 13, 61]):
        for position in range(length, length + 3):
            expected[case["block_table"][b, position // 16], position % 16] = True
    assert torch.equal(changed, expected)


@pytest.mark.parametrize("num_splits", [0, 3])
@pytest.mark.parametrize("page_size", [None, 16])
def test_a_call_without_query_rows_still_appends(page_size, num_splits):
    """Sq = 0: empty outputs, and the new keys are still written (check holds the caches to the
    append); no queries and nothing to append, or no sequences, launch nothing."""
    out, lse = check(kvcache_case(seqlen_q=0, new_keys=2, page_size=page_size), num_splits=num_splits)
    assert out.shape == (3, 0, 4, 32) and lse.shape == (3, 4, 0)
    check(kvcache_case(seqlen_q=0, new_keys=0, page_size=page_size), num_splits=num_splits)
    check(kvcache_case(batch=0, new_keys=1, page_size=page_size), num_splits=num_splits)


def test_int_and_absent_cache_seqlens():
    case = kvcache_case(new_keys=2, lengths=[20, 20, 20])
    int_case = {**case, "cache_seqlens": 20, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
    check(case)
    check(int_case)
    whole = kvcache_case(new_keys=0, capacity=40)
    del whole["cache_seqlens"]
    check(whole, causal=True)


def test_rows_that_see_no_key_are_zero_with_lse_minus_inf():
    """More queries than keys, causal: the first rows see nothing; an empty sequence sees nothing."""
    case = kvcache_case(seqlen_q=6, new_keys=0, lengths=[3, 0, 20], dtype=torch.float32)
    out, lse = check(case, causal=True, num_splits=2)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()
    assert torch.isneginf(lse[0, :, :3]).all() and torch.isfinite(lse[0, :, 3:]).all()


def test_head_dim_not_a_power_of_two_and_mqa():
    case = kvcache_case(q_heads=5, kv_heads=1, head_dim=24, page_size=16, new_keys=1)
    check(case, softmax_scale=0.3, num_splits=4)


def test_bfloat16_computes_in_float32_under_the_interpreter():
    case = kvcache_case(dtype=torch.bfloat16, page_size=16)
    check(case)


def _prepared(case, **options):
    """The prepared launches of a call (to look at their arrival counters)."""
    return kvcache_ops.prepared("test", case["q"], case["k_cache"], case["v_cache"], case.get("k"), case.get("v"),
                                case.get("rotary_cos"), case.get("rotary_sin"), case.get("cache_seqlens"), None,
                                None, case.get("block_table"), None, options.get("causal", False), (-1, -1), 0.0,
                                True, None, options.get("num_splits", 0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_decode_tiles_read_a_contiguous_cache_through_tensor_descriptors(monkeypatch, dtype):
    """One-chunk decode tiles of small grids read a contiguous cache with bulk copies, the last
    block moved back to end at the sequence's last key. Whatever the cache holds outside the
    sequences (NaN, infinities: before leftpad, past the end, in a batch no sequence uses) never
    reaches the output; a sequence shorter than a block keeps the pointer loads. Windows, leftpad
    and cache_batch_idx move the rows; a paged cache or an append keeps the pointer loads."""
    chosen = kvcache_ops.kvcache_config
    monkeypatch.setattr(kvcache_ops, "kvcache_config", lambda params, multiprocessors: dataclasses.replace(
        chosen(params, multiprocessors), splits=1, one_range=True, tma=params.page_size == 0 and not params.new_keys))
    kvcache_ops.forget()
    case = kvcache_case(batch=4, capacity=96, new_keys=0, lengths=[0, 37, 50, 43], dtype=dtype)
    extra = torch.randn(1, *case["k_cache"].shape[1:]).to(dtype)
    case["k_cache"], case["v_cache"] = torch.cat([case["k_cache"], extra]), torch.cat([case["v_cache"], -extra])
    case["cache_batch_idx"] = torch.tensor([4, 0, 2, 3], dtype=torch.int32)
    # sequence lengths 0, 28, 20 and 5 keys: 5 is under one 16-key block
    case["cache_leftpad"] = torch.tensor([0, 9, 30, 38], dtype=torch.int32)
    for batch, (start, length) in zip([4, 0, 2, 3], [(0, 0), (9, 37), (30, 50), (38, 43)]):
        for cache, value in ((case["k_cache"], float("nan")), (case["v_cache"], float("inf"))):
            cache[batch, :start] = value
            cache[batch, length:] = -value
    case["k_cache"][1], case["v_cache"][1] = float("nan"), float("inf")
    check(case)
    forward = kvcache_ops.prepared("test", case["q"], case["k_cache"], case["v_cache"], None, None, None, None,
                                   case["cache_seqlens"], case["cache_batch_idx"], case["cache_leftpad"], None, None,
                                   False, (-1, -1), 0.0, True, None, 0)
    assert forward.attend_launch.constants["TMA"] and forward.config.block_n == 16
    check(case, causal=True, window_size=(11, 0))
    check(case, window_size=(3, 0))
    for other in (kvcache_case(new_keys=0, page_size=16), kvcache_case(new_keys=1)):
        check(other)
        assert not _prepared(other).attend_launch.constants["TMA"]
    kvcache_ops.forget()


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_chunks_merge_in_the_launch_and_reset_their_counters(num_splits):
    """The last chunk of each tile merges all chunks in chunk order: repeated calls are bitwise
    equal, and every arrival counter is back at zero after each call (a CUDA graph replays it)."""
    case = kvcache_case(seqlen_q=3, new_keys=0, capacity=120, lengths=[119, 7, 60], dtype=torch.float32)
    first, first_lse = check(case, causal=True, num_splits=num_splits)
    forward = _prepared(case, causal=True, num_splits=num_splits)
    assert forward.splits > 1
    arrivals = forward.arrivals.get(case["q"].device)  # the stream's buffer (one stream on the CPU)
    assert arrivals.numel() == forward.attend_launch.grid[0] * forward.attend_launch.grid[2]
    for _ in range(2):
        out, lse = fmha.flash_attn_with_kvcache(**case, causal=True, num_splits=num_splits, return_softmax_lse=True)
        assert torch.equal(out, first) and torch.equal(lse, first_lse)
        assert forward.arrivals.get(case["q"].device) is arrivals and not arrivals.any()


@pytest.mark.parametrize("name", ["cache_seqlens", "cache_leftpad", "cache_batch_idx"])
def test_strided_per_sequence_tensors_are_refused(name):
    """The kernels read these as contiguous (B,) arrays."""
    case = kvcache_case(new_keys=0, capacity=40, lengths=[5, 6, 7])
    case[name] = torch.zeros(3, 2, dtype=torch.int32)[:, 0]
    with pytest.raises(ValueError, match=f"{name} must be contiguous"):
        fmha.flash_attn_with_kvcache(**case)


def test_a_decode_step_reuses_its_launches():
    """Changing lengths (tensor or int) does not change the signature: no new validation."""
    kvcache_ops.forget()
    case = kvcache_case(new_keys=1)
    for step in range(3):
        case["cache_seqlens"] = case["cache_seqlens"] + 1
        fmha.flash_attn_with_kvcache(**case)
        fmha.flash_attn_with_kvcache(**{**case, "cache_seqlens": 10 + step})
    assert len(kvcache_ops._signatures) == 2


def test_torch_compile_fullgraph_matches_eager():
    eager_case = kvcache_case(seqlen_q=2, new_keys=2, page_size=16, rotary_dim=16)
    compiled_case = {name: value.clone() for name, value in eager_case.items()}

    def step(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin):
        return fmha.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                            block_table=block_table, causal=True, return_softmax_lse=True)

    expected = step(**eager_case)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(**compiled_case)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(compiled_case[name], eager_case[name])
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_meta_tensors_give_shapes():
    q = torch.empty(2, 3, 8, 64, device="meta", dtype=torch.float16)
    cache = torch.empty(2, 128, 2, 64, device="meta", dtype=torch.float16)
    out, lse = fmha.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=7, return_softmax_lse=True)
    assert out.shape == (2, 3, 8, 64) and lse.shape == (2, 8, 3) and lse.dtype == torch.float32


def _bad(**changes):
    case = kvcache_case(batch=2, new_keys=1, page_size=16, rotary_dim=16, capacity=64)
    case.update(changes)
    return case


@pytest.mark.parametrize("changes, error, pattern", [
    (dict(softcap=-1.0), ValueError, "softcap must be finite and > 0"),
    (dict(softcap=True), TypeError, "softcap must be a float"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes must have shape"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError, "alibi_slopes must be float32"),
    (dict(sinks=torch.ones(2, 4)), ValueError, "sinks must have shape"),
    (dict(q=torch.ones(2, 1, 4, 32, dtype=torch.int32)), TypeError, "q has dtype"),
    (dict(q=torch.ones(2, 4, 32, dtype=torch.float16)), ValueError, "q must be 4-D"),
    (dict(k_cache=torch.ones(11, 16, 2, 32, dtype=torch.float32)), TypeError, "same dtype"),
    (dict(v_cache=torch.ones(11, 8, 2, 32, dtype=torch.float16)), ValueError, "k_cache and v_cache must have the same"),
    (dict(q=torch.ones(2, 1, 3, 32, dtype=torch.float16)), ValueError, "multiple"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.int64)), TypeError, "block_table must be torch.int32"),
    (dict(block_table=torch.zeros(3, 4, dtype=torch.int32)), ValueError, "block_table must have one row"),
    (dict(cache_batch_idx=torch.zeros(2, dtype=torch.int32)), ValueError, "cache_batch_idx cannot be used with"),
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), TypeError, "cache_seqlens must be torch.int32"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), ValueError, "cache_seqlens must have one entry"),
    (dict(cache_seqlens=2.0), TypeError, "cache_seqlens must be an int"),
    (dict(cache_seqlens=64), ValueError, "does not fit the cache"),
    (dict(cache_seqlens=None), ValueError, "needs cache_seqlens"),
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.int64)), TypeError, "cache_leftpad must be torch.int32"),
    (dict(v=None), ValueError, "k and v must be given together"),
    (dict(k=torch.ones(2, 1, 3, 32, dtype=torch.float16)), ValueError, "k must be"),
    (dict(k=torch.ones(2, 65, 2, 32, dtype=torch.float16), v=torch.ones(2, 65, 2, 32, dtype=torch.float16)),
     ValueError, "more than the cache holds"),
    (dict(rotary_sin=None), ValueError, "rotary_cos and rotary_sin must be given together"),
    (dict(rotary_cos=torch.ones(64, 20), rotary_sin=torch.ones(64, 20)), ValueError, "rotary dim"),
    (dict(rotary_cos=torch.ones(32, 8), rotary_sin=torch.ones(32, 8)), ValueError, "fewer than the cache holds"),
    (dict(k=None, v=None), ValueError, "rotary_cos and rotary_sin rotate the new keys"),
    (dict(softmax_scale="x"), TypeError, "softmax_scale"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(num_splits=-1), ValueError, "num_splits"),
    (dict(return_softmax_lse=None), TypeError, "return_softmax_lse"),
], ids=lambda value: None if isinstance(value, dict) else str(value))
def test_bad_arguments_are_named_before_any_launch(changes, error, pattern):
    case = _bad(**changes)
    k_before = case["k_cache"].clone()
    with pytest.raises(error, match=pattern):
        fmha.flash_attn_with_kvcache(**case)
    assert torch.equal(case["k_cache"], k_before)


def test_more_packed_rows_than_a_grid_axis_holds_are_refused_before_launch():
    """(heads per KV head) x queries over 65,535 tiles of 64 rows: refused by name, on meta
    tensors (nothing allocated, nothing launched); one row fewer plans."""
    from fmha.kvcache_params import MAX_PACKED_ROWS

    queries = MAX_PACKED_ROWS // 4
    cache = torch.empty(1, 64, 1, 16, device="meta", dtype=torch.float16)
    with pytest.raises(NotImplementedError, match=r"q.shape\[1\] = \d+ queries of 4 heads per KV head"):
        fmha.flash_attn_with_kvcache(torch.empty(1, queries + 1, 4, 16, device="meta", dtype=torch.float16),
                                     cache, cache)
    lengths = torch.zeros(2, dtype=torch.int32, device="meta")
    table = torch.zeros(1, 1, dtype=torch.int32, device="meta")
    with pytest.raises(NotImplementedError, match=r"max_seqlen_q = \d+ queries"):
        fmha.flash_attn_varlen_func(torch.empty(queries + 1, 4, 16, device="meta", dtype=torch.float16), cache,
                                    cache, lengths, lengths, queries + 1, 64, block_table=table)
    out = fmha.flash_attn_with_kvcache(torch.empty(1, queries, 4, 16, device="meta", dtype=torch.float16), cache,
                                       cache)
    assert out.shape == (1, queries, 4, 16)


def test_num_splits_stays_within_a_grid_axis():
    q = torch.empty(1, 1, 4, 16, device="meta", dtype=torch.float16)
    cache = torch.empty(1, 2 ** 23, 1, 16, device="meta", dtype=torch.float16)  # 131,072 blocks of 64 keys
    params = kvcache_params("test", q, cache, cache, None, None, None, None, None, None, None, None, None, False,
                            (-1, -1), 0.0, False, None, 10 ** 6)
    assert kvcache_config(params, 132).splits == 65535
