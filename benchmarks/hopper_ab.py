"""A/B timing of versions of the Gluon Hopper forward's source, on the default path's schedules (GPU, sm_90).

Each version is a copy of ``src/fmha/backends/gluon_sm90/forward.py`` (e.g. from ``git show
REV:src/fmha/backends/gluon_sm90/forward.py``); it is loaded as a module of
``fmha.backends.gluon_sm90``, so its relative imports (``.masking``) resolve to this tree, and
it must keep the kernel's signature. For every seeds/std case each version is compiled with the
schedule the default path picks (``fmha.tuning.lookup.hopper_schedule``; where that is the
portable kernel, the paired persistent schedule with two Q buffers and emulated exponentials),
its output is checked against SDPA flash, and the versions are timed interleaved, several
rounds, with SDPA cuDNN beside them.

    git show HEAD~1:src/fmha/backends/gluon_sm90/forward.py > /tmp/base.py
    PYTHONPATH=src python benchmarks/hopper_ab.py --version base=/tmp/base.py \
        --version new=src/fmha/backends/gluon_sm90/forward.py
"""

import argparse
import contextlib
import functools
import importlib.util
import json
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend

from fmha.backends.gluon_sm90 import launch
from fmha.backends.gluon_sm90.schedule import HopperSchedule
from fmha.params import attention_params
from fmha.testing import time_ms
from fmha.tools.bench import cases, metrics
from fmha.tools.bench.runner import environment, make_inputs
from fmha.tuning import lookup
from hopper_forward import sdpa  # the SDPA peers of the variant benchmark beside this script

FALLBACK = HopperSchedule(persistent=True, q_buffers=2, emulated_exp2=8)


def load_kernel(index: int, path: str):
    """The ``attention_forward_hopper_kernel`` of a copy of the kernel's source file."""
    name = f"{launch.__package__}._ab_version_{index}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.attention_forward_hopper_kernel


@contextlib.contextmanager
def kernel_version(kernel):
    """Inside the block, Hopper forwards are compiled from ``kernel``: ``launch.hopper_forward_source``
    builds the compile source from the launch module's kernel, and ``compiled_hopper_forward`` caches
    its builds per configuration, so the kernel is swapped and the cache emptied on the way in and out."""
    tree_kernel = launch.attention_forward_hopper_kernel
    launch.attention_forward_hopper_kernel = kernel
    launch.compiled_hopper_forward.cache_clear()
    try:
        yield
    finally:
        launch.attention_forward_hopper_kernel = tree_kernel
        launch.compiled_hopper_forward.cache_clear()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="append", required=True,
                        help="name=path of a copy of fmha/backends/gluon_sm90/forward.py")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="hopper_ab.json")
    args = parser.parse_args()
    paths = dict(item.split("=", 1) for item in args.version)
    versions = {name: load_kernel(index, path) for index, (name, path) in enumerate(paths.items())}
    payload = {"environment": environment(), "versions": paths, "rows": []}
    for case in cases.seeds() + cases.std():
        q, k, v = make_inputs(case, torch.bfloat16)
        params = attention_params("hopper_ab", q, k, v, causal=case.causal)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        schedule, source = lookup.hopper_schedule(params)
        schedule = schedule or FALLBACK

        cudnn = sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, case.causal)
        expected = sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, case.causal)().float()

        forwards, errors = {}, {}
        for name, kernel in versions.items():
            with kernel_version(kernel):
                forwards[name] = launch.HopperForward(params, schedule)
            out.fill_(float("nan"))
            forwards[name](q, k, v, out, lse)
            torch.cuda.synchronize()
            errors[name] = ((out.float() - expected).norm() / expected.norm()).item()
        cudnn_ms, _ = time_ms(cudnn)
        timings = {name: [] for name in versions}
        for _ in range(args.rounds):
            for name, forward in forwards.items():
                timings[name].append(time_ms(functools.partial(forward, q, k, v, out, lse))[0])
        row = {"case": case.to_dict(), "label": case.label, "schedule": schedule.to_record(),
               "schedule_source": source, "cudnn_tflops": metrics.tflops(case, cudnn_ms), "versions": {}}
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
