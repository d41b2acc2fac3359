"""Score features on the GPU (marker ``gpu``): softcap, ALiBi, sinks, dropout and SDPA's attn_mask,
forward and backward in bf16 against float64 (the project's error rule), dropout's reproducibility
and CUDA graphs, and torch.compile."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha
from fmha import ops
from fmha.backends.triton.launch import dropout_keep_mask, kernel_dropout_p

from .helpers import assert_close_to_reference, assert_grads_close, random_qkv

pytestmark = pytest.mark.gpu

Q_HEADS, KV_HEADS = 8, 2
LENGTHS = [(1000, 1000), (1500, 500)]


def inputs(seqlen_q, seqlen_k, head_dim, seed, dtype=torch.bfloat16, grad=False):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = random_qkv(2, Q_HEADS, KV_HEADS, seqlen_q, seqlen_k, head_dim, dtype, device="cuda",
                         generator=generator)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def feature_kwargs(name):
    generator = torch.Generator(device="cuda").manual_seed(0)
    slopes = torch.exp2(-8.0 * torch.arange(1, Q_HEADS + 1, device="cuda") / Q_HEADS)  # the usual geometric slopes
    sinks = torch.randn(Q_HEADS, device="cuda", generator=generator)
    return {"softcap": dict(softcap=30.0), "softcap_small": dict(softcap=2.0), "alibi": dict(alibi_slopes=slopes),
            "alibi_batched": dict(alibi_slopes=slopes * torch.rand(2, 1, device="cuda", generator=generator)),
            "sinks": dict(sinks=sinks), "all": dict(softcap=20.0, alibi_slopes=slopes, sinks=sinks),
            "softcap_sinks": dict(softcap=50.0, sinks=sinks), "softcap_wide": dict(softcap=60.0)}[name]


FEATURES = ["softcap", "softcap_small", "alibi_batched", "sinks", "all"]


def check_features(q, k, v, name, causal, **attention_kwargs):
    """Output, LSE and gradients (the sinks' too) of one feature set against float64."""
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    kwargs = feature_kwargs(name)
    leaves = (q, k, v)
    if "sinks" in kwargs:
        kwargs["sinks"] = kwargs["sinks"].clone().requires_grad_()
        leaves += (kwargs["sinks"],)
    out, lse = fmha.attention(q, k, v, causal=causal, return_lse=True, **attention_kwargs, **kwargs)
    offset = dict(causal_offset=seqlen_k - seqlen_q) if causal else {}
    constants = {key: value.detach() if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach(), lse=lse, atol=1e-5, **offset,
                              **constants)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    assert_grads_close(grads, q, k, v, dout, **offset, **kwargs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", LENGTHS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", FEATURES)
def test_features_forward_and_backward_gpu(name, head_dim, seqlen_q, seqlen_k, causal):
    q, k, v = inputs(seqlen_q, seqlen_k, head_dim, hash((name, head_dim, seqlen_q, causal)) % 2**31, grad=True)
    check_features(q, k, v, name, causal)


# softcap, softcap_small and softcap_sinks run the forward's fixed max (SOFTCAP_BOUNDED), softcap_wide the running one.
HOPPER_FEATURES = ["softcap", "softcap_small", "softcap_sinks", "softcap_wide", "alibi", "alibi_batched", "sinks",
                   "all"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", LENGTHS + [(77, 300)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", HOPPER_FEATURES)
def test_hopper_kernels_with_score_features_gpu(name, head_dim, seqlen_q, seqlen_k, causal):
    """The Gluon forward and backward (sm_90) run softcap, ALiBi and sinks themselves."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are built for sm_90")
    q, k, v = inputs(seqlen_q, seqlen_k, head_dim, hash((name, head_dim, seqlen_k, causal, "hopper")) % 2**31, grad=True)
    explanation = fmha.explain(q, k, v, causal=causal, config=fmha.HopperSchedule(), **feature_kwargs(name))
    assert explanation.backend == "gluon_sm90" and explanation.backward.startswith("gluon_sm90"), str(explanation)
    check_features(q, k, v, name, causal, config=fmha.HopperSchedule())


# The shipped D = 136-256 schedule: 64-key blocks, P packed, the output leaving by halves through a
# 128-column staging tile (which also holds causal ALiBi's key-term operands in bf16).
HEAD_DIM_256_SCHEDULE = dict(block_n=64, pack_p=True)

# The shipped causal-ALiBi schedules (fmha/tuning/defaults/schedules.json): P crosses the key loop packed.
PACKED_P_SCHEDULES = {64: dict(q_buffers=2, emulated_exp2=8, pack_p=True), 128: dict(q_buffers=2, pack_p=True),
                      192: HEAD_DIM_256_SCHEDULE, 256: HEAD_DIM_256_SCHEDULE}


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(700, 900), (1500, 1500)])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("name", ["alibi", "all"])
def test_hopper_packed_p_schedules_with_causal_alibi_gpu(name, head_dim, seqlen_q, seqlen_k):
    """Causal ALiBi (its key term on the tensor cores where no softcap comes first, ``alibi``) and
    with every other feature (``all``)."""
    skip_off_hopper()
    q, k, v = inputs(seqlen_q, seqlen_k, head_dim, hash((name, head_dim, seqlen_k, "packed")) % 2**31, grad=True)
    check_features(q, k, v, name, True, config=fmha.HopperSchedule(**PACKED_P_SCHEDULES[head_dim]))


# The shipped causal D = 64 schedules from 4k rows with softcap or ALiBi: tiles taken from a counter,
# longest first, the last four (batch, head)s together (16 here).
@pytest.mark.parametrize("name", ["softcap", "alibi_batched", "all"])
def test_hopper_dynamic_packed_p_schedule_with_causal_features_gpu(name):
    skip_off_hopper()
    q, k, v = inputs(1500, 1700, 64, hash((name, "dynamic")) % 2**31, grad=True)
    check_features(q, k, v, name, True, config=fmha.HopperSchedule(q_buffers=2, emulated_exp2=8, pack_p=True,
                                                                    dynamic=True))


# HopperSchedule.row_sum_mma: the row sums from the tensor cores, on the shipped D = 64 fields and with P packed at 128.
ROW_SUM_MMA_SCHEDULES = {64: dict(q_buffers=2, emulated_exp2=8, row_sum_mma=True),
                         128: dict(q_buffers=2, pack_p=True, row_sum_mma=True)}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", HOPPER_FEATURES)
def test_hopper_row_sums_on_the_tensor_cores_with_score_features_gpu(name, head_dim, causal):
    """Softcap (its fixed max too), ALiBi and sinks with the row sums of P·ones: the sinks join the
    sum at the tile's end, the fixed max never rescales it."""
    skip_off_hopper()
    q, k, v = inputs(1500, 500, head_dim, hash((name, head_dim, causal, "row sums")) % 2**31, grad=True)
    check_features(q, k, v, name, causal, config=fmha.HopperSchedule(**ROW_SUM_MMA_SCHEDULES[head_dim]))


@pytest.mark.parametrize("name", ["all", "softcap_sinks"])  # softcap_sinks: the forward's fixed max
@pytest.mark.parametrize("window", [(255, 0), (100, 100)], ids=lambda window: f"left{window[0]}-right{window[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_features_with_windows_and_packed_sequences_gpu(head_dim, window, name):
    q, k, v = inputs(1200, 1200, head_dim, 3, grad=True)
    kwargs = feature_kwargs(name)
    out = fmha.attention(q, k, v, window=window, **kwargs)
    from fmha.masking import Window

    visible = Window.of(1200, 1200, left=window[0], right=window[1])
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach(), window=visible, atol=1e-5, **kwargs)
    dout = torch.randn_like(out)
    assert_grads_close(torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, window=visible, **kwargs)
    # packed: the same two sequences as one THD batch give the dense results
    packed = [t.detach().transpose(1, 2).reshape(-1, t.shape[1], head_dim) for t in (q, k, v)]
    cu = torch.tensor([0, 1200, 2400], dtype=torch.int32, device="cuda")
    out_packed = fmha.varlen_attention(*packed, cu, cu, 1200, 1200, window=window, **kwargs)
    torch.testing.assert_close(out_packed.view(2, 1200, Q_HEADS, head_dim).transpose(1, 2), out.detach(),
                               atol=2e-2, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_matches_float64_with_the_kernels_pattern_gpu(causal, head_dim):
    q, k, v = inputs(700, 900, head_dim, 5, grad=True)
    generator = torch.Generator(device="cuda").manual_seed(17)
    out = fmha.attention(q, k, v, causal=causal, dropout_p=0.15, generator=generator)
    generator.manual_seed(17)
    keep = dropout_keep_mask(ops.dropout_seed(generator, q.device), 2 * Q_HEADS * 700, 900, 0.15, seqlen_q=700)
    keep = keep.view(2, Q_HEADS, 700, 900)
    assert abs(keep.float().mean().item() - 0.85) < 0.002
    offset = dict(causal_offset=200) if causal else {}
    dropout = dict(dropout_p=kernel_dropout_p(0.15), keep=keep)
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach(), atol=1e-5, **dropout, **offset)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close(grads, q, k, v, dout, **dropout, **offset)


def skip_off_hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are built for sm_90")


@pytest.mark.parametrize("schedule", [{}, {"q_buffers": 2}, {"q_buffers": 2, "pingpong": 0},
                                      {"q_buffers": 2, "row_sum_mma": True}, {"q_buffers": 2, "pack_p": True},
                                      {"q_buffers": 2, "pack_p": True, "row_sum_mma": True},
                                      {"q_buffers": 2, "pack_p": True, "pingpong": 0},
                                      {"consumers": 3, "q_buffers": 2, "row_sum_mma": True}],
                         ids=["default", "two_q_buffers_shipped", "two_q_buffers_no_turns", "row_sums", "packed_p",
                              "packed_p_row_sums", "packed_p_no_turns", "three_consumers_row_sums"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(700, 900), (1500, 500)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_forward_drops_the_portable_pattern_gpu(head_dim, seqlen_q, seqlen_k, causal, schedule):
    """The Gluon kernels (sm_90) keep the portable kernels' pattern: float64 with that pattern, the
    Gluon backward's gradients after it, and the portable forward's output for the same generator
    state. (1500, 500) causal: rows that see no key, and rows whose only keys may all be dropped.
    With ``row_sum_mma`` the row sums (every probability) come from the tensor cores while P·V
    takes the kept ones; with ``pack_p`` (and three consumers) the dropped halves of packed words
    are cleared, as the block ends or (with ``row_sum_mma``) where P·V takes them."""
    skip_off_hopper()
    q, k, v = inputs(seqlen_q, seqlen_k, head_dim, hash(("dropout", head_dim, seqlen_q, causal)) % 2**31, grad=True)
    hopper = fmha.HopperSchedule(**schedule)
    if hopper.build_refusal(head_dim):
        pytest.skip(hopper.build_refusal(head_dim))
    explanation = fmha.explain(q, k, v, causal=causal, dropout_p=0.3, config=hopper)
    assert explanation.backend == "gluon_sm90" and explanation.backward.startswith("gluon_sm90"), str(explanation)
    generator = torch.Generator(device="cuda")
    generator.manual_seed(21)
    out, lse = fmha.attention(q, k, v, causal=causal, dropout_p=0.3, generator=generator, return_lse=True,
                              config=hopper)
    generator.manual_seed(21)
    keep = dropout_keep_mask(ops.dropout_seed(generator, q.device), 2 * Q_HEADS * seqlen_q, seqlen_k, 0.3,
                             seqlen_q=seqlen_q)
    keep = keep.view(2, Q_HEADS, seqlen_q, seqlen_k)
    offset = dict(causal_offset=seqlen_k - seqlen_q) if causal else {}
    dropout = dict(dropout_p=kernel_dropout_p(0.3), keep=keep)
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach(), lse=lse, atol=1e-5, **dropout,
                              **offset)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close(grads, q, k, v, dout, **dropout, **offset)
    generator.manual_seed(21)
    portable = fmha.attention(q.detach(), k.detach(), v.detach(), causal=causal, dropout_p=0.3, generator=generator,
                              config=fmha.ForwardConfig(64, 64, 4, 3))
    # Another pattern would move outputs by about the dropout's noise, sqrt(0.3 / 0.7 / Sk) · |v| ~ 0.02.
    torch.testing.assert_close(out.detach(), portable, atol=4e-3, rtol=1.6e-2)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_hopper_varlen_forward_drops_the_portable_pattern_gpu(head_dim):
    """Packed sequences on the Gluon forward and backward (the default paths): rows (head, packed
    token), each sequence's keys counted from its start, as the portable kernels number them."""
    skip_off_hopper()
    from fmha import dispatch
    from fmha.masking import Window
    from fmha.params import varlen_params

    lengths_q, lengths_k = [1100, 700, 1300], [1200, 700, 1500]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for lengths in (lengths_q, lengths_k))
    generator = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(sum(lengths_q), Q_HEADS, head_dim, device="cuda", generator=generator, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths_k), KV_HEADS, head_dim, device="cuda", generator=generator, dtype=torch.bfloat16)
            for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    lengths = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    params = varlen_params("test", q, k, v, *lengths, causal=True, dropout_p=0.3)
    assert dispatch.prepared_forward(params, q, k, v, cu_q, cu_k).explanation.backend == "gluon_sm90"
    hopper, reason = dispatch.hopper_backward(params, q, q, k, v, q, k, v)
    assert hopper is not None, reason
    generator.manual_seed(31)
    out, lse = fmha.varlen_attention(q, k, v, *lengths, causal=True, dropout_p=0.3, generator=generator,
                                     return_lse=True)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    generator.manual_seed(31)
    keep = dropout_keep_mask(ops.dropout_seed(generator, q.device), Q_HEADS * q.shape[0], k.shape[0], 0.3,
                             cu_seqlens_q=cu_q)
    keep = keep.view(Q_HEADS, q.shape[0], k.shape[0])
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        q_b, k_b, v_b, out_b, dout_b = (t[s].detach().transpose(0, 1)[None] for t, s in
                                        ((q, rows), (k, keys), (v, keys), (out, rows), (dout, rows)))
        dropout = dict(dropout_p=kernel_dropout_p(0.3), keep=keep[:, rows, :lengths_k[b]][None])
        window = Window.causal(lengths_k[b] - lengths_q[b])
        assert_close_to_reference(out_b, q_b, k_b, v_b, window=window, lse=lse[:, rows][None], atol=1e-5, **dropout)
        grads_b = [g[s].transpose(0, 1)[None] for g, s in ((dq, rows), (dk, keys), (dv, keys))]
        assert_grads_close(grads_b, q_b, k_b, v_b, dout_b, window=window, **dropout)


