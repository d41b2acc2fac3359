"""attn_implementation="fmha" in a Hugging Face transformers model, on the CPU through the interpreter.

A tiny Llama (GQA, random weights, float32) against attn_implementation="sdpa": prefill with and
without padding, greedy decoding over a DynamicCache and a StaticCache, gradients, and which of
fmha's entry points (or the SDPA fallback) each mask takes.
"""

import inspect
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fmha.integrations.transformers as hf  # noqa: E402

from .helpers import sliding_window_model  # noqa: E402

pytestmark = pytest.mark.interpreter

PROMPT = 12


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of each path of the integration (and forgets which fallbacks warned)."""
    counter = Counter()
    for name in ("attention", "flash_attn_with_kvcache", "varlen_attention", "_sdpa"):
        original = getattr(hf, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counter[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(hf, name, counted)
    monkeypatch.setattr(hf, "_warned", set())
    return counter


def inputs(padding=None):
    """Two prompts; ``padding`` "left", "right" or "holes" pads the second."""
    ids = torch.randint(1, 64, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    if padding == "left":
        mask[1, :5] = 0
    elif padding == "right":
        mask[1, 8:] = 0
    elif padding == "holes":
        mask[1, 3:6] = 0
    return ids, mask


def logits(model, implementation, ids, mask=None):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


@pytest.mark.parametrize("padding, path", [(None, "attention"), ("left", "flash_attn_with_kvcache"),
                                           ("right", "varlen_attention")])
def test_prefill_logits_match_sdpa(model, calls, padding, path):
    ids, mask = inputs(padding)
    expected = logits(model, "sdpa", ids, mask if padding else None)
    got = logits(model, "fmha", ids, mask if padding else None)
    real = mask.bool()  # padded positions are garbage in both
    torch.testing.assert_close(got[real], expected[real], atol=2e-5, rtol=0)
    assert calls == {path: model.config.num_hidden_layers}


def test_padding_with_holes_falls_back_to_sdpa_with_a_warning(model, calls):
    ids, mask = inputs("holes")
    expected = logits(model, "sdpa", ids, mask)
    with pytest.warns(UserWarning, match="holes"):
        got = logits(model, "fmha", ids, mask)
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=2e-5, rtol=0)
    assert calls == {"_sdpa": model.config.num_hidden_layers}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padding", [None, "left"])
def test_greedy_decoding_matches_sdpa(model, calls, cache, padding):
    ids, mask = inputs(padding)
    outputs = {}
    for implementation in ("sdpa", "fmha"):
        model.set_attn_implementation(implementation)
        outputs[implementation] = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                                 cache_implementation=cache, return_dict_in_generate=True,
                                                 output_logits=True)
    assert torch.equal(outputs["fmha"].sequences, outputs["sdpa"].sequences)
    for got, expected in zip(outputs["fmha"].logits, outputs["sdpa"].logits):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    # Every step ran fmha: the prefill and three decode steps, in each layer.
    assert calls["_sdpa"] == 0 and sum(calls.values()) == 4 * model.config.num_hidden_layers
    if cache == "static" or padding:  # lengths on the device (a StaticCache's empty slots, left padding)
        assert calls["flash_attn_with_kvcache"] == 4 * model.config.num_hidden_layers


def cache_argument(model) -> str:
    """The forward's name for the cache: ``cache`` from transformers 5.24 (``past_key_values`` still
    works there, with a deprecation warning), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def test_chunked_prefill_over_a_dynamic_cache(model, calls):
    """A second chunk of queries over cached keys (Sq < Sk), with left padding."""
    ids, mask = inputs("left")
    results = {}
    for implementation in ("sdpa", "fmha"):
        model.set_attn_implementation(implementation)
        cache = {cache_argument(model): transformers.DynamicCache(config=model.config)}
        with torch.no_grad():
            model(ids[:, :7], attention_mask=mask[:, :7], **cache)
            results[implementation] = model(ids[:, 7:], attention_mask=mask, **cache).logits
    torch.testing.assert_close(results["fmha"], results["sdpa"], atol=2e-5, rtol=0)
    assert calls["_sdpa"] == 0


