"""What runs a call: each backend says whether it supports the parameters, and if not, why.

Forward: the Hopper backend (``gluon_sm90``) first, where the tuning data picks one of its
schedules for the call's key; then the portable Triton backend, which takes every dense call.
The naive baseline runs only when asked for by name. An explicit ``config=`` names its backend
(``ForwardConfig``: portable; ``HopperSchedule``: Gluon): if that backend refuses the call, the
call raises ``ValueError`` with the reason instead of running something else.

A prepared forward (:class:`PreparedForward`) is built once per call signature and reused: a
repeated call costs a dictionary lookup, two allocations and a launch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass, field

import torch

from .backends.gluon_sm90.backend import HopperBackend
from .backends.naive.backend import NaiveBackend
from .backends.triton.backend import TritonBackend
from .backends.triton.launch import tma_compatible
from .params import AttentionParams
from .runtime import KernelBuildError

BACKENDS = {backend.name: backend for backend in (HopperBackend(), TritonBackend(), NaiveBackend())}
FORWARD_ORDER = ("gluon_sm90", "triton")
BACKWARD_BACKEND = BACKENDS["triton"]
HOPPER_BACKEND = BACKENDS["gluon_sm90"]


@dataclass
class Explanation:
    """Which backend and config run a call, where the config came from, and why the others refused."""

    backend: str
    config: object
    source: str
    refused: dict[str, str] = field(default_factory=dict)
    backward: str | None = None

    @property
    def launch_free(self) -> bool:
        """Nothing runs: empty or meta inputs."""
        return self.backend == "none"

    def __str__(self) -> str:
        config = self.config.text() if hasattr(self.config, "text") else self.config
        lines = [f"runs: {self.backend} ({BACKENDS[self.backend].description if self.backend in BACKENDS else ''})",
                 f"config: {config} (from {self.source})"]
        if self.backward:
            lines.append(f"backward: {self.backward}")
        lines += [f"not {name}: {reason}" for name, reason in self.refused.items()]
        return "\n".join(lines)


def shares_one_kv_head(params: AttentionParams, k, v) -> bool:
    """Whether k and v repeat one head over their kv_heads > 1 (stride 0 over heads, as from
    ``expand``): the Hopper forward may read them as one KV head."""
    return params.kv_heads > 1 and k.stride(1) == 0 and v.stride(1) == 0


def output_order(q) -> list[int] | None:
    """q's dims from outermost to innermost by stride (None: q is contiguous), the order in which an
    output with another head dim is laid out, as ``torch.empty_like(q)`` keeps q's."""
    if q.is_contiguous():
        return None
    return sorted(range(q.ndim), key=lambda dim: (-q.stride(dim), dim))


def empty_output(q, head_dim_v: int, order: list[int] | None = None):
    """The output of a call: q's shape with the value head dim last, in q's layout (BSHD stays
    BSHD). ``order``: :func:`output_order` of q, where the caller has it."""
    if head_dim_v == q.shape[-1]:
        return torch.empty_like(q)
    shape = (*q.shape[:-1], head_dim_v)
    if order is None:
        order = output_order(q)
        if order is None:
            return torch.empty(shape, dtype=q.dtype, device=q.device)
    laid_out = torch.empty([shape[dim] for dim in order], dtype=q.dtype, device=q.device)
    return laid_out.permute(sorted(range(len(order)), key=order.__getitem__))


_warned_build_failures: set[str] = set()
_SAME_DEVICE = contextlib.nullcontext()


