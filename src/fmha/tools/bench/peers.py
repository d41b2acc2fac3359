"""Providers: every attention implementation the benchmark can time, behind one signature.

A provider's ``prepare(case, q, k, v)`` takes the case's inputs (BHSD, or THD for packed
sequences) and returns a :class:`Prepared`: ``run()`` computes the attention once, reading
``inputs``. Layout changes (BSHD copies for the FlashAttention packages, one (1, H, T, D) batch
for FlexAttention's packed sequences) happen in ``prepare``, outside the timed region, and
gradients are taken with respect to ``inputs``. ``prepare`` raises :class:`PeerUnavailable` when
the peer is missing and :class:`Unsupported` when it cannot run the case (a feature it lacks);
the benchmark records why and goes on.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import operator
from dataclasses import dataclass
from typing import Callable

import torch

import fmha
from fmha.masking import Window

from .cases import Case

# SDPA's MATH backend materialises S and P in the input dtype and in fp32: small shapes only.
MATH_MAX_SCORES = 1 << 27


class PeerUnavailable(Exception):
    """The peer is missing, or cannot run here."""


class Unsupported(PeerUnavailable):
    """The peer runs, but not this case: it lacks one of the case's features."""


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


def score_inputs(case: Case, device, requires_grad: bool = False) -> dict[str, torch.Tensor]:
    """The case's ALiBi slopes and sinks (float32, one per query head), the same on every call."""
    inputs = {}
    if case.alibi:  # the usual geometric slopes, 2^(-8 (h + 1) / H)
        heads = torch.arange(1, case.q_heads + 1, dtype=torch.float64)
        inputs["alibi_slopes"] = torch.exp2(-8.0 * heads / case.q_heads).to(device=device, dtype=torch.float32)
    if case.sinks:
        generator = torch.Generator().manual_seed(case.q_heads)
        sinks = torch.randn(case.q_heads, generator=generator, dtype=torch.float32).to(device)
        inputs["sinks"] = sinks.requires_grad_(requires_grad)
    return inputs


def cu_seqlens(case: Case, device) -> torch.Tensor:
    """int32 (B + 1,) sequence starts of a packed case, ending at the total."""
    starts = [0]
    for length in case.lengths:
        starts.append(starts[-1] + length)
    return torch.tensor(starts, dtype=torch.int32, device=device)


def fa_window(case: Case) -> tuple[int, int]:
    """The case's window as FlashAttention's ``window_size`` (-1: unbounded side)."""
    left, right = case.window or (None, None)
    return (-1 if left is None else left, -1 if right is None else right)


def _refuse(case: Case, peer: str, supported=()) -> None:
    """Raise Unsupported naming the first feature of the case that ``peer`` lacks."""
    names = {"varlen": "packed sequences (varlen)", "window": "sliding windows", "softcap": "softcap",
             "alibi": "ALiBi", "sinks": "sinks", "dropout": "dropout"}
    for feature in case.features:
        name = feature.partition("=")[0]
        if name not in supported:
            raise Unsupported(f"{peer} has no {names[name]}")


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


def fmha_options(case: Case, device, requires_grad: bool = False) -> dict:
    """The keyword arguments of ``fmha.attention`` for the case: ``causal`` and the features it has."""
    options = {"causal": case.causal}
    if case.window is not None:
        options["window"] = case.window
    if case.softcap:
        options["softcap"] = case.softcap
    if case.dropout:
        options["dropout_p"] = case.dropout
    options.update(score_inputs(case, device, requires_grad))
    return options


def _learnable(options: dict) -> tuple[torch.Tensor, ...]:
    return (options["sinks"],) if "sinks" in options else ()


