"""Hostile request templates on a real server with --trust-request-chat-template (issue 37 item 3),
under the canary rule of tests/e2e/test_hostile_canary.py: each gets a 400 in OpenAI's format
(param ``chat_template``) well within its deadline, /health polled every 100 ms stays under 1 s
meanwhile, small chats beside it succeed, and the server's process tree grows by less than
200 MiB. On main cd63c87 the first froze /health for 25 s and the second killed the server."""
from __future__ import annotations

import time

import httpx
import pytest

from pagedserve.loadtest import proctree
from tests.e2e.test_hostile_canary import ANSWER_BOUND_S, HEALTH_BOUND_S, POLL_S, RSS_BOUND_MIB, SMALL_CHAT, Watch
from tests.e2e.test_server_e2e import ServerProcess
from tests.engine.test_template_sandbox import HOSTILE

ORDER = ["power", "repeat", "range"] + [n for n in HOSTILE if n not in ("power", "repeat", "range")]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--trust-request-chat-template")
    yield s
    assert s.stop() == 0, s.output()[-4000:]


@pytest.fixture(scope="module")
def watch(server):
    httpx.post(server.url + "/v1/chat/completions", json=SMALL_CHAT, timeout=60)  # warm up
    w = Watch(server.url).start()
    time.sleep(0.5)
    w.rss0_kib = sum(proctree.rss_kib(p) for p in proctree.tree(server.pid))
    yield w
    w.close()


@pytest.mark.parametrize("name", ORDER)
def test_a_hostile_template_is_a_400_and_freezes_nothing(server, watch, name):
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/chat/completions", json={**SMALL_CHAT, "chat_template": HOSTILE[name]},
                   timeout=60)
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text[:500]
    assert r.json()["error"]["param"] == "chat_template"
    assert took < ANSWER_BOUND_S, f"{name}: answered in {took:.2f} s"
    time.sleep(2 * POLL_S)
    slowest = watch.slowest_health(t0)
    print(f"\n{name}: 400 in {took:.3f} s; slowest /health meanwhile {slowest:.3f} s "
          f"({r.json()['error']['message'][:100]})")
    assert slowest < HEALTH_BOUND_S, f"{name}: /health took {slowest:.2f} s"


def test_nested_loops_end_at_their_bound_and_tokenize_renders_too(server, watch):
    nested = "{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{% endfor %}{% endfor %}"
    for path, body in (("/v1/chat/completions", {**SMALL_CHAT, "chat_template": nested}),
                       ("/tokenize", {"messages": SMALL_CHAT["messages"], "chat_template": HOSTILE["repeat"]})):
        t0 = time.monotonic()
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text[:300]
        assert time.monotonic() - t0 < ANSWER_BOUND_S + 1
        time.sleep(2 * POLL_S)
        assert watch.slowest_health(t0) < HEALTH_BOUND_S


def test_the_server_is_healthy_and_bounded_after_them(server, watch):
    time.sleep(0.3)
    rss1 = sum(proctree.rss_kib(p) for p in proctree.tree(server.pid))
    print(f"\n{len(watch.health)} /health polls, slowest {watch.slowest_health():.3f} s; "
          f"{len(watch.chats)} small chats; RSS {watch.rss0_kib // 1024} -> {rss1 // 1024} MiB")
    assert all(s == 200 for _, _, s in watch.health) and watch.chats and all(s == 200 for _, s in watch.chats)
    assert (rss1 - watch.rss0_kib) / 1024 < RSS_BOUND_MIB
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        **SMALL_CHAT, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
    assert ok.status_code == 200, ok.text[:300]
