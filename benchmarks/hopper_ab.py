"""A/B timing of versions of the Gluon Hopper forward's source, on the default path's options (GPU).

Each version is a copy of ``fmha/kernels/forward_hopper.py`` (e.g. from ``git show REV:...``). For
every seeds/std case the versions run interleaved, several rounds, with the options
``fmha.ops.hopper_forward_plan`` picks (D=64 causal below 4k queries, where the plan takes the
portable kernel, with the paired persistent options); SDPA cuDNN is timed beside them. Each
version's output is checked against SDPA flash first.

    PYTHONPATH=src python benchmarks/hopper_ab.py --version base=/tmp/base.py --version new=src/fmha/kernels/forward_hopper.py
"""

import argparse
import importlib.util
import json
import statistics

import torch
from torch.nn.attention import SDPBackend

from fmha import launch, ops
from fmha.tools.bench import cases, metrics
from fmha.tools.bench.runner import environment, make_inputs, time_ms
from fmha.launch import default_scale, launch_forward_hopper
from hopper_forward import sdpa  # the SDPA peers of the variant benchmark beside this script

SHORT_CAUSAL_D64 = {"persistent": True, "q_buffers": 2, "emulated_exp2": 8}


def load_kernel(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"hopper_version_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.attention_forward_hopper_kernel


def use_kernel(kernel) -> None:
    launch.attention_forward_hopper_kernel = kernel
    launch._compiled_hopper_forward.cache_clear()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", action="append", required=True, help="name=path of a forward_hopper.py")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="hopper_ab.json")
    args = parser.parse_args()
    versions = {name: load_kernel(name, path) for name, path in (item.split("=", 1) for item in args.version)}
    payload = {"environment": environment(), "versions": dict(item.split("=", 1) for item in args.version), "rows": []}
    for case in cases.seeds() + cases.std():
        q, k, v = make_inputs(case, torch.bfloat16)
        offset = case.seqlen_k - case.seqlen_q if case.causal else None
        scale = default_scale(case.head_dim)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        options = ops.hopper_forward_plan(q, k, v, out, scale=scale, causal=case.causal) or SHORT_CAUSAL_D64

        cudnn = sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, case.causal)
        expected = sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, case.causal)().float()

        def run():
            launch_forward_hopper(q, k, v, out, lse, causal_offset=offset, scale=scale, **dict(options))

        timings = {name: [] for name in versions}
        errors = {}
        for name, kernel in versions.items():
            use_kernel(kernel)
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            errors[name] = ((out.float() - expected).norm() / expected.norm()).item()
        cudnn_ms, _ = time_ms(cudnn)
        for _ in range(args.rounds):
            for name, kernel in versions.items():
                use_kernel(kernel)
                timings[name].append(time_ms(run)[0])
        row = {"case": case.to_dict(), "label": case.label, "options": dict(options),
               "cudnn_tflops": metrics.tflops(case, cudnn_ms), "versions": {}}
        base = None
        line = f"{case.label:<32} cuDNN {row['cudnn_tflops']:5.0f}"
        for name in versions:
            ms = statistics.median(timings[name])
            tflops = metrics.tflops(case, ms)
            base = tflops if base is None else base
            row["versions"][name] = {"ms": timings[name], "tflops": tflops, "rel_error_vs_flash": errors[name]}
            flag = "" if errors[name] < 1e-2 else f" WRONG ({errors[name]:.1e})"
            line += f" | {name} {tflops:5.0f} ({tflops / base:4.2f}x, {tflops / row['cudnn_tflops']:4.2f}x cuDNN){flag}"
        print(line, flush=True)
        payload["rows"].append(row)
        with open(args.out, "w") as handle:
            json.dump(payload, handle, indent=1)


if __name__ == "__main__":
    main()
