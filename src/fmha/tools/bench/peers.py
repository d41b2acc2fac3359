"""Providers: every attention implementation the benchmark can time, behind one signature.

A provider's ``prepare(case, q, k, v)`` takes BHSD inputs and returns a :class:`Prepared`:
``run()`` computes the attention once, reading ``inputs``. Layout changes (BSHD copies for
the FlashAttention packages) happen in ``prepare``, outside the timed region, and gradients
are taken with respect to ``inputs``. ``prepare`` raises :class:`PeerUnavailable` when the
peer is missing or does not support the case; the benchmark records why and goes on.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

import fmha

from .cases import Case

# SDPA's MATH backend materialises S and P in the input dtype and in fp32: small shapes only.
MATH_MAX_SCORES = 1 << 27


class PeerUnavailable(Exception):
    """The peer is missing, or does not support this case."""


@dataclass(frozen=True)
class Prepared:
    run: Callable[[], torch.Tensor]
    inputs: tuple[torch.Tensor, ...]
    kernel: dict | None = None  # fmha's rows: backend, config, config_source (and the backward's config)


@dataclass(frozen=True)
class Peer:
    name: str
    description: str
    prepare: Callable[[Case, torch.Tensor, torch.Tensor, torch.Tensor], Prepared]
    is_fmha: bool = False


def _scores(case: Case) -> int:
    return case.batch * case.q_heads * case.seqlen_q * case.seqlen_k


def config_text(config) -> str:
    """A kernel choice as one short string: ``128×64 w8 s3`` or ``HopperSchedule(...)``."""
    if config is None:
        return "—"
    if hasattr(config, "text"):
        return config.text()
    return f"{config.block_m}×{config.block_n} w{config.num_warps} s{config.num_stages}"


def _kernel(backend: str, config, source: str, explanation=None, case: Case | None = None) -> dict:
    """What an fmha row runs: the backend, its config and where that config came from."""
    kernel = {"backend": backend, "config": config_text(config), "config_source": source}
    if case is not None and case.mode != "fwd" and explanation is not None and explanation.backward:
        kernel["backward"] = explanation.backward
    return kernel


def _fmha_default(case, q, k, v):
    """The headline: exactly what ``fmha.attention(q, k, v, causal=...)`` runs for this call."""
    explanation = fmha.explain(q, k, v, causal=case.causal)
    return Prepared(lambda: fmha.attention(q, k, v, causal=case.causal), (q, k, v),
                    _kernel(explanation.backend, explanation.config, explanation.source, explanation, case))


def _triton_heuristic(case, q, k, v):
    """Step 3: the portable Triton kernel with the heuristic tiles, whatever has been tuned."""
    from fmha.backends.triton.config import heuristic_forward_config

    config = heuristic_forward_config(case.head_dim, q.dtype, case.seqlen_q)
    explanation = fmha.explain(q, k, v, causal=case.causal, config=config)
    return Prepared(lambda: fmha.attention(q, k, v, causal=case.causal, config=config), (q, k, v),
                    _kernel("triton", config, "heuristic", explanation, case))


def _triton_tuned(case, q, k, v):
    """Step 4: the portable Triton kernel with the tiles the tuning data picks for this call (the
    ``fmha tune`` cache or the shipped defaults, never a search), narrowed as the default path narrows them."""
    from fmha.params import attention_params
    from fmha.runtime import INTERPRETED
    from fmha.tuning.lookup import portable_config

    if INTERPRETED:
        raise PeerUnavailable("Triton's interpreter does not autotune; row fmha shows what fmha.attention runs there")
    config, source = portable_config(attention_params("fmha bench", q, k, v, causal=case.causal), autotune=False)
    if source.startswith("heuristic"):
        raise PeerUnavailable("not tuned: no tuned tiles for this GPU and key (`fmha tune` stores them)")
    explanation = fmha.explain(q, k, v, causal=case.causal, config=config)
    return Prepared(lambda: fmha.attention(q, k, v, causal=case.causal, config=config), (q, k, v),
                    _kernel("triton", config, source, explanation, case))


def _naive(case, q, k, v):
    """Step 2: three kernels with S and P in global memory."""
    if case.mode != "fwd":
        raise PeerUnavailable("the naive baseline is forward only")
    if q.is_cuda:
        needed = _scores(case) * (4 + q.element_size())
        free, _ = torch.cuda.mem_get_info(q.device)
        if needed > 0.8 * free:
            raise PeerUnavailable(f"needs {needed / 2**30:.1f} GiB for S and P, {free / 2**30:.1f} GiB free")
    return Prepared(lambda: fmha.naive_attention(q, k, v, causal=case.causal), (q, k, v),
                    _kernel("naive", None, "no config: S and P materialised"))


def _sdpa(backend_name: str):
    def prepare(case, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        if case.causal and case.seqlen_q != case.seqlen_k:
            raise PeerUnavailable("SDPA's is_causal is top-left; fmha's causal is bottom-right")
        if backend_name == "MATH" and _scores(case) > MATH_MAX_SCORES:
            raise PeerUnavailable(f"small shapes only (B·H·Sq·Sk ≤ {MATH_MAX_SCORES:,})")
        backend = getattr(SDPBackend, backend_name)
        gqa = case.q_heads != case.kv_heads

        def run():
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=gqa)

        try:
            with torch.no_grad():
                run()
        except RuntimeError as error:  # the backend refuses this shape, dtype or GPU
            raise PeerUnavailable(str(error).splitlines()[0][:160]) from None
        return Prepared(run, (q, k, v))

    return prepare


_compiled_flex = None


def _flex(case, q, k, v):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as error:
        raise PeerUnavailable(f"flex_attention not importable: {error}") from None
    global _compiled_flex
    if _compiled_flex is None:
        import torch._dynamo

        # One compile per shape: every case is a new static shape.
        for limit in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 1024))
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if case.causal:
        offset = case.seqlen_k - case.seqlen_q  # bottom-right, like fmha

        def bottom_right_causal(batch, head, q_index, kv_index):
            return kv_index <= q_index + offset

        block_mask = create_block_mask(bottom_right_causal, None, None, case.seqlen_q, case.seqlen_k,
                                       device=q.device)
    gqa = case.q_heads != case.kv_heads
    return Prepared(lambda: _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=gqa), (q, k, v))


def _flash_attn_package(module_name: str, function_name: str = "flash_attn_func"):
    """FlashAttention's packages take BSHD tensors; the copies are made here, untimed."""

    def prepare(case, q, k, v):
        try:
            function = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as error:
            raise PeerUnavailable(f"{module_name} not installed ({type(error).__name__})") from None
        inputs = tuple(t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad) for t in (q, k, v))

        def run():
            out = function(*inputs, causal=case.causal)
            return out[0] if isinstance(out, tuple) else out

        try:
            with torch.no_grad():
                run()
        except (RuntimeError, TypeError, ValueError) as error:
            raise PeerUnavailable(str(error).splitlines()[0][:160]) from None
        return Prepared(run, inputs)

    return prepare


