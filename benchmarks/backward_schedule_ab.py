"""Gluon backward schedules side by side, interleaved (GPU, sm_90): the shipped one against
``HopperBackwardSchedule`` variants, on `std` shapes, sliding windows and packed sequences.

    PYTHONPATH=src python benchmarks/backward_schedule_ab.py out.json [--variant dynamic=1] [--rounds 3]

Each variant replaces the launcher's schedule choice for its calls. dK and dV must equal the
shipped schedule's bit for bit (each key block's sums run in the same order); dQ, added with
atomics, within 1e-2 absolute. GPU time of one ``torch.autograd.grad`` (every kernel) by the
profiler, median of the rounds.
"""

import argparse
import dataclasses
import statistics

import torch

import fmha
from fmha import dispatch
from fmha.backends.gluon_sm90 import backward_launch
from fmha.tools.bench.cases import NINE_SEQUENCES
from hopper_schedule_ab import kernel_times, parse_variant, write_result  # benchmarks/ is the script's directory

# (name, B, H, S, D, causal, window); varlen: the nine sequences
CASES = [("D64 S4k", 4, 32, 4096, 64, False, None), ("D64 S4k causal", 4, 32, 4096, 64, True, None),
         ("D128 S4k", 4, 16, 4096, 128, False, None), ("D128 S4k causal", 4, 16, 4096, 128, True, None),
         ("D128 S1k causal", 16, 16, 1024, 128, True, None),
         ("D128 S1k", 16, 16, 1024, 128, False, None), ("D128 S16k causal", 1, 16, 16384, 128, True, None),
         ("window 1024", 1, 16, 16384, 128, True, (1023, 0)), ("window 4096", 1, 16, 16384, 128, True, (4095, 0)),
         ("varlen 9", None, 16, None, 128, True, None),
         ("D64 S1k", 16, 32, 1024, 64, False, None), ("D64 S1k causal", 16, 32, 1024, 64, True, None),
         ("D64 S16k", 1, 32, 16384, 64, False, None), ("D64 S16k causal", 1, 32, 16384, 64, True, None),
         ("D64 window 1024", 1, 32, 16384, 64, True, (1023, 0)), ("D64 varlen 9", None, 32, None, 64, True, None),
         # one long sequence (docs/perf.md, session 13: the rate falls as S grows)
         ("D128 S16k", 1, 16, 16384, 128, False, None), ("D128 S32k", 1, 16, 32768, 128, False, None),
         ("D128 S64k", 1, 16, 65536, 128, False, None), ("D128 S64k causal", 1, 16, 65536, 128, True, None),
         ("D128 S2k causal", 8, 16, 2048, 128, True, None), ("D128 S8k causal", 2, 16, 8192, 128, True, None),
         ("D64 S2k causal", 8, 32, 2048, 64, True, None), ("D64 S8k causal", 2, 32, 8192, 64, True, None),
         ("D64 S64k", 1, 32, 65536, 64, False, None),
         # score features: the keyword arguments of fmha.attention (attn_mask: a bool (S, S) mask through
         # fmha.scaled_dot_product_attention)
         ("D64 S4k causal softcap", 4, 32, 4096, 64, True, None, {"softcap": 30.0}),
         ("D64 S4k causal alibi", 4, 32, 4096, 64, True, None, {"alibi_slopes": "geometric"}),
         ("D64 S4k causal dropout", 4, 32, 4096, 64, True, None, {"dropout_p": 0.1}),
         ("D64 S4k mask", 4, 32, 4096, 64, False, None, {"attn_mask": "bool"}),
         ("D128 S4k causal softcap", 4, 16, 4096, 128, True, None, {"softcap": 30.0}),
         ("D128 S4k causal alibi", 4, 16, 4096, 128, True, None, {"alibi_slopes": "geometric"}),
         ("D128 S4k causal dropout", 4, 16, 4096, 128, True, None, {"dropout_p": 0.1}),
         ("D128 S4k mask", 4, 16, 4096, 128, False, None, {"attn_mask": "bool"})]


def make_call(case):
    name, batch, heads, seqlen, head_dim, causal, window = case[:7]
    features = dict(case[7]) if len(case) > 7 else {}
    if batch is None:
        total = sum(NINE_SEQUENCES)
        q, k, v = (torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        cu = torch.tensor([0, *torch.tensor(NINE_SEQUENCES).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        longest = max(NINE_SEQUENCES)
        out = fmha.varlen_attention(q, k, v, cu, cu, longest, longest, causal=True)
    else:
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        if features.get("alibi_slopes") == "geometric":
            features["alibi_slopes"] = torch.exp2(-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)
        if features.pop("attn_mask", None):
            mask = torch.rand(seqlen, seqlen, device="cuda") < 0.9
            out = fmha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = fmha.attention(q, k, v, causal=causal, window=window, **features)
    grad_out = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--variant", action="append", default=[], type=parse_variant)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default="")
    args = parser.parse_args()
    shipped = backward_launch.default_backward_schedule
    rows = []
    for case in CASES:
        if args.cases and case[0] not in args.cases.split(","):
            continue
        torch.manual_seed(0)
        call = make_call(case)
        schedules = {"default": None}
        for fields in args.variant:
            schedules[",".join(f"{k}={v}" for k, v in fields.items())] = fields
        times = {label: [] for label in schedules}
        reference = None
        for round_index in range(args.rounds):
            # every other round in reverse: a schedule's place in the round must not favour it
            order = list(schedules.items())[::-1 if round_index % 2 else 1]
            for label, fields in order:
                if fields is None:
                    backward_launch.default_backward_schedule = shipped
                else:
                    def variant(head_dim, fields=fields):
                        base = shipped(head_dim)
                        return dataclasses.replace(base, **{key: type(getattr(base, key))(value)
                                                            for key, value in fields.items()})
                    backward_launch.default_backward_schedule = variant
                dispatch.forget()
                grads = call()
                if reference is None:
                    reference = grads
                else:
                    assert torch.equal(grads[1], reference[1]) and torch.equal(grads[2], reference[2]), label
                    assert (grads[0].float() - reference[0].float()).abs().max().item() < 1e-2, label
                times[label].append(sum(kernel_times(call, 10).values()))
        backward_launch.default_backward_schedule = shipped
        dispatch.forget()
        default = statistics.median(times["default"])
        for label, samples in times.items():
            row = {"case": case[0], "schedule": label, "total_us": statistics.median(samples), "samples_us": samples,
                   "vs_default": default / statistics.median(samples)}
            rows.append(row)
            print(case[0], label, round(row["total_us"], 1), round(row["vs_default"], 3), flush=True)
    write_result(args.out, rows)


if __name__ == "__main__":
    main()
