"""Steps 2 and 3 on the CPU: the naive and fused kernels under Triton's interpreter.

fp16 and fp32 throughout; bf16 once: under the interpreter, bf16 tl.dot multiplies raw bits, so
bf16 calls compute in fp32 there and store bf16.
"""

import math

import pytest
import torch

import fmha
from fmha import ForwardConfig
from fmha.backends.triton.config import KernelFeatures
from fmha.backends.triton.launch import launch_forward, tma_compatible
from fmha.params import attention_params

from .helpers import assert_close_to_reference, random_qkv

pytestmark = pytest.mark.interpreter

DTYPES = [torch.float16, torch.float32]
# (batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim)
SHAPES = [
    (1, 1, 1, 1, 1, 16),
    (2, 2, 2, 17, 17, 32),
    (1, 4, 1, 33, 70, 40),    # MQA, Sk > Sq, non-power-of-two D
    (1, 4, 2, 70, 33, 24),    # GQA, Sq > Sk: bottom-right causal leaves rows with no key
    (1, 2, 2, 48, 48, 80),
    (1, 1, 1, 5, 129, 96),
]
IMPLEMENTATIONS = {"fused": fmha.attention, "naive": fmha.naive_attention}


def _offset(causal, seqlen_q, seqlen_k):
    return seqlen_k - seqlen_q if causal else None


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(implementation, causal, shape, dtype):
    batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim = shape
    q, k, v = random_qkv(*shape, dtype)
    out, lse = IMPLEMENTATIONS[implementation](q, k, v, causal=causal, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal_offset=_offset(causal, seqlen_q, seqlen_k), lse=lse)


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_on_the_cpu_is_right(implementation, causal):
    q, k, v = random_qkv(1, 4, 2, 37, 45, 40, torch.bfloat16)
    out, lse = IMPLEMENTATIONS[implementation](q, k, v, causal=causal, return_lse=True)
    assert out.dtype == torch.bfloat16
    assert_close_to_reference(out, q, k, v, causal_offset=_offset(causal, 37, 45), lse=lse)


@pytest.mark.parametrize("config", [ForwardConfig(16, 32, 1, 1), ForwardConfig(32, 16, 1, 1),
                                    ForwardConfig(64, 16, 1, 2)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_tile_shapes(config, causal):
    """Causal diagonal and tails when BLOCK_M != BLOCK_N, through an explicit config."""
    q, k, v = random_qkv(1, 2, 1, 75, 90, 32, torch.float16)
    out, lse = fmha.attention(q, k, v, causal=causal, return_lse=True, config=config)
    assert_close_to_reference(out, q, k, v, causal_offset=_offset(causal, 75, 90), lse=lse)


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_bshd_strides(implementation):
    q, k, v = random_qkv(2, 4, 2, 19, 23, 32, torch.float16, layout="bshd")
    assert not q.is_contiguous()
    out = IMPLEMENTATIONS[implementation](q, k, v, causal=True)
    assert_close_to_reference(out, q, k, v, causal_offset=4)
    if implementation == "fused":
        assert out.stride() == q.stride()  # the output keeps the caller's BSHD layout


def test_expanded_inputs_with_zero_strides():
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 9, 16, generator=generator).expand(3, 2, 9, 16)
    k = torch.randn(1, 1, 20, 16, generator=generator).expand(3, 2, 20, 16)
    v = torch.randn(3, 2, 20, 16, generator=generator)
    assert q.stride()[:2] == (0, 0)
    out = fmha.attention(q, k, v)
    assert_close_to_reference(out, q, k, v)


def test_sliced_head_dim_view():
    """A non-contiguous last dim (every other element) is read through its stride."""
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 12, 64, generator=generator)[..., ::2] for _ in range(3))
    out = fmha.attention(q, k, v, causal=True)
    assert_close_to_reference(out, q, k, v, causal_offset=0)


