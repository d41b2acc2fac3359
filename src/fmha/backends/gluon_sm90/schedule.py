"""The Hopper forward's schedule: the launch choices of the Gluon kernel, as a config object."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

CONSUMER_ROWS = 64  # query rows per consumer warpgroup
# HopperSchedule.pingpong: the two consumers take turns issuing their products never, always, or
# when the call's score features lengthen the softmax (softcap, dropout, ALiBi both ways).
PINGPONG_OFF, PINGPONG_ON, PINGPONG_LONG_SOFTMAX = 0, 1, 2
# The turns' two named barriers sit above the K/V slots' (fmha.backends.gluon_sm90.forward.TURN_BARRIER).
MAX_STAGES_WITH_TURNS = 3


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
    registers of float32), as three consumers always do (not with dropout, which masks them where
    P·V takes them).
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

    @property
    def block_m(self) -> int:
        return self.consumers * CONSUMER_ROWS

    def to_ints(self) -> tuple[int, ...]:
        return tuple(int(value) for value in dataclasses.astuple(self))

    @classmethod
    def from_ints(cls, values) -> "HopperSchedule":
        names = [field.name for field in dataclasses.fields(cls)]
        return cls(**{name: (bool(value) if name in ("persistent", "dynamic", "pack_p") else int(value))
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
