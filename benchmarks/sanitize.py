"""Small calls of every kernel family, for compute-sanitizer (GPU).

    compute-sanitizer --tool racecheck python3 benchmarks/sanitize.py --family hopper
    bash benchmarks/sanitize.sh $OUT      # all four tools over all families, with a summary

Families: ``hopper`` (the Gluon forward, D 64 and 128, causal and not, GQA, odd lengths, each
schedule shape: one, two and three consumers), ``portable`` (the Triton forward and backward, odd
lengths, GQA, D 40 and 128, causal, a sliding window), ``varlen`` (packed sequences: the tile
list, the forward and the backward), ``split_kv`` (the decode forward and its combine kernel), ``naive``
(step 2's three kernels), and two minimal Gluon kernels:
``ws_minimal`` only warp-specialises (one worker; then the Hopper forward's shape: two workers,
setmaxnreg, a captured value) with no shared memory of its own, so its racecheck report shows
Triton's own hand-over of work to the partitions apart from the attention kernel's
synchronisation; ``tma_store_minimal`` writes a tensor only through a bulk tensor store, so
initcheck shows whether it counts such stores as initialising memory. Every attention call is
checked against SDPA's math backend; the Hopper outputs reuse NaN-filled memory, so an element
the kernel did not write shows up as NaN.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

import fmha
from fmha import ForwardConfig, HopperSchedule
from fmha.compat import tma_store


def _reference(q, k, v, causal, left=None):
    with sdpa_kernel(SDPBackend.MATH):
        # bottom-right causal (and a left window bound) as fmha: an explicit mask
        mask = None
        if causal:
            seqlen_q, seqlen_k = q.shape[2], k.shape[2]
            rows = torch.arange(seqlen_q, device=q.device)[:, None] + seqlen_k - seqlen_q
            keys = torch.arange(seqlen_k, device=q.device)[None, :]
            mask = keys <= rows
            if left is not None:
                mask &= keys >= rows - left
        return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                                enable_gqa=True)


def _poison_free_memory(nbytes):
    """The caching allocator hands this NaN-filled block to the next allocation of its size."""
    torch.full((nbytes // 2,), float("nan"), device="cuda", dtype=torch.bfloat16)


def _check(name, out, q, k, v, causal, left=None):
    expected = _reference(q, k, v, causal, left).nan_to_num()
    error = (out.float() - expected).abs().max().item()
    status = "ok" if error < 2e-2 and out.isfinite().all() else "WRONG"
    print(f"{name}: max abs error {error:.2e} {status}", flush=True)


def _inputs(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype=torch.bfloat16, grad=False):
    def make(heads, seqlen):
        return torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype, requires_grad=grad)
    return make(q_heads, seqlen_q), make(kv_heads, seqlen_k), make(kv_heads, seqlen_k)


def hopper():
    schedules = [HopperSchedule(), HopperSchedule(consumers=1, block_n=64, ctas_per_sm=3, persistent=False),
                 HopperSchedule(consumers=3, block_n=64, stages=3), HopperSchedule(q_buffers=2, emulated_exp2=8)]
    for head_dim in (64, 128):
        for causal in (False, True):
            for schedule in schedules:
                if head_dim == 128 and (schedule.consumers == 3 or schedule.ctas_per_sm == 3):
                    continue  # does not fit the registers at D=128 (ptxas fails)
                q, k, v = _inputs(1, 4, 2, 300, 333, head_dim)
                _poison_free_memory(q.numel() * 4)
                out = fmha.attention(q, k, v, causal=causal, config=schedule)
                unwritten = out.isnan().sum().item()
                _check(f"hopper D{head_dim} causal={causal} {schedule.text()} unwritten={unwritten}", out, q, k, v,
                       causal)
        # a sliding window: tiles start at the window's left edge
        q, k, v = _inputs(1, 4, 2, 300, 333, head_dim)
        _poison_free_memory(q.numel() * 4)
        out = fmha.attention(q, k, v, causal=True, window=(70, 0), config=HopperSchedule())
        _check(f"hopper D{head_dim} window (70, 0) unwritten={out.isnan().sum().item()}", out, q, k, v, True, 70)


def portable():
    for head_dim, config in ((40, ForwardConfig(64, 32, 4, 2)), (128, ForwardConfig(128, 64, 8, 3))):
        for causal in (False, True):
            q, k, v = _inputs(2, 4, 2, 77, 131, head_dim, grad=True)
            out = fmha.attention(q, k, v, causal=causal, config=config)
            _check(f"portable forward D{head_dim} causal={causal}", out, q, k, v, causal)
            out.backward(torch.randn_like(out))
            grads = [t.grad for t in (q, k, v)]
            finite = all(torch.isfinite(grad).all().item() for grad in grads)
            print(f"portable backward D{head_dim} causal={causal}: gradients finite={finite}", flush=True)
        q, k, v = _inputs(2, 4, 2, 77, 131, head_dim, grad=True)
        out = fmha.attention(q, k, v, causal=True, window=(20, 0), config=config)
        _check(f"portable forward D{head_dim} window (20, 0)", out, q, k, v, True, 20)
        out.backward(torch.randn_like(out))
        print(f"portable backward D{head_dim} window (20, 0): gradients finite="
              f"{all(torch.isfinite(t.grad).all().item() for t in (q, k, v))}", flush=True)


def varlen():
    """Packed sequences (empty, one-token and multi-tile ones): the tile list, forward and backward."""
    lengths_q, lengths_k = [77, 0, 1, 130, 5], [90, 3, 0, 130, 64]
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
                  for lengths in (lengths_q, lengths_k))
    for head_dim in (40, 128):
        q = torch.randn(sum(lengths_q), 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(sum(lengths_k), 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        out = fmha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
        for b in (0, 3, 4):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            _check(f"varlen forward D{head_dim} sequence {b}", out[rows].transpose(0, 1)[None],
                   *(t[span].transpose(0, 1)[None] for t, span in ((q, rows), (k, keys), (v, keys))), True)
        out.backward(torch.randn_like(out))
        print(f"varlen backward D{head_dim}: gradients finite="
              f"{all(torch.isfinite(t.grad).all().item() for t in (q, k, v))}", flush=True)


def split_kv():
    for shape, causal in (((1, 32, 8, 1, 1000, 128), False), ((2, 8, 2, 3, 517, 64), True)):
        q, k, v = _inputs(*shape)
        assert type(fmha.explain(q, k, v, causal=causal).config).__name__ == "SplitKVConfig"
        out = fmha.attention(q, k, v, causal=causal)
        _check(f"split_kv {shape} causal={causal}", out, q, k, v, causal)


def naive():
    q, k, v = _inputs(1, 4, 2, 77, 131, 64)
    with torch.no_grad():
        out = fmha.naive_attention(q, k, v, causal=True)
    _check("naive causal", out, q, k, v, True)


@gluon.jit
def _ws_default(out, WARPS: gl.constexpr):
    offsets = gl.arange(0, 32 * WARPS, gl.BlockedLayout([1], [32], [WARPS], [0]))
    gl.store(out + offsets, offsets)


@gluon.jit
def _ws_worker(out, FIRST: gl.constexpr):
    offsets = gl.arange(0, 32, gl.BlockedLayout([1], [32], [1], [0]))
    gl.store(out + FIRST + offsets, offsets)


@gluon.jit
def ws_minimal_kernel(out):
    gl.warp_specialize([(_ws_default, (out, 4)), (_ws_worker, (out, 128))], worker_num_warps=[1],
                       worker_num_regs=[24])


@gluon.jit
def _ws_consumer(out, value, FIRST: gl.constexpr):
    offsets = gl.arange(0, 128, gl.BlockedLayout([1], [32], [4], [0]))
    gl.store(out + FIRST + offsets, offsets + value)


@gluon.jit
def ws_two_workers_kernel(out, values):
    """The attention kernel's shape of warp specialisation: a 4-warp default partition, a 4-warp
    and a 1-warp worker, registers moved by setmaxnreg, and a captured value (a load, which the
    compiler passes to the workers through shared memory rather than recomputing it)."""
    value = gl.load(values + gl.program_id(0))
    gl.warp_specialize([(_ws_consumer, (out, value, 0)), (_ws_consumer, (out, value, 128)),
                        (_ws_worker, (out, 256))], worker_num_warps=[4, 1], worker_num_regs=[232, 40])


@gluon.jit
def tma_store_kernel(out_desc, BLOCK: gl.constexpr):
    """Writes one tile only through a bulk tensor store, as the Hopper forward writes O."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    rows = gl.arange(0, BLOCK, gl.SliceLayout(1, layout))
    cols = gl.arange(0, BLOCK, gl.SliceLayout(0, layout))
    tile = (rows[:, None] * BLOCK + cols[None, :]).to(gl.float16)
    staging = gl.allocate_shared_memory(gl.float16, [BLOCK, BLOCK], out_desc.layout)
    staging.store(tile)
    fence_async_shared()
    tma_store(out_desc, [0, 0], staging)
    tma.store_wait(0)


