"""flash_attn_with_kvcache on the GPU (marker ``gpu``): contiguous and paged caches (page sizes
1 to 256, powers of two or not), ragged lengths, GQA, append, rotary, leftpad, cache_batch_idx,
splits, against the float64 reference by the project's error rule; CUDA-graph capture and
torch.compile of a decode step. flash_attn_varlen_func with a block table (packed queries over a
paged cache) runs in the same kernel and is checked here too."""

import zlib

import pytest
import torch

import fmha
from fmha import kvcache_ops
from fmha.testing import check_kvcache, check_paged_varlen, random_kvcache, random_paged_varlen

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
HEADS = [(1, 32, 8), (4, 16, 16), (3, 8, 1)]  # (batch, q heads, kv heads)
PAGES = [None, 1, 16, 24, 256]


def check(case, **options):
    return check_kvcache(fmha.flash_attn_with_kvcache, case, **options)


def seed_of(*values) -> int:
    return zlib.crc32(repr(values).encode())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch, q_heads, kv_heads", HEADS, ids=lambda value: str(value))
@pytest.mark.parametrize("page_size", PAGES, ids=lambda size: "contiguous" if size is None else f"page{size}")
@pytest.mark.parametrize("capacity", [300, 4096])
@pytest.mark.parametrize("seqlen_q, causal", [(1, False), (4, True)], ids=["decode", "speculative4-causal"])
def test_kvcache_gpu(dtype, batch, q_heads, kv_heads, page_size, capacity, seqlen_q, causal):
    case = random_kvcache(batch, seqlen_q, q_heads, kv_heads, 128, capacity, new_keys=seqlen_q, dtype=dtype,
                          device="cuda", page_size=page_size, seed=seed_of(dtype, batch, q_heads, page_size, capacity))
    check(case, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary_leftpad_and_batch_index_gpu(dtype, interleaved, causal):
    case = random_kvcache(4, 3, 16, 4, 128, 1000, new_keys=3, dtype=dtype, device="cuda", rotary_dim=64,
                          seed=seed_of(dtype, interleaved, causal))
    case["k_cache"] = torch.cat([case["k_cache"], case["k_cache"][:2].flip(1)])
    case["v_cache"] = torch.cat([case["v_cache"], case["v_cache"][:2].flip(1)])
    case["cache_batch_idx"] = torch.tensor([5, 2, 0, 4], dtype=torch.int32, device="cuda")
    case["cache_leftpad"] = torch.minimum(case["cache_seqlens"], torch.tensor([0, 7, 100, 3], device="cuda")).int()
    check(case, causal=causal, rotary_interleaved=interleaved)


@pytest.mark.parametrize("page_size", [None, 16], ids=lambda size: "contiguous" if size is None else f"page{size}")
@pytest.mark.parametrize("seqlen_q", [2, 7, 16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [2, 6, 32])
def test_rotary_at_head_dim_32_gpu(rotary_dim, interleaved, seqlen_q, page_size):
    """Rotary at D = 32 over 16 to 128 packed query rows (8 query heads per KV head): each way of
    pairing (neighbours, halves split in registers, halves loaded twice). Triton 3.6 built the 64-
    and 128-row tiles of these calls wrong (an illegal address, or a wrong output), so they run as
    tiles of at most 32 rows."""
    case = random_kvcache(1, seqlen_q, 64, 8, 32, 100, new_keys=seqlen_q, dtype=torch.float16, device="cuda",
                          page_size=page_size, rotary_dim=rotary_dim,
                          seed=seed_of(rotary_dim, interleaved, seqlen_q, page_size))
    check(case, causal=True, rotary_interleaved=interleaved)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [None, 16], ids=lambda size: "contiguous" if size is None else f"page{size}")
@pytest.mark.parametrize("num_splits", [0, 1], ids=["heuristic-splits", "one-split"])
@pytest.mark.parametrize("features", ["softcap", "alibi", "sinks", "all"])
def test_score_features_gpu(dtype, page_size, num_splits, features):
    """Softcap 30 (the fast tanh at 16 bits), ALiBi per batch and head, sinks; decode and speculative rows."""
    generator = torch.Generator().manual_seed(seed_of(dtype, page_size, num_splits, features))
    case = random_kvcache(3, 2, 32, 8, 128, 3000, new_keys=2, dtype=dtype, device="cuda", page_size=page_size,
                          seed=seed_of(dtype, page_size, features))
    options = {}
    if features in ("softcap", "all"):
        options["softcap"] = 30.0
    if features in ("alibi", "all"):
        options["alibi_slopes"] = (torch.rand(3, 32, generator=generator) * 0.1).cuda()
    if features in ("sinks", "all"):
        options["sinks"] = torch.randn(32, generator=generator).cuda()
    check(case, causal=True, num_splits=num_splits, **options)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 256])
