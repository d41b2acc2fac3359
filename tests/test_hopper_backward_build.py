"""The Gluon Hopper backward without a GPU: when it is chosen, and what it compiles to for sm_90.

Its numerics are checked on the H100 (tests/test_gpu_backward.py runs the default path, which
takes this kernel there); here it is built for sm_90a in a clean child process (Gluon cannot be
built where TRITON_INTERPRET=1 was set) and the SASS is read back.
"""


import pytest
import torch

from fmha.backends.gluon_sm90 import backend as hopper_backend
from fmha.backends.gluon_sm90 import backward, backward_launch, launch
from fmha.params import attention_params

from .helpers import SASS_LOOP_SPILLS, build_report

pytest.importorskip("triton.experimental.gluon")

_BUILD_SCRIPT = SASS_LOOP_SPILLS + r"""
import dataclasses, json, re, subprocess, sys, tempfile
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.tools.disasm import path_to_cuobjdump
from fmha.backends.gluon_sm90 import backward_launch, launch

report = {"triton": triton.__version__}



for head_dim, has_left, has_right, *extra in json.loads(sys.argv[1]):
    schedule = backward_launch.default_backward_schedule(head_dim)
    if "in-order" in extra:  # the dropout builds' schedule: reads and stores where the products need them, K and V
        # in shared memory
        schedule = dataclasses.replace(schedule, lse_early=False, dq_late=False, kv_registers=False)
    features = launch.ScoreFeatures(softcap="softcap" in extra, alibi=int("alibi" in extra),
                                    dropout="dropout" in extra,
                                    mask=next((part[len("mask_"):] for part in extra if part.startswith("mask_")), ""))
    source, _ = backward_launch.hopper_backward_source(torch.bfloat16, head_dim, has_left, has_right, schedule,
                                                       features=features, varlen="varlen" in extra)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=backward_launch.hopper_backward_options(schedule))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(compiled.asm["cubin"])
        handle.flush()
        sass = subprocess.check_output([path_to_cuobjdump(), "-sass", handle.name], text=True)
    report[",".join(map(str, [head_dim, has_left, has_right, *extra]))] = {
        "counts": {op: sass.count(op) for op in ("HGMMA", "UTMALDG", "UTMASTG", "UTMAREDG", "USETMAXREG", "STL",
                                                 "MUFU.TANH", "IMAD.WIDE.U32", "STS", "LDS", "STG.E.128",
                                                 "STG.E.U16")},
        "hmma": sass.count("HMMA"), "shared": compiled.metadata.shared,
        # warpgroup MMAs whose A operand is read untransposed from shared memory (K or V; dQ's Kᵀ is transposed)
        "shared_a": len(re.findall(r"HGMMA\S* R\d+, gdesc\[UR\d+\](?!\.tnspA)", sass)),
        "loop_spills": spills_in_product_loops(sass),
        # whether a step waits for every product (dK's and dV's) between dK's issue and dQ's
        "waits_before_dq": "WARPGROUP.DEPBAR.LE gsb0, 0x0" in sass[
            sass.rfind("HGMMA.64x128x16", 0, sass.find("tnspA.tnspB")):sass.find("tnspA.tnspB")]}
print(json.dumps(report))
"""

# (head_dim, has_left, has_right, score features...): dense, causal, a two-sided window, softcap, ALiBi
# and dropout.
VARIANTS = [(128, False, False), (128, False, True), (64, False, False), (64, True, True),
            (128, False, True, "softcap"), (64, False, True, "softcap", "alibi"), (128, False, False, "alibi"),
            (128, False, True, "varlen"), (64, True, True, "varlen", "alibi"), (128, False, False, "dropout"),
            (64, True, True, "dropout"), (128, False, True, "varlen", "dropout"),
            (64, False, True, "softcap", "alibi", "dropout"), (128, False, False, "mask_bool"),
            (64, False, True, "mask_float32"), (128, False, True, "softcap", "mask_bfloat16")]
# Each dropout build's counterpart without dropout, on the schedule that builds with score features take.
IN_ORDER = [tuple(part for part in variant if part != "dropout") + ("in-order",) for variant in VARIANTS
            if "dropout" in variant]


