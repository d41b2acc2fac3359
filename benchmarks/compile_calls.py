"""Random calls of fmha's entry points, eager against ``torch.compile(fullgraph=True)``.

The compiled call traces fmha's Python (the argument checks, the dispatch) on fake tensors, and
with dynamic shapes the sizes, ints and floats passed in are symbolic. So every call is made both
ways, on copies of the same inputs, and must give the same outputs (values, shapes, dtypes and the
strides of every dimension longer than one), leave the inputs the same (the KV caches after an
append), and for the differentiable entry points give the same gradients. Scalars (scale,
softcap, window sides, max_seqlen) go in as arguments of the compiled function, so that dynamic
compiles see them symbolic, as a model's forward passes them.

    python benchmarks/compile_calls.py --seconds 600 --seed 1            # CPU, Triton's interpreter
    PYTHONPATH=src python benchmarks/compile_calls.py --device cuda ...  # a GPU

On the CPU (the default) the kernels run under TRITON_INTERPRET=1 and both ways must agree bit
for bit. On a GPU the outputs must too; the gradients within two units in the last place of their
dtype (at least 1e-3), since the Hopper backward adds dQ with atomics in a varying order. Each
mismatch or error is printed with the call's arguments.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

KINDS = ("attention", "sdpa", "flash", "varlen", "kvcache", "paged")
DIFFERENTIABLE = ("attention", "sdpa", "flash", "varlen")


def random_call(rng, torch, fmha, device):
    """``(kind, fn, args, kwargs)``: a small random call of one entry point."""
    kind = rng.choice(KINDS)
    on_gpu = device != "cpu"
    batch, kv_heads = rng.choice([1, 2]), rng.choice([1, 2])
    # on a GPU also lengths over one tile, and head dims that the Hopper kernels take (D > 32)
    seqlen_q = rng.choice([1, 3, 17] + [200] * on_gpu)
    seqlen_k = rng.choice([1, 5, 33] + [300] * on_gpu)
    q_heads = kv_heads * rng.choice([1, 2])
    head_dim = rng.choice([8, 16, 24] if not on_gpu else [16, 64, 96, 128])
    if on_gpu and kind in ("attention", "sdpa", "flash") and rng.random() < 0.25:
        # over 4.3 GFLOP, where the shipped rules run the Hopper forward rather than the portable one
        batch, kv_heads, q_heads, seqlen_q, seqlen_k, head_dim = 2, 2, 4, 1536, 2048, rng.choice([64, 128])
    dtype = rng.choice([torch.float16, torch.float32]) if device == "cpu" else rng.choice([torch.float16, torch.bfloat16])
    # v's own head dim in a fifth of the calls that take separate k and v (not the KV cache's)
    head_dim_v = head_dim if rng.random() < 0.8 else rng.choice([8, 32] if not on_gpu else [64, 128])

    def randn(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    if kind == "attention":
        kwargs = dict(causal=rng.random() < 0.5, return_lse=rng.random() < 0.5)
        if rng.random() < 0.3:
            kwargs["window"] = (rng.choice([None, 0, 3]), rng.choice([None, 0, 2]))
        if rng.random() < 0.3:
            kwargs["softcap"] = 20.0
        if rng.random() < 0.3:
            kwargs["scale"] = 0.3
        if rng.random() < 0.3:
            kwargs["sinks"] = torch.randn(q_heads, device=device)
        if rng.random() < 0.3:
            kwargs["alibi_slopes"] = torch.rand(rng.choice([(q_heads,), (batch, q_heads)]), device=device)
        bshd = rng.random() < 0.5  # BSHD views, or BHSD tensors

        def tensor(heads, seqlen, features=head_dim):
            x = randn(batch, seqlen, heads, features).transpose(1, 2)
            return x if bshd else x.contiguous()
        return kind, fmha.attention, (tensor(q_heads, seqlen_q), tensor(kv_heads, seqlen_k),
                                      tensor(kv_heads, seqlen_k, head_dim_v)), kwargs
    if kind == "sdpa":
        kwargs = dict(is_causal=rng.random() < 0.3, enable_gqa=True)
        if rng.random() < 0.3:
            kwargs["scale"] = 0.3
        if not kwargs["is_causal"] and rng.random() < 0.6:
            kwargs["attn_mask"] = (torch.rand(seqlen_q, seqlen_k, device=device) < 0.7 if rng.random() < 0.5
                                   else randn(batch, 1, seqlen_q, seqlen_k))
        kv_batch = 1 if rng.random() < 0.25 else batch  # a key/value batch of one broadcasts, as in torch
        return kind, fmha.scaled_dot_product_attention, (randn(batch, q_heads, seqlen_q, head_dim),
                                                        randn(kv_batch, kv_heads, seqlen_k, head_dim),
                                                        randn(kv_batch, kv_heads, seqlen_k, head_dim_v)), kwargs
    if kind == "flash":
        kwargs = dict(causal=rng.random() < 0.5, window_size=rng.choice([(-1, -1), (3, 0), (2, 2)]),
                      softcap=rng.choice([0.0, 15.0]), return_attn_probs=rng.random() < 0.5)
        if rng.random() < 0.3:
            kwargs["softmax_scale"] = 0.3
        if rng.random() < 0.3:
            kwargs["alibi_slopes"] = torch.rand(q_heads, device=device)
        return kind, fmha.flash_attn_func, (randn(batch, seqlen_q, q_heads, head_dim),
                                            randn(batch, seqlen_k, kv_heads, head_dim),
                                            randn(batch, seqlen_k, kv_heads, head_dim_v)), kwargs
    if kind == "varlen":
        lengths_q = [rng.choice([0, 1, 4, 9] + [150] * on_gpu) for _ in range(batch + 1)]
        lengths_k = [rng.choice([0, 1, 5, 12] + [210] * on_gpu) for _ in lengths_q]

        def offsets(lengths):
            return torch.tensor([0] + lengths, dtype=torch.int32, device=device).cumsum(0).to(torch.int32)
        kwargs = dict(causal=rng.random() < 0.5, window_size=rng.choice([(-1, -1), (3, 0)]),
                      softcap=rng.choice([0.0, 15.0]), return_attn_probs=rng.random() < 0.5)
        return kind, fmha.flash_attn_varlen_func, (randn(sum(lengths_q), q_heads, head_dim),
                                                   randn(sum(lengths_k), kv_heads, head_dim),
                                                   randn(sum(lengths_k), kv_heads, head_dim_v), offsets(lengths_q),
                                                   offsets(lengths_k), max(lengths_q), max(lengths_k)), kwargs
    capacity, new_keys = rng.choice([24] + [300] * on_gpu), rng.choice([0, 1, 2])
    kwargs = dict(cache_seqlens=torch.tensor([rng.randrange(0, capacity - 2) for _ in range(batch)], dtype=torch.int32,
                                             device=device),
                  causal=rng.random() < 0.5, num_splits=rng.choice([0, 1, 3]), return_softmax_lse=rng.random() < 0.5,
                  softcap=rng.choice([0.0, 10.0]))
    if rng.random() < 0.3:
        kwargs["sinks"] = torch.randn(q_heads, device=device)
    if new_keys:
        kwargs["k"], kwargs["v"] = randn(batch, new_keys, kv_heads, head_dim), randn(batch, new_keys, kv_heads, head_dim)
    if kind == "paged":
        page_size = rng.choice([1, 3, 8])
        blocks = -(-capacity // page_size)
        pages = batch * blocks + 2
        kwargs["block_table"] = torch.randperm(pages, device=device)[:batch * blocks].reshape(batch, blocks).to(torch.int32)
        caches = randn(pages, page_size, kv_heads, head_dim), randn(pages, page_size, kv_heads, head_dim)
    else:
        caches = randn(batch, capacity, kv_heads, head_dim), randn(batch, capacity, kv_heads, head_dim)
    return kind, fmha.flash_attn_with_kvcache, (randn(batch, rng.choice([1, 2]), q_heads, head_dim), *caches), kwargs


def tensors_in(value) -> list:
    """The tensors of a result or of the arguments, in order."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in tensors_in(item)]
    if isinstance(value, dict):
        return tensors_in(list(value.values()))
    return []


