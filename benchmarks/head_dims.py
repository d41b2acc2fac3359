"""Head dims between the Hopper kernels' tile widths (GPU, sm_90): speed of the Gluon kernels run
at the next tile width against the portable kernel and SDPA's backends.

For each head dim and causal or not (B4 H16 S4k, bf16), times the forward of the default path,
the Gluon forward (the shipped schedule of the tile width), the portable forward (heuristic tiles),
SDPA flash and SDPA cuDNN, and forward+backward of the default path, of the default path with
``deterministic=True`` (the portable backward) and of SDPA's. TFLOP/s count the call's head dim.
Correctness is tests/test_gpu_head_dims.py's. Writes JSON and prints one table per case.

    PYTHONPATH=src python benchmarks/head_dims.py --out head_dims.json [--head-dims 32 96] [--rounds 3]
"""

import argparse
import json

import torch
from head_dim_256 import report_rows, timed_rows, with_backward

import fmha
from fmha.backends.gluon_sm90.launch import HopperForward
from fmha.backends.gluon_sm90.schedule import HopperSchedule, tile_head_dim
from fmha.backends.triton.config import heuristic_forward_config
from fmha.backends.triton.launch import PortableForward
from fmha.masking import Window
from fmha.params import attention_params
from fmha.testing import random_qkv
from fmha.tools.bench.cases import Case
from fmha.tools.bench.metrics import visible_pairs
from fmha.tools.bench.peers import PEERS
from fmha.tools.bench.runner import environment

SCHEDULES = {64: HopperSchedule(q_buffers=2, emulated_exp2=8), 128: HopperSchedule(q_buffers=2),
             256: HopperSchedule(block_n=64, pack_p=True)}
BATCH, HEADS, SEQLEN = 4, 16, 4096


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="head_dims.json")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[16, 32, 48, 64, 80, 96, 128, 160, 192])
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds, providers interleaved; the median is kept")
    args = parser.parse_args()
    payload = {"environment": environment(), "rows": []}
    for head_dim in args.head_dims:
        for causal in (False, True):
            q, k, v = random_qkv(BATCH, HEADS, HEADS, SEQLEN, SEQLEN, head_dim, torch.bfloat16, device="cuda",
                                 layout="bshd")
            window = Window.of(SEQLEN, SEQLEN, right=0) if causal else None
            flops = 4 * BATCH * HEADS * head_dim * visible_pairs(SEQLEN, SEQLEN, window)
            params = attention_params("head_dims", q, k, v, causal=causal)
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
            case = Case(BATCH, HEADS, HEADS, SEQLEN, SEQLEN, head_dim, causal=causal)
            runs = {"fmha": lambda: fmha.attention(q, k, v, causal=causal),
                    "sdpa_flash": PEERS["sdpa_flash"].prepare(case, q, k, v).run,
                    "sdpa_cudnn": PEERS["sdpa_cudnn"].prepare(case, q, k, v).run}
            portable = PortableForward(params, heuristic_forward_config(head_dim, q.dtype, SEQLEN))
            runs["portable"] = lambda: portable(q, k, v, out, lse)
            tile = tile_head_dim(head_dim)
            if tile is not None and head_dim % 8 == 0:
                gluon = HopperForward(params, SCHEDULES[tile])
                runs["gluon"] = lambda: gluon(q, k, v, out, lse)
            q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
            training = {"fmha fwd+bwd": with_backward(runs["fmha"], q, k, v),
                        "fmha deterministic fwd+bwd": with_backward(
                            lambda: fmha.attention(q, k, v, causal=causal, deterministic=True), q, k, v),
                        "sdpa_flash fwd+bwd": with_backward(runs["sdpa_flash"], q, k, v),
                        "sdpa_cudnn fwd+bwd": with_backward(runs["sdpa_cudnn"], q, k, v)}
            explanation = fmha.explain(q, k, v, causal=causal)
            label = f"D{head_dim} B{BATCH} H{HEADS} S{SEQLEN}{' causal' if causal else ''}"
            record = report_rows(label, f"{explanation.backend} {explanation.config}",
                                 timed_rows({**runs, **training}, flops, args.rounds))
            payload["rows"].append({**record, "head_dim": head_dim, "causal": causal})
            del q, k, v
            with open(args.out, "w") as handle:
                json.dump(payload, handle, indent=1)


if __name__ == "__main__":
    main()
