"""Calls whose kernels launch as a chain (programmatic dependent launch on sm_90: each kernel may
start before the one before it has finished, and waits for it before touching memory), on the GPU
(marker ``gpu``): the packed forward and backward (the tile list, the rows pass, the backward
kernel, dQ's conversion) and the split-KV decode (chunks, then the combine).

Calls alternate between two inputs with no synchronisation between them, so a kernel that read
before its predecessor had written would see the other call's data: every result must equal,
bit for bit, the same call run alone. The same calls captured in a CUDA graph replay with new
inputs as they run eagerly.
"""

import itertools

import pytest
import torch

import fmha

pytestmark = pytest.mark.gpu

# Two packings of the same tokens into the same number of sequences, with empty and one-token ones.
PACKINGS = ([862, 1654, 712, 359, 1799, 0, 1, 613], [100, 2000, 33, 1000, 1999, 600, 268, 0])
HEADS, HEAD_DIM = 8, 128


def _cu_seqlens(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


def _packed_inputs(seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(PACKINGS[0])
    q, k, v, dout = (torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
                     for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], dout


def _packed_step(inputs, dout, cu_seqlens, longest):
    q, k, v = inputs
    out = fmha.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal=True,
                                      deterministic=True)
    return (out, *torch.autograd.grad(out, inputs, dout))


def test_packed_calls_back_to_back_equal_each_alone_gpu():
    inputs, dout = _packed_inputs(0)
    cus = [_cu_seqlens(lengths) for lengths in PACKINGS]
    longest = max(max(lengths) for lengths in PACKINGS)
    alone = []
    for cu in cus:
        alone.append(_packed_step(inputs, dout, cu, longest))
        torch.cuda.synchronize()
    results = [_packed_step(inputs, dout, cus[i % 2], longest) for i in range(12)]
    torch.cuda.synchronize()
    for i, result in enumerate(results):
        for got, expected, name in zip(result, alone[i % 2], ("out", "dq", "dk", "dv")):
            assert torch.equal(got, expected), f"call {i}: {name} differs from the call run alone"


def test_packed_calls_in_a_cuda_graph_equal_eager_gpu():
    inputs, dout = _packed_inputs(1)
    cu = _cu_seqlens(PACKINGS[0])
    longest = max(max(lengths) for lengths in PACKINGS)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        _packed_step(inputs, dout, cu, longest)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _packed_step(inputs, dout, cu, longest)
    for lengths in (PACKINGS[1], PACKINGS[0]):
        cu.copy_(_cu_seqlens(lengths))
        graph.replay()
        eager = _packed_step(inputs, dout, _cu_seqlens(lengths), longest)
        for got, expected, name in zip(captured, eager, ("out", "dq", "dk", "dv")):
            assert torch.equal(got, expected), f"{lengths}: {name} of the replay differs from eager"


def _decode_inputs(seed, batch=1, q_heads=32, kv_heads=8, seqlen_k=4096):
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=generator)

    return randn(batch, q_heads, 1, HEAD_DIM), randn(batch, kv_heads, seqlen_k, HEAD_DIM), \
        randn(batch, kv_heads, seqlen_k, HEAD_DIM)


@pytest.mark.parametrize("batch, q_heads, seqlen_k", [(1, 32, 4096), (1, 64, 8192), (4, 32, 8192)])
def test_split_kv_calls_back_to_back_equal_each_alone_gpu(batch, q_heads, seqlen_k):
    calls = [_decode_inputs(seed, batch, q_heads, 8, seqlen_k) for seed in (2, 3)]
    alone = []
    for q, k, v in calls:
        alone.append(fmha.attention(q, k, v, return_lse=True))
        torch.cuda.synchronize()
    results = [fmha.attention(*calls[i % 2], return_lse=True) for i in range(12)]
    torch.cuda.synchronize()
    for i, (out, lse) in enumerate(results):
        assert torch.equal(out, alone[i % 2][0]), f"call {i}: the output differs from the call run alone"
        assert torch.equal(lse, alone[i % 2][1]), f"call {i}: the LSE differs from the call run alone"


def test_split_kv_call_in_a_cuda_graph_equals_eager_gpu():
    q, k, v = _decode_inputs(4)
    fmha.attention(q, k, v)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fmha.attention(q, k, v)
    for seed in (5, 6):
        new_q, new_k, new_v = _decode_inputs(seed)
        q.copy_(new_q), k.copy_(new_k), v.copy_(new_v)
        graph.replay()
        assert torch.equal(captured, fmha.attention(new_q, new_k, new_v))
