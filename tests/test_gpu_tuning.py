"""The autotuner on a GPU (marker ``gpu``): FMHA_AUTOTUNE=1 searches a missing key once and stores it."""

import pytest
import torch

import fmha
from fmha.backends.triton.config import BackwardConfig
from fmha.tuning import lookup, store
from fmha.tuning.key import ShapeKey, device_key

from .helpers import assert_close_to_reference, assert_grads_close, random_qkv

pytestmark = pytest.mark.gpu


def test_autotune_searches_a_missing_key_once_and_stores_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path))
    lookup.forget()
    # fp16 at D=80 ships no default, so the lookup would fall back to the heuristic.
    q, k, v = random_qkv(2, 8, 2, 300, 700, 80, torch.float16, device="cuda")
    shape = ShapeKey.of("fwd", torch.float16, 80, True, 8, 2, 300, 700)
    assert lookup.explain_forward_config("cuda", torch.float16, 80, True, 8, 2, 300, 700)[1] == "heuristic"
    monkeypatch.setenv("FMHA_AUTOTUNE", "1")
    out = fmha.attention(q, k, v, causal=True)
    assert_close_to_reference(out, q, k, v, causal_offset=400)
    record = store.load()[device_key()][shape.text()]
    assert record["tflops"] > 0
    lookup.forget()
    config, source = lookup.explain_forward_config("cuda", torch.float16, 80, True, 8, 2, 300, 700)
    assert source == "cache" and config == store.record_to_config(record)
    lookup.forget()


def test_backward_autotune_searches_a_missing_key_once_and_stores_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path))
    lookup.forget()
    q, k, v = random_qkv(2, 8, 2, 300, 700, 80, torch.float16, device="cuda")
    shape = ShapeKey.of("bwd", torch.float16, 80, True, 8, 2, 300, 700)
    assert lookup.explain_backward_config("cuda", torch.float16, 80, True, 8, 2, 300, 700)[1] == "heuristic"
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fmha.attention(*leaves, causal=True)  # the forward's key is resolved before autotuning is on
    monkeypatch.setenv("FMHA_AUTOTUNE", "1")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    assert_grads_close(grads, q, k, v, dout, causal_offset=400)
    entries = store.load()[device_key()]
    assert entries[shape.text()]["tflops"] > 0
    assert ShapeKey.of("fwd", torch.float16, 80, True, 8, 2, 300, 700).text() not in entries
    lookup.forget()
    config, source = lookup.explain_backward_config("cuda", torch.float16, 80, True, 8, 2, 300, 700)
    assert source == "cache" and config == store.record_to_config(entries[shape.text()], BackwardConfig)
    assert isinstance(config, BackwardConfig)
    lookup.forget()


def test_underfilled_grid_gets_narrow_query_tiles():
    from fmha.params import attention_params
    from fmha.tuning.lookup import UNDERFILLED_GRID_CONFIG, portable_config

    small = torch.empty(1, 16, 1024, 64, device="cuda", dtype=torch.bfloat16)
    large = torch.empty(8, 16, 1024, 64, device="cuda", dtype=torch.bfloat16)
    assert portable_config(attention_params("test", small, small, small))[0] == UNDERFILLED_GRID_CONFIG
    assert portable_config(attention_params("test", large, large, large))[0] != UNDERFILLED_GRID_CONFIG
