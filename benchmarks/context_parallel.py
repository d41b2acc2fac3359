"""Context parallelism on PyTorch's engine: fmha beside SDPA's flash and cuDNN kernels, forward+backward.

One process per GPU, started by torchrun:

    torchrun --nproc_per_node=1 benchmarks/context_parallel.py --out cp_1gpu.json
    torchrun --nproc_per_node=4 benchmarks/context_parallel.py --baseline cp_1gpu.json --out cp_4gpu.json

With one process each provider is one ``F.scaled_dot_product_attention`` call on the whole
sequence (``--context-parallel`` runs the ring anyway, over one rank); with several, torch's
``context_parallel`` shards the sequence (load-balanced when causal) and runs its ring, every chunk
on the provider's kernel. Providers: ``fmha`` (FMHA activated in PyTorch's flash-attention
registry, SDPA's flash backend), ``sdpa_flash`` (torch's FlashAttention-2), ``sdpa_cudnn``.
Each rank makes its own shard of q, k and v (random: the timing does not depend on the values);
the sequence positions are the buffer that ``context_parallel`` shards.

Times are the median over ``--iters`` iterations of forward+backward, each the slowest rank's.
TFLOP/s count the visible (query, key) pairs: 4·D per pair forward, 3.5x that forward+backward;
per GPU is the total over the number of GPUs. ``--baseline`` (a one-GPU run's JSON) adds the
scaling efficiency t(1 GPU) / (N · t(N GPUs)). ``--check`` first compares the ring's output and
gradients (unsharded) with float64 at B1 H4 S4096 D128, by the project's error rule.

NVLink multicast stays off in every process (this workplace's device rules): NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are set before NCCL starts.
"""

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.experimental._attention import set_rotate_method  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import fmha  # noqa: E402
from fmha import distributed  # noqa: E402
from fmha.integrations import sdpa  # noqa: E402
from fmha.testing import assert_close_to_reference, assert_grads_close  # noqa: E402

PROVIDERS = {"fmha": SDPBackend.FLASH_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
             "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[131072, 262144, 524288, 1048576])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--masks", nargs="+", choices=["causal", "full"], default=["causal", "full"])
    parser.add_argument("--providers", nargs="+", choices=sorted(PROVIDERS), default=sorted(PROVIDERS))
    parser.add_argument("--rotate", choices=["allgather", "alltoall"], default="alltoall")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--context-parallel", action="store_true", help="run the ring even with one process")
    parser.add_argument("--check", action="store_true", help="check the ring against float64 first")
    parser.add_argument("--baseline", help="a one-GPU run's JSON, for the scaling efficiency")
    parser.add_argument("--out", help="write the results here (rank 0)")
    return parser.parse_args()


@contextlib.contextmanager
def provider_context(provider):
    if provider == "fmha":
        sdpa.activate(strict=True)  # a chunk fmha cannot run fails instead of timing torch's kernel
    else:
        sdpa.deactivate()
    with sdpa_kernel(PROVIDERS[provider]):
        yield


def ring_context(mesh, seqlen, causal, use_ring):
    """torch's context_parallel over the positions buffer, or nothing on one GPU without the ring."""
    if not use_ring:
        return contextlib.nullcontext()
    positions = torch.arange(seqlen, device="cuda")
    return distributed.context_parallel(mesh, causal=causal, buffers=[positions], buffer_seq_dims=[0],
                                        no_restore_buffers={positions})


def time_fwd_bwd(args, provider, seqlen, causal, mesh, use_ring):
    world = dist.get_world_size()
    shape = (args.batch, args.heads, seqlen // world, args.head_dim)
    generator = torch.Generator(device="cuda").manual_seed(dist.get_rank())
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    times = []
    with provider_context(provider), ring_context(mesh, seqlen, causal, use_ring):
        for step in range(args.warmup + args.iters):
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            out.backward(dout)
            end.record()
            torch.cuda.synchronize()
            elapsed = torch.tensor(start.elapsed_time(end), device="cuda")
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                times.append(elapsed.item())
            q.grad = k.grad = v.grad = None
            del out
    return statistics.median(times)


def check_ring(mesh, use_ring):
    """The ring's output and gradients at B1 H4 S4096 D128 (bf16) against float64, causal and not."""
    results = {}
    for causal in (True, False):
        generator = torch.Generator(device="cuda").manual_seed(0)  # the same full tensors on every rank
        q, k, v, dout = (torch.randn(1, 4, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
                         for _ in range(4))
        shards = [t.clone() for t in (q, k, v, dout)]
        context = distributed.context_parallel(mesh, causal=causal, buffers=shards, buffer_seq_dims=[2] * 4) \
            if use_ring else contextlib.nullcontext()
        with provider_context("fmha"), context:
            leaves = [t.detach().requires_grad_() for t in shards[:3]]
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            out.backward(shards[3])
        pieces = [out.detach()] + [t.grad for t in leaves]
        full = distributed.unshard(mesh, pieces, [2] * 4, causal=causal) if use_ring else pieces
        offset = 0 if causal else None
        error, torch_error = assert_close_to_reference(full[0], q, k, v, causal_offset=offset)
        grad_errors = assert_grads_close(full[1:], q, k, v, dout, causal_offset=offset)
        results["causal" if causal else "full"] = {"out_error": error, "torch_math_error": torch_error,
                                                   "grad_errors": grad_errors}
    return results


def main():
    args = arguments()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    use_ring = world > 1 or args.context_parallel
    set_rotate_method(args.rotate)
    baseline = {}
    if args.baseline:
        with open(args.baseline) as handle:
            baseline = {(row["provider"], row["seqlen"], row["causal"]): row["ms"] for row in json.load(handle)["rows"]}
    result = {"device": torch.cuda.get_device_name(), "gpus": world, "context_parallel": use_ring,
              "rotate": args.rotate if use_ring else None, "torch": torch.__version__, "triton": triton.__version__,
              "fmha": fmha.__version__, "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim,
              "dtype": "bfloat16", "iters": args.iters, "rows": []}
    if args.check:
        result["check"] = check_ring(mesh, use_ring)
        if rank == 0:
            print("check:", json.dumps(result["check"]), flush=True)
    for seqlen in args.seqlens:
        for mask in args.masks:
            causal = mask == "causal"
            pairs = args.batch * args.heads * (seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen)
            flops = 4 * args.head_dim * pairs * 3.5
            for provider in args.providers:
                ms = time_fwd_bwd(args, provider, seqlen, causal, mesh, use_ring)
                row = {"provider": provider, "seqlen": seqlen, "causal": causal, "ms": ms,
                       "tflops": flops / ms / 1e9, "tflops_per_gpu": flops / ms / 1e9 / world}
                if (provider, seqlen, causal) in baseline:
                    row["efficiency"] = baseline[provider, seqlen, causal] / (world * ms)
                result["rows"].append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    sdpa.deactivate()
    if rank == 0 and args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