@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_gradients_match_sdpa(model, padding):
    ids, mask = inputs(padding)
    grads = {}
    for implementation in ("sdpa", "fmha"):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        out = model(ids, attention_mask=mask if padding else None).logits
        out[mask.bool()].square().mean().backward()
        grads[implementation] = [p.grad.clone() for p in model.model.layers[0].self_attn.parameters()]
    model.zero_grad()
    for got, expected in zip(grads["fmha"], grads["sdpa"]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_a_user_4d_mask_runs_sdpa(model, calls):
    """A custom 4-D mask goes to torch SDPA as given."""
    ids, _ = inputs()
    causal = torch.ones(PROMPT, PROMPT, dtype=torch.bool).tril()
    causal[4:, :2] = False  # not expressible as padding
    mask = causal.expand(2, 1, PROMPT, PROMPT)
    expected = logits(model, "sdpa", ids, mask)
    with pytest.warns(UserWarning, match="4-D attention mask"):
        got = logits(model, "fmha", ids, mask)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    assert calls == {"_sdpa": model.config.num_hidden_layers}


def test_lengths_mask_columns_are_contiguous():
    mask = hf.lengths_mask(torch.tensor([0, 3]), torch.tensor([9, 9]))
    assert hf.is_lengths_mask(mask) and mask.shape == (2, 1, 1, 2)
    first, stop, end = hf._bounds(mask)
    assert first.tolist() == [0, 3] and stop.tolist() == end.tolist() == [9, 9]
    assert mask[:, 0, 0, 0].is_contiguous() and mask[:, 0, 0, 1].is_contiguous()


def eager_scores_attention(q, k, v, scale, softcap=None, sinks=None, first=None, stop=None):
    """Gemma 2's softcap and gpt-oss's sinks as their eager attention computes them, in float64:
    causal, bottom-right aligned, keys [first, stop) of each sequence; (B, Sq, Hq, D)."""
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    keys = torch.arange(seqlen_k)
    visible = keys[None, :] <= (torch.arange(seqlen_q) + seqlen_k - seqlen_q)[:, None]
    if first is not None:
        visible = visible[None] & (keys >= first[:, None, None]) & (keys < stop[:, None, None])
        visible = visible[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.double().reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return (probs.nan_to_num(0.0) @ v).transpose(1, 2)


@pytest.mark.parametrize("path", ["no-mask", "left-padded-cache", "packed"])
@pytest.mark.parametrize("features", ["softcap", "sinks", "both"])
def test_softcap_and_sinks_reach_fmha(calls, path, features):
    """Gemma 2's softcap and gpt-oss's sinks (s_aux, in the model's dtype) on each of fmha's paths."""
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 9, 16, generator=generator)
    k, v = (torch.randn(2, 2, 9, 16, generator=generator) for _ in range(2))
    options = {}
    if features in ("softcap", "both"):
        options["softcap"] = 2.0
    if features in ("sinks", "both"):
        options["s_aux"] = torch.randn(4, generator=generator).to(torch.bfloat16)
    sinks = options["s_aux"].float() if "s_aux" in options else None
    first = stop = mask = None
    if path != "no-mask":
        first, stop = torch.tensor([0, 3]), torch.tensor([9, 9])
        mask = hf.lengths_mask(first, stop)
    if path == "packed":
        q.requires_grad_(True)
    out, _ = hf.fmha_attention_forward(torch.nn.Module(), q, k, v, mask, scaling=0.25, **options)
    expected = eager_scores_attention(q.detach(), k, v, 0.25, options.get("softcap"), sinks, first, stop)
    if first is not None:  # padded query rows: zeros in fmha, whatever the eager softmax makes of them
        real = torch.arange(9)[None, :] >= first[:, None]
        out, expected = out[real], expected[real]
    torch.testing.assert_close(out.detach().double(), expected, atol=2e-5, rtol=0)
    taken = {"no-mask": "attention", "left-padded-cache": "flash_attn_with_kvcache", "packed": "varlen_attention"}
    assert calls == {taken[path]: 1}


def test_softcap_and_sinks_raise_where_sdpa_would_run():
    q = torch.zeros(1, 2, 3, 8)
    holes = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="softcap"):
        hf.fmha_attention_forward(torch.nn.Module(), q, q, q, holes, softcap=30.0)
    with pytest.raises(NotImplementedError, match="sinks"):
        hf.fmha_attention_forward(torch.nn.Module(), q, q, q, None, dropout=0.1, s_aux=torch.zeros(2))


def sliding_model(kind: str):
    """A tiny model with sliding-window layers, window 5 (shorter than the prompt)."""
    return sliding_window_model(kind, vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                                pad_token_id=0, sliding_window=5)


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padding", [None, "left"])
def test_sliding_window_models_decode_like_eager(calls, kind, cache, padding):
    """Prefill and decode past the window over a DynamicCache (sliding layers keep the last
    window's keys) and a StaticCache (a rolling window buffer), every call in fmha."""
    model = sliding_model(kind)
    ids, mask = inputs(padding)
    outputs = {}
    for implementation in ("eager", "fmha"):
        model.set_attn_implementation(implementation)
        outputs[implementation] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                                 cache_implementation=cache, return_dict_in_generate=True,
                                                 output_logits=True)
    assert torch.equal(outputs["fmha"].sequences, outputs["eager"].sequences)
    for got, expected in zip(outputs["fmha"].logits, outputs["eager"].logits):
        torch.testing.assert_close(got, expected, atol=5e-5, rtol=0)
    assert calls["_sdpa"] == 0 and sum(calls.values()) == 6 * model.config.num_hidden_layers


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
@pytest.mark.parametrize("padding", [None, "right"])
def test_sliding_window_prefill_and_gradients_like_eager(calls, kind, padding):
    model = sliding_model(kind)
    ids, mask = inputs(padding)
    grads = {}
    for implementation in ("eager", "fmha"):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        out = model(ids, attention_mask=mask).logits
        out[mask.bool()].square().sum().backward()
        grads[implementation] = (out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
    real = mask.bool()
    torch.testing.assert_close(grads["fmha"][0][real], grads["eager"][0][real], atol=5e-5, rtol=0)
    for got, expected in zip(grads["fmha"][1], grads["eager"][1]):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert calls["_sdpa"] == 0


def test_sliding_window_of_recognises_only_transformers_window_masks():
    from transformers.masking_utils import and_masks, chunked_overlay, sliding_window_causal_mask_function
    assert hf.sliding_window_of(sliding_window_causal_mask_function(7)) == 7
    assert hf.sliding_window_of(hf.causal_mask_function) is None
    assert hf.sliding_window_of(and_masks(hf.causal_mask_function, hf.sliding_window_overlay(7))) is None
    assert hf.sliding_window_of(and_masks(chunked_overlay(4, torch.zeros(1)), hf.causal_mask_function)) is None
