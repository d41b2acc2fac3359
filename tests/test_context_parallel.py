"""PyTorch's context parallelism over fmha: two CPU processes (gloo), kernels through the interpreter.

Each rank holds its shard of the sequence; PyTorch's ring (``torch.distributed.tensor.experimental``)
passes K/V between the ranks and calls ``aten::_scaled_dot_product_flash_attention`` per chunk,
which FMHA's activation routes to fmha. The unsharded output and gradients must meet the error
rule against float64, like a single-process call, and agree with fmha in one process.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fmha.integrations import sdpa

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.skipif(not sdpa.available(), reason=f"the flash-attention registry needs {sdpa.REQUIREMENT}"),
]

WORLD = 2
# (dtype, batch, q heads, kv heads, sequence length, head dim, causal, K/V rotation)
CASES = [
    (torch.float32, 1, 2, 2, 32, 16, True, "allgather"),
    (torch.float16, 2, 2, 2, 24, 16, False, "allgather"),
    (torch.float32, 1, 4, 2, 40, 24, True, "alltoall"),   # GQA: K/V with fewer heads go round the ring
    (torch.float16, 1, 2, 1, 16, 32, False, "alltoall"),  # MQA
]


def run_cases(rank, store_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    import fmha
    from fmha import distributed

    from .helpers import assert_close_to_reference, assert_grads_close, random_qkv

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        sdpa.activate(strict=True)
        for dtype, batch, q_heads, kv_heads, seqlen, head_dim, causal, rotation in CASES:
            set_rotate_method(rotation)
            generator = torch.Generator().manual_seed(seqlen)
            q, k, v = random_qkv(batch, q_heads, kv_heads, seqlen, seqlen, head_dim, dtype, generator=generator)
            dout = torch.randn(q.shape, dtype=dtype, generator=generator)
            shards = [t.clone() for t in (q, k, v, dout)]
            with distributed.context_parallel(mesh, causal=causal, buffers=shards, buffer_seq_dims=[2] * 4):
                leaves = [t.detach().requires_grad_() for t in shards[:3]]
                out = distributed.attention(*leaves, mesh, is_causal=causal)
                assert out.shape == leaves[0].shape and out.shape[2] == seqlen // WORLD
                out.backward(shards[3])
            full_out, *grads = distributed.unshard(mesh, [out.detach()] + [t.grad for t in leaves], [2] * 4,
                                                   causal=causal)
            offset = 0 if causal else None
            case = f"rank {rank}, case {dtype, batch, q_heads, kv_heads, seqlen, head_dim, causal, rotation}"
            assert_close_to_reference(full_out, q, k, v, causal_offset=offset)
            assert_grads_close(grads, q, k, v, dout, causal_offset=offset)
            single = [t.detach().requires_grad_() for t in (q, k, v)]
            single_out = fmha.attention(*single, causal=causal)
            single_grads = torch.autograd.grad(single_out, single, dout)
            tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(full_out, single_out, **tolerance, msg=lambda m: f"{case}: {m}")
            for grad, single_grad in zip(grads, single_grads):
                torch.testing.assert_close(grad, single_grad, **tolerance, msg=lambda m: f"{case}: {m}")
    finally:
        sdpa.deactivate()
        dist.destroy_process_group()


def test_context_parallel_over_two_gloo_ranks_matches_one_process(tmp_path):
    mp.spawn(run_cases, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True)
