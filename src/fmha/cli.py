"""The ``fmha`` command. ``fmha info`` for now; bench, tune and report come with their issues."""

from __future__ import annotations

import argparse
import importlib.util
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
    from fmha.launch import INTERPRETED

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fmha", description="fused multi-head attention in Triton")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, GPU and available peers")
    args = parser.parse_args(argv)
    if args.command == "info":
        print("\n".join(info_lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
