"""What each score becomes (softcap, ALiBi, sinks, dropout, SDPA's attn_mask) on the CPU through the
interpreter: forward and gradients against float64, torch's SDPA as the oracle for masks, and
dropout's statistics and reproducibility."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha
from fmha import ops
from fmha.backends.gluon_sm90.backend import attn_mask_refusal
from fmha.backends.triton.config import SplitKVConfig
from fmha.backends.triton.launch import dropout_keep_mask, dropout_threshold, kernel_dropout_p
from fmha.backends.triton.scores import PHILOX_ROUNDS, dropout_keep, exact_tanh
from fmha.masking import Window
from fmha.reference import dense_attention

from .helpers import assert_close_to_reference, assert_grads_close, random_qkv

pytestmark = pytest.mark.interpreter


def seeded(*shape, low=0.0, high=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=generator) * (high - low) + low


def features(name, batch, q_heads):
    """fmha.attention keyword arguments of a feature set; the reference takes the same ones."""
    slopes = seeded(q_heads, low=0.05, high=0.6)
    sinks = seeded(q_heads, low=-1.0, high=2.0, seed=1)
    return {
        "softcap": dict(softcap=1.5),
        "alibi": dict(alibi_slopes=slopes),
        "alibi_batched": dict(alibi_slopes=seeded(batch, q_heads, low=0.05, high=0.6, seed=2)),
        "sinks": dict(sinks=sinks),
        "all": dict(softcap=4.0, alibi_slopes=slopes, sinks=sinks),
    }[name]


def grads_with_sinks(out, q, k, v, kwargs, seed=0):
    """Gradients of ``out`` w.r.t. q, k, v (and the sinks when they are there) for a fixed dout."""
    dout = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    leaves = (q, k, v) + ((kwargs["sinks"],) if "sinks" in kwargs else ())
    return torch.autograd.grad(out, leaves, dout), dout


# (batch, q heads, kv heads, Sq, Sk, head dim, causal, window): bottom-right causal with Sq < Sk
# and Sq > Sk (rows that see nothing), GQA, a sliding window, lengths off the 16-row tiles.
SHAPES = [(1, 4, 2, 37, 45, 24, True, None), (2, 2, 2, 29, 19, 16, True, None), (1, 2, 1, 30, 41, 32, False, (6, 3))]


def window_of(shape):
    _, _, _, seqlen_q, seqlen_k, _, causal, window = shape
    left, right = window or (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return None
    return Window.of(seqlen_q, seqlen_k, left=left, right=right)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) + ("-causal" if s[6] else "")
                         + ("-window" if s[7] else ""))
@pytest.mark.parametrize("name", ["softcap", "alibi", "alibi_batched", "sinks", "all"])
def test_forward_and_gradients_match_float64(name, shape, dtype):
    batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, window = shape
    # Seeded: dsinks sums every row's rounding, and unseeded draws put it past the bound now and then.
    generator = torch.Generator().manual_seed(0)
    q, k, v = (t.requires_grad_() for t in random_qkv(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype,
                                                      generator=generator))
    kwargs = features(name, batch, q_heads)
    if "sinks" in kwargs:
        kwargs["sinks"] = kwargs["sinks"].requires_grad_()
    out, lse = fmha.attention(q, k, v, causal=causal, window=window, return_lse=True, **kwargs)
    constants = {name: value.detach() if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach(), window=window_of(shape),
                              lse=lse, **constants)
    grads, dout = grads_with_sinks(out, q, k, v, kwargs)
    assert_grads_close(grads, q, k, v, dout, window=window_of(shape), **kwargs)


def test_sinks_gradient_is_the_sum_over_rows_and_batch():
    q, k, v = random_qkv(2, 3, 3, 20, 20, 16, torch.float32)
    sinks = torch.tensor([0.5, -1.0, 3.0], requires_grad=True)
    out = fmha.attention(q, k, v, sinks=sinks)
    (dsinks,) = torch.autograd.grad(out.square().sum(), sinks)
    leaf = sinks.detach().double().requires_grad_()
    ref, _ = dense_attention(q, k, v, sinks=leaf)
    (expected,) = torch.autograd.grad(ref.square().sum(), leaf)
    torch.testing.assert_close(dsinks.double(), expected, rtol=1e-4, atol=1e-6)
    assert dsinks.dtype == torch.float32 and dsinks.shape == (3,)


def test_rows_that_see_nothing_with_sinks_are_zero_with_lse_minus_inf():
    q, k, v = random_qkv(1, 2, 2, 40, 10, 16, torch.float32)
    sinks = torch.tensor([1.0, -2.0], requires_grad=True)
    out, lse = fmha.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)  # rows 0..29 see no key
    assert (out[:, :, :30] == 0).all() and torch.isneginf(lse[:, :, :30]).all()
    assert torch.isfinite(lse[:, :, 30:]).all()
    (dsinks,) = torch.autograd.grad(out.sum(), sinks)
    assert torch.isfinite(dsinks).all()


def test_huge_sinks_take_all_the_mass_without_overflow():
    q, k, v = random_qkv(1, 2, 2, 16, 16, 16, torch.float32)
    out, lse = fmha.attention(q, k, v, sinks=torch.tensor([200.0, float("-inf")]), return_lse=True)
    assert out[:, 0].abs().max() < 1e-30 and torch.allclose(lse[:, 0], torch.full_like(lse[:, 0], 200.0))
    torch.testing.assert_close(out[:, 1], fmha.attention(q, k, v)[:, 1])


@triton.jit
def _tanh_of(X, Y, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(Y + offsets, exact_tanh(tl.load(X + offsets)))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply")  # x² of 1e30: the other branch's
def test_exact_tanh_has_a_relative_error_below_float32_epsilon():
    # 1 - 2 / (exp(2x) + 1) alone gives 0 for |x| < 2^-25 and loses all but a few bits below 0.01.
    magnitudes = torch.cat([torch.logspace(-30, 1.5, 3000, base=2.0), torch.linspace(0.8, 1.0, 1000),
                            torch.tensor([100.0, 1e30])])
    x = torch.cat([magnitudes, -magnitudes, torch.zeros(1)])
    x = torch.cat([x, torch.zeros(8192 - x.numel())]).float()
    y = torch.full_like(x, float("nan"))
    _tanh_of[(1,)](x, y, N=8192)
    expected = torch.tanh(x.double())
    relative = (y.double() - expected).abs() / expected.abs().clamp_min(2.0 ** -126) / torch.finfo(torch.float32).eps
    assert not y.isnan().any() and relative.max() <= 1.0, \
        f"{relative.max():.2f} eps at x = {x[relative.argmax()].item():.3g}"


@pytest.mark.parametrize("softcap", [30.0, 50.0])
def test_float32_scores_under_a_large_softcap_match_float64(softcap):
    # Gemma 2's caps leave s / softcap small, where a cancelling tanh was 10x torch's error.
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 4, 2, 33, 45, 40, torch.float32))
    out = fmha.attention(q, k, v, causal=True, softcap=softcap)
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach(), causal_offset=12, softcap=softcap)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close(grads, q.detach(), k.detach(), v.detach(), dout, causal_offset=12, softcap=softcap)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")  # the interpreter's exp2 -> inf: tanh -> 1
def test_softcap_bounds_large_scores():
    q, k, v = random_qkv(1, 2, 2, 20, 33, 16, torch.float16)
    q = q * 30  # scores far past the cap
    out = fmha.attention(q, k, v, softcap=2.0)
    assert_close_to_reference(out, q, k, v, softcap=2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_packed_sequences_with_every_feature(dtype):
    lengths_q, lengths_k = [5, 0, 23, 17], [9, 4, 16, 30]
    q_heads, kv_heads, head_dim = 4, 2, 16
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lengths_q), q_heads, head_dim, generator=generator).to(dtype).requires_grad_()
    k, v = (torch.randn(sum(lengths_k), kv_heads, head_dim, generator=generator).to(dtype).requires_grad_()
            for _ in range(2))
    slopes = seeded(4, q_heads, low=0.05, high=0.5)
    sinks = seeded(q_heads, low=-1.0, high=1.0, seed=4).requires_grad_()
    rng = torch.Generator().manual_seed(11)
    options = dict(causal=True, softcap=3.0, alibi_slopes=slopes, sinks=sinks, dropout_p=0.2)
    out, lse = fmha.varlen_attention(q, k, v, cu_q, cu_k, 23, 30, generator=rng, return_lse=True, **options)
    dout = torch.randn(out.shape, generator=generator).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    # The pattern the kernels kept: rows (head, packed token), keys counted from each sequence's start.
    rng.manual_seed(11)
    keep = dropout_keep_mask(ops.dropout_seed(rng, q.device), q_heads * q.shape[0], k.shape[0], 0.2, cu_seqlens_q=cu_q)
    keep = keep.view(q_heads, q.shape[0], k.shape[0])
    dq, dk, dv, dsinks = grads
    dsinks_expected = torch.zeros(q_heads, dtype=torch.float64)
    for b in range(4):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        q_b, k_b, v_b, out_b, dout_b = (t[s].transpose(0, 1)[None] for t, s in
                                        ((q, rows), (k, keys), (v, keys), (out, rows), (dout, rows)))
        scores = dict(softcap=3.0, alibi_slopes=slopes[b], sinks=sinks.detach(), dropout_p=kernel_dropout_p(0.2),
                      keep=keep[:, rows, :lengths_k[b]][None])
        window = Window.causal(lengths_k[b] - lengths_q[b])
        if not lengths_q[b]:  # keys no query sees get no gradient
            assert (dk[keys] == 0).all() and (dv[keys] == 0).all()
            continue
        assert_close_to_reference(out_b.detach(), q_b.detach(), k_b.detach(), v_b.detach(), window=window,
                                  lse=lse[:, rows][None], **scores)
        grads_b = [g[s].transpose(0, 1)[None] for g, s in ((dq, rows), (dk, keys), (dv, keys))]
        assert_grads_close(grads_b, q_b.detach(), k_b.detach(), v_b.detach(), dout_b, window=window, **scores)
        leaf = sinks.detach().double().requires_grad_()
        ref, _ = dense_attention(q_b.detach(), k_b.detach(), v_b.detach(), window=window,
                                 **{**scores, "sinks": leaf})
        dsinks_expected += torch.autograd.grad(ref, leaf, dout_b.double())[0]
    torch.testing.assert_close(dsinks.double(), dsinks_expected, rtol=2e-2 if dtype == torch.float16 else 1e-4,
                               atol=2e-3 if dtype == torch.float16 else 1e-5)


# Dropout

def dropout_pattern(generator_seed, shape, dropout_p, device="cpu"):
    """The (B, Hq, Sq, Sk) pattern of a dense call whose generator was seeded with ``generator_seed``."""
    batch, q_heads, seqlen_q, seqlen_k = shape
    key = ops.dropout_seed(torch.Generator(device).manual_seed(generator_seed), device)
    return dropout_keep_mask(key, batch * q_heads * seqlen_q, seqlen_k, dropout_p, seqlen_q=seqlen_q).view(shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape, options", [
    ((1, 4, 2, 37, 45, 24), dict(causal=True)),
    ((1, 2, 2, 33, 30, 16), dict(window=(5, 4), softcap=2.0, sinks=seeded(2, seed=5))),
], ids=["gqa-causal", "window-softcap-sinks"])
def test_dropout_matches_float64_with_the_kernels_pattern(shape, options, dtype):
    batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim = shape
    q, k, v = (t.requires_grad_() for t in random_qkv(*shape, dtype))
    out = fmha.attention(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(7), **options)
    keep = dropout_pattern(7, (batch, q_heads, seqlen_q, seqlen_k), 0.3)
    window = options.get("window")
    window = Window.of(seqlen_q, seqlen_k, left=window[0], right=window[1]) if window else None
    reference = dict(causal_offset=seqlen_k - seqlen_q) if options.get("causal") else dict(window=window)
    scores = {name: value for name, value in options.items() if name in ("softcap", "sinks")}
    dropout = dict(dropout_p=kernel_dropout_p(0.3), keep=keep)  # 0.3 to the kernels' 1/256 steps
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach(), **dropout, **reference, **scores)
    grads, dout = grads_with_sinks(out, q, k, v, {})
    assert_grads_close(grads, q, k, v, dout, **dropout, **reference, **scores)


def test_dropout_statistics():
    # 2 x 2 x 64 rows of 128 keys: 32,768 draws. With v = 1 every kept probability adds to its
    # row's output / (1 - p), so each output is an unbiased estimate of 1.
    p = 0.25
    keep = dropout_pattern(0, (2, 2, 64, 128), p)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.01  # about 4 standard deviations
    q, k = random_qkv(2, 2, 2, 64, 128, 16, torch.float32)[:2]
    v = torch.ones_like(k)
    out = fmha.attention(q, k, v, dropout_p=p, generator=torch.Generator().manual_seed(0))
    assert abs(out.mean().item() - 1.0) < 0.02
    assert out.std().item() > 0.01  # the rows differ: bits are not shared between rows
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0], keep[1])


def test_dropout_draws_8_bits_and_rounds_p_to_them():
    # Find one score's draw d by bisection over the thresholds: it is kept exactly while
    # round(p * 256) <= d, so the p that round to d keep it and the next step drops it.
    key = ops.dropout_seed(torch.Generator().manual_seed(2), "cpu")

    def kept(p):
        return dropout_keep_mask(key, 1, 16, p)[0, 5].item()

    low, high = 0, 256  # kept at threshold low, dropped at high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if kept(middle / 256) else (low, middle)
    draw = low
    assert kept((draw - 0.49) / 256) and kept((draw + 0.49) / 256)
    assert not kept((draw + 0.51) / 256)
    if draw >= 1:
        assert kernel_dropout_p((draw + 0.49) / 256) == draw / 256
    # Every p strictly between 0 and 1 drops some draws and keeps others.
    assert [dropout_threshold(p) for p in (0.0, 1e-9, 0.4 / 256, 0.3, 1 - 1e-9, 1.0)] == [0, 1, 1, 77, 255, 256]


@pytest.mark.parametrize("block_keys", [32, 64, 128])
def test_dropout_pattern_is_the_same_for_every_tile_width(block_keys):
    key = ops.dropout_seed(torch.Generator().manual_seed(4), "cpu")
    narrow = dropout_keep_mask(key, 40, 200, 0.5)
    assert torch.equal(dropout_keep_mask(key, 40, 200, 0.5, block_keys=block_keys), narrow)
    assert 0.4 < narrow.float().mean() < 0.6


# Philox-4x32 and the key-to-draw mapping in NumPy: the arithmetic the Gluon kernels write again
# (fmha.backends.gluon_sm90.scores), checked against the portable kernels' pattern.

WORD = 0xFFFFFFFF


def philox_reference(c0, c1, c2, c3, key0, key1, rounds=10):
    """Philox-4x32 (Salmon et al., SC 2011) on uint64 arrays of 32-bit words; the key as ints."""
    for _ in range(rounds):
        product_b, product_a = c2 * 0xCD9E8D57, c0 * 0xD2511F53  # 32 x 32 bits: exact in 64
        c0, c1, c2, c3 = ((product_b >> 32) ^ c1 ^ key0, product_b & WORD,
                          (product_a >> 32) ^ c3 ^ key1, product_a & WORD)
        key0, key1 = (key0 + 0x9E3779B9) & WORD, (key1 + 0xBB67AE85) & WORD
    return c0, c1, c2, c3


def counter_words(seed: int, rows, groups):
    """``tl.philox(seed, 0, rows, 0, groups, PHILOX_ROUNDS)``: the counter ``(0, row, 0, group)``
    (broadcast), the seed's halves as the key."""
    rows, groups = np.broadcast_arrays(np.asarray(rows, dtype=np.uint64) & np.uint64(WORD),
                                       np.asarray(groups, dtype=np.uint64))
    zeros = np.zeros_like(rows)
    return philox_reference(zeros, rows, zeros, groups, seed & WORD, seed >> 32, rounds=PHILOX_ROUNDS.value)


