"""The ``fmha`` command: ``info``, ``bench`` and ``report``.

``fmha report`` on a machine without CUDA runs the kernels through Triton's interpreter,
which must be chosen before triton is imported: the command re-executes itself with
TRITON_INTERPRET=1 when it was started without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

NO_CUDA_MESSAGE = "no CUDA device: kernels run under the Triton interpreter when TRITON_INTERPRET=1"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def peer_availability() -> dict[str, str]:
    """Which peers this machine could time, and why not when it cannot."""
    import torch

    cuda = torch.cuda.is_available()
    status = {}
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
        try:
            from torch.nn.attention import SDPBackend

            getattr(SDPBackend, name)
            status[f"sdpa {name.lower()}"] = "available" if cuda or name == "MATH" else "needs CUDA"
        except (ImportError, AttributeError):
            status[f"sdpa {name.lower()}"] = f"not in torch {torch.__version__}"
    flex = _importable("torch.nn.attention.flex_attention")
    status["flex_attention"] = ("available" if cuda else "needs CUDA") if flex else "not importable"
    for label, module in (("flash_attn (FA2)", "flash_attn"), ("flash_attn_interface (FA3)", "flash_attn_interface"),
                          ("flash_attn.cute (FA4)", "flash_attn.cute")):
        status[label] = "importable" if _importable(module) else "not installed"
    return status


def info_lines() -> list[str]:
    import torch
    import triton

    import fmha
    from fmha.runtime import INTERPRETED

    lines = [f"fmha {fmha.__version__}", f"torch {torch.__version__} (CUDA {torch.version.cuda})",
             f"triton {triton.__version__}" + (" (interpreter: TRITON_INTERPRET=1)" if INTERPRETED else "")]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            lines.append(f"GPU {index}: {props.name}, compute capability {props.major}.{props.minor}, "
                         f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.1f} GiB")
    else:
        lines.append(NO_CUDA_MESSAGE)
    lines.append("peers:")
    lines += [f"  {name:<28} {state}" for name, state in peer_availability().items()]
    return lines


def _add_run_options(parser: argparse.ArgumentParser, default_suites: list[str]) -> None:
    from fmha.tools.bench.cases import MODES, SUITES
    from fmha.tools.bench.peers import PEERS

    parser.add_argument("--suite", nargs="*", default=default_suites, choices=sorted(SUITES),
                        help=f"benchmark suites (default: {' '.join(default_suites)})")
    parser.add_argument("--shape", action="append", default=[], metavar="B,Hq,Hkv,Sq,Sk,D[,causal]",
                        help="a custom case; repeat for more")
    parser.add_argument("--mode", nargs="+", default=["fwd"], choices=MODES,
                        help="fwd, and fwdbwd (forward + backward) where the provider has a backward")
    parser.add_argument("--providers", nargs="+", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--memory-check", action="store_true", help="also run S = 131072, B = H = 1, D = 128")
    parser.add_argument("--out", default="fmha-results", help="output directory (default: fmha-results)")


def _add_tune_options(parser: argparse.ArgumentParser) -> None:
    from fmha.tools.bench.cases import SUITES

    parser.add_argument("--suite", nargs="*", default=["seeds", "std"], choices=sorted(SUITES))
    parser.add_argument("--shape", action="append", default=[], metavar="B,Hq,Hkv,Sq,Sk,D[,causal]")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--kernel", default="fwd", choices=["fwd", "bwd", "all"],
                        help="tune the forward, the backward or both (each has its own keys; default: fwd)")
    parser.add_argument("--dry-run", action="store_true", help="list the candidates after pruning, time nothing")
    parser.add_argument("--write-defaults", metavar="PATH",
                        help="also merge the winners into a shipped-defaults JSON (for maintainers)")
    parser.add_argument("--out", default=None, help="directory for tune.json with every candidate's timing")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        import torch

        from fmha.runtime import INTERPRETED

        if not torch.cuda.is_available() and not INTERPRETED:
            env = {**os.environ, "TRITON_INTERPRET": "1"}
            os.execve(sys.executable, [sys.executable, "-m", "fmha", *argv], env)
    parser = argparse.ArgumentParser(prog="fmha", description="fused multi-head attention in Triton")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, GPU and available peers")
    _add_run_options(commands.add_parser("bench", help="time fmha and the peers (GPU)"), ["seeds", "std"])
    _add_run_options(commands.add_parser("report", help="the engineering ladder as report.md + plots"), ["seeds"])
    tune = commands.add_parser("tune", help="search tile configs per key and store the best (GPU)")
    _add_tune_options(tune)
    args = parser.parse_args(argv)
    if args.command == "tune":
        from fmha.tools.tune import run_tune

        return run_tune(args)
    if args.command == "info":
        print("\n".join(info_lines()))
        return 0
    from fmha.tools.report.command import run_bench, run_report

    return run_bench(args) if args.command == "bench" else run_report(args)


if __name__ == "__main__":
    sys.exit(main())
