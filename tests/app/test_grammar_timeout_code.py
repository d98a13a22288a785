"""A grammar compile that runs past --grammar-compile-timeout while its request waits in the core
is its own 400 (code ``grammar_compile_timeout``, the message naming the flag), not
``constraints_unsatisfiable`` (which says the request's constraints admit no token)."""
from __future__ import annotations

import pytest

from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from tests.app.conftest import assert_openai_error

TIMEOUT_TEXT = ("compiling the grammar took longer than the limit of 10 s (--grammar-compile-timeout); "
                "simplify the request or ask the operator to raise the limit")
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


def _failing(engine, error: str, code: str | None):
    def script(call):
        return [RequestOutput(call.request_id, call.prompt, call.prompt_token_ids, None,
                              [CompletionOutput(0, "", [], finish_reason="error")], True,
                              error=error, error_from_request=True, error_code=code)]
    engine.script = script


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": SCHEMA}),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": {"type": "object"}}}),
])
async def test_a_compile_timeout_in_the_core_has_its_own_code(client, engine, path, body):
    _failing(engine, TIMEOUT_TEXT, "grammar_compile_timeout")
    err = assert_openai_error(await client.post(path, json=body), 400)
    assert err["code"] == "grammar_compile_timeout", err
    assert "--grammar-compile-timeout" in err["message"]
    # constraints that admit no token keep their code
    _failing(engine, "no token satisfies this request's constraints together", None)
    err = assert_openai_error(await client.post(path, json=body), 400)
    assert err["code"] == "constraints_unsatisfiable", err


async def test_a_compile_timeout_streamed_has_its_own_code(client, engine):
    import orjson

    _failing(engine, TIMEOUT_TEXT, "grammar_compile_timeout")
    r = await client.post("/v1/completions", json={"prompt": "hi", "stream": True,
                                                   "structured_outputs": {"json": {"type": "object"}}})
    events = [orjson.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    assert errors and errors[0]["code"] == "grammar_compile_timeout", events
