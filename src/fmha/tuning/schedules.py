"""Shipped Hopper schedules: which Gluon schedule (or the portable kernel) the default path takes.

``defaults/schedules.json`` holds, per GPU architecture, an ordered list of rules measured on a
GPU of it (docs/perf.md, "The Hopper kernel"). A rule's ``when`` tests the call; the first rule
that matches gives the schedule, or ``null`` for the portable kernel. Conditions:

* ``head_dim``: the tiles' head dim (the call's rounded up to 64, 128 or 256,
  :func:`fmha.backends.gluon_sm90.schedule.tile_head_dim`) is equal;
* ``head_dim_below``: the call's own head dim is under;
* ``causal`` (a right window bound), ``varlen`` (packed sequences): equal;
* ``seqlen_q_from`` / ``seqlen_q_below``: the query length is at least / under;
* ``flops_below``: 4·B·Hq·Sq·Sk·D is under (the 128-row tiles would idle);
* ``tiles_per_sm_below``: 128-row tiles per multiprocessor are under (the grid would not fill the GPU);
* ``window``: the window has a left bound (sliding windows), or not;
* ``attn_mask``: SDPA's attn_mask is ``"bool"``, ``"float"`` (any float dtype) or ``""`` (none);
* ``alibi``, ``dropout``: the call has ALiBi slopes / a dropout probability, or not;
* ``score_features``: the call has any of softcap, ALiBi, sinks, an attn_mask or dropout, or none;
* ``softcap``: how the forward softmaxes softcapped scores: ``"bounded"`` against a fixed max,
  ``"running"``, or ``""`` (no softcap) (:func:`fmha.backends.gluon_sm90.schedule.softcap_kind`).

An entry that ``fmha tune`` stored in the cache for the call's key comes before these rules.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ..backends.gluon_sm90.schedule import HopperSchedule, softcap_kind, tile_head_dim
from ..params import AttentionParams

SCHEDULES_FILE = Path(__file__).parent / "defaults" / "schedules.json"
SCHEDULES_FORMAT = "fmha-schedules/1"


@functools.lru_cache(maxsize=None)
def _rules(architecture: str) -> tuple:
    try:
        data = json.loads(SCHEDULES_FILE.read_text())
    except (OSError, ValueError):
        return ()
    if data.get("format") != SCHEDULES_FORMAT:
        return ()
    rules = data.get("architectures", {}).get(architecture, {}).get("rules", [])
    return tuple((index, rule["when"], None if rule["schedule"] is None else HopperSchedule.from_record(rule["schedule"]))
                 for index, rule in enumerate(rules))


def _matches(when: dict, params: AttentionParams, multiprocessors: int) -> bool:
    tiles = params.batch * params.q_heads * -(-params.seqlen_q // 128)
    flops = 4 * params.batch * params.q_heads * params.seqlen_q * params.seqlen_k * params.head_dim
    tests = {
        "head_dim": lambda value: tile_head_dim(params.head_dim) == value,
        "head_dim_below": lambda value: params.head_dim < value,
        "causal": lambda value: params.causal == value,
        "varlen": lambda value: params.varlen == value,
        "seqlen_q_from": lambda value: params.seqlen_q >= value,
        "seqlen_q_below": lambda value: params.seqlen_q < value,
        "flops_below": lambda value: flops < value,
        "tiles_per_sm_below": lambda value: tiles < value * multiprocessors,
        "window": lambda value: (params.options.window_left is not None) == value,
        "attn_mask": lambda value: _mask_class(params.options.attn_mask_kind) == value,
        "alibi": lambda value: params.options.has_alibi == value,
        "dropout": lambda value: (params.options.dropout_p > 0.0) == value,
        "score_features": lambda value: params.options.score_features == value,
        "softcap": lambda value: softcap_kind(params) == value,
    }
    return all(tests[name](value) for name, value in when.items())


def shipped_schedule(params: AttentionParams, architecture: str,
                     multiprocessors: int) -> tuple[HopperSchedule | None, str]:
    """The first matching rule's schedule (None: the portable kernel) and which rule it was."""
    for index, when, schedule in _rules(architecture):
        if _matches(when, params, multiprocessors):
            return schedule, f"shipped rule {index} for {architecture} ({json.dumps(when)})"
    return None, f"no shipped rule for {architecture}"


def _mask_class(kind: str) -> str:
    return kind if kind in ("", "bool") else "float"


def rule_conditions() -> tuple[str, ...]:
    return ("head_dim", "causal", "varlen", "seqlen_q_from", "seqlen_q_below", "flops_below", "tiles_per_sm_below",
            "window", "attn_mask", "alibi", "dropout", "score_features", "softcap")
