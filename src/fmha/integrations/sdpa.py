"""fmha behind PyTorch's flash-attention registry.

``import fmha`` registers the implementation "FMHA"; activating it puts fmha's kernels behind
PyTorch's flash-attention operators::

    fmha.integrations.sdpa.activate()          # or torch.nn.attention.activate_flash_attention_impl("FMHA")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # runs fmha, forward and backward

From then on these run fmha: ``F.scaled_dot_product_attention`` wherever SDPA picks its flash
backend, ``torch.nn.attention.varlen.varlen_attn``, and PyTorch's context parallelism, which calls
the flash operator once per chunk (:mod:`fmha.distributed`). ``deactivate()`` (or
``torch.nn.attention.restore_flash_attention_impl()``) puts torch's kernels back.

The operators replaced, with their schemas as they are (torch's CUDA kernels; under
``TRITON_INTERPRET=1`` also on CPU tensors, for which torch has no kernel of these operators):

* ``aten::_scaled_dot_product_flash_attention`` and ``..._backward``: (B, H, S, D) tensors.
* ``aten::_flash_attention_forward`` and ``..._backward``: (B, S, H, D), or packed sequences
  (total, H, D) cut by ``cum_seq_q``/``cum_seq_k`` (varlen), with ``window_size_left/right``.
* ``aten::_flash_attention_forward_no_dropout_inplace`` (torch 2.13 and later): the same, into ``out``.

They keep the semantics of torch's own flash kernels (FlashAttention-2): ``is_causal`` aligned
bottom-right when Sq != Sk, as ``fmha.attention``; a window side that is None or negative is
unbounded, and ``is_causal`` sets the right side to 0; GQA when the key has fewer heads. The
outputs have torch's shapes: the LSE is float32 natural log, (B, H, Sq), or (H, total_q) for
packed sequences; the dropout RNG state is ``(2,)`` and ``()`` uint64 zeros (no dropout runs);
the debug mask is empty. One difference: a query row that sees no key (causal with Sq > Sk) has
LSE = -inf here, +inf in FlashAttention-2; both outputs are zeros.

A call fmha cannot run (``dropout_p > 0``, ``return_debug_mask``, ALiBi, ``seqused_k``,
``block_table``, ``num_splits``, FP8, or anything fmha raises ``NotImplementedError`` for) runs the
kernel that torch had before activation (``torch.library.get_kernel``). With ``strict=True``, or
where torch has no kernel of its own (CPU tensors), it raises ``NotImplementedError`` with the reason.
The backward accepts the LSE of either implementation, so a forward that torch ran can be
differentiated by fmha.

Versions: the registry and ``torch.library.get_kernel`` exist in torch 2.11 and 2.13 (both
checked); on an older torch (pyproject allows 2.5 and later) nothing is registered and
:func:`activate` raises ``RuntimeError`` naming the requirement.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch
import torch.nn.attention

from .. import dispatch
from ..api import attention
from ..flash_attn import flash_attn_varlen_func
from ..params import attention_params, varlen_params
from ..runtime import INTERPRETED

NAME = "FMHA"
REQUIREMENT = ("torch 2.11 or later (torch.nn.attention.register_flash_attention_impl and "
               "torch.library.get_kernel)")
_FN = "fmha.integrations.sdpa"
log = logging.getLogger(__name__)


def available() -> bool:
    """Whether this torch has the flash-attention registry that FMHA plugs into."""
    return hasattr(torch.nn.attention, "register_flash_attention_impl") and hasattr(torch.library, "get_kernel")


def _require(fn: str) -> None:
    if not available():
        raise RuntimeError(f"{fn}: PyTorch's flash-attention registry needs {REQUIREMENT}; "
                           f"this is torch {torch.__version__}")


def active() -> bool:
    """Whether FMHA is the active flash-attention implementation."""
    return available() and torch.nn.attention.current_flash_attention_impl() == NAME


def activate(*, strict: bool = False) -> None:
    """Run PyTorch's flash-attention operators on fmha (replaces any other active implementation).

    Args:
        strict: a call fmha cannot run raises ``NotImplementedError`` instead of running torch's kernel.
    """
    _require(f"{_FN}.activate")
    torch.nn.attention.activate_flash_attention_impl(NAME)
    _active.strict = strict


def deactivate() -> None:
    """Put torch's own flash kernels back, if FMHA is active."""
    if active():
        torch.nn.attention.restore_flash_attention_impl()


