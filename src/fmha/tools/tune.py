"""``fmha tune``: search tile configs for a suite's keys, show best vs default vs heuristic, store.

``--kernel`` picks the forward (``fwd`` keys), the backward (``bwd`` keys) or both.
"""

from __future__ import annotations

import datetime
import json
import time
from collections import Counter
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ..backends.gluon_sm90.backend import HopperBackend
from ..backends.gluon_sm90.schedule import HopperSchedule, tile_head_dim
from ..backends.triton.config import ForwardConfig
from .. import dispatch
from ..params import attention_params
from ..runtime import shared_memory_per_block
from ..tuning import lookup, store
from ..tuning.autotune import best_of, measure_candidates, problem_for, winner_record
from ..tuning.key import ShapeKey, device_key, gpu_name
from ..tuning.lookup import DEFAULTS_FORMAT, heuristic_config, shipped_config
from ..tuning.space import DEFAULT_SHARED_MEMORY, SPACES, Problem
from .bench.cases import suite_cases
from .bench.peers import config_text as _config_text
from .console import make_console

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KERNEL_CHOICES = {"fwd": ("fwd",), "bwd": ("bwd",), "all": ("fwd", "bwd")}


# The Hopper schedules ``fmha tune`` times beside the portable tiles on sm_90 (the shipped rules' set).
HOPPER_CANDIDATES = (
    HopperSchedule(persistent=True), HopperSchedule(persistent=False),
    HopperSchedule(persistent=True, q_buffers=2),
    HopperSchedule(persistent=True, q_buffers=2, emulated_exp2=8),
    HopperSchedule(persistent=False, emulated_exp2=8),
    HopperSchedule(persistent=True, consumers=1, q_buffers=2, ctas_per_sm=2, emulated_exp2=8),
    HopperSchedule(persistent=True, consumers=1, block_n=64, q_buffers=2, ctas_per_sm=3),
    HopperSchedule(persistent=True, consumers=3, q_buffers=2, row_sum_mma=True),
    HopperSchedule(persistent=True, consumers=3, q_buffers=2, dynamic=True, row_sum_mma=True),
    HopperSchedule(persistent=True, q_buffers=2, dynamic=True, pack_p=True),
)


def hopper_candidates(case, dtype, device) -> list[HopperSchedule]:
    """The Hopper schedules for a forward key where the Gluon backend can run it (none elsewhere)."""
    q = torch.empty(case.batch, case.q_heads, case.seqlen_q, case.head_dim, device=device, dtype=dtype)
    k = torch.empty(case.batch, case.kv_heads, case.seqlen_k, case.head_dim, device=device, dtype=dtype)
    params = attention_params("fmha tune", q, k, k, causal=case.causal)
    if HopperBackend().refusal(params, q, k, k) is not None:
        return []
    tile_dim = tile_head_dim(case.head_dim)
    return [schedule for schedule in HOPPER_CANDIDATES if schedule.build_refusal(tile_dim) is None]


def _params(case, dtype, device):
    return lookup.params_of(device, dtype, case.head_dim, case.causal, case.q_heads, case.kv_heads, case.seqlen_q,
                            case.seqlen_k, batch=case.batch)


def _default_choice(shape: ShapeKey, case, dtype, device):
    """What a call of this key runs without the cache: a shipped Hopper schedule or portable config."""
    if shape.kernel == "fwd" and hopper_candidates(case, dtype, device):
        params = _params(case, dtype, device)
        from ..tuning.schedules import shipped_schedule
        from ..runtime import compute_capability, multiprocessors

        major, minor = compute_capability(device)
        schedule, _ = shipped_schedule(params, f"sm_{major}{minor}", multiprocessors(device))
        if schedule is not None:
            return schedule
    return shipped_config(gpu_name(device), shape)


def keyed_cases(args) -> dict[ShapeKey, object]:
    """The first case of each tuning key: a batch of 3 and of 4 at the same lengths tune once.

    A case's mode is its key's kernel (``fwd`` or ``bwd``): it says what is timed.
    """
    dtype = DTYPES[args.dtype]
    keyed = {}
    for case in suite_cases(args.suite, KERNEL_CHOICES[args.kernel], args.shape):
        shape = ShapeKey.of(case.mode, dtype, case.head_dim, case.causal, case.q_heads, case.kv_heads,
                            case.seqlen_q, case.seqlen_k)
        keyed.setdefault(shape, case)
    return keyed


def dry_run(args, console: Console) -> int:
    dtype = DTYPES[args.dtype]
    element_size = torch.empty((), dtype=dtype).element_size()
    shared = (shared_memory_per_block(torch.device("cuda", 0)) if torch.cuda.is_available()
              else DEFAULT_SHARED_MEMORY)
    if "bwd" in KERNEL_CHOICES[args.kernel]:
        console.print("tiles read BLOCK_M×BLOCK_N; in the backward BLOCK_N rows are resident, BLOCK_M rows streamed")
    for shape, case in keyed_cases(args).items():
        space = SPACES[shape.kernel]
        problem = Problem(case.head_dim, element_size, case.seqlen_q, shared, case.seqlen_k)
        kept, dropped = space.prune(space.all_candidates(), problem)
        console.print(f"[bold]{shape.text()}[/bold] ({case.label}): {len(kept)} candidates, {len(dropped)} pruned")
        console.print("  " + ", ".join(_config_text(c) for c in kept))
        reasons = Counter(rule for rule, _ in dropped.values())
        for reason, count in reasons.most_common():
            console.print(f"  pruned {count:3d}: {reason}")
    return 0