@pytest.fixture(scope="module")
def backward_builds():
    return build_report(_BUILD_SCRIPT, VARIANTS + IN_ORDER)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_backward_compiles_to_warpgroup_mma_and_bulk_reduce(backward_builds, variant):
    build = backward_builds[",".join(map(str, variant))]
    counts = build["counts"]
    assert counts["HGMMA"] > 0 and build["hmma"] == 0, "warpgroup MMAs, no pre-Hopper fallback"
    assert counts["UTMALDG"] > 0, "Q, dO, K, V and the row statistics move by bulk tensor copies"
    assert counts["UTMAREDG"] > 0, "dQ is added by the bulk copy engine (TMA reduce-add)"
    assert counts["UTMASTG"] > 0, "dK and dV leave by bulk tensor stores"
    assert counts["USETMAXREG"] > 0, "registers move from the load warp to the consumers"
    assert build["shared"] + 1024 <= 228 * 1024, "fits the H100's shared memory"


@pytest.mark.parametrize("variant", [(128, False, False), (64, False, False)], ids=str)
def test_dense_query_steps_do_not_spill(backward_builds, variant):
    """The build the H100 numbers were measured with (triton 3.6) keeps the query steps' values in
    registers (at D = 128 the early LSE leaves two spills of loop counters outside them; the D = 64
    two-sided window build, with the late dQ store, spills 14 inside them and still gained 2.4%);
    newer tritons' register allocation differs (3.9 spills a few values outside the inner loop)."""
    if not backward_builds["triton"].startswith("3.6."):
        pytest.skip(f"spills measured with triton 3.6, this is {backward_builds['triton']}")
    build = backward_builds[",".join(map(str, variant))]
    assert build["counts"]["HGMMA"] > 0 and build["loop_spills"] == 0


def test_attn_mask_query_steps_at_d64_do_not_spill(backward_builds):
    """The attn_mask's [keys, rows] tile (32 elements per thread, 32-bit offsets) fits beside the
    D = 64 query steps' values (triton 3.6); at D = 128 it spills (docs/perf.md, session 12)."""
    if not backward_builds["triton"].startswith("3.6."):
        pytest.skip(f"spills measured with triton 3.6, this is {backward_builds['triton']}")
    build = backward_builds["64,False,True,mask_float32"]
    assert build["counts"]["HGMMA"] > 0 and build["loop_spills"] == 0


@pytest.mark.parametrize("variant", [variant for variant in VARIANTS if "varlen" in variant], ids=str)
def test_packed_key_blocks_store_their_last_rows_16_bytes_a_thread(backward_builds, variant):
    """A key block that ends inside its sequence stores dK and dV without the bulk copy engine:
    eight columns a thread in one 16-byte store (launch.aligned_rows), never 2 bytes at a time."""
    counts = backward_builds[",".join(map(str, variant))]["counts"]
    assert counts["STG.E.128"] > 0 and counts["STG.E.U16"] == 0


def test_softcap_runs_tanh_on_the_mufu_unit(backward_builds):
    """One tanh.approx per score: the exp2-and-division form would add MUFU.EX2 and MUFU.RCP instead."""
    assert backward_builds["128,False,True,softcap"]["counts"]["MUFU.TANH"] > 0
    assert backward_builds["128,False,True"]["counts"]["MUFU.TANH"] == 0


@pytest.mark.parametrize("variant", [variant for variant in VARIANTS if "dropout" in variant], ids=str)
def test_backward_dropout_draws_in_registers(backward_builds, variant):
    """The backward regenerates the forward's bits where its scores are: Philox's multiplies
    (IMAD.WIDE.U32) are added, and no tile of bits passes through shared memory."""
    plain_variant = [part for part in variant if part != "dropout"] + ["in-order"]
    plain = backward_builds[",".join(map(str, plain_variant))]["counts"]
    counts = backward_builds[",".join(map(str, variant))]["counts"]
    assert (counts["STS"], counts["LDS"]) == (plain["STS"], plain["LDS"])
    assert counts["IMAD.WIDE.U32"] > plain["IMAD.WIDE.U32"]


def _params(**options):
    q = torch.empty(1, dtype=torch.bfloat16).expand(2, 8, 256, 128)
    return attention_params("test", q, q, q, **options), q


def test_backward_refusals_name_a_reason():
    params, q = _params()
    reason = hopper_backend.HopperBackend().backward_refusal(params, q, q, q, q, q, q, q)
    assert reason  # on the CPU: no CUDA device, or the interpreter
    params, q = _params(deterministic=True)
    reason = hopper_backend.HopperBackend().backward_refusal(params, q, q, q, q, q, q, q)
    assert "deterministic" in reason