def _fmha_default(case, q, k, v):
    """The headline: exactly what ``fmha.attention(q, k, v, causal=...)`` runs for this call
    (``fmha.flash_attn_varlen_func`` for packed sequences)."""
    if case.lengths is not None:
        return _fmha_varlen(case, q, k, v)
    options = fmha_options(case, q.device, requires_grad=q.requires_grad)
    explanation = fmha.explain(q, k, v, **options)
    return Prepared(lambda: fmha.attention(q, k, v, **options), (q, k, v, *_learnable(options)),
                    _kernel(explanation.backend, explanation.config, explanation.source, explanation, case))


def _fmha_varlen(case, q, k, v):
    from fmha import dispatch
    from fmha.params import varlen_params

    cu = cu_seqlens(case, q.device)
    longest = case.seqlen_q
    scores = score_inputs(case, q.device, requires_grad=q.requires_grad)
    options = dict(causal=case.causal, window_size=fa_window(case), softcap=case.softcap, dropout_p=case.dropout,
                   alibi_slopes=scores.get("alibi_slopes"))
    # What the call runs, as fmha.explain says for dense calls; refuses (NotImplementedError) what is not there yet.
    params = varlen_params("fmha bench", q, k, v, cu, cu, longest, longest, causal=case.causal, window=case.window,
                           softcap=case.softcap or None, alibi_slopes=options["alibi_slopes"],
                           sinks=scores.get("sinks"), dropout_p=case.dropout)
    explanation = dispatch.prepared_forward(params, q, k, v, cu, cu).explanation
    kernel = _kernel(explanation.backend, explanation.config, explanation.source)
    if case.mode != "fwd":
        backward, source = dispatch.BACKWARD_BACKEND.backward_config(params)
        kernel["backward"] = f"triton {backward} (from {source})"
    if case.sinks:  # FlashAttention-2's signature has no sinks: fmha's own varlen entry point
        return Prepared(lambda: fmha.varlen_attention(q, k, v, cu, cu, longest, longest, causal=case.causal,
                                                      window=case.window, softcap=case.softcap or None,
                                                      alibi_slopes=options["alibi_slopes"], sinks=scores["sinks"],
                                                      dropout_p=case.dropout),
                        (q, k, v, scores["sinks"]), kernel)
    return Prepared(lambda: fmha.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, **options), (q, k, v),
                    kernel)


def _ladder_step(case: Case) -> None:
    if case.lengths is not None:
        raise Unsupported("the ladder's steps are dense calls; row fmha runs the packed sequences")


def _triton_heuristic(case, q, k, v):
    """Step 3: the portable Triton kernel with the heuristic tiles, whatever has been tuned."""
    from fmha.backends.triton.config import heuristic_forward_config

    _ladder_step(case)
    config = heuristic_forward_config(case.head_dim, q.dtype, case.seqlen_q)
    options = fmha_options(case, q.device, requires_grad=q.requires_grad)
    explanation = fmha.explain(q, k, v, config=config, **options)
    return Prepared(lambda: fmha.attention(q, k, v, config=config, **options), (q, k, v, *_learnable(options)),
                    _kernel("triton", config, "heuristic", explanation, case))


def _triton_tuned(case, q, k, v):
    """Step 4: the portable Triton kernel with the tiles the tuning data picks for this call (the
    ``fmha tune`` cache or the shipped defaults, never a search), narrowed as the default path narrows them."""
    from fmha.params import attention_params
    from fmha.runtime import INTERPRETED
    from fmha.tuning.lookup import portable_config

    _ladder_step(case)
    if INTERPRETED:
        raise PeerUnavailable("Triton's interpreter does not autotune; row fmha shows what fmha.attention runs there")
    options = fmha_options(case, q.device, requires_grad=q.requires_grad)
    config, source = portable_config(attention_params("fmha bench", q, k, v, **options), autotune=False)
    if source.startswith("heuristic"):
        raise PeerUnavailable("not tuned: no tuned tiles for this GPU and key (`fmha tune` stores them)")
    explanation = fmha.explain(q, k, v, config=config, **options)
    return Prepared(lambda: fmha.attention(q, k, v, config=config, **options), (q, k, v, *_learnable(options)),
                    _kernel("triton", config, source, explanation, case))


