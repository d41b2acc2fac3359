"""GPU correctness over the full shape grid (marker ``gpu``; skipped without CUDA).

Error rule: max|fmha - float64| <= 2 * max|PyTorch SDPA MATH (same dtype) - float64| + atol.
"""

import itertools

import pytest
import torch

import fmha

from .helpers import assert_close_to_reference, assert_grads_close, random_qkv

pytestmark = pytest.mark.gpu

HEAD_DIMS = [32, 64, 80, 96, 128, 192, 256]
LENGTHS = [1, 17, 128, 1000, 4096]
GROUPS = [1, 4, 8]
KV_HEADS = 2


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", list(itertools.product(LENGTHS, LENGTHS)))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_forward_grid(dtype, head_dim, seqlen_q, seqlen_k, causal, group):
    batch = 1 if max(seqlen_q, seqlen_k) >= 4096 else 2
    # Every other GQA ratio reads BSHD storage through transposed views.
    layout = "bshd" if group == 4 else "bhsd"
    generator = torch.Generator(device="cuda").manual_seed(hash((head_dim, seqlen_q, seqlen_k, causal, group)) % 2**31)
    q, k, v = random_qkv(batch, KV_HEADS * group, KV_HEADS, seqlen_q, seqlen_k, head_dim, dtype,
                         device="cuda", layout=layout, generator=generator)
    out, lse = fmha.attention(q, k, v, causal=causal, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal_offset=seqlen_k - seqlen_q if causal else None,
                              lse=lse, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (17, 1000), (1000, 17), (128, 128), (1000, 1000)])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_naive_gpu(dtype, head_dim, seqlen_q, seqlen_k, causal):
    q, k, v = random_qkv(2, 4, 2, seqlen_q, seqlen_k, head_dim, dtype, device="cuda")
    out, lse = fmha.naive_attention(q, k, v, causal=causal, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal_offset=seqlen_k - seqlen_q if causal else None,
                              lse=lse, atol=1e-5)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(100, 1000), (1000, 100), (1000, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_sdpa_top_left_causal_gpu(dtype, seqlen_q, seqlen_k):
    q, k, v = random_qkv(2, 8, 2, seqlen_q, seqlen_k, 64, dtype, device="cuda")
    out = fmha.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close_to_reference(out, q, k, v, causal_offset=0, atol=1e-5)


@pytest.mark.parametrize("head_dim", [40, 128, 256])
def test_float32_gpu(head_dim):
    q, k, v = random_qkv(2, 4, 2, 300, 257, head_dim, torch.float32, device="cuda")
    out = fmha.attention(q, k, v, causal=True)
    assert_close_to_reference(out, q, k, v, causal_offset=-43)


def test_long_sequence_allocates_no_score_matrix():
    seqlen, head_dim = 131072, 128
    q, k, v = random_qkv(1, 1, 1, seqlen, seqlen, head_dim, torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fmha.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    output_bytes = out.numel() * out.element_size() + seqlen * 4  # out + LSE
    assert extra <= output_bytes + (1 << 20), f"{extra} bytes allocated; the output needs {output_bytes}"
    assert torch.isfinite(out).all()
    # Spot-check the last rows (which see every key) against float64.
    tail = slice(seqlen - 64, seqlen)
    from fmha.reference import dense_attention
    ref, _ = dense_attention(q[:, :, tail], k, v, causal_offset=seqlen - 64)
    assert (out[:, :, tail].double() - ref).abs().max().item() < 2e-2


HOPPER_SCHEDULES = {  # HopperSchedule fields; names without spaces (test ids pass through a shell)
    "grid": {"persistent": False},
    "persistent": {"persistent": True},
    "emulated_exp2_1_in_8": {"emulated_exp2": 8},
    "emulated_exp2_1_in_2": {"emulated_exp2": 2},
    "three_consumers": {"consumers": 3, "block_n": 64, "stages": 3},
    "three_consumers_128_keys": {"consumers": 3, "q_buffers": 2, "emulated_exp2": 8},
    "persistent_two_q_buffers": {"persistent": True, "q_buffers": 2},
    "persistent_two_q_buffers_exp2_1_in_8": {"persistent": True, "q_buffers": 2, "emulated_exp2": 8},
    "persistent_two_q_buffers_packed_p": {"persistent": True, "q_buffers": 2, "pack_p": True},
    "one_consumer_two_ctas_per_sm": {"consumers": 1, "q_buffers": 2, "ctas_per_sm": 2, "emulated_exp2": 8},
    "one_consumer_three_ctas_per_sm_64_keys": {"consumers": 1, "block_n": 64, "q_buffers": 2, "ctas_per_sm": 3},
    "one_consumer_three_ctas_per_sm_64_keys_exp2_1_in_8": {"consumers": 1, "block_n": 64, "q_buffers": 2,
                                                           "ctas_per_sm": 3, "emulated_exp2": 8},
    "dynamic": {"persistent": True, "dynamic": True},
    "dynamic_two_q_buffers_exp2_1_in_8": {"persistent": True, "dynamic": True, "q_buffers": 2, "emulated_exp2": 8},
    "dynamic_two_q_buffers_packed_p": {"persistent": True, "dynamic": True, "q_buffers": 2, "pack_p": True},
    "dynamic_one_consumer_three_ctas_per_sm_64_keys": {"consumers": 1, "block_n": 64, "q_buffers": 2, "ctas_per_sm": 3,
                                                       "dynamic": True},
    "grid_turns": {"persistent": False, "pingpong": 1},
    "persistent_turns": {"persistent": True, "pingpong": 1},
    "dynamic_two_q_buffers_exp2_1_in_8_turns": {"persistent": True, "dynamic": True, "q_buffers": 2, "emulated_exp2": 8,
                                                "pingpong": 1},
    "three_consumers_row_sum_mma": {"consumers": 3, "q_buffers": 2, "row_sum_mma": True},
    "dynamic_three_consumers_row_sum_mma": {"consumers": 3, "q_buffers": 2, "dynamic": True, "row_sum_mma": True},
    "persistent_two_q_buffers_packed_p_row_sum_mma": {"persistent": True, "q_buffers": 2, "pack_p": True,
                                                      "row_sum_mma": True},
    "persistent_two_q_buffers_exp2_1_in_8_turns_row_sum_mma": {"persistent": True, "q_buffers": 2, "emulated_exp2": 8,
                                                               "pingpong": 1, "row_sum_mma": True},
    "dynamic_two_q_buffers_packed_p_row_sum_mma": {"persistent": True, "dynamic": True, "q_buffers": 2, "pack_p": True,
                                                   "row_sum_mma": True},
    "one_consumer_three_ctas_per_sm_64_keys_row_sum_mma": {"consumers": 1, "block_n": 64, "q_buffers": 2,
                                                           "ctas_per_sm": 3, "row_sum_mma": True},
    # 64-key blocks with one Q buffer: the schedules D = 256 builds (its output staged in the Q buffer)
    "persistent_64_keys": {"persistent": True, "block_n": 64},
    "persistent_64_keys_packed_p": {"persistent": True, "block_n": 64, "pack_p": True},
    "grid_64_keys_packed_p": {"persistent": False, "block_n": 64, "pack_p": True},
    "dynamic_64_keys_packed_p": {"persistent": True, "dynamic": True, "block_n": 64, "pack_p": True},
}


def skip_unbuildable(schedule: str, head_dim: int):
    """Skip a schedule the Gluon backend refuses at this head dim (too few registers or too much
    shared memory: HopperSchedule.build_refusal, which tests/test_hopper_kernel.py checks against ptxas)."""
    reason = fmha.HopperSchedule(**HOPPER_SCHEDULES[schedule]).build_refusal(head_dim)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("schedule", HOPPER_SCHEDULES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_hopper_kernel_schedules(dtype, head_dim, causal, schedule):
    """The Gluon kernel's grids and softmax variants, on more tiles than multiprocessors, through
    an explicit ``config=HopperSchedule(...)``."""
    skip_unbuildable(schedule, head_dim)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    q, k, v = random_qkv(4, 16, 4, 777, 1500, head_dim, dtype, device="cuda", layout="bshd")
    out, lse = fmha.attention(q, k, v, causal=causal, return_lse=True,
                              config=fmha.HopperSchedule(**HOPPER_SCHEDULES[schedule]))
    offset = 1500 - 777 if causal else None
    assert_close_to_reference(out, q, k, v, causal_offset=offset, lse=lse, atol=1e-5)


@pytest.mark.parametrize("shape, causal, plan", [
    ((16, 2, 2, 1024, 1024), True, "one_consumer_three_ctas_per_sm_64_keys"),
    ((6, 4, 2, 1500, 1500), True, "one_consumer_three_ctas_per_sm_64_keys"),
    ((8, 4, 4, 1100, 1700), True, "one_consumer_three_ctas_per_sm_64_keys"),  # bottom-right causal: Sk > Sq
    ((1, 16, 16, 1024, 1024), False, "one_consumer_two_ctas_per_sm"),
    ((1, 3, 1, 3000, 2000), False, "one_consumer_two_ctas_per_sm"),
    ((4, 8, 8, 2048, 2048), False, "three_consumers_row_sum_mma"),
    ((2, 6, 2, 3000, 5000), False, "three_consumers_row_sum_mma"),
    ((1, 8, 8, 8192, 8192), True, "dynamic_three_consumers_row_sum_mma"),
    ((1, 6, 3, 9000, 9500), True, "dynamic_three_consumers_row_sum_mma"),  # bottom-right causal: Sk > Sq
], ids=lambda value: "x".join(map(str, value)) if isinstance(value, tuple) else str(value))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_default_path_schedules(dtype, shape, causal, plan):
    """fmha.attention on shapes where the default path picks each one-consumer schedule."""
    batch, q_heads, kv_heads, seqlen_q, seqlen_k = shape
    q, k, v = random_qkv(batch, q_heads, kv_heads, seqlen_q, seqlen_k, 64, dtype, device="cuda", layout="bshd")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel's schedules")
    explanation = fmha.explain(q, k, v, causal=causal)
    assert explanation.backend == "gluon_sm90" and explanation.config == fmha.HopperSchedule(**HOPPER_SCHEDULES[plan])
    out, lse = fmha.attention(q, k, v, causal=causal, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal_offset=seqlen_k - seqlen_q if causal else None,
                              lse=lse, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1, 1, 300, 300), (1, 5, 5, 300, 300), (7, 1, 1, 1100, 1100), (2, 3, 1, 640, 900)],
                         ids=lambda shape: "x".join(map(str, shape)))  # ids pass through a shell: no spaces
@pytest.mark.parametrize("schedule", ["persistent_two_q_buffers", "one_consumer_three_ctas_per_sm_64_keys", "dynamic",
                                      "dynamic_one_consumer_three_ctas_per_sm_64_keys", "persistent_turns",
                                      "dynamic_two_q_buffers_exp2_1_in_8_turns",
                                      "persistent_two_q_buffers_exp2_1_in_8_turns_row_sum_mma"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_causal_pairs_cover_every_tile(head_dim, shape, schedule):
    """Persistent causal programs walk pairs of tiles: odd tile counts (the last pair is one tile),
    pairs that straddle two heads (odd query blocks per head) and fewer pairs than multiprocessors."""
    skip_unbuildable(schedule, head_dim)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    batch, q_heads, kv_heads, seqlen_q, seqlen_k = shape
    q, k, v = random_qkv(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, torch.bfloat16, device="cuda")
    offset = seqlen_k - seqlen_q
    out, lse = fmha.attention(q, k, v, causal=True, return_lse=True,
                              config=fmha.HopperSchedule(**HOPPER_SCHEDULES[schedule]))
    assert_close_to_reference(out, q, k, v, causal_offset=offset, lse=lse, atol=1e-5)


@pytest.mark.parametrize("window", [None, (300, 0), (200, 100)],
                         ids=lambda window: "causal" if window is None else f"left{window[0]}-right{window[1]}")
@pytest.mark.parametrize("schedule", ["three_consumers_row_sum_mma", "dynamic_three_consumers_row_sum_mma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_row_sums_on_the_tensor_cores_where_rows_see_no_key(dtype, schedule, window):
    """The row sums of P·ones (HopperSchedule.row_sum_mma) where Sq > Sk leaves the first rows of a
    bottom-right causal call without a key (output 0, LSE -inf), and with windows, whose edge blocks
    are masked on both sides."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    q, k, v = random_qkv(2, 6, 2, 1500, 700, 64, dtype, device="cuda")
    config = fmha.HopperSchedule(**HOPPER_SCHEDULES[schedule])
    if window is None:
        out, lse = fmha.attention(q, k, v, causal=True, return_lse=True, config=config)
        assert_close_to_reference(out, q, k, v, causal_offset=700 - 1500, lse=lse, atol=1e-5)
        assert torch.isneginf(lse[:, :, :800]).all() and (out[:, :, :800] == 0).all()
    else:
        from fmha.masking import Window

        out, lse = fmha.attention(q, k, v, window=window, return_lse=True, config=config)
        assert_close_to_reference(out, q, k, v, window=Window.of(1500, 700, left=window[0], right=window[1]), lse=lse,
                                  atol=1e-5)


# (batch, q heads, kv heads, Sq, Sk, head dim): decode shapes whose per-KV-head grid leaves the GPU idle
SPLIT_KV_SHAPES = [(1, 32, 8, 1, 4096, 128), (8, 32, 8, 1, 2048, 128), (2, 16, 2, 4, 8192, 64),
                   (1, 8, 1, 8, 3000, 256), (3, 12, 4, 2, 1000, 80)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SPLIT_KV_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_split_kv_decode_gpu(dtype, shape, causal):
    from fmha.backends.triton.config import SplitKVConfig

    q, k, v = random_qkv(*shape, dtype, device="cuda")
    assert isinstance(fmha.explain(q, k, v, causal=causal).config, SplitKVConfig)
    out, lse = fmha.attention(q, k, v, causal=causal, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal_offset=shape[4] - shape[3] if causal else None, lse=lse,
                              atol=1e-5)


def test_more_batch_heads_than_a_grid_axis_holds():
    """B·Hkv = 65,600 in a split-KV decode and B·H = 65,600 in the naive kernels: past the 65,535
    that a CUDA grid's second and third axes hold; (batch, head) pairs take the first axis. (Head dim
    76, not a multiple of 8: the Gluon forward, which takes D = 80, leaves it to the split-KV kernel.)"""
    from fmha.backends.triton.config import SplitKVConfig

    q, k, v = random_qkv(16400, 16, 4, 1, 64, 76, torch.bfloat16, device="cuda")
    assert isinstance(fmha.explain(q, k, v).config, SplitKVConfig)
    keep = torch.cat([torch.arange(0, 8), torch.arange(16392, 16400)]).cuda()  # the first and last batches
    out = fmha.attention(q, k, v)
    assert_close_to_reference(out[keep], q[keep], k[keep], v[keep])
    q, k, v = random_qkv(4100, 16, 16, 16, 16, 64, torch.bfloat16, device="cuda")
    out = fmha.naive_attention(q, k, v, causal=True)
    assert_close_to_reference(out[:8], q[:8], k[:8], v[:8], causal_offset=0)
    assert_close_to_reference(out[-8:], q[-8:], k[-8:], v[-8:], causal_offset=0)


@pytest.mark.parametrize("features", [{}, {"softcap": 20.0}, {"dropout_p": 0.2}], ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("schedule", [{"persistent": True}, {"persistent": True, "dynamic": True, "q_buffers": 2}],
                         ids=["persistent", "dynamic"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_turns_change_no_arithmetic(head_dim, schedule, features):
    """The consumers taking turns (HopperSchedule.pingpong) only orders when products are issued:
    outputs and LSE are bitwise those of the schedule without turns."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    q, k, v = random_qkv(3, 8, 2, 1000, 1300, head_dim, torch.bfloat16, device="cuda", layout="bshd")
    results = []
    for pingpong in (0, 1):
        generator = torch.Generator(device="cuda").manual_seed(5) if "dropout_p" in features else None
        extra = {"generator": generator} if generator is not None else {}
        results.append(fmha.attention(q, k, v, causal=True, return_lse=True, **features, **extra,
                                      config=fmha.HopperSchedule(**schedule, pingpong=pingpong)))
    (out_off, lse_off), (out_on, lse_on) = results
    assert torch.equal(out_on, out_off) and torch.equal(lse_on, lse_off)


@pytest.mark.parametrize("layout", ["bhsd", "bshd", "packed"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_keys_expanded_over_heads_run_the_hopper_forward_as_one_kv_head(head_dim, causal, layout):
    """k and v expanded over their heads (stride 0, as in ``repeat_kv`` of an MQA model) run the
    Hopper forward as one KV head: the output equals a call with that one head, bit for bit, and the
    gradients (the portable backward, through the stride-0 views) match float64."""
    batch, heads, seqlen_q, seqlen_k = 2, 8, 1536, 2048  # over the size the portable forward takes
    generator = torch.Generator(device="cuda").manual_seed(head_dim + causal)
    q, k1, v1 = random_qkv(batch, heads, 1, seqlen_q, seqlen_k, head_dim, torch.bfloat16, device="cuda",
                           layout="bshd" if layout == "bshd" else "bhsd", generator=generator)
    if layout == "packed":
        cu_seqlens_q, cu_seqlens_k = (torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * n
                                      for n in (seqlen_q, seqlen_k))
        q_p, k_p, v_p = (x.transpose(1, 2).reshape(-1, x.shape[1], head_dim) for x in (q, k1, v1))
        expanded = k_p.expand(-1, heads, -1), v_p.expand(-1, heads, -1)
        outs = [fmha.varlen_attention(q_p, kk, vv, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, causal=causal)
                for kk, vv in ((k_p, v_p), expanded)]
        assert torch.equal(outs[0], outs[1])
        out = outs[1].reshape(batch, seqlen_q, heads, head_dim).transpose(1, 2)
        assert_close_to_reference(out, q, k1, v1, causal_offset=seqlen_k - seqlen_q if causal else None, atol=1e-5)
        return
    k, v = k1.expand(batch, heads, seqlen_k, head_dim), v1.expand(batch, heads, seqlen_k, head_dim)
    explanation = fmha.explain(q, k, v, causal=causal)
    assert explanation.backend == "gluon_sm90" and "one KV head" in explanation.source, str(explanation)
    out, lse = fmha.attention(q, k, v, causal=causal, return_lse=True)
    one_head = fmha.attention(q, k1, v1, causal=causal, return_lse=True)
    assert torch.equal(out, one_head[0]) and torch.equal(lse, one_head[1])
    assert_close_to_reference(out, q, k, v, causal_offset=seqlen_k - seqlen_q if causal else None, lse=lse,
                              atol=1e-5)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fmha.attention(q, k, v, causal=causal)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=generator)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close(grads, q.detach(), k.detach(), v.detach(), dout,
                       causal_offset=seqlen_k - seqlen_q if causal else None, out=out.detach())


@pytest.mark.parametrize("shapes", [((2, 8, 1536, 128), (2, 1, 2048, 128)), ((2, 8, 1536, 64), (1, 8, 2048, 64)),
                                    ((3, 2, 4, 300, 64), (2, 1, 500, 64))],
                         ids=lambda shapes: "-".join("x".join(map(str, shape)) for shape in shapes))
def test_sdpa_broadcasts_leading_dims_gpu(shapes):
    """SDPA's leading dims broadcast as in torch: one key/value head for every query head (the
    Hopper forward's one KV head), a batch of one, and fewer dims."""
    query_shape, key_shape = shapes
    generator = torch.Generator(device="cuda").manual_seed(len(query_shape))
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
               for shape in (query_shape, key_shape, key_shape))
    out = fmha.scaled_dot_product_attention(q, k, v, is_causal=True)
    batch = torch.broadcast_shapes(query_shape[:-2], key_shape[:-2])
    full = [x.expand(*batch, *x.shape[-2:]).reshape(-1, *x.shape[-2:]).unsqueeze(0) for x in (q, k, v)]
    assert out.shape == (*batch, *query_shape[-2:])
    assert_close_to_reference(out.reshape(full[0].shape), *full, causal_offset=0, atol=1e-5)


FEATURE_MAJOR_CALL = r"""
import sys, torch, fmha
from fmha.testing import assert_close_to_reference, assert_grads_close
from fmha.masking import Window
which, window = sys.argv[1], eval(sys.argv[2])
g = torch.Generator(device="cuda").manual_seed(0)

def tensor(heads, seqlen, feature_major):
    if feature_major:  # the head dim outermost in memory, the sequence innermost: unit sequence stride
        return torch.randn(24, seqlen, heads, 1, device="cuda", dtype=torch.bfloat16, generator=g).permute(3, 2, 1, 0)
    return torch.randn(1, heads, seqlen, 24, device="cuda", dtype=torch.bfloat16, generator=g)

shapes = (("q", 4, 128), ("k", 1, 1000), ("v", 1, 1000))
q, k, v = (tensor(heads, seqlen, name in which) for name, heads, seqlen in shapes)
visible = Window.of(128, 1000, left=window[0], right=window[1]) if window else None
leaves = [t.requires_grad_() for t in (q, k, v)]
out = fmha.attention(*leaves, window=window)
assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach(), window=visible)
dout = torch.randn_like(out)
grads = torch.autograd.grad(out, leaves, dout)
assert_grads_close(grads, q.detach(), k.detach(), v.detach(), dout, window=visible, out=out.detach())
print("ok")
"""


@pytest.mark.parametrize("window", ["(256, None)", "None"])
@pytest.mark.parametrize("which", ["k", "v", "q", "qkv"])
def test_tensors_stored_feature_major_gpu(which, window):
    """q, k or v whose head dim is outermost in memory (a unit sequence stride) on the portable
    kernels, which take any strides. Random calls found an illegal memory access in the forward
    with such a k (B1 Hq4 Hkv1 Sq128 Sk1000 D24 bf16, window (256, None); H200, triton 3.6,
    session 51). Each call runs in a child process: an illegal access ends the CUDA context."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", FEATURE_MAJOR_CALL, which, window], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
