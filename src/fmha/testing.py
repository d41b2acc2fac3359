"""Shared by the tests, the tools and the autotuner: inputs, the error rule and timing.

* :func:`random_qkv`: fresh normal inputs (never zeros), BHSD or BSHD storage.
* The error rule: ``max|out - float64| <= 2 * max|PyTorch same-dtype - float64| + atol``
  (:func:`assert_close_to_reference`, :func:`assert_grads_close`); NaN never passes. The output's
  default ``atol`` includes half a unit in the last place of its largest value: on a row of a few
  dozen elements PyTorch's own maximum error can fall well short of that rounding step.
* :func:`relative_error` (against float64) and :func:`time_ms` (``do_bench`` median, CUDA graphs
  for launch-bound calls).
* :func:`random_kvcache` and :func:`check_kvcache`: a ``flash_attn_with_kvcache`` call's inputs
  (contiguous or paged caches, ragged lengths) and its check against the float64 reference;
  :func:`random_paged_varlen` and :func:`check_paged_varlen` the same for
  ``flash_attn_varlen_func`` with a block table.
"""

from __future__ import annotations

import math

import torch

from .masking import Window, visible_mask, window_of
from .reference import dense_attention, kvcache_sequences, paged_varlen_sequences

# Below this, host-side launch time can show up in stream timing (the GPU waits for the CPU):
# replay a CUDA graph instead, which measures the GPU alone. The threshold is above 50 µs because
# the device's VM host takes 50-90 µs per launch.
CUDA_GRAPH_THRESHOLD_MS = 0.2


def random_qkv(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, device="cpu",
               layout="bhsd", generator=None, requires_grad=False, head_dim_v=None):
    """Fresh normal inputs; ``layout='bshd'`` returns transposed views of BSHD storage. v has
    ``head_dim_v`` features a head where given, else ``head_dim``."""

    def make(heads, seqlen, features):
        if layout == "bshd":
            tensor = torch.randn(batch, seqlen, heads, features, dtype=dtype, device=device,
                                 generator=generator).transpose(1, 2)
        else:
            tensor = torch.randn(batch, heads, seqlen, features, dtype=dtype, device=device, generator=generator)
        return tensor.requires_grad_(requires_grad)

    return (make(q_heads, seqlen_q, head_dim), make(kv_heads, seqlen_k, head_dim),
            make(kv_heads, seqlen_k, head_dim if head_dim_v is None else head_dim_v))


def half_ulp(value: float, dtype: torch.dtype) -> float:
    """Half the spacing of ``dtype``'s numbers at ``value``: the error of rounding to it."""
    if value <= 0.0 or not math.isfinite(value):
        return 0.0
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(value)) / 2


