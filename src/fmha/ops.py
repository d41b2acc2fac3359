"""Forward and backward on checked tensors: allocate outputs, handle empty inputs, pick a config, launch."""

from __future__ import annotations

import contextlib
from types import MappingProxyType

import torch

from .config import INTERPRETER_BACKWARD_CONFIG, INTERPRETER_FORWARD_CONFIG, BackwardConfig, ForwardConfig
from .launch import (INTERPRETED, hopper_forward_applies, launch_backward, launch_forward, launch_forward_hopper,
                     launch_naive, multiprocessors)
from .tuning.lookup import backward_config, forward_config

_NO_GUARD = contextlib.nullcontext()


def _device_guard(tensor: torch.Tensor):
    # Triton launches on the current device: switch only when the tensor lives elsewhere.
    if tensor.device.type == "cuda" and tensor.device.index != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return _NO_GUARD


# The smallest call measured on the Hopper kernel, (1,16,1024,64): 4·B·H·Sq·Sk·D = 2^32. Below it
# (decode, short sequences) the portable kernel's tuned small tiles serve; the Hopper kernel's
# 128-row tiles would idle. Its launch is not the reason: launched directly it costs less host
# time than the portable kernel's (benchmarks/results/h100_host_overhead.txt).
HOPPER_MIN_FLOPS = 1 << 32


def hopper_forward_plan(q, k, v, out, *, scale: float, causal: bool) -> MappingProxyType | None:
    """Whether the default path runs the warp-specialised Hopper kernel, and with which options.

    ``None``: the portable Triton kernel; otherwise the keyword options of
    ``launch_forward_hopper``. Measured on the H100 (docs/perf.md, "The Hopper kernel"):

    * D=128: two consumers on the persistent grid; below 8k queries each consumer's next Q loads
      early (two Q buffers) and causal tiles pair up longest with shortest per program. From 8k
      queries one Q buffer, and with a causal mask one program per tile (the hardware balances
      the long tiles better).
    * D=64 without a mask: one exponential in eight on the FMA units (the MUFU unit paces the
      softmax there) and two Q buffers, at every length (three 64-row consumers were slower in
      six rounds out of six at 16k queries). When the 128-row tiles are fewer than two per
      multiprocessor, one consumer per CTA and two CTAs per multiprocessor instead: 64-row
      tiles fill the GPU (+3 to +7%, rounds 12 and 16).
    * D=64 causal: below 2k queries (from 1k) one consumer per CTA, 64-key blocks, three CTAs per
      multiprocessor, which hide each other's tile starts and ends on short tiles, and every
      exponential on the MUFU unit (S=1k: +14 to +17% over both other kernels, rounds 15-17);
      from 2k queries two consumers on paired persistent tiles with two Q buffers, from 8k one
      program per tile, with the FMA exponentials. Below 1k queries the portable kernel (not
      measured against the Hopper kernel there).
    """
    batch, heads, seqlen_q, head_dim = q.shape
    if (4 * batch * heads * seqlen_q * k.shape[2] * head_dim < HOPPER_MIN_FLOPS
            or causal and head_dim == 64 and seqlen_q < 1024):
        return None
    if not hopper_forward_applies(q, k, v, out, scale):
        return None
    long_queries = seqlen_q >= 8192
    if head_dim == 128:
        if long_queries:
            return _GRID if causal else _PERSISTENT_GRID
        return _TWO_Q_BUFFERS
    if causal:
        if seqlen_q < 2048:
            return _SHORT_CAUSAL_D64
        return _GRID_EMULATED_EXP2 if long_queries else _TWO_Q_BUFFERS_EMULATED_EXP2
    if batch * heads * -(-seqlen_q // 128) < 2 * multiprocessors(q.device):
        return _SMALL_GRID_D64
    return _TWO_Q_BUFFERS_EMULATED_EXP2


# Shared by every call that takes them, so read-only.
_PERSISTENT_GRID = MappingProxyType({"persistent": True})
_GRID = MappingProxyType({"persistent": False})
_TWO_Q_BUFFERS = MappingProxyType({"persistent": True, "q_buffers": 2})
_GRID_EMULATED_EXP2 = MappingProxyType({"persistent": False, "emulated_exp2": 8})
_TWO_Q_BUFFERS_EMULATED_EXP2 = MappingProxyType({"persistent": True, "q_buffers": 2, "emulated_exp2": 8})
_SMALL_GRID_D64 = MappingProxyType({"persistent": True, "consumers": 1, "q_buffers": 2, "ctas_per_sm": 2,
                                    "emulated_exp2": 8})
_SHORT_CAUSAL_D64 = MappingProxyType({"persistent": True, "consumers": 1, "block_n": 64, "q_buffers": 2,
                                      "ctas_per_sm": 3})


def run_forward(q, k, v, *, causal_offset: int | None, scale: float, naive: bool = False,
                config: ForwardConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out, lse)``; ``out`` keeps q's layout (BSHD stays BSHD) when q is dense."""
    batch, num_q_heads, seqlen_q, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((batch, num_q_heads, seqlen_q), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    if k.shape[2] == 0:  # no keys at all: every row sees nothing
        return out.zero_(), lse.fill_(float("-inf"))
    with _device_guard(q):
        if naive:
            launch_naive(q, k, v, out, lse, causal_offset=causal_offset, scale=scale)
        elif config is None and (plan := hopper_forward_plan(
                q, k, v, out, scale=scale, causal=causal_offset is not None)) is not None:
            launch_forward_hopper(q, k, v, out, lse, causal_offset=causal_offset, scale=scale, **plan)
        else:
            if config is None:
                config = INTERPRETER_FORWARD_CONFIG if INTERPRETED else forward_config(q, k, causal_offset is not None)
            launch_forward(q, k, v, out, lse, causal_offset=causal_offset, scale=scale, config=config)
    return out, lse


def run_backward(dout, q, k, v, out, lse, *, causal_offset: int | None, scale: float,
                 config: BackwardConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dq, dk, dv)`` in the dtypes and shapes of q, k and v."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if config is None:
        config = INTERPRETER_BACKWARD_CONFIG if INTERPRETED else backward_config(q, k, causal_offset is not None)
    with _device_guard(q):
        launch_backward(q, k, v, out, dout, lse, dq, dk, dv, causal_offset=causal_offset, scale=scale,
                        config=config)
    return dq, dk, dv
