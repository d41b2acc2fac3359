"""Benchmark cases and the design's suites."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Case:
    batch: int
    q_heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = False
    mode: str = "fwd"
    per_head: bool = False  # report µs per head as the headline number

    @property
    def label(self) -> str:
        heads = f"{self.q_heads}" if self.q_heads == self.kv_heads else f"{self.q_heads}/{self.kv_heads}"
        seq = f"{self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"{self.seqlen_q}x{self.seqlen_k}"
        return f"B{self.batch} H{heads} S{seq} D{self.head_dim}{' causal' if self.causal else ''} {self.mode}"

    def to_dict(self) -> dict:
        return asdict(self)


def seeds(modes=("fwd",)) -> list[Case]:
    """The seed report's shapes: non-causal, (1,16,1024,64) reported per head."""
    return [
        Case(*shape, mode=mode, per_head=per_head)
        for mode in modes
        for shape, per_head in (((8, 16, 16, 1024, 1024, 64), False),
                                ((1, 16, 16, 1024, 1024, 64), True),
                                ((16, 16, 16, 2048, 2048, 64), False))
    ]


def std(modes=("fwd",)) -> list[Case]:
    """D in {64, 128}, H = 2048 / D, S in {1k, 4k, 16k}, B = 16384 / S, causal and not."""
    cases = []
    for mode in modes:
        for head_dim in (64, 128):
            for causal in (False, True):
                for seqlen in (1024, 4096, 16384):
                    heads = 2048 // head_dim
                    cases.append(Case(16384 // seqlen, heads, heads, seqlen, seqlen, head_dim, causal, mode))
    return cases


def decode(modes=("fwd",)) -> list[Case]:
    """One query token against an 8k cache, GQA 4: memory-bound, forward only."""
    return [Case(32, 32, 8, 1, 8192, 128)]


SUITES = {"seeds": seeds, "std": std, "decode": decode}
MODES = ("fwd", "bwd", "fwdbwd")


def suite_cases(suites, modes=("fwd",), shapes=()) -> list[Case]:
    """The named suites' cases in each mode, then ``--shape`` strings (in each mode)."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    cases = [case for suite in suites for case in SUITES[suite](modes)]
    for text in shapes:
        base = parse_shape(text)
        cases += [Case(**{**base.to_dict(), "mode": mode}) for mode in modes]
    return cases


def parse_shape(text: str) -> Case:
    """``B,Hq,Hkv,Sq,Sk,D[,causal]`` from the command line."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (6, 7):
        raise ValueError(f"--shape takes B,Hq,Hkv,Sq,Sk,D[,causal], got {text!r}")
    batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim = (int(p) for p in parts[:6])
    causal = len(parts) == 7 and parts[6].lower() in ("1", "true", "causal", "yes")
    return Case(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal)
