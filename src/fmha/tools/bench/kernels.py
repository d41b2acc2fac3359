"""Registers, spills and shared memory of fmha's portable kernels, read from Triton."""

from __future__ import annotations

import torch

from fmha.backends.naive.launch import launch_naive
from fmha.backends.triton.config import heuristic_forward_config
from fmha.backends.triton.launch import launch_forward
from fmha.params import attention_params
from fmha.tuning.lookup import portable_config

from .cases import Case


def describe(step: str, compiled, config: str) -> dict:
    """One table row from a Triton ``CompiledKernel`` (None under the interpreter)."""
    if compiled is None:
        return {"step": step, "kernel": None, "config": config}
    metadata = compiled.metadata
    return {"step": step, "kernel": compiled.name, "config": config,
            "registers": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None),
            "shared_bytes": getattr(metadata, "shared", None), "num_warps": getattr(metadata, "num_warps", None),
            "num_stages": getattr(metadata, "num_stages", None)}


def _tiles(config) -> str:
    return f"BLOCK_M={config.block_m} BLOCK_N={config.block_n} warps={config.num_warps} stages={config.num_stages}"


def kernel_resources(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     include_naive: bool = True) -> list[dict]:
    """Launch the portable kernels of steps 2-4 once on the case's inputs and read what the compiler produced.

    Step 4 is listed when its tuned tiles differ from step 3's heuristic ones. A case with features
    (a window, packed sequences, score features) gets no rows: these launches are plain attention.
    """
    if case.features:
        return []
    q, k, v = (t.detach() for t in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    params = attention_params("kernel_resources", q, k, v, causal=case.causal)
    heuristic = heuristic_forward_config(case.head_dim, q.dtype, case.seqlen_q)
    rows = [describe("fused forward (step 3, triton_heuristic)", launch_forward(q, k, v, out, lse, params, heuristic),
                     _tiles(heuristic))]
    tuned, source = portable_config(params, autotune=False)
    if not source.startswith("heuristic") and tuned != heuristic:
        rows.append(describe("fused forward (step 4, triton_tuned)", launch_forward(q, k, v, out, lse, params, tuned),
                             _tiles(tuned)))
    if include_naive:
        names = ("naive scores (step 2)", "naive softmax (step 2)", "naive PV (step 2)")
        compiled = launch_naive(q, k, v, out, lse, params)
        rows += [describe(name, kernel, "") for name, kernel in zip(names, compiled)]
    for row in rows:
        row["label"] = case.label
    return rows