# fmha's rows first: the headline (the default path), then the ladder's steps 2-4; then the peers.
PEERS: dict[str, Peer] = {
    peer.name: peer
    for peer in (
        Peer("fmha", "fmha.attention as a user calls it (the default path): on Hopper the Gluon kernel "
                     "with a tuned schedule, elsewhere the portable Triton kernel with tuned tiles", _fmha_default,
             is_fmha=True),
        Peer("naive", "step 2: fmha.naive_attention, S and P written to HBM (forward only)", _naive, is_fmha=True),
        Peer("triton_heuristic", "step 3: the portable Triton kernel with heuristic tiles", _triton_heuristic,
             is_fmha=True),
        Peer("triton_tuned", "step 4: the portable Triton kernel with tuned tiles (fmha tune cache or shipped "
                             "defaults)", _triton_tuned, is_fmha=True),
        Peer("sdpa_flash", "SDPA FLASH_ATTENTION (FlashAttention-2)", _sdpa("FLASH_ATTENTION")),
        Peer("sdpa_cudnn", "SDPA CUDNN_ATTENTION", _sdpa("CUDNN_ATTENTION")),
        Peer("sdpa_efficient", "SDPA EFFICIENT_ATTENTION (memory-efficient kernels)", _sdpa("EFFICIENT_ATTENTION")),
        Peer("sdpa_math", "SDPA MATH (PyTorch ops, small shapes only)", _sdpa("MATH")),
        Peer("flex", "FlexAttention (torch.compile)", _flex),
        Peer("fa2", "flash_attn (FlashAttention-2)", _flash_attn_package("flash_attn")),
        Peer("fa3", "flash_attn_interface (FlashAttention-3)", _flash_attn_package("flash_attn_interface")),
        Peer("fa4", "flash_attn.cute (FlashAttention-4)", _flash_attn_package("flash_attn.cute")),
    )
}
FMHA_PROVIDERS = tuple(name for name, peer in PEERS.items() if peer.is_fmha)


def provider_lines() -> list[str]:
    """One line per provider: its name and what it runs."""
    return [f"{name:<16} {peer.description}" for name, peer in PEERS.items()]
