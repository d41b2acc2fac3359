"""Head dims between the Hopper kernels' tile widths (marker ``gpu``): a head dim that is a multiple
of 8 runs the Gluon kernels at the next tile width (64, 128 or 256), with the columns past it
zero-filled by the bulk copies and left out of every store. The tensors here
are views of wider buffers whose extra columns hold NaN: a kernel that read or wrote past the head
dim would fail."""

import pytest
import torch

import fmha
from fmha.backends.gluon_sm90.schedule import tile_head_dim
from fmha.masking import Window

from .helpers import assert_close_to_reference, assert_grads_close, random_qkv
from .test_gpu_varlen import as_bhsd, check_packed_grads, spans

pytestmark = pytest.mark.gpu

FORWARD_HEAD_DIMS = [8, 32, 48, 80, 96, 112, 136, 160, 192, 248]
BACKWARD_HEAD_DIMS = [8, 32, 48, 80, 96, 112, 136, 160, 192, 248, 256]
# The shipped rules' schedule of each tile width without score features (tuning/defaults/schedules.json).
SCHEDULES = {64: dict(persistent=True, q_buffers=2, emulated_exp2=8), 128: dict(persistent=True, q_buffers=2),
             256: dict(persistent=True, block_n=64, pack_p=True)}


@pytest.fixture(autouse=True)
def _hopper_only():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are built for sm_90")


def in_wider_buffer(tensor: torch.Tensor, grad: bool = False) -> torch.Tensor:
    """``tensor`` copied into the leading columns of a buffer 64 columns wider, the rest NaN."""
    wide = torch.full((*tensor.shape[:-1], tensor.shape[-1] + 64), float("nan"), device=tensor.device,
                      dtype=tensor.dtype)
    wide[..., :tensor.shape[-1]] = tensor
    return wide[..., :tensor.shape[-1]].detach().requires_grad_(grad)


