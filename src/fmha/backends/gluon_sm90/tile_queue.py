"""Tiles taken one at a time (the kernels' DYNAMIC schedule): persistent CTAs draw tiles from a
per-launch int32 counter, longest first, so that they stay balanced as one CTA per tile is while
each tile's start hides under the previous one's end.

A CTA's load warp draws each tile (one relaxed atomic add) and hands it to the consumer warpgroups
through a ring of TILE_SLOTS shared slots, each with a "ready" mbarrier (one arrival, the load warp's)
and a "free" one (one arrival per consumer); drawing num_tiles or more means there are none left,
and that is handed out too, so every partition leaves its loop; the launch's last draw zeroes the
counter again (:func:`reset_counter`). A slot holds the tile and, where
the kernel asks for them, more int32 words that the load warp read for it (a packed tile's
sequence), so that the consumers do not wait for those loads at their tile's start.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

TILE_SLOTS: gl.constexpr = gl.constexpr(2)
TILE_SLOT_LAYOUT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])


@gluon.jit
def allocate_tile_slots(counter, CONSUMERS: gl.constexpr, WORDS: gl.constexpr = 1):
    """``(counter, tile words, ready barriers, free barriers)``, initialised; call before the partitions
    fork. A slot holds WORDS int32: the tile, and what the load warp worked out about it
    (:func:`hand_out_tile`)."""
    tile_ids = gl.allocate_shared_memory(gl.int32, [TILE_SLOTS * WORDS, 1], TILE_SLOT_LAYOUT)
    tile_ready = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    tile_free = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(TILE_SLOTS):
        mbarrier.init(tile_ready.index(slot), count=1)
        mbarrier.init(tile_free.index(slot), count=CONSUMERS)
    return counter, tile_ids, tile_ready, tile_free


@gluon.jit
def draw_tile(counter):
    """The next tile from the launch's counter. Relaxed: the id orders no other memory access (the
    consumers get it through shared memory and an mbarrier), so no fence waits for the memory
    operations in flight."""
    return gl.atomic_add(counter, 1, sem="relaxed")


@gluon.jit
def reset_counter(counter, last_draw, num_tiles):
    """Zero the launch's counter again once every CTA has drawn past the last tile: each CTA's
    load warp draws until it gets num_tiles or more, so the draw that returns num_tiles +
    num_programs - 1 is the launch's last. A counter kept between launches then needs no fill."""
    if last_draw == num_tiles + gl.num_programs(0) - 1:
        gl.atomic_xchg(counter, 0, sem="relaxed")


@gluon.jit
def hand_out_tile(tile_slots, index, tile, words):
    """The load warp's index-th tile (num_tiles: there are no more) to every consumer, with ``words``
    (a tuple of int32 scalars, one fewer than the slots' WORDS) beside it."""
    tile_ids, tile_ready, tile_free = tile_slots[1], tile_slots[2], tile_slots[3]
    WORDS: gl.constexpr = tile_ids.shape[0] // TILE_SLOTS
    slot = index % TILE_SLOTS
    # Every consumer took the slot's previous tile (the first use finds it free).
    mbarrier.wait(tile_free.index(slot), ((index // TILE_SLOTS) & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    tile_ids.index(slot * WORDS).store(gl.full([1], tile, gl.int32, layout))
    for word in gl.static_range(WORDS - 1):
        tile_ids.index(slot * WORDS + 1 + word).store(gl.full([1], words[word], gl.int32, layout))
    mbarrier.arrive(tile_ready.index(slot), count=1)


@gluon.jit
def _slot_word(tile_ids, position):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    return gl.max(tile_ids.index(position).load(layout), axis=0)


@gluon.jit
def take_tile(tile_slots, index):
    """A consumer's index-th tile from the load warp (:func:`hand_out_tile`): the tile, or with
    words beside it, ``(tile, words)``."""
    tile_ids, tile_ready, tile_free = tile_slots[1], tile_slots[2], tile_slots[3]
    WORDS: gl.constexpr = tile_ids.shape[0] // TILE_SLOTS
    slot = index % TILE_SLOTS
    mbarrier.wait(tile_ready.index(slot), (index // TILE_SLOTS) & 1)
    tile = _slot_word(tile_ids, slot * WORDS)
    if WORDS == 1:
        mbarrier.arrive(tile_free.index(slot), count=1)
        return tile
    else:
        words = ()
        for word in gl.static_range(WORDS - 1):
            words = words + (_slot_word(tile_ids, slot * WORDS + 1 + word),)
        mbarrier.arrive(tile_free.index(slot), count=1)
        return tile, words
