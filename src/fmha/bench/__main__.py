"""``python -m fmha.bench``: time fmha and its peers on the design's suites (GPU only)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .cases import SUITES, parse_shape
from .peers import PEERS
from .runner import environment, format_summary, memory_check, run_case, summarize, write_results

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fmha.bench", description=__doc__)
    parser.add_argument("--suite", nargs="*", default=["seeds", "std"], choices=sorted(SUITES))
    parser.add_argument("--shape", action="append", default=[], help="B,Hq,Hkv,Sq,Sk,D[,causal]")
    parser.add_argument("--providers", nargs="*", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--memory-check", action="store_true", help="also run S=131072, B=H=1, D=128")
    parser.add_argument("--out", type=Path, default=Path("fmha-results/bench.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m fmha.bench needs a CUDA GPU; none is visible.", file=sys.stderr)
        return 2
    env = environment()
    print(f"{env['device']} (sm_{env['capability'].replace('.', '')}, {env['sm_count']} SMs), "
          f"torch {env['torch']}, triton {env['triton']}, fmha {env['fmha']}, {env['date']}")
    cases = [case for suite in args.suite for case in SUITES[suite]()] + [parse_shape(s) for s in args.shape]
    rows = []
    for case in cases:
        rows += run_case(case, args.providers, DTYPES[args.dtype])
    summary = summarize(rows)
    payload = {"environment": env, "dtype": args.dtype, "suites": args.suite, "rows": rows, "summary": summary}
    if args.memory_check:
        payload["memory_check"] = memory_check()
        print("memory check:", payload["memory_check"])
    write_results(args.out, payload)
    print()
    print(format_summary(summary, args.providers))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