def choose_forward(params: AttentionParams, q, k, v, failed: dict[str, str] | None = None) -> Explanation:
    """The backend and config for this call, with every refusal on the way.

    ``failed``: backends whose kernel failed to build for this call (backend -> reason); they are
    skipped, and each reason is warned about once per process.
    """
    for reason in (failed or {}).values():
        if reason not in _warned_build_failures:
            _warned_build_failures.add(reason)
            warnings.warn(f"fmha: {reason}; the portable Triton kernel runs instead", RuntimeWarning, stacklevel=2)
    explicit = params.options.backend
    if explicit:
        backend = BACKENDS[explicit]
        reason = backend.refusal(params, q, k, v)
        if reason is not None:
            raise ValueError(f"fmha: config= asks for the {explicit} backend, which cannot run this call: {reason}")
        config, source = backend.forward_config(params)
        return Explanation(explicit, config, source)
    refused = {}
    for name in FORWARD_ORDER:
        backend = BACKENDS[name]
        reason = failed[name] if failed and name in failed else backend.refusal(params, q, k, v)
        if reason is None:
            config, source = backend.forward_config(params)
            if config is not None:
                return Explanation(name, config, source, refused)
            reason = f"the tuning data picks another kernel here ({source})"
        refused[name] = reason
    raise ValueError("fmha: no backend can run this call: "
                     + "; ".join(f"{name}: {reason}" for name, reason in refused.items()))


