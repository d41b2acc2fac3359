"""Releasing ring slots through named hardware barriers (``bar.arrive`` / ``bar.sync``).

A consumer warpgroup that is done with a K or V slot tells the load warp so. Through an mbarrier,
Triton has one thread arrive, and its shared-memory hazard analysis treats that arrive as touching
all of shared memory: it puts a barrier over the warpgroup before the arrive and another before
the next shared-memory access, three per key block of the forward. The warps of a warpgroup then
wait for each other at every block.

A named barrier needs neither: each consumer warp signals it with ``bar.arrive``, which does not
wait, and the load warp waits with ``bar.sync`` until all consumer warps and itself are there.
The hardware has 16 of them per CTA; the compiler's warp partitions use the first ones, so the
slots take barriers from :data:`FIRST_SLOT_BARRIER` on.

An instance of a named barrier completes once the given number of threads has arrived; the next
arrivals start a new one. Slot s of a ring of STAGES is filled again at position p + STAGES only
after the load warp's wait for position p completes, so no consumer arrives twice in one instance.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

FIRST_SLOT_BARRIER = gl.constexpr(8)


@gluon.constexpr_function
def _barrier_asm(instruction, threads):
    return f"{instruction} $1, {threads};\n\tmov.u32 $0, 0;"


@gluon.jit
def _per_thread(value):
    """``value`` as a tensor with exactly one element per thread of the partition, so that inline
    assembly over it runs once in every thread."""
    WARPS: gl.constexpr = gl.num_warps()
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    return gl.full([32 * WARPS], 0, gl.int32, layout) + value


@gluon.jit
def signal(barrier, THREADS: gl.constexpr):
    """Arrive at named barrier ``barrier`` (THREADS threads in all, the waiting ones included) without waiting."""
    gl.inline_asm_elementwise(_barrier_asm("bar.arrive", THREADS), "=r,r", [_per_thread(barrier)], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def wait(barrier, THREADS: gl.constexpr):
    """Wait at named barrier ``barrier`` until THREADS threads (this partition's included) are there."""
    gl.inline_asm_elementwise(_barrier_asm("bar.sync", THREADS), "=r,r", [_per_thread(barrier)], dtype=gl.int32,
                              is_pure=False, pack=1)
