"""Context parallelism on PyTorch's engine, with fmha computing every chunk.

PyTorch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``) shards
the sequence over a device mesh, passes K/V between the ranks (all-gather, or all-to-all after
``set_rotate_method("alltoall")``), and merges the chunks' outputs through their LSE. Each chunk is
one call of ``aten::_scaled_dot_product_flash_attention`` (and its backward), so with FMHA
activated (:mod:`fmha.integrations.sdpa`) every chunk runs on fmha. On GPUs, torch's own recipe
is all it takes::

    fmha.integrations.sdpa.activate()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), fmha.distributed.context_parallel(
            mesh, causal=True, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)    # q, k, v: this rank's shard
        out.backward(dout)

This package holds the glue that recipe lacks:

* :func:`context_parallel`: torch's context manager with its load balancing set from ``causal``.
  PyTorch balances by default (rank r holds chunks r and 2W-1-r of 2W) and then refuses
  non-causal attention ("Load balancing requires is_causal=True").
* :func:`unshard`: the full sequence back from every rank's shard, undoing that same balancing
  (torch's ``context_parallel_unshard`` reads a global flag that the context has reset by then).
* :func:`attention`: PyTorch's context-parallel attention on this rank's shards, called as the
  flash operator itself. ``F.scaled_dot_product_attention`` reaches that operator only on CUDA
  tensors under the flash backend; on CPU tensors SDPA's flash backend is another operator
  (``_scaled_dot_product_flash_attention_for_cpu``) that context parallelism does not handle
  (DTensor: "does not have a sharding strategy registered"). Through this function the same ring
  runs on the CPU (gloo, ``TRITON_INTERPRET=1``) and on GPUs whatever SDPA would pick.

What PyTorch's context parallelism does not do, so neither does this:

* Sliding windows: the SDPA flash operator has no window arguments.
* Packed sequences (varlen, ``cu_seqlens``): only dense SDPA operators are sharded.
* ``is_causal`` with Sq != Sk ("is_causal requires the same query and context sequence lengths"),
  and sequence lengths not divisible by twice the number of ranks under load balancing.
* Dropout: the dropout probability reaches each chunk through torch's flash-attention operator,
  which fmha's registry refuses with dropout (its key is not torch's seed and offset).

GQA works: K/V with fewer heads travel around the ring as they are.
Checked with torch 2.11 and 2.13: these internals (``_cp_options``, ``_HeadTailLoadBalancer``)
are private and may move.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import _attention as torch_cp

_SEQ_DIM = 2  # PyTorch's context parallelism shards dim 2: (B, H, S, D)


@contextlib.contextmanager
def _load_balancing(enabled: bool):
    options = torch_cp._cp_options
    previous = options.enable_load_balance
    options.enable_load_balance = enabled
    try:
        yield
    finally:
        options.enable_load_balance = previous


@contextlib.contextmanager
def context_parallel(mesh, *, causal: bool, buffers, buffer_seq_dims, no_restore_buffers=None):
    """PyTorch's ``context_parallel`` with load balancing on for causal attention, off otherwise.

    Shards ``buffers`` (at least one: torch reads the sequence length from the first) in place
    along ``buffer_seq_dims``, restored on exit unless named in ``no_restore_buffers``, and routes
    SDPA and :func:`attention` through PyTorch's ring. Causal load balancing needs the sequence
    length divisible by twice the mesh size.
    """
    with _load_balancing(causal), torch_cp.context_parallel(
            mesh, buffers=list(buffers), buffer_seq_dims=list(buffer_seq_dims), no_restore_buffers=no_restore_buffers):
        yield


def unshard(mesh, shards, seq_dims, *, causal: bool) -> list[torch.Tensor]:
    """The full tensors from every rank's shard, in sequence order (a collective: every rank calls it)."""
    shards = list(shards)
    load_balancer = None
    if causal:
        seqlen = shards[0].shape[seq_dims[0]] * mesh.size()
        load_balancer = torch_cp._HeadTailLoadBalancer(seqlen, mesh.size(), shards[0].device)
    with _load_balancing(causal):
        return torch_cp.context_parallel_unshard(mesh, shards, list(seq_dims), load_balancer=load_balancer)


def attention(query, key, value, mesh, *, is_causal: bool = False, scale: float | None = None):
    """Attention of this rank's query shard against the whole sequence, through PyTorch's ring.

    query (B, Hq, S/W, D), key and value (B, Hkv, S/W, D): this rank's shards from
    :func:`context_parallel`. Call it (and its backward) inside :func:`context_parallel` with the
    same ``causal``. Returns this rank's output shard; differentiable in query, key and value.
    """
    placements = [Shard(_SEQ_DIM)]
    q, k, v = (DTensor.from_local(t, mesh, placements, run_check=False) for t in (query, key, value))
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=is_causal, scale=scale)[0]
    return out.to_local()
