"""Packed variable-length sequences on the GPU: fmha beside SDPA's ``varlen_attn`` in the same run.

Cases (bf16, causal, H16 D128): the issue's nine sequences (16,384 tokens), and one long sequence
among many short ones (the tile list's balance case), beside the same tokens cut into equal
lengths. TFLOP/s count only visible pairs; forward and forward+backward; each output is checked
against ``varlen_attn`` first.
    PYTHONPATH=src python benchmarks/varlen.py [out.json]
"""

import inspect
import itertools
import json
import random
import sys

import torch
import triton

import fmha
from fmha import dispatch
from fmha.params import varlen_params

HEADS, HEAD_DIM = 16, 128
NINE = [862, 1654, 712, 3359, 1799, 1201, 2383, 3162, 1252]
ONE_LONG = [8192] + [random.Random(i).randint(1, 300) for i in range(63)]


def torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    causal = ({"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters
              else {"is_causal": True})
    return lambda q, k, v, cu, longest: varlen_attn(q, k, v, cu, cu, longest, longest, **causal)


def measure(lengths, peer):
    total = sum(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    longest = max(lengths)
    pairs = sum(length * (length + 1) // 2 for length in lengths) * HEADS
    flops = {"fwd": 4 * pairs * HEAD_DIM, "fwdbwd": 4 * pairs * HEAD_DIM * 3.5}
    providers = {"fmha": lambda: fmha.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)}
    if len(set(lengths)) == 1:  # the same tokens as a dense batch
        dense_q, dense_k, dense_v = (t.detach().view(len(lengths), lengths[0], HEADS, HEAD_DIM).transpose(1, 2)
                                     for t in (q, k, v))
        providers["fmha_dense"] = lambda: fmha.attention(dense_q, dense_k, dense_v, causal=True)
    if peer is not None:
        providers["varlen_attn"] = lambda: peer(q, k, v, cu, longest)
    row = {"lengths": lengths if len(lengths) < 20 else f"{len(lengths)} sequences, longest {longest}",
           "tokens": total}
    with torch.no_grad():
        reference = providers.get("varlen_attn", providers["fmha"])().float()
        row["max_diff_vs_peer"] = (providers["fmha"]().float() - reference).abs().max().item()
    params = varlen_params("bench", q, k, v, cu, cu, longest, longest, causal=True)
    row["fmha_runs"] = str(dispatch.prepared_forward(params, q, k, v, cu, cu).explanation).splitlines()[:2]
    for name, run in providers.items():
        with torch.no_grad():
            forward_ms = triton.testing.do_bench(run)
        if name == "fmha_dense":
            row["fmha_dense_fwd_tflops"] = flops["fwd"] / forward_ms / 1e9
            continue
        both_ms = triton.testing.do_bench(lambda: torch.autograd.grad(run(), (q, k, v), dout))
        row[f"{name}_fwd_us"] = forward_ms * 1e3
        row[f"{name}_fwdbwd_us"] = both_ms * 1e3
        row[f"{name}_fwd_tflops"] = flops["fwd"] / forward_ms / 1e9
        row[f"{name}_fwdbwd_tflops"] = flops["fwdbwd"] / both_ms / 1e9
    return row


def schedules(lengths):
    """Forward TFLOP/s of the Hopper kernel's schedules on one case (which the shipped rules should pick)."""
    total = sum(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    params = varlen_params("bench", q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    flops = 4 * sum(length * (length + 1) // 2 for length in lengths) * HEADS * HEAD_DIM
    results = {}
    for schedule in (fmha.HopperSchedule(), fmha.HopperSchedule(q_buffers=2), fmha.HopperSchedule(persistent=False),
                     fmha.HopperSchedule(persistent=False, q_buffers=2),
                     fmha.HopperSchedule(consumers=1, block_n=128, q_buffers=2, ctas_per_sm=2)):
        try:
            launch = dispatch.BACKENDS["gluon_sm90"].prepare_forward(params, schedule)
        except Exception as error:  # noqa: BLE001 - a schedule that does not build is reported
            results[schedule.text()] = f"failed: {error}"
            continue
        out = torch.empty_like(q)
        lse = torch.empty((HEADS, total), device="cuda", dtype=torch.float32)
        ms = triton.testing.do_bench(lambda: launch(q, k, v, out, lse, cu, cu))
        results[schedule.text()] = flops / ms / 1e9
    return results


def main():
    peer = torch_varlen()
    rows = []
    for lengths in (NINE, ONE_LONG):
        rows.append({"lengths": lengths if len(lengths) < 20 else "one long", "schedules_fwd_tflops": schedules(lengths)})
        print(json.dumps(rows[-1]), flush=True)
    equal = [sum(ONE_LONG) // 8] * 8
    for lengths in (NINE, ONE_LONG, equal):
        rows.append(measure(lengths, peer))
        print(json.dumps(rows[-1]), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
