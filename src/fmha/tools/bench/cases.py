"""Benchmark cases, the design's suites, and the one parser of ``--shape``."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace

from fmha.masking import Window

MODES = ("fwd", "bwd", "fwdbwd")
MAX_HEAD_DIM = 256
SHAPE_FORM = "B,Hq,Hkv,Sq,Sk,D[,causal]"
SHAPE_EXAMPLE = "2,32,8,4096,4096,128,causal"
SHAPE_OPTIONS = ("window=LEFT:RIGHT (-1: unbounded), lengths=L1:L2:... (packed sequences: B is their number, "
                 "Sq = Sk the longest), softcap=X, alibi, sinks, dropout=P")
FLAG_OPTIONS = ("alibi", "sinks")
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
    # Features (the `features` suite): which keys each query sees, and what each score becomes.
    window: tuple[int | None, int | None] | None = None  # (left, right) as in fmha.attention; None: unbounded
    lengths: tuple[int, ...] | None = None  # packed sequences (varlen), queries and keys alike
    softcap: float = 0.0  # 0: off
    alibi: bool = False
    sinks: bool = False
    dropout: float = 0.0

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
        self._check_features()

    def _check_features(self):
        # Results files hold lists where the case has tuples: Case(**row["case"]) gives the same case.
        if self.window is not None:
            window = tuple(self.window)
            if len(window) != 2 or not all(side is None or (_is_int(side) and side >= 0) for side in window):
                raise ValueError(f"window must be a (left, right) pair of integers >= 0 or None, got {self.window!r}")
            object.__setattr__(self, "window", None if window == (None, None) else window)
        if self.lengths is not None:
            lengths = tuple(self.lengths)
            if not lengths or not all(_is_int(length) and length >= 0 for length in lengths):
                raise ValueError(f"lengths must be integers >= 0, got {self.lengths!r}")
            if (self.batch, self.seqlen_q, self.seqlen_k) != (len(lengths), max(lengths), max(lengths)):
                raise ValueError(f"packed sequences need B = their number ({len(lengths)}) and Sq = Sk = the "
                                 f"longest ({max(lengths)}), got B={self.batch}, Sq={self.seqlen_q}, "
                                 f"Sk={self.seqlen_k}")
            object.__setattr__(self, "lengths", lengths)
        for name, low, high in (("softcap", 0.0, float("inf")), ("dropout", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < high:
                raise ValueError(f"{name} must be a number in [{low:g}, {high:g}), got {value!r}")
            object.__setattr__(self, name, float(value))

    @classmethod
    def packed(cls, lengths, q_heads: int, kv_heads: int, head_dim: int, **options) -> "Case":
        """Packed sequences (varlen) of these lengths: B is their number, Sq = Sk the longest."""
        lengths = tuple(lengths)
        longest = max(lengths, default=0)
        return cls(len(lengths), q_heads, kv_heads, longest, longest, head_dim, lengths=lengths, **options)

    @property
    def scores_modified(self) -> bool:
        """Softcap, ALiBi, sinks or dropout: the float64 reference of plain attention does not apply."""
        return bool(self.softcap or self.alibi or self.sinks or self.dropout)

    @property
    def features(self) -> tuple[str, ...]:
        """The case's features as ``--shape`` options (``lengths`` as ``varlen``); empty for plain attention."""
        return (("varlen",) if self.lengths is not None else ()) + self._options()

    def _options(self) -> tuple[str, ...]:
        options = []
        if self.window is not None:
            options.append("window=" + ":".join("-1" if side is None else str(side) for side in self.window))
        if self.softcap:
            options.append(f"softcap={self.softcap:g}")
        options += [name for name in FLAG_OPTIONS if getattr(self, name)]
        if self.dropout:
            options.append(f"dropout={self.dropout:g}")
        return tuple(options)

    def visible_window(self, seqlen_q: int | None = None, seqlen_k: int | None = None) -> Window | None:
        """The keys each query row sees (``fmha.masking``'s rule) at these lengths, by default the case's
        (for packed sequences, each sequence's: as many keys as queries, so offset 0).

        Bottom-right aligned, as ``fmha.attention``; causal caps the right side at 0. None: every key.
        """
        if seqlen_q is None:
            seqlen_q, seqlen_k = (0, 0) if self.lengths is not None else (self.seqlen_q, self.seqlen_k)
        left, right = self.window or (None, None)
        if self.causal:
            right = 0 if right is None else min(right, 0)
        if left is None and right is None:
            return None
        return Window.of(seqlen_q, seqlen_k, left=left, right=right)

    @property
    def tokens(self) -> tuple[int, int]:
        """Query and key tokens over the whole batch."""
        if self.lengths is not None:
            return sum(self.lengths), sum(self.lengths)
        return self.batch * self.seqlen_q, self.batch * self.seqlen_k

    @property
    def label(self) -> str:
        heads = f"{self.q_heads}" if self.q_heads == self.kv_heads else f"{self.q_heads}/{self.kv_heads}"
        options = "".join(f" {option}" for option in self._options())
        causal = " causal" if self.causal else ""
        if self.lengths is not None:
            return (f"varlen N{self.batch} T{self.tokens[0]} max{self.seqlen_q} H{heads} D{self.head_dim}"
                    f"{causal}{options} {self.mode}")
        seq = f"{self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"{self.seqlen_q}x{self.seqlen_k}"
        return f"B{self.batch} H{heads} S{seq} D{self.head_dim}{causal}{options} {self.mode}"

    @property
    def shape_text(self) -> str:
        """The case as ``--shape`` takes it."""
        sizes = (self.batch, self.q_heads, self.kv_heads, self.seqlen_q, self.seqlen_k, self.head_dim)
        options = ("lengths=" + ":".join(map(str, self.lengths)),) if self.lengths is not None else ()
        return ",".join(map(str, sizes)) + (",causal" if self.causal else "") + "".join(
            f",{option}" for option in options + self._options())

    def to_dict(self) -> dict:
        return asdict(self)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    return _tokens_by_heads(modes, (64, 128))