@pytest.mark.parametrize("variant, from_registers", [((64, False, False), True), ((64, True, True), True),
                                                     ((64, False, True, "mask_float32"), True),
                                                     ((64, True, True, "dropout"), False), ((128, False, False), False)],
                         ids=str)
def test_d64_products_take_k_and_v_from_registers(backward_builds, variant, from_registers):
    """At D = 64 (dropout aside) Sᵀ = K Qᵀ and dPᵀ = V dOᵀ take K and V from registers: no warpgroup
    MMA reads an untransposed A operand from shared memory; at D = 128 they do."""
    build = backward_builds[",".join(map(str, variant))]
    assert build["counts"]["HGMMA"] > 0
    assert (build["shared_a"] == 0) == from_registers


def _kernel_constants(source) -> dict:
    """The constexpr values of a backward compile source, by argument name."""
    names = backward.attention_backward_hopper_kernel.arg_names
    return {names[key[0]]: value for key, value in source.constants.items()}


@pytest.mark.parametrize("head_dim, features, lse_early, dq_late, kv_registers", [
    (128, launch.NO_FEATURES, True, False, False), (64, launch.NO_FEATURES, False, True, True),
    (64, launch.ScoreFeatures(sinks=True), False, True, True), (128, launch.ScoreFeatures(alibi=1), False, False, False),
    (64, launch.ScoreFeatures(dropout=True), False, False, False),
    (64, launch.ScoreFeatures(softcap=True), False, False, True)])
def test_step_order_follows_head_dim_and_score_features(head_dim, features, lse_early, dq_late, kv_registers):
    """The default schedules' early LSE (D = 128) and late dQ store (D = 64) hold registers across
    the step's first products; builds that modify the scores (the sinks change only the LSE) skip them.
    K and V sit in registers at D = 64 except in dropout builds."""
    schedule = backward_launch.default_backward_schedule(head_dim)
    source, _ = backward_launch.hopper_backward_source(torch.bfloat16, head_dim, False, True, schedule,
                                                       features=features)
    constants = _kernel_constants(source)
    assert (constants["LSE_EARLY"], constants["DQ_LATE"], constants["KV_REGISTERS"]) == (lse_early, dq_late,
                                                                                         kv_registers)


@pytest.mark.parametrize("variant, waits", [((128, False, False), False), ((128, False, True), True),
                                            ((128, False, False, "mask_bool"), False)], ids=str)
def test_dense_d128_issues_dq_behind_dk_and_dv(backward_builds, variant, waits):
    """Without a causal mask or window, a D = 128 step issues its dQ product right behind dK's and
    waits for dK and dV only after it (the slot of Q and dO is then released); causal builds wait
    for them first (issued early there, ptxas schedules the loops worse)."""
    assert backward_builds[",".join(map(str, variant))]["waits_before_dq"] == waits


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("has_left, has_right, varlen, grouped", [
    (False, True, False, True), (False, False, False, False), (True, True, False, False), (False, True, True, False)])
def test_causal_key_blocks_go_in_head_groups(head_dim, has_left, has_right, varlen, grouped):
    """Causal dense calls order their key blocks by head groups (the kernel applies them up to
    8,192 keys); windows keep one head at a time, packed sequences their longest-first list."""
    schedule = backward_launch.default_backward_schedule(head_dim)
    source, _ = backward_launch.hopper_backward_source(torch.bfloat16, head_dim, has_left, has_right, schedule,
                                                       varlen=varlen)
    constants = _kernel_constants(source)
    assert constants["HEAD_GROUP"] == (schedule.head_group if grouped else 0) and schedule.head_group > 1


_WIDE_BUILD_SCRIPT = SASS_LOOP_SPILLS + r"""
import json, subprocess, sys, tempfile
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.tools.disasm import path_to_cuobjdump
from fmha.backends.gluon_sm90 import backward_launch
from fmha.backends.gluon_sm90.launch import ScoreFeatures

report = {"triton": triton.__version__}
for has_left, has_right, head_group, features, varlen, columns in json.loads(sys.argv[1]):
    source, _ = backward_launch.hopper_wide_backward_source(torch.bfloat16, has_left, has_right, head_group,
                                                            ScoreFeatures(**features), varlen, columns)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=backward_launch.hopper_backward_options(backward_launch.HopperBackwardSchedule()))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(compiled.asm["cubin"])
        handle.flush()
        sass = subprocess.check_output([path_to_cuobjdump(), "-sass", handle.name], text=True)
    report[",".join(map(str, [has_left, has_right, head_group, *features, varlen, columns]))] = {
        "counts": {op: sass.count(op) for op in ("HGMMA", "UTMALDG", "UTMASTG", "UTMAREDG", "USETMAXREG", "STG.E.128",
                                                 "STG.E.U16")},
        "hmma": sass.count("HMMA"), "shared": compiled.metadata.shared, "loop_spills": spills_in_product_loops(sass)}
print(json.dumps(report))
"""