@pytest.mark.parametrize("head_dim", [160, 256])
def test_hopper_varlen_forward_with_causal_alibi_on_the_wide_tiles_gpu(head_dim):
    """Packed sequences with causal ALiBi at D 136-256: the key-term operands share the staging tile
    with the output's halves, and the sequences' last rows leave through it by plain stores."""
    skip_off_hopper()
    from fmha import dispatch
    from fmha.masking import Window
    from fmha.params import varlen_params

    lengths_q, lengths_k = [77, 1000, 300, 1], [300, 1000, 333, 5]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for lengths in (lengths_q, lengths_k))
    generator = torch.Generator(device="cuda").manual_seed(head_dim)
    q = torch.randn(sum(lengths_q), Q_HEADS, head_dim, device="cuda", generator=generator, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths_k), KV_HEADS, head_dim, device="cuda", generator=generator, dtype=torch.bfloat16)
            for _ in range(2))
    slopes = feature_kwargs("alibi")["alibi_slopes"]
    lengths = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    params = varlen_params("test", q, k, v, *lengths, causal=True, alibi_slopes=slopes)
    assert dispatch.prepared_forward(params, q, k, v, cu_q, cu_k).explanation.backend == "gluon_sm90"
    out, lse = fmha.varlen_attention(q, k, v, *lengths, causal=True, alibi_slopes=slopes, return_lse=True)
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        q_b, k_b, v_b, out_b = (t[s].transpose(0, 1)[None] for t, s in ((q, rows), (k, keys), (v, keys), (out, rows)))
        assert_close_to_reference(out_b, q_b, k_b, v_b, window=Window.causal(lengths_k[b] - lengths_q[b]),
                                  lse=lse[:, rows][None], atol=1e-5, alibi_slopes=slopes)


