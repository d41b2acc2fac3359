"""Whether Gluon builds an 80-row operand for a warpgroup MMA (sm_90a, no GPU needed).

FlashAttention-4's sm90 backward takes 80 query rows per step at D = 128. In Gluon the B operand
of such a step, an [80, 64] bf16 tile in shared memory, cannot be made: allocating it, or slicing
80 rows out of a [128, 64] buffer, fails with "shape must have power-of-2 and non-zero
dimensions": triton 3.9 raises it for the slice; triton 3.6 lets the slice through and its MLIR
verifier aborts the process on the [64, 80] view.

    python power_of_two_shapes.py
"""

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

ROWS = 80


@gluon.jit
def eighty_rows(A, C, ROWS: gl.constexpr):
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, ROWS, 16])
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, blocked))
    columns = gl.arange(0, 64, layout=gl.SliceLayout(0, blocked))
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], layout, gl.load(A + rows[:, None] * 64 + columns[None, :]))
    b_full = gl.allocate_shared_memory(gl.bfloat16, [128, 64], layout)
    b_full.store(gl.full([128, 64], 1.0, gl.bfloat16, blocked))
    b_smem = b_full.slice(0, ROWS, dim=0)  # the step's 80 rows
    fence_async_shared()
    acc = warpgroup_mma(a_smem, b_smem.permute((1, 0)), gl.zeros([64, ROWS], gl.float32, acc_layout))
    gl.store(C + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout)), gl.sum(acc, axis=1))


if __name__ == "__main__":
    source = ASTSource(eighty_rows, signature={"A": "*bf16", "C": "*fp32", "ROWS": "constexpr"},
                       constexprs={"ROWS": ROWS})
    try:
        triton.compile(source, target=GPUTarget("cuda", 90, 32))
        print(f"triton {triton.__version__}: {ROWS} rows build")
    except Exception as error:  # the compiler's refusal
        print(f"triton {triton.__version__}: {str(error).splitlines()[-1]}")