def ws_minimal():
    out = torch.full((160,), -1, device="cuda", dtype=torch.int32)
    ws_minimal_kernel[(4,)](out, num_warps=4)
    expected = torch.cat([torch.arange(128), torch.arange(32)]).to(out)
    print(f"ws_minimal one worker: {'ok' if torch.equal(out, expected) else 'WRONG'}", flush=True)
    out = torch.full((288,), -1, device="cuda", dtype=torch.int32)
    values = torch.full((4,), 5, device="cuda", dtype=torch.int32)
    ws_two_workers_kernel[(4,)](out, values, num_warps=4)
    expected = torch.cat([torch.arange(128) + 5, torch.arange(128) + 5, torch.arange(32)]).to(out)
    print(f"ws_minimal two workers: {'ok' if torch.equal(out, expected) else 'WRONG'}", flush=True)


def tma_store_minimal():
    """initcheck on a tensor written only by a bulk tensor store (then read by torch)."""
    block = 64
    out = torch.empty(block, block, device="cuda", dtype=torch.float16)
    layout = gl.NVMMASharedLayout.get_default_for([block, block], gl.float16)
    tma_store_kernel[(1,)](TensorDescriptor.from_tensor(out, [block, block], layout), block, num_warps=4)
    expected = torch.arange(block * block, device="cuda").reshape(block, block).to(torch.float16)
    print(f"tma_store_minimal: {'ok' if torch.equal(out, expected) else 'WRONG'}", flush=True)


FAMILIES = {"hopper": hopper, "portable": portable, "varlen": varlen, "split_kv": split_kv, "naive": naive,
            "ws_minimal": ws_minimal,
            "tma_store_minimal": tma_store_minimal}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="*", choices=sorted(FAMILIES), default=sorted(FAMILIES),
                        help="kernel families to run (default: all)")
    args = parser.parse_args()
    torch.manual_seed(0)
    for family in args.family:
        FAMILIES[family]()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