def test_dropout_is_reproducible_and_fresh_under_cuda_graphs_gpu():
    q, k, v = inputs(512, 512, 128, 9, grad=True)
    dout = torch.randn(2, Q_HEADS, 512, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for deterministic in (False, False, True, True):
        torch.manual_seed(4)
        out = fmha.attention(q, k, v, causal=True, dropout_p=0.2, deterministic=deterministic)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    # The default backward (Gluon on sm_90) adds dQ atomically: its dK and dV repeat bitwise, dQ
    # to rounding. deterministic=True repeats every gradient bitwise, with the same pattern.
    assert all(torch.equal(a, b) for a, b in zip(runs[0][:1] + runs[0][2:], runs[1][:1] + runs[1][2:]))
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=1e-2, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(runs[2], runs[3]))
    assert torch.equal(runs[0][0], runs[2][0])
    for default, deterministic in zip(runs[0][1:], runs[2][1:]):
        torch.testing.assert_close(default, deterministic, atol=2e-2, rtol=2e-2)
    # A captured call draws a fresh philox key on the device at each replay.
    static = [t.detach().clone() for t in (q, k, v)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up: compile and prepare outside the capture
            fmha.attention(*static, dropout_p=0.2)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fmha.attention(*static, dropout_p=0.2)
    graph.replay()
    first = captured.clone()
    graph.replay()
    assert torch.isfinite(first).all() and not torch.equal(first, captured)
    plain = fmha.attention(*static)
    assert (first.float().mean() - plain.float().mean()).abs() < 0.05


def test_compiled_block_with_features_matches_eager_gpu():
    torch._dynamo.reset()
    sinks = torch.zeros(Q_HEADS, device="cuda", requires_grad=True)
    slopes = feature_kwargs("alibi")["alibi_slopes"]

    def block(q, k, v):
        out = fmha.attention(q, k, v, causal=True, softcap=30.0, alibi_slopes=slopes, sinks=sinks)
        return out.float().square().mean()

    q, k, v = inputs(300, 300, 64, 2, grad=True)
    compiled = torch.compile(block, fullgraph=True)
    grads = torch.autograd.grad(compiled(q, k, v), (q, k, v, sinks))
    eager = torch.autograd.grad(block(q, k, v), (q, k, v, sinks))
    for got, expected in zip(grads, eager):
        torch.testing.assert_close(got, expected)
    dropped = torch.compile(lambda q, k, v: fmha.attention(q, k, v, dropout_p=0.3), fullgraph=True)
    torch.manual_seed(1)
    first = dropped(q, k, v)
    torch.manual_seed(1)
    assert torch.equal(first, dropped(q, k, v))


MASKS = ["bool", "float", "padding_stride0", "bool_per_head_transposed"]


def sdpa_mask(name, batch, heads, seqlen_q, seqlen_k, dtype):
    generator = torch.Generator(device="cuda").manual_seed(1)
    dense = torch.rand(batch, heads, seqlen_q, seqlen_k, device="cuda", generator=generator)
    if name == "bool":
        return dense > 0.2
    if name == "float":
        return ((dense - 0.5) * 8).to(dtype)
    if name == "padding_stride0":  # the Hugging Face padding mask: (B, 1, 1, S) expanded
        lengths = torch.tensor([seqlen_k, seqlen_k // 3], device="cuda")
        keep = torch.arange(seqlen_k, device="cuda")[None, :] < lengths[:, None]
        return keep[:, None, None, :].expand(batch, heads, seqlen_q, seqlen_k)
    if name == "bool_hidden_rows":  # every seventh row sees nothing: zeros
        mask = dense > 0.2
        mask[:, :, ::7] = False
        return mask
    if name in ("float32", "bfloat16"):  # with -inf entries
        bias = (dense - 0.5) * 8
        bias[..., ::5] = float("-inf")
        return bias.to(getattr(torch, name))
    if name == "shared_2d":  # (L, S): one mask for every batch and head
        return dense[0, 0] > 0.5
    return (dense[0] > 0.5).transpose(-1, -2).contiguous().transpose(-1, -2)  # (H, L, S), column-major


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", MASKS)
def test_attn_mask_against_float64_and_torch_gpu(name, head_dim):
    q, k, v = inputs(777, 1025, head_dim, 6, grad=True)
    k, v = (t.detach().repeat_interleave(Q_HEADS // KV_HEADS, dim=1).requires_grad_() for t in (k, v))
    mask = sdpa_mask(name, 2, Q_HEADS, 777, 1025, q.dtype)
    out = fmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach(), atol=1e-5, attn_mask=mask)
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                  attn_mask=mask.float() if mask.is_floating_point() else mask)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=0)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close(grads, q, k, v, dout, attn_mask=mask)


HOPPER_MASKS = ["bool", "bool_hidden_rows", "float32", "bfloat16", "padding_stride0", "shared_2d",
                "bool_per_head_transposed"]


@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(777, 1025), (1024, 2048), (129, 190)])
@pytest.mark.parametrize("name", HOPPER_MASKS)
def test_attn_mask_on_the_hopper_forward_gpu(name, seqlen_q, seqlen_k, head_dim, block_n):
    """The Gluon forward with each mask form: pairs of keys read at once (even Sk, aligned rows),
    one at a time (odd Sk), strided keys (the transposed mask); both key-block widths."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward runs on sm_90")
    from fmha.params import attention_params, sdpa_attn_mask

    q, k, v = inputs(seqlen_q, seqlen_k, head_dim, 7)
    k, v = (t.repeat_interleave(Q_HEADS // KV_HEADS, dim=1) for t in (k, v))
    mask = sdpa_mask(name, 2, Q_HEADS, seqlen_q, seqlen_k, q.dtype)
    view, kind = sdpa_attn_mask("t", mask, q.shape, seqlen_k, q.shape, q.dtype, q.device)
    schedule = fmha.HopperSchedule(block_n=block_n, stages=3 if block_n == 64 else 2, q_buffers=2)
    params = attention_params("t", q, k, v, top_left=True, attn_mask_kind=kind, config=schedule)
    out, lse = ops.forward(q, k, v, params, ops.score_tensors(None, None, view, None))
    assert_close_to_reference(out, q, k, v, lse=lse, atol=1e-5, attn_mask=mask)


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(777, 1025), (1100, 300)])
@pytest.mark.parametrize("name", HOPPER_MASKS)
def test_attn_mask_on_the_hopper_backward_gpu(name, seqlen_q, seqlen_k, head_dim):
    """The Gluon backward with each mask form (its [keys, rows] tiles read with 32-bit offsets):
    dQ, dK and dV against float64, and the Gluon backward is the one that ran."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are built for sm_90")
    from fmha import dispatch
    from fmha.params import attention_params, sdpa_attn_mask

    q, k, v = inputs(seqlen_q, seqlen_k, head_dim, 9)
    k, v = (t.repeat_interleave(Q_HEADS // KV_HEADS, dim=1) for t in (k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = sdpa_mask(name, 2, Q_HEADS, seqlen_q, seqlen_k, q.dtype)
    view, kind = sdpa_attn_mask("t", mask, q.shape, seqlen_k, q.shape, q.dtype, q.device)
    params = attention_params("t", q, k, v, top_left=True, attn_mask_kind=kind)
    hopper, reason = dispatch.hopper_backward(params, q, q, k, v, q, k, v, attn_mask=view)
    assert hopper is not None, reason
    out = fmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close(grads, q, k, v, dout, attn_mask=mask)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [2.0, 50.0, 52.0, 60.0])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_softcap_with_saturated_rows_gpu(head_dim, softcap, causal):
    """Rows whose scores all sit near -softcap or near +softcap: the forward's fixed max below the
    softcap's bound (up to softcap 52 in bf16, SOFTCAP_BOUNDED) keeps both kinds exact, and so does
    the running max above it."""
    skip_off_hopper()
    q, k, v = inputs(512, 700, head_dim, 11)
    generator = torch.Generator(device="cuda").manual_seed(12)
    direction = torch.randn(head_dim, device="cuda", generator=generator)
    direction = direction / direction.norm() * 4 * head_dim ** 0.5  # q·k·scale about ±16·sqrt(D)
    sign = torch.where(torch.arange(512, device="cuda") % 3 == 0, -1.0, 1.0)
    q = (q.float() + sign[:, None] * direction).to(q.dtype)
    k = (k.float() + direction).to(k.dtype)
    sinks = torch.randn(Q_HEADS, device="cuda", generator=generator)
    for extra in ({}, dict(sinks=sinks)):
        kwargs = dict(causal=causal, softcap=softcap, config=fmha.HopperSchedule(), **extra)
        explanation = fmha.explain(q, k, v, **kwargs)
        assert explanation.backend == "gluon_sm90", str(explanation)
        out, lse = fmha.attention(q, k, v, return_lse=True, **kwargs)
        offset = dict(causal_offset=700 - 512) if causal else {}
        assert_close_to_reference(out, q, k, v, lse=lse, atol=1e-5, softcap=softcap, **offset, **extra)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", HOPPER_FEATURES + ["dropout"])
def test_hopper_forward_at_head_dim_256_with_score_features_gpu(name, causal):
    """D = 256 runs the Gluon forward and the 256-wide tiles' Gluon backward with every score
    feature (dropout with the portable kernels' pattern, drawn again in the backward). Sq > Sk
    causal: rows that see no key, and rows whose only keys may all be dropped."""
    skip_off_hopper()
    seqlen_q, seqlen_k = (1500, 500) if causal else (700, 900)
    q, k, v = inputs(seqlen_q, seqlen_k, 256, hash((name, causal, "d256")) % 2**31, grad=True)
    hopper = fmha.HopperSchedule(**HEAD_DIM_256_SCHEDULE)
    kwargs = dict(dropout_p=0.3) if name == "dropout" else feature_kwargs(name)
    explanation = fmha.explain(q, k, v, causal=causal, config=hopper, **kwargs)
    assert explanation.backend == "gluon_sm90" and explanation.backward.startswith("gluon_sm90"), str(explanation)
    if name != "dropout":
        check_features(q, k, v, name, causal, config=hopper)
        return
    generator = torch.Generator(device="cuda").manual_seed(21)
    out, lse = fmha.attention(q, k, v, causal=causal, dropout_p=0.3, generator=generator, return_lse=True,
                              config=hopper)
    generator.manual_seed(21)
    keep = dropout_keep_mask(ops.dropout_seed(generator, q.device), 2 * Q_HEADS * seqlen_q, seqlen_k, 0.3,
                             seqlen_q=seqlen_q).view(2, Q_HEADS, seqlen_q, seqlen_k)
    offset = dict(causal_offset=seqlen_k - seqlen_q) if causal else {}
    dropout = dict(dropout_p=kernel_dropout_p(0.3), keep=keep)
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach(), lse=lse, atol=1e-5, **dropout,
                              **offset)
    dout = torch.randn_like(out)
    assert_grads_close(torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, **dropout, **offset)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", LENGTHS + [(77, 300)])
