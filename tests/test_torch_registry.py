"""FMHA in PyTorch's flash-attention registry, on the CPU through the interpreter.

Torch has no CPU kernel of the flash operators, and ``F.scaled_dot_product_attention`` on CPU
tensors calls another operator (``_scaled_dot_product_flash_attention_for_cpu``), so these tests
call the replaced operators themselves, and ``varlen_attn``, which calls them; activation also
registers fmha for CPU tensors when Triton interprets. The before/after equality of
``F.scaled_dot_product_attention`` and ``varlen_attn`` on CUDA is tests/test_gpu_torch_registry.py.
"""

import pytest
import torch
import torch.nn.attention

import fmha
from fmha.integrations import sdpa
from fmha.masking import Window

from .helpers import assert_close_to_reference, assert_grads_close, random_qkv

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not sdpa.available(), reason=f"the flash-attention registry needs {sdpa.REQUIREMENT}"),
]

aten = torch.ops.aten


@pytest.fixture
def fmha_active():
    sdpa.activate(strict=True)
    yield
    sdpa.deactivate()


def cpu_kernel(name):
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU")


def grads_of(out, leaves, seed=0):
    dout = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, leaves, dout), dout


def test_activation_puts_fmha_behind_the_operators_and_restore_takes_it_away():
    assert "FMHA" in torch.nn.attention.list_flash_attention_impls()
    assert not any(cpu_kernel(name) for name in sdpa.OPERATORS)
    torch.nn.attention.activate_flash_attention_impl("FMHA")  # torch's own entry point
    try:
        assert sdpa.active() and torch.nn.attention.current_flash_attention_impl() == "FMHA"
        assert all(cpu_kernel(name) for name in sdpa.OPERATORS if hasattr(aten, name))
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    assert not sdpa.active()
    assert not any(cpu_kernel(name) for name in sdpa.OPERATORS)
    with sdpa.activated():
        assert sdpa.active()
    assert not sdpa.active() and torch.nn.attention.current_flash_attention_impl() is None


def test_a_torch_without_the_registry_gets_a_clear_error(monkeypatch):
    monkeypatch.delattr(torch.nn.attention, "register_flash_attention_impl")
    assert not sdpa.available() and not sdpa.active()
    with pytest.raises(RuntimeError, match=r"torch 2\.11 or later.*this is torch"):
        sdpa.activate()
    sdpa.deactivate()  # nothing to undo: no error


# (batch, q heads, kv heads, Sq, Sk, head dim)
SHAPES = [(2, 2, 2, 24, 24, 16), (1, 4, 2, 19, 33, 24), (1, 2, 1, 33, 20, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_sdpa_flash_operator_forward_and_backward(fmha_active, dtype, shape, is_causal):
    q, k, v = (t.requires_grad_() for t in random_qkv(*shape, dtype))
    out, lse, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_mask = \
        aten._scaled_dot_product_flash_attention(q, k, v, is_causal=is_causal, scale=0.3)
    # is_causal in torch's flash kernels (FlashAttention-2) is aligned bottom-right, as in fmha
    offset = shape[4] - shape[3] if is_causal else None
    assert_close_to_reference(out, q, k, v, causal_offset=offset, scale=0.3, lse=lse)
    assert (cum_seq_q, cum_seq_k, max_q, max_k) == (None, None, shape[3], shape[4])
    assert rng_state.shape == (2,) and unused.shape == () and rng_state.dtype == unused.dtype == torch.uint64
    assert debug_mask.numel() == 0 and debug_mask.dtype == dtype
    grads, dout = grads_of(out, (q, k, v))  # through aten::_scaled_dot_product_flash_attention_backward
    assert_grads_close(grads, q, k, v, dout, causal_offset=offset, scale=0.3)


def window_id(window):
    return f"window{window[0]}_{window[1]}"


@pytest.mark.parametrize("window", [(-1, -1), (5, 0), (3, 7), (None, 2)], ids=window_id)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_flash_attention_operator_bshd_with_windows(fmha_active, window, is_causal):
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 4, 2, 21, 30, 16, torch.float16, layout="bshd"))
    query, key, value = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D), as the operator takes them
    out, lse, rng_state, unused, debug_mask = aten._flash_attention_forward(
        query, key, value, None, None, 21, 30, 0.0, is_causal, False,
        window_size_left=window[0], window_size_right=window[1])
    left = None if window[0] is None or window[0] < 0 else window[0]
    right = None if window[1] is None or window[1] < 0 else window[1]
    if is_causal:
        right = 0
    expected_window = Window.of(21, 30, left=left, right=right) if (left, right) != (None, None) else None
    assert out.shape == query.shape and out.stride() == torch.empty_like(query).stride()
    assert_close_to_reference(out.transpose(1, 2), q, k, v, window=expected_window, lse=lse)
    grads, dout = grads_of(out, (query, key, value))  # through aten::_flash_attention_backward
    assert_grads_close([g.transpose(1, 2) for g in grads], q, k, v, dout.transpose(1, 2), window=expected_window)


