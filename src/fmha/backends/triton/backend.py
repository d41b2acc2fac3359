"""The portable backend: the Triton forward and backward, on every GPU and under the interpreter."""

from __future__ import annotations

import dataclasses
import os

import torch

from ...params import NO_SCORE_TENSORS, AttentionParams, ScoreTensors
from ...runtime import INTERPRETED, Float32Forward, interpreter_upcasts, multiprocessors
from ...tuning import lookup
from .config import (INTERPRETER_BACKWARD_CONFIG, INTERPRETER_FORWARD_CONFIG, BackwardConfig, ForwardConfig,
                     SplitKVConfig, split_kv_config)
from .launch import PortableForward, SplitKVForward, launch_backward


def tile_params(params: AttentionParams) -> AttentionParams:
    """The parameters the tiles are chosen for: with a value head dim of its own, the wider of the
    two head dims (the tuning data and heuristics know one head dim)."""
    if params.head_dim_v:
        return dataclasses.replace(params, head_dim=max(params.head_dim, params.head_dim_v), head_dim_v=0)
    return params


class TritonBackend:
    name = "triton"
    description = "portable Triton kernel (any GPU; the CPU under TRITON_INTERPRET=1)"
    config_class = ForwardConfig

    def refusal(self, params: AttentionParams, q, k, v) -> str | None:
        if params.options.layout not in ("dense", "varlen"):
            return f"layout {params.options.layout!r} is not built yet"
        return None

    def forward_config(self, params: AttentionParams) -> tuple[ForwardConfig, str]:
        if params.options.backend == self.name:
            return ForwardConfig.from_ints(params.options.config), "explicit config="
        # The split-KV kernels have no score features: such calls keep the per-tile forward.
        split = None if params.varlen or params.options.score_features else split_kv_config(
            params, multiprocessors(params.device))
        if split is not None:
            return split, f"split-KV: {params.batch * params.kv_heads} KV heads for {multiprocessors(params.device)} multiprocessors"
        if INTERPRETED:
            return INTERPRETER_FORWARD_CONFIG, "pinned under the interpreter"
        return lookup.portable_config(tile_params(params), autotune=os.environ.get("FMHA_AUTOTUNE") == "1")

    def prepare_forward(self, params: AttentionParams, config: ForwardConfig | SplitKVConfig):
        forward = SplitKVForward if isinstance(config, SplitKVConfig) else PortableForward
        if interpreter_upcasts(params.dtype):
            return Float32Forward(forward(dataclasses.replace(params, dtype=torch.float32), config))
        return forward(params, config)

    def backward_config(self, params: AttentionParams) -> tuple[BackwardConfig, str]:
        if INTERPRETED:
            return INTERPRETER_BACKWARD_CONFIG, "pinned under the interpreter"
        return lookup.backward_config(tile_params(params))

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, params: AttentionParams,
                 config: BackwardConfig | None = None, seqlens: tuple = (), scores: ScoreTensors = NO_SCORE_TENSORS
                 ) -> None:
        if config is None:
            config, _ = self.backward_config(params)
        if interpreter_upcasts(params.dtype):
            grads = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (dq, dk, dv)]
            launch_backward(q.float(), k.float(), v.float(), out.float(), dout.float(), lse, *grads,
                            dataclasses.replace(params, dtype=torch.float32), config, *seqlens, scores=scores)
            for grad, grad32 in zip((dq, dk, dv), grads):
                grad.copy_(grad32)
            return
        launch_backward(q, k, v, out, dout, lse, dq, dk, dv, params, config, *seqlens, scores=scores)
