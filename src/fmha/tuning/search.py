"""Timing candidate configs: correctness first, then ``do_bench`` median; failures are recorded."""

from __future__ import annotations

import datetime

import torch

from ..config import ForwardConfig
from .key import ShapeKey, device_key
from .space import Problem, forward_candidates

# A candidate whose output differs from float64 by more than this (relative L2) is wrong.
MAX_RELATIVE_ERROR = 2e-2


def problem_for(device, dtype: torch.dtype, head_dim: int, seqlen_q: int) -> Problem:
    shared = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return Problem(head_dim, torch.empty((), dtype=dtype).element_size(), seqlen_q, shared)


def measure_candidates(case, dtype: torch.dtype, candidates: list[ForwardConfig], on_result=None) -> list[dict]:
    """One result per candidate: ``status`` ok / failed / wrong, TFLOP/s when ok."""
    import fmha
    from ..bench.metrics import tflops
    from ..bench.runner import make_inputs, relative_error, time_ms

    q, k, v = make_inputs(case, dtype)
    results = []
    for config in candidates:
        result = {"config": config, "status": "ok"}
        try:
            with torch.no_grad():
                out = fmha.attention(q, k, v, causal=case.causal, config=config)
                torch.cuda.synchronize()
                error = relative_error(case, q, k, v, out)
                del out
                if not error <= MAX_RELATIVE_ERROR:
                    result.update(status="wrong", error=f"relative error {error:.3g}")
                else:
                    ms, method = time_ms(lambda: fmha.attention(q, k, v, causal=case.causal, config=config))
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


def tune_and_store(device, dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k, batch) -> ForwardConfig | None:
    """``FMHA_AUTOTUNE=1``: search one key on inputs of the call's shape, store the winner."""
    from ..bench.cases import Case
    from . import lookup, store

    case = Case(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal)
    with torch.cuda.device(device):
        candidates = forward_candidates(problem_for(device, dtype, head_dim, seqlen_q))
        best = best_of(measure_candidates(case, dtype, candidates))
        if best is None:
            return None
        shape = ShapeKey.of("fwd", dtype, head_dim, causal, q_heads, kv_heads, seqlen_q, seqlen_k)
        store.store(device_key(device), {shape.text(): winner_record(best)})
    lookup.forget()
    return best["config"]
