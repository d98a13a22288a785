"""A LoRA adapter beside the base model's several served names (--served-model-name A B): every
name of the base model serves the base, the adapter serves itself, /v1/models lists each name and
the adapter with the first name as its parent; and LoRA with speculative decoding is refused at
start, by name. (The merge of issue 23's LoRA and issue 25's launch flags met in these paths.)"""
from __future__ import annotations

import pytest

from pagedserve.app.lora_adapters import LoRAModule
from pagedserve.app.server import build_app
from pagedserve.contracts.config import ConfigError, EngineConfig
from tests.e2e.test_lora_e2e import KEY, _client, _engine, _tokens, files  # noqa: F401  (files is a fixture)


async def test_served_name_aliases_and_an_adapter(files):
    root, refs = files
    engine = await _engine(root)
    try:
        app = build_app(engine, served_model_name="tiny", other_names=("tiny-alias",), api_key=KEY,
                        lora_modules=[LoRAModule("ada", str(root / "ada"))])
        client = _client(app)
        cards = {m.id: m for m in (await client.models.list()).data}
        assert set(cards) == {"tiny", "tiny-alias", "ada"}
        assert cards["ada"].parent == "tiny" and cards["tiny-alias"].parent is None
        assert await _tokens(client, "tiny-alias") == refs["tiny"]
        assert await _tokens(client, "ada") == refs["ada"]
        with pytest.raises(Exception) as e:
            await _tokens(client, "nope")
        assert getattr(e.value, "status_code", None) == 404
    finally:
        await engine.shutdown()


def test_lora_with_speculative_decoding_is_refused_by_name():
    with pytest.raises(ConfigError, match="--enable-lora and --speculative-config"):
        EngineConfig.from_options(enable_lora=True, speculative_config={"method": "ngram",
                                                                        "num_speculative_tokens": 3})
