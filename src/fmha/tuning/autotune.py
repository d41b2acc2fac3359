"""Measuring candidate configs of one key: correctness first, then the ``do_bench`` median.

Used by ``FMHA_AUTOTUNE=1`` (a key with no cached or shipped config is searched once, on inputs
of the call's shape, and stored) and by ``fmha tune`` (:mod:`fmha.tools.tune`), which sweeps
suites. The portable kernels are launched directly here, with explicit configs; a Hopper
schedule through its launcher.
"""

from __future__ import annotations

import datetime
from typing import Callable, NamedTuple

import torch

from ..backends.triton.config import ForwardConfig, heuristic_backward_config, heuristic_forward_config
from ..backends.triton.launch import launch_backward, launch_forward
from ..params import AttentionParams
from ..runtime import shared_memory_per_block
from ..testing import random_qkv, relative_error, time_ms
from . import store
from .key import ShapeKey, device_key
from .space import SPACES, Problem

# A candidate whose result differs from the reference by more than this (relative L2) is wrong:
# float64 for the forward's output, the heuristic config's gradients for the backward.
MAX_RELATIVE_ERROR = 2e-2


def attention_flops(kernel: str, params: AttentionParams) -> float:
    """4·B·Hq·Sq·Sk·D, halved when causal, ×2.5 for the backward (the benchmark's convention)."""
    flops = 4.0 * params.batch * params.q_heads * params.seqlen_q * params.seqlen_k * params.head_dim
    return flops * (0.5 if params.causal else 1.0) * (2.5 if kernel == "bwd" else 1.0)


def problem_for(device, dtype: torch.dtype, head_dim: int, seqlen_q: int, seqlen_k: int | None = None) -> Problem:
    return Problem(head_dim, torch.empty((), dtype=dtype).element_size(), seqlen_q, shared_memory_per_block(device),
                   seqlen_k)


class Trial(NamedTuple):
    """How to run one kernel on fixed inputs with a given config, and how wrong its result is."""

    run: Callable[[object], object]
    error: Callable[[object], float]


def _inputs(params: AttentionParams):
    generator = torch.Generator(device=params.device).manual_seed(0)
    return random_qkv(params.batch, params.q_heads, params.kv_heads, params.seqlen_q, params.seqlen_k,
                      params.head_dim, params.dtype, device=params.device, generator=generator)


def _forward_trial(params: AttentionParams) -> Trial:
    q, k, v = _inputs(params)
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    def run(config):
        if isinstance(config, ForwardConfig):
            launch_forward(q, k, v, out, lse, params, config)
        else:  # a Hopper schedule (Gluon is imported only where it is used)
            from ..backends.gluon_sm90.launch import HopperForward

            HopperForward(params, config)(q, k, v, out, lse)
        return out

    def error(config):
        result = run(config)
        torch.cuda.synchronize()
        return relative_error(q, k, v, result, window=params.window)

    return Trial(run, error)


def _backward_trial(params: AttentionParams) -> Trial:
    q, k, v = _inputs(params)
    dtype = params.dtype
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
    launch_forward(q, k, v, out, lse, params, heuristic_forward_config(params.head_dim, dtype, params.seqlen_q))
    dout = torch.randn_like(out)

    def run(config):
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        launch_backward(q, k, v, out, dout, lse, *grads, params, config)
        return grads

    # The heuristic's gradients are the reference: the GPU tests hold them to the float64 rule,
    # and a float64 autograd of long sequences would cost more than the whole search.
    try:
        expected = run(heuristic_backward_config(params.head_dim, dtype, shared_memory_per_block(params.device)))
    except Exception as failure:  # then nothing can be checked: every candidate is recorded failed
        expected = failure

    def error(config):
        if isinstance(expected, Exception):
            raise RuntimeError(f"the reference (heuristic) config failed: {expected}") from expected
        grads = run(config)
        torch.cuda.synchronize()
        return max(_relative_l2(got, want) for got, want in zip(grads, expected))

    return Trial(run, error)


def _relative_l2(got: torch.Tensor, expected: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("nan")
    expected = expected.double()
    return ((got.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


TRIALS = {"fwd": _forward_trial, "bwd": _backward_trial}


def measure_candidates(kernel: str, params: AttentionParams, candidates: list, on_result=None) -> list[dict]:
    """One result per candidate of the ``kernel`` (fwd / bwd) key of ``params``: ``status`` ok / failed /
    wrong, TFLOP/s when ok."""
    results = []
    with torch.no_grad():
        trial = TRIALS[kernel](params)
        for config in candidates:
            result = {"config": config, "status": "ok"}
            try:
                error = trial.error(config)
                if not error <= MAX_RELATIVE_ERROR:
                    result.update(status="wrong", error=f"relative error {error:.3g}")
                else:
                    ms, method = time_ms(lambda: trial.run(config))
                    result.update(ms=ms, method=method, tflops=attention_flops(kernel, params) / (ms * 1e-3) / 1e12, rel_err=error)
            except Exception as error:  # compile failure, out of resources, launch error: never chosen
                result.update(status="failed", error=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                              if str(error) else type(error).__name__)
            torch.cuda.empty_cache()
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


def best_of(results: list[dict]) -> dict | None:
    ok = [r for r in results if r["status"] == "ok"]
    return max(ok, key=lambda r: r["tflops"]) if ok else None


def winner_record(best: dict) -> dict:
    measured = dict(tflops=round(best["tflops"], 2), method=best["method"], date=datetime.date.today().isoformat())
    if isinstance(best["config"], ForwardConfig):
        return store.config_to_record(best["config"], **measured)
    return store.schedule_to_record(best["config"], **measured)


def tune_and_store(kernel: str, params: AttentionParams) -> ForwardConfig | None:
    """``FMHA_AUTOTUNE=1``: search one key of the portable ``kernel`` on inputs of the call's shape, store the winner."""
    device = params.device
    with torch.cuda.device(device):
        candidates = SPACES[kernel].candidates(problem_for(device, params.dtype, params.head_dim, params.seqlen_q,
                                                           params.seqlen_k))
        best = best_of(measure_candidates(kernel, params, candidates))
        if best is None:
            return None
        shape = ShapeKey.of(kernel, params.dtype, params.head_dim, params.causal, params.q_heads, params.kv_heads,
                            params.seqlen_q, params.seqlen_k)
        store.store(device_key(device), {shape.text(): winner_record(best)})
    return best["config"]
