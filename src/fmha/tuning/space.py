"""The search spaces: tile configs for each kernel, pruned by rules that say why.

Each rule takes a candidate and the problem and returns ``None`` (keep) or the reason to
drop it; its docstring names the rule. ``--dry-run`` prints the survivors and how many each
rule dropped; the tests check each rule on its own. :data:`SPACES` holds one
:class:`KernelSpace` per tuning key kernel: ``fwd`` and ``bwd``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import triton

from ..backends.triton.config import BackwardConfig, ForwardConfig, backward_shared_bytes, padded_head_dim

BLOCK_M_CHOICES = (16, 32, 64, 128, 256)
BLOCK_N_CHOICES = (32, 64, 128)
NUM_WARPS_CHOICES = (1, 4, 8)
NUM_STAGES_CHOICES = (2, 3, 4)
# The backward: BLOCK_N rows stay resident (keys in dK/dV, queries in dQ), BLOCK_M rows stream past.
BACKWARD_BLOCK_M_CHOICES = (16, 32, 64, 128)
BACKWARD_BLOCK_N_CHOICES = (32, 64, 128)
BACKWARD_NUM_WARPS_CHOICES = (4, 8)
BACKWARD_NUM_STAGES_CHOICES = (1, 2, 3)
# fp32 values one thread may keep live for the accumulator (BLOCK_M x D) and the score and
# probability tiles (2 x BLOCK_M x BLOCK_N): beyond this the kernel spills (255 registers a thread).
MAX_LIVE_FP32_PER_THREAD = 192
THREADS_PER_WARP = 32
# Hopper's shared memory per block when no device is visible (the CPU, --dry-run).
DEFAULT_SHARED_MEMORY = 227 * 1024


@dataclass(frozen=True)
class Problem:
    """What pruning needs to know about a tuning key."""

    head_dim: int
    element_size: int
    seqlen_q: int
    shared_memory: int = DEFAULT_SHARED_MEMORY
    seqlen_k: int | None = None  # None: as long as the query

    @property
    def key_length(self) -> int:
        return self.seqlen_q if self.seqlen_k is None else self.seqlen_k


def shared_memory_bytes(config: ForwardConfig, problem: Problem) -> int:
    """Q tile, plus K and V tiles for each pipeline stage."""
    block_d = padded_head_dim(problem.head_dim)
    q_tile = config.block_m * block_d * problem.element_size
    kv_tiles = 2 * config.num_stages * config.block_n * block_d * problem.element_size
    return q_tile + kv_tiles


def rule_shared_memory(config: ForwardConfig, problem: Problem) -> str | None:
    """shared memory over the device's limit"""
    needed = shared_memory_bytes(config, problem)
    if needed > problem.shared_memory:
        return f"needs {needed // 1024} KiB of shared memory, the device has {problem.shared_memory // 1024} KiB"
    return None


def rule_register_pressure(config: ForwardConfig, problem: Problem) -> str | None:
    """register pressure (would spill)"""
    block_d = padded_head_dim(problem.head_dim)
    live = config.block_m * (block_d + 2 * config.block_n) // (config.num_warps * THREADS_PER_WARP)
    if live > MAX_LIVE_FP32_PER_THREAD:
        return f"{live} live fp32 values per thread at D={problem.head_dim} (limit {MAX_LIVE_FP32_PER_THREAD}): spills"
    return None


def rule_block_m_within_query(config: ForwardConfig, problem: Problem) -> str | None:
    """BLOCK_M longer than the query"""
    longest_useful = max(16, triton.next_power_of_2(problem.seqlen_q))
    if config.block_m > longest_useful:
        return f"BLOCK_M={config.block_m} exceeds the query length bucket {longest_useful}"
    return None


def rule_rows_per_warp(config: ForwardConfig, problem: Problem) -> str | None:
    """rows per warp outside 16-32"""
    # An MMA instruction gives each warp 16 query rows: fewer leave warps idle, and more than
    # two such row tiles per warp serialise work that more warps could share.
    rows = config.block_m // config.num_warps
    if not 16 <= rows <= 32:
        return f"BLOCK_M={config.block_m} over {config.num_warps} warps is {rows} rows per warp (want 16-32)"
    return None


def rule_full_mma_rows(config: ForwardConfig, problem: Problem) -> str | None:
    """BLOCK_M < 64 for a long query"""
    # A Hopper warpgroup MMA covers 64 rows; shorter tiles only pay off for short queries.
    if config.block_m < 64 and problem.seqlen_q >= 64:
        return f"BLOCK_M={config.block_m} < 64 for a query of {problem.seqlen_q} rows under-uses the MMA"
    return None


PRUNING_RULES = (rule_block_m_within_query, rule_full_mma_rows, rule_rows_per_warp, rule_shared_memory,
                 rule_register_pressure)


