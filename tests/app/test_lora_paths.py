"""Runtime LoRA loading reads only under --lora-root (issue 37, findings 4, 5 and 8).

A caller of /v1/load_lora_adapter names a path; the server reads files there. Only directories
whose real path lies under a --lora-root are read, the adapter's files never through a symbolic
link, and every refused path gets the same answer: whether a path exists, is a directory or is
readable, and what its files hold, is nobody's business but the server log's. The table of loaded
adapters has a cap; the operator's --lora-modules cannot be unloaded through the API; an adapter a
request has resolved cannot be unloaded under it; a path's newlines cannot forge log lines; and
/v1/models names adapters, it does not show their paths."""
from __future__ import annotations

import asyncio
import logging
import os

import httpx
import pytest

from pagedserve.app.lora_adapters import LoRAModule
from pagedserve.app.server import build_app
from pagedserve.contracts.config import ConfigError
from pagedserve.contracts.lora import LoRAAdapterError, read_adapter
from pagedserve.engine.errors import RequestRejectedError
from tests.app.fake_engine import FakeAsyncEngine
from tests.lora_fixtures import TINY_HF, write_adapter_files


class AdapterEngine(FakeAsyncEngine):
    """The fake engine with the engine's adapter check (contracts/lora.read_adapter)."""

    def __init__(self):
        super().__init__()
        self.config.lora.enable_lora = True
        self.forgotten: list[int] = []
        self.in_use: dict[int, int] = {}

    def check_lora(self, lora_request) -> None:
        try:
            read_adapter(lora_request.lora_path, TINY_HF, 4)
        except LoRAAdapterError as e:
            raise RequestRejectedError(f"LoRA adapter {lora_request.lora_name!r}: {e}") from None

    def lora_requests_in_use(self, lora_int_id: int) -> int:
        return self.in_use.get(lora_int_id, 0)

    def forget_lora(self, lora_int_id: int) -> None:
        self.forgotten.append(lora_int_id)


