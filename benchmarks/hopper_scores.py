"""Score features on the Hopper kernels: the scores issue's cases, forward and forward+backward, each
beside the same shape without the feature, on fmha's default path, on the portable kernels (an
explicit portable config), and on Gluon forward schedules that move exponentials to the FMA units.

    PYTHONPATH=src python benchmarks/hopper_scores.py out.json

TFLOP/s count visible (query, key) pairs: 4·D per pair forward, ×3.5 forward+backward. The
peers (SDPA cuDNN, no softcap/ALiBi/sinks there) time the plain shape in the same run.
"""

import json
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

import fmha
from fmha import dispatch
from fmha.backends.gluon_sm90 import launch
from fmha.testing import time_ms

# (name, B, H, S, D, feature keyword arguments): causal, bf16.
CASES = [("plain D128", 4, 16, 4096, 128, {}), ("softcap 30", 4, 16, 4096, 128, {"softcap": 30.0}),
         ("ALiBi", 4, 16, 4096, 128, {"alibi": True}), ("plain D64", 4, 16, 4096, 64, {}),
         ("sinks", 4, 16, 4096, 64, {"sinks": True})]
PORTABLE = fmha.ForwardConfig(128, 64, 8, 2)  # the portable kernel's 128x64 tiles (triton_heuristic's)
SOFTCAP_SCHEDULES = [fmha.HopperSchedule(persistent=False, emulated_exp2=e) for e in (0, 2, 4, 8)]


def feature_tensors(heads, kwargs, device="cuda"):
    out = {}
    if "softcap" in kwargs:
        out["softcap"] = kwargs["softcap"]
    if kwargs.get("alibi"):
        out["alibi_slopes"] = torch.exp2(-8.0 * torch.arange(1, heads + 1, device=device) / heads)
    if kwargs.get("sinks"):
        out["sinks"] = torch.randn(heads, device=device).requires_grad_()
    return out


def two_sided_alibi(q, k, v, features):
    """Prepare these calls' forwards with ALiBi's general form (|pos(i) - j|), not the causal one."""
    general = launch.ScoreFeatures.of
    original = launch.ScoreFeatures.forward_of
    launch.ScoreFeatures.forward_of = classmethod(lambda cls, params: general(params.options))
    try:
        dispatch.forget()
        for tensors in ((q, k, v), [t.detach() for t in (q, k, v)]):
            fmha.attention(*tensors, causal=True, **features)
    finally:
        launch.ScoreFeatures.forward_of = original


def kernel_times(fn) -> dict[str, float]:
    """Microseconds per kernel of one call (torch.profiler), the longest first."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize()
    times = {}
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:60]] = times.get(event.name[:60], 0.0) + event.device_time
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def main(path):
    rows = []
    for name, batch, heads, s, d, kwargs in CASES:
        q, k, v = (torch.randn(batch, heads, s, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        dout = torch.randn_like(q)
        features = feature_tensors(heads, kwargs)
        flops = 4 * d * batch * heads * s * (s + 1) // 2
        providers = {"fmha": {}, "portable": {"config": PORTABLE}}
        if "softcap" in kwargs:
            providers.update({f"gluon {schedule.text()}": {"config": schedule} for schedule in SOFTCAP_SCHEDULES})
        if kwargs.get("alibi"):
            providers["gluon, ALiBi's two-sided form"] = {"two_sided_alibi": True}
        inference = [t.detach() for t in (q, k, v)]  # the forward alone is timed without autograd
        calls = {}
        for provider, extra in providers.items():
            extra = dict(extra)

            def forward(extra=extra):
                return fmha.attention(*inference, causal=True, **features, **extra)

            def forward_backward(extra=extra):
                torch.autograd.backward(fmha.attention(q, k, v, causal=True, **features, **extra), dout)

            calls[provider] = (forward, forward_backward, extra.pop("two_sided_alibi", False),
                               fmha.explain(q, k, v, causal=True, **features, **extra))
        if not kwargs:
            def cudnn(q=q, k=k, v=v):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return scaled_dot_product_attention(q, k, v, is_causal=True)

            calls["sdpa_cudnn"] = (lambda: cudnn(*inference), lambda: torch.autograd.backward(cudnn(), dout), False,
                                   None)
        for provider, (forward, forward_backward, two_sided, explanation) in calls.items():
            if two_sided:
                two_sided_alibi(q, k, v, features)
            forward_backward()  # compile first
            time_ms(forward_backward)  # the clocks settle on this case
            fwd_ms, _ = time_ms(forward)
            both_ms, _ = time_ms(forward_backward)
            if two_sided:
                dispatch.forget()  # later calls prepare the default form again
            row = {"case": name, "provider": provider, "fwd_ms": fwd_ms, "fwdbwd_ms": both_ms,
                   "fwd_tflops": flops / fwd_ms / 1e9, "fwdbwd_tflops": 3.5 * flops / both_ms / 1e9}
            if explanation is not None:
                row["runs"] = f"{explanation.backend}; backward {explanation.backward}"
            if provider == "fmha" and (kwargs.get("sinks") or name == "plain D64"):
                row["kernels_us"] = kernel_times(forward_backward)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "rows": rows}
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