def test_outputs_have_the_shapes_strides_and_dtypes_of_torchs_fake_kernels(fmha_active):
    q, k, v = random_qkv(2, 4, 2, 24, 40, 16, torch.float16, layout="bshd")
    for name, args in [("_scaled_dot_product_flash_attention", (q, k, v, 0.0, True)),
                       ("_flash_attention_forward", (*(t.transpose(1, 2) for t in (q, k, v)), None, None, 24, 40,
                                                     0.0, True, False))]:
        real = getattr(aten, name)(*args)
        fake = getattr(aten, name)(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
        for got, expected in zip(real, fake):
            if isinstance(expected, torch.Tensor):
                assert (got.shape, got.stride(), got.dtype) == (expected.shape, expected.stride(), expected.dtype)
            else:
                assert got == expected


def packed(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths_q), heads_q, head_dim, generator=generator, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), heads_kv, head_dim, generator=generator, dtype=dtype, requires_grad=True)
            for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
                  for lengths in (lengths_q, lengths_k))
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("window_size", [(-1, -1), (-1, 0), (4, 0), (2, 3)], ids=window_id)
def test_varlen_attn_runs_on_fmha(fmha_active, window_size):
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    lengths_q, lengths_k = [5, 12, 3], [9, 12, 1]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 2, 2, 16, torch.float16)
    out, lse = varlen_attn(q, k, v, cu_q, cu_k, 12, 12, return_aux=AuxRequest(lse=True), window_size=window_size)
    assert out.shape == q.shape and lse.shape == (2, sum(lengths_q)) and lse.dtype == torch.float32
    grads, dout = grads_of(out, (q, k, v))  # through aten::_flash_attention_backward with cum_seq
    left, right = (None if side < 0 else side for side in window_size)
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq = [t[part].detach().transpose(0, 1).unsqueeze(0) for t, part in ((q, rows), (k, keys), (v, keys))]
        window = Window.of(lengths_q[b], lengths_k[b], left=left, right=right) if (left, right) != (None, None) \
            else None
        assert_close_to_reference(out[rows].transpose(0, 1).unsqueeze(0), *seq, window=window,
                                  lse=lse[:, rows].unsqueeze(0))
        assert_grads_close([g[part].transpose(0, 1).unsqueeze(0) for g, part in zip(grads, (rows, keys, keys))],
                           *seq, dout[rows].transpose(0, 1).unsqueeze(0), window=window)


def test_backward_takes_an_lse_from_another_implementation(fmha_active):
    """A forward that torch ran (a refused call) can be differentiated by fmha: the LSE means the same."""
    q, k, v = random_qkv(1, 2, 2, 20, 20, 16, torch.float32)
    out, lse = fmha.reference.dense_attention(q, k, v, window=Window.of(20, 20, left=None, right=0))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    grads = aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out.float(), lse.float(), None, None, 20, 20, 0.0, True,
        torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64))
    assert_grads_close(grads, q, k, v, dout, causal_offset=0)


REFUSED = [
    ("dropout", dict(dropout_p=0.2), "dropout_p=0.2"),
    ("debug_mask", dict(return_debug_mask=True), "return_debug_mask"),
]


@pytest.mark.parametrize("case", REFUSED, ids=lambda case: case[0])
def test_refused_calls_raise_with_the_reason_where_torch_has_no_kernel(case):
    _, kwargs, reason = case
    q, k, v = random_qkv(1, 2, 2, 8, 8, 16, torch.float32)
    with sdpa.activated():  # not strict: would run torch's kernel, but there is none for CPU tensors
        with pytest.raises(NotImplementedError, match=f"{reason}.*torch has no CPU kernel"):
            aten._scaled_dot_product_flash_attention(q, k, v, **kwargs)


def test_unsupported_arguments_of_the_flash_operator_are_refused(fmha_active):
    q, k, v = (t.transpose(1, 2) for t in random_qkv(1, 2, 2, 8, 8, 16, torch.float32))
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        aten._flash_attention_forward(q, k, v, None, None, 8, 8, 0.0, False, False, alibi_slopes=torch.ones(2))
    # an argument of a newer torch is refused, not ignored
    with pytest.raises(NotImplementedError, match="an_argument_of_a_newer_torch"):
        sdpa.OPERATORS["_scaled_dot_product_flash_attention"](q, k, v, an_argument_of_a_newer_torch=1)


def test_a_refused_call_runs_the_kernel_torch_had_unless_strict():
    """Torch's CUDA kernels can't run here: a stand-in CPU kernel plays "the kernel torch had"."""
    calls = []

    def stand_in(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        calls.append(dropout_p)
        out = torch.zeros_like(query)
        return (out, torch.zeros(query.shape[:3]), None, None, query.shape[2], key.shape[2],
                torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64), torch.empty(0))

    library = torch.library.Library("aten", "IMPL")
    library.impl("_scaled_dot_product_flash_attention", stand_in, "CPU")
    try:
        q, k, v = random_qkv(1, 2, 2, 8, 8, 16, torch.float32)
        with sdpa.activated():
            out = aten._scaled_dot_product_flash_attention(q, k, v, 0.5)[0]
            assert calls == [0.5] and (out == 0).all()
            assert_close_to_reference(aten._scaled_dot_product_flash_attention(q, k, v)[0], q, k, v)  # fmha
            assert calls == [0.5]
        with sdpa.activated(strict=True):
            with pytest.raises(NotImplementedError, match=r"dropout_p=0\.5.*strict=True"):
                aten._scaled_dot_product_flash_attention(q, k, v, 0.5)
        assert calls == [0.5]
        aten._scaled_dot_product_flash_attention(q, k, v, 0.5)  # deactivated: the stand-in again
        assert calls == [0.5, 0.5]
    finally:
        library._destroy()
