"""RoPE scaling types real checkpoints use, against transformers at positions past the original
context (issue 25): llama3 (Llama 3.1/3.2), yarn (Qwen2.5 / Qwen3 long context), linear; and a
clear refusal for dynamic NTK, which rescales with the current length (a cached key would need
re-rotating as the sequence grows)."""
from __future__ import annotations

import pytest
import torch

from pagedserve.contracts.errors import ModelLoadError
from pagedserve.gpu.forward_context import forward_context
from tests.gpu.test_models import assert_close, load_ours, make_caches, paged_step, save_hf_model, tiny_config

ORIGINAL = 32  # the "pretrained" length; the prompts run to 120, well past it
SCALINGS = {
    "llama3": ("LlamaForCausalLM", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
    "yarn-qwen2": ("Qwen2ForCausalLM", {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": ORIGINAL}),
    "yarn-qwen3-betas": ("Qwen3ForCausalLM", {"rope_type": "yarn", "factor": 2.0, "beta_fast": 16, "beta_slow": 2,
                                              "original_max_position_embeddings": ORIGINAL}),
    "linear": ("LlamaForCausalLM", {"rope_type": "linear", "factor": 4.0}),
}


@pytest.fixture(scope="module", params=list(SCALINGS))
def pair(request, tmp_path_factory):
    arch, scaling = SCALINGS[request.param]
    cfg = tiny_config(arch, max_position_embeddings=256, rope_theta=10000.0, rope_scaling=scaling)
    path = tmp_path_factory.mktemp(request.param)
    return request.param, save_hf_model(cfg, path), load_ours(path)


def test_long_prompt_logits_match_transformers(pair):
    name, ref, ours = pair
    ids = torch.randint(0, 97, (120,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
        with forward_context(None, []):
            got = ours.compute_logits(ours(ids, torch.arange(len(ids))))
    assert_close(got, want, name)


def test_paged_decode_past_the_original_length_matches(pair):
    name, ref, ours = pair
    toks = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.inference_mode():
        want = ref(torch.tensor([toks])).logits[0]
    caches = make_caches(ours, num_blocks=16)
    table = list(range(13))
    assert_close(paged_step(ours, caches, [(table, 0, 90)], [toks]), want[:90], f"{name} prefill")
    for p in range(90, 100):
        assert_close(paged_step(ours, caches, [(table, p, 1)], [toks])[0], want[p], f"{name} decode at {p}")


def test_dynamic_ntk_is_refused_by_name(tmp_path):
    cfg = tiny_config("LlamaForCausalLM", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    save_hf_model(cfg, tmp_path)
    with pytest.raises(ModelLoadError, match="dynamic"):
        load_ours(tmp_path)
