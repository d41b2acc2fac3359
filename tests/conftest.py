"""Test setup.

Without a CUDA device the kernels run under Triton's interpreter: TRITON_INTERPRET
must be set before triton (and so fmha) is imported, which is why it happens here.
Every floating-point ``torch.empty``/``torch.empty_like`` is filled with NaN, so an
output element a kernel forgets to write fails the comparison instead of passing as 0.
Each test draws its random inputs from a seed made from its own name, so a failure reproduces
whatever ran before it, in any worker.
"""

import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fmha.runtime import INTERPRETED  # noqa: E402

_torch_empty = torch.empty
_torch_empty_like = torch.empty_like


def _poisoned(tensor):
    if tensor.is_floating_point():
        with torch.no_grad():  # torch.compile's own allocations can be leaves that require grad
            tensor.fill_(float("nan"))
    return tensor


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: _poisoned(_torch_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: _poisoned(_torch_empty_like(*a, **kw)))


@pytest.fixture(autouse=True)
def seed_from_test_name(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device and the compiled (not interpreted) kernels")
    skip_interpreter = pytest.mark.skip(reason="CPU kernel tests need TRITON_INTERPRET=1 (set when no CUDA)")
    for item in items:
        if "gpu" in item.keywords and (INTERPRETED or not torch.cuda.is_available()):
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not INTERPRETED:
            item.add_marker(skip_interpreter)
