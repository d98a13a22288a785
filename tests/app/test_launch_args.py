"""Launching as with `vllm serve`: the positional MODEL, a Hugging Face id from the local cache
(HF_HUB_OFFLINE=1, as tests/conftest.py sets; downloads: tests/contracts/test_hf_hub.py), several served names, CORS, --chat-template, --dtype half, and vLLM flags that
are not implemented refused by name."""
from __future__ import annotations

import argparse
import json

import httpx
import pytest

from pagedserve.app.cli import build_parser
from pagedserve.app.serve_cmd import _origins, take_model
from pagedserve.app.server import build_app
from pagedserve.contracts.config import ConfigError, EngineConfig
from pagedserve.engine.bootstrap import read_chat_template, resolve_config
from pagedserve.loadtest.tiny_model import TINY_CONFIG
from tests.app.fake_engine import FakeAsyncEngine


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser(["serve", *argv]).parse_args(["serve", *argv])


def test_positional_model_and_several_served_names():
    args = serve_args("/models/m.gguf", "--served-model-name", "a", "b", "a")
    take_model(args)
    assert (args.model, args.served_model_name, args.other_served_names) == ("/models/m.gguf", "a", ("b",))
    args = serve_args("/models/m.gguf", "--model", "/models/other.gguf")
    with pytest.raises(ConfigError, match="given twice"):
        take_model(args)
    args = serve_args("--model", "/models/m.gguf")
    take_model(args)
    assert args.served_model_name is None and args.other_served_names == ()


@pytest.mark.parametrize("flag, words", [
    ("--trust-remote-code", "own model code"), ("--seed=3", "request"), ("--tokenizer", "model's own"),
    ("--tokenizer-revision", "--revision"),
])
def test_unimplemented_vllm_flags_are_refused_by_name(capsys, flag, words):
    with pytest.raises(SystemExit) as e:
        serve_args(flag)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag.split('=')[0]} is a vLLM flag pagedserve does not implement" in err and words in err


def test_origins_and_dtype_aliases():
    assert _origins('["http://a.test", "*"]') == ["http://a.test", "*"]
    assert _origins("http://a.test, http://b.test") == ["http://a.test", "http://b.test"]
    with pytest.raises(argparse.ArgumentTypeError):
        _origins('["x", 1]')
    assert EngineConfig.from_options(dtype="half").model.dtype == "float16"
    assert EngineConfig.from_options(dtype="float").model.dtype == "float32"
    assert serve_args("--dtype", "half").dtype == "half"


def hub(tmp_path, monkeypatch, model_id="org/tiny-model"):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / ("models--" + model_id.replace("/", "--"))
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(TINY_CONFIG))
    (snap / "model.safetensors").write_bytes(b"")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    return str(snap)


def test_a_model_id_is_served_from_the_local_cache(tmp_path, monkeypatch):
    snap = hub(tmp_path, monkeypatch)
    config, hf = resolve_config(EngineConfig.from_options(model="org/tiny-model", load_format="dummy"))
    assert config.model.model == snap and config.model.served_model_name == "org/tiny-model"
    assert hf["hidden_size"] == TINY_CONFIG["hidden_size"]
    with pytest.raises(ConfigError, match="not in the local cache .*HF_HUB_OFFLINE is set"):
        resolve_config(EngineConfig.from_options(model="org/not-here"))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config(EngineConfig.from_options(model="/no/such/file.gguf"))


def test_chat_template_file_or_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert read_chat_template(str(path)) == path.read_text()
    assert read_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ConfigError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="does not parse"):
        read_chat_template("{% for m in messages %}")


async def test_several_names_answer_and_models_lists_them():
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model", other_names=("alias",))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        ids = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
        assert ids == ["fake-model", "alias"]
        r = await http.post("/v1/chat/completions", json={"model": "alias", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200 and r.json()["model"] == "fake-model"
        r = await http.post("/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404


async def test_cors_only_for_the_allowed_origins():
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model", api_key="k",
                    allowed_origins=["http://ok.test"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        r = await http.options("/v1/chat/completions", headers={"Origin": "http://ok.test", **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.test"
        r = await http.options("/v1/chat/completions", headers={"Origin": "http://evil.test", **preflight})
        assert "access-control-allow-origin" not in r.headers
        r = await http.get("/v1/models", headers={"Origin": "http://ok.test", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.test"
    app = build_app(FakeAsyncEngine(), served_model_name="fake-model")  # no --allowed-origins: no CORS
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        r = await http.get("/v1/models", headers={"Origin": "http://ok.test"})
        assert "access-control-allow-origin" not in r.headers
