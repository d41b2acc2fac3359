"""The Gluon Hopper forward without a GPU: when it is chosen, and what it compiles to for sm_90.

Its numerics are checked on the H100 (tests/test_gpu_forward.py runs the default path, which
takes this kernel there); here it is built for sm_90a with Triton's bundled ptxas and the SASS is
read back: warpgroup MMAs fed by bulk tensor copies, and no slow fallbacks.
"""

import dataclasses
import math

import pytest
import torch

import fmha
import fmha.testing

from fmha import HopperSchedule
from fmha.backends.gluon_sm90 import backend as hopper_backend
from fmha.backends.gluon_sm90 import launch
from fmha.backends.gluon_sm90 import schedule as schedule_module
from fmha.backends.gluon_sm90.schedule import (MAX_STAGES_WITH_TURNS, PINGPONG_OFF, PINGPONG_ON, SHARED_MEMORY_PER_CTA,
                                              product_columns)
from fmha.backends.gluon_sm90.scores import ALIBI_ANY, ALIBI_CAUSAL
from fmha.params import attention_params
from fmha.tuning import schedules

from .helpers import SASS_LOOP_SPILLS, build_report

gluon = pytest.importorskip("triton.experimental.gluon")


# Gluon kernels cannot be built in a process where TRITON_INTERPRET=1 was set at import (Triton's
# own jit helpers such as gl.max are then interpreted functions), so a clean child process builds
# them and reports what the SASS contains.
_BUILD_SCRIPT = SASS_LOOP_SPILLS + r"""
import json, re, subprocess, sys, tempfile
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.tools.disasm import path_to_cuobjdump
from fmha import HopperSchedule
from fmha.backends.gluon_sm90 import launch
from fmha.backends.gluon_sm90.schedule import PINGPONG_LONG_SOFTMAX, PINGPONG_OFF, PINGPONG_ON

def sass_of(cubin):
    # cuobjdump's own listing: triton.tools.disasm.get_sass stops at code offset 0x10000.
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        return subprocess.check_output([path_to_cuobjdump(), "-sass", handle.name], text=True)

report = {"triton": triton.__version__}
for variant in json.loads(sys.argv[1]):
    head_dim, causal, consumers, block_n, stages, emulated_exp2, q_buffers, ctas_per_sm, *extra = variant
    schedule = HopperSchedule(block_n=block_n, stages=stages, consumers=consumers, emulated_exp2=emulated_exp2,
                              q_buffers=q_buffers, ctas_per_sm=ctas_per_sm, dynamic="dynamic" in extra,
                              pingpong=PINGPONG_ON if "pingpong" in extra
                              else PINGPONG_OFF if "no_turns" in extra else PINGPONG_LONG_SOFTMAX,
                              pack_p="pack_p" in extra, row_sum_mma="row_sum_mma" in extra)
    # The very source, signature and options the launcher compiles on a GPU.
    alibi = 2 if "alibi_causal" in extra else int("alibi" in extra)
    mask = next((name[len("mask_"):] for name in extra if name.startswith("mask_") and name != "mask_strided"), "")
    softcap = 2 if "softcap_bounded" in extra else int("softcap" in extra)
    features = launch.ScoreFeatures(softcap=softcap, alibi=alibi, sinks="sinks" in extra,
                                    dropout="dropout" in extra, mask=mask, mask_keys=0 if "mask_strided" in extra else 2)
    source, _ = launch.hopper_forward_source(torch.bfloat16, head_dim, causal, schedule, has_left=2 if "wide" in extra else int("left" in extra),
                                             varlen="varlen" in extra, features=features,
                                             columns=192 if "columns_192" in extra else None)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options=launch.hopper_compile_options(schedule, "varlen" in extra))
    except Exception as error:
        report[",".join(map(str, variant))] = {"error": launch.build_error_summary(error)}
        continue
    sass = sass_of(compiled.asm["cubin"])
    report[",".join(map(str, variant))] = {
        "counts": {op: sass.count(op) for op in ("HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG", "MUFU.EX2", "MUFU.TANH",
                                                 "FMNMX", "FADD", "STL", "ISETP", "HSET2", "PRMT", "STG.E.128",
                                                 "STG.E.U16")},
        "hmma": sass.count("HMMA"),  # "HGMMA" does not contain it
        # the N of every warpgroup MMA shape in the PTX (the product's columns)
        "wgmma_columns": sorted({int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16",
                                                            compiled.asm["ptx"])}),
        # shared-memory stores and loads (STS, LDS; not STSM, LDSM)
        "sts": len(re.findall(r"\bSTS\b", sass)), "lds": len(re.findall(r"\bLDS\b", sass)),
        "wide_multiplies": sass.count("IMAD.WIDE.U32"),
        "loop_spills": spills_in_product_loops(sass),
        "unmasked_loop_spills": spills_in_product_loops(sass, unmasked_only=True),
        "num_warps": compiled.metadata.num_warps, "shared": compiled.metadata.shared,
        "maxnreg": int(compiled.asm["ptx"].split(".maxnreg")[1].split()[0]),
        # named barriers: the ids the compiler uses (immediates) and the slots' releases (by register)
        "compiler_barriers": sorted({int(n) for n in re.findall(
            r"\b(?:bar|barrier)(?:\.cta)?\.(?:sync|arrive)(?:\.aligned)?\s+(\d+)", compiled.asm["ptx"])}),
        "slot_releases": len(re.findall(r"\bbar\.arrive\s+%r", compiled.asm["ptx"])),
        # the consumers' turns: named barriers of the two consumer warpgroups alone (256 threads)
        "turns": len(re.findall(r"\bbar\.(?:sync|arrive)\s+%r\d+,\s*256;", compiled.asm["ptx"])),
        # what a consumer does while it holds its turn: from taking it (a 256-thread barrier of the
        # turns' ids) to passing it, in SASS
        "compares_in_turns": sum(section.count("HSET2") for section in re.findall(
            r"BAR\.SYNC\.DEFER_BLOCKING 0x[ef], 0x100(.*?)BAR\.ARV 0x[ef], 0x100", sass, re.S)),
        "global_atomics": len(re.findall(r"\batom\.global", compiled.asm["ptx"])),
        "relaxed_atomics": len(re.findall(r"\batom\.global\.gpu\.relaxed\b", compiled.asm["ptx"])),
        "gpu_fences": sass.count("MEMBAR.ALL.GPU"),
        # the attn_mask's loads: one per key pair, or per key where its keys are strided
        "global_loads": {width: len(re.findall(r"\bLDG\.E" + suffix + r"\s", sass))
                         for width, suffix in (("8", r"\.U8"), ("16", r"\.U16"), ("32", ""), ("64", r"\.64"))}}
print(json.dumps(report))
"""

