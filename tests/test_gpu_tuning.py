"""The autotuner on a GPU (marker ``gpu``): FMHA_AUTOTUNE=1 searches a missing key once and stores it."""

import pytest
import torch

import fmha
from fmha.tuning import lookup, store
from fmha.tuning.key import ShapeKey, device_key

from .helpers import assert_close_to_reference, random_qkv

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
