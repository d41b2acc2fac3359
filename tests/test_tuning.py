"""The autotuner without a GPU: keys, pruning rules, the cache file and the lookup order."""

import json
import multiprocessing
import warnings

import pytest
import torch

from fmha.backends.triton.config import BackwardConfig, ForwardConfig, heuristic_backward_config
from fmha.tuning import lookup, store
from fmha.tuning.key import ShapeKey, length_bucket
from fmha.tuning.space import (
    BACKWARD_PRUNING_RULES,
    PRUNING_RULES,
    SPACES,
    Problem,
    all_candidates,
    backward_shared_memory_bytes,
    prune,
    rule_backward_register_pressure,
    rule_backward_shared_memory,
    rule_backward_tiles_within_sequences,
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
    from fmha.backends.triton.config import ForwardConfig as Config
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
            config_class = SPACES[ShapeKey.parse(text).kernel].config_class
            assert isinstance(store.record_to_config(record, config_class), config_class), (gpu, text)


def test_interpreter_pins_one_small_config():
    from fmha.backends.triton.config import INTERPRETER_FORWARD_CONFIG
    from fmha.runtime import INTERPRETED

    if not INTERPRETED:
        pytest.skip("CPU interpreter only")
    assert INTERPRETER_FORWARD_CONFIG == ForwardConfig(16, 16, 1, 1)


def test_tune_dry_run_lists_pruned_candidates_without_a_gpu(capsys):
    from fmha.tools.cli import main

    assert main(["tune", "--dry-run", "--suite", "seeds"]) == 0
    text = capsys.readouterr().out
    assert "fwd|bfloat16|d64|full|g1|q1024|k1024" in text and "fwd|bfloat16|d64|full|g1|q2048|k2048" in text
    assert "candidates" in text and "pruned" in text and "128×64 w8 s3" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_tune_without_gpu_says_so(capsys):
    from fmha.tools.cli import main

    assert main(["tune", "--suite", "seeds"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


# The backward: its own space, rules and keys, looked up like the forward's.


def test_backward_keys_are_separate_from_forward_keys():
    forward = ShapeKey.of("fwd", torch.bfloat16, 128, True, 8, 2, 17, 300)
    backward = ShapeKey.of("bwd", torch.bfloat16, 128, True, 8, 2, 17, 300)
    assert backward != forward and backward.text() == "bwd|bfloat16|d128|causal|g4|q32|k512"
    assert ShapeKey.parse(backward.text()) == backward


def test_backward_space_is_resident_by_streamed_by_warps_by_stages():
    candidates = SPACES["bwd"].all_candidates()
    assert len(candidates) == 3 * 4 * 2 * 3 and all(type(c) is BackwardConfig for c in candidates)
    assert {c.block_n for c in candidates} == {32, 64, 128} and {c.block_m for c in candidates} == {16, 32, 64, 128}


def test_rule_backward_shared_memory_counts_resident_and_streamed_tiles():
    config = BackwardConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
    # K and V resident; Q, dO, LSE and delta for each of the 3 stages.
    assert backward_shared_memory_bytes(config, PROBLEM) == 2 * 128 * 128 * 2 + 3 * 128 * (2 * 128 * 2 + 8)
    assert "shared memory" in rule_backward_shared_memory(config, PROBLEM)  # 259 KiB > 227 KiB
    assert rule_backward_shared_memory(BackwardConfig(64, 128, 8, 3), PROBLEM) is None
    small_gpu = Problem(128, 2, 4096, shared_memory=100 * 1024)
    assert rule_backward_shared_memory(BackwardConfig(64, 128, 8, 3), small_gpu) is not None


def test_rule_backward_register_pressure_counts_two_accumulators():
    # dK and dV (64 x 128 fp32 each) and two 64 x 64 tiles over 128 threads: 192 values, the limit.
    assert rule_backward_register_pressure(BackwardConfig(64, 64, 4, 2), PROBLEM) is None
    assert "spills" in rule_backward_register_pressure(BackwardConfig(128, 64, 4, 2), PROBLEM)
    assert rule_backward_register_pressure(BackwardConfig(128, 64, 8, 2), PROBLEM) is None
    assert rule_backward_register_pressure(BackwardConfig(16, 128, 4, 1), PROBLEM) is not None
    assert rule_backward_register_pressure(BackwardConfig(32, 128, 4, 1), Problem(64, 2, 4096)) is None
    assert rule_backward_register_pressure(BackwardConfig(64, 128, 4, 1), Problem(64, 2, 4096)) is not None
    assert rule_backward_register_pressure(BackwardConfig(32, 32, 4, 1), Problem(256, 2, 4096)) is None


def test_rule_backward_tiles_within_sequences():
    rule = rule_backward_tiles_within_sequences
    assert "BLOCK_N" in rule(BackwardConfig(16, 64, 4, 1), Problem(64, 2, 4096, seqlen_k=20))  # key bucket 32
    assert "BLOCK_M" in rule(BackwardConfig(64, 32, 4, 1), Problem(64, 2, 20, seqlen_k=4096))  # query bucket 32
    assert rule(BackwardConfig(64, 128, 4, 1), Problem(64, 2, 33, seqlen_k=100)) is None
    # The smallest tiles stay for the shortest sequences; without seqlen_k the keys are as long as the query.
    assert rule(BackwardConfig(16, 32, 4, 1), Problem(64, 2, 1, seqlen_k=1)) is None
    assert rule(BackwardConfig(16, 64, 4, 1), Problem(64, 2, 20)) is not None


def test_every_backward_key_keeps_candidates_and_each_drop_has_a_reason():
    rule_names = {rule.__doc__ for rule in BACKWARD_PRUNING_RULES}
    space = SPACES["bwd"]
    for head_dim in (32, 64, 96, 128, 192, 256):
        for seqlen_q, seqlen_k in ((1, 1), (17, 300), (128, 128), (1000, 1000), (16384, 16384)):
            kept, dropped = space.prune(space.all_candidates(), Problem(head_dim, 2, seqlen_q, seqlen_k=seqlen_k))
            assert kept, (head_dim, seqlen_q, seqlen_k)
            assert len(kept) + len(dropped) == len(space.all_candidates())
            assert all(rule in rule_names and reason for rule, reason in dropped.values())


@pytest.mark.parametrize("shared_memory", [0, 99 * 1024, 163 * 1024, 227 * 1024])  # none known, sm_86, A100, H100
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [16, 32, 40, 64, 80, 96, 128, 192, 256])
def test_heuristic_backward_configs_survive_pruning(dtype, head_dim, shared_memory):
    heuristic = heuristic_backward_config(head_dim, dtype, shared_memory)
    element_size = torch.empty((), dtype=dtype).element_size()
    for seqlen in (128, 1000, 4096, 16384):
        problem = Problem(head_dim, element_size, seqlen, shared_memory or 99 * 1024, seqlen_k=seqlen)
        kept, dropped = prune([heuristic], problem, BACKWARD_PRUNING_RULES)
        assert kept == [heuristic], dropped


def test_wide_heads_take_the_wide_backward_tiles_where_shared_memory_holds_them():
    from fmha.backends.triton.config import WIDE_HEAD_BACKWARD_CONFIG, backward_shared_bytes

    needed = backward_shared_bytes(WIDE_HEAD_BACKWARD_CONFIG, 256, 2)
    assert needed == 2 * 32 * 256 * 2 + 2 * 64 * (2 * 256 * 2 + 8)  # Triton's own count on the H200
    assert heuristic_backward_config(256, torch.bfloat16, needed) == WIDE_HEAD_BACKWARD_CONFIG
    assert heuristic_backward_config(192, torch.float16, 227 * 1024) == WIDE_HEAD_BACKWARD_CONFIG
    assert heuristic_backward_config(256, torch.bfloat16, needed - 1) == BackwardConfig(32, 32, 4, 1)
    assert heuristic_backward_config(256, torch.float32, 227 * 1024) == BackwardConfig(16, 16, 4, 1)
    assert heuristic_backward_config(128, torch.bfloat16, 227 * 1024) == BackwardConfig(64, 64, 4, 2)


FAKE_GPU = "Fake GPU"
FAKE_DEVICE = "Fake GPU|sm_90|triton 3.6.0|fmha 0.1.0"


@pytest.fixture
def fake_gpu(cache_dir, tmp_path, monkeypatch):
    """The lookup on CPU tensors: a named GPU with its own shipped defaults file."""
    monkeypatch.setattr(lookup, "device_key", lambda device=None: FAKE_DEVICE)
    monkeypatch.setattr(lookup, "gpu_name", lambda device=None: FAKE_GPU)
    shipped = {
        "bwd|float16|d64|full|g1|q1024|k1024": store.config_to_record(BackwardConfig(32, 128, 8, 2), tflops=1.0),
        "bwd|float16|d64|causal|g1|q64|k64": store.config_to_record(BackwardConfig(64, 64, 4, 1), tflops=1.0),
        "fwd|float16|d128|full|g1|q1024|k1024": store.config_to_record(ForwardConfig(64, 32, 4, 3), tflops=1.0),
    }
    path = tmp_path / "defaults.json"
    path.write_text(json.dumps({"format": lookup.DEFAULTS_FORMAT, "gpus": {FAKE_GPU: {"entries": shipped}}}))
    monkeypatch.setattr(lookup, "SHIPPED_DEFAULTS", path)
    lookup.forget()
    yield path
    lookup.forget()


def test_backward_shipped_defaults_exact_and_nearest(fake_gpu):
    exact = lookup.shipped_config(FAKE_GPU, ShapeKey.of("bwd", torch.float16, 64, False, 16, 16, 1000, 1000))
    assert exact == BackwardConfig(32, 128, 8, 2) and type(exact) is BackwardConfig
    nearby = ShapeKey.of("bwd", torch.float16, 64, False, 16, 16, 4096, 4096)
    assert lookup.shipped_config(FAKE_GPU, nearby) == BackwardConfig(32, 128, 8, 2)
    # A neighbour whose resident tile is longer than these keys is not used.
    assert lookup.shipped_config(FAKE_GPU, ShapeKey.of("bwd", torch.float16, 64, False, 1, 1, 1024, 40)) is None
    # Forward entries never answer a backward key, nor the other way round.
    assert lookup.shipped_config(FAKE_GPU, ShapeKey.of("bwd", torch.float16, 128, False, 1, 1, 1024, 1024)) is None
    assert lookup.shipped_config(FAKE_GPU, ShapeKey.of("fwd", torch.float16, 64, False, 1, 1, 1024, 1024)) is None


def test_backward_cache_round_trip_comes_back_as_backward_config(fake_gpu):
    text = ShapeKey.of("bwd", torch.float16, 80, True, 8, 2, 300, 700).text()
    store.store(FAKE_DEVICE, {text: store.config_to_record(BackwardConfig(16, 64, 4, 3), tflops=12.5)})
    saved = store.load()[FAKE_DEVICE][text]
    assert saved["tflops"] == 12.5
    config = store.record_to_config(saved, BackwardConfig)
    assert config == BackwardConfig(16, 64, 4, 3) and type(config) is BackwardConfig
    config, source = lookup.explain_backward_config("cpu", torch.float16, 80, True, 8, 2, 300, 700)
    assert source == "cache" and config == BackwardConfig(16, 64, 4, 3) and type(config) is BackwardConfig
    # The forward key of the same shape is not affected.
    assert lookup.explain_forward_config("cpu", torch.float16, 80, True, 8, 2, 300, 700)[1] == "heuristic"


def test_backward_lookup_order_cache_then_shipped_then_heuristic(fake_gpu):
    shape = ("cpu", torch.float16, 64, False, 16, 16, 1024, 1024)
    assert lookup.explain_backward_config(*shape) == (BackwardConfig(32, 128, 8, 2), "shipped")
    record = store.config_to_record(BackwardConfig(64, 32, 8, 1))
    store.store(FAKE_DEVICE, {"bwd|float16|d64|full|g1|q1024|k1024": record})
    lookup.forget()
    assert lookup.explain_backward_config(*shape) == (BackwardConfig(64, 32, 8, 1), "cache")
    other = ("cpu", torch.float16, 96, False, 16, 16, 1024, 1024)
    assert lookup.explain_backward_config(*other) == (heuristic_backward_config(96, torch.float16), "heuristic")


def test_record_to_config_ignores_extra_fields_and_rejects_incomplete_records():
    record = {**store.config_to_record(BackwardConfig(16, 32, 4, 1)), "tflops": 1.0, "future_field": "x"}
    assert store.record_to_config(record, BackwardConfig) == BackwardConfig(16, 32, 4, 1)
    assert store.record_to_config({"block_m": 16, "block_n": 32}, BackwardConfig) is None
    assert store.record_to_config({**record, "block_m": 24}, BackwardConfig) is None  # not a power of two


def test_run_backward_uses_the_looked_up_config_unless_one_is_given(fake_gpu, monkeypatch):
    from fmha import dispatch
    from fmha.backends.triton import backend
    from fmha.params import attention_params

    launched = []
    monkeypatch.setattr(backend, "INTERPRETED", False)  # the compiled path's lookup, without compiling
    monkeypatch.setattr(backend, "launch_backward", lambda *args, **scores: launched.append(args[-1]))
    text = ShapeKey.of("bwd", torch.float16, 32, True, 4, 2, 40, 50).text()
    store.store(FAKE_DEVICE, {text: store.config_to_record(BackwardConfig(16, 32, 8, 3))})
    q, k, v = (torch.randn(1, heads, seqlen, 32, dtype=torch.float16) for heads, seqlen in ((4, 40), (2, 50), (2, 50)))
    out, lse = torch.randn_like(q), torch.randn(1, 4, 40)
    params = attention_params("test", q, k, v, causal=True, scale=0.1)
    dispatch.run_backward(torch.randn_like(q), q, k, v, out, lse, params)
    explicit = BackwardConfig(32, 64, 4, 2)
    dispatch.run_backward(torch.randn_like(q), q, k, v, out, lse, params, config=explicit)
    assert launched == [BackwardConfig(16, 32, 8, 3), explicit] and type(launched[0]) is BackwardConfig


def test_tune_dry_run_lists_backward_candidates(capsys):
    from fmha.tools.cli import main

    assert main(["tune", "--dry-run", "--kernel", "bwd", "--suite", "seeds"]) == 0
    text = capsys.readouterr().out
    assert "bwd|bfloat16|d64|full|g1|q1024|k1024" in text and "fwd|" not in text
    assert "candidates" in text and "pruned" in text and "register pressure" in text
    assert "64×64 w4 s2" in text  # the heuristic
    assert main(["tune", "--dry-run", "--kernel", "all", "--shape", "1,16,16,4096,4096,128"]) == 0
    text = capsys.readouterr().out
    assert "fwd|bfloat16|d128|full|g1|q4096|k4096" in text and "bwd|bfloat16|d128|full|g1|q4096|k4096" in text
    assert "shared memory over the device's limit" in text


def test_write_defaults_adds_backward_entries_and_keeps_the_rest(tmp_path):
    from fmha.tools.tune import write_defaults

    path = tmp_path / "forward.json"
    path.write_text(lookup.SHIPPED_DEFAULTS.read_text())
    before = json.loads(path.read_text())
    gpu = "NVIDIA H100 80GB HBM3"
    record = store.config_to_record(BackwardConfig(64, 64, 4, 2), tflops=100.0)
    write_defaults(path, gpu, {"bwd|bfloat16|d128|full|g1|q4096|k4096": record})
    after = json.loads(path.read_text())
    assert set(after["gpus"]) == set(before["gpus"])
    for name, section in before["gpus"].items():
        assert section["entries"].items() <= after["gpus"][name]["entries"].items()
    assert after["gpus"][gpu]["entries"]["bwd|bfloat16|d128|full|g1|q4096|k4096"] == record
