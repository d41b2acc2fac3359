"""FLOPs, an analytic model of HBM traffic, and rates relative to the chip's measured limits.

Conventions follow the design: FLOPs count only the visible (query, key) pairs, 4·D per pair
(two matmuls), ×2.5 for the backward and ×3.5 for forward+backward. Without a window the pairs
are Sq·Sk, halved when causal (the convention of the published numbers); with a sliding window
they are counted exactly, row by row. Packed sequences (varlen) sum their sequences.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fmha.masking import Window

from .cases import Case

MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
LSE_BYTES = 4  # float32 per query row


@functools.lru_cache(maxsize=256)
def visible_pairs(seqlen_q: int, seqlen_k: int, window: Window | None) -> int:
    """The (query, key) pairs ``window`` lets through, counted per row (no Sq x Sk mask is built)."""
    if window is None:
        return seqlen_q * seqlen_k
    pairs = 0
    for row in range(seqlen_q):
        position = row + window.offset
        first = 0 if window.left is None else max(0, position - window.left)
        last = seqlen_k - 1 if window.right is None else min(seqlen_k - 1, position + window.right)
        pairs += max(0, last - first + 1)
    return pairs


def _sequence_pairs(case: Case, seqlen_q: int, seqlen_k: int) -> float:
    if case.window is None:
        return seqlen_q * seqlen_k * (0.5 if case.causal else 1.0)
    return float(visible_pairs(seqlen_q, seqlen_k, case.visible_window(seqlen_q, seqlen_k)))


def pairs_per_head(case: Case) -> float:
    """Visible (query, key) pairs of one head over the batch (or over the packed sequences)."""
    if case.lengths is not None:
        return sum(_sequence_pairs(case, length, length) for length in case.lengths)
    return case.batch * _sequence_pairs(case, case.seqlen_q, case.seqlen_k)


def attention_flops(case: Case) -> float:
    """4 * D per visible pair for the two matmuls, over Hq heads, times the mode's factor."""
    return 4.0 * case.q_heads * case.head_dim * pairs_per_head(case) * MODE_FLOP_FACTOR[case.mode]


def tflops(case: Case, milliseconds: float) -> float:
    return attention_flops(case) / (milliseconds * 1e-3) / 1e12


def microseconds_per_head(case: Case, milliseconds: float) -> float:
    return milliseconds * 1e3 / (case.batch * case.q_heads)


def _tensor_bytes(case: Case, element_size: int) -> dict[str, int]:
    tokens_q, tokens_k = case.tokens
    rows_q = case.q_heads * tokens_q
    rows_kv = case.kv_heads * tokens_k
    if case.lengths is not None:
        scores = case.q_heads * sum(length * length for length in case.lengths)
    else:
        scores = rows_q * case.seqlen_k
    return {
        "q": rows_q * case.head_dim * element_size,
        "kv": 2 * rows_kv * case.head_dim * element_size,
        "o": rows_q * case.head_dim * element_size,
        "lse": rows_q * LSE_BYTES,
        "scores": scores,  # elements of S (and of P), every pair of each sequence
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
