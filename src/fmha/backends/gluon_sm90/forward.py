"""The fused forward for Hopper (sm_90), written in Gluon, Triton's explicit-layout dialect.

Same math as :mod:`fmha.backends.triton.forward` (online softmax in exp2 with the scale folded in,
causal blocks above the diagonal skipped), scheduled the way cuDNN and FlashAttention-3 do it,
which Triton's automatic pipeliner does not reach on this chip:

* a CTA walks query tiles of BLOCK_M = 64 x CONSUMERS rows of one (batch, head) (persistent: as
  many CTAs as fit on the multiprocessors, or one per tile) and runs CONSUMERS + 1 warp
  partitions: one to three consumer warpgroups of 64 rows each and one load warp;
* the load warp streams K and V blocks through a ring of STAGES shared-memory slots with
  bulk tensor copies (TMA); each slot has a "ready" mbarrier (the copy landed) and a named
  hardware barrier that the consumers' warps signal when they are done with it
  (:mod:`fmha.backends.gluon_sm90.slot_barriers`: no warpgroup barrier in the consumers' loop);
* each consumer keeps its Q rows in shared memory and its accumulator in registers and
  overlaps its own work: the Q·Kᵀ of block j and the P·V of block j-1 are in flight on the
  tensor cores while it waits, and the softmax of block j runs while P·V of block j-1 finishes;
* the consumers run independently, so one's softmax overlaps another's matrix products;
* while the consumers finish a tile (last P·V, normalisation, output store), the load warp
  already fetches the next tile's Q, K and V: the per-tile start-up is hidden. With Q_BUFFERS = 2
  each consumer has a second Q buffer, so its next Q is loaded while it still works on the
  current tile rather than after it;
* persistent causal programs take their tiles in pairs, the longest and the shortest query
  block of a head, so that every program gets the same number of key blocks;
* CTAS_PER_SM > 1 lowers the registers per thread so that several CTAs share a multiprocessor:
  with one consumer each, one CTA's tile start and end hide behind the others' work, which pays
  on short tiles (short causal sequences) and on grids too small to fill the GPU.

ROW_SUM_MMA takes each block's row sums from the tensor cores: P times a [BLOCK_N, 8] tile of ones,
issued behind P·V, replaces the sum over the block's probabilities (about 70 of a consumer
thread's 480 instructions per block at head dim 64). The sums are then those of P as P·V takes
it, rounded to 16 bits. It pays where the issue slots bind (three consumers at D = 64) and costs
where the tensor cores do. With dropout, P·ones takes P before the keep masks and P·V after them.

EMULATED_EXP2 = k computes one exponential in every k on the FMA units (a cubic polynomial,
relative error 1e-4, far below the 16-bit rounding of P) instead of the MUFU unit, whose 16
results per clock per multiprocessor otherwise pace the softmax at head dim 64.

Rows past the end of a sequence load as zeros and are never stored (the descriptors carry the
bounds). Packed sequences (varlen) share one descriptor: a tile's rows past its sequence read the
next sequence's tokens, which the mask hides, and a tile that ends past its sequence stores its
rows without the bulk copy. A tile walks only the key blocks its rows can see (:mod:`fmha.backends.gluon_sm90.masking`:
a left and a right bound, each optional); keys past the end and outside the window in the edge
blocks are masked to -inf.

Dropout (DROPOUT) keeps the portable kernels' pattern bit for bit, so that their backward, which
regenerates it, can follow this forward: each consumer thread runs Philox for the counters of its
own accumulator columns (:func:`fmha.backends.gluon_sm90.scores.dropout_draws`) after the block's
row sum, which counts every probability, and the draws clear the dropped probabilities where
P·V takes its operand (:func:`fmha.backends.gluon_sm90.scores.dropped`): only the kept ones enter
P·V.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ...compat import cta_barrier, reinterpret_shared, tma_load, tma_store
from . import slot_barriers
from .chain import wait_for_previous_kernel
from .schedule import register_budget as schedule_registers
from .tile_queue import allocate_tile_slots, draw_tile, hand_out_tile, reset_counter, take_tile
from .masking import head_and_entry, key_blocks, sequence_span, visible, visible_block
from .scores import (ALIBI_CAUSAL, ALIBI_CAUSAL_MMA, BOUNDED_MAX_OFFSET, NO_MASK, SOFTCAP_BOUNDED, alibi_form,
                     draw_layout, dropout_draws, dropout_key, dropped, dropped_words, expand_mask, load_mask, mask_rows,
                     masked_scores, pair_conversion, pair_rows, tanh_approx)

LN_2: gl.constexpr = gl.constexpr(0.6931471805599453)
LOG2_E: gl.constexpr = gl.constexpr(1.4426950408889634)
# HAS_LEFT: 0 no left bound, 1 a left bound, WIDE_LEFT a window so wide (fmha.backends.gluon_sm90.launch.left_bound)
# that the masked blocks at a tile's right end lie right of every row's left bound.
WIDE_LEFT: gl.constexpr = gl.constexpr(2)
CONSUMER_WARPS = gl.constexpr(4)


@gluon.constexpr_function
def _slot_threads(CONSUMERS: gl.constexpr):
    """The threads that meet at a slot's barrier: every consumer warp and the load warp."""
    return 32 * (CONSUMER_WARPS * CONSUMERS + 1)


@gluon.jit
def _k_slot_barrier(slot):
    """The named barrier of K slot ``slot`` (:mod:`fmha.backends.gluon_sm90.slot_barriers`): the
    consumers' warps signal it when done with the slot, the load warp waits at it before refilling."""
    return slot_barriers.FIRST_SLOT_BARRIER + slot


@gluon.jit
def _v_slot_barrier(slot, STAGES: gl.constexpr):
    return slot_barriers.FIRST_SLOT_BARRIER + STAGES + slot


# Two consumers taking turns (TURN 0 or 1; -1: no turns): consumer c waits at named barrier
# TURN_BARRIER + c before issuing a block's products and signals the other's once they are issued,
# so that one's softmax runs while the other's products do. Above the slots' barriers
# (HopperSchedule.turns_fit: at most three stages).
TURN_BARRIER = gl.constexpr(14)
TURN_THREADS = gl.constexpr(2 * 32 * CONSUMER_WARPS.value)  # both consumer warpgroups


@gluon.jit
def _take_turn(TURN: gl.constexpr):
    if TURN >= 0:
        slot_barriers.wait(TURN_BARRIER + TURN, TURN_THREADS)


@gluon.jit
def _pass_turn(TURN: gl.constexpr):
    if TURN >= 0:
        slot_barriers.signal(TURN_BARRIER + 1 - TURN, TURN_THREADS)


register_budget = gluon.constexpr_function(schedule_registers)  # callable in the kernel and on the host


@gluon.constexpr_function
def _worker_registers(consumers, ctas_per_sm, row_sum_mma):
    """worker_num_regs: consumers 1.. (consumer 0 is the default partition), then the load warp."""
    _, consumer, loader = register_budget(consumers, ctas_per_sm, row_sum_mma)
    return [consumer] * (consumers - 1) + [loader]


@gluon.constexpr_function
def accumulator_layout(columns):
    """wgmma accumulator of a consumer: 4 warps x 16 rows, one instruction spans all columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                     instr_shape=[16, columns, 16])


@gluon.constexpr_function
def operand_layout(columns):
    """P as the register A operand of the P·V wgmma whose accumulator has ``columns`` columns."""
    return gl.DotOperandLayout(operand_index=0, parent=accumulator_layout(columns), k_width=2)


@gluon.constexpr_function
def _exp2_asm(every):
    """PTX for ``every`` exponentials: the first by polynomial on the FMA units, the rest by MUFU.

    2^x = 2^n * 2^f with n = round(x) (adding 1.5 * 2^23 rounds and leaves n in the low bits),
    f = x - n in [-0.5, 0.5], 2^f ~ 1 + f (c1 + f (c2 + f c3)), and 2^n added to the exponent
    bits. x is clamped to -127 first, where f = 0 and the bits come out as exactly 0.0
    (exp2(-inf) = 0 for masked keys)."""
    polynomial = (
        "max.ftz.f32 %ex_in, ${arg}, 0fC2FE0000;\n"
        "add.rn.f32 %ex_shift, %ex_in, 0f4B400000;\n"
        "sub.rn.f32 %ex_int, %ex_shift, 0f4B400000;\n"
        "sub.rn.f32 %ex_frac, %ex_in, %ex_int;\n"
        "fma.rn.f32 %ex_poly, %ex_frac, 0f3D6150AE, 0f3E7805FF;\n"
        "fma.rn.f32 %ex_poly, %ex_poly, %ex_frac, 0f3F317AFD;\n"
        "fma.rn.f32 %ex_poly, %ex_poly, %ex_frac, 0f3F800000;\n"
        "mov.b32 %ex_bits, %ex_shift;\n"
        "shl.b32 %ex_bits, %ex_bits, 23;\n"
        "mov.b32 %ex_pbits, %ex_poly;\n"
        "add.s32 $0, %ex_pbits, %ex_bits;\n"
    ).format(arg=every)
    mufu = "".join(f"ex2.approx.ftz.f32 ${i}, ${every + i};\n" for i in range(1, every))
    return ("{\n.reg .f32 %ex_in, %ex_shift, %ex_int, %ex_frac, %ex_poly;\n.reg .b32 %ex_bits, %ex_pbits;\n"
            + polynomial + mufu + "}")


@gluon.constexpr_function
def _exp2_constraints(every):
    return ",".join(["=r"] * every + ["r"] * every)


@gluon.jit
def _exp2(x, EMULATED_EXP2: gl.constexpr):
    """exp2, with one element in every EMULATED_EXP2 computed on the FMA units (0: none)."""
    if EMULATED_EXP2 == 0:
        result = gl.exp2(x)
    else:
        result = gl.inline_asm_elementwise(_exp2_asm(EMULATED_EXP2), _exp2_constraints(EMULATED_EXP2), [x],
                                           dtype=gl.float32, is_pure=True, pack=EMULATED_EXP2)
    return result


# Shared layout of the ALiBi key-term tiles: rows of 16 elements (32 bytes).
BIAS_LAYOUT: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
BIAS_COLUMNS: gl.constexpr = gl.constexpr(16)  # one k-step of a 16-bit wgmma


@gluon.jit
def _alibi_key_terms(staging, slope, qk_scale, BLOCK_N: gl.constexpr):
    """``(ones, terms)``: shared-memory operands whose product [ROWS, BLOCK_N] is ``slope · j / qk_scale``
    in every row, for key j of a block, so that one more k-step of the scores' wgmma adds ALiBi's
    key term (:func:`_scores`). The term goes in three bf16 parts (about 24 bits, as an fp32
    value) against three columns of ones. ``staging`` is the consumer's output buffer, idle until
    the tile's end: the tiles are rewritten at every tile start (the previous output has left)."""
    ROWS: gl.constexpr = staging.shape[2]
    dtype: gl.constexpr = staging.dtype
    layout: gl.constexpr = gl.BlockedLayout([1, BIAS_COLUMNS], [32, 1], [gl.num_warps(), 1], [1, 0])
    # The whole buffer as rows of 16 (triton 3.8 reinterprets only to the same size); its first
    # 2 · BLOCK_N rows hold the terms, then the ones (ROWS <= BLOCK_N).
    buffer_rows: gl.constexpr = ROWS * staging.shape[3] // BIAS_COLUMNS
    gl.static_assert(buffer_rows >= 2 * BLOCK_N)
    tiles = reinterpret_shared(staging, dtype, [buffer_rows, BIAS_COLUMNS], BIAS_LAYOUT)
    columns = gl.arange(0, BIAS_COLUMNS, layout=gl.SliceLayout(0, layout))[None, :]
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    value = (slope / qk_scale) * keys.to(gl.float32)
    high = value.to(dtype).to(gl.float32)
    middle = (value - high).to(dtype).to(gl.float32)
    low = value - high - middle
    terms = gl.where(columns == 0, high[:, None],
                     gl.where(columns == 1, middle[:, None], gl.where(columns == 2, low[:, None], 0.0)))
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))[:, None]
    ones = gl.where((columns < 3) & (rows >= 0), 1.0, 0.0)
    tma.store_wait(0)  # the previous tile's output has left the buffer
    tiles.slice(0, BLOCK_N).store(terms.to(dtype))
    tiles.slice(BLOCK_N, ROWS).store(ones.to(dtype))
    fence_async_shared()
    cta_barrier()  # every thread's part is written before the wgmma reads it
    return tiles.slice(BLOCK_N, ROWS), tiles.slice(0, BLOCK_N).permute((1, 0))


