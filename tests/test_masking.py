"""The Triton masking helpers against the rule itself (fmha.masking.Window), by brute force."""

import itertools

import pytest
import torch
import triton
import triton.language as tl

from fmha.backends.triton.masking import key_blocks, query_blocks
from fmha.masking import Window

pytestmark = pytest.mark.interpreter


@triton.jit
def _ranges_kernel(Out, first, count, length, lo, hi, BLOCK: tl.constexpr, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr, KEYS: tl.constexpr):
    if KEYS:
        a, b, c, d = key_blocks(first, count, length, lo, hi, BLOCK, HAS_LEFT, HAS_RIGHT)
    else:
        a, b, c, d = query_blocks(first, count, length, lo, hi, BLOCK, HAS_LEFT, HAS_RIGHT)
    tl.store(Out + 0, a)
    tl.store(Out + 1, b)
    tl.store(Out + 2, c)
    tl.store(Out + 3, d)


def ranges(keys, first, count, length, lo, hi, block, has_left, has_right):
    out = torch.empty(4, dtype=torch.int32)
    _ranges_kernel[(1,)](out, first, count, length, lo, hi, BLOCK=block, HAS_LEFT=has_left, HAS_RIGHT=has_right,
                         KEYS=keys)
    return out.tolist()


CASES = list(itertools.product([0, 16, 40], [16], [0, 7, 50], [-30, -5, 0, 9], [0, 3, 30], [(False, True), (True, True),
                                                                                               (True, False)]))


@pytest.mark.parametrize("first, count, other, offset, width, sides", CASES)
def test_key_blocks_cover_every_visible_key_and_mask_only_edges(first, count, other, offset, width, sides):
    has_left, has_right = sides
    window = Window(offset, width if has_left else None, 0 if has_right else None)
    block = 16
    lo, hi = offset - width, offset
    rows = torch.arange(first, first + count)
    seen = window.visible(rows, torch.arange(other)) if other else torch.zeros(count, 0, dtype=torch.bool)
    kv_start, full_start, full_end, kv_end = ranges(True, first, count, other, lo, hi, block, has_left, has_right)
    assert kv_start <= full_start <= full_end <= max(kv_end, full_end) and kv_start % block == 0
    visible_keys = seen.any(0).nonzero().flatten().tolist()
    assert all(kv_start <= key < kv_end for key in visible_keys)  # nothing visible is skipped
    assert seen[:, full_start:full_end].all()  # the unmasked blocks are whole for every row
    assert full_start % block == 0 and full_end % block == 0 or full_start == full_end


@pytest.mark.parametrize("first, count, other, offset, width, sides", CASES)
def test_query_blocks_cover_every_row_that_sees_the_keys(first, count, other, offset, width, sides):
    has_left, has_right = sides
    window = Window(offset, width if has_left else None, 0 if has_right else None)
    block = 16
    lo, hi = offset - width, offset
    keys = torch.arange(first, first + count)
    seen = window.visible(torch.arange(other), keys) if other else torch.zeros(0, count, dtype=torch.bool)
    m_start, full_start, full_end, m_end = ranges(False, first, count, other, lo, hi, block, has_left, has_right)
    assert m_start <= full_start <= full_end <= m_end and m_start % block == 0
    rows = seen.any(1).nonzero().flatten().tolist()
    assert all(m_start <= row < m_end for row in rows)
    assert seen[full_start:full_end].all() and (full_start == full_end or full_end <= other)  # unmasked rows exist
