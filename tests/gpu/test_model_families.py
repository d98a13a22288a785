"""Gemma 2, Gemma 3 (text) and Phi-3 / Phi-4-mini against transformers on small random configs
(fp32): prompt logits, the paged path with chunked prefill and decodes whose context is longer
than the sliding window (so out-of-window keys must be masked, across block boundaries), greedy
tokens through the engine with chunked prefill and prefix caching, tensor parallelism over two
gloo ranks, and LongRoPE's table at positions past the original context."""
from __future__ import annotations

import pytest
import torch

from pagedserve.gpu.forward_context import forward_context
from tests.gpu.test_models import assert_close, check_tensor_parallel, load_ours, make_caches, paged_step, save_hf_model

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
            pad_token_id=0, bos_token_id=2, eos_token_id=1)
WINDOW = 5  # shorter than every prompt below and than a block pair: the window matters everywhere

FAMILIES = {
    # Gemma 2: sliding / global alternate, query_pre_attn_scalar != head_dim, both soft-caps small
    # enough to bite on random weights.
    "gemma2": dict(BASE, model_type="gemma2", architectures=["Gemma2ForCausalLM"], sliding_window=WINDOW,
                   query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    # Gemma 3: q/k norms, local and global rope bases (linear scaling on the global one), an uneven
    # layer pattern, no soft-caps (global layers take the shared paged kernels).
    "gemma3": dict(BASE, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], sliding_window=WINDOW,
                   query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                       "rope_theta": 1000000.0}}),
    # Phi-3-mini's shape: fused qkv / gate_up, a sliding window on every layer, LongRoPE.
    "phi3": dict(BASE, model_type="phi3", architectures=["Phi3ForCausalLM"], tie_word_embeddings=False,
                 sliding_window=WINDOW + 2, max_position_embeddings=256, original_max_position_embeddings=64,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0],
                                  "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0],
                                  "original_max_position_embeddings": 64}),
    # Phi-4-mini's shape: partial rotary (0.5 here), tied embeddings, no window.
    "phi4-mini": dict(BASE, model_type="phi3", architectures=["Phi3ForCausalLM"], tie_word_embeddings=True,
                      partial_rotary_factor=0.5, max_position_embeddings=256, original_max_position_embeddings=64,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                       "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0],
                                       "original_max_position_embeddings": 64}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = save_hf_model(FAMILIES[request.param], path)
    return request.param, ref, load_ours(path), path


