"""Time the portable forward kernel's switches and tiles side by side with SDPA flash and cuDNN (GPU).

Each variant is a ``KernelFeatures`` (folded scale, tensor descriptors, Triton's warp
specialisation) with a ``ForwardConfig`` (the heuristic's, or a listed one), launched through
``PortableForward``. It is checked against SDPA flash's output before it is timed. Writes JSON
rows and prints one table per seeds/std case.

    PYTHONPATH=src python benchmarks/forward_levers.py --out levers.json [--only tma ...] [--head-dims 64]
"""

import argparse
import dataclasses
import json
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention
from triton.tools.disasm import get_sass

from fmha.backends.triton.config import ForwardConfig, KernelFeatures, heuristic_forward_config
from fmha.backends.triton.launch import PortableForward
from fmha.params import attention_params
from fmha.testing import time_ms
from fmha.tools.bench import cases, metrics
from fmha.tools.bench.runner import environment, make_inputs

PLAIN = KernelFeatures(fused_scale=False)
FUSED = KernelFeatures()
TMA = KernelFeatures(tma=True)
TMA_WS = KernelFeatures(tma=True, warp_specialize=True)


def _tiles(config):
    return f"{config.block_m}x{config.block_n}w{config.num_warps}s{config.num_stages}"


def variants(head_dim):
    """(name, features, config or None for the heuristic's)."""
    yield "plain", PLAIN, None
    yield "fused_scale", FUSED, None
    yield "tma", TMA, None
    yield "tma+ws", TMA_WS, None
    if head_dim > 128:
        return
    for config in [ForwardConfig(128, 128, 8, 3), ForwardConfig(64, 64, 4, 3), ForwardConfig(64, 128, 4, 3)]:
        yield f"fused_scale {_tiles(config)}", FUSED, config
        yield f"tma {_tiles(config)}", TMA, config
    for config in [ForwardConfig(128, 64, 4, 2), ForwardConfig(128, 64, 4, 3), ForwardConfig(128, 128, 4, 2),
                   ForwardConfig(128, 128, 8, 3), ForwardConfig(64, 64, 4, 3),
                   ForwardConfig(64, 128, 4, 3)]:
        yield f"tma+ws {_tiles(config)}", TMA_WS, config


def sdpa(backend, q, k, v, causal):
    def run():
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="levers.json")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to keep")
    parser.add_argument("--head-dims", type=int, nargs="*", default=None)
    args = parser.parse_args()
    payload = {"environment": environment(), "rows": []}
    for case in cases.seeds() + cases.std():
        if args.head_dims and case.head_dim not in args.head_dims:
            continue
        q, k, v = make_inputs(case, torch.bfloat16)
        params = attention_params("forward_levers", q, k, v, causal=case.causal)
        peers = {"sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, case.causal),
                 "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, case.causal)}
        expected = peers["sdpa_flash"]().float()
        rows = []
        for name, run in peers.items():
            ms, method = time_ms(run)
            rows.append({"variant": name, "ms": ms, "method": method, "tflops": metrics.tflops(case, ms)})
        for name, features, config in variants(case.head_dim):
            if args.only and name not in args.only:
                continue
            config = config or heuristic_forward_config(case.head_dim, q.dtype, case.seqlen_q)
            out = torch.full_like(q, float("nan"))
            lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
            forward = PortableForward(params, config, features)

            def run():
                return forward(q, k, v, out, lse)
            row = {"variant": name, "features": dataclasses.asdict(features), "config": dataclasses.asdict(config)}
            try:
                started = time.perf_counter()
                compiled = run()
                torch.cuda.synchronize()
                row["compile_s"] = time.perf_counter() - started
                error = ((out.float() - expected).norm() / expected.norm()).item()
                row["error_vs_flash"] = error
                row["registers"], row["spills"] = compiled.n_regs, compiled.n_spills
                if case.seqlen_q == 4096:  # the instruction mix, at the S=4k shapes
                    sass = get_sass(compiled.asm["cubin"])
                    row["sass"] = {op: sass.count(op) for op in ("HGMMA", "HMMA", "UTMALDG", "LDGSTS", "LDL", "STL", "MUFU.EX2")}
                if not error < 1e-2:
                    raise AssertionError(f"relative error {error:.2e} against SDPA flash")
                row["ms"], row["method"] = time_ms(run)
                row["tflops"] = metrics.tflops(case, row["ms"])
            except Exception as exc:  # compile failures and wrong results are recorded, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
        cudnn = rows[1]["tflops"]
        print(f"\n{case.label}  (flash {rows[0]['tflops']:.0f}, cuDNN {cudnn:.0f} TFLOP/s)", flush=True)
        for row in rows[2:]:
            if "tflops" in row:
                print(f"  {row['variant']:<34} {row['tflops']:6.0f}  {row['tflops'] / cudnn:5.2f}x cuDNN"
                      f"  regs {row['registers']} spills {row['spills']}", flush=True)
            else:
                print(f"  {row['variant']:<34} {row.get('error')}", flush=True)
        payload["rows"] += [{"case": case.to_dict(), "label": case.label, **row} for row in rows]
        del q, k, v
    with open(args.out, "w") as handle:
        json.dump(payload, handle, indent=1)


if __name__ == "__main__":
    main()