@pytest.mark.parametrize("scale", [0.1, 1.0, -0.3])
def test_scale(scale):
    q, k, v = random_qkv(1, 2, 2, 20, 31, 16, torch.float32)
    out = fmha.attention(q, k, v, scale=scale)
    assert_close_to_reference(out, q, k, v, scale=scale)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = random_qkv(1, 1, 1, 8, 8, 24, torch.float32)
    torch.testing.assert_close(fmha.attention(q, k, v), fmha.attention(q, k, v, scale=1 / math.sqrt(24)))


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_rows_that_see_no_key_give_zero_and_minus_inf(implementation):
    q, k, v = random_qkv(1, 2, 2, 40, 8, 16, torch.float16)
    out, lse = IMPLEMENTATIONS[implementation](q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :, :32] == 0) and torch.all(torch.isneginf(lse[:, :, :32]))
    assert torch.isfinite(lse[:, :, 32:]).all()
    assert_close_to_reference(out, q, k, v, causal_offset=-32, lse=lse)


def test_large_logits_stay_finite():
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, 30, 16, generator=generator) * 100
    k = torch.randn(1, 1, 45, 16, generator=generator) * 100
    v = torch.randn(1, 1, 45, 16, generator=generator)
    out, lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close_to_reference(out, q, k, v, causal_offset=15, lse=lse)


@pytest.mark.parametrize("shape", [(0, 2, 2, 5, 5, 16), (2, 0, 0, 5, 5, 16), (1, 2, 2, 0, 5, 16),
                                   (1, 2, 1, 5, 0, 16)], ids=str)
@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_empty_inputs(shape, implementation):
    q, k, v = random_qkv(*shape, torch.float16)
    out, lse = IMPLEMENTATIONS[implementation](q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    if shape[4] == 0:  # no keys: zeros and -inf, not NaN
        assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_output_dtype_and_lse_dtype():
    q, k, v = random_qkv(1, 1, 1, 4, 4, 16, torch.float16)
    out, lse = fmha.attention(q, k, v, return_lse=True)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32


FEATURES = [KernelFeatures(fused_scale=False), KernelFeatures(), KernelFeatures(tma=True),
            KernelFeatures(pipeline_qk=True), KernelFeatures(tma=True, pipeline_qk=True),
            KernelFeatures(persistent=True), KernelFeatures(tma=True, warp_specialize=True)]


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(k for k, v in f.__dict__.items() if v) or "none")
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_features(features, causal):
    """Every compile-time switch of the forward computes the same function, tails and GQA included."""
    q, k, v = random_qkv(2, 4, 2, 37, 53, 40, torch.float16)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"))
    offset = _offset(causal, 37, 53)
    params = attention_params("test", q, k, v, causal=causal)
    launch_forward(q, k, v, out, lse, params, ForwardConfig(32, 16, 1, 1), features)
    assert_close_to_reference(out, q, k, v, causal_offset=offset, lse=lse)


def test_negative_scale_keeps_the_unfolded_path():
    q, k, v = random_qkv(1, 2, 2, 20, 24, 32, torch.float16)
    out, lse = fmha.attention(q, k, v, scale=-0.2, return_lse=True)
    assert_close_to_reference(out, q, k, v, scale=-0.2, lse=lse)


def test_tma_needs_aligned_rows():
    aligned = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    assert tma_compatible(aligned)
    assert not tma_compatible(torch.randn(1, 2, 8, 17, dtype=torch.float16))  # 34-byte rows
    assert not tma_compatible(aligned.transpose(2, 3))  # D not contiguous
    assert not tma_compatible(aligned.expand(1, 2, 8, 64).as_strided((1, 2, 8, 64), (0, 0, 64, 1)))
    # packed (total, H, D), as the varlen kernels describe it: (1, H, total, D)
    packed = torch.randn(10, 2, 64, dtype=torch.float16)
    assert tma_compatible(packed) and tma_compatible(packed.unsqueeze(0).transpose(1, 2))
    assert not tma_compatible(torch.randn(10, 2, 68, dtype=torch.float16)[..., :64])  # heads 136 bytes apart


