"""Every Triton API that fmha uses and Triton has renamed or keeps private, in one place.

pyproject allows ``TRITON_OLDEST`` to ``TRITON_NEWEST``; CI builds the kernels with both ends.
Each shim checks the installed version (or the attribute) once, at import.
"""

from __future__ import annotations

import re

import triton

TRITON_OLDEST = (3, 6, 0)  # the first release whose Gluon has the Hopper API and warp_specialize form used here
TRITON_NEWEST = (3, 9, 0)  # the newest release the kernels were built and tested with


def _release(text: str) -> tuple[int, int, int]:
    numbers = [int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))


TRITON_VERSION = _release(triton.__version__)


def triton_version_problem() -> str | None:
    """Why this triton is outside the verified range (None: it is inside)."""
    if TRITON_VERSION < TRITON_OLDEST:
        return f"triton {triton.__version__} is older than {'.'.join(map(str, TRITON_OLDEST))}, the oldest supported"
    if TRITON_VERSION[:2] > TRITON_NEWEST[:2]:
        return (f"triton {triton.__version__} is newer than {'.'.join(map(str, TRITON_NEWEST))}, "
                "the newest verified")
    return None


# Options of every kernel build. FP fusion (a*b+c as one FMA) is what the kernels were measured
# with; 3.9 warns when it is left to the default, which 3.10 turns off.
COMPILE_OPTIONS = {"enable_fp_fusion": True}


# --- the interpreter and host descriptors -------------------------------------------------------

try:  # the class triton.jit returns when TRITON_INTERPRET=1 was set at import time
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - outside the supported range
    InterpretedFunction = ()

try:  # host-side TMA descriptors for tl.make_tensor_descriptor / descriptor arguments
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - outside the supported range: the portable forward keeps plain loads
    TensorDescriptor = None


# --- launching a compiled kernel directly --------------------------------------------------------

def load_compiled(compiled) -> None:
    """Load a compiled kernel's module on the current device: ``CompiledKernel._init_handles``,
    private, in every supported release; past them, reading ``.run`` loads it lazily."""
    if TRITON_VERSION <= TRITON_NEWEST or hasattr(compiled, "_init_handles"):
        compiled._init_handles()
    else:
        compiled.run  # noqa: B018 - the property loads the module


_RUNTIME_KNOBS = triton.knobs.runtime  # a public knob since 3.4


def active_launch_hooks():
    """Triton's launch enter and exit hooks when something listens (a profiler), else None.

    From 3.6 each knob is a chain of hooks, empty by default (``.calls``); a hook set as a plain
    callable, or None, is read as itself. Paid on every direct launch: one function call.
    """
    enter, exit_ = _RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook
    if getattr(enter, "calls", enter) or getattr(exit_, "calls", exit_):
        return enter, exit_
    return None


# --- Gluon ----------------------------------------------------------------------------------------

def _gluon():
    """(GluonASTSource, tma_load, tma_store, cta_barrier, tma_atomic_add, reinterpret_shared), or the
    ImportError that says why Gluon is unusable."""
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon._runtime import GluonASTSource  # private: the compile source of a Gluon kernel
        from triton.experimental.gluon.language.nvidia.hopper import tma
    except ImportError as error:
        return error
    # 3.8 renamed the bulk tensor copies (async_load / async_store); 3.9 removed the old names.
    if TRITON_VERSION >= (3, 8, 0):
        load, store = tma.async_load, tma.async_store
    else:
        load, store = tma.async_copy_global_to_shared, tma.async_copy_shared_to_global
    # A barrier over the threads of a CTA (of a warp partition): thread_barrier until 3.6, barrier from 3.7.
    barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # The bulk tensor reduce-add (cp.reduce.async.bulk.tensor): public from 3.8; before, the
    # builder's op, which the public function wraps, without a Python name.
    atomic_add = getattr(tma, "async_atomic_add", None) or _tma_atomic_add_builtin()
    return GluonASTSource, load, store, barrier, atomic_add, _reinterpret_builtin()


def _tma_atomic_add_builtin():
    from triton._C.libtriton import ir
    from triton.experimental.gluon.language._core import builtin

    @builtin
    def async_atomic_add(tensor_desc, coord, src, _semantic=None):
        """Add a shared-memory tile into global memory with the bulk tensor copy engine."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    return async_atomic_add


def _reinterpret_builtin():
    from triton.experimental.gluon.language._core import _unwrap_if_constexpr, builtin

    @builtin
    def reinterpret_shared(memory, dtype, shape, layout, _semantic=None):
        """The same shared memory as another dtype, shape and layout (a method named
        ``_reinterpret`` until 3.8, ``reinterpret`` from 3.9)."""
        shape = [_unwrap_if_constexpr(size) for size in shape]
        return _semantic.memdesc_reinterpret(memory, _unwrap_if_constexpr(dtype), shape, _unwrap_if_constexpr(layout))

    return reinterpret_shared


_GLUON = _gluon()
GLUON_IMPORT_ERROR = _GLUON if isinstance(_GLUON, ImportError) else None
if GLUON_IMPORT_ERROR is None:
    GluonASTSource, tma_load, tma_store, cta_barrier, tma_atomic_add, reinterpret_shared = _GLUON
else:
    GluonASTSource = tma_load = tma_store = cta_barrier = tma_atomic_add = reinterpret_shared = None
