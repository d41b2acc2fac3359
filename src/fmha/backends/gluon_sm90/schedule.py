"""The Hopper forward's schedule: the launch choices of the Gluon kernel, as a config object."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

CONSUMER_ROWS = 64  # query rows per consumer warpgroup
# HopperSchedule.pingpong: the two consumers take turns issuing their products never, always, or
# when the call's score features lengthen the softmax (softcap, dropout, ALiBi both ways).
PINGPONG_OFF, PINGPONG_ON, PINGPONG_LONG_SOFTMAX = 0, 1, 2
# The turns' two named barriers sit above the K/V slots' (fmha.backends.gluon_sm90.forward.TURN_BARRIER).
MAX_STAGES_WITH_TURNS = 3
# The fewest registers a consumer thread builds with, by (head dim, block_n): sm_90a builds of every
# consumers x ctas_per_sm pair with fewer fail in ptxas ("Insufficient registers"; triton 3.6,
# tests/test_hopper_kernel.py checks the boundary). 64-key blocks at D = 64 need the least.
MIN_CONSUMER_REGISTERS = {(64, 64): 104}
DEFAULT_MIN_CONSUMER_REGISTERS = 160
# Head dims the kernels' tiles are built for. A call's head dim is rounded up to the next of them:
# its tensors' descriptors keep the call's width, so the bulk copies fill the columns past it with
# zeros (which add nothing to Q·Kᵀ and give zero output columns) and the stores leave them out.
# The bulk copies step rows in 16-byte multiples, so the head dim must be a multiple of 8.
TILE_HEAD_DIMS = (64, 128, 256)


def tile_head_dim(head_dim: int) -> int | None:
    """The tile width a head dim runs at: the smallest of TILE_HEAD_DIMS at or above it (None: too wide)."""
    return next((tile for tile in TILE_HEAD_DIMS if head_dim <= tile), None)


def product_columns(head_dim: int) -> int | None:
    """The columns of Q, K and V that the kernels' products read: the tile's width, or 192 for head
    dims 136-192 on the 256-wide tiles (a quarter fewer products; None: too wide)."""
    tile = tile_head_dim(head_dim)
    return 192 if tile == 256 and head_dim <= 192 else tile


def head_dim_refusal(head_dim: int) -> str | None:
    """Why the Gluon kernels cannot take this head dim (None: they can)."""
    if head_dim % 8:
        return f"head dim {head_dim} is not a multiple of 8 (the bulk copies step rows in 16-byte multiples)"
    if tile_head_dim(head_dim) is None:
        return f"head dim {head_dim} is wider than the widest tile built ({TILE_HEAD_DIMS[-1]})"
    return None


# Keys per block a head dim builds with: at D = 256, 128-key blocks' scores and probabilities
# next to the accumulator overflow the consumers' registers.
HEAD_DIM_BLOCK_N = {256: (64,)}
# Shared memory a CTA may ask for on sm_90 (227 KiB), and what the kernel's mbarriers take beyond
# its tiles (under 400 bytes in every build).
SHARED_MEMORY_PER_CTA = 227 * 1024
BARRIER_BYTES = 512
# The largest softcap whose scores the forward softmaxes against a fixed max in bf16
# (fmha.backends.gluon_sm90.scores.SOFTCAP_BOUNDED: 2 · softcap · log2 e - BOUNDED_MAX_OFFSET <= 120).
BOUNDED_SOFTCAP_LIMIT = 52.0


def softcap_kind(params) -> str:
    """How the forward softmaxes a call's softcapped scores: ``""`` (no softcap), ``"bounded"`` against
    a fixed max (SOFTCAP_BOUNDED: bf16, softcap <= BOUNDED_SOFTCAP_LIMIT, and nothing after the tanh
    that moves a score past its bound: no ALiBi, no float attn_mask) or ``"running"``."""
    options = params.options
    if options.softcap <= 0.0:
        return ""
    if (params.dtype == torch.bfloat16 and options.softcap <= BOUNDED_SOFTCAP_LIMIT and not options.has_alibi
            and options.attn_mask_kind in ("", "bool")):
        return "bounded"
    return "running"


def register_budget(consumers: int, ctas_per_sm: int, row_sum_mma: bool = False) -> tuple[int, int, int]:
    """(registers per thread at launch, per consumer thread, per load-warp thread) for ``ctas_per_sm``
    CTAs of ``consumers`` warpgroups and one load warp (padded to a warpgroup) on a multiprocessor.

    The load warp gives its registers to the consumers (setmaxnreg); the launch count fixes how
    many CTAs fit side by side."""
    threads = 128 * (consumers + 1)
    launch = 65536 // (ctas_per_sm * threads) // 8 * 8  # 64k registers per multiprocessor
    # 24 is setmaxnreg's minimum. The two-consumer build keeps the 40 it was measured with, except
    # with the row sums on the tensor cores, whose operand needs the 8 more (240) at D = 128.
    loader = 40 if consumers == 2 and ctas_per_sm == 1 and not row_sum_mma else 24
    consumer = min(240, (launch * threads - 128 * loader) // (128 * consumers) // 8 * 8)
    return launch, consumer, loader


@dataclass(frozen=True)
class HopperSchedule:
    """How the warp-specialised Gluon forward runs a call (see :mod:`fmha.backends.gluon_sm90.forward`).

    ``block_n`` keys per step through a ring of ``stages`` shared-memory slots; ``persistent``:
    ``ctas_per_sm`` programs per multiprocessor walk the tiles (causal ones in longest/shortest
    pairs), otherwise one program per tile; ``consumers``: 1-3 warpgroups of 64 query rows per
    tile; ``emulated_exp2`` (0, 2, 4, 8): one exponential in that many on the FMA units;
    ``q_buffers`` 2: each consumer's next Q tile loads while it works on the current one;
    ``ctas_per_sm``: CTAs sharing a multiprocessor (registers per thread shrink with it);
    ``dynamic`` (persistent only): programs take tiles one at a time from a counter, longest first,
    instead of a fixed share (balanced as one program per tile is, with the tile starts hidden);
    ``pingpong``: the two consumers take turns issuing their products, so that one's softmax runs
    under the other's (:data:`PINGPONG_OFF`, :data:`PINGPONG_ON` with two consumers and at most
    three stages, or :data:`PINGPONG_LONG_SOFTMAX`: on where the call's softcap, dropout or
    two-sided ALiBi lengthens the softmax and the schedule allows it); ``pack_p``: a block's
    probabilities cross the key loop rounded to P·V's operand type, a word per key pair (half the
    registers of float32), as three consumers always do (with dropout the dropped halves of the
    words are cleared as the block ends, or with ``row_sum_mma`` where P·V takes them);
    ``row_sum_mma``: each block's row sums come from the tensor cores, P times a column of ones
    beside P·V, instead of a sum over the block's probabilities on the FMA units (with dropout that
    product takes P before the keep masks, since the sum counts the dropped probabilities); the
    sums, and so the LSE, then count P rounded to 16 bits (up to 2^-8 of a row's sum where it has
    few keys).
    """

    backend: ClassVar[str] = "gluon_sm90"

    block_n: int = 128
    stages: int = 2
    persistent: bool = True
    consumers: int = 2
    emulated_exp2: int = 0
    q_buffers: int = 1
    ctas_per_sm: int = 1
    dynamic: bool = False
    pingpong: int = PINGPONG_LONG_SOFTMAX
    pack_p: bool = False
    row_sum_mma: bool = False

    def __post_init__(self):
        checks = {"block_n": self.block_n in (64, 128), "stages": 1 <= self.stages <= 4,
                  "consumers": self.consumers in (1, 2, 3), "emulated_exp2": self.emulated_exp2 in (0, 2, 4, 8),
                  "q_buffers": self.q_buffers in (1, 2), "ctas_per_sm": 1 <= self.ctas_per_sm <= 4,
                  "dynamic": not self.dynamic or self.persistent,
                  "pingpong": self.pingpong in (PINGPONG_OFF, PINGPONG_LONG_SOFTMAX)
                  or (self.pingpong == PINGPONG_ON and self.turns_fit)}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"HopperSchedule.{name}: {getattr(self, name)!r} is not a valid choice")

    @property
    def turns_fit(self) -> bool:
        """Whether the consumers can take turns: two of them, and the turns' barriers free."""
        return self.consumers == 2 and self.stages <= MAX_STAGES_WITH_TURNS

    def shared_bytes(self, head_dim: int) -> int:
        """Shared memory of a CTA (16-bit elements): each consumer's Q buffers and output staging
        tile (:meth:`output_columns`), the K and V ring, and the barriers."""
        return self._tile_bytes(head_dim, self.output_columns(head_dim))

    def output_columns(self, head_dim: int) -> int:
        """The columns of each consumer's output staging tile: the head dim; half of it where a whole
        tile would not fit (D = 256's: the output then leaves by halves); or 0, where neither fits:
        the output is staged in the consumer's Q buffer, which its tile no longer reads once the last
        Q·Kᵀ is done (one Q buffer; the next tile's Q then loads after the output has left)."""
        for columns in (head_dim, head_dim // 2):
            if self._tile_bytes(head_dim, columns) <= SHARED_MEMORY_PER_CTA:
                return columns
        return 0 if self.q_buffers == 1 else head_dim

    def _tile_bytes(self, head_dim: int, staging_columns: int) -> int:
        rows = CONSUMER_ROWS * self.consumers * self.q_buffers + 2 * self.stages * self.block_n
        return 2 * (head_dim * rows + CONSUMER_ROWS * self.consumers * staging_columns) + BARRIER_BYTES

    def build_refusal(self, head_dim: int) -> str | None:
        """Why this schedule cannot be built for ``head_dim`` (None: it can): its consumers' share
        of the registers is under what the kernel needs, or its tiles overflow shared memory."""
        block_ns = HEAD_DIM_BLOCK_N.get(head_dim, (64, 128))
        if self.block_n not in block_ns:
            return f"{self.text()}: head dim {head_dim} builds with block_n in {block_ns}"
        registers = register_budget(self.consumers, self.ctas_per_sm, self.row_sum_mma)[1]
        needed = MIN_CONSUMER_REGISTERS.get((head_dim, self.block_n), DEFAULT_MIN_CONSUMER_REGISTERS)
        if registers < needed:
            return (f"{self.text()} leaves {registers} registers a consumer thread; head dim {head_dim} "
                    f"with block_n={self.block_n} needs {needed} (fewer consumers or CTAs per multiprocessor)")
        shared = self.shared_bytes(head_dim)
        if shared > SHARED_MEMORY_PER_CTA:
            return (f"{self.text()} needs {shared} bytes of shared memory a CTA at head dim {head_dim}; "
                    f"sm_90 has {SHARED_MEMORY_PER_CTA} (fewer consumers, Q buffers, stages or keys per block)")
        return None

    @property
    def block_m(self) -> int:
        return self.consumers * CONSUMER_ROWS

    def to_ints(self) -> tuple[int, ...]:
        return tuple(int(value) for value in dataclasses.astuple(self))

    @classmethod
    def from_ints(cls, values) -> "HopperSchedule":
        names = [field.name for field in dataclasses.fields(cls)]
        return cls(**{name: (bool(value) if name in ("persistent", "dynamic", "pack_p", "row_sum_mma") else int(value))
                      for name, value in zip(names, values)})

    def to_record(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> "HopperSchedule":
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in record.items() if name in names})

    def text(self) -> str:
        default = HopperSchedule()
        changed = [f"{name}={value}" for name, value in dataclasses.asdict(self).items()
                   if value != getattr(default, name)]
        return "HopperSchedule(" + ", ".join(changed) + ")"
