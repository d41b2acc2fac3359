"""Run the engineering ladder (and the peers) and return one results payload.

Step 1 checks the invariant in NumPy on the CPU. Steps 2-5 and the peers run on the GPU;
without one, fmha's rows run through Triton's interpreter at one tiny shape.
"""

from __future__ import annotations

import time

import numpy as np
import torch

import fmha
from fmha.tools.bench import metrics
from fmha.tools.bench.cases import Case
from fmha.tools.bench.peers import PEERS, PeerUnavailable
from fmha.tools.bench.runner import RESULTS_SCHEMA, environment, relative_error, run_case, summarize

# (step, row, what it runs). The last step is the headline the report compares with the peers.
STEPS = (
    ("1", "invariant", "NumPy float64: blockwise online softmax vs direct softmax (CPU)"),
    ("2", "naive", "3 Triton kernels: S = QKᵀ and P = softmax(S) written to HBM, then PV"),
    ("3", "triton_heuristic", "the portable fused Triton kernel (online softmax, K/V loop, causal block "
                              "skipping) with heuristic tiles"),
    ("4", "triton_tuned", "the portable fused kernel with tuned tiles (the `fmha tune` cache or the shipped "
                          "defaults)"),
    ("5", "fmha", "the default path, exactly what `fmha.attention(q, k, v, causal=...)` runs: on Hopper the "
                  "warp-specialised Gluon kernel with a tuned schedule, elsewhere the portable kernel with tuned "
                  "tiles"),
)
LADDER_PROVIDERS = tuple(provider for _, provider, _ in STEPS[1:])
INVARIANT_SHAPE = (1, 4, 2, 256, 320, 64)  # B, Hq, Hkv, Sq, Sk, D: GQA, Sk not a block multiple
INTERPRETER_CASE = Case(1, 2, 2, 64, 64, 32)


def invariant_step(block: int = 64, seed: int = 0) -> dict:
    """Online softmax against the direct formula, non-causal and causal in both alignments."""
    batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim = INVARIANT_SHAPE
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, q_heads, seqlen_q, head_dim))
    k = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim))
    v = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim))
    worst, elapsed = 0.0, []
    for offset in (None, seqlen_k - seqlen_q, 0):
        start = time.perf_counter()
        online, online_lse = fmha.reference.online_attention(q, k, v, causal_offset=offset, block_n=block)
        elapsed.append(time.perf_counter() - start)
        direct, direct_lse = fmha.reference.direct_attention(q, k, v, causal_offset=offset)
        worst = max(worst, float(np.abs(online - direct).max() / np.abs(direct).max()),
                    float(np.abs(online_lse - direct_lse).max() / np.abs(direct_lse).max()))
    case = Case(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim)
    ms = elapsed[0] * 1e3
    return {"label": case.label + " (NumPy, CPU)", "case": case.to_dict(), "max_rel_error": worst,
            "status": "pass" if worst <= 1e-12 else "fail", "ms": ms, "tflops": metrics.tflops(case, ms),
            "block_n": block}


def run_ladder_gpu(cases: list[Case], providers: list[str], dtype: torch.dtype, *, limits=None,
                   on_row=None, on_case=None) -> tuple[list[dict], list[dict]]:
    """Rows for every case and provider, plus the kernel resource table."""
    from fmha.tools.bench.kernels import kernel_resources
    from fmha.tools.bench.runner import make_inputs

    rows, kernels = [], []
    for case in cases:
        case_rows = run_case(case, providers, dtype, limits=limits, on_row=on_row)
        rows += case_rows
        if case.mode == "fwd" and any(PEERS[name].is_fmha for name in providers):
            naive_ok = any(r["provider"] == "naive" and r["status"] == "ok" for r in case_rows)
            q, k, v = make_inputs(case, dtype)
            try:
                kernels += kernel_resources(case, q, k, v, include_naive=naive_ok)
            except (RuntimeError, torch.OutOfMemoryError) as error:
                kernels.append({"label": case.label, "step": "all", "kernel": None,
                                "config": f"not read: {type(error).__name__}"})
            del q, k, v
            torch.cuda.empty_cache()
        if on_case is not None:
            on_case(case)
    return rows, kernels


def run_ladder_interpreter(on_row=None) -> list[dict]:
    """No GPU: fmha's rows at one tiny fp32 shape through the interpreter, one call each; peers skipped."""
    case = INTERPRETER_CASE
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(case.batch, heads, seqlen, case.head_dim, generator=generator)
               for heads, seqlen in ((case.q_heads, case.seqlen_q), (case.kv_heads, case.seqlen_k),
                                     (case.kv_heads, case.seqlen_k)))
    rows = []
    for name, peer in PEERS.items():
        row = {"case": case.to_dict(), "label": case.label, "provider": name, "dtype": "float32"}
        if not peer.is_fmha:
            row.update(status="skipped", error="no GPU: peers were skipped")
        else:
            try:
                prepared = peer.prepare(case, q, k, v)
            except PeerUnavailable as reason:
                row.update(status="unavailable", error=str(reason))
            else:
                row.update(prepared.kernel or {})
                start = time.perf_counter()
                out = prepared.run()
                ms = (time.perf_counter() - start) * 1e3
                error = relative_error(case, q, k, v, out)
                # Timings are kept for the record; the report makes no speed claim from them.
                row.update(status="ok" if error <= 1e-5 else "wrong", rel_err=error, ms=ms, us=ms * 1e3,
                           method="cpu_interpreter", tflops=metrics.tflops(case, ms),
                           us_per_head=metrics.microseconds_per_head(case, ms))
                if row["status"] == "wrong":
                    row["error"] = f"relative error {error:.3g} vs float64"
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def build_payload(*, suites, modes, dtype: str, providers, rows, kernels, invariant, limits=None,
                  limits_source=None, memory=None, interpreter=False, shapes=(), ignored_options=()) -> dict:
    payload = {
        "schema": RESULTS_SCHEMA,
        "environment": environment(),
        "suites": list(suites),
        "shapes": [case.shape_text for case in shapes],
        "modes": list(modes),
        "dtype": dtype,
        "providers": list(providers),
        "interpreter": interpreter,
        "invariant": invariant,
        "rows": rows,
        "summary": summarize(rows),
        "kernels": kernels,
    }
    if limits is not None:
        payload["chip_limits"] = {"matmul_tflops": limits.matmul_tflops, "copy_gbps": limits.copy_gbps,
                                  "source": limits_source}
    if memory is not None:
        payload["memory_check"] = memory
    if ignored_options:
        payload["ignored_options"] = list(ignored_options)
    return payload
