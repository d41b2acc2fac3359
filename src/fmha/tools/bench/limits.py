"""The chip's limits, measured once per GPU and cached: bf16 matmul rate and copy bandwidth."""

from __future__ import annotations

import torch
import triton.testing

from ...cache import cache_dir, read_json, write_json_atomic
from .metrics import ChipLimits

LIMITS_FILE = "chip_limits.json"
MATMUL_SIZE = 8192
COPY_BYTES = 1 << 30


def gpu_key(device=None) -> str:
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}|sm_{props.major}{props.minor}|{props.multi_processor_count}SM|torch {torch.__version__}"


def measure_chip_limits(device=None) -> ChipLimits:
    """A bf16 MATMUL_SIZE³ matmul and a COPY_BYTES device-to-device copy, do_bench medians."""
    with torch.cuda.device(device):
        a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
        matmul_ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=200, return_mode="median")
        del a, b
        source = torch.empty(COPY_BYTES, device="cuda", dtype=torch.uint8).random_()
        target = torch.empty_like(source)
        copy_ms = triton.testing.do_bench(lambda: target.copy_(source), warmup=20, rep=100, return_mode="median")
        del source, target
        torch.cuda.empty_cache()
    return ChipLimits(matmul_tflops=2 * MATMUL_SIZE**3 / (matmul_ms * 1e-3) / 1e12,
                      copy_gbps=2 * COPY_BYTES / (copy_ms * 1e-3) / 1e9)  # read + write


def chip_limits(device=None, remeasure: bool = False) -> tuple[ChipLimits, str]:
    """Cached limits for this GPU (measured on first use). Returns ``(limits, source)``."""
    path = cache_dir() / LIMITS_FILE
    key = gpu_key(device)
    cached = read_json(path)
    entry = cached.get(key)
    if not remeasure and isinstance(entry, dict):
        try:
            return ChipLimits(float(entry["matmul_tflops"]), float(entry["copy_gbps"])), f"cached in {path}"
        except (KeyError, TypeError, ValueError):
            pass
    limits = measure_chip_limits(device)
    cached[key] = {"matmul_tflops": limits.matmul_tflops, "copy_gbps": limits.copy_gbps}
    try:
        write_json_atomic(path, cached)
    except OSError:
        pass  # a read-only home still gets the measured limits
    return limits, "measured"