@contextlib.contextmanager
def activated(*, strict: bool = False):
    """FMHA active inside the block; torch's own kernels after it."""
    activate(strict=strict)
    try:
        yield
    finally:
        deactivate()


# The operator implementations: aten's schemas, fmha's kernels.

def _unbounded(side):
    """aten's window side (None or negative: unbounded) as fmha's (None: unbounded)."""
    return None if side is None or side < 0 else int(side)


def _window(left, right):
    left, right = _unbounded(left), _unbounded(right)
    return None if left is None and right is None else (left, right)


def _refuse_unsupported(dropout_p=0.0, return_debug_mask=False, **unsupported) -> None:
    """NotImplementedError for what torch's flash kernels do and fmha does not (yet)."""
    if dropout_p > 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p} (fmha's dropout draws its own philox key, not the "
                                  "seed and offset these ops pass between forward and backward)")
    if return_debug_mask:
        raise NotImplementedError("return_debug_mask=True (the dropout pattern)")
    for name, value in unsupported.items():  # also arguments of a newer torch that fmha does not know
        if value is not None:
            raise NotImplementedError(f"{name}={value!r} is not supported by fmha")


def _rng_state(device):
    """torch's flash kernels return their dropout RNG state (seed and offset); with no dropout, zeros."""
    return (torch.zeros(2, dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device))


def _no_debug_mask(query):
    return torch.empty(0, dtype=query.dtype, device=query.device)


def _like(result, query):
    """``result`` with the strides of ``torch.empty_like(query)``, as torch's fake kernels promise."""
    expected = torch.empty_like(query)
    if result.stride() == expected.stride():
        return result
    return expected.copy_(result)


def _forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale, left, right):
    """``(out, lse)`` of ``aten::_flash_attention_forward``: dense (B, S, H, D) or packed (total, H, D)."""
    if cum_seq_q is None:
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out, lse = attention(q, k, v, causal=is_causal, scale=scale, window=_window(left, right), return_lse=True)
        return _like(out.transpose(1, 2), query), lse
    if cum_seq_k is None:
        raise NotImplementedError("cum_seq_k=None (keys given by seqused_k or a block table)")
    window_size = tuple(-1 if side is None else side for side in map(_unbounded, (left, right)))  # FA2's -1
    out, lse, _ = flash_attn_varlen_func(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, softmax_scale=scale,
                                         causal=is_causal, window_size=window_size, return_attn_probs=True)
    return out, lse


def _flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                             return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                             seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None, **newer):
    _refuse_unsupported(dropout_p, return_debug_mask, seqused_k=seqused_k, alibi_slopes=alibi_slopes,
                        block_table=block_table, num_splits=num_splits, **newer)
    out, lse = _forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale, window_size_left,
                        window_size_right)
    return (out, lse, *_rng_state(query.device), _no_debug_mask(query))


def _flash_attention_forward_no_dropout_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                                dropout_p, is_causal, return_debug_mask, *, scale=None,
                                                window_size_left=None, window_size_right=None, seqused_k=None,
                                                alibi_slopes=None, block_table=None, num_splits=None, **newer):
    _refuse_unsupported(dropout_p, return_debug_mask, seqused_k=seqused_k, alibi_slopes=alibi_slopes,
                        block_table=block_table, num_splits=num_splits, **newer)
    result, lse = _forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale,
                           window_size_left, window_size_right)
    out.copy_(result)
    return lse


