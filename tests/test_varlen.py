"""Packed variable-length sequences (varlen, THD layout) on the CPU through the interpreter:
forward and gradients per sequence against float64, FlashAttention's varlen functions, the tile
list, torch.compile and the argument checks."""

import itertools

import pytest
import torch
import triton
import triton.language as tl

import fmha
from fmha import ops
from fmha.backends.triton.launch import TileList
from fmha.backends.triton.varlen import TAIL_HEADS, head_and_entry
from fmha.masking import Window
from fmha.params import AttentionOptions

from .helpers import assert_close_to_reference, assert_grads_close

pytestmark = pytest.mark.interpreter


def cu_seqlens(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def packed_inputs(lengths_q, lengths_k, q_heads, kv_heads, head_dim, dtype, requires_grad=False):
    q = torch.randn(sum(lengths_q), q_heads, head_dim, dtype=dtype)
    k = torch.randn(sum(lengths_k), kv_heads, head_dim, dtype=dtype)
    v = torch.randn(sum(lengths_k), kv_heads, head_dim, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)] + [cu_seqlens(lengths_q), cu_seqlens(lengths_k)]


def sequences(cu_q, cu_k):
    """Row slices of each sequence in q and in k."""
    for b in range(len(cu_q) - 1):
        yield slice(cu_q[b].item(), cu_q[b + 1].item()), slice(cu_k[b].item(), cu_k[b + 1].item())


def as_bhsd(tensor):
    return tensor.unsqueeze(0).transpose(1, 2)


def window_of(seqlen_q, seqlen_k, left, right, causal):
    if causal:
        right = 0 if right is None else min(right, 0)
    return Window.of(seqlen_q, seqlen_k, left=left, right=right)


