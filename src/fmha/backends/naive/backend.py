"""The naive backend: step 2 of the ladder, forward only, only when asked for by name."""

from __future__ import annotations

import dataclasses

import torch

from ...params import AttentionParams
from ...runtime import Float32Forward, interpreter_upcasts


class NaiveForward:
    __slots__ = ("params",)

    def __init__(self, params: AttentionParams):
        self.params = params

    def __call__(self, q, k, v, out, lse):
        from .launch import launch_naive

        return launch_naive(q, k, v, out, lse, self.params)


class NaiveBackend:
    name = "naive"
    description = "materialising baseline: S and P in global memory (fmha.naive_attention)"
    config_class = None

    def refusal(self, params: AttentionParams, q, k, v) -> str | None:
        if params.options.backend != self.name:
            return "runs only when asked for (fmha.naive_attention)"
        return None

    def forward_config(self, params: AttentionParams):
        return None, "no tiles to tune"

    def prepare_forward(self, params: AttentionParams, config):
        if interpreter_upcasts(params.dtype):
            return Float32Forward(NaiveForward(dataclasses.replace(params, dtype=torch.float32)))
        return NaiveForward(params)
