"""Schedule variants of the Gluon Hopper forward on the score-feature cases, interleaved (GPU, sm_90).

For each case the default path's schedule (``fmha.tuning.lookup.hopper_schedule``) runs beside
copies of it with fields replaced (``--variant pack_p=1``, ``--variant emulated_exp2=2,pack_p=1``).
Every variant's output is checked against the default's first (bitwise equality is not expected: a
variant may round differently), then all are timed round-robin, ``--rounds`` times; the kernel's
own time comes from the profiler, which moves less between runs than the wall clock. TFLOP/s count
the pairs each row sees. The packed cases (the `features` suite's nine sequences) go through
``fmha.varlen_attention``, which takes no config: the schedule lookup is replaced for their calls.

    PYTHONPATH=src python benchmarks/hopper_schedule_ab.py out.json --variant pack_p=1
"""

import argparse
import dataclasses
import json
import statistics

import torch
import triton

import fmha
from fmha import dispatch
from fmha.masking import Window
from fmha.params import attention_params, varlen_params
from fmha.tools.bench.cases import EQUAL_SEQUENCES, NINE_SEQUENCES, one_long_many_short
from fmha.tools.bench.metrics import visible_pairs
from fmha.tuning import lookup

# (name, B, H, S, D, causal, keyword arguments): bf16.
CASES = [("plain D128 causal", 4, 16, 4096, 128, True, {}),
         ("softcap 30", 4, 16, 4096, 128, True, {"softcap": 30.0}),
         ("ALiBi", 4, 16, 4096, 128, True, {"alibi": True}),
         ("ALiBi D64", 4, 32, 4096, 64, True, {"alibi": True}),
         ("ALiBi non-causal", 4, 16, 4096, 128, False, {"alibi": True}),
         ("dropout 0.1", 4, 16, 4096, 128, True, {"dropout_p": 0.1}),
         ("plain D128", 4, 16, 4096, 128, False, {}),
         ("plain D64 causal", 4, 32, 4096, 64, True, {}),
         ("plain D64", 4, 32, 4096, 64, False, {}),
         ("softcap 30 D64", 4, 32, 4096, 64, True, {"softcap": 30.0}),
         ("window 1024", 1, 16, 16384, 128, True, {"window": (1023, 0)}),
         ("window 4096", 1, 16, 16384, 128, True, {"window": (4095, 0)}),
         ("window 1024 S4k", 4, 16, 4096, 128, True, {"window": (1023, 0)}),
         ("plain D128 causal S16k", 1, 16, 16384, 128, True, {}),
         ("plain D128 S16k", 1, 16, 16384, 128, False, {}),
         ("plain D128 S1k", 16, 16, 1024, 128, False, {}),
         ("plain D64 causal S16k", 1, 32, 16384, 64, True, {}),
         ("plain D64 S16k", 1, 32, 16384, 64, False, {}),
         ("plain D64 S1k", 16, 32, 1024, 64, False, {}),
         ("plain D64 causal S1k", 16, 32, 1024, 64, True, {}),
         ("seed003 D64", 16, 16, 2048, 64, False, {}),
         ("sinks D64", 4, 16, 4096, 64, True, {"sinks": True}),
         ("dropout 0.1 D64", 4, 32, 4096, 64, True, {"dropout_p": 0.1}),
         ("dropout 0.1 D64 non-causal", 4, 32, 4096, 64, False, {"dropout_p": 0.1}),
         ("ALiBi D64 S16k", 1, 32, 16384, 64, True, {"alibi": True}),
         ("window 1024 D64", 1, 32, 16384, 64, True, {"window": (1023, 0)}),
         ("plain D128 causal S1k", 16, 16, 1024, 128, True, {}),
         ("softcap 30 S1k", 16, 16, 1024, 128, True, {"softcap": 30.0}),
         ("softcap 30 non-causal", 4, 16, 4096, 128, False, {"softcap": 30.0}),
         ("softcap 30 D64 non-causal", 4, 32, 4096, 64, False, {"softcap": 30.0}),
         ("softcap 50 sinks", 4, 16, 4096, 128, True, {"softcap": 50.0, "sinks": True}),
         # packed sequences (batch None): the nine of the `features` suite unless "lengths" says otherwise
         ("varlen 9", None, 16, None, 128, True, {}),
         ("varlen 9 D64", None, 32, None, 64, True, {}),
         ("varlen 8x2048", None, 16, None, 128, True, {"lengths": EQUAL_SEQUENCES}),
         ("varlen 16x1024", None, 16, None, 128, True, {"lengths": (1024,) * 16}),
         ("varlen one long", None, 16, None, 128, True, {"lengths": one_long_many_short()}),
         ("varlen 8x2048 D64", None, 32, None, 64, True, {"lengths": EQUAL_SEQUENCES}),
         ("varlen one long D64", None, 32, None, 64, True, {"lengths": one_long_many_short()}),
         ("varlen 9 D64 non-causal", None, 32, None, 64, False, {}),
         ("varlen 9 non-causal", None, 16, None, 128, False, {}),
         ("plain D128 causal S2k", 8, 16, 2048, 128, True, {}),
         ("plain D64 causal S2k", 8, 32, 2048, 64, True, {}),
         ("plain D64 causal S8k", 2, 32, 8192, 64, True, {}),
         ("plain D128 causal S8k", 2, 16, 8192, 128, True, {}),
         ("plain D64 S8k", 2, 32, 8192, 64, False, {}),
         # head dims 136-192 on the 256-wide tiles
         ("plain D192", 4, 16, 4096, 192, False, {}),
         ("plain D192 causal", 4, 16, 4096, 192, True, {}),
         ("plain D160", 4, 16, 4096, 160, False, {}),
         ("plain D160 causal", 4, 16, 4096, 160, True, {}),
         ("plain D192 S16k", 1, 16, 16384, 192, False, {}),
         ("plain D192 causal S1k", 16, 16, 1024, 192, True, {}),
         ("softcap 30 D192", 4, 16, 4096, 192, True, {"softcap": 30.0}),
         ("ALiBi D192", 4, 16, 4096, 192, True, {"alibi": True}),
         ("ALiBi D160", 4, 16, 4096, 160, True, {"alibi": True}),
         ("ALiBi D256", 4, 8, 4096, 256, True, {"alibi": True}),
         ("ALiBi D256 S1k", 16, 8, 1024, 256, True, {"alibi": True}),
         ("dropout 0.1 D192", 4, 16, 4096, 192, True, {"dropout_p": 0.1}),
         ("window 1024 D192", 1, 16, 16384, 192, True, {"window": (1023, 0)}),
         ("varlen 9 D192", None, 16, None, 192, True, {}),
         # the 256-wide tiles at D = 256 (the `wide` suite's shapes)
         ("plain D256 S1k", 16, 8, 1024, 256, False, {}),
         ("plain D256 causal S1k", 16, 8, 1024, 256, True, {}),
         ("plain D256", 4, 8, 4096, 256, False, {}),
         ("plain D256 S16k", 1, 8, 16384, 256, False, {})]


