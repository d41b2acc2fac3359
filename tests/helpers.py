"""The shared test helpers live in :mod:`fmha.testing` (the tools and the autotuner use them too)."""

from fmha.testing import (  # noqa: F401
    assert_close_to_reference,
    assert_grads_close,
    random_qkv,
    torch_math_attention,
)


def build_report(script: str, variants) -> dict:
    """The JSON a Gluon build script prints from a child process without TRITON_INTERPRET (Gluon
    kernels cannot be built where it was set at import); the compiler's error if it fails."""
    import json
    import os
    import subprocess
    import sys

    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script, json.dumps(variants)], env=env,
                            capture_output=True, text=True, timeout=600)
    # nanobind reports leaked objects at exit; the compiler's own error is the rest.
    errors = "\n".join(line for line in result.stderr.splitlines() if "nanobind" not in line and "leaked" not in line)
    assert result.returncode == 0, errors[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