# (head_dim, causal, consumers, block_n, stages, emulated_exp2, q_buffers, ctas_per_sm): the
# default path's choices, three consumers (an option of the launcher), and D=64 without the
# emulated exponentials.
VARIANTS = [(64, False, 2, 128, 2, 8, 2, 1), (64, True, 2, 128, 2, 8, 2, 1), (64, True, 2, 128, 2, 8, 1, 1),
            (128, False, 2, 128, 2, 0, 2, 1), (128, True, 2, 128, 2, 0, 2, 1), (128, True, 2, 128, 2, 0, 1, 1),
            (64, False, 1, 128, 2, 8, 2, 2), (64, True, 1, 64, 2, 0, 2, 3),
            (64, False, 3, 64, 3, 0, 1, 1), (64, False, 2, 128, 2, 0, 2, 1),
            (64, False, 3, 128, 2, 8, 2, 1), (64, True, 3, 128, 2, 8, 2, 1),
            (128, True, 2, 128, 2, 0, 2, 1, "pack_p"), (128, True, 2, 128, 2, 0, 2, 1, "wide", "dynamic", "pack_p"),
            (64, True, 2, 128, 2, 8, 2, 1, "left"), (128, True, 2, 128, 2, 0, 2, 1, "left"),
            (64, False, 2, 128, 2, 8, 2, 1, "left"), (128, False, 2, 128, 2, 0, 2, 1, "left", "dynamic", "pack_p"),
            (128, True, 2, 128, 2, 0, 2, 1, "varlen"), (64, True, 1, 64, 2, 0, 2, 3, "varlen"),
            (128, True, 2, 128, 2, 0, 2, 1, "left", "varlen"),
            (128, True, 2, 128, 2, 0, 2, 1, "softcap"), (64, False, 2, 128, 2, 8, 2, 1, "softcap"),
            (128, False, 2, 128, 2, 0, 2, 1, "softcap", "alibi", "sinks"),
            (64, True, 2, 128, 2, 8, 2, 1, "alibi", "sinks", "left", "varlen"),
            (128, True, 2, 128, 2, 0, 2, 1, "alibi_causal"), (64, True, 2, 128, 2, 8, 2, 1, "alibi_causal", "softcap"),
            (64, False, 2, 128, 2, 8, 2, 1, "dropout"), (64, True, 2, 128, 2, 8, 2, 1, "dropout"),
            (128, False, 2, 128, 2, 0, 2, 1, "dropout"), (128, True, 2, 128, 2, 0, 2, 1, "dropout"),
            (64, True, 1, 64, 2, 0, 2, 3, "dropout"), (128, True, 2, 128, 2, 0, 2, 1, "varlen", "dropout"),
            (128, False, 2, 128, 2, 0, 2, 1, "softcap", "alibi", "sinks", "dropout"),
            (64, True, 2, 128, 2, 8, 2, 1, "dynamic"), (128, True, 2, 128, 2, 0, 2, 1, "left", "dynamic"),
            (128, True, 2, 128, 2, 0, 2, 1, "varlen", "dynamic"), (64, True, 1, 64, 2, 0, 2, 3, "dynamic"),
            (128, True, 2, 128, 2, 0, 2, 1, "wide", "dynamic"),
            (128, True, 2, 128, 2, 0, 2, 1, "pingpong"), (64, True, 2, 128, 2, 8, 2, 1, "dynamic", "left", "pingpong"),
            (64, True, 2, 128, 3, 8, 1, 1, "softcap", "varlen"), (64, True, 2, 128, 4, 8, 1, 1, "softcap"),
            (128, True, 2, 128, 2, 0, 2, 1, "softcap_bounded"), (64, False, 2, 128, 2, 8, 2, 1, "softcap_bounded"),
            (128, True, 2, 128, 2, 0, 2, 1, "softcap_bounded", "sinks"),
            (128, True, 2, 128, 2, 0, 2, 1, "softcap_bounded", "sinks", "dropout"),
            (64, True, 2, 128, 3, 8, 1, 1, "softcap_bounded", "varlen", "left"),
            (128, False, 2, 64, 3, 0, 2, 1, "mask_bool"), (64, False, 2, 128, 2, 8, 2, 1, "mask_bool"),
            (64, False, 1, 128, 2, 8, 2, 2, "mask_float32", "mask_strided"),
            (128, False, 2, 64, 3, 0, 2, 1, "mask_bfloat16"),
            (64, False, 3, 128, 2, 0, 2, 1), (64, False, 3, 128, 2, 0, 2, 1, "row_sum_mma"),
            (64, True, 3, 128, 2, 0, 2, 1, "dynamic", "row_sum_mma"),
            (64, True, 2, 128, 2, 8, 2, 1, "dropout", "row_sum_mma"),
            (64, True, 2, 128, 2, 0, 2, 1, "pack_p", "no_turns"),
            (64, True, 2, 128, 2, 0, 2, 1, "dropout", "pack_p", "no_turns"),
            (128, True, 2, 128, 2, 0, 2, 1, "dropout", "pack_p"),
            (256, False, 2, 64, 2, 0, 1, 1, "pack_p"), (256, False, 2, 64, 2, 0, 1, 1, "pack_p", "dropout"),
            (256, True, 2, 64, 2, 0, 1, 1, "pack_p", "softcap_bounded", "left", "varlen", "dynamic"),
            (256, True, 2, 64, 2, 0, 1, 1, "pack_p", "alibi_causal", "sinks"), (256, True, 2, 64, 2, 0, 1, 1, "pack_p", "sinks"),
            (256, False, 2, 64, 2, 0, 1, 1, "pack_p", "columns_192"),
            (256, True, 2, 64, 2, 0, 1, 1, "pack_p", "columns_192"),
            (256, True, 2, 64, 2, 0, 1, 1, "pack_p", "dropout", "columns_192"),
            (256, True, 2, 64, 2, 0, 1, 1, "pack_p", "softcap_bounded", "left", "varlen", "dynamic", "columns_192")]


