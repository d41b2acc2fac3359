"""Providers: every attention implementation the benchmark can time, behind one signature.

A provider is ``make(case, q, k, v) -> fn`` where ``fn()`` runs the attention once on
BHSD tensors prepared outside the timed region. ``make`` raises
:class:`PeerUnavailable` when the peer cannot run this case on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import fmha

from .cases import Case


class PeerUnavailable(Exception):
    """The peer is missing, or does not support this case."""


@dataclass(frozen=True)
class Peer:
    name: str
    description: str
    make: Callable[[Case, torch.Tensor, torch.Tensor, torch.Tensor], Callable[[], torch.Tensor]]


def _fmha_fused(case, q, k, v):
    return lambda: fmha.attention(q, k, v, causal=case.causal)


def _fmha_naive(case, q, k, v):
    needed = case.batch * case.q_heads * case.seqlen_q * case.seqlen_k * (4 + q.element_size())
    free, _ = torch.cuda.mem_get_info(q.device)
    if needed > 0.8 * free:
        raise PeerUnavailable(f"needs {needed / 2**30:.1f} GiB for S and P, {free / 2**30:.1f} GiB free")
    return lambda: fmha.naive_attention(q, k, v, causal=case.causal)


def _sdpa(backend_name: str):
    def make(case, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        if case.causal and case.seqlen_q != case.seqlen_k:
            raise PeerUnavailable("SDPA's is_causal is top-left; fmha's causal is bottom-right")
        backend = getattr(SDPBackend, backend_name)
        gqa = case.q_heads != case.kv_heads

        def run():
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=gqa)

        try:
            run()
        except RuntimeError as error:  # the backend refuses this shape/dtype/GPU
            raise PeerUnavailable(str(error).splitlines()[0][:120]) from None
        return run

    return make


PEERS: dict[str, Peer] = {
    peer.name: peer
    for peer in (
        Peer("fmha", "fmha fused forward (step 3)", _fmha_fused),
        Peer("naive", "fmha materialising baseline (step 2)", _fmha_naive),
        Peer("sdpa_flash", "SDPA FLASH_ATTENTION (FlashAttention-2)", _sdpa("FLASH_ATTENTION")),
        Peer("sdpa_cudnn", "SDPA CUDNN_ATTENTION", _sdpa("CUDNN_ATTENTION")),
        Peer("sdpa_efficient", "SDPA EFFICIENT_ATTENTION (xformers kernels)", _sdpa("EFFICIENT_ATTENTION")),
    )
}
