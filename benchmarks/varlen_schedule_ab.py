"""Hopper schedules on the packed-sequence (varlen) cases of the `features` suite, interleaved (GPU, sm_90).

    PYTHONPATH=src python benchmarks/varlen_schedule_ab.py out.json

``fmha.varlen_attention`` takes no config, so each variant replaces the shipped schedule lookup
for its calls. Every variant's output must equal the default's bit for bit (same per-tile
arithmetic; only the order of tiles changes); kernel time by the profiler, median of 3 rounds.
"""

import statistics
import sys

import torch

import fmha
from fmha import HopperSchedule, dispatch
from fmha.tools.bench.cases import EQUAL_SEQUENCES, NINE_SEQUENCES, one_long_many_short
from fmha.tuning import lookup
from hopper_schedule_ab import kernel_us, write_result  # benchmarks/ is the script's directory

VARIANTS = {"default": None,
            "dynamic, two Q buffers": HopperSchedule(persistent=True, q_buffers=2, dynamic=True),
            "dynamic": HopperSchedule(persistent=True, dynamic=True),
            "persistent, fixed shares, two Q buffers": HopperSchedule(persistent=True, q_buffers=2)}


def main():
    shipped = lookup.hopper_schedule
    rows = []
    for lengths in (NINE_SEQUENCES, EQUAL_SEQUENCES, one_long_many_short()):
        total = sum(lengths)
        q, k, v = (torch.randn(total, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        longest = max(lengths)
        times = {name: [] for name in VARIANTS}
        reference = None
        for _ in range(3):
            for name, schedule in VARIANTS.items():
                lookup.hopper_schedule = shipped if schedule is None else (lambda params, s=schedule: (s, name))
                dispatch.forget()

                def call():
                    return fmha.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal=True)

                out = call()
                reference = out if reference is None else reference
                assert torch.equal(out, reference), name
                times[name].append(kernel_us(call))
        lookup.hopper_schedule = shipped
        dispatch.forget()
        row = {"sequences": len(lengths), "lengths": list(lengths),
               "kernel_us": {name: statistics.median(samples) for name, samples in times.items()}}
        rows.append(row)
        print(row["sequences"], {name: round(us, 1) for name, us in row["kernel_us"].items()}, flush=True)
    write_result(sys.argv[1], rows)


if __name__ == "__main__":
    main()