def torch_math_attention(q, k, v, *, causal_offset=None, window: Window | None = None, scale=None):
    """PyTorch's own attention (SDPA MATH backend) in the inputs' dtype.

    Rows that see no key come back NaN from SDPA; they are set to 0, the defined answer.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    window = window_of(causal_offset, window)
    mask = None if window is None else visible_mask(q.shape[2], k.shape[2], window, q.device)
    with sdpa_kernel(SDPBackend.MATH):
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
    return out.nan_to_num(0.0)


def assert_close_to_reference(out, q, k, v, *, causal_offset=None, window=None, scale=None, lse=None, atol=None,
                              lse_tol=None, roundings=1, **scores):
    """The project's error rule.

    max|out - ref64| <= 2 * max|torch_math - ref64| + atol, with ref64 the float64 truth,
    torch_math PyTorch's same-dtype attention on the same inputs. NaN never passes.
    ``scores``: score features as :func:`fmha.reference.dense_attention` takes them (softcap,
    alibi_slopes, sinks, attn_mask, dropout_p with keep); PyTorch's same-dtype attention is then
    that formula evaluated by torch in q's dtype.
    ``lse_tol``: the LSE's error bound relative to max(1, |LSE|) (1e-5 in fp32, 1e-3 in 16 bits).
    ``roundings``: half-units in the last place of the largest output that ``atol`` allows by default
    (1: the output's own rounding; a kernel that rounds once more documents why it passes 2).
    """
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "output contains NaN (unwritten or invalid elements)"
    window = window_of(causal_offset, window)
    ref, ref_lse = dense_attention(q, k, v, scale=scale, window=window, **scores)
    if scores:
        torch_out = dense_attention(q, k, v, scale=scale, window=window, dtype=q.dtype, **scores)[0]
    else:
        torch_out = torch_math_attention(q, k, v, window=window, scale=scale)
    torch_error = (torch_out.double() - ref).abs().max().item() if ref.numel() else 0.0
    error = (out.double() - ref).abs().max().item() if ref.numel() else 0.0
    if atol is None:
        largest = ref.abs().max().item() if ref.numel() else 0.0
        atol = max({torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}[q.dtype],
                   roundings * half_ulp(largest, q.dtype))
    assert error <= 2 * torch_error + atol, f"max error {error:.3g} > 2 * torch's {torch_error:.3g} + {atol:g}"
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
        assert not torch.isnan(lse).any(), "LSE contains NaN"
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "LSE -inf rows differ"
        finite = torch.isfinite(ref_lse)
        if lse_tol is None:
            lse_tol = 1e-5 if q.dtype == torch.float32 else 1e-3
        if finite.any():
            lse_error = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
            assert lse_error <= lse_tol * max(1.0, ref_lse[finite].abs().max().item()), f"LSE error {lse_error:.3g}"
    return error, torch_error


def assert_grads_close(grads, q, k, v, dout, *, causal_offset=None, window=None, scale=None, atol=None, out=None,
                       **scores):
    """The error rule for dq, dk, dv: at most 2x the error of torch's own same-dtype autograd.

    Both are measured against float64 autograd of the same formula; NaN never passes.
    ``scores``: as :func:`assert_close_to_reference`; with ``sinks``, ``grads`` may hold the sinks'
    gradient fourth (torch's same-dtype sinks gradient is taken with float32 sinks, their dtype).

    ``out``: the forward's output that the backward used. The kernels take each row's
    ``delta = rowsum(dO · O)`` from it, as FlashAttention does, so its rounding reaches the
    gradients: exactly, ``-(dO · (out - O)) · ∂LSE/∂(q, k, v, sinks)`` per row. With ``out`` that
    term, in float64, joins the bound. It matters where torch's own error vanishes: a row that sees
    one key has P = 1 and torch's dS is exactly zero, but the rounded output is not exactly V's row.
    """
    window = window_of(causal_offset, window)
    sinks = scores.pop("sinks", None)
    leaves_of = (q, k, v) if sinks is None or len(grads) == 3 else (q, k, v, sinks)

    def autograd_of(dtype, rounded_out=None):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        if len(leaves_of) == 4:
            leaves.append(sinks.detach().clone().requires_grad_())
        exact, lse = dense_attention(*leaves[:3], scale=scale, window=window, dtype=dtype,
                                     sinks=sinks if len(leaves) == 3 else leaves[3], **scores)
        grads = torch.autograd.grad(exact, leaves, dout.to(dtype), retain_graph=rounded_out is not None)
        if rounded_out is None:
            return grads, None
        # delta's change per row; rows that see nothing (LSE -inf) output zeros either way
        delta_change = (dout.to(dtype) * (rounded_out.detach().to(dtype) - exact.detach())).sum(-1)
        finite = torch.isfinite(lse)
        lse = torch.where(finite, lse, 0.0)
        shifts = torch.autograd.grad(lse, leaves, -torch.where(finite, delta_change, 0.0), allow_unused=True)
        return grads, [None if shift is None else shift.abs().max().item() if shift.numel() else 0.0
                       for shift in shifts]

    truth, rounding = autograd_of(torch.float64, out)
    same_dtype, _ = autograd_of(q.dtype)
    if atol is None:
        atol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[q.dtype]
    errors = []
    for index, (name, got, ref, torch_grad, leaf) in enumerate(
            zip(("dq", "dk", "dv", "dsinks"), grads, truth, same_dtype, leaves_of)):
        assert got.shape == leaf.shape and got.dtype == leaf.dtype, name
        assert not torch.isnan(got).any(), f"{name} contains NaN"
        error = (got.double() - ref).abs().max().item() if ref.numel() else 0.0
        torch_error = (torch_grad.double() - ref).abs().max().item() if ref.numel() else 0.0
        from_output = (rounding[index] or 0.0) if rounding is not None else 0.0
        bound = 2 * torch_error + from_output + atol
        assert error <= bound, (f"{name}: max error {error:.3g} > 2 * torch's {torch_error:.3g}"
                                + (f" + the output's rounding {from_output:.3g}" if rounding is not None else "")
                                + f" + {atol:g}")
        errors.append(error)
    return errors


def assert_sdpa_grads_close(grads, query, key, value, attn_mask, dout, out, *, enable_gqa=False, is_causal=False):
    """The error rule for SDPA's gradients: dq, dk, dv, and the attn_mask's where ``grads`` has a
    fourth, each at most 2x the error of torch's math SDPA in the inputs' dtype, both against
    float64, plus ``atol``; NaN never passes. ``out``: the output the backward used.

    The mask's bound adds the output's rounding. The backward takes delta = rowsum(dO * O) from the
    rounded output, as FlashAttention does, which moves each row's dS by -P * dO.(out - O). The mask's
    gradient sums that over the dims it broadcasts over, where torch's exact terms cancel.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    inputs = (query, key, value) + ((attn_mask,) if len(grads) == 4 else ())

    def torch_grads(dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
        mask = leaves[3] if len(leaves) == 4 else attn_mask
        with sdpa_kernel(SDPBackend.MATH):
            expected = scaled_dot_product_attention(*leaves[:3], attn_mask=mask, is_causal=is_causal,
                                                    enable_gqa=enable_gqa)
        return torch.autograd.grad(expected, leaves, dout.to(dtype))

    truth, same_dtype = torch_grads(torch.float64), torch_grads(query.dtype)
    rounding = 0.0
    if len(grads) == 4:
        q64, k64, v64, mask64 = (x.detach().double() for x in inputs)
        group = q64.shape[-3] // k64.shape[-3]
        k64, v64 = (x.repeat_interleave(group, dim=-3) for x in (k64, v64))
        probs = torch.softmax(q64 @ k64.transpose(-1, -2) / q64.shape[-1] ** 0.5 + mask64, dim=-1)
        shift = (dout.double() * (out.detach().double() - probs @ v64)).sum(-1, keepdim=True)
        rounding = (probs * shift).sum_to_size(attn_mask.shape).abs().max().item()
    atol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[query.dtype]
    for name, got, want, torch_grad, leaf in zip(("dq", "dk", "dv", "dmask"), grads, truth, same_dtype, inputs):
        assert got.shape == leaf.shape and got.dtype == leaf.dtype, name
        assert not torch.isnan(got).any(), f"{name} contains NaN"
        error = (got.double() - want).abs().max().item() if got.numel() else 0.0
        torch_error = (torch_grad.double() - want).abs().max().item() if got.numel() else 0.0
        bound = 2 * torch_error + atol + (rounding if name == "dmask" else 0.0)
        assert error <= bound, (f"{name}: max error {error:.3g} > 2 * torch's {torch_error:.3g} + {atol:g}"
                                + (f" + the output's rounding {rounding:.3g}" if name == "dmask" else ""))


def relative_error(q, k, v, out, *, causal_offset=None, window: Window | None = None, max_heads: int = 2) -> float:
    """Relative L2 error of the first heads of batch 0 against float64 (BHSD or BSHD ``out``); NaN if not finite."""
    if out.shape != q.shape:
        out = out.transpose(1, 2)
    heads = min(max_heads, q.shape[1])
    group = q.shape[1] // k.shape[1]
    kv_heads = slice(0, -(-heads // group))
    q, k, v = (t.detach() for t in (q, k, v))
    ref, _ = dense_attention(q[:1, :heads], k[:1, kv_heads], v[:1, kv_heads], window=window_of(causal_offset, window))
    got = out[:1, :heads].detach().double()
    if not torch.isfinite(got).all():
        return float("nan")
    return ((got - ref).norm() / ref.norm()).item()


def time_ms(fn) -> tuple[float, str]:
    """Median milliseconds, with CUDA-graph replay for launch-bound calls."""
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    if ms < CUDA_GRAPH_THRESHOLD_MS:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"), "cuda_graph"
    return ms, "do_bench"


def random_kvcache(batch, seqlen_q, q_heads, kv_heads, head_dim, capacity, *, new_keys=1, dtype=torch.float16,
                   device="cpu", page_size=None, rotary_dim=0, lengths=None, seed=0) -> dict:
    """Keyword arguments of a ``flash_attn_with_kvcache`` call, drawn fresh (every cache slot is
    random, so stray reads and writes show).

    ``lengths`` (default: random, leaving room for ``new_keys``) become the int32 cache_seqlens.
    With ``page_size`` the caches are pages in a shuffled block table, plus spare pages no
    sequence owns; ``rotary_dim`` adds cos/sin tables covering the cache.
    """
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    if lengths is None:
        lengths = torch.randint(0, capacity - new_keys + 1, (batch,), generator=generator)
    case = dict(q=randn(batch, seqlen_q, q_heads, head_dim),
                cache_seqlens=torch.as_tensor(lengths, dtype=torch.int32).to(device))
    if page_size is None:
        case["k_cache"], case["v_cache"] = (randn(batch, capacity, kv_heads, head_dim) for _ in range(2))
    else:
        blocks = -(-capacity // page_size)
        pages = batch * blocks + 3
        table = torch.randperm(pages, generator=generator)[:batch * blocks].reshape(batch, blocks)
        case["block_table"] = table.to(device=device, dtype=torch.int32)
        case["k_cache"], case["v_cache"] = (randn(pages, page_size, kv_heads, head_dim) for _ in range(2))
    if new_keys:
        case["k"], case["v"] = (randn(batch, new_keys, kv_heads, head_dim) for _ in range(2))
    if rotary_dim:
        rows = -(-capacity // page_size) * page_size if page_size else capacity
        angle = torch.rand(rows, rotary_dim // 2, generator=generator) * 2 * torch.pi
        case["rotary_cos"], case["rotary_sin"] = (t.to(device=device, dtype=dtype) for t in (angle.cos(), angle.sin()))
    return case


def _same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal element for element, NaN where NaN was (a cache may hold NaN in slots no sequence reads)."""
    return got.shape == expected.shape and bool(((got == expected) | (got.isnan() & expected.isnan())).all())


def check_kvcache(flash_attn_with_kvcache, case: dict, **options):
    """Run ``flash_attn_with_kvcache(**case, **options)`` (fmha's, or any with FlashAttention's API;
    the caches change in place) and hold it to the reference: the caches exactly (rotated keys
    within one rounding), and each sequence's output and LSE by the error rule. Returns ``(out, lse)``.
    Score features among the options (softcap, alibi_slopes, sinks) go to the reference too."""
    semantics = {name: options[name] for name in ("causal", "window_size", "rotary_interleaved") if name in options}
    scores = {name: options[name] for name in ("softcap", "alibi_slopes", "sinks") if options.get(name) is not None}
    if not scores.get("softcap", 1.0):  # FlashAttention's 0.0: off
        del scores["softcap"]
    k_expected, v_expected, sequences = kvcache_sequences(**case, **semantics)
    out, lse = flash_attn_with_kvcache(**case, return_softmax_lse=True, **options)
    q = case["q"]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    if "rotary_cos" in case:
        tolerance = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[q.dtype]  # one rounding
        torch.testing.assert_close(case["k_cache"], k_expected, rtol=tolerance, atol=tolerance)
    else:
        assert _same_bits(case["k_cache"], k_expected), "k_cache differs from the expected append"
    assert _same_bits(case["v_cache"], v_expected), "v_cache differs from the expected append"
    for b, (q_b, k_b, v_b, window) in enumerate(sequences):
        sequence_scores = dict(scores)
        if "alibi_slopes" in scores and scores["alibi_slopes"].ndim == 2:  # (B, Hq): this sequence's row
            sequence_scores["alibi_slopes"] = scores["alibi_slopes"][b]
        assert_close_to_reference(out[b].transpose(0, 1)[None], q_b, k_b, v_b, window=window,
                                  scale=options.get("softmax_scale"), lse=lse[b][None], **sequence_scores)
    return out, lse


def random_paged_varlen(lengths_q, lengths_k, q_heads, kv_heads, head_dim, page_size, *, dtype=torch.float16,
                        device="cpu", spare_blocks=0, seed=0) -> dict:
    """Keyword arguments of a ``flash_attn_varlen_func`` call over a paged cache, drawn fresh:
    packed q, int32 cu_seqlens, and k/v pages in a shuffled block table (plus spare pages no
    sequence owns, and ``spare_blocks`` unused entries per row); every page slot is random."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    def offsets(lengths):
        return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()],
                            dtype=torch.int32, device=device)

    batch = len(lengths_q)
    blocks = max(1, -(-max(lengths_k, default=0) // page_size)) + spare_blocks
    pages = batch * blocks + 3
    table = torch.randperm(pages, generator=generator)[:batch * blocks].reshape(batch, blocks)
    return dict(q=randn(sum(lengths_q), q_heads, head_dim), k=randn(pages, page_size, kv_heads, head_dim),
                v=randn(pages, page_size, kv_heads, head_dim), cu_seqlens_q=offsets(lengths_q),
                cu_seqlens_k=offsets(lengths_k), max_seqlen_q=max(lengths_q, default=0),
                max_seqlen_k=max(lengths_k, default=0), block_table=table.to(device=device, dtype=torch.int32))


def check_paged_varlen(flash_attn_varlen_func, case: dict, **options):
    """Run ``flash_attn_varlen_func(**case, **options)`` with a block table and hold each sequence's
    output and LSE to the float64 reference by the error rule; the pages must not change.
    Returns ``(out, lse)``."""
    semantics = {name: options[name] for name in ("causal", "window_size") if name in options}
    scores = {name: options[name] for name in ("softcap", "alibi_slopes") if options.get(name) is not None}
    if not scores.get("softcap", 1.0):  # FlashAttention's 0.0: off
        del scores["softcap"]
    pages = case["k"].clone(), case["v"].clone()
    out, lse, _ = flash_attn_varlen_func(**case, return_attn_probs=True, **options)
    q = case["q"]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert torch.equal(case["k"], pages[0]) and torch.equal(case["v"], pages[1]), "the pages changed"
    starts = case["cu_seqlens_q"].tolist()
    sequences = paged_varlen_sequences(q, case["k"], case["v"], case["cu_seqlens_q"], case["cu_seqlens_k"],
                                       case["block_table"], **semantics)
    for b, (q_b, k_b, v_b, window) in enumerate(sequences):
        rows = slice(starts[b], starts[b + 1])
        sequence_scores = dict(scores)
        if "alibi_slopes" in scores and scores["alibi_slopes"].ndim == 2:  # (B, Hq): this sequence's row
            sequence_scores["alibi_slopes"] = scores["alibi_slopes"][b]
        assert_close_to_reference(out[rows].transpose(0, 1)[None], q_b, k_b, v_b, window=window,
                                  scale=options.get("softmax_scale"), lse=lse[:, rows][None], **sequence_scores)
    return out, lse
