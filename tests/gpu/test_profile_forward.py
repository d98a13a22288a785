"""The KV-budget profile forward (issue 24 fault 1): one forward of max_num_batched_tokens tokens
with no KV cache, run at start on CUDA to measure peak activation memory. Its logic does not
depend on the device, so it is proven here on CPU: a model whose position table is shorter than
the token budget (GPT-2's 1024 < 2048, a Llama with a small max_position_embeddings) and every
stage of a pipeline (a stage without the embedding gets zero activations instead of tokens)."""
from __future__ import annotations

import pytest
import torch

from pagedserve.contracts.config import EngineConfig
from pagedserve.gpu.model_runner import ModelRunner
from pagedserve.gpu.models.stages import StageActivations
from pagedserve.gpu.parallel_state import init_pipeline_parallel, reset_pipeline_parallel

TOKENS = 96  # the token budget: more than either position table below

GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 256, "n_embd": 32,
        "n_layer": 2, "n_head": 4, "n_positions": 64, "layer_norm_epsilon": 1e-5}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 48, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False}


def runner_for(hf_config: dict) -> ModelRunner:
    from pagedserve.gpu.models.loader import load_model

    config = EngineConfig.from_options(load_format="dummy", hf_config=hf_config, dtype="float32", device="cpu",
                                       max_num_batched_tokens=TOKENS, num_gpu_blocks_override=4)
    runner = ModelRunner(config)
    runner.model = load_model(config.model, runner.device, runner.dtype)
    return runner


@pytest.fixture
def pipeline_stage():
    yield init_pipeline_parallel
    reset_pipeline_parallel()


@pytest.mark.parametrize("hf_config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_the_profile_runs_past_the_position_table(hf_config):
    out = runner_for(hf_config).profile_forward()
    assert out.shape[0] == TOKENS and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("hf_config", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("stage", [0, 1])
def test_every_pipeline_stage_runs_the_profile(pipeline_stage, hf_config, stage):
    pipeline_stage(stage, 2)
    out = runner_for(hf_config).profile_forward()
    if stage == 0:  # a stage before the last hands on activations
        assert isinstance(out, StageActivations) and out.hidden.shape[0] == TOKENS
    else:
        assert out.shape[0] == TOKENS and bool(torch.isfinite(out).all())
