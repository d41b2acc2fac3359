"""Counters that a kernel leaves zeroed for the next launch (``fmha.runtime.StreamCounters``), on
the GPU (marker ``gpu``): the Gluon forward's tile counter (windows draw their tiles from it) and the
split KV-cache decode's arrival counts. One buffer serves each stream, so calls on one stream, calls
on two streams at once, and a CUDA graph replayed beside eager calls must each give what the call
gives alone, bit for bit.
"""

import pytest
import torch

import fmha
from fmha.testing import random_kvcache

pytestmark = pytest.mark.gpu

ROUNDS = 8


def _window_inputs(seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(1, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
            for _ in range(3)]


def _window_call(inputs):
    return fmha.attention(*inputs, causal=True, window=(1023, 0))


def _kvcache_inputs(seed):
    """B1 H32/8 over 8,000 cached keys: the heuristic splits them, and the chunks count arrivals."""
    return random_kvcache(1, 1, 32, 8, 128, 8192, new_keys=0, dtype=torch.bfloat16, device="cuda",
                          lengths=[8000], seed=seed)


def _kvcache_call(case):
    return fmha.flash_attn_with_kvcache(**case, causal=True)


CALLS = {"window": (_window_inputs, _window_call), "kvcache": (_kvcache_inputs, _kvcache_call)}


@pytest.mark.parametrize("name", list(CALLS))
def test_calls_on_one_stream_and_on_two_equal_each_alone_gpu(name):
    make, call = CALLS[name]
    inputs = [make(seed) for seed in (0, 1)]
    alone = []
    for each in inputs:
        alone.append(call(each))
        torch.cuda.synchronize()
    back_to_back = [call(inputs[i % 2]) for i in range(ROUNDS)]
    streams = [torch.cuda.Stream() for _ in inputs]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    concurrent = [[], []]
    for _ in range(ROUNDS // 2):
        for index, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                concurrent[index].append(call(inputs[index]))
    torch.cuda.synchronize()
    for i, out in enumerate(back_to_back):
        assert torch.equal(out, alone[i % 2]), f"call {i} on one stream differs from the call alone"
    for index, outs in enumerate(concurrent):
        for i, out in enumerate(outs):
            assert torch.equal(out, alone[index]), f"call {i} on stream {index} differs from the call alone"


@pytest.mark.parametrize("name", list(CALLS))
def test_graph_replays_beside_eager_calls_equal_each_alone_gpu(name):
    make, call = CALLS[name]
    captured_inputs, eager_inputs = make(2), make(3)
    eager_alone = call(eager_inputs)
    call(captured_inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(captured_inputs)
    graph.replay()
    torch.cuda.synchronize()
    captured_alone = captured.clone()
    replay_stream = torch.cuda.Stream()
    replay_stream.wait_stream(torch.cuda.current_stream())
    eager = []
    for _ in range(ROUNDS // 2):
        with torch.cuda.stream(replay_stream):
            graph.replay()
        eager.append(call(eager_inputs))
    torch.cuda.synchronize()
    assert torch.equal(captured, captured_alone)
    for i, out in enumerate(eager):
        assert torch.equal(out, eager_alone), f"eager call {i} beside the replays differs from the call alone"
