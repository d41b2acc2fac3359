"""The shared test helpers live in :mod:`fmha.testing` (the tools and the autotuner use them too)."""

import inspect

from fmha.testing import (  # noqa: F401
    assert_close_to_reference,
    assert_grads_close,
    assert_sdpa_grads_close,
    random_qkv,
    torch_math_attention,
)


def spills_in_product_loops(sass: str, unmasked_only: bool = False) -> int:
    """Local-memory loads and stores inside the innermost loops that issue warpgroup MMAs (a
    kernel's key blocks or query steps), found from the backward branches of a SASS listing; with
    ``unmasked_only``, in those that select no scores (FSEL: a mask's). The Gluon build scripts run
    it in their child process (:data:`SASS_LOOP_SPILLS`)."""
    import re

    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    loops = []
    for index, (address, text) in enumerate(lines):
        branch = re.search(r"BRA (0x[0-9a-f]+)", text) if "BRA" in text else None
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            first = index  # the listing runs in address order: walk back to the branch's target
            while first > 0 and lines[first - 1][0] >= start:
                first -= 1
            body = [t for _, t in lines[first:index + 1]]
            if any("HGMMA" in t for t in body) and not (unmasked_only and any(t.startswith("FSEL") for t in body)):
                loops.append((start, address, body))
    innermost = [body for start, end, body in loops
                 if not any(start <= s and e <= end and (s, e) != (start, end) for s, e, _ in loops)]
    return sum(t.startswith(("STL", "LDL")) for body in innermost for t in body)


def build_report(script: str, variants) -> dict:
    """The JSON a Gluon build script prints from a child process without TRITON_INTERPRET (Gluon
    kernels cannot be built where it was set at import); the compiler's error if it fails."""
    import json
    import os
    import subprocess
    import sys

    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    # On CI's two cores, beside another test file, the forward's ~70 builds took 400 s to past 600.
    result = subprocess.run([sys.executable, "-c", script, json.dumps(variants)], env=env,
                            capture_output=True, text=True, timeout=1800)
    # nanobind reports leaked objects at exit; the compiler's own error is the rest.
    errors = "\n".join(line for line in result.stderr.splitlines() if "nanobind" not in line and "leaked" not in line)
    assert result.returncode == 0, errors[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# :func:`spills_in_product_loops` as source, for the build scripts' child processes.
SASS_LOOP_SPILLS = inspect.getsource(spills_in_product_loops)


def sliding_window_model(kind: str, **shape):
    """A float32 model with sliding-window layers, random weights (transformers imported here, so
    that files without it still import this module): Mistral (every layer sliding), Gemma 2 (sliding
    and full layers, softcap 50) or gpt-oss (sliding and full layers, sinks drawn from a normal, as
    the model starts them at zero). ``shape``: the config's sizes, ``sliding_window`` included."""
    import torch
    import transformers

    torch.manual_seed(0)
    if kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**shape))
    elif kind == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**shape, attn_logit_softcapping=50.0,
                                                                         final_logit_softcapping=None))
    else:
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**shape, num_local_experts=4,
                                                                         num_experts_per_tok=2))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
    return model.float().eval()
