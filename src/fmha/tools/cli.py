"""The ``fmha`` command: ``info``, ``bench``, ``report`` and ``tune``.

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


# Options that ``fmha report`` cannot honour without a GPU (it then runs one tiny fixed shape).
INTERPRETER_IGNORES = ("--suite", "--shape", "--mode", "--dtype", "--providers", "--memory-check")


def shape_argument(text: str):
    """argparse ``type`` of ``--shape``: every command parses and validates shapes here."""
    from fmha.tools.bench.cases import parse_shape

    try:
        return parse_shape(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def plain_shape_argument(text: str):
    """argparse ``type`` of ``fmha tune --shape``: tuning keys are plain attention, without features."""
    case = shape_argument(text)
    if case.features:
        raise argparse.ArgumentTypeError(f"{text!r}: fmha tune tunes plain attention; drop {', '.join(case.features)}")
    return case


def _suite_epilog(command: str = "bench") -> list[str]:
    from fmha.tools.bench.cases import PLAIN_SUITES, SHAPE_EXAMPLE, SHAPE_FORM, SHAPE_OPTIONS, SUITES, suite_lines

    names = PLAIN_SUITES if command == "tune" else tuple(SUITES)
    lines = (["suites (--suite):"] + [f"  {line}" for line in suite_lines(names)]
             + [f"--shape {SHAPE_FORM}, e.g. {SHAPE_EXAMPLE}: one case (repeat for more); it replaces the",
                "  default suites unless --suite is given too. Hq must be a multiple of Hkv, D within 1..256."])
    if command != "tune":
        lines.append(f"  Features follow as options: {SHAPE_OPTIONS}.")
    return lines


def _provider_epilog() -> list[str]:
    from fmha.tools.bench.peers import provider_lines

    return ["providers (--providers), fmha's own rows first; `fmha` is the headline:"] + [
        f"  {line}" for line in provider_lines()]


def listing(command: str) -> list[str]:
    """``--list``: every suite with its cases (as --shape takes them), and the providers."""
    from fmha.tools.bench.cases import PLAIN_SUITES, SUITES, suite_lines

    names = PLAIN_SUITES if command == "tune" else tuple(SUITES)
    lines = ["suites (--suite):"]
    for name, line in zip(names, suite_lines(names)):
        lines.append(f"  {line}")
        lines += [f"    {case.label:<32} --shape {case.shape_text}" for case in SUITES[name]()]
    if command != "tune":
        lines += _provider_epilog()
    return lines


def _add_case_options(parser: argparse.ArgumentParser, default_suites: list[str], listed: str,
                      plain: bool = False) -> None:
    from fmha.tools.bench.cases import PLAIN_SUITES, SHAPE_FORM, SUITES

    parser.set_defaults(default_suites=default_suites)
    suites = sorted(PLAIN_SUITES if plain else SUITES)
    parser.add_argument("--suite", nargs="*", default=None, choices=suites, metavar="SUITE",
                        help=f"named sets of cases, listed below (default: {' '.join(default_suites)}; none when "
                             "--shape is given; a bare --suite selects none)")
    parser.add_argument("--shape", action="append", default=None,
                        type=plain_shape_argument if plain else shape_argument, metavar=SHAPE_FORM,
                        help="a custom case (repeat for more); replaces the default suites")
    parser.add_argument("--list", action="store_true", help=f"print {listed}, then exit")


def _add_run_options(parser: argparse.ArgumentParser, default_suites: list[str]) -> None:
    from fmha.tools.bench.cases import MODES
    from fmha.tools.bench.peers import PEERS

    _add_case_options(parser, default_suites, "every suite's cases and the providers")
    parser.add_argument("--mode", nargs="+", default=None, choices=MODES,
                        help="what is timed: fwd (default), bwd (the backward of one saved forward), fwdbwd "
                             "(forward + backward); a provider without a backward says so")
    parser.add_argument("--providers", nargs="+", default=None, choices=list(PEERS), metavar="NAME",
                        help="which rows to time, listed below (default: all)")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp16"], help="input dtype (default: bf16)")
    parser.add_argument("--memory-check", action="store_true",
                        help="also time one fmha.attention call at S = 131072, B = H = 1, D = 128 and report its "
                             "peak extra memory")
    parser.add_argument("--out", default="fmha-results", help="output directory (default: fmha-results)")


def _add_tune_options(parser: argparse.ArgumentParser) -> None:
    _add_case_options(parser, ["seeds", "std"], "every suite's cases", plain=True)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="input dtype (default: bf16)")
    parser.add_argument("--kernel", default="fwd", choices=["fwd", "bwd", "all"],
                        help="tune the forward, the backward or both (each has its own keys; default: fwd)")
    parser.add_argument("--dry-run", action="store_true", help="list the candidates after pruning, time nothing")
    parser.add_argument("--write-defaults", metavar="PATH",
                        help="also merge the winners into a shipped-defaults JSON (for maintainers)")
    parser.add_argument("--out", default=None, help="directory for tune.json with every candidate's timing "
                                                    "(default: none written)")


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="fmha", description="fused multi-head attention in Triton: the "
                                     "engineering ladder, benchmarks against the peers, tuning",
                                     epilog="`fmha COMMAND --help` lists a command's options, suites and providers.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("info", help="versions, GPU and available peers", description="versions, GPU and which "
                        "peers this machine could time")
    bench = commands.add_parser(
        "bench", help="time fmha and the peers (GPU) into bench.json", formatter_class=raw,
        description="Time every provider on every case and write bench.json (needs a CUDA GPU).",
        epilog="\n".join(_suite_epilog() + _provider_epilog()))
    _add_run_options(bench, ["seeds", "std"])
    report = commands.add_parser(
        "report", help="the engineering ladder and the peers as report.md + plots", formatter_class=raw,
        description="The ladder (steps 1-5) and the peers: report.md, PNG plots and results.json. Without a GPU "
                    "fmha's rows run through Triton's interpreter at one tiny fixed shape, and "
                    f"{', '.join(INTERPRETER_IGNORES)} are ignored (a note names those given).",
        epilog="\n".join(_suite_epilog() + _provider_epilog()))
    _add_run_options(report, ["seeds"])
    tune = commands.add_parser(
        "tune", help="search kernel configs per key and store the best (GPU)", formatter_class=raw,
        description="Time the portable kernel's tile configs (and, on sm_90, the Hopper schedules) for each "
                    "tuning key of the cases, and store the winners in the cache (needs a CUDA GPU; "
                    "--dry-run does not).",
        epilog="\n".join(_suite_epilog("tune")))
    _add_tune_options(tune)
    return parser


def parse_args(argv) -> argparse.Namespace:
    """Parse, then fill the defaults that depend on what was given (``--shape`` replaces the default suites)."""
    args = build_parser().parse_args(argv)
    if args.command == "info":
        return args
    if args.command in ("bench", "report"):
        from fmha.tools.bench.peers import PEERS

        args.explicit = [option for option in INTERPRETER_IGNORES
                         if getattr(args, option[2:].replace("-", "_")) not in (None, False)]
        args.mode = args.mode or ["fwd"]
        args.providers = args.providers or list(PEERS)
        args.dtype = args.dtype or "bf16"
    if args.suite is None:
        args.suite = [] if args.shape else list(args.default_suites)
    args.shape = args.shape or []
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        import torch

        from fmha.runtime import INTERPRETED

        if not torch.cuda.is_available() and not INTERPRETED:
            env = {**os.environ, "TRITON_INTERPRET": "1"}
            os.execve(sys.executable, [sys.executable, "-m", "fmha", *argv], env)
    args = parse_args(argv)
    if args.command == "info":
        print("\n".join(info_lines()))
        return 0
    if args.list:
        print("\n".join(listing(args.command)))
        return 0
    if args.command == "tune":
        from fmha.tools.tune import run_tune

        return run_tune(args)
    from fmha.tools.report.command import run_bench, run_report

    return run_bench(args) if args.command == "bench" else run_report(args)


if __name__ == "__main__":
    sys.exit(main())
