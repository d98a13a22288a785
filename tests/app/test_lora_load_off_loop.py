"""POST /v1/load_lora_adapter reads the adapter's files (config and safetensors header) off the
event loop: a slow disk stalls only that request, never /health for everyone; and its body is
bounded before it is read."""
from __future__ import annotations

import asyncio
import time

import httpx

from pagedserve.app.server import build_app
from tests.app.fake_engine import FakeAsyncEngine
from tests.lora_fixtures import write_adapter_files


class SlowDiskEngine(FakeAsyncEngine):
    def __init__(self):
        super().__init__()
        self.config.lora.enable_lora = True
        self.checked = []
        self.started = self.ended = None

    def check_lora(self, lora_request) -> None:
        self.started = time.perf_counter()
        time.sleep(0.8)  # a slow (network) disk: blocking file reads
        self.checked.append(lora_request.lora_name)
        self.ended = time.perf_counter()


async def test_health_answers_while_an_adapter_is_being_read(tmp_path):
    engine = SlowDiskEngine()
    write_adapter_files(tmp_path / "a")
    app = build_app(engine, served_model_name="fake-model", allow_runtime_lora_updating=True,
                    lora_roots=[str(tmp_path)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        load = asyncio.create_task(client.post("/v1/load_lora_adapter",
                                               json={"lora_name": "a", "lora_path": str(tmp_path / "a")}))
        for _ in range(300):  # until the adapter read has begun (on a blocked loop: until it is over)
            if engine.started is not None:
                break
            await asyncio.sleep(0.01)
        health = await client.get("/health")
        answered = time.perf_counter()
        r = await load
    assert r.status_code == 200 and engine.checked == ["a"]
    assert health.status_code == 200
    assert answered < engine.ended, "/health waited behind an adapter read on the event loop"


async def test_a_huge_body_is_refused_before_it_is_read(tmp_path):
    engine = SlowDiskEngine()
    app = build_app(engine, served_model_name="fake-model", allow_runtime_lora_updating=True,
                    lora_roots=[str(tmp_path)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post("/v1/load_lora_adapter", content=b'{"lora_name": "' + b"x" * (1 << 20) + b'"}',
                              headers={"content-type": "application/json"})
    assert r.status_code == 413 and engine.checked == []
