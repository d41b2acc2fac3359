"""FMHA in PyTorch's flash-attention registry on the GPU (marker ``gpu``): what torch's flash
kernels gave before activation, fmha gives after, forward and gradients.

Each result is measured against float64: fmha's error must stay within 2x the error of torch's
own flash kernel on the same inputs (plus a small atol), and within the project's error rule.
Activation is strict here, and fmha's entry points are counted, so a call that silently ran
torch's kernel instead would fail.
"""

import collections

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha
from fmha.integrations import sdpa
from fmha.masking import Window
from fmha.reference import dense_attention

from .helpers import assert_close_to_reference, assert_grads_close, random_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not sdpa.available(), reason=f"the flash-attention registry needs {sdpa.REQUIREMENT}"),
]

aten = torch.ops.aten
ATOL = {torch.float16: 1e-4, torch.bfloat16: 1e-3}
GRAD_ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}


@pytest.fixture
def fmha_calls(monkeypatch):
    """Activates FMHA (strict) and counts the calls that reach fmha's forward and backward."""
    calls = collections.Counter()

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(sdpa, "attention", counted("forward", sdpa.attention))
    monkeypatch.setattr(sdpa, "flash_attn_varlen_func", counted("forward", sdpa.flash_attn_varlen_func))
    monkeypatch.setattr(sdpa.dispatch, "run_backward", counted("backward", sdpa.dispatch.run_backward))
    yield calls
    sdpa.deactivate()


def truth(q, k, v, dout, window, scale=None):
    """float64 output, LSE and gradients."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = dense_attention(*leaves, scale=scale, window=window, dtype=torch.float64)
    return out.detach(), lse, torch.autograd.grad(out, leaves, dout.double())


def assert_as_good_as_before(after, before, reference, atol, name="out"):
    assert not torch.isnan(after).any(), f"{name} has NaN"
    error = (after.double() - reference).abs().max().item()
    before_error = (before.double() - reference).abs().max().item()
    assert error <= 2 * before_error + atol, f"{name}: fmha's error {error:.3g} > 2 * torch flash's {before_error:.3g}"


def run_both(fmha_calls, fn):
    """``fn()`` with torch's kernels, then with FMHA active."""
    sdpa.deactivate()
    before = fn()
    sdpa.activate(strict=True)
    fmha_calls.clear()
    after = fn()
    return before, after


# (batch, q heads, kv heads, Sq, Sk, head dim): MHA, GQA, Sq != Sk, a head dim that is not a power of two
SDPA_SHAPES = [(2, 8, 8, 1024, 1024, 64), (1, 16, 4, 2048, 2048, 128), (2, 4, 4, 512, 1536, 96),
               (1, 8, 2, 1000, 1000, 256)]


def shape_id(shape):
    return "x".join(map(str, shape))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SDPA_SHAPES, ids=shape_id)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_sdpa_flash_backend_same_as_before_gpu(fmha_calls, dtype, shape, is_causal):
    if is_causal and shape[3] != shape[4]:
        pytest.skip("SDPA's flash backend refuses is_causal with Sq != Sk (top-left vs bottom-right)")
    generator = torch.Generator(device="cuda").manual_seed(hash((shape, is_causal)) % 2**31)
    q, k, v = random_qkv(*shape, dtype, device="cuda", generator=generator, requires_grad=True)
    dout = torch.randn(q.shape, dtype=dtype, device="cuda", generator=generator)

    def sdpa_call():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=shape[1] != shape[2])
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    before, after = run_both(fmha_calls, sdpa_call)
    assert fmha_calls == {"forward": 1, "backward": 1}
    window = Window.of(shape[3], shape[4], right=0, top_left=True) if is_causal else None
    out64, _, grads64 = truth(q, k, v, dout, window)
    for name, got, was, reference, atol in zip(("out", "dq", "dk", "dv"), after, before, (out64, *grads64),
                                               (ATOL[dtype], *[GRAD_ATOL[dtype]] * 3)):
        assert got.shape == was.shape and got.dtype == was.dtype, name
        assert_as_good_as_before(got, was, reference, atol, name)
    assert_close_to_reference(after[0], q, k, v, window=window)
    assert_grads_close(after[1:], q, k, v, dout, window=window)


def test_auxiliary_outputs_are_torchs_gpu(fmha_calls):
    q, k, v = random_qkv(2, 4, 4, 256, 384, 64, torch.bfloat16, device="cuda")
    before, after = run_both(fmha_calls, lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False))
    assert fmha_calls["forward"] == 1
    for index, (got, was) in enumerate(zip(after, before)):
        if isinstance(was, torch.Tensor):
            assert (got.shape, got.dtype, got.device) == (was.shape, was.dtype, was.device), index
        else:
            assert got == was, index


@pytest.mark.parametrize("seqlens", [(700, 1500), (1500, 700)], ids=shape_id)
def test_flash_operator_causal_is_bottom_right_as_before_gpu(fmha_calls, seqlens):
    seqlen_q, seqlen_k = seqlens
    q, k, v = random_qkv(1, 8, 8, seqlen_q, seqlen_k, 128, torch.bfloat16, device="cuda")
    before, after = run_both(fmha_calls, lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True))
    assert fmha_calls["forward"] == 1
    window = Window.of(seqlen_q, seqlen_k, right=0)
    out64, lse64, _ = truth(q, k, v, torch.zeros_like(q), window)
    assert_as_good_as_before(after[0], before[0], out64, ATOL[torch.bfloat16])
    seen = torch.isfinite(lse64)  # rows that see no key: LSE -inf in fmha, +inf in FlashAttention-2
    torch.testing.assert_close(after[1][seen], before[1][seen], atol=1e-3, rtol=1e-3)
    assert torch.isneginf(after[1][~seen]).all() and (after[0][:, :, (~seen)[0, 0]] == 0).all()


