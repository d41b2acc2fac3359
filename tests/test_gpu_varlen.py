"""Packed variable-length sequences on the GPU (marker ``gpu``): forward and backward per sequence
against float64 (the project's error rule), over random lengths with empty and one-token
sequences, windows, causal, GQA and head dims; deterministic gradients."""

import itertools
import random

import pytest
import torch

import fmha
from fmha.masking import Window

from .helpers import assert_close_to_reference, assert_grads_close

pytestmark = pytest.mark.gpu

WINDOWS = [(None, None), (0, 0), (1, 0), (63, 0), (256, 0), (1024, 0), (100, 100)]
HEADS = [(8, 8), (8, 2)]


def random_lengths(seed: int, count: int, longest: int) -> list[int]:
    lengths = [random.Random(seed + i).randint(0, longest) for i in range(count)]
    return [0, 1, *lengths, 1, 0]


def packed(lengths_q, lengths_k, q_heads, kv_heads, head_dim, seed, grad=False):
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def make(total, heads):
        tensor = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        return tensor.requires_grad_(grad)

    cu = [torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
          for lengths in (lengths_q, lengths_k)]
    return make(sum(lengths_q), q_heads), make(sum(lengths_k), kv_heads), make(sum(lengths_k), kv_heads), *cu


def spans(lengths_q, lengths_k):
    starts_q, starts_k = [0, *itertools.accumulate(lengths_q)], [0, *itertools.accumulate(lengths_k)]
    for b in range(len(lengths_q)):
        yield slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])


def as_bhsd(tensor):
    return tensor.unsqueeze(0).transpose(1, 2)


def visible_window(seqlen_q, seqlen_k, left, right, causal):
    if causal:
        right = 0 if right is None else min(right, 0)
    return Window.of(seqlen_q, seqlen_k, left=left, right=right)


def check_packed_grads(grads, q, k, v, dout, lengths_q, lengths_k, window, causal):
    """Each sequence's gradients against float64; sequences with no rows or no keys get zeros."""
    dq, dk, dv = grads
    for rows, keys in spans(lengths_q, lengths_k):
        seqlen_q, seqlen_k = rows.stop - rows.start, keys.stop - keys.start
        if seqlen_q == 0 or seqlen_k == 0:
            for grad, span in ((dq, rows), (dk, keys), (dv, keys)):
                assert torch.equal(grad[span], torch.zeros_like(grad[span]))
            continue
        inputs = [as_bhsd(t.detach()) for t in (q[rows], k[keys], v[keys])]
        assert_grads_close((as_bhsd(dq[rows]), as_bhsd(dk[keys]), as_bhsd(dv[keys])), *inputs,
                           as_bhsd(dout[rows]), window=visible_window(seqlen_q, seqlen_k, *window, causal))


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda heads: f"h{heads[0]}-kv{heads[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda window: f"left{window[0]}-right{window[1]}")
def test_varlen_forward_gpu(window, head_dim, heads, causal, cross):
    seed = hash((window, head_dim, heads, causal, cross)) % 2**31
    lengths_q = random_lengths(seed, 6, 1500)
    lengths_k = random_lengths(seed + 99, 6, 1500) if cross else lengths_q
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, *heads, head_dim, seed)
    out, lse = fmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                           window_size=tuple(-1 if side is None else side for side in window),
                                           return_attn_probs=True)[:2]
    for rows, keys in spans(lengths_q, lengths_k):
        seqlen_q, seqlen_k = rows.stop - rows.start, keys.stop - keys.start
        if seqlen_q == 0:
            continue
        if seqlen_k == 0:
            assert torch.equal(out[rows], torch.zeros_like(out[rows]))
            assert torch.all(lse[:, rows] == float("-inf"))
            continue
        assert_close_to_reference(as_bhsd(out[rows]), as_bhsd(q[rows]), as_bhsd(k[keys]), as_bhsd(v[keys]),
                                  window=visible_window(seqlen_q, seqlen_k, *window, causal),
                                  lse=lse[:, rows].unsqueeze(0), atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda heads: f"h{heads[0]}-kv{heads[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", WINDOWS[::2], ids=lambda window: f"left{window[0]}-right{window[1]}")
def test_varlen_backward_gpu(window, head_dim, heads, causal):
    seed = hash((window, head_dim, heads, causal, "backward")) % 2**31
    lengths_q = random_lengths(seed, 4, 1200)
    lengths_k = random_lengths(seed + 7, 4, 1200)
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, *heads, head_dim, seed, grad=True)
    out = fmha.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal, window=window)
    dout = torch.randn_like(out)
    check_packed_grads(torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, lengths_q, lengths_k, window,
                       causal)


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_varlen_backward_runs_the_gluon_kernel_on_hopper_gpu(head_dim):
    """Packed sequences take the Gluon backward on sm_90: one long and many short sequences, some of
    length 0 and 1, GQA, causal, against float64 per sequence."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are built for sm_90")
    lengths_q = [1500, 0, 1, 77, 300, 64, 129, 5]
    lengths_k = [1500, 3, 1, 200, 300, 64, 0, 130]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 8, 2, head_dim, 17, grad=True)
    params = fmha.params.varlen_params("test", q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    hopper, reason = fmha.dispatch.hopper_backward(params, q, q, k, v, q, k, v)
    assert hopper is not None, reason
    out = fmha.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    dout = torch.randn_like(out)
    check_packed_grads(torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, lengths_q, lengths_k,
                       (None, None), True)


def test_one_long_and_many_short_sequences_gpu():
    lengths = [8192] + [random.Random(i).randint(1, 300) for i in range(63)]
    q, k, v, cu_q, cu_k = packed(lengths, lengths, 16, 4, 128, 3)
    out = fmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8192, 8192, causal=True)
    for index, (rows, keys) in enumerate(spans(lengths, lengths)):
        if index % 9 == 0:
            assert_close_to_reference(as_bhsd(out[rows]), as_bhsd(q[rows]), as_bhsd(k[keys]), as_bhsd(v[keys]),
                                      window=Window.causal(0), atol=1e-5)


def test_varlen_gradients_are_deterministic_gpu():
    """deterministic=True: the portable backward (the Gluon one adds dQ with atomics, as for dense calls)."""
    lengths = random_lengths(11, 8, 2000)
    q, k, v, cu_q, cu_k = packed(lengths, lengths, 8, 2, 128, 5, grad=True)
    dout = torch.randn_like(q)

    def grads():
        out = fmha.varlen_attention(q, k, v, cu_q, cu_k, max(lengths), max(lengths), causal=True, deterministic=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    first = grads()
    for _ in range(9):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))


def test_varlen_matches_torch_varlen_attn_gpu():
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    lengths = random_lengths(21, 6, 1000)
    q, k, v, cu_q, cu_k = packed(lengths, lengths, 8, 8, 128, 9)
    ours = fmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths), max(lengths), causal=True)
    try:  # torch >= 2.12 spells causal as a window
        theirs = varlen.varlen_attn(q, k, v, cu_q, cu_k, max(lengths), max(lengths), window_size=(-1, 0))
    except TypeError:
        theirs = varlen.varlen_attn(q, k, v, cu_q, cu_k, max(lengths), max(lengths), is_causal=True)
    assert (ours.float() - theirs.float()).abs().max().item() < 2e-2
