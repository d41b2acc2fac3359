"""The autotuner without a GPU: keys, pruning rules, the cache file and the lookup order."""

import json
import multiprocessing
import warnings

import pytest
import torch

from fmha.config import ForwardConfig
from fmha.tuning import lookup, store
from fmha.tuning.key import ShapeKey, length_bucket
from fmha.tuning.space import (
    PRUNING_RULES,
    Problem,
    all_candidates,
    prune,
    rule_block_m_within_query,
    rule_full_mma_rows,
    rule_register_pressure,
    rule_rows_per_warp,
    rule_shared_memory,
    shared_memory_bytes,
)


@pytest.mark.parametrize("length, bucket", [(0, 1), (1, 1), (2, 2), (3, 4), (1000, 1024), (1024, 1024),
                                            (1025, 2048), (16384, 16384)])
def test_length_buckets_are_powers_of_two(length, bucket):
    assert length_bucket(length) == bucket


def test_batch_and_head_count_share_a_key_but_lengths_and_gqa_do_not():
    def key(batch, q_heads, kv_heads, seqlen_q, seqlen_k):
        del batch  # not part of the key at all
        return ShapeKey.of("fwd", torch.bfloat16, 128, True, q_heads, kv_heads, seqlen_q, seqlen_k)

    assert key(3, 16, 16, 1000, 1000) == key(4, 16, 16, 1000, 1000) == key(4, 32, 32, 1024, 1024)
    assert key(4, 16, 16, 1000, 1000) != key(4, 16, 16, 1025, 1000)
    assert key(4, 16, 4, 1000, 1000) != key(4, 16, 16, 1000, 1000)
    text = key(1, 8, 2, 17, 300).text()
    assert text == "fwd|bfloat16|d128|causal|g4|q32|k512"
    assert ShapeKey.parse(text) == key(1, 8, 2, 17, 300)


PROBLEM = Problem(head_dim=128, element_size=2, seqlen_q=4096, shared_memory=227 * 1024)


def test_rule_shared_memory_uses_the_device_budget():
    config = ForwardConfig(128, 128, 8, 4)
    needed = shared_memory_bytes(config, PROBLEM)
    assert needed == 128 * 128 * 2 + 2 * 4 * 128 * 128 * 2
    assert rule_shared_memory(config, PROBLEM) is not None  # 288 KiB > 227 KiB
    assert rule_shared_memory(ForwardConfig(128, 64, 8, 3), PROBLEM) is None
    small_gpu = Problem(128, 2, 4096, shared_memory=100 * 1024)
    assert "shared memory" in rule_shared_memory(ForwardConfig(128, 64, 8, 3), small_gpu)


def test_rule_register_pressure_grows_with_head_dim():
    config = ForwardConfig(128, 64, 4, 2)
    assert rule_register_pressure(config, Problem(64, 2, 4096)) is None
    assert "spills" in rule_register_pressure(config, Problem(128, 2, 4096))
    assert rule_register_pressure(ForwardConfig(128, 64, 8, 2), Problem(256, 2, 4096)) is None
    assert rule_register_pressure(ForwardConfig(128, 128, 8, 2), Problem(256, 2, 4096)) is not None


def test_rule_block_m_within_query():
    assert rule_block_m_within_query(ForwardConfig(64, 64, 4, 2), Problem(64, 2, 20)) is not None  # bucket 32
    assert rule_block_m_within_query(ForwardConfig(64, 64, 4, 2), Problem(64, 2, 33)) is None
    assert rule_block_m_within_query(ForwardConfig(16, 64, 1, 2), Problem(64, 2, 1)) is None


def test_rules_on_rows_per_warp_and_mma_rows():
    assert rule_rows_per_warp(ForwardConfig(64, 64, 8, 2), PROBLEM) is not None  # 8 rows a warp
    assert rule_rows_per_warp(ForwardConfig(256, 64, 4, 2), PROBLEM) is not None  # 64 rows a warp
    assert rule_rows_per_warp(ForwardConfig(128, 64, 8, 2), PROBLEM) is None
    assert rule_full_mma_rows(ForwardConfig(32, 64, 1, 2), PROBLEM) is not None
    assert rule_full_mma_rows(ForwardConfig(32, 64, 1, 2), Problem(128, 2, 32)) is None


def test_every_key_keeps_candidates_and_each_drop_has_a_reason():
    for head_dim in (32, 64, 96, 128, 192, 256):
        for seqlen_q in (1, 17, 128, 1000, 16384):
            kept, dropped = prune(all_candidates(), Problem(head_dim, 2, seqlen_q))
            assert kept, (head_dim, seqlen_q)
            assert len(kept) + len(dropped) == len(all_candidates())
            rule_names = {rule.__doc__ for rule in PRUNING_RULES}
            assert all(rule in rule_names and reason for rule, reason in dropped.values())


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path))
    lookup.forget()
    yield tmp_path
    lookup.forget()