# With COLUMNS < HEAD_DIM (head dims up to 192 on the 256-wide tiles) the products read the first
# COLUMNS columns of Q, K and V, and the output accumulator is a pair: columns [0, 128) and
# [128, COLUMNS) (Gluon's tensors have power-of-two shapes).
SPLIT_COLUMNS = gl.constexpr(128)


@gluon.jit
def columns_product(a, b, initial, COLUMNS: gl.constexpr):
    """Issues a · bᵀ (async) over the first COLUMNS columns of the shared-memory tiles a and b: one
    product, or two (SPLIT_COLUMNS, then the rest) where COLUMNS is narrower than the tiles."""
    if COLUMNS == a.shape[1]:
        product = warpgroup_mma(a, b.permute((1, 0)), initial, use_acc=False, is_async=True)
    else:
        REST: gl.constexpr = COLUMNS - SPLIT_COLUMNS
        product = warpgroup_mma(a.slice(0, SPLIT_COLUMNS, dim=1), b.slice(0, SPLIT_COLUMNS, dim=1).permute((1, 0)),
                                initial, use_acc=False, is_async=True)
        product = warpgroup_mma(a.slice(SPLIT_COLUMNS, REST, dim=1), b.slice(SPLIT_COLUMNS, REST, dim=1).permute((1, 0)),
                                product, is_async=True)
    return product


@gluon.jit
def _scores(q, k, initial, mods, ALIBI: gl.constexpr, COLUMNS: gl.constexpr):
    """Issues Q·Kᵀ (async) over Q's and K's first COLUMNS columns (k: the [BLOCK_N, HEAD_DIM] tile),
    plus ALiBi's key term with ALIBI_CAUSAL_MMA."""
    scores = columns_product(q, k, initial, COLUMNS)
    if ALIBI == ALIBI_CAUSAL_MMA:
        ones, terms = mods[5]
        scores = warpgroup_mma(ones, terms, scores, is_async=True)
    return scores


@gluon.constexpr_function
def _score_groups(head_dim, columns):
    """wgmma groups Q·Kᵀ issues (one per product)."""
    return 1 if columns == head_dim else 2


@gluon.jit
def _zero_output(ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, COLUMNS: gl.constexpr):
    """The output accumulator of a tile: [ROWS, HEAD_DIM], or the pair of its first COLUMNS columns."""
    if COLUMNS == HEAD_DIM:
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=accumulator_layout(HEAD_DIM))
    else:
        acc = (gl.zeros([ROWS, SPLIT_COLUMNS], gl.float32, layout=accumulator_layout(SPLIT_COLUMNS)),
               gl.zeros([ROWS, COLUMNS - SPLIT_COLUMNS], gl.float32,
                        layout=accumulator_layout(COLUMNS - SPLIT_COLUMNS)))
    return acc


@gluon.jit
def _output_product(p, v, acc, HEAD_DIM: gl.constexpr, COLUMNS: gl.constexpr):
    """Issues acc += P·V (async; v: the [BLOCK_N, HEAD_DIM] tile)."""
    if COLUMNS == HEAD_DIM:
        acc = warpgroup_mma(p, v, acc, is_async=True)
    else:
        REST: gl.constexpr = COLUMNS - SPLIT_COLUMNS
        low = warpgroup_mma(gl.convert_layout(p, operand_layout(SPLIT_COLUMNS), assert_trivial=True),
                            v.slice(0, SPLIT_COLUMNS, dim=1), acc[0], is_async=True)
        high = warpgroup_mma(gl.convert_layout(p, operand_layout(REST), assert_trivial=True),
                             v.slice(SPLIT_COLUMNS, REST, dim=1), acc[1], is_async=True)
        acc = (low, high)
    return acc


@gluon.jit
def _output_wait(acc, row_sum, HEAD_DIM: gl.constexpr, COLUMNS: gl.constexpr):
    """Waits for every product issued, P·V and the row sums among them."""
    if COLUMNS == HEAD_DIM:
        acc, row_sum = warpgroup_mma_wait(0, deps=(acc, row_sum))
    else:
        low, high, row_sum = warpgroup_mma_wait(0, deps=(acc[0], acc[1], row_sum))
        acc = (low, high)
    return acc, row_sum


@gluon.jit
def _output_times(acc, factor, HEAD_DIM: gl.constexpr, COLUMNS: gl.constexpr):
    """acc · factor per row (factor: [ROWS] in any row layout)."""
    if COLUMNS == HEAD_DIM:
        acc = acc * gl.convert_layout(factor, gl.SliceLayout(1, accumulator_layout(HEAD_DIM)))[:, None]
    else:
        acc = (acc[0] * gl.convert_layout(factor, gl.SliceLayout(1, accumulator_layout(SPLIT_COLUMNS)))[:, None],
               acc[1] * gl.convert_layout(factor, gl.SliceLayout(1, acc[1].type.layout))[:, None])
    return acc


@gluon.jit
def _output_over(acc, divisor, HEAD_DIM: gl.constexpr, COLUMNS: gl.constexpr):
    """acc / divisor per row."""
    if COLUMNS == HEAD_DIM:
        acc = acc / gl.convert_layout(divisor, gl.SliceLayout(1, accumulator_layout(HEAD_DIM)))[:, None]
    else:
        acc = (acc[0] / gl.convert_layout(divisor, gl.SliceLayout(1, accumulator_layout(SPLIT_COLUMNS)))[:, None],
               acc[1] / gl.convert_layout(divisor, gl.SliceLayout(1, acc[1].type.layout))[:, None])
    return acc


@gluon.jit
def _output_to(acc, dtype: gl.constexpr, HEAD_DIM: gl.constexpr, COLUMNS: gl.constexpr):
    if COLUMNS == HEAD_DIM:
        out = acc.to(dtype)
    else:
        out = (acc[0].to(dtype), acc[1].to(dtype))
    return out


@gluon.jit
def _stage_output(out, staging, HEAD_DIM: gl.constexpr, COLUMNS: gl.constexpr):
    """The output tile into the [ROWS, HEAD_DIM] staging buffer (its first COLUMNS columns)."""
    if COLUMNS == HEAD_DIM:
        staging.store(out)
    else:
        staging.slice(0, SPLIT_COLUMNS, dim=1).store(out[0])
        staging.slice(SPLIT_COLUMNS, COLUMNS - SPLIT_COLUMNS, dim=1).store(out[1])


@gluon.jit
def _paired(num_tiles, HAS_RIGHT: gl.constexpr, VARLEN: gl.constexpr):
    """Whether this launch walks causal tiles in pairs: persistent (fewer programs than tiles) and
    causal. Packed sequences take their tiles from the longest-first list instead."""
    if HAS_RIGHT and not VARLEN:
        paired = gl.num_programs(0) < num_tiles
    else:
        paired = False
    return paired


@gluon.jit
def _program_steps(num_tiles, HAS_RIGHT: gl.constexpr, VARLEN: gl.constexpr):
    """How many tiles this program walks."""
    programs = gl.num_programs(0)
    program = gl.program_id(0)
    steps = gl.cdiv(num_tiles - program, programs)
    if _paired(num_tiles, HAS_RIGHT, VARLEN):
        # Pairs program, program + P, ... of cdiv(num_tiles, 2); the last pair of an odd count is one tile.
        num_pairs = (num_tiles + 1) // 2
        slots = gl.cdiv(num_pairs - program, programs)
        last_slot = program + (slots - 1) * programs
        steps = 2 * slots - ((last_slot == num_pairs - 1) & (num_tiles % 2 == 1)).to(gl.int32)
    return steps


