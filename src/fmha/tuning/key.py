"""Tuning keys: what makes one tuned config apply to a call.

A key holds the GPU (name and compute capability), the triton and fmha versions, the kernel
(``fwd`` or ``bwd``), dtype, head dim, causal, the GQA ratio and power-of-two buckets of the
query and key lengths. Batch and head counts are not in it: they scale the grid, not the tile.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton

from .._version import __version__ as FMHA_VERSION


def length_bucket(length: int) -> int:
    """The power of two at or above ``length`` (1 for 0 or 1)."""
    return 1 << max(0, int(length) - 1).bit_length()


@dataclass(frozen=True)
class ShapeKey:
    """The problem part of a key, shared by the cache and the shipped defaults."""

    kernel: str
    dtype: str
    head_dim: int
    causal: bool
    group: int
    seqlen_q_bucket: int
    seqlen_k_bucket: int

    @classmethod
    def of(cls, kernel: str, dtype: torch.dtype, head_dim: int, causal: bool, q_heads: int, kv_heads: int,
           seqlen_q: int, seqlen_k: int) -> "ShapeKey":
        return cls(kernel, str(dtype).removeprefix("torch."), int(head_dim), bool(causal),
                   max(1, q_heads // max(1, kv_heads)), length_bucket(seqlen_q), length_bucket(seqlen_k))

    def text(self) -> str:
        return (f"{self.kernel}|{self.dtype}|d{self.head_dim}|{'causal' if self.causal else 'full'}|"
                f"g{self.group}|q{self.seqlen_q_bucket}|k{self.seqlen_k_bucket}")

    @classmethod
    def parse(cls, text: str) -> "ShapeKey":
        kernel, dtype, head_dim, causal, group, seqlen_q, seqlen_k = text.split("|")
        return cls(kernel, dtype, int(head_dim[1:]), causal == "causal", int(group[1:]), int(seqlen_q[1:]),
                   int(seqlen_k[1:]))

    def to_dict(self) -> dict:
        return asdict(self)


def device_key(device=None) -> str:
    """GPU name and compute capability, triton and fmha versions."""
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}|sm_{props.major}{props.minor}|triton {triton.__version__}|fmha {FMHA_VERSION}"


def gpu_name(device=None) -> str:
    return torch.cuda.get_device_properties(device).name