def test_prompt_logits_match_transformers(family):
    name, ref, ours, _ = family
    ids = torch.randint(0, 97, (23,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
        with forward_context(None, []):
            got = ours.compute_logits(ours(ids, torch.arange(len(ids))))
    assert got.shape == want.shape
    assert_close(got, want, name)


def test_paged_chunked_prefill_and_decode_past_the_window(family):
    """A prefills whole then decodes while B prefills in three chunks (mid-block ends, each chunk's
    window reaching into earlier chunks' blocks); then both decode 12 steps. Every new token's
    logits equal transformers' at that position of the full sequence."""
    name, ref, ours, _ = family
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 97, (22,), generator=g).tolist()  # 9 prompt + 13 decodes
    b = torch.randint(0, 97, (31,), generator=g).tolist()  # 19 prompt (6 + 7 + 6) + 12 decodes
    table_a, table_b = [5, 2, 9], [7, 1, 12, 3]
    with torch.inference_mode():
        ref_a, ref_b = ref(torch.tensor([a])).logits[0], ref(torch.tensor([b])).logits[0]
    caches = make_caches(ours)
    assert_close(paged_step(ours, caches, [(table_a, 0, 9)], [a]), ref_a[:9], f"{name} A prefill")
    cached_b = 0
    for step, chunk in enumerate((6, 7, 6)):
        got = paged_step(ours, caches, [(table_a, 9 + step, 1), (table_b, cached_b, chunk)], [a, b])
        assert_close(got[0], ref_a[9 + step], f"{name} A decode {step}")
        assert_close(got[1:], ref_b[cached_b:cached_b + chunk], f"{name} B chunk {step}")
        cached_b += chunk
    for step in range(12):  # A ends after position 21; B decodes positions 19..30
        reqs, toks = ([(table_a, 12 + step, 1)], [a]) if 12 + step < 22 else ([], [])
        got = paged_step(ours, caches, reqs + [(table_b, 19 + step, 1)], toks + [b])
        if reqs:
            assert_close(got[0], ref_a[12 + step], f"{name} A decode {12 + step}")
        assert_close(got[-1], ref_b[19 + step], f"{name} B decode {step}")


def test_windowed_layers_really_mask(family):
    """The reference check above would pass a model whose window never applied only if the
    window changed nothing: prove it does, on the same prompt."""
    name, _, ours, _ = family
    windows = [m for m in ours.modules() if getattr(m, "sliding_window", None)]
    if name == "phi4-mini":
        assert not windows
        return
    assert windows
    ids = torch.randint(0, 97, (23,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), forward_context(None, []):
        with_window = ours.compute_logits(ours(ids, torch.arange(23)))
        saved = [m.sliding_window for m in windows]
        for m in windows:
            m.sliding_window = None
        try:
            without = ours.compute_logits(ours(ids, torch.arange(23)))
        finally:
            for m, w in zip(windows, saved):
                m.sliding_window = w
    assert torch.allclose(with_window[:WINDOW], without[:WINDOW], atol=1e-5)
    assert (with_window[WINDOW + 2:] - without[WINDOW + 2:]).abs().max() > 1e-3


def test_fast_decode_binds_only_plain_layers(family):
    """The fused C decode layer knows neither windows nor soft-caps nor Gemma's norms: Gemma and
    windowed Phi-3 take the eager path; Phi-4-mini (no window, partial rotary) may bind, and its
    paged test above then ran through it."""
    from pagedserve.kernels import fused

    name, _, ours, _ = family
    bound = [layer for layer in ours.model.layers if getattr(layer, "fast_decode", None) is not None]
    if name == "phi4-mini" and fused.available():
        assert len(bound) == len(ours.model.layers)
    else:
        assert not bound


def test_longrope_table_matches_transformers_past_the_original_length():
    """Our table keeps the short factors below original_max_position_embeddings and the long ones
    from there on (as vLLM: cached keys keep their rotation); transformers rotates a sequence
    longer than the original with the long factors throughout, so each range is compared with
    the transformers rotary run in that regime."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from pagedserve.gpu.models.phi3 import Phi3ForCausalLM

    cfg = FAMILIES["phi4-mini"]
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    rotary = Phi3RotaryEmbedding(hf_cfg)
    x = torch.zeros(1, 1, dtype=torch.float32)
    ours = Phi3ForCausalLM(dict(cfg), "Phi3ForCausalLM").model.rotary
    table = ours.cos_sin_cache
    half = ours.rotary_dim // 2
    short_pos = torch.arange(0, 64)[None]
    cos, sin = rotary(x, short_pos)  # seq_len 64: short factors
    torch.testing.assert_close(table[:64, :half], cos[0, :, :half])
    torch.testing.assert_close(table[:64, half:], sin[0, :, :half])
    long_pos = torch.arange(0, 256)[None]
    cos, sin = rotary(x, long_pos)  # seq_len 256 > 64: long factors
    torch.testing.assert_close(table[64:, :half], cos[0, 64:, :half])
    torch.testing.assert_close(table[64:, half:], sin[0, 64:, :half])
    assert not torch.allclose(table[64:, :half], torch.cos(torch.outer(torch.arange(64, 256.0), 1.0 / (
        torch.tensor(cfg["rope_parameters"]["short_factor"]) * 10000.0 ** (torch.arange(0, 8, 2) / 8)))))


def test_tensor_parallel_forward_matches_single_rank(tmp_path):
    """Two gloo ranks (heads 4 / kv heads 2: one kv head a rank; Phi-3's fused tensors cut per
    rank) give the single-rank logits, full prompt and paged (window 5 < the 10-token prompt)."""
    check_tensor_parallel(tmp_path, {name: FAMILIES[name] for name in ["gemma2", "gemma3", "phi3"]})


def per_row_int8(model):
    """A copy of the transformers model with its linear weights rounded to symmetric per-row int8:
    how far int8 alone moves this random model's logits (Gemma 3's four norms a layer amplify it)."""
    import copy

    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and "lm_head" not in name:
                scale = m.weight.abs().amax(1, keepdim=True) / 127
                m.weight.copy_((m.weight / scale).round().clamp(-127, 127) * scale)
    return model


@pytest.mark.parametrize("quantization,dtype", [("int8", torch.float32), ("none", torch.bfloat16)])
def test_quantized_and_bf16_loads_stay_close(family, quantization, dtype):
    """int8 weights (the CPU kernel's packed layout) and bf16 weights and activations stay near the
    fp32 reference: within 8 % of its scale or twice what the same precision costs transformers
    itself (per-row int8 weights; the model run in bf16), the same top token at most positions."""
    import copy

    from pagedserve.contracts.config import ModelConfig
    from pagedserve.gpu.models.loader import load_model

    name, ref, _, path = family
    ours = load_model(ModelConfig(model=str(path), quantization=quantization), "cpu", dtype)
    ids = torch.arange(23) * 7 % 97
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
        lossy = per_row_int8(ref) if quantization == "int8" else copy.deepcopy(ref).to(dtype)
        bound = max(0.08 * want.abs().max(), 2 * (lossy(ids[None]).logits[0].float() - want).abs().max())
        with forward_context(None, []):
            got = ours.compute_logits(ours(ids, torch.arange(23)))
    assert (got - want).abs().max() < bound, name
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8, name


def test_gemma3_conditional_generation_checkpoint_serves_text(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: its text_config is the model's
    config, the language model's weights load (vision tower skipped) and text-only logits equal
    the multimodal model's."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from pagedserve.contracts.hf_config import load_hf_config

    text = {k: v for k, v in FAMILIES["gemma3"].items() if k not in ("architectures", "model_type")}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = Gemma3Config(text_config=dict(text, vocab_size=100), vision_config=vision, mm_tokens_per_image=4,
                       image_token_index=99, boi_token_index=97, eoi_token_index=98)
    torch.manual_seed(0)
    ref = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    ref.save_pretrained(tmp_path)
    read = load_hf_config(str(tmp_path))
    assert read["max_position_embeddings"] == 128 and read["num_hidden_layers"] == 4 and read["vocab_size"] == 100
    ours = load_ours(tmp_path)
    ids = torch.randint(0, 97, (23,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = ref(input_ids=ids[None]).logits[0]
        with forward_context(None, []):
            got = ours.compute_logits(ours(ids, torch.arange(23)))
    assert_close(got, want, "gemma3 conditional generation")


def pipeline_stages_equal_one_model(path, ids: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Load ``path`` as stage 0 and stage 1 of a 2-stage pipeline (each holds only its layers and
    loads only their tensors); stage 0's activations through stage 1 give ``want``."""
    from pagedserve.gpu.parallel_state import init_pipeline_parallel, reset_pipeline_parallel

    try:
        stages = []
        for which in (0, 1):
            init_pipeline_parallel(which, 2)
            stages.append(load_ours(path))
        with torch.inference_mode(), forward_context(None, []):
            handoff = stages[0](ids, torch.arange(len(ids)))
            got = stages[1].compute_logits(stages[1](ids, torch.arange(len(ids)), handoff))
    finally:
        reset_pipeline_parallel()
    assert_close(got, want, f"{what} pp=2")


def test_pipeline_stages_equal_one_model(family):
    name, _, ours, path = family
    ids = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode(), forward_context(None, []):
        want = ours.compute_logits(ours(ids, torch.arange(13)))
    pipeline_stages_equal_one_model(path, ids, want, name)


def test_sparse_gemma3_text_config_takes_transformers_defaults(tmp_path):
    """gemma-3-4b-it's config.json names five text keys; the rest are Gemma3TextConfig's defaults,
    which the lifted config must hold (rope: the global scaling, local base 10000)."""
    import json

    from transformers import Gemma3Config

    from pagedserve.contracts.hf_config import load_hf_config

    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model"}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = load_hf_config(str(tmp_path))
    want = Gemma3Config(**{k: v for k, v in raw.items() if k != "architectures"}).text_config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_activation", "max_position_embeddings", "rms_norm_eps",
                "query_pre_attn_scalar", "sliding_window", "final_logit_softcapping", "attn_logit_softcapping"):
        assert ours.get(key) == getattr(want, key), key
    assert ours["eos_token_id"] == [1, 106]
    from pagedserve.gpu.models.gemma import SLIDING, FULL, _rope, layer_types

    assert layer_types(dict(ours, model_type="gemma3")) == list(want.layer_types)
    for kind in (SLIDING, FULL):
        params = want.rope_parameters[kind]
        table = _rope(dict(ours, model_type="gemma3"), kind, 8).cos_sin_cache
        factor = params.get("factor", 1.0) if params.get("rope_type") == "linear" else 1.0
        inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, 8, 2).float() / 8)) / factor
        torch.testing.assert_close(table[:50, :4], torch.cos(torch.outer(torch.arange(50.0), inv)))
