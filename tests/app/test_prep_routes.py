"""The routes' side of the preparation pools (issue 22 item 6): a deadline is a 400 in OpenAI's
format naming the limit, a full pool a 503 with Retry-After, and /tokenize's token strings are
converted by the engine (off the loop), not in the route."""
from __future__ import annotations

import threading

import httpx

from pagedserve.app.server import build_app
from pagedserve.engine.prep_pools import PrepBusyError, PrepDeadlineError
from tests.app.conftest import assert_openai_error
from tests.app.fake_engine import FakeAsyncEngine


class PoolEngine(FakeAsyncEngine):
    def __init__(self, render_error=None):
        super().__init__()
        self.render_error = render_error
        self.convert_threads: list[str] = []

    async def render_chat(self, messages, add_generation_prompt=True, continue_final_message=False,
                          **template_kwargs):
        if self.render_error is not None:
            raise self.render_error
        return await super().render_chat(messages, add_generation_prompt, continue_final_message,
                                         **template_kwargs)

    async def convert_ids_to_tokens(self, token_ids):
        import asyncio

        def convert():
            self.convert_threads.append(threading.current_thread().name)
            return self.tokenizer.convert_ids_to_tokens(token_ids)

        return await asyncio.get_running_loop().run_in_executor(None, convert)


async def _post(engine, path, body):
    app = build_app(engine, served_model_name="fake-model")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.post(path, json=body)


CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_a_template_past_its_deadline_is_a_400_naming_the_flag():
    err = PrepDeadlineError("rendering the chat template took longer than the limit of 5 s "
                            "(--chat-template-timeout)", "chat_template")
    r = await _post(PoolEngine(err), "/v1/chat/completions", CHAT)
    body = assert_openai_error(r, 400)
    assert "--chat-template-timeout" in body["message"]


async def test_a_full_pool_is_a_503_with_retry_after():
    r = await _post(PoolEngine(PrepBusyError("256 requests are already waiting for rendering")),
                    "/v1/chat/completions", CHAT)
    assert_openai_error(r, 503)
    assert r.headers.get("retry-after")


async def test_tokenize_token_strs_come_from_the_engine_off_the_loop():
    engine = PoolEngine()
    r = await _post(engine, "/tokenize", {"model": "fake-model", "prompt": "ab", "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert r.json()["token_strs"] == ["a", "b"]
    assert len(engine.convert_threads) == 1 and engine.convert_threads[0] != threading.main_thread().name
