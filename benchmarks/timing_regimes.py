"""One call timed four ways, to split the `features` suite's numbers from the profiler's (GPU).

The suite times with ``fmha.testing.time_ms`` (``do_bench``: L2 flushed before every call, CUDA
events around it); the schedule A/B scripts take the profiler's kernel time over back-to-back
calls. This script runs both on the same prepared call, and in between:

* ``events_back_to_back``: CUDA events around each call, no flush;
* ``kernels_flushed`` / ``kernels_back_to_back``: every kernel a call launches, by the profiler,
  with and without the flush before each call (the flush's own kernel is left out);
* a bf16 matmul of about the same length, timed the same ways, as the control: what it loses
  between regimes is the regime's, not the attention kernel's.

    PYTHONPATH=src python benchmarks/timing_regimes.py out.json [--training]

``--training`` times forward+backward on the `std` shapes at S = 4k and 16k instead (every kernel of the step).
"""

import json
import statistics
import sys

import torch
import triton

from fmha.testing import time_ms
from fmha.tools.bench import metrics
from fmha.tools.bench.cases import Case, features
from fmha.tools.bench.peers import PEERS, PeerUnavailable
from fmha.tools.bench.runner import environment, make_inputs, timed_callable

FLUSH_BYTES = 256 << 20  # what do_bench zeroes before each call


def events_back_to_back(fn, calls=100) -> float:
    """Median milliseconds of one call among ``calls`` issued back to back, no flush."""
    for _ in range(10):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends))


def kernel_times(fn, flush: bool, repeats=20) -> dict:
    """Device microseconds per call of each kernel ``fn`` launches, with or without the L2 flush."""
    cache = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(repeats):
            if flush:
                cache.zero_()
            fn()
        torch.cuda.synchronize()
    flush_events = repeats if flush else 0
    times, counts = {}, {}
    for event in sorted(profile.events(), key=lambda event: -event.device_time):
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if flush_events and "fill" in event.name.lower() and event.device_time > 20:
            flush_events -= 1  # the flush: the longest fills, one per call
            continue
        times[event.name] = times.get(event.name, 0.0) + event.device_time / repeats
        counts[event.name] = counts.get(event.name, 0) + 1
    return {name: {"us": round(times[name], 2), "per_call": counts[name] / repeats} for name in times}


def regimes(fn) -> dict:
    suite_ms, method = time_ms(fn)
    flushed = kernel_times(fn, flush=True)
    back_to_back = kernel_times(fn, flush=False)
    return {"suite_us": suite_ms * 1e3, "suite_method": method,
            "events_back_to_back_us": events_back_to_back(fn) * 1e3,
            "graph_us": triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3,
            "kernels_flushed": flushed, "kernels_back_to_back": back_to_back,
            "kernel_sum_flushed_us": sum(row["us"] for row in flushed.values()),
            "kernel_sum_back_to_back_us": sum(row["us"] for row in back_to_back.values())}


def main():
    out_path = sys.argv[1]
    if "--training" in sys.argv[2:]:
        cases = [Case(batch, 2048 // head_dim, 2048 // head_dim, seqlen, seqlen, head_dim, causal=causal, mode="fwdbwd")
                 for batch, seqlen in ((4, 4096), (1, 16384)) for head_dim in (64, 128) for causal in (False, True)]
    else:
        cases = [case for case in features() if not case.scores_modified]
        cases += [Case(4, 32, 32, 4096, 4096, 64, causal=False), Case(4, 16, 16, 4096, 4096, 128, causal=True)]
    rows = []
    for case in cases:
        q, k, v = make_inputs(case, torch.bfloat16)
        for provider in ("fmha", "sdpa_cudnn"):
            try:
                prepared = PEERS[provider].prepare(case, q, k, v)
            except PeerUnavailable as reason:
                print(json.dumps({"case": case.label, "provider": provider, "skipped": str(reason)}), flush=True)
                continue
            fn = timed_callable(case, prepared)
            try:
                row = {"case": case.label, "provider": provider, **regimes(fn)}
            except Exception as error:
                print(json.dumps({"case": case.label, "provider": provider, "failed": str(error)[:300]}), flush=True)
                continue
            row["suite_tflops"] = metrics.tflops(case, row["suite_us"] / 1e3)
            row["back_to_back_tflops"] = metrics.tflops(case, row["events_back_to_back_us"] / 1e3)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    # the control: a matmul of about the attention calls' length
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    b = b[:, :2048].contiguous()
    row = {"case": "matmul 8192x8192x2048", "provider": "torch", **regimes(lambda: a @ b)}
    row["suite_tflops"] = 2 * 8192 * 8192 * 2048 / row["suite_us"] / 1e6
    row["back_to_back_tflops"] = 2 * 8192 * 8192 * 2048 / row["events_back_to_back_us"] / 1e6
    rows.append(row)
    print(json.dumps(row), flush=True)
    with open(out_path, "w") as handle:
        json.dump({"environment": environment(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