def test_cache_round_trip(cache_dir):
    record = store.config_to_record(ForwardConfig(64, 32, 4, 2), tflops=123.4)
    store.store("GPU|sm_90|triton 3.6.0|fmha 0.1.0", {"fwd|bfloat16|d64|full|g1|q1024|k1024": record})
    entries = store.load()
    saved = entries["GPU|sm_90|triton 3.6.0|fmha 0.1.0"]["fwd|bfloat16|d64|full|g1|q1024|k1024"]
    assert store.record_to_config(saved) == ForwardConfig(64, 32, 4, 2) and saved["tflops"] == 123.4
    data = json.loads((cache_dir / "tuning.json").read_text())
    assert data["format"] == store.FORMAT


def _write_many(args):
    cache, worker = args
    import os

    os.environ["FMHA_CACHE_DIR"] = cache
    from fmha.config import ForwardConfig as Config
    from fmha.tuning import store as tuning_store

    for index in range(25):
        record = tuning_store.config_to_record(Config(64, 64, 4, 2), worker=worker)
        tuning_store.store("GPU", {f"fwd|float16|d64|full|g1|q{index}|k{worker}": record})


def test_concurrent_writers_lose_nothing(cache_dir):
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        pool.map(_write_many, [(str(cache_dir), 1), (str(cache_dir), 2)])
    entries = store.load()["GPU"]
    assert len(entries) == 50
    assert {record["worker"] for record in entries.values()} == {1, 2}


@pytest.mark.parametrize("content", ["{truncated", "[1, 2]", json.dumps({"format": "fmha-tuning/0", "entries": {}})])
def test_corrupt_or_foreign_cache_is_ignored_with_a_warning_and_rewritten(cache_dir, content):
    path = cache_dir / "tuning.json"
    path.write_text(content)
    with pytest.warns(UserWarning, match="tuning cache"):
        assert store.load() == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # storing over a bad file is silent and repairs it
        store.store("GPU", {"fwd|float16|d64|full|g1|q1|k1": store.config_to_record(ForwardConfig(16, 32, 1, 2))})
    assert list(store.load()) == ["GPU"]


def test_shipped_defaults_exact_and_nearest():
    gpu = "NVIDIA H100 80GB HBM3"
    exact = ShapeKey.of("fwd", torch.bfloat16, 128, True, 16, 16, 1024, 1024)
    assert lookup.shipped_config(gpu, exact) is not None
    nearby = ShapeKey.of("fwd", torch.bfloat16, 128, True, 16, 16, 2048, 2048)
    assert lookup.shipped_config(gpu, nearby) is not None
    # A neighbour whose tile is longer than this query is not used.
    short = ShapeKey.of("fwd", torch.bfloat16, 128, False, 16, 16, 17, 1024)
    assert lookup.shipped_config(gpu, short) is None
    assert lookup.shipped_config("Some Other GPU", exact) is None
    assert lookup.shipped_config(gpu, ShapeKey.of("fwd", torch.float16, 80, False, 1, 1, 64, 64)) is None


def test_shipped_defaults_hold_valid_configs():
    data = json.loads(lookup.SHIPPED_DEFAULTS.read_text())
    assert data["format"] == lookup.DEFAULTS_FORMAT
    assert "NVIDIA H100 80GB HBM3" in data["gpus"]
    for gpu, section in data["gpus"].items():
        for text, record in section["entries"].items():
            ShapeKey.parse(text)
            assert store.record_to_config(record) is not None, (gpu, text)


def test_interpreter_pins_one_small_config():
    from fmha.config import INTERPRETER_FORWARD_CONFIG
    from fmha.launch import INTERPRETED

    if not INTERPRETED:
        pytest.skip("CPU interpreter only")
    assert INTERPRETER_FORWARD_CONFIG == ForwardConfig(16, 16, 1, 1)


def test_tune_dry_run_lists_pruned_candidates_without_a_gpu(capsys):
    from fmha.cli import main

    assert main(["tune", "--dry-run", "--suite", "seeds"]) == 0
    text = capsys.readouterr().out
    assert "fwd|bfloat16|d64|full|g1|q1024|k1024" in text and "fwd|bfloat16|d64|full|g1|q2048|k2048" in text
    assert "candidates" in text and "pruned" in text and "128×64 w8 s3" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_tune_without_gpu_says_so(capsys):
    from fmha.cli import main

    assert main(["tune", "--suite", "seeds"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