def _naive(case, q, k, v):
    """Step 2: three kernels with S and P in global memory."""
    if case.mode != "fwd":
        raise PeerUnavailable("the naive baseline is forward only")
    _refuse(case, "the naive baseline", supported=("window",))
    if q.is_cuda:
        needed = _scores(case) * (4 + q.element_size())
        free, _ = torch.cuda.mem_get_info(q.device)
        if needed > 0.8 * free:
            raise PeerUnavailable(f"needs {needed / 2**30:.1f} GiB for S and P, {free / 2**30:.1f} GiB free")
    window = {"window": case.window} if case.window is not None else {}
    return Prepared(lambda: fmha.naive_attention(q, k, v, causal=case.causal, **window), (q, k, v),
                    _kernel("naive", None, "no config: S and P materialised"))


def _sdpa(backend_name: str):
    def prepare(case, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        _refuse(case, "SDPA")
        if case.causal and case.seqlen_q != case.seqlen_k:
            raise Unsupported("SDPA's is_causal is top-left; fmha's causal is bottom-right")
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


def _flex_attention():
    """FlexAttention compiled once, allowed one compile per shape and mask: every case is new."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as error:
        raise PeerUnavailable(f"flex_attention not importable: {error}") from None
    global _compiled_flex
    if _compiled_flex is None:
        import torch._dynamo

        for limit in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 1024))
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def flex_mask_mod(window: Window | None, sequence_ids: torch.Tensor | None = None):
    """FlexAttention's ``mask_mod`` of ``window`` (and, for packed sequences, of their boundaries).

    None when every key is visible. Packed sequences have as many keys as queries, so a query and
    a key of the same sequence are ``q_index - kv_index`` apart in the sequence, as in the packing.
    """
    if window is None and sequence_ids is None:
        return None
    offset, left, right = (window.offset, window.left, window.right) if window is not None else (0, None, None)

    def mask_mod(batch, head, q_index, kv_index):
        position = q_index + offset
        terms = []
        if left is not None:
            terms.append(kv_index >= position - left)
        if right is not None:
            terms.append(kv_index <= position + right)
        if sequence_ids is not None:
            terms.append(sequence_ids[q_index] == sequence_ids[kv_index])
        return functools.reduce(operator.and_, terms)

    return mask_mod


def flex_score_mod(case: Case, offset: int, alibi_slopes: torch.Tensor | None = None):
    """FlexAttention's ``score_mod``: softcap, then the ALiBi bias -slope·|pos(i) - j| (None when neither)."""
    softcap = case.softcap
    if not softcap and alibi_slopes is None:
        return None

    def score_mod(score, batch, head, q_index, kv_index):
        if softcap:
            score = softcap * torch.tanh(score / softcap)
        if alibi_slopes is not None:
            score = score - alibi_slopes[head] * (q_index + offset - kv_index).abs()
        return score

    return score_mod


def _flex(case, q, k, v):
    _refuse(case, "FlexAttention", supported=("window", "varlen", "softcap", "alibi"))
    compiled = _flex_attention()
    from torch.nn.attention.flex_attention import create_block_mask

    if case.lengths is not None:  # one batch of (1, H, T, D) copies; the document mask keeps sequences apart
        inputs = tuple(t.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_(t.requires_grad)
                       for t in (q, k, v))
        lengths = torch.tensor(case.lengths, device=q.device)
        sequence_ids = torch.repeat_interleave(torch.arange(len(case.lengths), device=q.device), lengths)
        mask_mod = flex_mask_mod(case.visible_window(), sequence_ids)
        seqlen_q = seqlen_k = case.tokens[0]
    else:
        inputs = (q, k, v)
        mask_mod = flex_mask_mod(case.visible_window())
        seqlen_q, seqlen_k = case.seqlen_q, case.seqlen_k
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, seqlen_q, seqlen_k, device=q.device)
    offset = 0 if case.lengths is not None else case.seqlen_k - case.seqlen_q
    score_mod = flex_score_mod(case, offset, score_inputs(case, q.device).get("alibi_slopes"))
    gqa = case.q_heads != case.kv_heads
    return Prepared(lambda: compiled(*inputs, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa), inputs)