def _flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                              dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                              window_size_right=None, **newer):
    _refuse_unsupported(dropout_p, **newer)
    window = _window(window_size_left, window_size_right)
    if cum_seq_q is None:
        q, k, v, o, do = (t.transpose(1, 2) for t in (query, key, value, out, grad_out))
        params = attention_params(_FN, q, k, v, causal=is_causal, scale=scale, window=window)
        grads = dispatch.run_backward(do, q, k, v, o, logsumexp, params)
        return tuple(_like(grad.transpose(1, 2), t) for grad, t in zip(grads, (query, key, value)))
    params = varlen_params(_FN, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, causal=is_causal, scale=scale,
                           window=window)
    return dispatch.run_backward(grad_out, query, key, value, out, logsumexp, params, seqlens=(cum_seq_q, cum_seq_k))


def _scaled_dot_product_flash_attention(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                                        *, scale=None, **newer):
    _refuse_unsupported(dropout_p, return_debug_mask, **newer)
    out, lse = attention(query, key, value, causal=is_causal, scale=scale, return_lse=True)
    return (out, lse, None, None, query.shape[2], key.shape[2], *_rng_state(query.device), _no_debug_mask(query))


def _scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                                 max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                                                 scale=None, **newer):
    _refuse_unsupported(dropout_p, **newer)
    params = attention_params(_FN, query, key, value, causal=is_causal, scale=scale)
    return dispatch.run_backward(grad_out, query, key, value, out, logsumexp, params)


OPERATORS = {
    "_scaled_dot_product_flash_attention": _scaled_dot_product_flash_attention,
    "_scaled_dot_product_flash_attention_backward": _scaled_dot_product_flash_attention_backward,
    "_flash_attention_forward": _flash_attention_forward,
    "_flash_attention_backward": _flash_attention_backward,
    "_flash_attention_forward_no_dropout_inplace": _flash_attention_forward_no_dropout_inplace,
}


def dispatch_keys() -> tuple[str, ...]:
    """CUDA; and the CPU when Triton interprets (torch has no CPU kernel of these operators)."""
    return ("CUDA", "CPU") if INTERPRETED else ("CUDA",)


class _Fallback:
    """The kernels torch had before activation, and whether to run them when fmha refuses a call."""

    def __init__(self):
        self.kernels: dict[tuple[str, str], object] = {}
        self.strict = False

    def kernel(self, name, implementation):
        def kernel(keyset, *args, **kwargs):
            try:
                return implementation(*args, **kwargs)
            except NotImplementedError as refusal:
                device = next(arg.device for arg in args if isinstance(arg, torch.Tensor))
                key = "CUDA" if device.type == "cuda" else "CPU"
                original = self.kernels.get((name, key))
                if original is None or self.strict:
                    why = "strict=True" if original is not None else f"torch has no {key} kernel of its own for it"
                    raise NotImplementedError(f"{_FN} ({NAME}): fmha cannot run aten::{name}: {refusal} "
                                              f"({why})") from refusal
                log.debug("aten::%s runs torch's kernel: %s", name, refusal)
                return original.call_boxed(keyset, *args, **kwargs)

        return kernel


class Registration:
    """What torch's registry holds while FMHA is active; ``remove()`` puts torch's kernels back."""

    def __init__(self):
        self._fallback = _Fallback()
        self.library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # replacing torch's kernels is the point
            warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel")
            for key in dispatch_keys():
                for name, implementation in OPERATORS.items():
                    if not hasattr(torch.ops.aten, name):  # newer than this torch
                        continue
                    try:
                        self._fallback.kernels[name, key] = torch.library.get_kernel(f"aten::{name}", key)
                    except RuntimeError:  # no kernel for this key
                        pass
                    self.library.impl(name, self._fallback.kernel(name, implementation), key, with_keyset=True)

    @property
    def strict(self) -> bool:
        return self._fallback.strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self._fallback.strict = bool(value)

    def remove(self) -> None:
        global _active
        self.library = None  # the last reference: its registrations go with it
        if _active is self:
            _active = None


_active: Registration | None = None


def _register() -> Registration:
    """The registry's ``register_fn``: called by ``activate_flash_attention_impl("FMHA")``."""
    global _active
    _active = Registration()
    return _active


if available():
    torch.nn.attention.register_flash_attention_impl(NAME, register_fn=_register)