def backward_shared_memory_bytes(config: BackwardConfig, problem: Problem) -> int:
    """The dK/dV kernel: K and V tiles resident, Q and dO tiles with their LSE and delta per stage
    (:func:`fmha.backends.triton.config.backward_shared_bytes`)."""
    return backward_shared_bytes(config, problem.head_dim, problem.element_size)


def rule_backward_shared_memory(config: BackwardConfig, problem: Problem) -> str | None:
    """shared memory over the device's limit"""
    needed = backward_shared_memory_bytes(config, problem)
    if needed > problem.shared_memory:
        return f"needs {needed // 1024} KiB of shared memory, the device has {problem.shared_memory // 1024} KiB"
    return None


def rule_backward_register_pressure(config: BackwardConfig, problem: Problem) -> str | None:
    """register pressure (would spill)"""
    # The forward's bound with two accumulators: dK and dV (BLOCK_N x D each) live for the whole
    # kernel, next to two transient BLOCK_N x BLOCK_M tiles (P and dP, then dS).
    block_d = padded_head_dim(problem.head_dim)
    live = 2 * config.block_n * (block_d + config.block_m) // (config.num_warps * THREADS_PER_WARP)
    if live > MAX_LIVE_FP32_PER_THREAD:
        return f"{live} live fp32 values per thread at D={problem.head_dim} (limit {MAX_LIVE_FP32_PER_THREAD}): spills"
    return None


def rule_backward_tiles_within_sequences(config: BackwardConfig, problem: Problem) -> str | None:
    """backward tile longer than its sequence"""
    # Bounds follow the dK/dV kernel (four of the backward's seven matmuls): BLOCK_N covers keys,
    # BLOCK_M queries. The smallest choice always passes, so short sequences keep candidates.
    longest_keys = max(BACKWARD_BLOCK_N_CHOICES[0], triton.next_power_of_2(problem.key_length))
    longest_queries = max(BACKWARD_BLOCK_M_CHOICES[0], triton.next_power_of_2(problem.seqlen_q))
    if config.block_n > longest_keys:
        return f"BLOCK_N={config.block_n} exceeds the key length bucket {longest_keys}"
    if config.block_m > longest_queries:
        return f"BLOCK_M={config.block_m} exceeds the query length bucket {longest_queries}"
    return None


BACKWARD_PRUNING_RULES = (rule_backward_tiles_within_sequences, rule_backward_shared_memory,
                          rule_backward_register_pressure)


def prune(candidates: list[ForwardConfig], problem: Problem, rules=PRUNING_RULES
          ) -> tuple[list[ForwardConfig], dict[ForwardConfig, tuple[str, str]]]:
    """Survivors, and for each dropped candidate the first rule it failed: ``(rule, reason)``."""
    kept, dropped = [], {}
    for config in candidates:
        for rule in rules:
            reason = rule(config, problem)
            if reason is not None:
                dropped[config] = (rule.__doc__, reason)
                break
        else:
            kept.append(config)
    return kept, dropped


Rule = Callable[[ForwardConfig, Problem], str | None]


@dataclass(frozen=True)
class KernelSpace:
    """What the tuner knows about one kernel: its config class, the choices and the rules."""

    config_class: type[ForwardConfig]
    block_m: tuple[int, ...]
    block_n: tuple[int, ...]
    num_warps: tuple[int, ...]
    num_stages: tuple[int, ...]
    rules: tuple[Rule, ...]
    # What a shipped config tuned for other lengths must pass to be used for this key.
    fits_lengths: Rule

    def all_candidates(self) -> list[ForwardConfig]:
        return [self.config_class(*values) for values in itertools.product(
            self.block_m, self.block_n, self.num_warps, self.num_stages)]

    def prune(self, candidates: list[ForwardConfig], problem: Problem):
        return prune(candidates, problem, self.rules)

    def candidates(self, problem: Problem) -> list[ForwardConfig]:
        return self.prune(self.all_candidates(), problem)[0]


SPACES = {
    "fwd": KernelSpace(ForwardConfig, BLOCK_M_CHOICES, BLOCK_N_CHOICES, NUM_WARPS_CHOICES, NUM_STAGES_CHOICES,
                       PRUNING_RULES, rule_block_m_within_query),
    "bwd": KernelSpace(BackwardConfig, BACKWARD_BLOCK_M_CHOICES, BACKWARD_BLOCK_N_CHOICES,
                       BACKWARD_NUM_WARPS_CHOICES, BACKWARD_NUM_STAGES_CHOICES, BACKWARD_PRUNING_RULES,
                       rule_backward_tiles_within_sequences),
}


def all_candidates() -> list[ForwardConfig]:
    """The forward's whole space."""
    return SPACES["fwd"].all_candidates()