def varlen_attn_options(function, case: Case) -> dict:
    """Keyword arguments of ``varlen_attn`` for the case: ``window_size`` where this torch has it
    (2.11 and later), else ``is_causal`` (no windows)."""
    parameters = inspect.signature(function).parameters
    options = {}
    if "window_size" in parameters:
        left, right = fa_window(case)
        options["window_size"] = (left, 0 if case.causal else right)
    elif case.window is not None:
        raise Unsupported("this torch's varlen_attn has no window_size")
    else:
        options["is_causal"] = case.causal
    if case.q_heads != case.kv_heads:
        if "enable_gqa" not in parameters:
            raise Unsupported("this torch's varlen_attn has no enable_gqa")
        options["enable_gqa"] = True
    return options


def _varlen_attn(case, q, k, v):
    if case.lengths is None:
        raise Unsupported("varlen_attn takes packed sequences only")
    _refuse(case, "varlen_attn", supported=("varlen", "window"))
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as error:
        raise PeerUnavailable(f"torch.nn.attention.varlen not importable: {error}") from None
    options = varlen_attn_options(varlen_attn, case)
    cu = cu_seqlens(case, q.device)
    longest = case.seqlen_q

    def run():
        return varlen_attn(q, k, v, cu, cu, longest, longest, **options)

    try:
        with torch.no_grad():
            run()
    except RuntimeError as error:  # no CUDA, or this GPU, dtype or head dim is refused
        raise PeerUnavailable(str(error).splitlines()[0][:160]) from None
    return Prepared(run, (q, k, v))


def _flash_attn_package(module_name: str, function_name: str = "flash_attn_func"):
    """FlashAttention's packages take BSHD tensors; the copies are made here, untimed."""

    def prepare(case, q, k, v):
        try:
            function = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as error:
            raise PeerUnavailable(f"{module_name} not installed ({type(error).__name__})") from None
        _refuse(case, "fmha bench's call of the flash_attn packages", supported=("window", "softcap"))
        inputs = tuple(t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad) for t in (q, k, v))
        options = {"causal": case.causal}
        if case.window is not None:
            options["window_size"] = fa_window(case)
        if case.softcap:
            options["softcap"] = case.softcap

        def run():
            out = function(*inputs, **options)
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
        Peer("fmha", "fmha.attention as a user calls it (the default path; fmha.flash_attn_varlen_func for "
                     "packed sequences): on Hopper the Gluon kernel with a tuned schedule, elsewhere the portable "
                     "Triton kernel with tuned tiles", _fmha_default,
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
        Peer("flex", "FlexAttention (torch.compile; block masks for windows and packed sequences)", _flex),
        Peer("varlen_attn", "torch.nn.attention.varlen.varlen_attn (packed sequences only)", _varlen_attn),
        Peer("fa2", "flash_attn (FlashAttention-2)", _flash_attn_package("flash_attn")),
        Peer("fa3", "flash_attn_interface (FlashAttention-3)", _flash_attn_package("flash_attn_interface")),
        Peer("fa4", "flash_attn.cute (FlashAttention-4)", _flash_attn_package("flash_attn.cute")),
    )
}
FMHA_PROVIDERS = tuple(name for name, peer in PEERS.items() if peer.is_fmha)


def provider_lines() -> list[str]:
    """One line per provider: its name and what it runs."""
    return [f"{name:<16} {peer.description}" for name, peer in PEERS.items()]