# (has_left, has_right, head_group, score features, varlen, columns): dense, causal in head groups,
# a two-sided window, packed causal sequences with softcap, ALiBi and dropout (the float32 tile dS
# reads: the most shared memory), a float attn_mask; then the 192-column builds (D <= 192) of the
# dense and causal ones and of dropout.
WIDE_VARIANTS = [(False, False, 0, {}, False, 256), (False, True, 4, {}, False, 256), (True, True, 0, {}, False, 256),
                 (False, True, 0, dict(softcap=1, alibi=1, dropout=True), True, 256),
                 (False, False, 0, dict(mask="float32"), False, 256),
                 (False, False, 0, {}, False, 192), (False, True, 4, {}, False, 192),
                 (False, True, 4, dict(dropout=True), False, 192)]


def wide_variant_key(variant) -> str:
    has_left, has_right, head_group, features, varlen, columns = variant
    return ",".join(map(str, [has_left, has_right, head_group, *features, varlen, columns]))


@pytest.fixture(scope="module")
def wide_backward_builds():
    return build_report(_WIDE_BUILD_SCRIPT, WIDE_VARIANTS)


@pytest.mark.parametrize("variant", WIDE_VARIANTS, ids=wide_variant_key)
def test_wide_backward_compiles_to_warpgroup_mma_and_bulk_reduce(wide_backward_builds, variant):
    """The 256-wide tiles' backward: warpgroup MMAs, bulk copies in, dQ by bulk reduce-adds, dK and
    dV by plain 16-byte stores along their rows (once per program; 2-byte stores from the
    accumulator's layout took 10-13 us a program, docs/perf.md, session 43), within the H100's
    shared memory."""
    build = wide_backward_builds[wide_variant_key(variant)]
    counts = build["counts"]
    assert counts["HGMMA"] > 0 and build["hmma"] == 0
    assert counts["UTMALDG"] > 0 and counts["UTMAREDG"] > 0 and counts["UTMASTG"] == 0
    assert counts["STG.E.128"] > 0 and counts["STG.E.U16"] == 0
    assert counts["USETMAXREG"] > 0
    assert build["shared"] + 1024 <= 228 * 1024


@pytest.mark.parametrize("variant", [variant for variant in WIDE_VARIANTS if variant[-1] == 192], ids=wide_variant_key)
def test_wide_backward_of_192_columns_issues_fewer_products(wide_backward_builds, variant):
    """Head dims up to 192: Sᵀ and dPᵀ over 192 columns, consumer 1's 64 columns of dK and dV, and
    dQ's three chunks: fewer warpgroup MMA instructions than the same build over 256 columns."""
    wide = wide_backward_builds[wide_variant_key(variant[:-1] + (256,))] if variant[:-1] + (256,) in WIDE_VARIANTS \
        else None
    build = wide_backward_builds[wide_variant_key(variant)]
    if wide is not None:
        assert build["counts"]["HGMMA"] < wide["counts"]["HGMMA"]
    assert build["counts"]["UTMAREDG"] > 0


@pytest.mark.parametrize("variant", WIDE_VARIANTS[:2] + WIDE_VARIANTS[5:7], ids=wide_variant_key)
def test_wide_backward_steps_do_not_spill(wide_backward_builds, variant):
    """With triton 3.6 (the measured build) the dense and causal steps keep their values in
    registers (the two-sided window's builds spill 1 and 8 instructions inside them, the score
    features' builds 4-44, packed sequences with softcap, ALiBi and dropout 141; triton 3.9 spills more)."""
    if not wide_backward_builds["triton"].startswith("3.6."):
        pytest.skip(f"spills measured with triton 3.6, this is {wide_backward_builds['triton']}")
    assert wide_backward_builds[wide_variant_key(variant)]["loop_spills"] == 0

