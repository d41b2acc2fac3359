"""attn_implementation="fmha" in a small Llama on the GPU (marker ``gpu``; skipped without
transformers): the inference issue's checks.

* bf16 prefill logits (left-padded batch, and without padding) are as close to a float32 SDPA
  reference (the same bf16 weights, upcast) as SDPA's own backends are;
* greedy generation of 64 tokens equals SDPA's token for token on a float32 model (DynamicCache
  and StaticCache, left padding);
* generation with a StaticCache under torch.compile (transformers' automatic compile of the decode
  step) runs through fmha;
* sliding-window models (Mistral, Gemma 2 with its softcap, gpt-oss with its sinks) decode 64
  tokens past the window as their eager attention does, with no SDPA fallback.
"""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fmha.integrations.transformers as hf  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from .helpers import sliding_window_model  # noqa: E402

pytestmark = pytest.mark.gpu

VOCAB = 2048


def small_llama(dtype):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                      max_position_embeddings=1024, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).to(device="cuda", dtype=dtype).eval()


def prompts(batch, length, left_pads):
    ids = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(2)).cuda()
    mask = torch.ones(batch, length, dtype=torch.long, device="cuda")
    for row, pad in enumerate(left_pads):
        mask[row, :pad] = 0
    return ids, mask


def relative_error(got, expected):
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("left_pads", [(0, 0, 0, 0), (0, 37, 150, 255)], ids=["unpadded", "left-padded"])
def test_prefill_logits_within_sdpa_backends_spread_gpu(left_pads):
    ids, mask = prompts(4, 256, left_pads)
    real = mask.bool()
    model = small_llama(torch.bfloat16)
    # The reference: the same (bf16-rounded) weights in float32, SDPA's math backend.
    reference = copy.deepcopy(model).float()
    reference.set_attn_implementation("sdpa")
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        expected = reference(ids, attention_mask=mask).logits[real]
    del reference
    errors = {}
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        if not any(left_pads):  # a mask rules out the flash and cuDNN kernels
            backends += [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        for backend in backends:
            try:
                with sdpa_kernel(backend):
                    errors[backend.name] = relative_error(model(ids, attention_mask=mask).logits[real], expected)
            except RuntimeError:  # this backend cannot take the call (cuDNN: GQA)
                continue
        assert len(errors) >= 2
        model.set_attn_implementation("fmha")
        got = model(ids, attention_mask=mask).logits[real]
    spread = max(errors.values())
    print(f"fmha {relative_error(got, expected):.2e}, SDPA backends {errors}")
    assert relative_error(got, expected) <= 1.25 * spread


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_64_tokens_equal_sdpa_float32_gpu(cache):
    model = small_llama(torch.float32)
    ids, mask = prompts(3, 40, (0, 9, 30))
    sequences = {}
    for implementation in ("sdpa", "fmha"):
        model.set_attn_implementation(implementation)
        sequences[implementation] = model.generate(ids, attention_mask=mask, max_new_tokens=64, min_new_tokens=64,
                                                   do_sample=False, cache_implementation=cache,
                                                   disable_compile=True)
    assert sequences["fmha"].shape[1] == 40 + 64
    assert torch.equal(sequences["fmha"], sequences["sdpa"])


def test_static_cache_generation_under_torch_compile_gpu(monkeypatch):
    """transformers compiles the decode step of a StaticCache generation (mode reduce-overhead:
    CUDA graphs); the masks are made outside it, as lengths, so every compiled step runs fmha."""
    monkeypatch.setattr(hf, "_warned", set())
    model = small_llama(torch.float32)
    model.set_attn_implementation("fmha")
    ids, mask = prompts(2, 24, (0, 5))
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                           cache_implementation="static", disable_compile=True)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fallback to SDPA would warn
        warnings.filterwarnings("ignore", message="(?!fmha)")
        compiled = model.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                  cache_implementation="static")
    assert compiled.shape == eager.shape
    # Inductor's fused float32 arithmetic may round differently; the first tokens must agree.
    assert torch.equal(compiled[:, :24 + 16], eager[:, :24 + 16])
    print(f"compiled == eager on {(compiled == eager).all(0).sum().item() - 24} of 32 new tokens")


def small_sliding_model(kind):
    """Window 32 (shorter than the prompts), GQA 4, D 64, on the GPU in float32."""
    return sliding_window_model(kind, vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                max_position_embeddings=1024, pad_token_id=0, sliding_window=32).cuda()


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_sliding_window_models_greedy_64_tokens_equal_eager_float32_gpu(monkeypatch, kind, cache):
    """Decoding 64 tokens past a 32-key window, left-padded prompts; no call falls back to SDPA."""
    monkeypatch.setattr(hf, "_warned", set())
    model = small_sliding_model(kind)
    ids, mask = prompts(3, 40, (0, 9, 30))
    sequences = {}
    for implementation in ("eager", "fmha"):
        model.set_attn_implementation(implementation)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # a fallback to SDPA would warn
            warnings.filterwarnings("ignore", message="(?!fmha)")
            sequences[implementation] = model.generate(ids, attention_mask=mask, max_new_tokens=64,
                                                       min_new_tokens=64, do_sample=False,
                                                       cache_implementation=cache, disable_compile=True)
    assert sequences["fmha"].shape[1] == 40 + 64
    assert torch.equal(sequences["fmha"], sequences["eager"])