def differences(eager, compiled, exact=True, what="out") -> list[str]:
    """What differs between two lists of tensors: values (NaN equal to NaN), shapes, dtypes, and
    the strides of dimensions longer than one."""
    import torch

    found = [] if len(eager) == len(compiled) else [f"{len(eager)} against {len(compiled)} {what}puts"]
    for index, (a, b) in enumerate(zip(eager, compiled)):
        if a is None or b is None:
            if (a is None) != (b is None):
                found.append(f"{what}{index}: None on one side")
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            found.append(f"{what}{index}: {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}")
        elif a.numel() and not (torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) if exact else
                                torch.allclose(a.float(), b.float(), rtol=(tolerance := max(2 * torch.finfo(a.dtype).eps, 1e-3)),
                                               atol=tolerance, equal_nan=True)):
            found.append(f"{what}{index}: values differ by up to {(a.float() - b.float()).abs().nan_to_num(0).max().item():.3g}")
        elif any(x != y for x, y, size in zip(a.stride(), b.stride(), a.shape) if size > 1):
            found.append(f"{what}{index}: strides {a.stride()} against {b.stride()}")
    return found


def check_call(rng, torch, kind, fn, args, kwargs, exact_grads) -> list[str]:
    """The call eager and compiled, on copies of its inputs: what differs (empty: nothing)."""
    def copies():
        return ([a.clone() if isinstance(a, torch.Tensor) else a for a in args],
                {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    def scalar(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    eager_args, eager_kwargs = copies()
    compiled_args, compiled_kwargs = copies()
    # ints, floats and tuples of them as arguments of the compiled function: symbolic when dynamic
    passed = {k: v for k, v in compiled_kwargs.items()
              if scalar(v) or (isinstance(v, tuple) and all(scalar(side) for side in v))}
    fixed = {k: v for k, v in compiled_kwargs.items() if k not in passed}

    def call(*call_args, **scalars):
        return fn(*call_args, **fixed, **scalars)

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, dynamic=rng.random() < 0.7)
    found = differences(tensors_in(fn(*eager_args, **eager_kwargs)), tensors_in(compiled(*compiled_args, **passed)))
    found += differences(tensors_in((eager_args, eager_kwargs)), tensors_in((compiled_args, compiled_kwargs)), what="in")
    if kind in DIFFERENTIABLE and not found and rng.random() < 0.6:
        def leaves(call_args, call_kwargs):  # q, k, v, and the sinks and a float attn_mask where given
            extra = [call_kwargs[name] for name in ("sinks", "attn_mask")
                     if isinstance(call_kwargs.get(name), torch.Tensor) and call_kwargs[name].is_floating_point()]
            return call_args[:3] + extra
        eager_leaves, compiled_leaves = leaves(eager_args, eager_kwargs), leaves(compiled_args, compiled_kwargs)
        for leaf in eager_leaves + compiled_leaves:
            leaf.requires_grad_()
        eager_out = tensors_in(fn(*eager_args, **eager_kwargs))[0]
        compiled_out = tensors_in(compiled(*compiled_args, **passed))[0]
        weights = torch.randn(eager_out.shape, device=eager_out.device).to(eager_out.dtype)
        eager_grads = torch.autograd.grad((eager_out * weights).sum(), eager_leaves, allow_unused=True)
        compiled_grads = torch.autograd.grad((compiled_out * weights).sum(), compiled_leaves, allow_unused=True)
        found += differences(list(eager_grads), list(compiled_grads), exact=exact_grads, what="grad")
    return found


def described(args, kwargs) -> str:
    import torch

    def short(value):
        return f"{tuple(value.shape)} {str(value.dtype)[6:]}" if isinstance(value, torch.Tensor) else repr(value)
    return ", ".join([short(a) for a in args] + [f"{k}={short(v)}" for k, v in kwargs.items()])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton or fmha is imported
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import torch

    import fmha

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    end, calls, failures = time.time() + args.seconds, 0, 0
    while time.time() < end:
        kind, fn, call_args, kwargs = random_call(rng, torch, fmha, args.device)
        try:
            found = check_call(rng, torch, kind, fn, call_args, kwargs, exact_grads=args.device == "cpu")
            status = "ok" if not found else "MISMATCH " + "; ".join(found)
        except Exception as error:  # every failure is reported with its call, and the run goes on
            status = f"ERROR {type(error).__name__}: {str(error).splitlines()[0][:300]}"
        calls += 1
        failures += status != "ok"
        print(f"{kind}({described(call_args, kwargs)}) -> {status}", flush=True)
    print(f"{calls} calls, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