def run_tune(args) -> int:
    console = make_console()
    if args.dry_run:
        return dry_run(args, console)
    if not torch.cuda.is_available():
        console.print("fmha tune needs a CUDA GPU; none is visible (`fmha tune --dry-run` lists the candidates).")
        return 2
    dtype = DTYPES[args.dtype]
    device = torch.device("cuda", torch.cuda.current_device())
    keyed = keyed_cases(args)
    plans = {}
    for shape, case in keyed.items():
        candidates = SPACES[shape.kernel].candidates(problem_for(device, dtype, case.head_dim, case.seqlen_q,
                                                                 case.seqlen_k))
        if shape.kernel == "fwd":
            candidates += hopper_candidates(case, dtype, device)
        heuristic = heuristic_config(shape.kernel, case.head_dim, dtype, case.seqlen_q, device)
        default = _default_choice(shape, case, dtype, device)
        extra = [c for c in (heuristic, default) if c is not None and c not in candidates]
        plans[shape] = (case, candidates + list(dict.fromkeys(extra)), heuristic, default)
    total = sum(len(plan[1]) for plan in plans.values())
    table = Table(title=f"fmha tune ({gpu_name(device)}, {args.dtype})", title_justify="left")
    for column in ("key", "case", "best", "TFLOP/s", "default", "TFLOP/s ", "heuristic", "TFLOP/s  ",
                   "best/heuristic", "failed"):
        table.add_column(column, justify="left" if column in ("key", "case") else "right")
    records, report = {}, []
    started = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("left"), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("tuning", total=total)
        for shape, (case, candidates, heuristic, default) in plans.items():
            progress.update(task, description=case.label)
            with torch.cuda.device(device):
                results = measure_candidates(shape.kernel, _params(case, dtype, device), candidates,
                                             on_result=lambda _: progress.advance(task))
            by_config = {r["config"]: r for r in results}
            best = best_of(results)
            failed = [r for r in results if r["status"] != "ok"]
            for result in failed:
                progress.console.print(f"  {shape.text()} {_config_text(result['config'])}: "
                                       f"{result['status']}: {result.get('error', '')}")
            heuristic_tflops = by_config.get(heuristic, {}).get("tflops")
            default_tflops = by_config.get(default, {}).get("tflops") if default else None
            speedup = best["tflops"] / heuristic_tflops if best and heuristic_tflops else None
            table.add_row(shape.text(), case.label, _config_text(best and best["config"]),
                          f"{best['tflops']:.1f}" if best else "—", _config_text(default),
                          f"{default_tflops:.1f}" if default_tflops else "—", _config_text(heuristic),
                          f"{heuristic_tflops:.1f}" if heuristic_tflops else "—",
                          f"{speedup:.2f}×" if speedup else "—", str(len(failed)))
            progress.console.print(
                f"{shape.text()}: best {_config_text(best and best['config'])} "
                f"{best['tflops'] if best else 0:.1f} TFLOP/s, heuristic {_config_text(heuristic)} "
                f"{heuristic_tflops or 0:.1f}, {len(failed)} failed")
            if best is not None:
                records[shape.text()] = winner_record(best)
            report.append({"key": shape.text(), "case": case.to_dict(), "label": case.label,
                           "best": _record(best), "heuristic": _record(by_config.get(heuristic)),
                           "default": _record(by_config.get(default)) if default else None,
                           "speedup_over_heuristic": speedup,
                           "candidates": [_record(r) for r in results]})
            # Saved after every key, so an interrupted sweep keeps what it measured.
            _save(args, device, records, report, time.perf_counter() - started)
    elapsed = time.perf_counter() - started
    console.print(table)
    console.print(f"{len(plans)} keys, {total} candidates in {elapsed:.0f} s")
    _save(args, device, records, report, elapsed)
    lookup.forget()
    dispatch.forget()
    if records:
        console.print(f"stored {len(records)} configs in {store.cache_path()}")
    if args.write_defaults:
        console.print(f"merged {len(records)} configs into the shipped defaults {args.write_defaults}")
    if args.out:
        console.print(f"wrote {Path(args.out) / 'tune.json'}")
    return 0


def _save(args, device, records: dict, report: list, seconds: float) -> None:
    from .bench.runner import environment

    if records:
        store.store(device_key(device), records)
        if args.write_defaults:
            write_defaults(Path(args.write_defaults), gpu_name(device), records)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {"environment": environment(), "dtype": args.dtype, "suites": args.suite,
                   "shapes": [case.shape_text for case in args.shape], "seconds": seconds, "keys": report}
        (out / "tune.json").write_text(json.dumps(payload, indent=1) + "\n")


def _record(result: dict | None) -> dict | None:
    if result is None:
        return None
    config = result["config"]
    return {**{k: v for k, v in result.items() if k != "config"}, "config": config.__dict__,
            "kernel": config.backend}


def write_defaults(path: Path, gpu: str, records: dict[str, dict]) -> None:
    """Merge tuned records into a shipped-defaults file (``src/fmha/tuning/defaults/forward.json``).

    Entries of other keys (other kernels, other lengths) and other GPUs' sections are kept.
    """
    import triton

    from .._version import __version__

    data = json.loads(path.read_text()) if path.exists() else {"format": DEFAULTS_FORMAT, "gpus": {}}
    section = data["gpus"].setdefault(gpu, {"entries": {}})
    section.update(triton=triton.__version__, fmha=__version__, date=datetime.date.today().isoformat())
    section["entries"].update(records)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")

