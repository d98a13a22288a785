"""The offline LLM samples a call without sampling params with the model's recommended settings
(--generation-config), as vLLM's LLM.get_default_sampling_params."""
from __future__ import annotations

import json

from pagedserve.engine.sampling_params import SamplingParams
from tests.tiny import tiny_llm


def test_default_sampling_params_come_from_the_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    llm = tiny_llm(generation_config=str(tmp_path))
    try:
        p = llm.get_default_sampling_params()
        assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)
        assert llm._as_params_list(None, 2) == [p, p]
        out = llm.generate("The capital of France is", use_tqdm=False)
        assert out[0].outputs[0].token_ids  # sampled with them
    finally:
        llm.shutdown()
    llm = tiny_llm()  # the default model's GGUF has no sampling keys: SamplingParams()'s
    try:
        assert llm.get_default_sampling_params() == SamplingParams()
    finally:
        llm.shutdown()