def wide_qkv(head_dim, dtype, seqlen_q=777, seqlen_k=1500, grad=False, seed=0):
    torch.manual_seed(seed)
    q, k, v = random_qkv(2, 8, 2, seqlen_q, seqlen_k, head_dim, dtype, device="cuda", layout="bshd")
    return tuple(in_wider_buffer(t, grad) for t in (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", FORWARD_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gluon_forward_between_tile_widths_gpu(dtype, head_dim, causal):
    q, k, v = wide_qkv(head_dim, dtype, seed=head_dim)
    config = fmha.HopperSchedule(**SCHEDULES[tile_head_dim(head_dim)])
    assert fmha.explain(q, k, v, causal=causal, config=config).backend == "gluon_sm90"
    out, lse = fmha.attention(q, k, v, causal=causal, return_lse=True, config=config)
    assert_close_to_reference(out, q, k, v, causal_offset=1500 - 777 if causal else None, lse=lse, atol=1e-5)


@pytest.mark.parametrize("head_dim", [48, 96, 160])
def test_gluon_forward_between_tile_widths_with_score_features_gpu(head_dim):
    """Softcap, ALiBi and sinks, causal, at a head dim the tiles round up (the scale is the call's D's)."""
    q, k, v = wide_qkv(head_dim, torch.bfloat16, seed=head_dim + 1)
    slopes = torch.rand(8, device="cuda") * 0.1
    sinks = torch.randn(8, device="cuda")
    features = dict(causal=True, softcap=30.0, alibi_slopes=slopes, sinks=sinks,
                    config=fmha.HopperSchedule(**SCHEDULES[tile_head_dim(head_dim)]))
    assert fmha.explain(q, k, v, **features).backend == "gluon_sm90"
    out, lse = fmha.attention(q, k, v, return_lse=True, **features)
    assert_close_to_reference(out, q, k, v, causal_offset=1500 - 777, softcap=30.0, alibi_slopes=slopes,
                              sinks=sinks, lse=lse, atol=1e-5)


@pytest.mark.parametrize("window", [None, (None, 0), (300, 0), (200, None), (100, 100)],
                         ids=lambda window: "dense" if window is None else f"window{window[0]}-{window[1]}")
@pytest.mark.parametrize("head_dim", BACKWARD_HEAD_DIMS)
def test_gluon_backward_between_tile_widths_gpu(head_dim, window):
    """The Gluon backward at every tile width (the 256-wide one over D = 128), GQA, Sq != Sk,
    causal and windows, against float64."""
    q, k, v = wide_qkv(head_dim, torch.bfloat16, seqlen_q=1000, seqlen_k=1100, grad=True, seed=head_dim + 2)
    causal = window == (None, 0)
    window = None if causal else window
    params = fmha.params.attention_params("test", q, k, v, causal=causal, window=window)
    hopper, reason = fmha.dispatch.hopper_backward(params, q, q, k, v, q, k, v)
    assert hopper is not None, reason
    out = fmha.attention(q, k, v, causal=causal, window=window)
    dout = in_wider_buffer(torch.randn_like(out))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    left, right = window if window is not None else (None, 0 if causal else None)
    assert_grads_close(grads, q, k, v, dout, window=Window.of(1000, 1100, left=left, right=right))


@pytest.mark.parametrize("head_dim", [48, 96, 192])
def test_packed_sequences_between_tile_widths_gpu(head_dim):
    """Packed sequences end inside tiles, where the forward and the backward store rows with plain
    stores (columns past the head dim masked), forward and backward at every width."""
    lengths_q = [1500, 0, 1, 77, 300, 64, 129, 5]
    lengths_k = [1500, 3, 1, 200, 300, 64, 0, 130]
    generator = torch.Generator(device="cuda").manual_seed(head_dim)
    q, k, v = (in_wider_buffer(torch.randn(sum(lengths), heads, head_dim, device="cuda", dtype=torch.bfloat16,
                                           generator=generator), grad=True)
               for lengths, heads in ((lengths_q, 8), (lengths_k, 2), (lengths_k, 2)))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for lengths in (lengths_q, lengths_k))
    params = fmha.params.varlen_params("test", q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    assert fmha.dispatch.choose_forward(params, q, k, v).backend == "gluon_sm90"
    out, lse = fmha.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                     return_lse=True)
    for rows, keys in spans(lengths_q, lengths_k):
        if rows.stop > rows.start and keys.stop > keys.start:
            assert_close_to_reference(as_bhsd(out[rows]), as_bhsd(q[rows]), as_bhsd(k[keys]), as_bhsd(v[keys]),
                                      causal_offset=(keys.stop - keys.start) - (rows.stop - rows.start),
                                      lse=lse[:, rows].unsqueeze(0), atol=1e-5)
    hopper, reason = fmha.dispatch.hopper_backward(params, q, q, k, v, q, k, v)
    assert hopper is not None, reason
    dout = torch.randn_like(out)
    check_packed_grads(torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, lengths_q, lengths_k,
                       (None, None), True)


@pytest.mark.parametrize("window", [(None, 0), (255, 0), (100, 100)],
                         ids=lambda window: f"left{window[0]}-right{window[1]}")
@pytest.mark.parametrize("head_dim", [192, 256])
def test_packed_sequences_with_score_features_on_the_wide_backward_gpu(head_dim, window):
    """Softcap and ALiBi on packed sequences in the 256-wide tiles' backward: each sequence's
    gradients against float64 (ALiBi's positions and the window counted within the sequence)."""
    lengths_q = [700, 0, 1, 77, 300, 129]
    lengths_k = [900, 3, 1, 200, 300, 64]
    generator = torch.Generator(device="cuda").manual_seed(head_dim + 5)
    q, k, v = (torch.randn(sum(lengths), heads, head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=generator).requires_grad_()
               for lengths, heads in ((lengths_q, 8), (lengths_k, 2), (lengths_k, 2)))
    slopes = torch.exp2(-8.0 * torch.arange(1, 9, device="cuda") / 8)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for lengths in (lengths_q, lengths_k))
    features = dict(softcap=30.0, alibi_slopes=slopes)
    params = fmha.params.varlen_params("test", q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), window=window,
                                       **features)
    hopper, reason = fmha.dispatch.hopper_backward(params, q, q, k, v, q, k, v)
    assert hopper is not None, reason
    out = fmha.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), window=window, **features)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for rows, keys in spans(lengths_q, lengths_k):
        seqlen_q, seqlen_k = rows.stop - rows.start, keys.stop - keys.start
        if seqlen_q == 0 or seqlen_k == 0:
            continue
        inputs = [as_bhsd(t.detach()) for t in (q[rows], k[keys], v[keys])]
        assert_grads_close((as_bhsd(dq[rows]), as_bhsd(dk[keys]), as_bhsd(dv[keys])), *inputs, as_bhsd(dout[rows]),
                           window=Window.of(seqlen_q, seqlen_k, left=window[0], right=window[1]), **features)