@pytest.mark.parametrize("window", [(-1, -1), (255, 0), (100, 100), (-1, 64)], ids=lambda w: f"left{w[0]}_right{w[1]}")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_flash_attention_forward_bshd_windows_same_as_before_gpu(fmha_calls, window, is_causal):
    generator = torch.Generator(device="cuda").manual_seed(hash((window, is_causal)) % 2**31)
    q, k, v = random_qkv(2, 8, 2, 1000, 1300, 128, torch.bfloat16, device="cuda", generator=generator,
                         layout="bshd", requires_grad=True)
    query, key, value = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D)
    dout = torch.randn(query.shape, dtype=torch.bfloat16, device="cuda", generator=generator)

    def flash_call():
        out = aten._flash_attention_forward(query, key, value, None, None, 1000, 1300, 0.0, is_causal, False,
                                            window_size_left=window[0], window_size_right=window[1])[0]
        return (out, *torch.autograd.grad(out, (query, key, value), dout))

    before, after = run_both(fmha_calls, flash_call)
    assert fmha_calls == {"forward": 1, "backward": 1}
    left, right = (None if side < 0 else side for side in window)
    expected = Window.of(1000, 1300, left=left, right=0 if is_causal else right)
    out64, _, grads64 = truth(q, k, v, dout.transpose(1, 2), expected)
    for name, got, was, reference, atol in zip(("out", "dq", "dk", "dv"), after, before, (out64, *grads64),
                                               (1e-3, 1e-2, 1e-2, 1e-2)):
        assert got.shape == was.shape and got.dtype == was.dtype, name
        assert_as_good_as_before(got.transpose(1, 2), was.transpose(1, 2), reference, atol, name)


@pytest.mark.parametrize("window_size", [(-1, -1), (-1, 0), (128, 0)], ids=lambda w: f"left{w[0]}_right{w[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_varlen_attn_same_as_before_gpu(fmha_calls, window_size, dtype):
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    lengths = [300, 1000, 17, 512]
    generator = torch.Generator(device="cuda").manual_seed(hash((window_size, str(dtype))) % 2**31)
    q, k, v = (torch.randn(sum(lengths), 8, 128, dtype=dtype, device="cuda", generator=generator, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(q.shape, dtype=dtype, device="cuda", generator=generator)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def varlen_call():
        out, lse = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), return_aux=AuxRequest(lse=True),
                               window_size=window_size)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))

    before, after = run_both(fmha_calls, varlen_call)
    assert fmha_calls == {"forward": 1, "backward": 1}
    assert after[1].shape == before[1].shape == (8, sum(lengths))
    torch.testing.assert_close(after[1], before[1], atol=2e-3, rtol=1e-3)
    left, right = (None if side < 0 else side for side in window_size)
    for b, length in enumerate(lengths):
        rows = slice(cu[b].item(), cu[b + 1].item())
        seq = [t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        window = Window.of(length, length, left=left, right=right) if (left, right) != (None, None) else None
        out64, _, grads64 = truth(*seq, dout[rows].transpose(0, 1).unsqueeze(0), window)
        for name, got, was, reference, atol in zip(("out", "dq", "dk", "dv"), after[:1] + after[2:],
                                                   before[:1] + before[2:], (out64, *grads64),
                                                   (ATOL[dtype], *[GRAD_ATOL[dtype]] * 3)):
            assert_as_good_as_before(got[rows].transpose(0, 1).unsqueeze(0), was[rows].transpose(0, 1).unsqueeze(0),
                                     reference, atol, f"sequence {b} {name}")


def test_compiled_sdpa_runs_fmha_as_eager_does_gpu(fmha_calls):
    q, k, v = random_qkv(2, 8, 8, 1024, 1024, 128, torch.bfloat16, device="cuda", requires_grad=True)
    dout = torch.randn_like(q)

    def step(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    sdpa.activate(strict=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        eager = step(q, k, v)
        eager_grads = torch.autograd.grad(eager, (q, k, v), dout)
        fmha_calls.clear()
        compiled = torch.compile(step, fullgraph=True)(q, k, v)
        compiled_grads = torch.autograd.grad(compiled, (q, k, v), dout)
    assert fmha_calls == {"forward": 1, "backward": 1}
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
    # dK and dV bitwise; dQ is summed by atomic adds whose order varies run to run (under load: other
    # processes on the GPU), which only deterministic=True makes bitwise
    (dq, dk, dv), (eager_dq, eager_dk, eager_dv) = compiled_grads, eager_grads
    torch.testing.assert_close(dk, eager_dk, atol=0, rtol=0)
    torch.testing.assert_close(dv, eager_dv, atol=0, rtol=0)
    torch.testing.assert_close(dq, eager_dq, atol=1e-2, rtol=0)


def test_dropout_runs_torchs_kernel_unless_strict_gpu(fmha_calls):
    q, k, v = random_qkv(2, 8, 8, 512, 512, 64, torch.bfloat16, device="cuda")

    def dropout_call():
        torch.manual_seed(7)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)

    before = dropout_call()
    with pytest.raises(NotImplementedError, match=r"dropout_p=0\.3.*strict=True"):
        with sdpa.activated(strict=True):
            dropout_call()
    with sdpa.activated():  # not strict: torch's kernel, with the same random stream
        after = dropout_call()
    assert fmha_calls["forward"] == 0
    assert torch.equal(after, before)