@pytest.mark.parametrize("head_dim", [160, 256])
@pytest.mark.parametrize("name", HOPPER_FEATURES)
def test_wide_backward_with_score_features_gpu(name, head_dim, seqlen_q, seqlen_k, causal):
    """Softcap, ALiBi and sinks on the 256-wide tiles (D 136-256), forward and backward, the sinks'
    gradient too, at the shipped D = 256 schedule."""
    skip_off_hopper()
    q, k, v = inputs(seqlen_q, seqlen_k, head_dim, hash((name, head_dim, seqlen_k, causal, "wide")) % 2**31, grad=True)
    hopper = fmha.HopperSchedule(**HEAD_DIM_256_SCHEDULE)
    explanation = fmha.explain(q, k, v, causal=causal, config=hopper, **feature_kwargs(name))
    assert explanation.backend == "gluon_sm90" and explanation.backward.startswith("gluon_sm90"), str(explanation)
    check_features(q, k, v, name, causal, config=hopper)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mask_shape, gqa", [((2, 4, 300, 700), False), ((300, 700), True), ((2, 1, 1, 700), False),
                                             ((1, 4, 300, 1), True)], ids=lambda x: "x".join(map(str, x))
                         if isinstance(x, tuple) else str(x))
def test_attn_mask_gradient_gpu(dtype, mask_shape, gqa):
    """SDPA's float attn_mask that requires grad: its gradient from the portable backward (the Gluon
    one leaves it there), against float64 (tests/test_sdpa.py's rule)."""
    from .test_sdpa import check_attn_mask_gradient

    check_attn_mask_gradient(dtype, mask_shape, gqa, device="cuda", lengths=(300, 700), head_dim=64)
