"""A value head dim of its own on the GPU (marker ``gpu``): q and k (..., D), v and the output (..., Dv),
DeepSeek's MLA shape (192, 128) among others. On sm_90 the Gluon forward runs a Dv that is a
multiple of 8 within the columns its products read at D (V's columns past Dv zero-filled by the bulk
copies, the output's past Dv never stored), and the Gluon backward runs them with every tensor
zero-padded to the wider head dim. The inputs are
views of wider buffers whose extra columns hold NaN: a kernel that read past a head dim would fail."""

import pytest
import torch

import fmha
from fmha.backends.gluon_sm90.backend import value_head_dim_refusal
from fmha.backends.gluon_sm90.schedule import tile_head_dim
from fmha.masking import Window

from .helpers import assert_close_to_reference, assert_grads_close, random_qkv
from .test_gpu_head_dims import SCHEDULES, in_wider_buffer
from .test_gpu_varlen import as_bhsd, spans

pytestmark = pytest.mark.gpu

# (D, Dv): MLA's, narrower and wider values, widths between the tiles, and one off the 8-column steps.
HEAD_DIMS = [(192, 128), (128, 64), (256, 128), (96, 64), (64, 128), (48, 40), (128, 100)]


def ids(head_dims):
    return f"d{head_dims[0]}-dv{head_dims[1]}"


def wide_inputs(head_dim, head_dim_v, dtype, seqlen_q, seqlen_k, seed, grad=False):
    torch.manual_seed(seed)
    q, k, v = random_qkv(2, 8, 2, seqlen_q, seqlen_k, head_dim, dtype, device="cuda", layout="bshd",
                         head_dim_v=head_dim_v)
    return tuple(in_wider_buffer(t, grad) for t in (q, k, v))


def gluon_forward_schedule(q, k, v, **options):
    """A schedule of the Gluon forward for this call where it takes v's head dim (sm_90), else None."""
    params = fmha.params.attention_params("test", q, k, v, **options)
    if torch.cuda.get_device_capability() != (9, 0) or value_head_dim_refusal(params) is not None:
        return None
    return fmha.HopperSchedule(**SCHEDULES[tile_head_dim(params.head_dim)])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=ids)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_forward_gpu(dtype, head_dims, causal):
    """The default path, and the Gluon forward by name where it takes the call (else a refusal
    that names v's head dim)."""
    q, k, v = wide_inputs(*head_dims, dtype, 777, 1500, seed=sum(head_dims))
    reference = dict(causal_offset=1500 - 777 if causal else None)
    out, lse = fmha.attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (2, 8, 777, head_dims[1])
    assert_close_to_reference(out, q, k, v, lse=lse, **reference)
    schedule = gluon_forward_schedule(q, k, v, causal=causal)
    if schedule is None:
        explanation = fmha.explain(q, k, v, causal=causal)
        assert explanation.backend == "triton" and "v's head dim" in str(explanation), str(explanation)
        return
    assert fmha.explain(q, k, v, causal=causal, config=schedule).backend == "gluon_sm90"
    out, lse = fmha.attention(q, k, v, causal=causal, return_lse=True, config=schedule)
    assert_close_to_reference(out, q, k, v, lse=lse, **reference)


@pytest.mark.parametrize("window", [None, (None, 0), (200, 0)], ids=lambda w: "dense" if w is None else f"left{w[0]}")
@pytest.mark.parametrize("head_dims", [(192, 128), (128, 64), (64, 128), (48, 40)], ids=ids)
def test_backward_gpu(head_dims, window):
    q, k, v = wide_inputs(*head_dims, torch.bfloat16, 1000, 1100, seed=sum(head_dims) + 1, grad=True)
    causal = window is not None
    window = None if window is None or window[0] is None else window
    backward = fmha.explain(q, k, v, causal=causal, window=window).backward
    assert backward.startswith("gluon_sm90") and "zero-padded to head dim" in backward, backward
    out = fmha.attention(q, k, v, causal=causal, window=window)
    dout = in_wider_buffer(torch.randn_like(out))
    left = None if window is None else window[0]
    visible = Window.of(1000, 1100, left=left, right=0 if causal else None)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close(grads, q, k, v, dout, out=out.detach(), window=visible)
    # the portable backward, which takes two head dims as they are
    out = fmha.attention(q, k, v, causal=causal, window=window, deterministic=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close(grads, q, k, v, dout, out=out.detach(), window=visible)


def test_score_features_gpu():
    q, k, v = wide_inputs(192, 128, torch.bfloat16, 600, 900, seed=5, grad=True)
    slopes = torch.rand(8, device="cuda") * 0.1
    sinks = torch.randn(8, device="cuda", requires_grad=True)
    features = dict(causal=True, softcap=30.0, alibi_slopes=slopes)
    out = fmha.attention(q, k, v, sinks=sinks, **features)
    reference = dict(causal_offset=300, softcap=30.0, alibi_slopes=slopes, sinks=sinks.detach())
    assert_close_to_reference(out.detach(), q, k, v, **reference)
    dout = torch.randn_like(out)
    assert_grads_close(torch.autograd.grad(out, (q, k, v, sinks), dout), q, k, v, dout, **reference)


def test_decode_rows_gpu():
    # One query row a head, GQA 4: a decode-like call, which runs the per-tile forward here.
    q, k, v = wide_inputs(192, 128, torch.bfloat16, 1, 4096, seed=6)
    out = fmha.attention(q, k, v)
    assert_close_to_reference(out, q, k, v)


def test_packed_sequences_gpu():
    lengths_q = [1500, 0, 1, 77, 300, 64, 129, 5]
    lengths_k = [1500, 3, 1, 200, 300, 64, 0, 130]
    generator = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (in_wider_buffer(torch.randn(sum(lengths), heads, dim, device="cuda", dtype=torch.bfloat16,
                                           generator=generator), grad=True)
               for lengths, heads, dim in ((lengths_q, 8, 192), (lengths_k, 2, 192), (lengths_k, 2, 128)))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for lengths in (lengths_q, lengths_k))
    out, lse = fmha.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                     return_lse=True)
    assert out.shape == (sum(lengths_q), 8, 128)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for rows, keys in spans(lengths_q, lengths_k):
        if rows.stop == rows.start:
            continue
        if keys.stop == keys.start:  # rows that see nothing: zeros, and no gradient
            assert torch.equal(out[rows], torch.zeros_like(out[rows])) and not dq[rows].any()
            continue
        inputs = [as_bhsd(t.detach()) for t in (q[rows], k[keys], v[keys])]
        offset = dict(causal_offset=(keys.stop - keys.start) - (rows.stop - rows.start))
        assert_close_to_reference(as_bhsd(out[rows].detach()), *inputs, lse=lse[:, rows].unsqueeze(0), **offset)
        assert_grads_close((as_bhsd(dq[rows]), as_bhsd(dk[keys]), as_bhsd(dv[keys])), *inputs,
                           as_bhsd(dout[rows]), out=as_bhsd(out[rows].detach()), **offset)


def test_sdpa_matches_torch_gpu():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    torch.manual_seed(8)
    query, key, value = (torch.randn(2, 16, 512, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                         for dim in (192, 192, 128))
    out = fmha.scaled_dot_product_attention(query, key, value, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        expected = scaled_dot_product_attention(query.double(), key.double(), value.double(), is_causal=True)
    assert out.shape == (2, 16, 512, 128)
    assert (out.double() - expected).abs().max().item() < 2e-2