def keep_reference(seed: int, rng_row: int, rows, keys, threshold: int):
    """Key j of row i (counted within its sequence) keeps its probability where byte
    2 · ((j // 8) % 2) + j % 2 of word 2 · ((i // 8) % 2) + (j // 16) % 2 of the counter
    ``(0, rng_row + i - (i & 8), 0, 4 · (j // 32) + (j % 8) // 2)`` is >= threshold."""
    rows = np.asarray(rows, dtype=np.uint64)[:, None]
    keys = np.asarray(keys, dtype=np.uint64)[None, :]
    words = counter_words(seed, np.uint64(rng_row) + rows - (rows & np.uint64(8)), 4 * (keys // 32) + (keys % 8) // 2)
    word = 2 * ((rows // 8) % 2) + (keys // 16) % 2
    byte = 2 * ((keys // 8) % 2) + keys % 2
    words = np.choose(np.broadcast_to(word, words[0].shape).astype(np.intp), words)
    return (words >> (np.uint64(8) * byte)) & np.uint64(0xFF) >= threshold


def test_philox_reference_gives_the_known_answers():
    # Random123's known-answer vectors of philox4x32-10
    vectors = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
               ((WORD,) * 4, (WORD, WORD), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
               ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
                (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, expected in vectors:
        words = philox_reference(*(np.array([c], dtype=np.uint64) for c in counter), *key)
        assert tuple(int(word[0]) for word in words) == expected


@pytest.mark.parametrize("dropout_p", [0.3, 1e-9, 1 - 1e-6])
def test_dropout_pattern_is_philox_of_its_documented_counters(dropout_p):
    key = ops.dropout_seed(torch.Generator().manual_seed(11), "cpu")
    seqlen_q, keys = 37, 200
    keep = dropout_keep_mask(key, 2 * seqlen_q, keys, dropout_p, seqlen_q=seqlen_q).view(2, seqlen_q, keys)
    for sequence in range(2):
        expected = keep_reference(int(key.item()), sequence * seqlen_q, np.arange(seqlen_q), np.arange(keys),
                                  dropout_threshold(dropout_p))
        np.testing.assert_array_equal(keep[sequence].numpy(), expected)


@triton.jit
def _keep_from_counters(RngState, Keep, rng_row, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    keys = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = dropout_keep(tl.load(RngState), rng_row, rows, tl.program_id(0) * BLOCK_N, threshold, BLOCK_M, BLOCK_N)
    tl.store(Keep + rows[:, None] * (tl.num_programs(0) * BLOCK_N) + keys[None, :], keep)


def test_dropout_rows_use_the_whole_high_word():
    # Calls of 2^31 rows and more (B · H · Sq): the row is a whole word of the counter, unsigned.
    key = ops.dropout_seed(torch.Generator().manual_seed(12), "cpu")
    for rng_row in (2 ** 31 - 16, 2 ** 32 - 40, 2 ** 32 - 8):  # the last wraps past 2^32
        keep = torch.empty(32, 96, dtype=torch.bool)
        _keep_from_counters[(3,)](key, keep, rng_row, 77, BLOCK_M=32, BLOCK_N=32)
        expected = keep_reference(int(key.item()), rng_row, np.arange(32), np.arange(96), 77)
        np.testing.assert_array_equal(keep.numpy(), expected)


@pytest.mark.parametrize("block_n", [64, 128])
def test_gluon_forward_draw_tiles_give_the_same_pattern(block_n):
    """The steps of fmha.backends.gluon_sm90.scores.dropout_draws and dropped in NumPy (``gl.join``
    stacks on a new last axis): a [32, block_n // 8] tile of counters, one per (row pair, eight
    keys), each word's byte pairs spread to 16-bit halves (PRMT 0x4140 and 0x4342), the halves
    expanded to a consumer's 64 rows by block_n keys, and each key's half compared with the
    threshold as a half-precision number, as ``set.ge.u32.f16x2`` compares them; and dropped_words'
    arrangement of the same halves as a consumer's 64 rows by block_n // 2 key pairs."""
    seed = int(ops.dropout_seed(torch.Generator().manual_seed(13), "cpu").item())
    first_row, rng_row, keys_per_row = 128, 5000, 1000
    pairs = np.arange(32, dtype=np.uint64)
    row_words = np.uint64(rng_row + first_row) + 16 * (pairs // 8) + pairs % 8
    byte = [lambda word, b=b: (word >> np.uint64(8 * b)) & np.uint64(0xFF) for b in range(4)]
    for threshold in (1, 2, 77, 255, 256):
        for key_start in range(0, keys_per_row, block_n):
            groups = np.uint64(key_start // 8) + np.arange(block_n // 8, dtype=np.uint64)
            word0, word1, word2, word3 = counter_words(seed, row_words[:, None], groups[None, :])
            words = np.stack([np.stack([word0, word1], -1), np.stack([word2, word3], -1)], -1)
            near = byte[0](words) | (byte[1](words) << np.uint64(16))
            far = byte[2](words) | (byte[3](words) << np.uint64(16))
            pair_halves = np.stack([near, far], -1)
            halves = np.stack([pair_halves, pair_halves], -1)
            halves = halves.reshape(4, 8, block_n // 32, 4, 2, 2, 2, 2).transpose(0, 5, 1, 2, 4, 6, 3, 7)
            halves = halves.reshape(64, block_n)
            own_half = (halves >> (np.uint64(16) * (np.arange(block_n, dtype=np.uint64) % 2))) & np.uint64(0xFFFF)
            keep = own_half.astype(np.uint16).view(np.float16) >= np.uint16(threshold).view(np.float16)
            expected = keep_reference(seed, rng_row, np.arange(first_row, first_row + 64),
                                      np.arange(key_start, key_start + block_n), threshold)
            np.testing.assert_array_equal(keep, expected)
            np.testing.assert_array_equal(own_half >= threshold, expected)  # the half-precision order is the integers'
            # dropped_words: key pair m's word (key 2m in the low half) against the pair's halves
            pair_halves = pair_halves.reshape(4, 8, block_n // 32, 4, 2, 2, 2).transpose(0, 5, 1, 2, 4, 6, 3)
            pair_halves = pair_halves.reshape(64, block_n // 2)
            word_halves = np.stack([pair_halves & np.uint64(0xFFFF), pair_halves >> np.uint64(16)], -1)
            np.testing.assert_array_equal(word_halves.reshape(64, block_n) >= threshold, expected)


@pytest.mark.parametrize("block_m", [64, 128])
def test_gluon_backward_draw_tiles_give_the_same_pattern(block_m):
    """The steps of fmha.backends.gluon_sm90.scores.transposed_keep_bits and unpack_keep in NumPy: a
    consumer's 64 keys as rows, a [32, block_m // 2] tile of counters, one per (key without bits 0
    and 3, query pair), each query row taking its word by the keys' bit 4 and each key its byte by
    a shift to the top of the word, four flags to a nibble, the pairs a thread holds in registers
    folded into one word, and the way back to the [64, block_m] tile of Sᵀ."""
    seed = int(ops.dropout_seed(torch.Generator().manual_seed(14), "cpu").item())
    first_key, rng_row, seqlen_q = 192, 300, 700
    key_rows = np.arange(32, dtype=np.uint64)  # key bits 0-2 and 4-5 of the consumer's 64 keys
    key_groups = np.uint64(first_key // 8) + 4 * (key_rows // 16) + (key_rows % 8) // 2
    near_shifts = (np.uint64(24) - np.uint64(8) * (key_rows & np.uint64(1)))[:, None]
    far_shifts = (np.uint64(8) - np.uint64(8) * (key_rows & np.uint64(1)))[:, None]
    upper = ((key_rows // 8) % 2 == 1)[:, None]
    pairs = np.arange(block_m // 2, dtype=np.uint64)
    for threshold in (1, 2, 77, 255, 256):
        high_bound = np.uint64((threshold * 2 ** 24 - 1) & WORD)  # uint32 arithmetic: 256 wraps to 2^32 - 1
        for first_row in range(0, seqlen_q, block_m):
            row_words = np.uint64(rng_row + first_row) + 16 * (pairs // 8) + pairs % 8
            word0, word1, word2, word3 = counter_words(seed, row_words[None, :], key_groups[:, None])
            first, second = np.where(upper, word1, word0), np.where(upper, word3, word2)
            flags = [((word << shifts) & np.uint64(WORD)) > high_bound
                     for word in (first, second) for shifts in (near_shifts, far_shifts)]
            nibbles = sum(flag.astype(np.uint64) << np.uint64(bit) for bit, flag in enumerate(flags))  # [32, pairs]
            split = nibbles.reshape(32, block_m // 16, 4, 2)
            bits = (split[..., 0] | (split[..., 1] << np.uint64(4))).transpose(0, 2, 1)  # [32, 4, block_m // 16]
            for width in (8, 16, 32)[:(block_m // 16).bit_length() - 1]:
                halves = bits.reshape(32, 4, bits.shape[2] // 2, 2)
                bits = halves[..., 0] | (halves[..., 1] << np.uint64(width))
            assert bits.shape == (32, 4, 1) and bits.max() < 2 ** (block_m // 2)
            for width in (32, 16, 8)[3 - ((block_m // 16).bit_length() - 1):]:  # unpack_keep
                mask = np.uint64((1 << width) - 1)
                bits = np.stack([bits & mask, bits >> np.uint64(width)], -1).reshape(32, 4, bits.shape[2] * 2)
            bits = bits.transpose(0, 2, 1)
            nibbles = np.stack([bits & np.uint64(0xF), bits >> np.uint64(4)], -1).reshape(32, block_m // 2)
            flags = [(nibbles >> np.uint64(w)) & np.uint64(1) != 0 for w in range(4)]
            keep = np.stack([np.stack(flags[0:2], -1), np.stack(flags[2:4], -1)], -1)  # [key, pair, kb3, rb]
            keep = keep.reshape(4, 8, block_m // 16, 8, 2, 2).transpose(0, 4, 1, 2, 5, 3).reshape(64, block_m)
            expected = keep_reference(seed, rng_row, np.arange(first_row, first_row + block_m),
                                      np.arange(first_key, first_key + 64), threshold)
            np.testing.assert_array_equal(keep, expected.T)


def test_dropout_with_wide_key_tiles_matches_float64():
    # The forward in tiles of 64 keys, the backward in tiles of 16: one pattern.
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 20, 150, 16, torch.float32))
    out = fmha.attention(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(8),
                         config=fmha.ForwardConfig(16, 64, 1, 1))
    dropout = dict(dropout_p=kernel_dropout_p(0.3), keep=dropout_pattern(8, (1, 2, 20, 150), 0.3))
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach(), **dropout)
    grads, dout = grads_with_sinks(out, q, k, v, {})
    assert_grads_close(grads, q, k, v, dout, **dropout)


def test_dropout_is_bitwise_reproducible_for_a_generator_state():
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 1, 21, 26, 16, torch.float16))
    generator = torch.Generator()
    runs = []
    for deterministic in (False, True):
        generator.manual_seed(123)
        out = fmha.attention(q, k, v, causal=True, dropout_p=0.4, generator=generator, deterministic=deterministic)
        runs.append((out, *grads_with_sinks(out, q, k, v, {})[0]))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))
    # The call advanced the generator: the next call draws other bits.
    state = generator.get_state()
    again = fmha.attention(q, k, v, causal=True, dropout_p=0.4, generator=generator)
    assert not torch.equal(state, generator.get_state()) and not torch.equal(again, runs[0][0])
    # torch's default generator, as torch's own random ops use it
    torch.manual_seed(5)
    first = fmha.attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(5)
    assert torch.equal(first, fmha.attention(q, k, v, dropout_p=0.4))


def test_dropout_edge_probabilities():
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 20, 24, 16, torch.float32))
    out = fmha.attention(q, k, v, dropout_p=1.0)
    assert (out == 0).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all((grad == 0).all() for grad in grads)
    plain = fmha.attention(q, k, v)
    assert torch.equal(fmha.attention(q, k, v, dropout_p=0.0, generator=torch.Generator()), plain)
    # p is rounded to a multiple of 1/256, but a p between 0 and 1 still drops some scores and
    # keeps others (scaled by 256, not 1/0, at p = 1 - 1e-9).
    tiny = fmha.attention(q, k, v, dropout_p=1e-9, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(tiny, plain) and torch.isfinite(tiny).all()
    almost_all = fmha.attention(q, k, v, dropout_p=1 - 1e-9, generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(almost_all).all() and (almost_all != 0).any()


def test_flash_attn_functions_take_softcap_alibi_and_dropout():
    q, k, v = random_qkv(2, 4, 2, 30, 38, 16, torch.float16, layout="bshd")
    slopes = seeded(4, low=0.1, high=0.5)
    out, lse, probs = fmha.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                           softcap=5.0, alibi_slopes=slopes, return_attn_probs=True)
    assert probs is None
    assert_close_to_reference(out.transpose(1, 2), q, k, v, causal_offset=8, lse=lse, softcap=5.0,
                              alibi_slopes=slopes)
    torch.manual_seed(9)
    dropped = fmha.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.5)
    torch.manual_seed(9)
    assert torch.equal(dropped, fmha.attention(q, k, v, dropout_p=0.5).transpose(1, 2))


def test_decode_shapes_with_features_keep_the_per_tile_forward():
    q, k, v = random_qkv(1, 8, 1, 2, 90, 32, torch.float16)
    assert isinstance(fmha.explain(q, k, v).config, SplitKVConfig)
    assert not isinstance(fmha.explain(q, k, v, softcap=3.0).config, SplitKVConfig)
    slopes = seeded(8, low=0.1, high=0.5)
    out = fmha.attention(q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes)
    assert_close_to_reference(out, q, k, v, causal_offset=88, softcap=3.0, alibi_slopes=slopes)


def test_bfloat16_with_features_on_the_cpu():
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 2, 21, 27, 16, torch.bfloat16))
    sinks = torch.tensor([0.3, -0.4], requires_grad=True)
    out = fmha.attention(q, k, v, causal=True, softcap=2.0, sinks=sinks)
    assert out.dtype == torch.bfloat16
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach(), causal_offset=6, softcap=2.0,
                              sinks=sinks.detach())
    grads, dout = grads_with_sinks(out, q, k, v, {"sinks": sinks})
    assert_grads_close(grads, q, k, v, dout, causal_offset=6, softcap=2.0, sinks=sinks)


def test_torch_compile_fullgraph_with_features():
    def block(q, k, v, sinks, slopes):
        return (fmha.attention(q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes, sinks=sinks,
                               dropout_p=0.2) * 2).sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, 1, 24, 30, 16, torch.float32))
    sinks, slopes = torch.tensor([0.1, 0.7], requires_grad=True), seeded(2)
    torch.manual_seed(0)
    grads = torch.autograd.grad(compiled(q, k, v, sinks, slopes), (q, k, v, sinks))
    torch.manual_seed(0)
    eager = torch.autograd.grad(block(q, k, v, sinks, slopes), (q, k, v, sinks))
    for got, expected in zip(grads, eager):
        torch.testing.assert_close(got, expected)


def test_torch_compile_dynamic_takes_symbolic_floats_and_sizes():
    """With dynamic shapes (``dynamic=True``, or torch.compile's own after a second shape) the
    floats passed in (scale, softcap) and the sizes of sinks and ALiBi slopes are symbolic: the
    argument checks compare them, and the graph stays whole."""
    def attention(q, k, v, sinks, slopes, scale, softcap):
        return fmha.attention(q, k, v, causal=True, scale=scale, softcap=softcap, alibi_slopes=slopes, sinks=sinks)

    def flash(q, k, v, slopes, scale, softcap):
        return fmha.flash_attn_func(q, k, v, softmax_scale=scale, softcap=softcap, alibi_slopes=slopes,
                                    window_size=(4, 0))

    def decode(q, k_cache, v_cache, seqlens, sinks, slopes, scale, softcap):
        return fmha.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, softmax_scale=scale,
                                           softcap=softcap, alibi_slopes=slopes, sinks=sinks, causal=True)

    for seqlen in (5, 9):
        q, k, v = random_qkv(2, 4, 2, seqlen, seqlen + 3, 16, torch.float16)
        sinks, slopes = torch.randn(4), torch.rand(2, 4)
        cases = [(attention, (q, k, v, sinks, slopes)),
                 (flash, tuple(t.transpose(1, 2) for t in (q, k, v)) + (slopes[0],)),
                 (decode, (q.transpose(1, 2)[:, :1], k.transpose(1, 2), v.transpose(1, 2),
                           torch.tensor([seqlen, 2], dtype=torch.int32), sinks, slopes))]
        for fn, args in cases:
            compiled = torch.compile(fn, fullgraph=True, dynamic=True)
            for scale, softcap in ((0.25, 8.0), (0.5, 3.0)):
                torch.testing.assert_close(compiled(*args, scale, softcap), fn(*args, scale, softcap), rtol=0, atol=0)


def test_custom_op_schemas_name_every_argument_once():
    # Inductor builds a Python signature from a schema: a tensor and an option of one name break it.
    for op in (ops.forward_op, ops.backward_op, ops.varlen_forward_op, ops.varlen_backward_op):
        names = [argument.name for argument in op._opoverload._schema.arguments]
        assert len(names) == len(set(names)), names


def test_hopper_backward_reads_masks_with_32_bit_offsets():
    """The Gluon backward adds 32-bit offsets within a (batch, head) of the attn_mask: a mask view
    that spans 2^31 elements there is refused (the portable backward runs it), a smaller one not."""
    assert attn_mask_refusal(None) is None
    small = torch.ones(1, 1, 1, 4096, dtype=torch.bool).expand(2, 4, 4096, 4096)
    assert attn_mask_refusal(small) is None
    huge = torch.empty_strided((1, 1, 65536, 65536), (0, 0, 65536, 1), dtype=torch.bool, device="meta")
    assert "2^31" in attn_mask_refusal(huge)
    transposed = torch.empty_strided((1, 1, 1024, 4096), (0, 0, 1, 1024), dtype=torch.bool, device="meta")
    assert attn_mask_refusal(transposed) is None
    q, k, v = random_qkv(1, 2, 2, 8, 8, 16, torch.float16)
    assert fmha.explain(q, k, v, softcap=2.0).backend == "triton"


# SDPA's attn_mask: torch's own SDPA is the oracle

def sdpa_both(q, k, v, **kwargs):
    """fmha's and torch's (MATH) SDPA outputs and gradients for the same inputs and dout."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fmha.scaled_dot_product_attention(*leaves, **kwargs)
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(*torch_leaves, **kwargs)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return (out, *torch.autograd.grad(out, leaves, dout)), (expected, *torch.autograd.grad(expected, torch_leaves, dout))


def masks(batch, heads, seqlen_q, seqlen_k):
    generator = torch.Generator().manual_seed(2)
    dense = torch.rand(batch, heads, seqlen_q, seqlen_k, generator=generator)
    hidden_rows = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    hidden_rows[[0, 5, seqlen_q - 1]] = False  # rows that see nothing: zeros, as torch
    minus_inf = torch.zeros(seqlen_q, seqlen_k)
    minus_inf[3] = float("-inf")
    minus_inf[:, 7] = float("-inf")
    return {
        "bool": dense > 0.4,
        "float": dense * 4 - 2,
        "bool_2d": dense[0, 0] > 0.5,
        "float_per_batch": (dense[:, :1] - 0.5) * 3,  # (B, 1, L, S): broadcast over heads
        "padding_stride0": (torch.arange(seqlen_k) < seqlen_k - 6).expand(batch, heads, seqlen_q, seqlen_k),
        "float_transposed": dense[0, 0].t().contiguous().t(),  # any strides
        "hidden_rows": hidden_rows,
        "minus_inf": minus_inf,
    }


@pytest.mark.parametrize("name", list(masks(2, 4, 19, 27)))
def test_attn_mask_matches_torch(name):
    q, k, v = random_qkv(2, 4, 2, 19, 27, 16, torch.float32)
    mask = masks(2, 4, 19, 27)[name]
    if name == "padding_stride0":
        assert 0 in mask.stride()
    got, expected = sdpa_both(q, k, v, attn_mask=mask, enable_gqa=True)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=3e-6, rtol=1e-5)


def test_attn_mask_in_half_precision_against_float64():
    q, k, v = random_qkv(2, 2, 2, 29, 35, 24, torch.float16)
    mask = (torch.randn(1, 2, 29, 35, generator=torch.Generator().manual_seed(4)) * 2).half()
    out = fmha.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    assert_close_to_reference(out, q, k, v, scale=0.3, attn_mask=mask)
    bool_mask = mask > 0
    out = fmha.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask)
    assert_close_to_reference(out, q, k, v, attn_mask=bool_mask)


@pytest.mark.parametrize("query_shape, mask_shape", [((3, 11, 16), (11, 13)), ((2, 3, 2, 7, 16), (3, 1, 7, 13)),
                                                     ((2, 3, 2, 7, 16), (2, 1, 1, 7, 13))],
                         ids=lambda shape: "x".join(map(str, shape)))
def test_attn_mask_with_three_and_five_dim_inputs(query_shape, mask_shape):
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(query_shape, generator=generator)
    k, v = (torch.randn(*query_shape[:-2], 13, 16, generator=generator) for _ in range(2))
    mask = torch.randn(mask_shape, generator=generator) > 0
    got, expected = sdpa_both(q, k, v, attn_mask=mask)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=3e-6, rtol=1e-5)


def test_sdpa_dropout_draws_from_the_default_generator():
    q, k, v = random_qkv(1, 2, 2, 20, 20, 16, torch.float32)
    mask = torch.rand(20, 20, generator=torch.Generator().manual_seed(0)) > 0.3
    torch.manual_seed(3)
    out = fmha.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5)
    torch.manual_seed(3)
    keep = dropout_keep_mask(ops.dropout_seed(None, q.device), 2 * 20, 20, 0.5, seqlen_q=20).view(1, 2, 20, 20)
    assert_close_to_reference(out, q, k, v, attn_mask=mask, dropout_p=0.5, keep=keep)