def feature_arguments(heads, kwargs):
    out = dict(kwargs)
    out.pop("lengths", None)
    if out.pop("alibi", False):
        out["alibi_slopes"] = torch.exp2(-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)
    if out.pop("sinks", False):
        out["sinks"] = torch.randn(heads, device="cuda")
    return out


def kernel_times(fn, repeats=20) -> dict:
    """Device microseconds per call of each kernel that ``fn`` launches, by the profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] = times.get(event.name, 0.0) + event.device_time / repeats
    return times


def tree_row(tree: str, case: str, forward, inputs) -> dict:
    """One tree's kernel times for a case (``benchmarks/*_tree_ab.py``): the forward's kernel and every
    kernel of the backward of one saved forward, by the profiler (median of 3), with checksums of
    the output and of dK that show whether two trees compute the same."""
    out = forward()
    grad_out = torch.randn_like(out)

    def backward():
        return torch.autograd.grad(out, inputs, grad_out, retain_graph=True)

    grads = backward()
    with torch.no_grad():
        return {"tree": tree, "case": case,
                "out_checksum": float(out.double().abs().sum()),
                "dk_checksum": float(grads[1].double().abs().sum()),
                "forward_us": statistics.median(max(kernel_times(forward).values()) for _ in range(3)),
                "backward_us": statistics.median(sum(kernel_times(backward).values()) for _ in range(3))}


def kernel_us(fn, repeats=20) -> float:
    """Mean device microseconds per call of the attention kernel (the longest one)."""
    return max(kernel_times(fn, repeats).values())


def write_result(path, rows):
    """The rows with the device and the versions, as JSON."""
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "rows": rows}
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)


def parse_variant(text: str) -> dict:
    fields = {}
    for item in text.split(","):
        name, value = item.split("=")
        fields[name] = int(value)
    return fields


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--variant", action="append", default=[], type=parse_variant)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    chosen = [case for case in CASES if not args.cases or case[0] in args.cases.split(",")]
    rows = []
    shipped_lookup = lookup.hopper_schedule
    for name, batch, heads, seqlen, head_dim, causal, kwargs in chosen:
        torch.manual_seed(0)
        features = feature_arguments(heads, kwargs)
        packed = kwargs.get("lengths", NINE_SEQUENCES)
        if batch is None:  # packed: varlen_attention takes no config, so the lookup is replaced per call
            total = sum(packed)
            q, k, v = (torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            cu_seqlens = torch.tensor([0, *torch.tensor(packed).cumsum(0).tolist()], dtype=torch.int32,
                                      device="cuda")
            params = varlen_params("varlen_attention", q, k, v, cu_seqlens, cu_seqlens, max(packed),
                                   max(packed), causal=causal, **features)
        else:
            q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            params = attention_params("attention", q, k, v, causal=causal, **features)  # the default path's schedule
        default, _ = shipped_lookup(params)
        default = default or fmha.HopperSchedule()
        schedules = {"default": default}
        for fields in args.variant:
            value = {key: (bool(v) if isinstance(getattr(default, key), bool) else v) for key, v in fields.items()}
            try:
                schedules[",".join(f"{key}={v}" for key, v in fields.items())] = dataclasses.replace(default, **value)
            except ValueError as error:  # a field this case's schedule cannot take
                print(json.dumps({"case": name, "skipped": str(error)}), flush=True)
        lengths = packed if seqlen is None else [seqlen] * batch
        left = kwargs["window"][0] if "window" in kwargs else None
        windows = [Window.of(n, n, left=left, right=0) if causal else None for n in lengths]
        flops = 4 * head_dim * heads * sum(visible_pairs(n, n, window) for n, window in zip(lengths, windows))
        calls = {}
        reference = None
        for label, schedule in schedules.items():
            def call(schedule=schedule):
                generator = torch.Generator(device="cuda").manual_seed(1) if "dropout_p" in features else None
                extra = {"generator": generator} if generator is not None else {}
                if seqlen is None:
                    lookup.hopper_schedule = lambda params: (schedule, "variant")
                    dispatch.forget()
                    try:
                        return fmha.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max(lengths), max(lengths),
                                                     causal=causal, **features, **extra)
                    finally:
                        lookup.hopper_schedule = shipped_lookup
                return fmha.attention(q, k, v, causal=causal, config=schedule, **features, **extra)

            try:
                out = call()
            except ValueError as error:  # the backend refuses this schedule for the case (shared memory, registers)
                print(json.dumps({"case": name, "schedule": label, "skipped": str(error)}), flush=True)
                continue
            if reference is None:
                reference = out.float()
            error = (out.float() - reference).abs().max().item()
            calls[label] = call
            print(json.dumps({"case": name, "schedule": label, "text": schedule.text(), "max_diff_vs_default": error}),
                  flush=True)
        times = {label: [] for label in calls}
        for round_index in range(args.rounds):
            # every other round in reverse: a schedule's place in the round must not favour it
            for label, call in list(calls.items())[::-1 if round_index % 2 else 1]:
                times[label].append(kernel_us(call))
        for label, samples in times.items():
            us = statistics.median(samples)
            row = {"case": name, "schedule": label, "kernel_us": us, "tflops": flops / us / 1e6,
                   "samples_us": samples, "vs_default": statistics.median(times["default"]) / us}
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_result(args.out, rows)


if __name__ == "__main__":
    main()