class PreparedForward:
    """A call signature's forward: allocates the outputs, handles empty inputs, launches."""

    __slots__ = ("params", "explanation", "launch", "lse_shape", "device_index", "empty", "no_keys",
                 "head_dim_v", "output_order")

    def __init__(self, params: AttentionParams, q, k, v):
        self.params = params
        self.lse_shape = params.lse_shape
        self.head_dim_v = params.head_dim_v  # 0: the output is shaped like q
        self.output_order = output_order(q) if self.head_dim_v else None
        self.device_index = params.device.index if params.device.type == "cuda" else None
        self.empty = params.empty
        self.no_keys = params.no_keys
        if params.device.type == "meta":  # shapes only (torch.compile's fakes, export, model sizing)
            self.explanation = Explanation("none", None, "meta tensors: shapes only, nothing is launched")
            self.launch, self.no_keys = None, False
        elif self.empty or self.no_keys:
            self.explanation = Explanation("none", None, "empty input: nothing is launched")
            self.launch = None
        else:
            failed = {}
            self.launch = self._one_kv_head_launch(params, q, k, v, failed) if shares_one_kv_head(params, k, v) else None
            if self.launch is None:
                self.explanation = choose_forward(params, q, k, v, failed)
                self.launch = self._prepare(params, q, k, v)

    def _prepare(self, params: AttentionParams, q, k, v):
        try:
            return BACKENDS[self.explanation.backend].prepare_forward(params, self.explanation.config)
        except KernelBuildError as error:
            if params.options.backend:  # asked for by name: say so rather than run something else
                raise ValueError(f"fmha: config= asks for the {params.options.backend} backend: {error}") from None
            self.explanation = choose_forward(params, q, k, v, failed={self.explanation.backend: str(error)})
            return BACKENDS[self.explanation.backend].prepare_forward(params, self.explanation.config)

    def _one_kv_head_launch(self, params: AttentionParams, q, k, v, failed: dict[str, str]):
        """The Hopper forward reading k and v, expanded over their heads with stride 0, as one KV
        head (MQA): the bulk copy engine takes no zero stride. None where it would not run (a
        kernel that fails to build is added to ``failed``)."""
        one_head = dataclasses.replace(params, kv_heads=1)
        try:
            explanation = choose_forward(one_head, q, k[:, :1], v[:, :1])
        except ValueError:  # an explicit config refuses it: the call's own parameters say why
            return None
        if explanation.backend != HOPPER_BACKEND.name:
            return None
        self.explanation = dataclasses.replace(
            explanation, source=f"{explanation.source}; k and v, expanded over heads, read as one KV head")
        try:
            return HOPPER_BACKEND.prepare_forward(one_head, explanation.config, first_kv_head=True)
        except KernelBuildError as error:
            failed[HOPPER_BACKEND.name] = str(error)
            return None

    def __call__(self, q, k, v, *seqlens, **scores) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)``; ``out`` keeps q's layout (BSHD stays BSHD) when q is dense.

        Packed sequences (varlen) also pass ``cu_seqlens_q, cu_seqlens_k``; score features pass
        ``scores=ScoreTensors(...)``.
        """
        out = empty_output(q, self.head_dim_v, self.output_order) if self.head_dim_v else torch.empty_like(q)
        lse = torch.empty(self.lse_shape, device=q.device, dtype=torch.float32)
        if self.launch is None:
            if self.no_keys and not self.empty:  # every row sees nothing
                out.zero_(), lse.fill_(float("-inf"))
            return out, lse
        index = self.device_index
        if index is not None and index != torch.cuda.current_device():
            with torch.cuda.device(index):
                self.launch(q, k, v, out, lse, *seqlens, **scores)
        else:
            self.launch(q, k, v, out, lse, *seqlens, **scores)
        return out, lse


# Prepared forwards by (params, strides, alignment), and the entry point's cache of raw call
# signatures. Bounded: a server that sees ever new lengths starts over rather than growing.
MAX_SIGNATURES = 4096
_prepared: dict = {}
signatures: dict = {}  # fmha.api.attention: call signature -> (params, PreparedForward)


def remember(cache: dict, key, value):
    if len(cache) >= MAX_SIGNATURES:
        cache.clear()
    cache[key] = value
    return value


def prepared_forward(params: AttentionParams, q, k, v, *seqlens) -> PreparedForward:
    """The prepared forward of this call's signature (shapes, strides, options, 16-byte alignment).

    Packed sequences pass their cu_seqlens too: their alignment is part of the signature.
    """
    pointers = q.data_ptr() | k.data_ptr() | v.data_ptr()
    for cu_seqlens in seqlens:
        pointers |= cu_seqlens.data_ptr()
    key = (params, q.stride(), k.stride(), v.stride(), pointers & 15 == 0)
    prepared = _prepared.get(key)
    if prepared is None:
        prepared = remember(_prepared, key, PreparedForward(params, q, k, v))
    return prepared


_prepared_backward: dict = {}


def hopper_backward(params: AttentionParams, *tensors, attn_mask=None):
    """The Gluon backward prepared for this call signature, or (None, reason) where the portable
    one runs. ``tensors``: dout, q, k, v, dq, dk, dv; ``attn_mask``: SDPA's mask view, if any."""
    pointers = 0
    for tensor in tensors:
        pointers |= tensor.data_ptr()
    key = (params, tuple(tensor.stride() for tensor in tensors), pointers & 15 == 0,
           None if attn_mask is None else attn_mask.stride())
    prepared = _prepared_backward.get(key)
    if prepared is None:
        reason = HOPPER_BACKEND.backward_refusal(params, *tensors, attn_mask=attn_mask)
        launch = None
        if reason is None:
            try:
                launch = HOPPER_BACKEND.prepare_backward(params)
            except KernelBuildError as error:
                reason = str(error)
                if reason not in _warned_build_failures:
                    _warned_build_failures.add(reason)
                    warnings.warn(f"fmha: {reason}; the portable Triton backward runs instead", RuntimeWarning,
                                  stacklevel=2)
        prepared = remember(_prepared_backward, key, (launch, reason))
    return prepared


