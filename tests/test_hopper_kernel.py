"""The Gluon Hopper forward without a GPU: when it is chosen, and what it compiles to for sm_90.

Its numerics are checked on the H100 (tests/test_gpu_forward.py runs the default path, which
takes this kernel there); here it is built for sm_90a with Triton's bundled ptxas and the SASS is
read back: warpgroup MMAs fed by bulk tensor copies, and no slow fallbacks.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from fmha import launch, ops

gluon = pytest.importorskip("triton.experimental.gluon")


# Gluon kernels cannot be built in a process where TRITON_INTERPRET=1 was set at import (Triton's
# own jit helpers such as gl.max are then interpreted functions), so a clean child process builds
# them and reports what the SASS contains.
_BUILD_SCRIPT = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.tools.disasm import get_sass
from fmha import launch

report = {}
for variant in json.loads(sys.argv[1]):
    head_dim, causal, consumers, block_n, stages, emulated_exp2, q_buffers, ctas_per_sm = variant
    # The very source, signature and options the launcher compiles on a GPU.
    source, _ = launch.hopper_forward_source(torch.bfloat16, head_dim, block_n, stages, causal, consumers,
                                              emulated_exp2, q_buffers, ctas_per_sm)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=launch.hopper_compile_options(consumers, ctas_per_sm))
    sass = get_sass(compiled.asm["cubin"])
    report[",".join(map(str, variant))] = {
        "counts": {op: sass.count(op) for op in ("HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG", "MUFU.EX2")},
        "hmma": sass.count("HMMA"),  # "HGMMA" does not contain it
        "num_warps": compiled.metadata.num_warps, "shared": compiled.metadata.shared,
        "maxnreg": int(compiled.asm["ptx"].split(".maxnreg")[1].split()[0])}
print(json.dumps(report))
"""

# (head_dim, causal, consumers, block_n, stages, emulated_exp2, q_buffers, ctas_per_sm): the
# default path's choices, three consumers (an option of the launcher), and D=64 without the
# emulated exponentials.
VARIANTS = [(64, False, 2, 128, 2, 8, 2, 1), (64, True, 2, 128, 2, 8, 2, 1), (64, True, 2, 128, 2, 8, 1, 1),
            (128, False, 2, 128, 2, 0, 2, 1), (128, True, 2, 128, 2, 0, 2, 1), (128, True, 2, 128, 2, 0, 1, 1),
            (64, False, 1, 128, 2, 8, 2, 2), (64, True, 1, 64, 2, 0, 2, 3),
            (64, False, 3, 64, 3, 0, 1, 1), (64, False, 2, 128, 2, 0, 2, 1)]


@pytest.fixture(scope="module")
def hopper_builds():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT, json.dumps(VARIANTS)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_compiles_to_warpgroup_mma_with_tensor_copies(hopper_builds, variant):
    head_dim, causal, consumers, block_n, stages, emulated_exp2, q_buffers, ctas_per_sm = variant
    build = hopper_builds[",".join(map(str, variant))]
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


def test_emulated_exponentials_leave_the_mufu_unit(hopper_builds):
    """One exponential in eight computed by polynomial: fewer MUFU.EX2 in the SASS."""
    plain = hopper_builds["64,False,2,128,2,0,2,1"]["counts"]["MUFU.EX2"]
    emulated = hopper_builds["64,False,2,128,2,8,2,1"]["counts"]["MUFU.EX2"]
    assert emulated < plain


@pytest.mark.parametrize("head_dim", [64, 128])
def test_second_q_buffer_per_consumer(hopper_builds, head_dim):
    """Two Q buffers: one more 64-row Q tile per consumer in shared memory (and its two barriers)."""
    extra = 2 * 64 * head_dim * 2
    options = "2,128,2,8" if head_dim == 64 else "2,128,2,0"
    one = hopper_builds[f"{head_dim},True,{options},1,1"]["shared"]
    two = hopper_builds[f"{head_dim},True,{options},2,1"]["shared"]
    assert extra <= two - one < extra + 1024


def test_not_applicable_off_hopper():
    q = torch.randn(1, 2, 128, 64, dtype=torch.float16)
    assert not launch.hopper_forward_applies(q, q, q, q, 0.125)
    assert ops.hopper_forward_plan(q, q, q, q, scale=0.125, causal=False) is None


def test_plan_follows_the_measurements(monkeypatch):
    monkeypatch.setattr(ops, "hopper_forward_applies", lambda *args: True)
    monkeypatch.setattr(ops, "multiprocessors", lambda device: 132)  # the H100's

    def plan(seqlen, head_dim, causal, batch=8):
        q = torch.empty(1).expand(batch, 16, seqlen, head_dim)
        return ops.hopper_forward_plan(q, q, q, q, scale=0.1, causal=causal)

    assert plan(1024, 128, causal=False) == {"persistent": True, "q_buffers": 2}
    assert plan(16384, 128, causal=False) == {"persistent": True}
    assert plan(1024, 128, causal=True) == {"persistent": True, "q_buffers": 2}
    assert plan(16384, 128, causal=True) == {"persistent": False}
    assert plan(1024, 64, causal=False) == {"persistent": True, "q_buffers": 2, "emulated_exp2": 8}
    assert plan(16384, 64, causal=False) == {"persistent": True, "q_buffers": 2, "emulated_exp2": 8}
    short_causal = {"persistent": True, "consumers": 1, "block_n": 64, "q_buffers": 2, "ctas_per_sm": 3}
    assert plan(1024, 64, causal=True) == short_causal
    assert plan(512, 64, causal=True) is None  # not measured against the portable kernel
    assert plan(2048, 64, causal=True) == {"persistent": True, "q_buffers": 2, "emulated_exp2": 8}
    assert plan(4096, 64, causal=True) == {"persistent": True, "q_buffers": 2, "emulated_exp2": 8}
    assert plan(16384, 64, causal=True) == {"persistent": False, "emulated_exp2": 8}
    # 128 or 256 tiles of 128 rows: fewer than two per multiprocessor
    small_grid = {"persistent": True, "consumers": 1, "q_buffers": 2, "ctas_per_sm": 2, "emulated_exp2": 8}
    assert plan(1024, 64, causal=False, batch=1) == small_grid
    assert plan(1024, 64, causal=False, batch=2) == small_grid
    assert plan(1024, 64, causal=False, batch=3) == {"persistent": True, "q_buffers": 2, "emulated_exp2": 8}
    assert plan(512, 64, causal=False, batch=1) is None  # the portable kernel's small tiles


@pytest.mark.parametrize("reason", ["dtype", "head_dim", "scale", "stride"])
def test_applies_only_where_the_kernel_can_run(monkeypatch, reason):
    monkeypatch.setattr(launch, "INTERPRETED", False)
    monkeypatch.setattr(launch, "_compute_capability", lambda device: (9, 0))

    class FakeCuda:
        type = "cuda"

    def tensor(shape=(1, 2, 128, 64), dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype)

    q, scale = tensor(), 0.125
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: FakeCuda()))
    assert launch.hopper_forward_applies(q, q, q, q, scale)
    if reason == "dtype":
        q = tensor(dtype=torch.float32)
    elif reason == "head_dim":
        q = tensor(shape=(1, 2, 128, 96))
    elif reason == "scale":
        scale = -0.125
    else:
        q = tensor(shape=(1, 2, 128, 68))[..., :64]  # rows 136 bytes apart: not 16-byte aligned
    assert not launch.hopper_forward_applies(q, q, q, q, scale)
