"""Launcher of the materialising baseline (step 2)."""

from __future__ import annotations

import torch
import triton

from ...compat import COMPILE_OPTIONS
from ...params import AttentionParams
from ...runtime import INTERPRETED
from ..triton.config import padded_head_dim
from ..triton.launch import dot_precision, window_bounds
from .kernels import pv_kernel, scores_kernel, softmax_kernel

NAIVE_BLOCK = 16 if INTERPRETED else 64
NAIVE_SOFTMAX_BLOCK = 64 if INTERPRETED else 1024


def launch_naive(q, k, v, out, lse, params: AttentionParams) -> list:
    """Materialising baseline: S (fp32) and unnormalised P (input dtype) are allocated in full.

    Returns the three compiled kernels (None under the interpreter).
    """
    batch, num_q_heads, seqlen_q, head_dim = q.shape
    num_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    group_size = num_q_heads // num_kv_heads
    head_dim_v = v.shape[3]
    block_d, block_dv = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    has_left, has_right, lo, hi = window_bounds(params)
    # Wide head dims would not fit a 64x64 tile per operand in shared memory.
    block = NAIVE_BLOCK if max(block_d, block_dv) <= 128 else min(NAIVE_BLOCK, 32)
    scores = torch.empty((batch, num_q_heads, seqlen_q, seqlen_k), device=q.device, dtype=torch.float32)
    probs = torch.empty((batch, num_q_heads, seqlen_q, seqlen_k), device=q.device, dtype=q.dtype)
    inv_row_sum = torch.empty((batch, num_q_heads, seqlen_q), device=q.device, dtype=torch.float32)
    precision = dot_precision(q.dtype)
    compiled = [scores_kernel[(batch * num_q_heads, triton.cdiv(seqlen_q, block), triton.cdiv(seqlen_k, block))](
        q, k, scores, *q.stride(), *k.stride(),
        num_q_heads, group_size, seqlen_q, seqlen_k, lo, hi, params.options.scale,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block, BLOCK_N=block,
        HAS_LEFT=has_left, HAS_RIGHT=has_right, DOT_PRECISION=precision, **COMPILE_OPTIONS,
    )]
    softmax_block = min(NAIVE_SOFTMAX_BLOCK, triton.next_power_of_2(seqlen_k))
    compiled.append(softmax_kernel[(batch * num_q_heads * seqlen_q,)](
        scores, probs, inv_row_sum, lse, seqlen_k, BLOCK_N=softmax_block,
        num_warps=4 if softmax_block >= 512 else 1, **COMPILE_OPTIONS,
    ))
    compiled.append(pv_kernel[(batch * num_q_heads, triton.cdiv(seqlen_q, block))](
        probs, v, inv_row_sum, out, *v.stride(), *out.stride(),
        num_q_heads, group_size, seqlen_q, seqlen_k,
        HEAD_DIM=head_dim_v, BLOCK_D=block_dv, BLOCK_M=block, BLOCK_N=block, DOT_PRECISION=precision,
        **COMPILE_OPTIONS,
    ))
    return compiled
