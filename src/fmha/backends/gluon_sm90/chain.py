"""Programmatic dependent launch in the Gluon kernels (the Triton side:
:func:`fmha.backends.triton.common.chain_launches`)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def wait_for_previous_kernel():
    """Wait until the kernel before this one on the stream has finished and its writes are
    visible: a kernel launched with programmatic dependent launch may start before. Called before
    the kernel touches global memory; a no-op for a kernel launched without the attribute."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
