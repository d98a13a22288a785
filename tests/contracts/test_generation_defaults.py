"""A model's recommended sampling settings (--generation-config) from generation_config.json and from
GGUF general.sampling.* keys written by the gguf package's own writer (llama.cpp's names)."""
from __future__ import annotations

import json
import logging

import pytest

from pagedserve.contracts.config import ConfigError, EngineConfig
from pagedserve.contracts.generation_defaults import generation_defaults

QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "bos_token_id": 1}


def hf_dir(tmp_path, gen: dict | None):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text("{}")
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return str(tmp_path)


def gguf_file(tmp_path, **sampling) -> str:
    import gguf

    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for key, value in sampling.items():
        getattr(w, f"add_sampling_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_hf_generation_config(tmp_path):
    path = hf_dir(tmp_path, QWEN3)
    defaults, source = generation_defaults(path, "auto")
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert source.endswith("generation_config.json")
    assert generation_defaults(path, "vllm") == ({}, None)
    assert generation_defaults(hf_dir(tmp_path / "none", None), "auto") == ({}, None)


def test_gguf_sampling_keys(tmp_path):
    path = gguf_file(tmp_path, temp=0.7, top_k=40, top_p=0.8, min_p=0.05, penalty_repeat=1.1)
    defaults, source = generation_defaults(path, "auto")
    assert defaults == pytest.approx({"temperature": 0.7, "top_k": 40, "top_p": 0.8, "min_p": 0.05,
                                      "repetition_penalty": 1.1})
    assert source == path
    assert generation_defaults(gguf_file(tmp_path), "auto")[0] == {}


def test_a_path_names_another_generation_config(tmp_path):
    model = hf_dir(tmp_path / "model", QWEN3)
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "min_p": 0.1}))
    assert generation_defaults(model, str(other))[0] == {"temperature": 0.2, "min_p": 0.1}
    assert generation_defaults(model, str(other / "generation_config.json"))[0] == {"temperature": 0.2, "min_p": 0.1}
    with pytest.raises(ConfigError, match="no generation_config.json"):
        generation_defaults(model, str(tmp_path / "missing"))


@pytest.mark.parametrize("gen, match", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": 2.5}, "top_k"),
    ({"repetition_penalty": "high"}, "repetition_penalty"),
])
def test_values_the_sampler_cannot_take_fail_the_start(tmp_path, gen, match):
    with pytest.raises(ConfigError, match=match):
        generation_defaults(hf_dir(tmp_path, gen), "auto")


def test_the_flag_is_an_engine_option_and_is_logged(tmp_path, caplog):
    from pagedserve.engine.bootstrap import sampling_defaults

    config = EngineConfig.from_options(model=hf_dir(tmp_path, QWEN3))
    assert config.model.generation_config == "auto"
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.bootstrap"):
        assert sampling_defaults(config) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert "temperature=0.6" in caplog.text and "--generation-config vllm" in caplog.text
    config = EngineConfig.from_options(model=config.model.model, generation_config="vllm")
    assert sampling_defaults(config) == {}
