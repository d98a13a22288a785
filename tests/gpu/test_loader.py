"""Weight loading: the default GGUF model against transformers, and the typed errors."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.contracts.config import ModelConfig
from pagedserve.gpu.forward_context import forward_context
from pagedserve.contracts.errors import ModelLoadError, UnsupportedArchitectureError
from pagedserve.gpu.models.loader import load_model

from tests.gpu.test_models import ARCHS, assert_close, make_caches, paged_step, save_hf_model

PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is"
PARIS_IDS = [7042, 30]  # " Paris."


# ---- the default model (one load of each side per module) ------------------------------------

@pytest.fixture(scope="module")
def default_pair(default_model_path):
    from transformers import AutoModelForCausalLM

    # model=None -> the default GGUF, dequantized as transformers does (auto would keep it packed)
    ours = load_model(ModelConfig(quantization="none"), "cpu", torch.float32)
    d, f = os.path.split(default_model_path)
    ref = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return ours, ref


def test_default_gguf_config(default_model_path):
    from pagedserve.contracts.hf_config import load_hf_config

    cfg = load_hf_config(default_model_path)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]) == (576, 1536, 49152)
    assert cfg["head_dim"] == 64 and cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True
    assert cfg["max_position_embeddings"] == 8192
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)


def test_default_model_logits_match_transformers(default_pair):
    ours, ref = default_pair
    assert (ours.num_layers, ours.num_kv_heads, ours.head_dim) == (30, 3, 64)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = torch.tensor(PROMPT_IDS)
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
        with forward_context(None, []):
            got = ours.compute_logits(ours(ids, torch.arange(len(ids))))
    assert_close(got, want, "default model")


def test_default_model_greedy_paged_matches_transformers(default_pair):
    """Prefill through the paged cache, then greedy decode steps: the same tokens as
    transformers' greedy generation, and " Paris" first."""
    ours, ref = default_pair
    n_new = 8
    with torch.inference_mode():
        want = ref.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=n_new, do_sample=False)[0].tolist()
    caches = make_caches(ours, num_blocks=4)
    table = [3, 1]
    toks = list(PROMPT_IDS)
    logits = paged_step(ours, caches, [(table, 0, len(toks))], [toks])
    toks.append(int(logits[-1].argmax()))
    while len(toks) < len(PROMPT_IDS) + n_new:
        logits = paged_step(ours, caches, [(table, len(toks) - 1, 1)], [toks])
        toks.append(int(logits[-1].argmax()))
    assert toks == want
    assert toks[len(PROMPT_IDS):len(PROMPT_IDS) + 2] == PARIS_IDS


# ---- errors ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_hf_model(ARCHS["llama"], path)
    return path


def _copy_dir(src, dst, edit):
    """Copy a saved model, letting ``edit(tensors dict)`` change the weights."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_missing_tensor_names_file_and_tensor(llama_dir, tmp_path):
    bad = _copy_dir(llama_dir, tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*missing.*layers\.1\.mlp\.down_proj\.weight"):
        load_model(ModelConfig(model=str(bad)), "cpu", torch.float32)
    # One part of a fused parameter missing is reported as that part.
    bad2 = _copy_dir(llama_dir, tmp_path / "m2", lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"layers\.0\.self_attn\.qkv_proj\.weight \(part k\)"):
        load_model(ModelConfig(model=str(bad2)), "cpu", torch.float32)


def test_wrong_shape_names_file_and_tensor(llama_dir, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.v_proj.weight"] = t["model.layers.0.self_attn.v_proj.weight"][:-1]

    bad = _copy_dir(llama_dir, tmp_path / "s", shrink)
    with pytest.raises(ModelLoadError) as e:
        load_model(ModelConfig(model=str(bad)), "cpu", torch.float32)
    msg = str(e.value)
    assert "model.safetensors" in msg and "model.layers.0.self_attn.v_proj.weight" in msg
    assert "(31, 64)" in msg and "(32, 64)" in msg

    def widen(t):
        t["model.norm.weight"] = torch.ones(65)

    bad = _copy_dir(llama_dir, tmp_path / "w", widen)
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight.*shape mismatch"):
        load_model(ModelConfig(model=str(bad)), "cpu", torch.float32)


def test_unexpected_tensor(llama_dir, tmp_path):
    bad = _copy_dir(llama_dir, tmp_path / "u", lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ModelLoadError, match=r"model\.extra\.weight"):
        load_model(ModelConfig(model=str(bad)), "cpu", torch.float32)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "hidden_size": 8}))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(ModelConfig(model=str(tmp_path)), "cpu", torch.float32)
    msg = str(e.value)
    assert "MambaForCausalLM" in msg
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                 "GPT2LMHeadModel"):
        assert arch in msg
    assert isinstance(e.value, ModelLoadError)


def test_bad_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="no such"):
        load_model(ModelConfig(model=str(tmp_path / "nope")), "cpu", torch.float32)
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(ModelConfig(model=str(tmp_path)), "cpu", torch.float32)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        load_model(ModelConfig(model=str(junk)), "cpu", torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(ARCHS["llama"]))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(ModelConfig(model=str(tmp_path)), "cpu", torch.float32)
    with pytest.raises(ModelLoadError, match="unknown load format"):
        load_model(ModelConfig(model=str(tmp_path), load_format="pickle"), "cpu", torch.float32)
    with pytest.raises(ModelLoadError, match="unsupported rope scaling"):
        load_model(ModelConfig(load_format="dummy", hf_config=dict(
            ARCHS["llama"], rope_scaling={"rope_type": "dynamic", "factor": 4.0})), "cpu", torch.float32)


def test_dummy_from_path_config(llama_dir):
    """load_format=dummy with a path builds from that path's config.json."""
    m = load_model(ModelConfig(model=str(llama_dir), load_format="dummy", seed=1), "cpu", torch.bfloat16)
    assert m.num_layers == 2 and m.model.embed_tokens.weight.dtype == torch.bfloat16
    assert m.model.embed_tokens.weight.float().std().item() == pytest.approx(0.02, rel=0.2)


def test_gguf_unpermute_restores_hf_rows():
    """llama.cpp's permutation (per head: halves -> interleaved pairs) is undone exactly."""
    import numpy as np

    from pagedserve.gpu.models.gguf_loader import unpermute_rows

    n_heads, head_dim, cols = 3, 8, 5
    hf = np.arange(n_heads * head_dim * cols, dtype=np.float32).reshape(n_heads * head_dim, cols)
    # llama.cpp's convert: reshape(n, 2, d/2, cols).swapaxes(1, 2)
    permuted = hf.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(permuted, hf)
    assert np.array_equal(unpermute_rows(permuted, n_heads), hf)