@pytest.fixture(scope="module")
def hopper_builds():
    return build_report(_BUILD_SCRIPT, VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_compiles_to_warpgroup_mma_with_tensor_copies(hopper_builds, variant):
    head_dim, causal, consumers, block_n, stages, emulated_exp2, q_buffers, ctas_per_sm, *extra = variant
    build = hopper_builds[",".join(map(str, variant))]
    assert "error" not in build, f"triton {hopper_builds['triton']}: {build.get('error')}"
    counts = build["counts"]
    assert counts["HGMMA"] > 0, "expected warpgroup MMAs"
    assert build["hmma"] == 0, "no pre-Hopper MMA fallback"
    assert counts["UTMALDG"] > 0 and counts["UTMASTG"] > 0, "Q/K/V/O move by bulk tensor copies"
    assert counts["USETMAXREG"] > 0, "registers move from the load warp to the consumers"
    # 4-warp default partition + 4-warp consumers + load warp, padded to whole warpgroups.
    assert build["num_warps"] == 4 * (consumers + 1)
    # ctas_per_sm CTAs side by side: the H100's 228 KiB of shared memory per multiprocessor (1 KiB
    # of it reserved per CTA) and 64k registers (the launch count, before setmaxnreg moves them).
    assert ctas_per_sm * (build["shared"] + 1024) <= 228 * 1024
    assert ctas_per_sm * build["maxnreg"] * 128 * (consumers + 1) <= 65536


@pytest.mark.parametrize("variant", [variant for variant in VARIANTS if any("mask_" in name for name in variant[8:])],
                         ids=str)
def test_attn_mask_builds_read_key_pairs_without_spilling(hopper_builds, variant):
    """A bool mask at D = 128 with the shipped rule's 64-key blocks keeps the mask's words in
    registers: fewer local-memory stores than a tile has registers per thread (7 with triton 3.6,
    22 with 3.9, scalars; the spilled tiles of 128-key blocks showed hundreds; D = 64's 128-key
    blocks spill some and still run faster than 64-key ones, docs/perf.md). Where the keys are contiguous a thread reads each of its key pairs in one load,
    so a key block's loads are half its scores per thread."""
    build = hopper_builds[",".join(map(str, variant))]
    assert "error" not in build
    if "mask_bool" in variant and variant[0] == 128:
        assert build["counts"]["STL"] < 64
    loads = build["global_loads"]
    element_bits = {"mask_bool": 8, "mask_bfloat16": 16, "mask_float32": 32}[variant[8]]
    per_block = 64 * variant[3] // 128  # a warpgroup thread's scores of one key block
    if "mask_strided" in variant:
        assert loads[str(element_bits)] >= per_block
    else:  # pairs only: never one element alone
        assert loads[str(2 * element_bits)] >= per_block // 2 and loads[str(element_bits)] == 0


@pytest.mark.parametrize("variant", [variant for variant in VARIANTS if "varlen" in variant], ids=str)
def test_packed_tiles_store_their_last_rows_16_bytes_a_thread(hopper_builds, variant):
    """A packed tile that ends inside its sequence stores its rows without the bulk copy engine:
    eight columns a thread in one 16-byte store (launch.aligned_rows), never 2 bytes at a time."""
    counts = hopper_builds[",".join(map(str, variant))]["counts"]
    assert counts["STG.E.128"] > 0 and counts["STG.E.U16"] == 0


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_only_dynamic_schedules_draw_tiles_from_a_counter(hopper_builds, variant):
    """And they draw them relaxed: no GPU-wide fence holds the load warp before the draw."""
    build = hopper_builds[",".join(map(str, variant))]
    assert "error" not in build
    assert (build["global_atomics"] > 0) == ("dynamic" in variant)
    assert build["relaxed_atomics"] == build["global_atomics"] and build["gpu_fences"] == 0


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_slots_are_released_through_named_barriers_the_compiler_leaves_free(hopper_builds, variant):
    """The consumers release K/V slots with bar.arrive on barriers from FIRST_SLOT_BARRIER on
    (:mod:`fmha.backends.gluon_sm90.slot_barriers`); the compiler's own partition barriers stay below."""
    from fmha.backends.gluon_sm90.slot_barriers import FIRST_SLOT_BARRIER

    build = hopper_builds[",".join(map(str, variant))]
    assert build["slot_releases"] > 0
    assert build["compiler_barriers"] and max(build["compiler_barriers"]) < FIRST_SLOT_BARRIER.value


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_consumers_take_turns_where_the_softmax_is_long(hopper_builds, variant):
    """By default (PINGPONG_LONG_SOFTMAX) the two consumers take turns with softcap, dropout or
    two-sided ALiBi, when the schedule has two consumers and at most three stages (the turns' named
    barriers sit above the slots'); with PINGPONG_ON always, with PINGPONG_OFF never."""
    from fmha.backends.gluon_sm90.forward import TURN_BARRIER
    from fmha.backends.gluon_sm90.slot_barriers import FIRST_SLOT_BARRIER

    consumers, stages, extra = variant[2], variant[4], variant[8:]
    long_softmax = bool({"softcap", "softcap_bounded", "dropout", "alibi"} & set(extra))
    expected = "pingpong" in extra or (long_softmax and consumers == 2 and stages <= MAX_STAGES_WITH_TURNS
                                       and "no_turns" not in extra)
    build = hopper_builds[",".join(map(str, variant))]
    assert (build["turns"] > 0) == expected
    assert FIRST_SLOT_BARRIER.value + 2 * MAX_STAGES_WITH_TURNS <= TURN_BARRIER.value <= 14  # two of the 16


def test_turns_need_two_consumers_and_free_barriers():
    with pytest.raises(ValueError, match="pingpong"):
        HopperSchedule(consumers=1, pingpong=PINGPONG_ON)
    with pytest.raises(ValueError, match="pingpong"):
        HopperSchedule(stages=4, pingpong=PINGPONG_ON)
    with pytest.raises(ValueError, match="pingpong"):
        HopperSchedule(pingpong=3)
    schedule = HopperSchedule(pingpong=PINGPONG_OFF)
    assert HopperSchedule.from_ints(schedule.to_ints()) == schedule
    assert HopperSchedule.from_record(schedule.to_record()) == schedule
    softcap = launch.ScoreFeatures(softcap=True)
    assert launch.takes_turns(HopperSchedule(), softcap)
    assert launch.takes_turns(HopperSchedule(), launch.ScoreFeatures(dropout=True))
    assert launch.takes_turns(HopperSchedule(), launch.ScoreFeatures(alibi=ALIBI_ANY.value))
    assert not launch.takes_turns(HopperSchedule(), launch.NO_FEATURES)
    assert not launch.takes_turns(HopperSchedule(), launch.ScoreFeatures(alibi=ALIBI_CAUSAL.value, sinks=True))
    assert not launch.takes_turns(HopperSchedule(pingpong=PINGPONG_OFF), softcap)
    assert not launch.takes_turns(HopperSchedule(stages=4), softcap)
    assert not launch.takes_turns(HopperSchedule(consumers=1), softcap)
    assert launch.takes_turns(HopperSchedule(pingpong=PINGPONG_ON), launch.NO_FEATURES)


def test_emulated_exponentials_leave_the_mufu_unit(hopper_builds):
    """One exponential in eight computed by polynomial: fewer MUFU.EX2 in the SASS."""
    plain = hopper_builds["64,False,2,128,2,0,2,1"]["counts"]["MUFU.EX2"]
    emulated = hopper_builds["64,False,2,128,2,8,2,1"]["counts"]["MUFU.EX2"]
    assert emulated < plain


@pytest.mark.parametrize("variant", [variant for variant in VARIANTS if "dropout" in variant and "row_sum_mma" not in variant],
                         ids=str)
def test_dropout_draws_in_registers(hopper_builds, variant):
    """Each thread draws the bits of its own accumulator columns: no tile passes through shared
    memory. The partitions' captured arguments (the seed's pointer, the threshold and the scale,
    16 bytes) are the only shared memory added; Philox multiplies by IMAD.WIDE.U32, and each key
    pair's two draws are compared at once (HSET2, whose mask clears the pair's P·V operand word)."""
    plain = hopper_builds[",".join(map(str, [part for part in variant if part != "dropout"]))]
    build = hopper_builds[",".join(map(str, variant))]
    assert 0 <= build["shared"] - plain["shared"] <= 16
    assert (build["sts"], build["lds"]) == (plain["sts"], plain["lds"])
    assert build["wide_multiplies"] > plain["wide_multiplies"]
    assert build["counts"]["HSET2"] > 0 == plain["counts"]["HSET2"]
    assert build["counts"]["PRMT"] >= build["counts"]["HSET2"]


@pytest.mark.parametrize("causal", [False, True])
def test_three_consumers_of_128_keys_fit_their_registers(hopper_builds, causal):
    """Three consumers (160 registers a thread) with 128-key blocks at D = 64, FlashAttention-3's
    tile there: a block's P crosses the key loop packed in bf16 pairs, and the unmasked key loop
    does not spill (with float32 P the key loops held 1,234 spill instructions with triton 3.6's
    compiler, 1,555 with 3.9's)."""
    build = hopper_builds[f"64,{causal},3,128,2,8,2,1"]
    assert "error" not in build and build["maxnreg"] <= 168
    assert build["unmasked_loop_spills"] == 0


def test_row_sums_on_the_tensor_cores(hopper_builds):
    """``HopperSchedule.row_sum_mma`` (the shipped long D = 64 schedules): each block issues P·ones
    beside P·V (8 more wgmma of N = 8 per block) in place of the FADDs that summed the block's P,
    with no spill in the unmasked key loop (the masked loops, at the diagonal and the end of K, hold a
    few). With dropout P·ones takes the probabilities before the keep masks (the sum counts the
    dropped ones), P·V the masked ones: the same compares, one conversion for both."""
    plain = hopper_builds["64,False,3,128,2,0,2,1"]["counts"]
    summed = hopper_builds["64,False,3,128,2,0,2,1,row_sum_mma"]
    assert summed["counts"]["HGMMA"] > plain["HGMMA"]
    assert summed["counts"]["FADD"] < plain["FADD"] - 100  # about 66 a block, in each of the key loops
    for build in (summed, hopper_builds["64,True,3,128,2,0,2,1,dynamic,row_sum_mma"]):
        assert build["unmasked_loop_spills"] == 0
    dropout = hopper_builds["64,True,2,128,2,8,2,1,dropout"]["counts"]
    summed_dropout = hopper_builds["64,True,2,128,2,8,2,1,dropout,row_sum_mma"]
    assert summed_dropout["counts"]["HGMMA"] > dropout["HGMMA"]
    assert summed_dropout["counts"]["FADD"] < dropout["FADD"] - 100
    assert summed_dropout["counts"]["HSET2"] == dropout["HSET2"]
    assert summed_dropout["unmasked_loop_spills"] == 0


@pytest.mark.parametrize("variant", [(128, True, 2, 128, 2, 0, 2, 1), (128, True, 2, 128, 2, 0, 2, 1, "wide", "dynamic")],
                         ids=str)
def test_packed_p_frees_registers(hopper_builds, variant):
    """``HopperSchedule.pack_p`` at D = 128: a block's P crosses the key loop in 32 registers instead
    of 64, and the two-consumer builds spill less (with triton 3.6's compiler the causal build's
    38 stores and the window's 82 go to none; with 3.9's the causal build's 120 to 15)."""
    plain = hopper_builds[",".join(map(str, variant))]
    packed = hopper_builds[",".join(map(str, (*variant, "pack_p")))]
    assert packed["counts"]["STL"] < plain["counts"]["STL"]
    assert packed["counts"]["HGMMA"] == plain["counts"]["HGMMA"]


def test_packed_dropout_words_are_masked_before_the_turn(hopper_builds):
    """With ``pack_p`` and dropout a block's words are masked where the block ends, so a consumer
    that holds its turn only issues its products: no compare with the threshold (HSET2) lies between
    taking the turn and passing it, whatever ptxas schedules (masked where P·V takes them, triton
    3.6's ptxas moved the first consumer's compares past the barrier). The build without turns
    (shipped at D = 64, causal) compares every key pair too."""
    packed = hopper_builds["128,True,2,128,2,0,2,1,dropout,pack_p"]
    assert packed["turns"] > 0 and packed["compares_in_turns"] == 0 < packed["counts"]["HSET2"]
    no_turns = hopper_builds["64,True,2,128,2,0,2,1,dropout,pack_p,no_turns"]
    assert no_turns["turns"] == 0 and no_turns["counts"]["HSET2"] > 0
    assert no_turns["unmasked_loop_spills"] == packed["unmasked_loop_spills"] == 0


@pytest.mark.parametrize("head_dim", [64, 128])
def test_second_q_buffer_per_consumer(hopper_builds, head_dim):
    """Two Q buffers: one more 64-row Q tile per consumer in shared memory (and its two barriers)."""
    extra = 2 * 64 * head_dim * 2
    options = "2,128,2,8" if head_dim == 64 else "2,128,2,0"
    one = hopper_builds[f"{head_dim},True,{options},1,1"]["shared"]
    two = hopper_builds[f"{head_dim},True,{options},2,1"]["shared"]
    assert extra <= two - one < extra + 1024


@pytest.mark.parametrize("variant", [variant for variant in VARIANTS if variant[0] == 256], ids=str)
def test_head_dim_256_stages_its_output_by_halves(hopper_builds, variant):
    """At D = 256 a CTA holds each consumer's Q tile and a two-stage K/V ring of 64-key blocks (192
    KiB): room for staging tiles of half the output's columns, not whole ones, so each consumer's
    output leaves in two bulk stores (and its Q buffer is free as soon as its last Q·Kᵀ is done).
    The unmasked key loop keeps everything in registers."""
    build = hopper_builds[",".join(map(str, variant))]
    assert "error" not in build, build.get("error")
    q_tiles, ring, halves = 2 * 64 * 256 * 2, 2 * 2 * 64 * 256 * 2, 2 * 64 * 128 * 2
    assert q_tiles + ring + halves <= build["shared"] < q_tiles + ring + halves + 1024
    assert build["counts"]["UTMASTG"] == 4  # two stores in each consumer's copy of the epilogue
    assert build["unmasked_loop_spills"] == 0


@pytest.mark.parametrize("with_alibi, without", [
    ((128, True, 2, 128, 2, 0, 2, 1, "alibi_causal"), (128, True, 2, 128, 2, 0, 2, 1)),
    ((256, True, 2, 64, 2, 0, 1, 1, "pack_p", "alibi_causal", "sinks"), (256, True, 2, 64, 2, 0, 1, 1, "pack_p", "sinks"))])
def test_causal_alibi_adds_its_key_term_on_the_tensor_cores(hopper_builds, with_alibi, without):
    """bf16 causal ALiBi without softcap adds its key term by one more k-step of Q·Kᵀ whose operands
    sit in the output staging tile: at D = 128 a whole one, at D = 256 the half tile."""
    counts = [hopper_builds[",".join(map(str, variant))]["counts"]["HGMMA"] for variant in (with_alibi, without)]
    assert counts[0] > counts[1]


@pytest.mark.parametrize("schedule, head_dim, columns", [
    (HopperSchedule(), 128, 128), (HopperSchedule(block_n=64, q_buffers=2), 128, 128),
    (HopperSchedule(block_n=64), 256, 128), (HopperSchedule(block_n=64, stages=1), 256, 256),
    (HopperSchedule(block_n=64, consumers=1), 256, 256), (HopperSchedule(block_n=64, consumers=3), 256, 0)])
def test_output_staging_tile_is_as_wide_as_shared_memory_allows(schedule, head_dim, columns):
    """Each consumer's output staging tile: the whole head dim where it fits, half of it where only
    that fits, else none (the output goes through the Q buffer); the CTA's bytes count it."""
    assert schedule.output_columns(head_dim) == columns
    assert schedule.build_refusal(head_dim) is None
    assert schedule.shared_bytes(head_dim) <= SHARED_MEMORY_PER_CTA
    if columns == head_dim // 2:  # a whole tile would not fit
        whole = schedule.shared_bytes(head_dim) + 2 * 64 * schedule.consumers * (head_dim - columns)
        assert whole > SHARED_MEMORY_PER_CTA


def test_head_dim_256_refuses_128_key_blocks_and_a_second_q_buffer():
    assert "block_n in (64,)" in HopperSchedule().build_refusal(256)
    assert "shared memory" in HopperSchedule(block_n=64, q_buffers=2).build_refusal(256)


@pytest.mark.parametrize("variant", [variant for variant in VARIANTS if variant[0] == 256], ids=str)
def test_head_dims_up_to_192_read_192_columns_of_the_256_wide_tiles(hopper_builds, variant):
    """Head dims 136-192 build with 192 columns (schedule.product_columns): Q·Kᵀ over 128 and 64
    columns, P·V into a 128- and a 64-column accumulator, no product 256 columns wide."""
    build = hopper_builds[",".join(map(str, variant))]
    if "columns_192" in variant:
        assert 256 not in build["wgmma_columns"] and {64, 128} <= set(build["wgmma_columns"])
    else:
        assert 256 in build["wgmma_columns"]
    assert [product_columns(d) for d in (64, 128, 136, 160, 192, 200, 256)] == [64, 128, 192, 192, 192, 256, 256]


def params_of(batch, seqlen, head_dim, causal, dtype=torch.bfloat16):
    q = torch.empty(1, dtype=dtype).expand(batch, 16, seqlen, head_dim)
    return attention_params("test", q, q, q, causal=causal)


def test_refused_off_hopper_with_a_reason():
    q = torch.randn(1, 2, 128, 64, dtype=torch.float16)
    params = attention_params("test", q, q, q)
    reason = hopper_backend.HopperBackend().refusal(params, q, q, q)
    assert reason and ("interpreter" in reason or "TRITON_INTERPRET" in reason or "CUDA" in reason)


def test_two_sided_masks_test_bits_and_wide_windows_compare_one_side(hopper_builds):
    """A window's blocks masked on both sides test a word of bits per row, not compares per score;
    a wide window's blocks at a tile's right end compare each score with the right bound alone
    (bits measured slower for one side): a compare per score of a consumer thread's 64."""
    wide = hopper_builds["128,True,2,128,2,0,2,1,wide,dynamic"]["counts"]
    general = hopper_builds["128,True,2,128,2,0,2,1,left,dynamic"]["counts"]
    scores_per_thread = 64 * 128 // 128
    assert wide["HGMMA"] > 0 and general["ISETP"] < 2 * scores_per_thread
    assert wide["ISETP"] - general["ISETP"] >= scores_per_thread


@pytest.mark.parametrize("window, seqlen_q, seqlen_k, varlen, expected", [
    ((1023, 0), 16384, 16384, False, 2), ((255, 0), 4096, 4096, False, 1), ((256, 0), 4096, 4096, False, 2),
    ((1000, 500), 4096, 4096, False, 1), ((300, 0), 4096, 2048, False, 2), ((1023, 0), 1000, 3000, False, 2),
    ((1023, 0), 2000, 2000, True, 2), ((200, 0), 2000, 2000, True, 1), (None, 4096, 4096, False, 0)])
def test_left_bound_is_wide_where_the_right_end_blocks_see_every_left_bound(window, seqlen_q, seqlen_k, varlen,
                                                                              expected):
    """WIDE_LEFT for causal-style windows (right <= 0) at least a tile's rows (128) plus a key block (128) wide."""
    if varlen:
        q = torch.randn(seqlen_q, 2, 128, dtype=torch.float16)
        cu = torch.tensor([0, seqlen_q // 2, seqlen_q], dtype=torch.int32)
        params = fmha.params.varlen_params("test", q, q, q, cu, cu, seqlen_q, seqlen_q, causal=True, window=window)
    else:
        q = torch.randn(1, 2, seqlen_q, 128, dtype=torch.float16)
        k = torch.randn(1, 2, seqlen_k, 128, dtype=torch.float16)
        params = attention_params("test", q, k, k, causal=window is None, window=window)
    assert launch.left_bound(params, HopperSchedule()) == expected


def test_dynamic_tiles_need_a_persistent_schedule():
    with pytest.raises(ValueError, match="dynamic"):
        HopperSchedule(persistent=False, dynamic=True)
    schedule = HopperSchedule(persistent=True, q_buffers=2, dynamic=True)
    assert HopperSchedule.from_ints(schedule.to_ints()) == schedule
    assert HopperSchedule.from_record(schedule.to_record()) == schedule


# (variant as in VARIANTS, whether it builds): at the register floor of HopperSchedule.register_refusal.
REGISTER_BOUNDARY = [((64, True, 2, 64, 2, 0, 1, 2), True),  # 104 registers a consumer, 64-key blocks
                     ((64, True, 2, 64, 2, 0, 1, 3), False),  # 72
                     ((64, True, 1, 128, 2, 0, 1, 3), False),  # 136, 128-key blocks
                     ((128, True, 1, 64, 2, 0, 1, 3), False)]  # 136 at D = 128


def test_register_refusal_matches_what_ptxas_builds():
    """A schedule refused for too few registers fails in ptxas; one at the floor builds (the
    three-consumer build of VARIANTS, 160 registers at 128-key blocks, is the other side)."""
    report = build_report(_BUILD_SCRIPT, [variant for variant, _ in REGISTER_BOUNDARY])
    for variant, builds in REGISTER_BOUNDARY:
        head_dim, _, consumers, block_n, stages, emulated_exp2, q_buffers, ctas_per_sm = variant
        schedule = HopperSchedule(consumers=consumers, block_n=block_n, stages=stages, q_buffers=q_buffers,
                                  ctas_per_sm=ctas_per_sm)
        refusal = schedule.build_refusal(head_dim)
        build = report[",".join(map(str, variant))]
        assert ("error" not in build) == builds, (variant, build.get("error"))
        assert (refusal is None) == builds, (variant, refusal)
        if not builds:  # the build error quotes ptxas's reason
            assert "Insufficient registers" in build["error"], build["error"]
    assert HopperSchedule(consumers=3, q_buffers=2, emulated_exp2=8).build_refusal(64) is None


def test_shipped_rules_follow_the_measurements():
    """The shipped sm_90 rules (tuning data) reproduce the measured table of docs/perf.md."""
    def plan(seqlen, head_dim, causal, batch=8):
        schedule, _ = schedules.shipped_schedule(params_of(batch, seqlen, head_dim, causal), "sm_90", 132)
        return schedule

    assert plan(1024, 128, causal=False) == HopperSchedule(persistent=True, q_buffers=2)
    assert plan(16384, 128, causal=False) == HopperSchedule(persistent=True)
    assert plan(1024, 128, causal=True) == HopperSchedule(persistent=True, q_buffers=2)
    assert plan(16384, 128, causal=True) == HopperSchedule(persistent=True, q_buffers=2, dynamic=True)
    q = torch.empty(1, dtype=torch.bfloat16).expand(1, 16, 16384, 128)  # with score features: one program per tile
    assert schedules.shipped_schedule(attention_params("test", q, q, q, causal=True, sinks=torch.zeros(16)), "sm_90",
                                      132)[0] == HopperSchedule(persistent=False)
    assert plan(1024, 64, causal=False) == HopperSchedule(persistent=True, q_buffers=2, emulated_exp2=8)
    three_consumers = HopperSchedule(persistent=True, consumers=3, q_buffers=2, row_sum_mma=True)
    assert plan(2048, 64, causal=False) == three_consumers
    assert plan(16384, 64, causal=False) == three_consumers
    short_causal = HopperSchedule(persistent=True, consumers=1, block_n=64, q_buffers=2, ctas_per_sm=3)
    assert plan(1024, 64, causal=True) == short_causal
    assert plan(512, 64, causal=True) is None  # not measured against the portable kernel
    assert plan(2048, 64, causal=True) == HopperSchedule(persistent=True, q_buffers=2, emulated_exp2=8,
                                                         pingpong=PINGPONG_ON)
    assert plan(4096, 64, causal=True) == HopperSchedule(persistent=True, q_buffers=2, emulated_exp2=8,
                                                         pingpong=PINGPONG_ON, dynamic=True)
    assert plan(8192, 64, causal=True) == HopperSchedule(persistent=True, consumers=3, q_buffers=2, dynamic=True,
                                                         row_sum_mma=True)
    # long causal calls with score features keep two consumers (three would hold P in float32)
    q = torch.empty(1, dtype=torch.bfloat16).expand(1, 32, 16384, 64)
    assert schedules.shipped_schedule(attention_params("test", q, q, q, causal=True, sinks=torch.zeros(32)), "sm_90",
                                      132)[0] == HopperSchedule(persistent=True, q_buffers=2, dynamic=True,
                                                                emulated_exp2=8)
    # 128 or 256 tiles of 128 rows: fewer than two per multiprocessor
    small_grid = HopperSchedule(persistent=True, consumers=1, q_buffers=2, ctas_per_sm=2, emulated_exp2=8)
    assert plan(1024, 64, causal=False, batch=1) == small_grid
    assert plan(1024, 64, causal=False, batch=2) == small_grid
    assert plan(1024, 64, causal=False, batch=3) == HopperSchedule(persistent=True, q_buffers=2, emulated_exp2=8)
    assert plan(512, 64, causal=False, batch=1) is None  # the portable kernel's small tiles
    # sliding windows and packed sequences take tiles one at a time
    q = torch.empty(1, dtype=torch.bfloat16).expand(1, 16, 16384, 128)
    dynamic = HopperSchedule(persistent=True, q_buffers=2, dynamic=True, pack_p=True)
    for left in (1023, 4095):
        assert schedules.shipped_schedule(attention_params("test", q, q, q, window=(left, 0)), "sm_90", 132)[0] == dynamic
    # score features: causal ALiBi, a bounded softcap and dropout at D = 64 pack P; dropout at D = 64
    # emulates no exponential, and its causal calls take no turns; three consumers only for plain calls
    for head_dim, causal, features, expected in [
            (128, True, dict(has_alibi=True), HopperSchedule(persistent=True, q_buffers=2, pack_p=True)),
            (128, False, dict(has_alibi=True), HopperSchedule(persistent=True, q_buffers=2)),
            (64, True, dict(has_alibi=True), HopperSchedule(persistent=True, q_buffers=2, emulated_exp2=8, pack_p=True,
                                                            dynamic=True)),
            (64, True, dict(dropout_p=0.1), HopperSchedule(persistent=True, q_buffers=2, pack_p=True,
                                                           pingpong=PINGPONG_OFF)),
            (64, False, dict(dropout_p=0.1), HopperSchedule(persistent=True, q_buffers=2, pack_p=True)),
            (64, False, dict(softcap=30.0), HopperSchedule(persistent=True, q_buffers=2, emulated_exp2=8, pack_p=True)),
            (64, True, dict(softcap=30.0), HopperSchedule(persistent=True, q_buffers=2, emulated_exp2=8, pack_p=True,
                                                          dynamic=True)),
            (64, True, dict(softcap=60.0), HopperSchedule(persistent=True, q_buffers=2, emulated_exp2=8,
                                                          pingpong=PINGPONG_ON)),
            (128, True, dict(softcap=50.0), HopperSchedule(persistent=True, q_buffers=2, pack_p=True, emulated_exp2=8)),
            (128, False, dict(softcap=60.0), HopperSchedule(persistent=True, q_buffers=2)),
            (128, True, dict(softcap=30.0, dropout_p=0.1), HopperSchedule(persistent=True, q_buffers=2)),
            (64, False, dict(has_sinks=True), HopperSchedule(persistent=True, q_buffers=2, emulated_exp2=8))]:
        q = torch.empty(1, dtype=torch.bfloat16).expand(4, 16, 4096, head_dim)
        params = attention_params("test", q, q, q, causal=causal)
        params = dataclasses.replace(params, options=dataclasses.replace(params.options, **features))
        assert schedules.shipped_schedule(params, "sm_90", 132)[0] == expected, (head_dim, causal, features)
    schedule, rule = schedules.shipped_schedule(params_of(8, 1024, 64, False), "sm_80", 108)
    assert schedule is None and "sm_80" in rule
    # head dims between the tile widths take their tile width's rules; 32 and under the portable kernel
    assert plan(4096, 96, causal=False, batch=4) == plan(4096, 128, causal=False, batch=4)
    assert plan(4096, 48, causal=True, batch=4) == plan(4096, 64, causal=True, batch=4)
    assert plan(4096, 192, causal=True, batch=4) == HopperSchedule(persistent=True, block_n=64, pack_p=True)
    assert plan(4096, 32, causal=False, batch=4) is None and plan(4096, 16, causal=True, batch=4) is None
    # SDPA's attn_mask: bool masks at D = 128 take 64-key blocks, float ones the portable kernel
    q = torch.empty(1, dtype=torch.bfloat16).expand(4, 16, 4096, 128)
    masked = {kind: schedules.shipped_schedule(attention_params("test", q, q, q, attn_mask_kind=kind), "sm_90", 132)[0]
              for kind in ("bool", "float32", "bfloat16")}
    assert masked == {"bool": HopperSchedule(persistent=True, block_n=64, stages=3, q_buffers=2), "float32": None,
                      "bfloat16": None}


def test_mask_keys_layout_picks_the_build_from_the_strides():
    """Paired loads need an even Sk and every row starting at an even element; strided keys get
    their own build; broadcast (stride 0) and size-1 dimensions never break the pairing."""
    from fmha.backends.gluon_sm90.scores import PAIRED_MASK_KEYS, STRIDED_MASK_KEYS, UNIT_MASK_KEYS

    mask = torch.ones(2, 1, 64, 128, dtype=torch.bool)
    assert launch.mask_keys_layout(mask.expand(2, 8, 64, 128)) == PAIRED_MASK_KEYS.value
    assert launch.mask_keys_layout(mask[:, :, :1].expand(2, 8, 64, 128)) == PAIRED_MASK_KEYS.value
    assert launch.mask_keys_layout(torch.ones(1, 1, 64, 127, dtype=torch.bool)) == UNIT_MASK_KEYS.value
    odd_rows = torch.ones(1, 1, 64, 129, dtype=torch.bfloat16)[..., :128]  # rows start 129 elements apart
    assert launch.mask_keys_layout(odd_rows) == UNIT_MASK_KEYS.value
    assert launch.mask_keys_layout(torch.ones(1, 1, 63, 128)[..., 1:, :]) == PAIRED_MASK_KEYS.value
    assert launch.mask_keys_layout(torch.ones(1, 1, 64, 129)[..., 1:]) == UNIT_MASK_KEYS.value  # base off by one
    transposed = torch.ones(1, 1, 128, 64, dtype=torch.bool).transpose(-1, -2)
    assert launch.mask_keys_layout(transposed) == STRIDED_MASK_KEYS.value


@pytest.mark.parametrize("reason, pattern", [("dtype", "float16 or bfloat16"), ("head_dim", "head dim 100 is not a multiple of 8"),
                                             ("scale", "positive scale"), ("stride", "TMA"),
                                             ("registers", "leaves 40 registers a consumer thread"),
                                             ("shared", "bytes of shared memory")])
def test_refusals_name_the_reason(monkeypatch, reason, pattern):
    monkeypatch.setattr(hopper_backend, "INTERPRETED", False)
    monkeypatch.setattr(hopper_backend, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(hopper_backend, "gluon_unavailable", lambda: None)

    def tensor(shape=(1, 2, 128, 64), dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype)

    def refusal(q, **kwargs):
        params = attention_params("test", q, q, q, **kwargs)
        params = type(params)(*[getattr(params, name) for name in ("batch", "q_heads", "kv_heads", "seqlen_q",
                                                                   "seqlen_k", "head_dim", "dtype")],
                              torch.device("cuda", 0), params.options)
        return hopper_backend.HopperBackend().refusal(params, q, q, q)

    assert refusal(tensor()) is None
    assert refusal(tensor(shape=(1, 2, 128, 96))) is None  # run at the 128-wide tiles
    if reason == "dtype":
        found = refusal(tensor(dtype=torch.float32))
    elif reason == "head_dim":
        found = refusal(tensor(shape=(1, 2, 128, 104))[..., :100])  # rows 16-byte aligned, the width not
    elif reason == "scale":
        found = refusal(tensor(), scale=-0.125)
    elif reason == "registers":  # an explicit schedule the compiler could not build
        found = refusal(tensor(), config=HopperSchedule(consumers=3, ctas_per_sm=3))
    elif reason == "shared":
        found = refusal(tensor(shape=(1, 2, 128, 128)), config=HopperSchedule(consumers=3, q_buffers=2))
    else:
        found = refusal(tensor(shape=(1, 2, 128, 68))[..., :64])  # rows 136 bytes apart: not 16-byte aligned
    assert found is not None and pattern in found


def test_dropout_runs_both_gluon_kernels(monkeypatch):
    """The Gluon kernels draw the portable kernels' bits, so either backward can follow either forward."""
    monkeypatch.setattr(hopper_backend, "INTERPRETED", False)
    monkeypatch.setattr(hopper_backend, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(hopper_backend, "gluon_unavailable", lambda: None)
    q = torch.empty((2, 4, 256, 128), dtype=torch.bfloat16)

    def on_cuda(**kwargs):
        params = attention_params("test", q, q, q, **kwargs)
        return dataclasses.replace(params, device=torch.device("cuda", 0))

    backend = hopper_backend.HopperBackend()
    for dropout_p in (0.0, 0.1):
        assert backend.refusal(on_cuda(dropout_p=dropout_p), q, q, q) is None
    for dropout_p in (0.0, 0.1):
        assert backend.backward_refusal(on_cuda(dropout_p=dropout_p), *[q] * 7) is None


def test_dropout_builds_only_where_p_is_positive():
    # Every p > 0 drops something (at least one draw value in 256), so only p = 0 builds without it.
    from fmha.backends.gluon_sm90 import launch

    q = torch.empty((1, 2, 100, 64), dtype=torch.float16)
    features = [launch.ScoreFeatures.of(attention_params("test", q, q, q, dropout_p=p).options)
                for p in (0.0, 1e-9, 0.4 / 256, 1.0)]
    assert [f.dropout for f in features] == [False, True, True, True]
    assert launch.ScoreFeatures.dropout_scalars(attention_params("test", q, q, q, dropout_p=0.25).options) == (
        64, 4 / 3)


def test_an_explicit_schedule_that_cannot_run_raises_instead_of_switching_kernels():
    q = torch.randn(1, 2, 64, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="gluon_sm90 backend, which cannot run this call"):
        fmha.attention(q, q, q, config=HopperSchedule())
    explanation = fmha.explain(q, q, q, config=fmha.ForwardConfig(16, 16, 1, 1))
    assert explanation.backend == "triton" and explanation.source == "explicit config="


def test_a_hopper_build_failure_falls_back_to_the_portable_kernel_with_one_warning(monkeypatch):
    """A Gluon compile that fails (e.g. a triton whose Gluon API moved) must not fail the call."""
    from fmha import dispatch
    from fmha.runtime import KernelBuildError

    failure = "the Gluon Hopper forward failed to build with triton 9.9: CompilationError: moved"
    backend = dispatch.BACKENDS["gluon_sm90"]
    monkeypatch.setattr(type(backend), "refusal", lambda self, params, q, k, v: None)
    monkeypatch.setattr(type(backend), "forward_config", lambda self, params: (HopperSchedule(), "test"))

    def failing_build(self, params, schedule):
        raise KernelBuildError(failure)

    monkeypatch.setattr(type(backend), "prepare_forward", failing_build)
    monkeypatch.setattr(dispatch, "_warned_build_failures", set())
    dispatch.forget()
    try:
        q, k, v = fmha.testing.random_qkv(1, 2, 1, 33, 40, 32, torch.float16)
        with pytest.warns(RuntimeWarning, match="portable Triton kernel runs instead") as warned:
            out = fmha.attention(q, k, v, causal=True)
            fmha.attention(q[:, :, :20], k, v)  # another signature: no second warning
        ours = [w.message for w in warned if "portable Triton kernel runs instead" in str(w.message)]
        assert len(ours) == 1 and "CompilationError: moved" in str(ours[0])
        fmha.testing.assert_close_to_reference(out, q, k, v, causal_offset=40 - 33)
        explanation = fmha.explain(q, k, v, causal=True)
        assert explanation.backend == "triton" and explanation.refused["gluon_sm90"] == failure
        with pytest.raises(ValueError, match="CompilationError: moved"):  # asked for by name: no switch
            fmha.attention(q, k, v, config=HopperSchedule())
    finally:
        dispatch.forget()


def test_build_errors_name_the_compilers_message():
    from fmha.backends.gluon_sm90.launch import build_error_summary

    try:
        try:
            raise RuntimeError("async_copy_shared_to_global has been removed; call async_store instead")
        except RuntimeError as inner:
            raise ValueError("at 71:8:\n    source line") from inner
    except ValueError as error:
        assert build_error_summary(error) == ("RuntimeError: async_copy_shared_to_global has been removed; "
                                              "call async_store instead")
    # a schedule whose consumers get too few registers (three consumers, three CTAs per multiprocessor)
    ptxas = RuntimeError("Internal Triton PTX codegen error\n`ptxas` stderr:\nptxas fatal   : (C7602) Insufficient "
                         "registers (40) to compile instruction at line 1425\nptxas fatal   : Ptx assembly aborted")
    assert build_error_summary(ptxas) == ("RuntimeError: Internal Triton PTX codegen error (ptxas fatal   : (C7602) "
                                          "Insufficient registers (40) to compile instruction at line 1425)")
    newer = RuntimeError("Internal Triton PTX codegen error\n`ptxas` stderr:\nptxas-blackwell fatal   : (C7602) "
                         "Insufficient registers (56)")  # triton 3.9's ptxas
    assert build_error_summary(newer).endswith("(ptxas-blackwell fatal   : (C7602) Insufficient registers (56))")


def test_compat_resolves_this_triton():
    """The names fmha.compat picks exist in the installed triton, which pyproject's range admits."""
    from fmha import compat

    assert compat.TRITON_OLDEST <= compat.TRITON_VERSION and compat.triton_version_problem() is None
    assert compat.GLUON_IMPORT_ERROR is None
    assert callable(compat.tma_load) and callable(compat.tma_store) and compat.GluonASTSource is not None
    assert compat.COMPILE_OPTIONS == {"enable_fp_fusion": True}
    assert compat.active_launch_hooks() is None  # nobody listens in tests
    import triton

    def listener(metadata):
        pass

    triton.knobs.runtime.launch_enter_hook.add(listener)
    try:
        assert compat.active_launch_hooks() is not None  # a profiler's hook makes launches report
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(listener)
    assert compat._release("3.9.0+git1234") == (3, 9, 0) and compat._release("3.10") == (3, 10, 0)


@pytest.mark.parametrize("options, expected", [
    (dict(causal=True), 2), (dict(), 1), (dict(window=(100, 0)), 2), (dict(window=(100, 3)), 1),
    (dict(causal=True, top_left=True), 2)])
def test_alibi_takes_its_causal_form_only_where_no_key_follows_a_row(options, expected):
    """ALiBi's one-sided form is exact only when every visible key j of row i has j <= i + Sk - Sq."""
    from fmha.backends.gluon_sm90 import launch

    q = torch.empty(1, 2, 100, 64, dtype=torch.float16)
    k = torch.empty(1, 2, 300, 64, dtype=torch.float16)
    params = attention_params("test", q, k, k, alibi_slopes=torch.ones(2), **options)
    assert launch.ScoreFeatures.forward_of(params).alibi == expected


@pytest.mark.parametrize("dtype, softcap, extra, expected", [
    (torch.bfloat16, 30.0, {}, 2), (torch.bfloat16, 52.0, {}, 2), (torch.bfloat16, 52.5, {}, 1),
    (torch.float16, 30.0, {}, 1), (torch.bfloat16, 30.0, dict(alibi_slopes=torch.ones(2)), 1),
    (torch.bfloat16, 30.0, dict(attn_mask_kind="float32"), 1), (torch.bfloat16, 30.0, dict(attn_mask_kind="bool"), 2)])
def test_softcap_subtracts_a_fixed_max_only_where_the_scores_stay_bounded(dtype, softcap, extra, expected):
    """SOFTCAP_BOUNDED needs bf16's range and scores that nothing pushes past ±softcap after the tanh."""
    from fmha.backends.gluon_sm90 import launch

    q = torch.empty(1, 2, 100, 64, dtype=dtype)
    k = torch.empty(1, 2, 300, 64, dtype=dtype)
    params = attention_params("test", q, k, k, softcap=softcap, **extra)
    assert launch.ScoreFeatures.forward_of(params).softcap == expected


def test_bounded_softcap_limit_keeps_every_probability_a_normal_float():
    """exp2 of a bounded softcap score minus the fixed max lies in [2^(offset - 2C), 2^offset]."""
    from fmha.backends.gluon_sm90.schedule import BOUNDED_SOFTCAP_LIMIT
    from fmha.backends.gluon_sm90.scores import BOUNDED_MAX_OFFSET

    bound = BOUNDED_SOFTCAP_LIMIT * math.log2(math.e)
    assert BOUNDED_MAX_OFFSET.value - 2 * bound >= -121 and BOUNDED_MAX_OFFSET.value <= 32


def test_bounded_softcap_builds_keep_no_running_max(hopper_builds):
    """With SOFTCAP_BOUNDED the forward computes no row max (no FMNMX besides the emulated exponentials'
    clamp)."""
    for schedule in [(128, True, 2, 128, 2, 0, 2, 1), (64, False, 2, 128, 2, 8, 2, 1)]:
        online, bounded = (hopper_builds[",".join(map(str, schedule + (kind,)))] for kind in ("softcap", "softcap_bounded"))
        assert online["counts"]["FMNMX"] > 256
        assert bounded["counts"]["FMNMX"] <= online["counts"]["FMNMX"] // 8  # the emulated exponentials' clamp


@pytest.mark.parametrize("head_dim, tile", [(8, 64), (64, 64), (72, 128), (96, 128), (128, 128), (136, 256),
                                            (256, 256), (264, None)])
def test_head_dims_round_up_to_a_tile_width(head_dim, tile):
    assert schedule_module.tile_head_dim(head_dim) == tile


@pytest.mark.parametrize("head_dim, features, refusal", [
    (96, {}, None), (96, dict(softcap=30.0), None), (136, {}, None), (256, dict(sinks=True), None),
    (136, dict(softcap=30.0), None), (256, dict(dropout_p=0.1), None), (192, dict(alibi=True), None),
    (256, dict(deterministic=True), "deterministic=True")])
def test_the_wide_backward_takes_score_features(monkeypatch, head_dim, features, refusal):
    """Head dims over 128 run the 256-wide tiles' backward (backward_wide.py) with every score
    feature; like the narrower one it refuses deterministic calls (dQ is summed by atomic adds)."""
    monkeypatch.setattr(hopper_backend, "INTERPRETED", False)
    monkeypatch.setattr(hopper_backend, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(hopper_backend, "gluon_unavailable", lambda: None)
    q = torch.empty((1, 2, 128, head_dim), dtype=torch.bfloat16)
    options = dict(softcap=features.get("softcap"), dropout_p=features.get("dropout_p", 0.0),
                   deterministic=features.get("deterministic", False),
                   sinks=torch.zeros(2) if features.get("sinks") else None,
                   alibi_slopes=torch.ones(2) if features.get("alibi") else None)
    params = attention_params("test", q, q, q, **options)
    params = dataclasses.replace(params, device=torch.device("cuda", 0))
    reason = hopper_backend.HopperBackend().backward_refusal(params, *[q] * 7)
    assert reason == refusal if refusal is None else refusal in reason
