"""Where the GPU waits inside a timed call: the trace of a do_bench-style loop (GPU).

Each iteration runs what precedes the call (the 256 MiB L2 flush, a tiny fill, or nothing),
records an event, calls, records an event, as ``triton.testing.do_bench`` does. From the profiler's
trace (CPU and GPU on one clock) it reports, per iteration, the idle time between the preceding
kernel's end and the call's first kernel, the call's kernel time, and when the host issued the
call's launch relative to the preceding kernel's end (negative: the host was ahead).

    PYTHONPATH=src python benchmarks/launch_gaps.py OUT_DIR
"""

import json
import statistics
import sys
from pathlib import Path

import torch

from fmha.tools.bench.cases import Case, features
from fmha.tools.bench.peers import PEERS
from fmha.tools.bench.runner import environment, make_inputs, timed_callable

LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaMemsetAsync")


def traced_loop(fn, before, iterations=20):
    """The chrome trace of ``iterations`` timed calls, each after ``before()``."""
    for _ in range(3):
        before()
        fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(iterations):
            before()
            with torch.profiler.record_function("timed_call"):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
        torch.cuda.synchronize()
    return profile


def gaps(profile, trace_path: Path) -> dict:
    """Per iteration: the GPU idle time before the call, its kernels' time, and the host's lead."""
    profile.export_chrome_trace(str(trace_path))
    events = json.loads(trace_path.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset")), key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("name") in LAUNCH_CALLS}
    calls = sorted((e for e in events if e.get("name") == "timed_call" and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    rows = []
    for call in calls:
        start, stop = call["ts"], call["ts"] + call["dur"]
        # the call's kernels: those whose launch the host issued inside the annotated range
        mine = [k for k in kernels if start <= launches.get(k["args"].get("correlation"), {"ts": -1})["ts"] <= stop]
        if not mine:
            continue
        first = mine[0]
        before = [k for k in kernels if k["ts"] < first["ts"]]
        if not before:
            continue
        previous_end = before[-1]["ts"] + before[-1]["dur"]
        launch = launches[first["args"]["correlation"]]
        rows.append({"idle_before_us": first["ts"] - previous_end,
                     "kernels_us": mine[-1]["ts"] + mine[-1]["dur"] - first["ts"],
                     "kernel_names": [k["name"][:60] for k in mine],
                     "host_launch_minus_previous_end_us": launch["ts"] - previous_end,
                     "host_call_us": call["dur"]})
    if not rows:
        names = sorted({(e.get("cat"), e.get("name", "")[:40]) for e in events if e.get("cat") != "cpu_op"})
        return {"iterations": 0, "categories": names[:80]}
    summary = {key: statistics.median(row[key] for row in rows)
               for key in ("idle_before_us", "kernels_us", "host_launch_minus_previous_end_us", "host_call_us")}
    summary["kernel_names"] = rows[0]["kernel_names"]
    summary["iterations"] = len(rows)
    return summary


def main():
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    tiny = torch.empty(256, dtype=torch.int8, device="cuda")
    befores = {"flush": cache.zero_, "tiny_fill": tiny.zero_, "nothing": lambda: None}
    window = features()[0]
    plain = Case(4, 16, 16, 4096, 4096, 128, causal=True)
    rows = []
    for case, provider in ((window, "fmha"), (plain, "fmha"), (plain, "sdpa_cudnn")):
        q, k, v = make_inputs(case, torch.bfloat16)
        fn = timed_callable(case, PEERS[provider].prepare(case, q, k, v))
        for name, before in befores.items():
            trace = Path("/tmp") / f"{provider}_{len(rows)}_{name}.json"
            row = {"case": case.label, "provider": provider, "before": name,
                   **gaps(traced_loop(fn, before), trace)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out_dir / "launch_gaps.json").write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