# Lengths with empty and one-token sequences, Sq_i != Sk_i, and sequences longer than one tile.
LENGTHS = [
    ([37, 0, 1, 20, 53], [37, 0, 1, 20, 53]),
    ([5, 0, 1, 37, 20], [7, 3, 0, 37, 41]),
    ([1, 1, 1], [30, 1, 17]),
]
MASKS = [(None, None, False), (None, None, True), (6, None, True), (3, 2, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("left, right, causal", MASKS, ids=lambda m: str(m))
@pytest.mark.parametrize("lengths", LENGTHS, ids=["self", "cross", "decode-like"])
def test_forward_matches_float64_per_sequence(lengths, left, right, causal, dtype):
    q, k, v, cu_q, cu_k = packed_inputs(*lengths, 4, 2, 24, dtype)
    out, lse = fmha.varlen_attention(q, k, v, cu_q, cu_k, max(lengths[0]), max(lengths[1]), causal=causal,
                                     window=(left, right), return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    for rows, keys in sequences(cu_q, cu_k):
        seqlen_q, seqlen_k = rows.stop - rows.start, keys.stop - keys.start
        if seqlen_q == 0:
            continue
        if seqlen_k == 0:  # nothing to see: zeros and LSE -inf
            assert torch.equal(out[rows], torch.zeros_like(out[rows]))
            assert torch.all(lse[:, rows] == float("-inf"))
            continue
        assert_close_to_reference(as_bhsd(out[rows]), as_bhsd(q[rows]), as_bhsd(k[keys]), as_bhsd(v[keys]),
                                  window=window_of(seqlen_q, seqlen_k, left, right, causal),
                                  lse=lse[:, rows].unsqueeze(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("left, right, causal", MASKS[1:], ids=lambda m: str(m))
@pytest.mark.parametrize("lengths", LENGTHS[:2], ids=["self", "cross"])
def test_gradients_match_float64_per_sequence(lengths, left, right, causal, dtype):
    q, k, v, cu_q, cu_k = packed_inputs(*lengths, 4, 2, 16, dtype, requires_grad=True)
    out = fmha.varlen_attention(q, k, v, cu_q, cu_k, max(lengths[0]), max(lengths[1]), causal=causal,
                                window=(left, right))
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for rows, keys in sequences(cu_q, cu_k):
        seqlen_q, seqlen_k = rows.stop - rows.start, keys.stop - keys.start
        if seqlen_q == 0 or seqlen_k == 0:  # no pairs: every gradient is zero
            for grad, span in ((dq, rows), (dk, keys), (dv, keys)):
                assert torch.equal(grad[span], torch.zeros_like(grad[span]))
            continue
        grads = (as_bhsd(dq[rows]), as_bhsd(dk[keys]), as_bhsd(dv[keys]))
        inputs = [as_bhsd(t.detach()) for t in (q[rows], k[keys], v[keys])]
        assert_grads_close(grads, *inputs, as_bhsd(dout[rows]),
                           window=window_of(seqlen_q, seqlen_k, left, right, causal))


def test_equal_lengths_match_the_dense_call():
    q, k, v, cu_q, cu_k = packed_inputs([24, 24, 24], [24, 24, 24], 2, 2, 16, torch.float32)
    packed = fmha.varlen_attention(q, k, v, cu_q, cu_k, 24, 24, causal=True)
    dense = fmha.attention(*(t.view(3, 24, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)), causal=True)
    torch.testing.assert_close(packed, dense.transpose(1, 2).reshape(q.shape), rtol=0, atol=1e-6)


@pytest.mark.parametrize("lengths", [[37, 0, 1, 20, 53], [5, 0, 1, 37, 20]], ids=["self", "causal-rows"])
def test_heads_before_and_in_the_tail_match_float64(lengths):
    # 6 query heads: two walked alone, four together; 3 KV heads: all together (backward).
    q, k, v, cu_q, cu_k = packed_inputs(lengths, lengths, 6, 3, 16, torch.float32, requires_grad=True)
    out = fmha.varlen_attention(q, k, v, cu_q, cu_k, max(lengths), max(lengths), causal=True)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for rows, keys in sequences(cu_q, cu_k):
        if rows.stop == rows.start:
            continue
        window = window_of(rows.stop - rows.start, keys.stop - keys.start, None, None, True)
        inputs = [as_bhsd(t.detach()) for t in (q[rows], k[keys], v[keys])]
        assert_close_to_reference(as_bhsd(out[rows].detach()), *inputs, window=window)
        assert_grads_close((as_bhsd(dq[rows]), as_bhsd(dk[keys]), as_bhsd(dv[keys])), *inputs,
                           as_bhsd(dout[rows]), window=window)


@triton.jit
def _head_and_entry_kernel(Heads, Entries, entries, num_heads):
    head, entry = head_and_entry(tl.program_id(0), entries, num_heads)
    tl.store(Heads + tl.program_id(0), head)
    tl.store(Entries + tl.program_id(0), entry)


@pytest.mark.parametrize("num_heads", [1, 3, 4, 6, 9])
@pytest.mark.parametrize("entries", [1, 5])
def test_tiles_cover_every_head_and_entry_once_the_last_heads_together(num_heads, entries):
    heads = torch.full((entries * num_heads,), -1, dtype=torch.int32)
    listed = torch.full_like(heads, -1)
    _head_and_entry_kernel[(entries * num_heads,)](heads, listed, entries, num_heads)
    pairs = list(zip(heads.tolist(), listed.tolist()))
    tail = min(num_heads, TAIL_HEADS.value)
    alone = [(h, e) for h in range(num_heads - tail) for e in range(entries)]
    together = [(h, e) for e in range(entries) for h in range(num_heads - tail, num_heads)]
    assert pairs == alone + together


def test_bfloat16_computes_in_float32_under_the_interpreter():
    q, k, v, cu_q, cu_k = packed_inputs([9, 30], [12, 30], 2, 1, 16, torch.bfloat16)
    out = fmha.varlen_attention(q, k, v, cu_q, cu_k, 30, 30, causal=True)
    assert out.dtype == torch.bfloat16
    for rows, keys in sequences(cu_q, cu_k):
        assert_close_to_reference(as_bhsd(out[rows]), as_bhsd(q[rows]), as_bhsd(k[keys]), as_bhsd(v[keys]),
                                  window=Window.causal(keys.stop - keys.start - (rows.stop - rows.start)))


def test_flash_attn_varlen_functions_agree():
    lengths = [13, 0, 1, 29]
    qkv = torch.randn(sum(lengths), 3, 4, 16)
    cu = cu_seqlens(lengths)
    q, k, v = qkv.unbind(1)
    out, lse, probs = fmha.flash_attn_varlen_func(q, k, v, cu, cu, 29, 29, causal=True, window_size=(5, -1),
                                                  return_attn_probs=True)
    assert probs is None and lse.shape == (4, sum(lengths))
    expected = fmha.varlen_attention(q, k, v, cu, cu, 29, 29, causal=True, window=(5, None))
    assert torch.equal(out, expected)
    assert torch.equal(fmha.flash_attn_varlen_qkvpacked_func(qkv, cu, 29, causal=True, window_size=(5, -1)), expected)
    kv = qkv[:, 1:]
    assert torch.equal(fmha.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 29, 29, causal=True, window_size=(5, 0)),
                       expected)


def test_torch_compile_fullgraph_forward_and_backward():
    lengths_q, lengths_k = [7, 0, 19], [9, 4, 19]

    def block(q, k, v, cu_q, cu_k):
        return (fmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, 19, causal=True) * 2).sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    q, k, v, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, 2, 1, 16, torch.float32, requires_grad=True)
    grads = torch.autograd.grad(compiled(q, k, v, cu_q, cu_k), (q, k, v))
    eager = torch.autograd.grad(block(q, k, v, cu_q, cu_k), (q, k, v))
    for got, expected in zip(grads, eager):
        torch.testing.assert_close(got, expected)


def expected_tile_list(lengths, block, from_end):
    """Deepest first; within a depth, sequences in order."""
    blocks = [-(-length // block) for length in lengths]
    tiles = []
    for depth in reversed(range(max(blocks, default=0))):
        tiles += [(seq, count - 1 - depth if from_end else depth) for seq, count in enumerate(blocks) if count > depth]
    return tiles


@pytest.mark.parametrize("from_end", [False, True], ids=["from-start", "from-end"])
@pytest.mark.parametrize("lengths, block", [
    ([50, 0, 16, 17, 1, 33], 16),
    ([300, 7, 0, 129], 8),  # more depths than one pass lists
    (torch.randint(0, 40, (1030,), generator=torch.Generator().manual_seed(3)).tolist(), 16),  # past 1,024 sequences
], ids=["six", "deep", "many"])
def test_tile_list_holds_every_tile_once_deepest_first(lengths, block, from_end, monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(-7))  # unwritten entries show
    cu = cu_seqlens(lengths)
    tile_list = TileList(len(lengths), sum(lengths), block, from_end, device=cu.device)
    flat = tile_list(cu)
    assert flat.shape == (2 * tile_list.entries + 1,)
    assert tile_list.counter(flat).tolist() == [0]  # the zeroed tile counter after the list
    tiles = [tuple(pair) for pair in flat[:-1].view(-1, 2).tolist()]
    expected = expected_tile_list(lengths, block, from_end)
    assert tiles[:len(expected)] == expected
    assert all(pair == (-1, 0) for pair in tiles[len(expected):])


def test_lengths_past_the_tensor_are_clamped_not_read():
    # The device cannot check cu_seqlens without a synchronisation: the kernels clamp each
    # sequence into the tensor, so an overlong last entry reads nothing outside it.
    q, k, v, _, _ = packed_inputs([10], [10], 2, 2, 16, torch.float32)
    overlong = torch.tensor([0, 1000], dtype=torch.int32)
    options = AttentionOptions(scale=0.25, window_right=0, layout="varlen")
    out, lse = ops.run_varlen_forward(q, k, v, overlong, overlong, 1000, 1000, options)
    expected = fmha.attention(as_bhsd(q), as_bhsd(k), as_bhsd(v), causal=True, scale=0.25)
    torch.testing.assert_close(out, expected[0].transpose(0, 1), rtol=0, atol=1e-6)


def test_empty_batch_and_empty_tokens():
    q, k, v, cu_q, cu_k = packed_inputs([0, 0], [0, 3], 2, 2, 16, torch.float32)
    out, lse = fmha.varlen_attention(q, k, v, cu_q, cu_k, 0, 3, return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)


@pytest.mark.parametrize("change, error, pattern", [
    (dict(cu_seqlens_q=torch.tensor([0, 4, 8], dtype=torch.int64)), TypeError, "cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 4], dtype=torch.int32)), ValueError, "cu_seqlens_k must start at 0, never decrease"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 7], dtype=torch.int32)), ValueError, r"end at 8 \(the tokens in q\)"),
    (dict(cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32)), ValueError, "same number of sequences"),
    (dict(cu_seqlens_q=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "cu_seqlens_q must be 1-D"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be a non-negative int"),
    (dict(max_seqlen_k=4.0), ValueError, "max_seqlen_k must be a non-negative int"),
    (dict(q=torch.randn(1, 8, 2, 16)), ValueError, r"q must be 3-D \(total_tokens, heads, head_dim\)"),
    (dict(k=torch.randn(8, 3, 16), v=torch.randn(8, 3, 16)), ValueError, "multiple of the number of key/value heads"),
    (dict(window_size=(-2, 0)), ValueError, "window_size's left side"),
    (dict(softcap=-30.0), ValueError, "softcap must be finite and > 0"),
    (dict(alibi_slopes=torch.ones(3, 2)), ValueError, r"alibi_slopes must have shape \(2,\) or \(2, 2\)"),
    (dict(cu_seqlens_k=torch.tensor([0, 0, 4, 0, 8, 0], dtype=torch.int32)[::2]), ValueError,
     "cu_seqlens_k must be contiguous"),
])
def test_bad_arguments_are_named(change, error, pattern):
    arguments = dict(q=torch.randn(8, 2, 16), k=torch.randn(8, 2, 16), v=torch.randn(8, 2, 16),
                     cu_seqlens_q=cu_seqlens([4, 4]), cu_seqlens_k=cu_seqlens([4, 4]), max_seqlen_q=4, max_seqlen_k=4)
    arguments.update(change)
    with pytest.raises(error, match=pattern):
        fmha.flash_attn_varlen_func(**arguments)
