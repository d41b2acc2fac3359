"""Which keys each query sees: the one rule, as a torch/NumPy predicate.

Query row i sits at key position ``pos(i) = i + offset``: ``offset = Sk - Sq`` aligns the last
query with the last key (FlashAttention's convention, ``fmha.attention``), ``offset = 0`` aligns
the first query with the first key (SDPA's ``is_causal``). Row i sees key j iff

    pos(i) - left <= j <= pos(i) + right        (a side that is None is unbounded)

so ``causal`` is ``right = 0`` and a sliding window sets ``left``. The kernels implement the same
rule in their own DSL (``fmha.backends.triton.masking``, ``fmha.backends.gluon_sm90.masking``);
the reference, the naive baseline's checks and the tests use this one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Window:
    """The visible keys of every query row: ``pos(i) - left <= j <= pos(i) + right``."""

    offset: int = 0
    left: int | None = None
    right: int | None = None

    @classmethod
    def causal(cls, offset: int) -> "Window":
        return cls(offset, None, 0)

    @classmethod
    def of(cls, seqlen_q: int, seqlen_k: int, *, left: int | None = None, right: int | None = None,
           top_left: bool = False) -> "Window":
        """The window of a (Sq, Sk) problem in either alignment."""
        return cls(0 if top_left else seqlen_k - seqlen_q, left, right)

    @property
    def unbounded(self) -> bool:
        return self.left is None and self.right is None

    def visible(self, rows, keys):
        """Boolean (len(rows), len(keys)) array of the pairs this window lets through.

        ``rows`` and ``keys`` are 1-D integer arrays (NumPy or torch, same library).
        """
        position = rows[:, None] + self.offset
        keys = keys[None, :]
        visible = keys >= 0 if self.left is None else keys >= position - self.left
        if self.right is not None:
            visible = visible & (keys <= position + self.right)
        return visible


def window_of(causal_offset: int | None = None, window: Window | None = None) -> Window | None:
    """The window given either as a causal diagonal offset or directly (None: every key visible)."""
    if window is not None:
        if causal_offset is not None:
            raise ValueError("give either causal_offset or window, not both")
        return None if window.unbounded else window
    return None if causal_offset is None else Window.causal(causal_offset)


def visible_mask(seqlen_q: int, seqlen_k: int, window: Window, device=None):
    """The (Sq, Sk) torch bool mask of ``window``."""
    import torch

    return window.visible(torch.arange(seqlen_q, device=device), torch.arange(seqlen_k, device=device))
