"""Where a forward+backward's wall-clock time goes (GPU): kernels, host enqueue, synchronisations.

    PYTHONPATH=src python benchmarks/fwdbwd_host.py out.json

For each case, timed the way ``fmha bench --mode fwdbwd`` times it (``torch.autograd.grad`` of a
fresh forward, :func:`fmha.testing.time_ms`): the wall clock; the summed GPU time of every kernel
by the profiler; the host's time to enqueue one call (10 calls without a synchronisation); the
CUDA runtime calls that block the host or touch the allocator (profiler CPU trace); and the
kernels themselves. Wall clock ≈ kernels + host means the call synchronises; ≈ kernels means the
GPU paces it.
"""

import argparse
import json
import time

import torch

from fmha.testing import time_ms
from fmha.tools.bench.cases import Case, features
from fmha.tools.bench.peers import PEERS
from fmha.tools.bench.runner import make_inputs, timed_callable
from hopper_schedule_ab import write_result  # benchmarks/ is the script's directory

BLOCKING = ("Synchronize", "Memcpy", "Malloc", "Free", "EventQuery")


def profile(fn, repeats=10):
    """(GPU µs per call by kernel, runtime calls per call that block or allocate)."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as trace:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    kernels, runtime = {}, {}
    for event in trace.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time / repeats
        elif any(word in event.name for word in BLOCKING):
            runtime[event.name] = runtime.get(event.name, 0) + 1 / repeats
    runtime.pop("cudaDeviceSynchronize", None)  # the profile's own, once per window
    return kernels, runtime


def host_us(fn, calls=10):
    """Host microseconds to enqueue one call, with the GPU idle at the start."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    enqueued = time.perf_counter() - start
    torch.cuda.synchronize()
    return enqueued / calls * 1e6, (time.perf_counter() - start) / calls * 1e6


def cases():
    chosen = [case for case in features(("fwdbwd",)) if case.label]
    chosen += [Case(4, 16, 16, 4096, 4096, 64, causal=True, mode="fwdbwd"),
               Case(4, 16, 16, 4096, 4096, 128, causal=True, mode="fwdbwd"),
               Case(4, 32, 32, 4096, 4096, 64, causal=True, mode="fwdbwd")]
    return chosen


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--only", default="", help="comma-separated substrings of case labels")
    args = parser.parse_args()
    wanted = [word for word in args.only.split(",") if word]
    rows = []
    for case in cases():
        if wanted and not any(word in case.label for word in wanted):
            continue
        q, k, v = make_inputs(case, torch.bfloat16)
        fn = timed_callable(case, PEERS["fmha"].prepare(case, q, k, v))
        wall_ms, method = time_ms(fn)
        kernels, runtime = profile(fn)
        enqueue, enqueue_and_run = host_us(fn)
        row = {"case": case.label, "wall_us": wall_ms * 1e3, "method": method,
               "kernels_us": sum(kernels.values()), "host_enqueue_us": enqueue,
               "enqueue_and_run_us": enqueue_and_run, "runtime_calls": runtime,
               "kernels": {name[:90]: round(us, 1) for name, us in kernels.items()}}
        rows.append(row)
        print(f"{case.label:<44} wall {row['wall_us']:8.1f}  kernels {row['kernels_us']:8.1f}  "
              f"host {enqueue:7.1f}  10 calls/10 {enqueue_and_run:8.1f}  runtime {runtime}", flush=True)
        for name, us in sorted(kernels.items(), key=lambda item: -item[1]):
            print(f"      {us:8.1f}  {name[:100]}")
        del fn, q, k, v
        torch.cuda.empty_cache()
    write_result(args.out, rows)


if __name__ == "__main__":
    main()
