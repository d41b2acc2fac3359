"""Benchmark cases, the design's suites, and the one parser of ``--shape``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

MODES = ("fwd", "bwd", "fwdbwd")
MAX_HEAD_DIM = 256
SHAPE_FORM = "B,Hq,Hkv,Sq,Sk,D[,causal]"
SHAPE_EXAMPLE = "2,32,8,4096,4096,128,causal"
CAUSAL_WORDS = {"causal": True, "true": True, "yes": True, "1": True,
                "full": False, "noncausal": False, "false": False, "no": False, "0": False}


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

    def __post_init__(self):
        sizes = {"B": self.batch, "Hq": self.q_heads, "Hkv": self.kv_heads, "Sq": self.seqlen_q,
                 "Sk": self.seqlen_k, "D": self.head_dim}
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"Hq must be a multiple of Hkv (GQA), got Hq={self.q_heads}, Hkv={self.kv_heads}")
        if self.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"D must be 1..{MAX_HEAD_DIM}, got {self.head_dim}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @property
    def label(self) -> str:
        heads = f"{self.q_heads}" if self.q_heads == self.kv_heads else f"{self.q_heads}/{self.kv_heads}"
        seq = f"{self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"{self.seqlen_q}x{self.seqlen_k}"
        return f"B{self.batch} H{heads} S{seq} D{self.head_dim}{' causal' if self.causal else ''} {self.mode}"

    @property
    def shape_text(self) -> str:
        """The case as ``--shape`` takes it."""
        sizes = (self.batch, self.q_heads, self.kv_heads, self.seqlen_q, self.seqlen_k, self.head_dim)
        return ",".join(map(str, sizes)) + (",causal" if self.causal else "")

    def to_dict(self) -> dict:
        return asdict(self)


def seeds(modes=("fwd",)) -> list[Case]:
    """The seed report's shapes: non-causal D=64, (1,16,1024,64) reported per head."""
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


def suite_lines() -> list[str]:
    """One line per suite: its name, what it holds and how many forward cases."""
    lines = []
    for name, function in SUITES.items():
        count = len(function())
        lines.append(f"{name:<8} {function.__doc__.splitlines()[0]} ({count} case{'s' if count != 1 else ''})")
    return lines


def suite_cases(suites, modes=("fwd",), shapes=()) -> list[Case]:
    """The named suites' cases in each mode, then the ``--shape`` cases (Case or text) in each mode."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    cases = [case for suite in suites for case in SUITES[suite](modes)]
    for shape in shapes:
        base = parse_shape(shape) if isinstance(shape, str) else shape
        cases += [replace(base, mode=mode) for mode in modes]
    return cases


def parse_shape(text: str) -> Case:
    """``B,Hq,Hkv,Sq,Sk,D[,causal]`` from the command line; ValueError says what is wrong and the form."""
    parts = [part.strip() for part in text.split(",")]
    expected = f"expected {SHAPE_FORM}, e.g. {SHAPE_EXAMPLE}"
    if len(parts) not in (6, 7):
        raise ValueError(f"{text!r} has {len(parts)} fields; {expected}")
    try:
        sizes = [int(part) for part in parts[:6]]
    except ValueError:
        raise ValueError(f"{text!r}: B, Hq, Hkv, Sq, Sk and D must be integers; {expected}") from None
    causal = False
    if len(parts) == 7:
        if parts[6].lower() not in CAUSAL_WORDS:
            raise ValueError(f"{text!r}: the 7th field must be 'causal' or 'full', got {parts[6]!r}")
        causal = CAUSAL_WORDS[parts[6].lower()]
    try:
        return Case(*sizes, causal=causal)
    except ValueError as error:
        raise ValueError(f"{text!r}: {error}; {expected}") from None
