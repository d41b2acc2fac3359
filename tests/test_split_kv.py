"""The split-KV forward (decode: few query rows, many keys) on the CPU through the interpreter."""

import pytest
import torch

import fmha
from fmha import dispatch
from fmha.backends.triton.config import SplitKVConfig, split_kv_config
from fmha.backends.triton.launch import SplitKVForward
from fmha.masking import Window
from fmha.params import AttentionOptions, AttentionParams

from .helpers import assert_close_to_reference, assert_grads_close, random_qkv

pytestmark = pytest.mark.interpreter


def run_split_kv(q, k, v, config, *, left=None, right=None, top_left=False):
    options = AttentionOptions(scale=q.shape[-1] ** -0.5, window_left=left, window_right=right, top_left=top_left)
    params = AttentionParams.of(q, k, v, options)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"))
    SplitKVForward(params, config)(q, k, v, out, lse)
    return out, lse, params.window


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [
    (2, 8, 2, 1, 77, 32),    # decode, GQA 4: eight packed rows per KV head
    (1, 4, 4, 3, 50, 24),    # MHA, three query rows, D not a power of two
    (1, 6, 1, 2, 33, 16),    # MQA, twelve packed rows
], ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("window", [(None, None), (None, 0), (7, 0), (5, 3)], ids=["full", "causal", "left7", "left5right3"])
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_matches_float64_reference(dtype, shape, window, splits):
    batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim = shape
    q, k, v = random_qkv(*shape, dtype)
    packed = q_heads // kv_heads * seqlen_q
    config = SplitKVConfig(max(16, 1 << (packed - 1).bit_length()), 16, 1, splits)
    out, lse, visible = run_split_kv(q, k, v, config, left=window[0], right=window[1])
    assert_close_to_reference(out, q, k, v, window=visible, lse=lse)


@pytest.mark.parametrize("window", [(None, None), (None, 0)], ids=["full", "causal"])
def test_one_chunk_of_long_key_blocks(window):
    """The plan of half-full grids: one chunk of 256-key blocks, written without the combine kernel;
    the keys end inside a block."""
    q, k, v = random_qkv(2, 8, 2, 1, 600, 32, torch.float32)
    out, lse, visible = run_split_kv(q, k, v, SplitKVConfig(16, 256, 1, 1, num_stages=3), left=window[0],
                                     right=window[1])
    assert_close_to_reference(out, q, k, v, window=visible, lse=lse)


def test_rows_that_see_no_key_and_chunks_outside_the_window():
    """Sq > Sk bottom-right causal with a left bound: the first rows see nothing, several packed
    tiles, and chunks that hold no key a tile sees."""
    q, k, v = random_qkv(1, 2, 1, 45, 40, 16, torch.float32)
    out, lse, visible = run_split_kv(q, k, v, SplitKVConfig(32, 16, 1, 3), left=3, right=0)
    assert torch.isneginf(lse).any() and torch.isfinite(lse).any()
    assert_close_to_reference(out, q, k, v, window=visible, lse=lse)


def test_decode_calls_take_it_and_explain_says_so():
    q, k, v = random_qkv(1, 8, 1, 1, 100, 32, torch.float16)
    dispatch.forget()
    explanation = fmha.explain(q, k, v, causal=True)
    assert isinstance(explanation.config, SplitKVConfig) and "split-KV" in str(explanation)
    out, lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal_offset=99, lse=lse)


def test_gradients_of_a_split_kv_forward():
    """The backward recomputes from the combined LSE, so it must be the exact one."""
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 4, 1, 2, 70, 16, torch.float32))
    dispatch.forget()
    assert isinstance(fmha.explain(q, k, v, causal=True).config, SplitKVConfig)
    out = fmha.attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    assert_grads_close(torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, causal_offset=68)


def test_the_plan_only_takes_underfilled_decode_grids():
    def params(batch, q_heads, kv_heads, seqlen_q, seqlen_k):
        q = torch.empty(batch, q_heads, seqlen_q, 128).expand(batch, q_heads, seqlen_q, 128)
        k = torch.empty(batch, kv_heads, seqlen_k, 128)
        return AttentionParams.of(q, k, k, AttentionOptions(scale=1.0))

    decode = split_kv_config(params(1, 32, 8, 1, 4096), 132)
    assert decode is not None and decode.block_m == 16 and decode.splits == 16  # a program per multiprocessor
    assert decode.num_stages == 3  # a small grid reads three key blocks deep
    half = split_kv_config(params(8, 32, 8, 1, 2048), 132)  # 64 KV heads: one chunk each, longer blocks
    assert half.splits == 1 and half.block_n == 128
    assert split_kv_config(params(2, 32, 8, 1, 4096), 132).splits == 8  # 16 KV heads: eight chunks each
    assert split_kv_config(params(6, 32, 8, 1, 4096), 132).splits == 2  # 48 KV heads: too few to stream alone
    full = split_kv_config(params(64, 32, 8, 1, 2048), 132)  # the GPU is full: packing only
    assert full.splits == 1 and full.num_stages == 2
    assert split_kv_config(params(1, 32, 8, 1, 1024), 132).splits == 4  # chunks of at least four key blocks
    assert split_kv_config(params(64, 32, 32, 1, 2048), 132) is None  # and MHA gains nothing
    assert split_kv_config(params(1, 32, 8, 1024, 1024), 132) is None  # prefill
    assert split_kv_config(params(1, 32, 32, 1, 64), 132) is None  # too few keys to split, MHA
