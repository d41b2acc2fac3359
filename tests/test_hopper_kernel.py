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
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.tools.disasm import get_sass
from fmha import launch

def descriptor(rows, head_dim):
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], gl.bfloat16)
    return f"tensordesc<bf16[1,1,{rows},{head_dim}],{layout!r}>"

report = {}
for head_dim, causal in json.loads(sys.argv[1]):
    block_n = 128
    signature = {"q_desc": descriptor(launch.HOPPER_CONSUMER_ROWS, head_dim), "k_desc": descriptor(block_n, head_dim),
                 "v_desc": descriptor(block_n, head_dim), "o_desc": descriptor(launch.HOPPER_CONSUMER_ROWS, head_dim),
                 "Lse": "*fp32", "num_q_heads": "i32", "group_size": "i32", "seqlen_q": "i32", "seqlen_k": "i32",
                 "causal_offset": "i32", "qk_scale": "fp32", "num_tiles": "i32",
                 "HEAD_DIM": "constexpr", "BLOCK_N": "constexpr", "STAGES": "constexpr", "CAUSAL": "constexpr"}
    constants = {"HEAD_DIM": head_dim, "BLOCK_N": block_n, "STAGES": 2, "CAUSAL": causal}
    source = GluonASTSource(launch.attention_forward_hopper_kernel, signature, constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    sass = get_sass(compiled.asm["cubin"])
    report[f"{head_dim},{causal}"] = {
        "counts": {op: sass.count(op) for op in ("HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG")},
        "hmma": sass.count("HMMA"),  # "HGMMA" does not contain it
        "num_warps": compiled.metadata.num_warps, "shared": compiled.metadata.shared}
print(json.dumps(report))
"""

VARIANTS = [(64, False), (64, True), (128, False), (128, True)]


@pytest.fixture(scope="module")
def hopper_builds():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT, json.dumps(VARIANTS)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("head_dim, causal", VARIANTS)
def test_compiles_to_warpgroup_mma_with_tensor_copies(hopper_builds, head_dim, causal):
    build = hopper_builds[f"{head_dim},{causal}"]
    counts = build["counts"]
    assert counts["HGMMA"] > 0, "expected warpgroup MMAs"
    assert build["hmma"] == 0, "no pre-Hopper MMA fallback"
    assert counts["UTMALDG"] > 0 and counts["UTMASTG"] > 0, "Q/K/V/O move by bulk tensor copies"
    assert counts["USETMAXREG"] > 0, "registers move from the load warp to the consumers"
    # 4-warp default partition + 4-warp consumer + load warp, padded to whole warpgroups.
    assert build["num_warps"] == 12
    assert build["shared"] <= 232448, "fits the H100's shared memory per block"


def test_not_applicable_off_hopper():
    q = torch.randn(1, 2, 128, 64, dtype=torch.float16)
    assert not launch.hopper_forward_applies(q, q, q, q, 0.125)
    assert ops.hopper_forward_plan(q, q, q, q, scale=0.125, causal=False) is None


def test_plan_follows_the_measurements(monkeypatch):
    monkeypatch.setattr(ops, "hopper_forward_applies", lambda *args: True)
    q64, q128 = (torch.empty(1).expand(8, 16, 1024, d) for d in (64, 128))
    assert ops.hopper_forward_plan(q128, q128, q128, q128, scale=0.1, causal=False) is True
    assert ops.hopper_forward_plan(q128, q128, q128, q128, scale=0.1, causal=True) is False
    assert ops.hopper_forward_plan(q64, q64, q64, q64, scale=0.1, causal=False) is True
    assert ops.hopper_forward_plan(q64, q64, q64, q64, scale=0.1, causal=True) is None
    small = torch.empty(1).expand(1, 16, 1024, 64)  # host-bound: the cheaper launch wins
    assert ops.hopper_forward_plan(small, small, small, small, scale=0.1, causal=False) is None


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