def run_backward(dout, q, k, v, out, lse, params: AttentionParams, config=None, seqlens: tuple = (), **scores):
    """``(dq, dk, dv)`` in the dtypes and shapes of q, k and v: the Hopper backward where it
    runs the call, else the portable one (always with an explicit portable ``config``).

    Packed sequences (varlen) pass ``seqlens=(cu_seqlens_q, cu_seqlens_k)``; score features pass
    ``scores=ScoreTensors(...)``, whose ``sinks_grad`` receives the sinks' gradient.
    """
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if params.device.type == "meta":
        return dq, dk, dv
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    hopper = None
    if config is None and params.device.type == "cuda":
        if not tma_compatible(dout):
            dout = dout.contiguous()  # e.g. the expanded gradient of a sum
        score_tensors = scores.get("scores")
        attn_mask = None if score_tensors is None else score_tensors.attn_mask
        if params.head_dim_v:
            return _one_head_dim_backward(dout, q, k, v, out, lse, params, seqlens, attn_mask, dq, dk, dv, **scores)
        hopper, _ = hopper_backward(params, dout, q, k, v, dq, dk, dv, attn_mask=attn_mask)
    index = params.device.index if params.device.type == "cuda" else None
    with torch.cuda.device(index) if index is not None and index != torch.cuda.current_device() else _SAME_DEVICE:
        if hopper is not None:
            hopper(dout, q, k, v, out, lse, dq, dk, dv, *seqlens, **scores)
        else:
            BACKWARD_BACKEND.backward(dout, q, k, v, out, lse, dq, dk, dv, params, config, seqlens, **scores)
    return dq, dk, dv


def one_head_dim_params(params: AttentionParams) -> AttentionParams:
    """A call whose v has a head dim of its own as the one-head-dim call the Gluon backward runs:
    every tensor zero-padded to the wider head dim (:func:`_one_head_dim_backward`)."""
    return dataclasses.replace(params, head_dim=max(params.head_dim, params.value_head_dim), head_dim_v=0)


def _one_head_dim_backward(dout, q, k, v, out, lse, params: AttentionParams, seqlens, attn_mask, dq, dk, dv,
                           **scores):
    """The backward of a call whose v has a head dim of its own, through the Gluon backward, which
    takes one: every tensor zero-padded to the wider head dim. The zero columns add nothing to
    Q·Kᵀ, dO·Vᵀ or delta = rowsum(O ⊙ dO), and the padded columns of the gradients are cut off
    (H200, D = 192 and Dv = 128: 1.9-2.1x the portable backward's speed, copies included;
    docs/perf.md). Where the Gluon backward refuses the call all the same, the portable backward
    runs it as it is."""
    one_dim = one_head_dim_params(params)
    width = one_dim.head_dim
    narrow = (dout, q, k, v, out)
    # Whether the Gluon backward takes the padded call, asked with unfilled tensors of the padded
    # shapes (the check reads shapes, strides and alignment only), so that a call it refuses
    # (deterministic=True, another GPU) copies nothing.
    shaped = [tensor if tensor.shape[-1] == width else
              torch.empty((*tensor.shape[:-1], width), dtype=tensor.dtype, device=tensor.device)
              for tensor in narrow[:4]]
    hopper, _ = hopper_backward(one_dim, *shaped, *shaped[1:4], attn_mask=attn_mask)
    index = params.device.index
    with torch.cuda.device(index) if index is not None and index != torch.cuda.current_device() else _SAME_DEVICE:
        if hopper is None:
            BACKWARD_BACKEND.backward(dout, q, k, v, out, lse, dq, dk, dv, params, None, seqlens, **scores)
            return dq, dk, dv
        wide = [tensor if tensor.shape[-1] == width else torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]))
                for tensor in narrow]
        # a gradient whose tensor is as wide already is written in place
        wide_grads = [grad if wide_tensor is tensor else torch.empty_like(wide_tensor)
                      for grad, tensor, wide_tensor in zip((dq, dk, dv), (q, k, v), wide[1:4])]
        hopper(*wide, lse, *wide_grads, *seqlens, **scores)
    for grad, wide_grad in zip((dq, dk, dv), wide_grads):
        if wide_grad is not grad:
            grad.copy_(wide_grad[..., :grad.shape[-1]])
    return dq, dk, dv


def forget() -> None:
    """Drop prepared forwards and call signatures (after tuning data changed)."""
    _prepared.clear()
    _prepared_backward.clear()
    signatures.clear()