def test_head_dims_gpu(dtype, head_dim):
    case = random_kvcache(2, 2, 8, 2, head_dim, 2000, new_keys=2, dtype=dtype, device="cuda", page_size=16,
                          rotary_dim=32, seed=seed_of(dtype, head_dim))
    check(case, causal=True)


@pytest.mark.parametrize("num_splits", [0, 1, 2, 7, 64])
@pytest.mark.parametrize("window_size", [(-1, -1), (200, 0), (50, 10)], ids=lambda w: f"left{w[0]}-right{w[1]}")
def test_splits_and_windows_gpu(num_splits, window_size):
    case = random_kvcache(3, 8, 32, 8, 128, 3000, new_keys=8, dtype=torch.bfloat16, device="cuda", page_size=24,
                          lengths=[2990, 0, 1234], seed=seed_of(num_splits, window_size))
    check(case, window_size=window_size, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim, rotary_dim", [(128, 0), (128, 64), (64, 64), (256, 0)], ids=str)
def test_chunked_prefill_gpu(dtype, head_dim, rotary_dim):
    """A long chunk of new queries (Sq = 300) appended to a paged cache and attended: the prefill tiles."""
    case = random_kvcache(2, 300, 16, 4, head_dim, 2048, new_keys=300, dtype=dtype, device="cuda",
                          page_size=16, lengths=[0, 1500], rotary_dim=rotary_dim, seed=seed_of(dtype, head_dim))
    check(case, causal=True)


def test_decode_suite_shape_gpu():
    """The benchmark's dense decode: B32 H32/8 Sk8192 D128, int cache_seqlens."""
    case = random_kvcache(32, 1, 32, 8, 128, 8192, new_keys=0, dtype=torch.bfloat16, device="cuda", seed=5)
    case["cache_seqlens"] = 8192
    check(case)


@pytest.mark.parametrize("batch, capacity", [(1, 4096), (4, 4096)])
def test_small_batch_merge_is_deterministic_gpu(batch, capacity):
    """Small decode batches (many chunks per KV head; B8 takes one chunk): the chunk that finishes last
    merges all of them in chunk order, so 50 calls give the same bits, and the arrival counters
    are zero after each."""
    case = random_kvcache(batch, 1, 32, 8, 128, capacity, new_keys=0, dtype=torch.bfloat16, device="cuda",
                          lengths=[capacity - 97 * b for b in range(batch)], seed=seed_of(batch, capacity))
    out, lse = check(case)
    forward = kvcache_ops.prepared("test", case["q"], case["k_cache"], case["v_cache"], None, None, None, None,
                                   case["cache_seqlens"], None, None, None, None, False, (-1, -1), 0.0, True, None, 0)
    assert forward.splits > 1
    for _ in range(50):
        again, again_lse = fmha.flash_attn_with_kvcache(**case, return_softmax_lse=True)
        assert torch.equal(again, out) and torch.equal(again_lse, lse)
    assert not forward.arrivals.get(case["q"].device).any()  # the current stream's counters


def _small_decode(dtype, seed):
    """B8 H32/8 D128 over a contiguous cache of 2,048 (one chunk of 128-key blocks per KV head: bulk
    copies), lengths from empty to full, leftpad and cache_batch_idx, and NaN and infinities in
    every cache slot outside the sequences."""
    lengths = [0, 5, 127, 128, 129, 1000, 2047, 2048]
    case = random_kvcache(8, 1, 32, 8, 128, 2048, new_keys=0, dtype=dtype, device="cuda", lengths=lengths, seed=seed)
    case["k_cache"] = torch.cat([case["k_cache"], case["k_cache"][:1]])
    case["v_cache"] = torch.cat([case["v_cache"], case["v_cache"][:1]])
    case["cache_batch_idx"] = torch.tensor([8, 0, 1, 2, 3, 4, 5, 6], dtype=torch.int32, device="cuda")
    leftpad = [0, 2, 0, 0, 1, 300, 1919, 0]
    case["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device="cuda")
    for batch, start, end in zip([8, 0, 1, 2, 3, 4, 5, 6], leftpad, lengths):
        for cache, value in ((case["k_cache"], float("nan")), (case["v_cache"], float("inf"))):
            cache[batch, :start] = value
            cache[batch, end:] = -value
    case["k_cache"][7], case["v_cache"][7] = float("nan"), float("inf")  # no sequence's batch
    return case


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", [{}, dict(causal=True, window_size=(200, 0)), dict(window_size=(1000, 0))],
                         ids=["whole", "window200", "window1000"])
def test_small_decode_reads_only_the_sequences_gpu(dtype, options):
    """The small-grid decode's bulk copies read no slot outside a sequence, with sequences shorter
    than a block, lengths one past a block, leftpad and cache_batch_idx."""
    case = _small_decode(dtype, seed_of(dtype, tuple(options)))
    check(case, **options)
    forward = kvcache_ops.prepared("test", case["q"], case["k_cache"], case["v_cache"], None, None, None, None,
                                   case["cache_seqlens"], case["cache_batch_idx"], case["cache_leftpad"], None, None,
                                   options.get("causal", False), options.get("window_size", (-1, -1)), 0.0, True,
                                   None, 0)
    assert forward.attend_launch.constants["TMA"] and forward.splits == 1


def test_small_decode_in_a_cuda_graph_gpu():
    """The bulk-copy decode captured in a CUDA graph: replays with new queries and lengths equal eager."""
    graph_case = _small_decode(torch.bfloat16, 21)
    eager_case = {name: value.clone() for name, value in graph_case.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        fmha.flash_attn_with_kvcache(**graph_case)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fmha.flash_attn_with_kvcache(**graph_case)
    for step in range(3):
        q = torch.randn_like(graph_case["q"])
        graph_case["q"].copy_(q)
        eager_case["q"].copy_(q)
        if step:  # shorter sequences, still inside what the poison leaves
            graph_case["cache_seqlens"] -= 1
            eager_case["cache_seqlens"] -= 1
            graph_case["cache_seqlens"].clamp_(min=0)
            eager_case["cache_seqlens"].clamp_(min=0)
        graph.replay()
        expected = fmha.flash_attn_with_kvcache(**eager_case)
        torch.cuda.synchronize()
        assert not out.isnan().any() and torch.equal(out, expected)


def _decode_step(seed, page_size=16):
    return random_kvcache(8, 1, 32, 8, 128, 1024, new_keys=1, dtype=torch.bfloat16, device="cuda",
                          page_size=page_size, rotary_dim=128, lengths=[(seed + 113 * i) % 1000 for i in range(8)],
                          seed=seed)


def test_cuda_graph_capture_and_replay_equal_eager_gpu():
    """A decode step (append + rotary + paged attention, lengths on the device) in a CUDA graph:
    each replay, with new q/k/v and lengths written into the captured buffers, equals eager."""
    graph_case = _decode_step(11)
    eager_case = {name: value.clone() for name, value in graph_case.items()}
    warm = {name: value.clone() for name, value in graph_case.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        fmha.flash_attn_with_kvcache(**warm, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fmha.flash_attn_with_kvcache(**graph_case, causal=True)
    for step in range(4):
        fresh = _decode_step(100 + step)
        for name in ("q", "k", "v"):
            graph_case[name].copy_(fresh[name])
            eager_case[name].copy_(fresh[name])
        if step:
            graph_case["cache_seqlens"] += 1
            eager_case["cache_seqlens"] += 1
        graph.replay()
        expected = fmha.flash_attn_with_kvcache(**eager_case, causal=True)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        assert torch.equal(graph_case["k_cache"], eager_case["k_cache"])
        assert torch.equal(graph_case["v_cache"], eager_case["v_cache"])


def test_torch_compile_fullgraph_decode_step_gpu():
    eager_case = _decode_step(12, page_size=None)
    compiled_case = {name: value.clone() for name, value in eager_case.items()}

    def step(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens):
        out = fmha.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                           causal=True)
        return out * 2

    expected = step(**eager_case)
    got = torch.compile(step, fullgraph=True)(**compiled_case)
    assert torch.equal(got, expected)
    assert torch.equal(compiled_case["k_cache"], eager_case["k_cache"])
    assert torch.equal(compiled_case["v_cache"], eager_case["v_cache"])


PAGED_VARLEN_LENGTHS = {
    # (query lengths, key lengths): decode rows over long caches (split keys), chunked prefill,
    # and prefill with empty and one-token sequences.
    "decode": ([1] * 16, [4096, 1, 0, 3000, 77, 2048, 8000, 5, 1024, 1023, 6000, 2, 4097, 300, 7000, 64]),
    "chunked": ([128, 1, 512, 37], [2048, 1, 4096, 3000]),
    "prefill": ([700, 0, 1, 1300, 257], [700, 0, 1, 1300, 257]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths", list(PAGED_VARLEN_LENGTHS))
@pytest.mark.parametrize("page_size", [1, 16, 24, 256], ids=lambda size: f"page{size}")
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(32, 8, 128), (8, 8, 64), (16, 2, 256)],
                         ids=lambda value: str(value))
def test_paged_varlen_gpu(dtype, lengths, page_size, q_heads, kv_heads, head_dim):
    """flash_attn_varlen_func with a block table, causal (decode rows see their whole cache)."""
    case = random_paged_varlen(*PAGED_VARLEN_LENGTHS[lengths], q_heads, kv_heads, head_dim, page_size, dtype=dtype,
                               device="cuda", seed=seed_of(dtype, lengths, page_size, q_heads, head_dim))
    check_paged_varlen(fmha.flash_attn_varlen_func, case, causal=True)


@pytest.mark.parametrize("options", [dict(window_size=(255, 0)), dict(window_size=(100, 30)),
                                     dict(causal=True, softcap=30.0), dict(causal=True, alibi="batch")],
                         ids=["window255", "window100-30", "softcap", "alibi"])
def test_paged_varlen_options_gpu(options):
    case = random_paged_varlen(*PAGED_VARLEN_LENGTHS["chunked"], 16, 4, 128, 16, dtype=torch.bfloat16,
                               device="cuda", seed=seed_of(str(options)))
    if options.get("alibi"):
        options = dict(options, alibi_slopes=torch.rand(4, 16, device="cuda") * 0.1)
        del options["alibi"]
    check_paged_varlen(fmha.flash_attn_varlen_func, case, **options)


def test_paged_varlen_rows_past_a_short_max_seqlen_q_are_nan_gpu():
    case = random_paged_varlen(*PAGED_VARLEN_LENGTHS["chunked"], 16, 4, 128, 16, dtype=torch.bfloat16,
                               device="cuda")
    exact = fmha.flash_attn_varlen_func(**case, causal=True)
    short = fmha.flash_attn_varlen_func(**{**case, "max_seqlen_q": 64}, causal=True)
    starts = case["cu_seqlens_q"].tolist()
    for b in range(len(starts) - 1):
        # Other chunk counts (a smaller grid): bf16 roundings apart.
        torch.testing.assert_close(short[starts[b]:starts[b + 1]][:64], exact[starts[b]:starts[b + 1]][:64],
                                   rtol=2e-2, atol=2e-2)
    assert short[starts[2] + 64:starts[3]].isnan().all()  # past the grid's 4 blocks of 64 packed rows


def test_paged_varlen_cuda_graph_replay_equals_eager_gpu():
    case = random_paged_varlen(*PAGED_VARLEN_LENGTHS["decode"], 32, 8, 128, 16, dtype=torch.bfloat16, device="cuda")
    fmha.flash_attn_varlen_func(**case, causal=True)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fmha.flash_attn_varlen_func(**case, causal=True)
    case["q"].copy_(torch.randn_like(case["q"]))
    eager = fmha.flash_attn_varlen_func(**case, causal=True)
    graph.replay()
    assert torch.equal(captured, eager)


def test_paged_varlen_torch_compile_fullgraph_gpu():
    case = random_paged_varlen(*PAGED_VARLEN_LENGTHS["chunked"], 16, 4, 128, 16, dtype=torch.bfloat16, device="cuda")

    def layer(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table):
        out = fmha.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          causal=True, block_table=block_table)
        return out * 2

    expected = layer(**case)
    got = torch.compile(layer, fullgraph=True)(**case)
    assert torch.equal(got, expected)
