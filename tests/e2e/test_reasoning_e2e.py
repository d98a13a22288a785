"""--reasoning-parser on a real server (tiny random model, the default model's ChatML template, which
opens no think block): with deepseek_r1 a reply starts inside the thinking, so a random reply without
</think> is all reasoning; streamed reasoning deltas join to the non-streamed reasoning_content, on
chat and on /v1/responses."""
from __future__ import annotations

import openai
import pytest

from tests.e2e.test_server_e2e import ServerProcess

USER = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def client():
    s = ServerProcess("--reasoning-parser", "deepseek_r1")
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    assert s.stop() == 0, s.output()


def test_chat_reasoning_streamed_and_not(client):
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, temperature=0)
    msg = r.choices[0].message
    thought = msg.model_extra["reasoning_content"]
    assert thought and msg.model_extra["reasoning"] == thought
    joined = "".join(ch.choices[0].delta.model_extra.get("reasoning_content") or ""
                     for ch in client.chat.completions.create(model="tiny", messages=USER, max_tokens=16,
                                                              temperature=0, stream=True) if ch.choices)
    assert joined == thought  # greedy: the same tokens, split the same way
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, temperature=0,
                                       extra_body={"include_reasoning": False})
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


def test_responses_reasoning_item(client):
    r = client.responses.create(model="tiny", input="What is 2 + 2?", max_output_tokens=16, temperature=0)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens  # never closed
    events = list(client.responses.create(model="tiny", input="What is 2 + 2?", max_output_tokens=16,
                                          temperature=0, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == r.output[0].content[0].text
