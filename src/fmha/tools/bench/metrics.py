"""FLOPs, an analytic model of HBM traffic, and rates relative to the chip's measured limits.

Conventions follow the design: FLOPs = 4·B·Hq·Sq·Sk·D, halved when causal, ×2.5 for the
backward and ×3.5 for forward+backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cases import Case

MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
LSE_BYTES = 4  # float32 per query row


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


def _tensor_bytes(case: Case, element_size: int) -> dict[str, int]:
    rows_q = case.batch * case.q_heads * case.seqlen_q
    rows_kv = case.batch * case.kv_heads * case.seqlen_k
    return {
        "q": rows_q * case.head_dim * element_size,
        "kv": 2 * rows_kv * case.head_dim * element_size,
        "o": rows_q * case.head_dim * element_size,
        "lse": rows_q * LSE_BYTES,
        "scores": rows_q * case.seqlen_k,  # elements of S (and of P)
    }


def fused_bytes(case: Case, element_size: int) -> int:
    """Minimum HBM traffic of a fused kernel: read Q, K, V once, write O and the LSE.

    Forward+backward adds the backward's minimum: read Q, K, V, O, dO and the LSE,
    write dQ, dK and dV.
    """
    t = _tensor_bytes(case, element_size)
    forward = t["q"] + t["kv"] + t["o"] + t["lse"]
    if case.mode == "fwd":
        return forward
    backward = 2 * t["q"] + 2 * t["kv"] + 2 * t["o"] + t["lse"]
    return backward if case.mode == "bwd" else forward + backward


def naive_bytes(case: Case, element_size: int) -> int:
    """HBM traffic of the materialising baseline (forward), kernel by kernel.

    scores: read Q, K; write S (fp32). softmax: read S; write P (input dtype), 1/rowsum and
    the LSE. pv: read P, V, 1/rowsum; write O. S and P are full Sq x Sk even when causal.
    """
    t = _tensor_bytes(case, element_size)
    half_kv = t["kv"] // 2
    scores = t["q"] + half_kv + 4 * t["scores"]
    softmax = 4 * t["scores"] + element_size * t["scores"] + 2 * t["lse"]
    pv = element_size * t["scores"] + half_kv + t["lse"] + t["o"]
    return scores + softmax + pv


def modelled_bytes(case: Case, step: str, element_size: int) -> int:
    """Bytes a provider must move: ``step`` is ``"naive"`` or anything fused."""
    return naive_bytes(case, element_size) if step == "naive" else fused_bytes(case, element_size)


@dataclass(frozen=True)
class ChipLimits:
    """Measured ceilings: a dense bf16 matmul and a device-to-device copy."""

    matmul_tflops: float
    copy_gbps: float

    def bound_ms(self, flops: float, bytes_moved: float) -> tuple[float, str]:
        """The roofline lower bound on time, and which limit sets it."""
        compute_ms = flops / (self.matmul_tflops * 1e12) * 1e3
        memory_ms = bytes_moved / (self.copy_gbps * 1e9) * 1e3
        return (compute_ms, "compute") if compute_ms >= memory_ms else (memory_ms, "memory")

    def percent_of_limit(self, flops: float, bytes_moved: float, milliseconds: float) -> tuple[float, str]:
        bound, kind = self.bound_ms(flops, bytes_moved)
        return 100.0 * bound / milliseconds, kind
