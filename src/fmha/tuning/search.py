"""Timing candidate configs: correctness first, then ``do_bench`` median; failures are recorded.

A case's mode says which kernel is timed: ``fwd`` the forward, ``bwd`` the backward of one
saved forward (direct launches, no autograd).
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Callable, NamedTuple

import torch

from ..config import ForwardConfig, heuristic_backward_config
from .key import ShapeKey, device_key
from .space import SPACES, Problem

# A candidate whose result differs from the reference by more than this (relative L2) is wrong:
# float64 for the forward's output, the heuristic config's gradients for the backward.
MAX_RELATIVE_ERROR = 2e-2


def problem_for(device, dtype: torch.dtype, head_dim: int, seqlen_q: int, seqlen_k: int | None = None) -> Problem:
    shared = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return Problem(head_dim, torch.empty((), dtype=dtype).element_size(), seqlen_q, shared, seqlen_k)


class Trial(NamedTuple):
    """How to run one kernel on fixed inputs with a given config, and how wrong its result is."""

    run: Callable[[ForwardConfig], object]
    error: Callable[[ForwardConfig], float]


def _forward_trial(case, dtype: torch.dtype) -> Trial:
    import fmha
    from ..bench.runner import make_inputs, relative_error

    q, k, v = make_inputs(case, dtype)

    def run(config):
        return fmha.attention(q, k, v, causal=case.causal, config=config)

    def error(config):
        out = run(config)
        torch.cuda.synchronize()
        return relative_error(case, q, k, v, out)

    return Trial(run, error)


def _backward_trial(case, dtype: torch.dtype) -> Trial:
    from ..bench.runner import make_inputs
    from ..launch import default_scale
    from ..ops import run_backward, run_forward

    q, k, v = make_inputs(dataclasses.replace(case, mode="fwd"), dtype)  # no autograd graph
    causal_offset = case.seqlen_k - case.seqlen_q if case.causal else None
    scale = default_scale(case.head_dim)
    out, lse = run_forward(q, k, v, causal_offset=causal_offset, scale=scale)
    dout = torch.randn_like(out)

    def run(config):
        return run_backward(dout, q, k, v, out, lse, causal_offset=causal_offset, scale=scale, config=config)

    # The heuristic's gradients are the reference: the GPU tests hold them to the float64 rule,
    # and a float64 autograd of long sequences would cost more than the whole search.
    try:
        expected = run(heuristic_backward_config(case.head_dim, dtype))
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


def measure_candidates(case, dtype: torch.dtype, candidates: list[ForwardConfig], on_result=None) -> list[dict]:
    """One result per candidate: ``status`` ok / failed / wrong, TFLOP/s when ok."""
    from ..bench.metrics import tflops
    from ..bench.runner import time_ms

    results = []
    with torch.no_grad():
        trial = TRIALS[case.mode](case, dtype)
        for config in candidates:
            result = {"config": config, "status": "ok"}
            try:
                error = trial.error(config)
                if not error <= MAX_RELATIVE_ERROR:
                    result.update(status="wrong", error=f"relative error {error:.3g}")
                else:
                    ms, method = time_ms(lambda: trial.run(config))
                    result.update(ms=ms, method=method, tflops=tflops(case, ms), rel_err=error)
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
    from .store import config_to_record

    return config_to_record(best["config"], tflops=round(best["tflops"], 2), method=best["method"],
                            date=datetime.date.today().isoformat())


def tune_and_store(kernel, device, dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k,
                   batch) -> ForwardConfig | None:
    """``FMHA_AUTOTUNE=1``: search one key of ``kernel`` on inputs of the call's shape, store the winner."""
    from ..bench.cases import Case
    from . import lookup, store

    case = Case(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, mode=kernel)
    with torch.cuda.device(device):
        candidates = SPACES[kernel].candidates(problem_for(device, dtype, head_dim, seqlen_q, seqlen_k))
        best = best_of(measure_candidates(case, dtype, candidates))
        if best is None:
            return None
        shape = ShapeKey.of(kernel, dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k)
        store.store(device_key(device), {shape.text(): winner_record(best)})
    lookup.forget()
    return best["config"]