@gluon.jit
def _tile_coordinates(step, num_tiles, num_m_blocks, num_q_heads, group_size, seqlen_k, lo, hi,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                      DYNAMIC: gl.constexpr):
    """The program's step-th tile (DYNAMIC: tile ``step`` itself). Tile t covers query block
    t % num_m_blocks of (batch, head) t // num_m_blocks: the query blocks of one head run side by
    side and share K/V in L2.

    Causal tiles differ in length (the last rows see the most keys). With one program per tile
    they run longest first within a head, so the short tiles fill the tail of the wave. A
    persistent program takes them in pairs, the longest and the shortest query block left in a
    head (m and M - 1 - m), so that every pair, and every program, has the same number of key
    blocks: program p walks pairs p, p + P, p + 2P, ... of the cdiv(T, 2) pairs, the last one too
    (dealing the remainder out as single tiles left some programs twice the work of others).
    Tiles taken from a counter (DYNAMIC) come longest first within a head, as with one program per
    tile; there the last heads of a causal launch walk their blocks together
    (:func:`head_and_entry`), so that their longest tiles do not start last."""
    programs = gl.num_programs(0)
    if DYNAMIC:
        tile = step
    else:
        tile = gl.program_id(0) + step * programs
    m_block = tile % num_m_blocks
    batch_head = tile // num_m_blocks
    if HAS_RIGHT:
        if not DYNAMIC and _paired(num_tiles, HAS_RIGHT, False):
            tile = 2 * (gl.program_id(0) + (step // 2) * programs) + step % 2
            local = tile % num_m_blocks
            if local % 2 == 0:
                m_block = num_m_blocks - 1 - local // 2
            else:
                m_block = local // 2
            batch_head = tile // num_m_blocks
        elif HAS_LEFT:
            m_block = num_m_blocks - 1 - m_block
        else:
            batch_head, m_block = head_and_entry(tile, num_m_blocks, num_tiles // num_m_blocks)
            m_block = num_m_blocks - 1 - m_block
    head = batch_head % num_q_heads
    first_row = m_block * BLOCK_M
    # Key blocks [start, end): [start, full_start) and [full_end, end) need the mask, the others not.
    blocks = key_blocks(first_row, BLOCK_M, seqlen_k, lo, hi, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    return batch_head // num_q_heads, head, head // group_size, first_row, blocks


@gluon.jit
def _sequence_words(tile, sequences, num_tiles, num_q_heads, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr):
    """What a packed tile reads from memory: ``(sequence, first row, q_start, seqlen_q, k_start,
    seqlen_k)``: its entry of the list (:func:`head_and_entry`); the sequence is -1 past the list's
    end."""
    cu_seqlens_q, cu_seqlens_k, tiles = sequences
    entry = head_and_entry(tile, num_tiles // num_q_heads, num_q_heads)[1]
    seq = gl.load(tiles + 2 * entry)
    first_row = gl.load(tiles + 2 * entry + 1) * BLOCK_M
    q_start, seq_q = sequence_span(cu_seqlens_q, gl.maximum(seq, 0), seqlen_q)
    k_start, seq_k = sequence_span(cu_seqlens_k, gl.maximum(seq, 0), seqlen_k)
    return seq, first_row, q_start, seq_q, k_start, seq_k


@gluon.jit
def _tile(step, sequences, num_tiles, num_m_blocks, num_q_heads, group_size, seqlen_q, seqlen_k, lo, hi,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
          VARLEN: gl.constexpr, DYNAMIC: gl.constexpr, words):
    """The program's step-th tile (DYNAMIC: tile ``step`` itself): ``(valid, batch, head, kv_head, first_row, q_start, k_start,
    seqlen_q, seqlen_k, lo, hi, key blocks, sequence)``, its sequence's lengths and window in its own
    rows; ``sequence`` is the batch index, or the packed sequence's.

    Packed sequences (VARLEN): ``sequences`` holds cu_seqlens_q, cu_seqlens_k and the tile list
    (:mod:`fmha.backends.triton.varlen`), taken head after head, the last few together
    (:func:`head_and_entry`: a head's tiles side by side share its K/V in L2); seqlen_q and
    seqlen_k arrive as the packed totals, lo and hi without the sequence's Sk - Sq. Entries past
    the list's end are not valid. ``words``: the tile's :func:`_sequence_words`, where the caller
    has them already (else they are loaded). Dense tiles start at token 0 of their batch."""
    if VARLEN:
        if DYNAMIC:
            tile = step
        else:
            tile = gl.program_id(0) + step * gl.num_programs(0)
        if len(words) == 0:
            words = _sequence_words(tile, sequences, num_tiles, num_q_heads, seqlen_q, seqlen_k, BLOCK_M)
        seq, first_row, q_start, seq_q, k_start, seq_k = words
        head = head_and_entry(tile, num_tiles // num_q_heads, num_q_heads)[0]
        seq_lo = lo + seq_k - seq_q
        seq_hi = hi + seq_k - seq_q
        blocks = key_blocks(first_row, BLOCK_M, seq_k, seq_lo, seq_hi, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        # Packed tensors are viewed as one batch of (1, H, total, D).
        return (seq >= 0, 0, head, head // group_size, first_row, q_start, k_start, seq_q, seq_k, seq_lo, seq_hi, blocks,
                seq)
    else:
        batch, head, kv_head, first_row, blocks = _tile_coordinates(
            step, num_tiles, num_m_blocks, num_q_heads, group_size, seqlen_k, lo, hi,
            BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, DYNAMIC)
        return True, batch, head, kv_head, first_row, 0, 0, seqlen_q, seqlen_k, lo, hi, blocks, batch


@gluon.jit
def _load_tile(
    step, ring_position, tile_count, args, counter,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    CONSUMERS: gl.constexpr, VARLEN: gl.constexpr, DYNAMIC: gl.constexpr, words,
):
    """The load warp's part of one tile: its consumers' Q blocks, then its K/V blocks through the
    ring. ``step``: the program's step, or with DYNAMIC the tile itself; returns the ring position
    and tile count after it, and with DYNAMIC the next tile, drawn from ``counter`` between the last
    block's K and V: the draw's round trip overlaps the wait for V's slot instead of holding up the
    next tile's Q and first K."""
    if VARLEN:
        (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready,
         num_tiles, num_m_blocks, num_q_heads, group_size, seqlen_q, seqlen_k, lo, hi, sequences) = args
    else:
        (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready,
         num_tiles, num_m_blocks, num_q_heads, group_size, seqlen_k, lo, hi) = args
        seqlen_q = 0  # not read: dense tiles come from num_m_blocks
        sequences = None
    consumer_rows: gl.constexpr = q_desc.block_type.shape[2]
    Q_BUFFERS: gl.constexpr = q_smem.shape[0] // CONSUMERS
    valid, batch, head, kv_head, first_row, q_start, k_start, _, _, _, _, blocks, _ = _tile(
        step, sequences, num_tiles, num_m_blocks, num_q_heads, group_size, seqlen_q, seqlen_k, lo, hi,
        CONSUMERS * consumer_rows, BLOCK_N, HAS_LEFT, HAS_RIGHT, VARLEN, DYNAMIC, words)
    next_tile = 0
    if valid:
        start, _, _, end = blocks
        q_phase = (tile_count // Q_BUFFERS) & 1
        for consumer in gl.static_range(CONSUMERS):
            q_slot = consumer * Q_BUFFERS + tile_count % Q_BUFFERS
            # A free barrier completes once per use; the first wait finds it free.
            mbarrier.wait(q_free.index(q_slot), q_phase ^ 1)
            mbarrier.expect(q_ready.index(q_slot), q_desc.block_type.nbytes)
            tma_load(q_desc, [batch, head, q_start + first_row + consumer * consumer_rows, 0],
                     q_ready.index(q_slot), q_smem.index(q_slot))
        for block in range(start, end - 1):
            _load_block(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, batch, kv_head, k_start, block,
                        ring_position + block - start, STAGES, CONSUMERS, True, True)
        if end > start:
            last = end - 1
            position = ring_position + last - start
            LAST_V_NOW: gl.constexpr = not DYNAMIC
            _load_block(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, batch, kv_head, k_start, last, position,
                        STAGES, CONSUMERS, True, LAST_V_NOW)
            if DYNAMIC:  # the next tile, drawn while the last block's V slot frees
                next_tile = draw_tile(counter)
                _load_block(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, batch, kv_head, k_start, last, position,
                            STAGES, CONSUMERS, False, True)
        elif DYNAMIC:
            next_tile = draw_tile(counter)
        ring_position += end - start
        tile_count += 1
    elif DYNAMIC:
        next_tile = draw_tile(counter)
    return ring_position, tile_count, next_tile


@gluon.jit
def _load_block(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, batch, kv_head, k_start, block, position,
                STAGES: gl.constexpr, CONSUMERS: gl.constexpr, LOAD_K: gl.constexpr, LOAD_V: gl.constexpr):
    """Key block ``block``'s K (LOAD_K) and V (LOAD_V) into ring ``position``'s slot, once the
    consumers have released it (the first STAGES find it free)."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    slot = position % STAGES
    if LOAD_K:
        if position >= STAGES:
            slot_barriers.wait(_k_slot_barrier(slot), _slot_threads(CONSUMERS))
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma_load(k_desc, [batch, kv_head, k_start + block * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
    if LOAD_V:
        if position >= STAGES:
            slot_barriers.wait(_v_slot_barrier(slot, STAGES), _slot_threads(CONSUMERS))
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma_load(v_desc, [batch, kv_head, k_start + block * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _load_partition(
    args,  # :func:`_load_tile` unpacks them
    tile_slots,  # with DYNAMIC: the tile counter and the hand-out ring (fmha.backends.gluon_sm90.tile_queue)
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    CONSUMERS: gl.constexpr, VARLEN: gl.constexpr, DYNAMIC: gl.constexpr,
):
    num_tiles = args[10]
    ring_position = 0  # K/V blocks loaded so far, over all tiles: slot and phase of the next one
    tile_count = 0
    if DYNAMIC:  # take tiles from the launch's counter and hand each to the consumers; num_tiles: done
        counter = tile_slots[0]
        handed = 0
        tile = draw_tile(counter)
        while tile < num_tiles:
            words = ()
            if VARLEN:  # the consumers get the tile's sequence with it: no loads at their tile's start
                num_q_heads, seqlen_q, seqlen_k, sequences = args[12], args[14], args[15], args[18]
                words = _sequence_words(tile, sequences, num_tiles, num_q_heads, seqlen_q, seqlen_k,
                                        CONSUMERS * args[0].block_type.shape[2])
            hand_out_tile(tile_slots, handed, tile, words)
            ring_position, tile_count, tile = _load_tile(tile, ring_position, tile_count, args, counter, BLOCK_N,
                                                         STAGES, HAS_LEFT, HAS_RIGHT, CONSUMERS, VARLEN, DYNAMIC,
                                                         words)
            handed += 1
        reset_counter(counter, tile, num_tiles)
        if VARLEN:
            hand_out_tile(tile_slots, handed, num_tiles, (0, 0, 0, 0, 0, 0))
        else:
            hand_out_tile(tile_slots, handed, num_tiles, ())
    else:
        for step in range(_program_steps(num_tiles, HAS_RIGHT, VARLEN)):
            ring_position, tile_count, _ = _load_tile(step, ring_position, tile_count, args, tile_slots[0], BLOCK_N,
                                                      STAGES, HAS_LEFT, HAS_RIGHT, CONSUMERS, VARLEN, DYNAMIC, ())
    # Take the consumers' last releases: no named barrier is left half-arrived when the CTA exits.
    for position in range(gl.maximum(ring_position - STAGES, 0), ring_position):
        slot = position % STAGES
        slot_barriers.wait(_k_slot_barrier(slot), _slot_threads(CONSUMERS))
        slot_barriers.wait(_v_slot_barrier(slot, STAGES), _slot_threads(CONSUMERS))


@gluon.jit
def _softmax_block(
    scores,  # [ROWS, BLOCK_N] f32, Q·Kᵀ unscaled
    row_max, row_sum,  # [ROWS] f32, log2 units
    rows, keys0, key_start, seqlen_k, lo, hi, qk_scale, mods, mask_tile,
    MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, EMULATED_EXP2: gl.constexpr,
    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, MASK: gl.constexpr, MASK_KEYS: gl.constexpr,
    ROW_SUM_MMA: gl.constexpr,
):
    """Probabilities of the key block starting at key_start (its keys are key_start + keys0), the
    accumulator's rescale factor, the new max and sum. ``mods``: the score features' values
    ``(softcap_scale, slope, row_positions, dropout, mask_rows)`` (:func:`_tile_mods`), and with
    ALIBI_CAUSAL_MMA the key-term operands (:func:`_alibi_key_terms`); ``mask_tile``: the block's
    attn_mask with MASK (:func:`fmha.backends.gluon_sm90.scores.load_mask`).

    Each score is ``scores * qk_scale + row_shift`` in log2 units: without ALiBi the row shift is 0
    and the scale joins the max's subtraction in one FMA per score. With ALIBI_CAUSAL every visible
    key sits at or before its row's position, so ``-slope · |pos(i) - j|`` splits into a term per
    key of the block (``slope · keys0``) and one per row (``slope · (key_start - pos(i))``); the
    block-relative terms stay small (no cancellation against large positions). Without a softcap
    the key term is already in ``scores`` (:func:`_alibi_key_terms`, added by the tensor cores) and
    only the row shift is left; with one, it is one FMA per score after the tanh."""
    row_shift = 0.0
    if SOFTCAP or ALIBI:
        softcap_scale, slope, row_positions = mods[0], mods[1], mods[2]
        if SOFTCAP:
            scores = tanh_approx(scores * qk_scale)
            qk_scale = softcap_scale
        if ALIBI == ALIBI_CAUSAL or ALIBI == ALIBI_CAUSAL_MMA:
            row_shift = slope * (key_start - row_positions)
            if ALIBI == ALIBI_CAUSAL:
                scores = scores * qk_scale + _block_key_positions(keys0, key_start, slope)[None, :]
                qk_scale = 1.0
        elif ALIBI:  # the distance both ways; block-relative positions
            distance = (row_positions - key_start)[:, None] - _block_key_positions(keys0, key_start, 1.0)[None, :]
            scores = scores * qk_scale - slope * gl.abs(distance)
            qk_scale = 1.0
    if MASK != NO_MASK:
        element_type: gl.constexpr = mods[4].dtype.element_ty
        s_layout: gl.constexpr = scores.type.layout
        mask_tile = expand_mask(mask_tile, element_type, s_layout, MASK, MASK_KEYS)
        scores, qk_scale = masked_scores(scores, qk_scale, mask_tile, MASK)
    if MASKED:
        # Block-relative keys: shift the window and the end of K by the block's first key. Both
        # bounds: a word of bits per row; one: a compare per score (bits measured slower there).
        if HAS_LEFT:
            seen = visible_block(rows, keys0, seqlen_k - key_start, lo - key_start, hi - key_start, HAS_LEFT,
                                 HAS_RIGHT)
        else:
            seen = visible(rows[:, None], keys0[None, :], seqlen_k - key_start, lo - key_start, hi - key_start,
                           HAS_LEFT, HAS_RIGHT)
        scores = gl.where(seen, scores, float("-inf"))
    if SOFTCAP == SOFTCAP_BOUNDED:  # row_max is the fixed bound (:func:`_initial_max`); no ALiBi
        probs = _exp2(scores * qk_scale - row_max[:, None], EMULATED_EXP2)
        rescale = gl.full_like(row_max, 1.0)  # unread
        new_max = row_max
        if not ROW_SUM_MMA:
            row_sum = row_sum + gl.sum(probs, 1)
    else:
        new_max = gl.maximum(row_max, gl.max(scores, 1) * qk_scale + row_shift)
        # A row that has seen no key keeps max = -inf; subtracting 0 gives exp2(-inf) = 0, not NaN.
        new_max_safe = gl.where(new_max == float("-inf"), 0.0, new_max)
        probs = _exp2(scores * qk_scale - (new_max_safe - row_shift)[:, None], EMULATED_EXP2)
        rescale = gl.exp2(row_max - new_max_safe)
        if not ROW_SUM_MMA:  # else the tensor cores sum P (_summed_rows) and the caller rescales
            row_sum = row_sum * rescale + gl.sum(probs, 1)
    return probs, rescale, new_max, row_sum


@gluon.jit
def _block_key_positions(keys0, key_start, factor):
    """``factor · keys0`` as floats, built in each block from two values per thread: the wgmma
    accumulator gives a thread columns ``8i + c`` with a fixed pair c, so ``8i`` folds into constants.
    The factor passes through a term of the block (``x · 0.0`` is not folded), or the compiler would
    hoist all 32 of a thread's values out of the loop and keep them live, which spills at D = 128."""
    factor = factor + key_start.to(gl.float32) * 0.0
    return (keys0 // 8 * 8).to(gl.float32) * factor + (keys0 % 8).to(gl.float32) * factor


@gluon.jit
def _tile_mods(score_args, sequence, head, rows, seqlen_q, seqlen_k, dropout, ALIBI: gl.constexpr,
               MASK: gl.constexpr):
    """``(softcap_scale, slope, row_positions, dropout, mask_rows)`` of a tile: its head's ALiBi
    slope (log2 units; 0 where off), the rows' positions ``i + Sk - Sq`` as floats, ``dropout``
    (:func:`_tile_dropout`) as given, and the rows' pointers into the attn_mask
    (:func:`fmha.backends.gluon_sm90.scores.mask_rows`; 0 without MASK)."""
    AlibiSlopes, stride_ab, stride_ah, softcap_scale = score_args[0], score_args[1], score_args[2], score_args[3]
    slope = 0.0
    if ALIBI:
        slope = gl.load(AlibiSlopes + sequence.to(gl.int64) * stride_ab + head.to(gl.int64) * stride_ah) * LOG2_E
    row_positions = (rows + (seqlen_k - seqlen_q)).to(gl.float32)
    row_pointers = 0
    if MASK != NO_MASK:
        row_pointers = mask_rows(score_args[9], sequence, head, rows, seqlen_q, score_args[10])
    return softcap_scale, slope, row_positions, dropout, row_pointers


@gluon.jit
def _block_mask(mods, key_start, keys0, seqlen_k, score_args, MASKED: gl.constexpr, MASK: gl.constexpr,
                MASK_KEYS: gl.constexpr):
    """The attn_mask's tile of a key block (0 without MASK), loaded while the block's scores are computed."""
    tile = 0
    if MASK != NO_MASK:
        s_layout: gl.constexpr = keys0.type.layout.parent
        tile = load_mask(mods[4], key_start, seqlen_k, score_args[10][3], s_layout, MASKED, MASK_KEYS)
    return tile


@gluon.jit
def _tile_dropout(first_row, rng_row, rng_key, threshold, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """``(key, row_words, thresholds)`` of a consumer's ROWS rows from ``first_row``: the Philox key,
    each row pair's counter row word and the threshold in both halves of a word
    (:func:`fmha.backends.gluon_sm90.scores.dropped`; ``threshold`` >= 1). Counters are numbered as
    the portable kernels number them (:func:`fmha.backends.triton.scores.score_mods`): row i of the
    tile's (batch, head) is row ``rng_row + i`` of the call."""
    row_words = pair_rows(first_row, rng_row, ROWS // 2, gl.SliceLayout(1, draw_layout(BLOCK_N)))
    return rng_key, row_words, threshold.to(gl.uint32) * 65537


@gluon.jit
def _softmax_first_block(scores, row_sum, rows, keys0, key_start, seqlen_k, lo, hi, qk_scale, mods, mask_tile, masked,
                         HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, EMULATED_EXP2: gl.constexpr,
                         SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, MASK: gl.constexpr, MASK_KEYS: gl.constexpr,
                         ROW_SUM_MMA: gl.constexpr):
    """The first block of a tile: nothing to rescale yet. A masked one checks both sides of a window:
    a third build of this step for a window's left edge alone (one compare less per score) made the
    kernel larger and no faster (docs/perf.md, "One masked build of the first block instead of two")."""
    row_max = _initial_max(mods, scores.shape[0], gl.SliceLayout(1, scores.type.layout), SOFTCAP)
    if masked:
        probs, rescale, row_max, row_sum = _softmax_block(
            scores, row_max, row_sum, rows, keys0, key_start, seqlen_k, lo, hi, qk_scale, mods, mask_tile, True,
            HAS_LEFT, HAS_RIGHT, EMULATED_EXP2, SOFTCAP, ALIBI, MASK, MASK_KEYS, ROW_SUM_MMA)
    else:
        probs, rescale, row_max, row_sum = _softmax_block(
            scores, row_max, row_sum, rows, keys0, key_start, seqlen_k, lo, hi, qk_scale, mods, mask_tile, False,
            HAS_LEFT, HAS_RIGHT, EMULATED_EXP2, SOFTCAP, ALIBI, MASK, MASK_KEYS, ROW_SUM_MMA)
    return probs, row_max, row_sum


@gluon.jit
def _initial_max(mods, ROWS: gl.constexpr, layout: gl.constexpr, SOFTCAP: gl.constexpr):
    """The rows' max before any key (log2 units): -inf, or with SOFTCAP_BOUNDED the fixed max that
    every block subtracts, BOUNDED_MAX_OFFSET below the softcap's bound ``mods[0]``."""
    if SOFTCAP == SOFTCAP_BOUNDED:
        row_max = gl.full([ROWS], mods[0] - BOUNDED_MAX_OFFSET, gl.float32, layout=layout)
    else:
        row_max = gl.full([ROWS], float("-inf"), gl.float32, layout=layout)
    return row_max


ONES_COLUMNS = gl.constexpr(8)  # the narrowest wgmma: N = 8


@gluon.jit
def _no_row_sum(ROWS: gl.constexpr, rows_layout: gl.constexpr, ROW_SUM_MMA: gl.constexpr):
    """A tile's row sums before any key: [ROWS], or with ROW_SUM_MMA the [ROWS, ONES_COLUMNS]
    accumulator of P·ones (every column the row's sum)."""
    if ROW_SUM_MMA:
        row_sum = gl.zeros([ROWS, ONES_COLUMNS], gl.float32, layout=accumulator_layout(ONES_COLUMNS))
    else:
        row_sum = gl.zeros([ROWS], gl.float32, layout=rows_layout)
    return row_sum


@gluon.jit
def _summed_rows(p, ones, row_sum, ROW_SUM_MMA: gl.constexpr):
    """With ROW_SUM_MMA, issues row_sum += P·ones (async): the tensor cores sum the block's P as P·V
    takes it, in place of a sum on the FMA units."""
    if ROW_SUM_MMA:
        row_sum = warpgroup_mma(gl.convert_layout(p, operand_layout(ONES_COLUMNS)), ones, row_sum, is_async=True)
    return row_sum


@gluon.jit
def _row_sums(row_sum, rows_layout: gl.constexpr, ROW_SUM_MMA: gl.constexpr):
    """The tile's row sums as [ROWS] in ``rows_layout``."""
    if ROW_SUM_MMA:
        row_sum = gl.convert_layout(gl.max(row_sum, 1), rows_layout)
    return row_sum


@gluon.constexpr_function
def packs_probs(consumers, pack_p):
    """Whether a block's probabilities cross the key loop packed in P·V's operand type (half the
    registers of float32; ``HopperSchedule.pack_p``): always with three consumers (160 registers a
    thread)."""
    return consumers == 3 or bool(pack_p)


@gluon.constexpr_function
def masks_at_tail(packed_p, dropout, row_sum_mma):
    """Whether a block's packed P words are masked where the block ends (:func:`_pipelined_blocks`)
    rather than where P·V takes them: then the words cross the key loop ready for P·V, and nothing
    is left to do between a consumer's turn and its products. Not with ``row_sum_mma``, whose
    product takes the words unmasked."""
    return bool(packed_p) and bool(dropout) and not row_sum_mma


@gluon.jit
def _p_operand(probs, draws, dropout, dtype: gl.constexpr, layout: gl.constexpr, DROPOUT: gl.constexpr,
               ROW_SUM_MMA: gl.constexpr):
    """P·V's operand from a block's probabilities (float32, or words packed where the softmax ended,
    :func:`_packed_probs`): rounded to ``dtype``, with dropout's zeros (the block's ``draws``,
    :func:`fmha.backends.gluon_sm90.scores.dropout_draws`) where it is on, unless the words were
    masked already (:func:`masks_at_tail`). Made where P·V takes it, so the words go straight to the
    operand's registers. Returns ``(p, whole)``: ``whole``, the operand of the row sums
    (:func:`_summed_rows`), counts the dropped probabilities too."""
    if probs.dtype == gl.uint32:
        whole = _unpacked_probs(probs, dtype)
        if DROPOUT and not masks_at_tail(True, DROPOUT, ROW_SUM_MMA):
            p = _unpacked_probs(dropped_words(probs, draws, dropout[2]), dtype)
        else:
            p = whole
    elif DROPOUT:
        p, whole = dropped(probs, draws, dropout[2], dtype)
    else:
        p = probs.to(dtype)
        whole = p
    return gl.convert_layout(p, layout), gl.convert_layout(whole, layout)


@gluon.constexpr_function
def _pack_asm(dtype):
    return pair_conversion(dtype) + " $0, $2, $1;"


@gluon.jit
def _packed_probs(probs, dtype: gl.constexpr):
    """uint32 [ROWS, BLOCK_N // 2]: each key pair's probabilities rounded to ``dtype``, one word (the
    P·V operand's registers), so that a block's P lives across the loop in half the registers."""
    ROWS: gl.constexpr = probs.shape[0]
    BLOCK_N: gl.constexpr = probs.shape[1]
    even, odd = gl.split(probs.reshape([ROWS, BLOCK_N // 2, 2]))
    return gl.inline_asm_elementwise(_pack_asm(dtype), "=r,r,r", [even, odd], dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def _unpacked_probs(words, dtype: gl.constexpr):
    """The inverse of :func:`_packed_probs`: [ROWS, 2 · columns] in ``dtype``."""
    low, high = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [words], dtype=(gl.int16, gl.int16),
                                          is_pure=True, pack=1)
    return gl.join(low, high).reshape([words.shape[0], 2 * words.shape[1]]).to(dtype, bitcast=True)


@gluon.jit
def _packed_block(probs, draws, dropout, dtype: gl.constexpr, PACKED_P: gl.constexpr, DROPOUT: gl.constexpr,
                  ROW_SUM_MMA: gl.constexpr):
    """A block's probabilities as they cross the key loop: float32, or with PACKED_P P·V's words,
    dropout's zeros in them where :func:`masks_at_tail`."""
    if PACKED_P:
        probs = _packed_probs(probs, dtype)
        if masks_at_tail(PACKED_P, DROPOUT, ROW_SUM_MMA):
            probs = dropped_words(probs, draws, dropout[2])
    return probs


@gluon.jit
def _pipelined_blocks(
    acc, probs, draws, row_max, row_sum, q, k_smem, v_smem, k_ready, v_ready,
    rows, keys0, ring_base, block_start, block_end, seqlen_k, lo, hi, qk_scale, mods, score_args, ones,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
    MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, EMULATED_EXP2: gl.constexpr,
    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, DROPOUT: gl.constexpr, TURN: gl.constexpr,
    MASK: gl.constexpr, MASK_KEYS: gl.constexpr, PACK_P: gl.constexpr, ROW_SUM_MMA: gl.constexpr,
    COLUMNS: gl.constexpr,
):
    """Key blocks [block_start, block_end), each issued with the previous block's P·V; key block b
    sits at ring position ring_base + b. ``probs``: those of the block before (:func:`_packed_block`);
    ``draws``: its dropout draws (DROPOUT), applied where P·V takes P (:func:`_p_operand`) or where
    the block ended (:func:`masks_at_tail`)."""
    ROWS: gl.constexpr = q.shape[0]
    p_layout: gl.constexpr = operand_layout(HEAD_DIM)
    no_scores = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=accumulator_layout(BLOCK_N))
    PACKED_P: gl.constexpr = packs_probs(CONSUMERS, PACK_P)
    for block in range(block_start, block_end):
        position = ring_base + block
        slot = position % STAGES
        prev_slot = (position - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (position // STAGES) & 1)
        k = k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])
        if TURN >= 0:  # everything but the products before the turn
            p, whole_p = _p_operand(probs, draws, mods[3], v_smem.dtype, p_layout, DROPOUT, ROW_SUM_MMA)
            _take_turn(TURN)
        scores = _scores(q, k, no_scores, mods, ALIBI, COLUMNS)
        mask_tile = _block_mask(mods, block * BLOCK_N, keys0, seqlen_k, score_args, MASKED, MASK, MASK_KEYS)
        mbarrier.wait(v_ready.index(prev_slot), ((position - 1) // STAGES) & 1)
        v = v_smem.index(prev_slot).reshape([BLOCK_N, HEAD_DIM])  # [BLOCK_N, HEAD_DIM]
        if TURN < 0:
            p, whole_p = _p_operand(probs, draws, mods[3], v_smem.dtype, p_layout, DROPOUT, ROW_SUM_MMA)
        acc = _output_product(p, v, acc, HEAD_DIM, COLUMNS)
        row_sum = _summed_rows(whole_p, ones, row_sum, ROW_SUM_MMA)
        _pass_turn(TURN)
        # wgmma groups retire in order: this waits for the scores, not for P·V (nor the row sums).
        scores = warpgroup_mma_wait(_score_groups(HEAD_DIM, COLUMNS) + (1 if ROW_SUM_MMA else 0), deps=(scores,))
        slot_barriers.signal(_k_slot_barrier(slot), _slot_threads(CONSUMERS))
        probs, rescale, row_max, row_sum = _softmax_block(
            scores, row_max, row_sum, rows, keys0, block * BLOCK_N, seqlen_k, lo, hi, qk_scale, mods, mask_tile,
            MASKED, HAS_LEFT, HAS_RIGHT, EMULATED_EXP2, SOFTCAP, ALIBI, MASK, MASK_KEYS, ROW_SUM_MMA)
        if DROPOUT:  # the row sum counts every probability, P·V only the kept ones
            draws = dropout_draws(block * BLOCK_N, mods[3], BLOCK_N)
        acc, row_sum = _output_wait(acc, row_sum, HEAD_DIM, COLUMNS)
        slot_barriers.signal(_v_slot_barrier(prev_slot, STAGES), _slot_threads(CONSUMERS))
        if SOFTCAP != SOFTCAP_BOUNDED:
            acc = _output_times(acc, rescale, HEAD_DIM, COLUMNS)
            if ROW_SUM_MMA:
                row_sum = row_sum * gl.convert_layout(rescale, gl.SliceLayout(1, row_sum.type.layout))[:, None]
        probs = _packed_block(probs, draws, mods[3], v_smem.dtype, PACKED_P, DROPOUT, ROW_SUM_MMA)
    return acc, probs, draws, row_max, row_sum


@gluon.jit
def _column_halves(out, HEAD_DIM: gl.constexpr, COLUMNS: gl.constexpr):
    """The output's columns [0, HEAD_DIM / 2) and [HEAD_DIM / 2, COLUMNS), each in its accumulator
    layout (where COLUMNS < HEAD_DIM, the pair already is)."""
    if COLUMNS == HEAD_DIM:
        ROWS: gl.constexpr = out.shape[0]
        HALF: gl.constexpr = HEAD_DIM // 2
        low, high = out.reshape([ROWS, 2, HALF]).permute((0, 2, 1)).split()
        layout: gl.constexpr = accumulator_layout(HALF)  # the halves' registers, no data moves
        halves = (gl.convert_layout(low, layout, assert_trivial=True), gl.convert_layout(high, layout, assert_trivial=True))
    else:
        gl.static_assert(SPLIT_COLUMNS == HEAD_DIM // 2)  # the pair splits where the halves do
        halves = out
    return halves


@gluon.jit
def _stage_columns(part, staging):
    """``part`` ([ROWS, n], n <= the staging tile's columns) into the staging tile's first n columns."""
    if part.shape[1] == staging.shape[1]:
        staging.store(part)
    else:
        staging.slice(0, part.shape[1], dim=1).store(part)


@gluon.jit
def _store_output(out, staging, o_desc, coordinates, HEAD_DIM: gl.constexpr, COLUMNS: gl.constexpr):
    """A tile of the output through shared memory and bulk tensor stores (which leave out the
    columns past the call's head dim): at once, or through a staging tile of half the columns
    (:func:`fmha.backends.gluon_sm90.schedule.HopperSchedule.output_columns`), one half after the other."""
    ROWS: gl.constexpr = o_desc.block_type.shape[2]
    STAGED: gl.constexpr = o_desc.block_type.shape[3]
    tma.store_wait(0)  # the previous tile's output has left the staging buffer
    if STAGED == HEAD_DIM:
        _stage_output(out, staging.reshape([ROWS, HEAD_DIM]), HEAD_DIM, COLUMNS)
        fence_async_shared()
        tma_store(o_desc, coordinates, staging)
    else:
        low, high = _column_halves(out, HEAD_DIM, COLUMNS)
        _stage_columns(low, staging.reshape([ROWS, STAGED]))
        fence_async_shared()
        tma_store(o_desc, coordinates, staging)
        tma.store_wait(0)  # the low half has left (the compiler adds the barrier for the other threads)
        _stage_columns(high, staging.reshape([ROWS, STAGED]))
        fence_async_shared()
        # columns past the call's head dim (stale ones among them) are left out
        tma_store(o_desc, [coordinates[0], coordinates[1], coordinates[2], STAGED], staging)


@gluon.jit
def _rows_from_staging(staging, base, stride_row, row0, num_rows, num_columns, first_column):
    """Rows row0 + i < num_rows of the [ROWS, n] staging tile, as columns first_column + j under
    num_columns, with plain stores: each thread's 8 columns leave in one 16-byte store (head dims
    are multiples of 8, base and stride_row 16-byte multiples: the launchers' attributes)."""
    ROWS: gl.constexpr = staging.shape[0]
    STAGED: gl.constexpr = staging.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    cta_barrier()  # every row is in shared memory before any thread reads another's
    out = staging.load(layout)
    cta_barrier()  # and read before the buffer is written again
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    columns = first_column + gl.arange(0, STAGED, layout=gl.SliceLayout(0, layout))
    pointers = base + rows.to(gl.int64)[:, None] * stride_row + columns[None, :]
    num_columns = num_columns // 8 * 8
    gl.store(pointers, out, mask=(rows[:, None] < num_rows) & (columns[None, :] < num_columns))


@gluon.jit
def _store_rows(out, staging, base, stride_row, row0, num_rows, num_columns, ROWS: gl.constexpr,
                HEAD_DIM: gl.constexpr, COLUMNS: gl.constexpr):
    """Rows row0 + i < num_rows, columns under num_columns (the call's head dim, which the tile's
    may exceed), of a tile, through the staging buffer (no room for another; whole or by halves,
    as :func:`_store_output`) and plain stores."""
    STAGED: gl.constexpr = staging.shape[3]
    tma.store_wait(0)  # the previous tile's output has left the staging buffer
    staging = staging.reshape([ROWS, STAGED])
    if STAGED == HEAD_DIM:
        _stage_output(out, staging, HEAD_DIM, COLUMNS)
        _rows_from_staging(staging, base, stride_row, row0, num_rows, num_columns, 0)
    else:
        low, high = _column_halves(out, HEAD_DIM, COLUMNS)
        _stage_columns(low, staging)
        _rows_from_staging(staging, base, stride_row, row0, num_rows, num_columns, 0)
        _stage_columns(high, staging)
        _rows_from_staging(staging, base, stride_row, row0, num_rows, num_columns, STAGED)


@gluon.jit
def _consumer_tile(
    step, ring_position, tile_count, shared, tile_args,
    CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, EMULATED_EXP2: gl.constexpr,
    VARLEN: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, SINKS: gl.constexpr, DROPOUT: gl.constexpr,
    DYNAMIC: gl.constexpr, TURN: gl.constexpr, MASK: gl.constexpr, MASK_KEYS: gl.constexpr, PACK_P: gl.constexpr,
    ROW_SUM_MMA: gl.constexpr, OUTPUT_COLUMNS: gl.constexpr, COLUMNS: gl.constexpr, words,
):
    """One tile of a consumer: its 64 rows' output and LSE. ``step``: the program's step, or with
    DYNAMIC the tile itself (and a packed tile's :func:`_sequence_words` from the load warp);
    returns the ring position and tile count after it."""
    if VARLEN:  # also the sequences, and the output's pointer and strides
        (q_smem, o_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, o_desc, Lse,
         num_tiles, num_m_blocks, num_q_heads, group_size, seqlen_q, seqlen_k, lo, hi, qk_scale, score_args, ones,
         packed) = shared
        sequences, Out, stride_lh, stride_om, stride_oh = packed
    else:
        (q_smem, o_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, o_desc, Lse,
         num_tiles, num_m_blocks, num_q_heads, group_size, seqlen_q, seqlen_k, lo, hi, qk_scale, score_args,
         ones) = shared
        sequences = None
    rng_key = tile_args
    dtype: gl.constexpr = o_desc.dtype
    ROWS: gl.constexpr = o_desc.block_type.shape[2]
    s_layout: gl.constexpr = accumulator_layout(BLOCK_N)
    p_layout: gl.constexpr = operand_layout(HEAD_DIM)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    keys0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # [BLOCK_N]
    Q_BUFFERS: gl.constexpr = q_smem.shape[0] // CONSUMERS
    PACKED_P: gl.constexpr = packs_probs(CONSUMERS, PACK_P)
    valid, batch, head, kv_head, first_row, q_start, k_start, seq_q, seq_k, seq_lo, seq_hi, blocks, sequence = _tile(
        step, sequences, num_tiles, num_m_blocks, num_q_heads, group_size, seqlen_q, seqlen_k, lo, hi,
        CONSUMERS * ROWS, BLOCK_N, HAS_LEFT, HAS_RIGHT, VARLEN, DYNAMIC, words)
    if valid:
        start, full_start, full_end, end = blocks
        ring_base = ring_position - start  # key block b sits at ring position ring_base + b
        row0 = first_row + CONSUMER * ROWS
        rows = row0 + gl.arange(0, ROWS, layout=s_rows)  # [ROWS]
        dropout = 0
        if DROPOUT:  # counter rows as the portable kernels number them: (batch, head, row), or (head, packed row)
            rng_row = (batch * num_q_heads + head).to(gl.int64) * seqlen_q + q_start
            dropout = _tile_dropout(row0, rng_row, rng_key, score_args[7], ROWS, BLOCK_N)
        mods = _tile_mods(score_args, sequence, head, rows, seq_q, seq_k, dropout, ALIBI, MASK)
        if ALIBI == ALIBI_CAUSAL_MMA:
            mods = mods + (_alibi_key_terms(o_smem.index(CONSUMER), mods[1], qk_scale, BLOCK_N),)
        row_max = _initial_max(mods, ROWS, s_rows, SOFTCAP)
        row_sum = _no_row_sum(ROWS, s_rows, ROW_SUM_MMA)
        acc = _zero_output(ROWS, HEAD_DIM, COLUMNS)
        q_slot = CONSUMER * Q_BUFFERS + tile_count % Q_BUFFERS
        mbarrier.wait(q_ready.index(q_slot), (tile_count // Q_BUFFERS) & 1)
        q = q_smem.index(q_slot).reshape([ROWS, HEAD_DIM])  # [ROWS, HEAD_DIM]
        if end > start:
            # The first block: scores and probabilities; its P·V is issued with the next block's Q·Kᵀ.
            slot = ring_position % STAGES
            mbarrier.wait(k_ready.index(slot), (ring_position // STAGES) & 1)
            k = k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])
            _take_turn(TURN)
            scores = _scores(q, k, gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout), mods, ALIBI, COLUMNS)
            _pass_turn(TURN)
            mask_tile = _block_mask(mods, start * BLOCK_N, keys0, seq_k, score_args, True, MASK, MASK_KEYS)
            scores = warpgroup_mma_wait(0, deps=(scores,))
            slot_barriers.signal(_k_slot_barrier(slot), _slot_threads(CONSUMERS))
            probs, row_max, row_sum = _softmax_first_block(
                scores, row_sum, rows, keys0, start * BLOCK_N, seq_k, seq_lo, seq_hi, qk_scale, mods, mask_tile,
                (start < full_start) | (start >= full_end), HAS_LEFT, HAS_RIGHT, EMULATED_EXP2,
                SOFTCAP, ALIBI, MASK, MASK_KEYS, ROW_SUM_MMA)
            draws = 0
            if DROPOUT:
                draws = dropout_draws(start * BLOCK_N, mods[3], BLOCK_N)
            probs = _packed_block(probs, draws, mods[3], dtype, PACKED_P, DROPOUT, ROW_SUM_MMA)
            # Blocks wholly visible to every row run without masks; the window's edges and the end
            # of K with: masked (start, full_start), unmasked [full_start, full_end), masked after.
            unmasked_start = gl.maximum(full_start, start + 1)
            unmasked_end = gl.maximum(full_end, unmasked_start)
            if HAS_LEFT:
                acc, probs, draws, row_max, row_sum = _pipelined_blocks(
                    acc, probs, draws, row_max, row_sum, q, k_smem, v_smem, k_ready, v_ready,
                    rows, keys0, ring_base, start + 1, unmasked_start, seq_k, seq_lo, seq_hi, qk_scale,
                    mods, score_args, ones, HEAD_DIM, BLOCK_N, STAGES, CONSUMERS, True, HAS_LEFT, HAS_RIGHT,
                    EMULATED_EXP2, SOFTCAP, ALIBI, DROPOUT, TURN, MASK, MASK_KEYS, PACK_P, ROW_SUM_MMA, COLUMNS)
            acc, probs, draws, row_max, row_sum = _pipelined_blocks(
                acc, probs, draws, row_max, row_sum, q, k_smem, v_smem, k_ready, v_ready,
                rows, keys0, ring_base, unmasked_start, unmasked_end, seq_k, seq_lo, seq_hi, qk_scale,
                mods, score_args, ones, HEAD_DIM, BLOCK_N, STAGES, CONSUMERS, False, HAS_LEFT, HAS_RIGHT,
                EMULATED_EXP2, SOFTCAP, ALIBI, DROPOUT, TURN, MASK, MASK_KEYS, PACK_P, ROW_SUM_MMA, COLUMNS)
            # With WIDE_LEFT the blocks at the right end lie right of every row's left bound: one
            # compare per score instead of two.
            RIGHT_END_LEFT: gl.constexpr = HAS_LEFT and not (HAS_LEFT == WIDE_LEFT and HAS_RIGHT)
            acc, probs, draws, row_max, row_sum = _pipelined_blocks(
                acc, probs, draws, row_max, row_sum, q, k_smem, v_smem, k_ready, v_ready,
                rows, keys0, ring_base, unmasked_end, end, seq_k, seq_lo, seq_hi, qk_scale,
                mods, score_args, ones, HEAD_DIM, BLOCK_N, STAGES, CONSUMERS, True, RIGHT_END_LEFT, HAS_RIGHT,
                EMULATED_EXP2, SOFTCAP, ALIBI, DROPOUT, TURN, MASK, MASK_KEYS, PACK_P, ROW_SUM_MMA, COLUMNS)
            last = ring_position + end - start - 1
            last_slot = last % STAGES
            mbarrier.wait(v_ready.index(last_slot), (last // STAGES) & 1)
            v = v_smem.index(last_slot).reshape([BLOCK_N, HEAD_DIM])
            p, whole_p = _p_operand(probs, draws, mods[3], dtype, p_layout, DROPOUT, ROW_SUM_MMA)
            _take_turn(TURN)
            acc = _output_product(p, v, acc, HEAD_DIM, COLUMNS)
            row_sum = _summed_rows(whole_p, ones, row_sum, ROW_SUM_MMA)
            _pass_turn(TURN)
            acc, row_sum = _output_wait(acc, row_sum, HEAD_DIM, COLUMNS)
            slot_barriers.signal(_v_slot_barrier(last_slot, STAGES), _slot_threads(CONSUMERS))
        row_sum = _row_sums(row_sum, s_rows, ROW_SUM_MMA)
        if OUTPUT_COLUMNS != 0:
            mbarrier.arrive(q_free.index(q_slot), count=1)  # the load warp may refill this Q buffer

        # Rows that saw no key: output 0 and LSE -inf, never 0/0.
        seen = row_sum > 0.0
        if SINKS:
            # The sink joins the row's max and denominator: exp2(sink - top) of mass that goes nowhere.
            Sinks, stride_sh = score_args[4], score_args[5]
            sink = gl.load(Sinks + head.to(gl.int64) * stride_sh) * LOG2_E
            top = gl.maximum(row_max, sink)
            top = gl.where(top == float("-inf"), 0.0, top)
            kept = gl.exp2(row_max - top)
            total = gl.where(seen, row_sum * kept + gl.exp2(sink - top), 1.0)
            factor = gl.where(seen, kept / total, 0.0)
            if DROPOUT:  # kept probabilities count 1 / (1 - p) times
                factor = factor * score_args[8]
            out = _output_times(acc, factor, HEAD_DIM, COLUMNS)
            lse = gl.where(seen, (top + gl.log2(total)) * LN_2, float("-inf"))
        else:
            row_sum_safe = gl.where(seen, row_sum, 1.0)
            if DROPOUT:  # kept probabilities count 1 / (1 - p) times
                out = _output_times(acc, score_args[8] / row_sum_safe, HEAD_DIM, COLUMNS)
            else:
                out = _output_over(acc, row_sum_safe, HEAD_DIM, COLUMNS)
            lse = gl.where(seen, (row_max + gl.log2(row_sum_safe)) * LN_2, float("-inf"))
        if VARLEN:  # (Hq, total_q)
            lse_base = Lse + head.to(gl.int64) * stride_lh + q_start
        else:  # (B, Hq, Sq)
            lse_base = Lse + (batch * num_q_heads + head).to(gl.int64) * seqlen_q
        gl.store(lse_base + rows, lse, mask=rows < seq_q)
        if VARLEN:
            if row0 + ROWS <= seq_q:
                _store_output(_output_to(out, dtype, HEAD_DIM, COLUMNS), o_smem.index(CONSUMER), o_desc,
                              [batch, head, q_start + row0, 0], HEAD_DIM, COLUMNS)
            else:  # the sequence ends inside the tile: its rows only (the next sequence's follow)
                _store_rows(_output_to(out, dtype, HEAD_DIM, COLUMNS), o_smem.index(CONSUMER),
                            Out + q_start.to(gl.int64) * stride_om + head.to(gl.int64) * stride_oh, stride_om, row0,
                            seq_q, o_desc.shape[3], ROWS, HEAD_DIM, COLUMNS)
        else:  # the descriptor clips rows past the end
            _store_output(_output_to(out, dtype, HEAD_DIM, COLUMNS), o_smem.index(CONSUMER), o_desc,
                          [batch, head, row0, 0], HEAD_DIM, COLUMNS)
        if OUTPUT_COLUMNS == 0:  # the output has left the Q buffer (the issuing thread waits, the
            # others wait for it): the load warp may refill it
            tma.store_wait(0)
            cta_barrier()
            mbarrier.arrive(q_free.index(q_slot), count=1)
        ring_position += end - start
        tile_count += 1
    return ring_position, tile_count


@gluon.jit
def _consumer_partition(
    shared,  # the runtime arguments every consumer gets (:func:`_consumer_tile` unpacks them)
    tile_slots,  # with DYNAMIC: the hand-out ring (fmha.backends.gluon_sm90.tile_queue)
    CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, EMULATED_EXP2: gl.constexpr,
    VARLEN: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, SINKS: gl.constexpr, DROPOUT: gl.constexpr,
    DYNAMIC: gl.constexpr, PINGPONG: gl.constexpr, PACK_P: gl.constexpr, MASK: gl.constexpr,
    MASK_KEYS: gl.constexpr, ROW_SUM_MMA: gl.constexpr, OUTPUT_COLUMNS: gl.constexpr, COLUMNS: gl.constexpr,
):
    num_tiles, seqlen_k, score_args = shared[10], shared[15], shared[19]
    TURN: gl.constexpr = CONSUMER if PINGPONG else -1
    if TURN == 1:  # consumer 0 goes first
        _pass_turn(TURN)
    tile_args = 0
    if DROPOUT:  # the call's Philox key
        tile_args = dropout_key(score_args[6])
    ring_position = 0
    tile_count = 0
    if DYNAMIC:  # tiles as the load warp hands them out (packed ones with their sequences), until num_tiles
        handed = 0
        if VARLEN:
            tile, words = take_tile(tile_slots, handed)
            while tile < num_tiles:
                ring_position, tile_count = _consumer_tile(
                    tile, ring_position, tile_count, shared, tile_args, CONSUMER, CONSUMERS, HEAD_DIM, BLOCK_N,
                    STAGES, HAS_LEFT, HAS_RIGHT, EMULATED_EXP2, VARLEN, SOFTCAP, ALIBI, SINKS, DROPOUT, DYNAMIC, TURN,
                    MASK, MASK_KEYS, PACK_P, ROW_SUM_MMA, OUTPUT_COLUMNS, COLUMNS, words)
                handed += 1
                tile, words = take_tile(tile_slots, handed)
        else:
            tile = take_tile(tile_slots, handed)
            while tile < num_tiles:
                ring_position, tile_count = _consumer_tile(
                    tile, ring_position, tile_count, shared, tile_args, CONSUMER, CONSUMERS, HEAD_DIM, BLOCK_N,
                    STAGES, HAS_LEFT, HAS_RIGHT, EMULATED_EXP2, VARLEN, SOFTCAP, ALIBI, SINKS, DROPOUT, DYNAMIC, TURN,
                    MASK, MASK_KEYS, PACK_P, ROW_SUM_MMA, OUTPUT_COLUMNS, COLUMNS, ())
                handed += 1
                tile = take_tile(tile_slots, handed)
    else:
        for step in range(_program_steps(num_tiles, HAS_RIGHT, VARLEN)):
            ring_position, tile_count = _consumer_tile(
                step, ring_position, tile_count, shared, tile_args, CONSUMER, CONSUMERS, HEAD_DIM, BLOCK_N, STAGES,
                HAS_LEFT, HAS_RIGHT, EMULATED_EXP2, VARLEN, SOFTCAP, ALIBI, SINKS, DROPOUT, DYNAMIC, TURN, MASK,
                MASK_KEYS, PACK_P, ROW_SUM_MMA, OUTPUT_COLUMNS, COLUMNS, ())
    if TURN == 0:  # take consumer 1's last turn: no named barrier is left half-arrived
        _take_turn(TURN)
    tma.store_wait(0)


@gluon.jit
def attention_forward_hopper_kernel(
    q_desc, k_desc, v_desc, o_desc, Lse, Out, CuSeqlensQ, CuSeqlensK, Tiles, AlibiSlopes, Sinks, RngState, TileCounter,
    Mask, stride_lh, stride_om, stride_oh, stride_ab, stride_ah, stride_sh, stride_mb, stride_mh, stride_mm, stride_mn,
    num_q_heads, group_size, seqlen_q, seqlen_k, lo, hi, qk_scale, softcap_scale, dropout_threshold, dropout_scale,
    num_tiles,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
    HAS_RIGHT: gl.constexpr,
    CONSUMERS: gl.constexpr, EMULATED_EXP2: gl.constexpr, Q_BUFFERS: gl.constexpr, CTAS_PER_SM: gl.constexpr,
    VARLEN: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, SINKS: gl.constexpr, DROPOUT: gl.constexpr,
    DYNAMIC: gl.constexpr, PINGPONG: gl.constexpr, PACK_P: gl.constexpr, MASK: gl.constexpr,
    MASK_KEYS: gl.constexpr, ROW_SUM_MMA: gl.constexpr, OUTPUT_COLUMNS: gl.constexpr, COLUMNS: gl.constexpr,
):
    """Programs walk tiles t = program, program + num_programs, ...; with DYNAMIC they take them
    from the int32 counter at TileCounter (zero at launch, and zero again at the end) instead, one at a time, longest first; descriptors are (B, H, S, D)
    with blocks of 64 query rows (Q, O) and BLOCK_N keys (K, V). CONSUMERS is 1, 2 or 3, Q_BUFFERS 1 or 2;
    CTAS_PER_SM sets the registers each partition gets (:func:`register_budget`).

    Packed sequences (VARLEN): the descriptors view (total, H, D) tensors as (1, H, total, D);
    seqlen_q and seqlen_k are the totals; tiles come from the list in ``Tiles``; Out (row stride
    stride_om, head stride stride_oh) takes the rows of a tile that ends past its sequence.

    Score features (:mod:`fmha.backends.gluon_sm90.scores`): SOFTCAP (``qk_scale`` is then
    ``scale / softcap``, ``softcap_scale`` is ``softcap · log2 e``), ALIBI (slopes (B, Hq) through
    stride_ab, stride_ah; stride_ab 0 for (Hq,); ALIBI_CAUSAL where no row sees a key after its
    position), SINKS (one per query head, stride_sh), DROPOUT (the int64 Philox seed at RngState;
    an 8-bit draw >= ``dropout_threshold``, from 1 to 256, keeps its probability in P·V, and the output
    is scaled by ``dropout_scale``; the statistics and the LSE are those before dropout), MASK
    (SDPA's attn_mask of (batch, head) at ``Mask + batch · stride_mb + head · stride_mh``, strides
    in elements; BOOL_MASK: int8, 0 hides the key; FLOAT_MASK: added to the scores; MASK_KEYS: how
    its keys lie, :data:`fmha.backends.gluon_sm90.scores.PAIRED_MASK_KEYS` and the others). ROW_SUM_MMA:
    the row sums from the tensor cores (:func:`_summed_rows`; with DROPOUT of P before the keep masks).
    OUTPUT_COLUMNS: the columns of each consumer's output staging tile: HEAD_DIM, HEAD_DIM / 2 (the
    output leaves by halves: D = 256's tiles, where a whole staging tile does not fit beside the Q
    buffer), or 0: the output is staged in the Q buffer, released to the load warp once it has left.
    COLUMNS: the columns of Q, K and V the products read and of the output they write (HEAD_DIM, or
    192 for head dims up to 192 on the 256-wide tiles)."""
    num_m_blocks = gl.cdiv(seqlen_q, CONSUMERS * q_desc.block_type.shape[2])
    dtype: gl.constexpr = q_desc.dtype
    ALIBI_FORM: gl.constexpr = alibi_form(ALIBI, SOFTCAP, dtype, OUTPUT_COLUMNS == 0)
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS * Q_BUFFERS] + q_desc.block_type.shape, q_desc.layout)
    if OUTPUT_COLUMNS == 0:
        gl.static_assert(Q_BUFFERS == 1)
        o_smem = q_smem
    else:
        o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS * Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [CONSUMERS * Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for q_slot in gl.static_range(CONSUMERS * Q_BUFFERS):
        mbarrier.init(q_ready.index(q_slot), count=1)
        mbarrier.init(q_free.index(q_slot), count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(slot), count=1)
        mbarrier.init(v_ready.index(slot), count=1)
    ones = 0
    if ROW_SUM_MMA:  # P·ones gives the row sums: a [BLOCK_N, ONES_COLUMNS] operand, stored K-major
        ones = gl.allocate_shared_memory(dtype, [ONES_COLUMNS, BLOCK_N],
                                         gl.NVMMASharedLayout.get_default_for([ONES_COLUMNS, BLOCK_N], dtype))
        ones_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        ones.store(gl.full([ONES_COLUMNS, BLOCK_N], 1.0, dtype, layout=ones_layout))
        fence_async_shared()  # visible to the tensor cores' reads
        ones = ones.permute((1, 0))
    tile_slots = (TileCounter,)  # not read without DYNAMIC
    if DYNAMIC:  # a packed tile's slot also holds its sequence (_sequence_words)
        tile_slots = allocate_tile_slots(TileCounter, CONSUMERS, 7 if VARLEN else 1)
    if VARLEN:  # launched as the tile list's kernel starts: its list and counter are ready after this
        wait_for_previous_kernel()

    score_args = (AlibiSlopes, stride_ab, stride_ah, softcap_scale, Sinks, stride_sh, RngState, dropout_threshold,
                  dropout_scale, Mask, (stride_mb, stride_mh, stride_mm, stride_mn))
    shared = (q_smem, o_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, o_desc, Lse,
              num_tiles, num_m_blocks, num_q_heads, group_size, seqlen_q, seqlen_k, lo, hi, qk_scale, score_args, ones)
    load_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready,
                 num_tiles, num_m_blocks, num_q_heads, group_size, seqlen_k, lo, hi)
    if VARLEN:  # the partitions also get the sequences (and the consumers the output's pointer and strides);
        # dense builds capture nothing more
        sequences = (CuSeqlensQ, CuSeqlensK, Tiles)
        shared = shared + ((sequences, Out, stride_lh, stride_om, stride_oh),)
        load_args = load_args[:-3] + (seqlen_q, seqlen_k, lo, hi, sequences)
    # The registers go to the consumers (setmaxnreg): the load warp needs few.
    if CONSUMERS == 1:
        gl.warp_specialize(
            [(_consumer_partition, (shared, tile_slots, 0, CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, EMULATED_EXP2, VARLEN,
                                    SOFTCAP, ALIBI_FORM, SINKS, DROPOUT, DYNAMIC, PINGPONG, PACK_P, MASK, MASK_KEYS,
                                    ROW_SUM_MMA, OUTPUT_COLUMNS, COLUMNS)),
             (_load_partition, (load_args, tile_slots, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, CONSUMERS, VARLEN, DYNAMIC))],
            worker_num_warps=[1], worker_num_regs=_worker_registers(CONSUMERS, CTAS_PER_SM, ROW_SUM_MMA))
    elif CONSUMERS == 2:
        gl.warp_specialize(
            [(_consumer_partition, (shared, tile_slots, 0, CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, EMULATED_EXP2, VARLEN,
                                    SOFTCAP, ALIBI_FORM, SINKS, DROPOUT, DYNAMIC, PINGPONG, PACK_P, MASK, MASK_KEYS,
                                    ROW_SUM_MMA, OUTPUT_COLUMNS, COLUMNS)),
             (_consumer_partition, (shared, tile_slots, 1, CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, EMULATED_EXP2, VARLEN,
                                    SOFTCAP, ALIBI_FORM, SINKS, DROPOUT, DYNAMIC, PINGPONG, PACK_P, MASK, MASK_KEYS,
                                    ROW_SUM_MMA, OUTPUT_COLUMNS, COLUMNS)),
             (_load_partition, (load_args, tile_slots, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, CONSUMERS, VARLEN, DYNAMIC))],
            worker_num_warps=[CONSUMER_WARPS, 1], worker_num_regs=_worker_registers(CONSUMERS, CTAS_PER_SM, ROW_SUM_MMA))
    else:
        gl.warp_specialize(
            [(_consumer_partition, (shared, tile_slots, 0, CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, EMULATED_EXP2, VARLEN,
                                    SOFTCAP, ALIBI_FORM, SINKS, DROPOUT, DYNAMIC, PINGPONG, PACK_P, MASK, MASK_KEYS,
                                    ROW_SUM_MMA, OUTPUT_COLUMNS, COLUMNS)),
             (_consumer_partition, (shared, tile_slots, 1, CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, EMULATED_EXP2, VARLEN,
                                    SOFTCAP, ALIBI_FORM, SINKS, DROPOUT, DYNAMIC, PINGPONG, PACK_P, MASK, MASK_KEYS,
                                    ROW_SUM_MMA, OUTPUT_COLUMNS, COLUMNS)),
             (_consumer_partition, (shared, tile_slots, 2, CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, EMULATED_EXP2, VARLEN,
                                    SOFTCAP, ALIBI_FORM, SINKS, DROPOUT, DYNAMIC, PINGPONG, PACK_P, MASK, MASK_KEYS,
                                    ROW_SUM_MMA, OUTPUT_COLUMNS, COLUMNS)),
             (_load_partition, (load_args, tile_slots, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, CONSUMERS, VARLEN, DYNAMIC))],
            worker_num_warps=[CONSUMER_WARPS, CONSUMER_WARPS, 1],
            worker_num_regs=_worker_registers(CONSUMERS, CTAS_PER_SM, ROW_SUM_MMA))