def wide(modes=("fwd",)) -> list[Case]:
    """D = 256 (Gemma's heads) as std: H = 8, S in {1k, 4k, 16k}, B = 16384 / S, causal and not."""
    return _tokens_by_heads(modes, (256,))


# Head dims of models between the kernels' tile widths (Phi-3's 96; Stable Diffusion's 80 and 160, ...).
BETWEEN_TILE_HEAD_DIMS = (32, 48, 80, 96, 160, 192)


def dims(modes=("fwd",)) -> list[Case]:
    """Head dims between 64, 128 and 256 (32-192): B4 H16 S4k, causal and not."""
    return [Case(4, 16, 16, 4096, 4096, head_dim, causal, mode)
            for mode in modes for head_dim in BETWEEN_TILE_HEAD_DIMS for causal in (False, True)]


def _tokens_by_heads(modes, head_dims) -> list[Case]:
    cases = []
    for mode in modes:
        for head_dim in head_dims:
            for causal in (False, True):
                for seqlen in (1024, 4096, 16384):
                    heads = 2048 // head_dim
                    cases.append(Case(16384 // seqlen, heads, heads, seqlen, seqlen, head_dim, causal, mode))
    return cases


def decode(modes=("fwd",)) -> list[Case]:
    """One query token against an 8k cache, GQA 4: memory-bound, forward only."""
    return [Case(32, 32, 8, 1, 8192, 128)]


# The packed-sequence cases hold 16,384 tokens each, as the dense window cases do.
NINE_SEQUENCES = (862, 1654, 712, 3359, 1799, 1201, 2383, 3162, 1252)
EQUAL_SEQUENCES = (2048,) * 8


def one_long_many_short(long: int = 8192, short: int = 63, total: int = 16384, seed: int = 0) -> tuple[int, ...]:
    """One long sequence after ``short`` random short ones (about 1..300 tokens), ``total`` tokens in all.

    The long one comes last: a schedule that runs sequences in order leaves it alone at the end.
    """
    rng = random.Random(seed)
    draws = [rng.randint(1, 300) for _ in range(short)]
    room = total - long
    lengths = [max(1, round(draw * room / sum(draws))) for draw in draws]
    lengths[lengths.index(max(lengths))] += room - sum(lengths)  # rounding leaves a few tokens over or short
    return (*lengths, long)


def features(modes=("fwd",)) -> list[Case]:
    """Sliding windows, packed sequences (varlen) and score features: softcap, ALiBi, sinks, dropout."""
    cases = []
    for mode in modes:
        for left in (1023, 4095):  # windows of 1024 and 4096 keys
            cases.append(Case(1, 16, 16, 16384, 16384, 128, causal=True, mode=mode, window=(left, 0)))
        for lengths in (NINE_SEQUENCES, EQUAL_SEQUENCES, one_long_many_short()):
            cases.append(Case.packed(lengths, 16, 16, 128, causal=True, mode=mode))
        # Score features: fmha raises NotImplementedError for these until their kernels land.
        cases += [Case(4, 16, 16, 4096, 4096, 128, causal=True, mode=mode, softcap=30.0),
                  Case(4, 16, 16, 4096, 4096, 128, causal=True, mode=mode, alibi=True),  # softcap's shape
                  Case(4, 16, 16, 4096, 4096, 64, causal=True, mode=mode, sinks=True),
                  Case(4, 16, 16, 4096, 4096, 128, causal=True, mode=mode, dropout=0.1)]
    return cases


SUITES = {"seeds": seeds, "std": std, "decode": decode, "features": features, "wide": wide, "dims": dims}
# Suites of plain attention: what `fmha tune` keys on (it tunes neither windows nor packed sequences).
PLAIN_SUITES = ("seeds", "std", "decode", "wide", "dims")


def suite_lines(names=tuple(SUITES)) -> list[str]:
    """One line per suite: its name, what it holds and how many forward cases."""
    lines = []
    for name in names:
        function = SUITES[name]
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


def _is_option(part: str) -> bool:
    return "=" in part or part.lower() in FLAG_OPTIONS


def parse_shape(text: str) -> Case:
    """``B,Hq,Hkv,Sq,Sk,D[,causal][,option...]`` from the command line; ValueError says what is wrong and the form.

    The options (:data:`SHAPE_OPTIONS`) add the features of the ``features`` suite.
    """
    fields = [part.strip() for part in text.split(",")]
    parts = [part for part in fields if not _is_option(part)]
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
    options = parse_options(text, [part for part in fields if _is_option(part)])
    try:
        return Case(*sizes, causal=causal, **options)
    except ValueError as error:
        raise ValueError(f"{text!r}: {error}; {expected}") from None


def parse_options(text: str, parts: list[str]) -> dict:
    """The feature options of a ``--shape`` (``window=1023:0``, ``alibi``...) as Case fields."""
    options = {}
    for part in parts:
        name, _, value = part.partition("=")
        name = name.strip().lower()
        problem = None
        if name in options:
            problem = f"{name} is given twice"
        elif name in FLAG_OPTIONS:
            problem = None if not value else f"{name} takes no value"
            options[name] = True
        elif name in ("window", "lengths"):
            try:
                numbers = [int(number) for number in value.split(":")]
            except ValueError:
                numbers = []
            if name == "window":
                if len(numbers) != 2 or min(numbers) < -1:
                    problem = f"window must be LEFT:RIGHT, integers >= -1 (-1: unbounded), got {value!r}"
                options[name] = tuple(None if number == -1 else number for number in numbers)
            else:
                if not numbers or min(numbers) < 0:
                    problem = f"lengths must be integers >= 0 separated by ':', got {value!r}"
                options[name] = tuple(numbers)
        elif name in ("softcap", "dropout"):
            try:
                options[name] = float(value)
            except ValueError:
                problem = f"{name} must be a number, got {value!r}"
        else:
            problem = f"unknown option {part!r}"
        if problem:
            raise ValueError(f"{text!r}: {problem}; options: {SHAPE_OPTIONS}")
    return options
