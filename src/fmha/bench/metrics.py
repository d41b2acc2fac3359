"""FLOPs and derived rates, following the design's conventions."""

from __future__ import annotations

from .cases import Case

MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


def attention_flops(case: Case) -> float:
    """4 * B * Hq * Sq * Sk * D for the two matmuls, halved when causal."""
    flops = 4.0 * case.batch * case.q_heads * case.seqlen_q * case.seqlen_k * case.head_dim
    if case.causal:
        flops *= 0.5
    return flops * MODE_FLOP_FACTOR[case.mode]


def tflops(case: Case, milliseconds: float) -> float:
    return attention_flops(case) / (milliseconds * 1e-3) / 1e12


def microseconds_per_head(case: Case, milliseconds: float) -> float:
    return milliseconds * 1e3 / (case.batch * case.q_heads)
