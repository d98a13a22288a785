"""The GPU check's ``serve`` phase (loadtest/micro/gpu_check.py): a real ``serve`` on the tiny random
model, over HTTP."""
from __future__ import annotations

import asyncio
import json

from pagedserve.loadtest.micro.gpu_check_common import Ctx, Report, greedy, tiny_options


def _serve_args(options: dict) -> list[str]:
    return ["--model", options["model"], "--load-format", "dummy", "--hf-config", json.dumps(options["hf_config"]),
            "--dtype", options["dtype"], "--device", options["device"], "--num-gpu-blocks-override",
            str(options["num_gpu_blocks_override"]), "--max-model-len", "2048"]


async def _concurrent(url: str, model: str, n: int) -> list[bool]:
    import httpx

    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i):
            r = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": f"Request {i}: count to ten.", "max_tokens": 16, "temperature": 0.8,
                "seed": i})
            return r.status_code == 200 and isinstance(r.json()["choices"][0]["text"], str)
        return await asyncio.gather(*(one(i) for i in range(n)))


def phase_serve(ctx: Ctx, rep: Report) -> None:
    import httpx

    from pagedserve.engine.llm import LLM
    from pagedserve.loadtest.local_server import LocalServer

    options = tiny_options(ctx)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    with LLM(**options) as llm:
        offline = [o.outputs[0].text for o in llm.generate(texts, greedy(16))]
    server = LocalServer(_serve_args(options), log_prefix="gpu-check-serve-")
    code = None
    try:
        url = server.url
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        served = []
        for t in texts:
            r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": t, "max_tokens": 16,
                                                          "temperature": 0, "ignore_eos": True}, timeout=120)
            served.append(r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}")
        rep.check("served greedy == offline", served == offline, served=served, offline=offline)
        chunks, last = 0, None
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
                "model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    last = line[len("data: "):]
                    chunks += last != "[DONE]"
        rep.check("streamed chat ends with [DONE]", last == "[DONE]" and chunks > 0, chunks=chunks, last=last)
        ok = asyncio.run(_concurrent(url, model, 64))
        rep.check("64 concurrent completions", all(ok), succeeded=sum(ok))
        r = httpx.get(url + "/metrics", timeout=30)
        rep.check("/metrics", r.status_code == 200 and "# TYPE" in r.text, status=r.status_code, bytes=len(r.text))
    finally:
        code = server.stop()
        if code != 0:
            print(server.output()[-3000:], flush=True)
    rep.check("SIGTERM: exit code 0", code == 0, exit_code=code)