def test_a_repeated_call_signature_reuses_its_prepared_forward():
    """The hot path: validation and dispatch run once per signature (shapes, strides, options)."""
    from fmha import dispatch

    dispatch.forget()
    q, k, v = random_qkv(1, 2, 2, 20, 24, 16, torch.float16)
    first = fmha.attention(q, k, v, causal=True)
    second = fmha.attention(q, k, v, causal=True)
    assert len(dispatch.signatures) == 1 and len(dispatch._prepared) == 1
    assert torch.equal(first, second)
    q2, k2, v2 = random_qkv(1, 2, 2, 20, 24, 16, torch.float16, layout="bshd")  # other strides: prepared anew
    assert_close_to_reference(fmha.attention(q2, k2, v2, causal=True), q2, k2, v2, causal_offset=4)
    assert len(dispatch._prepared) == 2
    with pytest.raises(TypeError, match="causal must be a bool"):
        fmha.attention(q, k, v, causal=1)  # same hash as True: still checked


@pytest.mark.parametrize("kind", ["bhsd", "bshd", "packed"])
def test_keys_expanded_over_heads_reach_the_hopper_forward_as_one_kv_head(monkeypatch, kind):
    """The bulk copy engine takes no zero stride, so k and v expanded over their heads reach the
    Hopper forward as one KV head (MQA). Here a stand-in for that backend, which refuses what TMA
    cannot describe and runs the portable kernel, checks what it is given and the result."""
    from fmha import dispatch
    from fmha.backends.gluon_sm90.backend import HopperBackend
    from fmha.backends.triton.backend import TritonBackend
    from fmha.backends.triton.config import INTERPRETER_FORWARD_CONFIG

    given = []

    def refusal(self, params, q, k, v):
        return None if all(map(tma_compatible, (q, k, v))) else "strides TMA cannot describe"

    def prepare_forward(self, params, config, first_kv_head=False):
        portable = TritonBackend().prepare_forward(params, INTERPRETER_FORWARD_CONFIG)

        def run(q, k, v, *rest, **scores):
            given.append((params.kv_heads, first_kv_head, k.shape[1], v.shape[1]))
            portable(q, k[:, :1], v[:, :1], *rest, **scores)  # as the descriptors of the first head read them
        return run

    monkeypatch.setattr(HopperBackend, "refusal", refusal)
    monkeypatch.setattr(HopperBackend, "forward_config", lambda self, params: ("stand-in", "test"))
    monkeypatch.setattr(HopperBackend, "prepare_forward", prepare_forward)
    dispatch.forget()
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 19, 16, generator=generator, dtype=torch.float16)
    k1, v1 = (torch.randn(2, 1, 23, 16, generator=generator, dtype=torch.float16) for _ in range(2))
    k, v = k1.expand(2, 4, 23, 16), v1.expand(2, 4, 23, 16)
    if kind == "bshd":
        q, k1, v1 = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k1, v1))
        k, v = k1.expand(2, 4, 23, 16), v1.expand(2, 4, 23, 16)
    try:
        if kind == "packed":
            cu_seqlens_q, cu_seqlens_k = (torch.tensor([0, n, 2 * n], dtype=torch.int32) for n in (19, 23))
            packed = [x.transpose(1, 2).reshape(-1, x.shape[1], 16) for x in (q, k1, v1)]
            q_p, k_p, v_p = packed[0], packed[1].expand(-1, 4, -1), packed[2].expand(-1, 4, -1)
            out = fmha.varlen_attention(q_p, k_p, v_p, cu_seqlens_q, cu_seqlens_k, 19, 23, causal=True)
            out = out.reshape(2, 19, 4, 16).transpose(1, 2)
        else:
            assert k.stride(1) == 0 and fmha.explain(q, k, v, causal=True).backend == "gluon_sm90"
            assert "read as one KV head" in fmha.explain(q, k, v, causal=True).source
            distinct_v = v.contiguous()  # heads that may differ: not one KV head, and TMA refuses k
            assert fmha.explain(q, k, distinct_v).backend == "triton"
            out = fmha.attention(q, k, v, causal=True)
    finally:
        dispatch.forget()
    assert given == [(1, True, 4, 4)]
    assert_close_to_reference(out, q, k, v, causal_offset=4)
