"""Rows 2^31 elements or more apart, on the GPU: each kernel family built with WIDE_OFFSETS, held
to float64 by the error rule (tests/test_wide_offsets.py runs the portable kernels' cases under
the interpreter).

    PYTHONPATH=src python benchmarks/check_wide_offsets.py
"""

import time

import torch

import fmha
from fmha.backends.triton.config import ForwardConfig, SplitKVConfig
from fmha.testing import assert_close_to_reference, assert_grads_close

ROWS, ROW_STRIDE = 4100, 2 ** 19 + 8


def far_rows(heads, head_dim, dtype, generator):
    storage = torch.empty((ROWS - 1) * ROW_STRIDE + heads * head_dim, dtype=dtype, device="cuda")
    view = storage.as_strided((1, heads, ROWS, head_dim), (0, head_dim, ROW_STRIDE, 1))
    view.copy_(torch.randn(view.shape, generator=generator, device="cuda").to(dtype))
    return view


def portable_forward_and_backward(generator):
    k = far_rows(1, 64, torch.bfloat16, generator).requires_grad_()
    q = torch.randn(1, 2, 256, 64, generator=generator, device="cuda").bfloat16().requires_grad_()
    v = torch.randn(1, 1, ROWS, 64, generator=generator, device="cuda").bfloat16().requires_grad_()
    out = fmha.attention(q, k, v, config=ForwardConfig(64, 64, 4, 2), deterministic=True)
    assert_close_to_reference(out.detach(), q.detach(), k.detach(), v.detach())
    dout = torch.randn(out.shape, generator=generator, device="cuda").bfloat16()
    assert_grads_close(torch.autograd.grad(out, (q, k, v), dout), q.detach(), k.detach(), v.detach(), dout)


def split_kv_decode(generator):
    k = torch.randn(1, 1, ROWS, 80, generator=generator, device="cuda").half()
    v = far_rows(1, 80, torch.float16, generator)
    q = torch.randn(1, 4, 1, 80, generator=generator, device="cuda").half()
    assert isinstance(fmha.explain(q, k, v).config, SplitKVConfig)
    out, lse = fmha.attention(q, k, v, return_lse=True)
    assert_close_to_reference(out, q, k, v, lse=lse)


def hopper_backward_with_far_output_gradient(generator):
    q, k, v = (torch.randn(1, 1, ROWS, 128, generator=generator, device="cuda").bfloat16().requires_grad_()
               for _ in range(3))
    explanation = fmha.explain(q, k, v, causal=True)
    out = fmha.attention(q, k, v, causal=True)
    dout = far_rows(1, 128, torch.bfloat16, generator)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close(grads, q.detach(), k.detach(), v.detach(), dout, causal_offset=0)
    return f"{explanation.backend} / {explanation.backward.split('(')[0]}"


def hopper_varlen_forward_past_2_31(generator):
    """(tokens, 32, 128) packed queries: the last sequence starts 2^31 elements in and ends inside
    a tile, so the Gluon forward stores its rows one by one from q_start · stride."""
    lengths_q = [2 ** 31 // (32 * 128) + 24, 1000]
    lengths_k = [64, 64]
    q = torch.randn(sum(lengths_q), 32, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
    k, v = (torch.randn(sum(lengths_k), 8, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
            for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device="cuda")
                  for lengths in (lengths_q, lengths_k))
    out, lse = fmha.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), 64, return_lse=True)
    rows = slice(lengths_q[0], sum(lengths_q))
    assert_close_to_reference(out[rows].transpose(0, 1)[None], q[rows].transpose(0, 1)[None],
                              k[64:].transpose(0, 1)[None], v[64:].transpose(0, 1)[None], lse=lse[:, rows][None])
    from fmha import dispatch
    from fmha.params import varlen_params
    params = varlen_params("check", q, k, v, cu_q, cu_k, max(lengths_q), 64)
    return dispatch.prepared_forward(params, q, k, v, cu_q, cu_k).explanation.backend


def main():
    print(torch.cuda.get_device_name(), torch.__version__)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for check in (portable_forward_and_backward, split_kv_decode, hopper_backward_with_far_output_gradient,
                  hopper_varlen_forward_past_2_31):
        started = time.time()
        try:
            note = check(generator) or ""
            print(f"{check.__name__}: ok {note} ({time.time() - started:.0f} s)", flush=True)
        except Exception as error:  # each check reports on its own
            print(f"{check.__name__}: FAIL {type(error).__name__}: {str(error)[:300]}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