@pytest.fixture
def tree(tmp_path):
    """root/ (the --lora-root) with a good adapter, and outside/ with another one."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    write_adapter_files(root / "good")
    write_adapter_files(outside / "secret")
    (outside / "notes.txt").write_text("top secret\n")
    return root, outside


def _app(root, **kw):
    engine = kw.pop("engine", None) or AdapterEngine()
    app = build_app(engine, served_model_name="fake-model", allow_runtime_lora_updating=True,
                    lora_roots=[str(root)], **kw)
    return engine, app


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def _load(c, name, path) -> httpx.Response:
    return await c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def test_runtime_updating_without_a_root_refuses_to_start(tmp_path):
    with pytest.raises(ConfigError, match="--allow-runtime-lora-updating needs --lora-root"):
        build_app(AdapterEngine(), served_model_name="fake-model", allow_runtime_lora_updating=True)
    with pytest.raises(ConfigError, match="--lora-root .*not a directory"):
        build_app(AdapterEngine(), served_model_name="fake-model", allow_runtime_lora_updating=True,
                  lora_roots=[str(tmp_path / "missing")])


def test_serve_refuses_runtime_updating_without_a_root(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from pagedserve.app.cli import build_parser
    from pagedserve.app.serve_cmd import check_access

    argv = ["serve", "--enable-lora", "--allow-runtime-lora-updating"]
    args = build_parser(argv).parse_args(argv)
    with pytest.raises(ConfigError, match="--allow-runtime-lora-updating needs --lora-root"):
        check_access(args)
    for d in "abc":
        (tmp_path / d).mkdir()
    argv += ["--lora-root", str(tmp_path / "a"), "--lora-root", f"{tmp_path / 'b'},{tmp_path / 'c'}"]
    args = build_parser(argv).parse_args(argv)
    check_access(args)
    assert args.lora_root == [str(tmp_path / d) for d in "abc"]
    with pytest.raises(ConfigError, match="--lora-root .*not a directory"):
        check_access(build_parser(argv).parse_args(argv + ["--lora-root", str(tmp_path / "nope")]))
    # the real command: one line naming the flag, exit 1, before any model is loaded
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "pagedserve.app.cli", "serve", "--enable-lora", "--allow-runtime-lora-updating",
                           "--host", "127.0.0.1", "--port", "0"], cwd=root, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if " ERROR " in line]
    assert proc.returncode == 1 and "Traceback" not in out and len(errors) == 1, out
    assert "--allow-runtime-lora-updating needs --lora-root" in errors[0]


async def test_an_adapter_under_the_root_loads(tree):
    root, _ = tree
    engine, app = _app(root)
    async with _client(app) as c:
        assert (await _load(c, "good", root / "good")).status_code == 200
        os.symlink(root / "good", root / "alias")  # a link that stays inside the root is fine
        assert (await _load(c, "alias", root / "alias")).status_code == 200
        assert (await _load(c, "rel", f"{root}/../root/good")).status_code == 200
    adapters = app.state.server.checks.adapters
    assert adapters.by_name["alias"].lora_path == str((root / "good").resolve())  # read where it really is


async def test_every_refused_path_gets_the_same_answer(tree, tmp_path):
    root, outside = tree
    (root / "link-out").symlink_to(outside / "secret")
    (root / "empty").mkdir()
    (root / "a-file").write_text("x")
    files_out = root / "files-out"
    files_out.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (files_out / name).symlink_to(outside / "secret" / name)
    cfg_out = root / "cfg-out"
    write_adapter_files(cfg_out)
    (cfg_out / "adapter_config.json").unlink()
    (cfg_out / "adapter_config.json").symlink_to(outside / "notes.txt")
    bad_json = write_adapter_files(root / "bad-json")
    (bad_json / "adapter_config.json").write_text('{"r": "top secret value"')
    locked = write_adapter_files(root / "locked")
    os.chmod(locked, 0)
    refused = [outside / "secret", outside, "/etc", "/nonexistent/x", tmp_path, root / "link-out",
               root / "empty", root / "a-file", root / "missing", files_out, cfg_out, bad_json,
               f"{root}/../outside/secret", "relative/path", f"{root}/good\0", "/" + "x" * 5000,
               f"{root}/good\nINFO forged log line"]
    if os.geteuid() != 0:  # root reads it anyway
        refused.append(locked)
    engine, app = _app(root)
    try:
        async with _client(app) as c:
            answers = []
            for i, path in enumerate(refused):
                r = await _load(c, f"a{i}", path)
                assert r.status_code == 400, (path, r.text)
                answers.append(r.json()["error"])
    finally:
        os.chmod(locked, 0o755)
    texts = {(e["message"], e["param"], e["code"]) for e in answers}
    assert len(texts) == 1, texts
    message = answers[0]["message"]
    assert "--lora-root" in message
    for word in ("secret", "outside", "/etc", str(tmp_path), "exist", "ermission", "Expecting", "char 24"):
        assert word not in message, word
    assert app.state.server.checks.adapters.by_name == {}


async def test_loaded_adapters_are_capped(tree):
    root, _ = tree
    for i in range(3):
        write_adapter_files(root / f"ad{i}")
    engine, app = _app(root, max_runtime_loras=2, lora_modules=[LoRAModule("pinned", str(root / "good"))])
    async with _client(app) as c:
        assert (await _load(c, "ad0", root / "ad0")).status_code == 200
        assert (await _load(c, "ad1", root / "ad1")).status_code == 200
        r = await _load(c, "ad2", root / "ad2")
        assert r.status_code == 400 and "--max-runtime-loras" in r.json()["error"]["message"]
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "ad0"})
        assert r.status_code == 200
        assert (await _load(c, "ad2", root / "ad2")).status_code == 200


async def test_lora_modules_cannot_be_unloaded_through_the_api(tree, tmp_path):
    root, outside = tree
    # the operator's adapters may live anywhere (--lora-root bounds the API's loads only)
    engine, app = _app(root, lora_modules=[LoRAModule("ops", str(outside / "secret"))])
    async with _client(app) as c:
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "ops"})
        assert r.status_code == 400 and "--lora-modules" in r.json()["error"]["message"], r.text
        assert "ops" in app.state.server.checks.adapters.by_name and engine.forgotten == []
        r = await c.post("/v1/chat/completions", json={"model": "ops", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200


class GatedEngine(AdapterEngine):
    """Chat templates wait for a gate: a request that resolved its adapter is held before generate()."""

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()
        self.rendering = asyncio.Event()

    async def render_chat(self, *a, **kw):
        self.rendering.set()
        await self.gate.wait()
        return await super().render_chat(*a, **kw)


async def test_an_adapter_is_held_from_the_moment_a_request_resolves_it(tree):
    """Between resolving the model name and engine.generate() a request awaits (template,
    tokenizer); an unload meanwhile must be refused, or the request runs an unloaded adapter."""
    root, _ = tree
    engine = GatedEngine()
    _, app = _app(root, engine=engine)
    async with _client(app) as c:
        assert (await _load(c, "good", root / "good")).status_code == 200
        chat = asyncio.create_task(c.post("/v1/chat/completions", json={
            "model": "good", "messages": [{"role": "user", "content": "x"}]}))
        await asyncio.wait_for(engine.rendering.wait(), 10)
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "good"})
        assert r.status_code == 409, r.text
        engine.gate.set()
        assert (await chat).status_code == 200
        assert engine.calls[-1].request_id  # it ran
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "good"})  # released with the request
        assert r.status_code == 200, r.text


async def test_a_path_with_newlines_cannot_forge_log_lines(tree, caplog):
    root, _ = tree
    engine, app = _app(root)
    caplog.set_level(logging.DEBUG)
    async with _client(app) as c:
        r = await _load(c, "x", f"{root}/nope\n2025-01-01 INFO app: forged")
    assert r.status_code == 400
    lines = [line for rec in caplog.records for line in rec.getMessage().splitlines()]
    assert not any(line.startswith("2025-01-01 INFO app: forged") for line in lines), lines
    assert any("nope\\n2025" in rec.getMessage() for rec in caplog.records)  # logged, escaped


async def test_models_lists_names_not_paths(tree):
    root, outside = tree
    engine, app = _app(root, lora_modules=[LoRAModule("ops", str(outside / "secret"))])
    engine.config.model.model = "/srv/models/base-model"
    async with _client(app) as c:
        assert (await _load(c, "good", root / "good")).status_code == 200
        body = (await c.get("/v1/models")).text
        cards = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
    assert str(root) not in body and str(outside) not in body and "/srv/models" not in body
    assert cards["good"]["root"] == "good" and cards["good"]["parent"] == "fake-model"
    assert cards["fake-model"]["root"] == "fake-model"
    _, app = _app(root, lora_modules=[LoRAModule("ops", str(outside / "secret"))], show_model_paths=True)
    app.state.server.info.engine.config.model.model = "/srv/models/base-model"
    async with _client(app) as c:
        cards = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
    assert cards["ops"]["root"] == str(outside / "secret") and cards["fake-model"]["root"] == "/srv/models/base-model"
