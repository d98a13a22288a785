"""The chat page (GET /, app/static) in a real browser: Debian's headless Chromium driven by
Selenium through chromedriver, against a real server (the tiny random model) started with
--api-key. The page asks for the key, keeps it in localStorage, lists the served model, streams a
greedy answer into the DOM that equals what the API answers to the same request, shows tokens/s,
stops a long answer with its Stop button, and shows reasoning apart from the answer
(--reasoning-parser). `make install` installs chromium and chromium-driver (apt) and selenium (the
test extra); without them this test skips here, and fails under CI=true, where it must run.

The same server answers `pagedserve chat --url` (app/chat_remote.py), the terminal's chat client.

`python -m tests.e2e.test_chat_page_e2e docs/chat-page.png` takes the README's screenshot with the
default model (SmolLM2-135M-Instruct)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_server_e2e import ServerProcess

KEY = "sk-chat-page"
SYSTEM = "You are a terse assistant."
PROMPT = "Name three rivers."
CHROME_ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--disable-background-networking", "--disable-component-update", "--no-first-run",
               "--window-size=1280,860")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _missing(what: str) -> None:
    msg = (f"{what}: the chat page's browser test needs Debian's chromium and chromium-driver "
           "(apt-get install -y chromium chromium-driver; `make install` does it as root) and selenium "
           "(pip install -e '.[test]')")
    if _in_ci():
        pytest.fail("CI=true: " + msg, pytrace=False)
    pytest.skip(msg)


def start_browser():
    """Headless Chromium under chromedriver (their paths: $CHROMIUM, $CHROMEDRIVER, else on PATH)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing("selenium is not installed")
    browser = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    driver = os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver")
    if not browser or not driver:
        _missing(f"no {'chromium' if not browser else 'chromedriver'} on PATH")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in CHROME_ARGS:
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


def wait_for(condition, timeout: float = 120.0, what: str = "the page"):  # a busy CI box is slow
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


class ChatPage:
    """The page's controls by their ids (app/static/chat.html)."""

    def __init__(self, driver, url: str) -> None:
        self.driver = driver
        driver.get(url + "/")

    def el(self, css: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)

    def text(self, css: str) -> str:
        return self.driver.execute_script("const e = document.querySelector(arguments[0]); "
                                          "return e ? e.textContent : null;", css)

    def fill(self, css: str, value: str) -> None:
        field = self.el(css)
        field.clear()
        field.send_keys(value)

    def models(self) -> list[str]:
        return self.driver.execute_script("return [...document.querySelectorAll('#model option')].map(o => o.value)")

    def set_key(self, key: str) -> None:
        from selenium.webdriver.common.keys import Keys

        self.fill("#api-key", key)
        self.el("#api-key").send_keys(Keys.TAB)  # the change event: stored, models listed again

    def ask(self, text: str, max_tokens: int, temperature: float = 0) -> None:
        self.fill("#system", SYSTEM)
        self.fill("#temperature", str(temperature))
        self.fill("#max-tokens", str(max_tokens))
        self.fill("#prompt", text)
        self.el("#send").click()

    def last_state(self) -> str | None:
        return self.driver.execute_script(
            "const m = document.querySelectorAll('.msg.assistant'); return m.length ? m[m.length - 1].dataset.state : null")


def api_answer(url: str, max_tokens: int) -> dict:
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120, json={
        "model": "tiny", "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]})
    r.raise_for_status()
    return r.json()


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("1", pytest.fail.Exception),
                                         ("", pytest.skip.Exception), ("false", pytest.skip.Exception)])
def test_a_missing_browser_fails_under_ci_and_skips_elsewhere(monkeypatch, ci, outcome):
    monkeypatch.setenv("CI", ci)
    monkeypatch.delenv("CHROMIUM", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(outcome, match="chromium"):
        start_browser()


@pytest.fixture(scope="module")
def browser():
    driver = start_browser()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--api-key", KEY)
    yield s
    assert s.stop() == 0, s.output()


def test_the_page_streams_an_answer_with_the_api_key(browser, server, tmp_path):
    page = ChatPage(browser, server.url)
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    wait_for(lambda: "API key" in (page.text("#status") or ""), what="the page to ask for the key")
    assert page.models() == []
    page.set_key(KEY)
    wait_for(lambda: page.models() == ["tiny"], what="the served model in the list")
    assert browser.execute_script("return localStorage.getItem('pagedserve.apiKey')") == KEY

    expected = api_answer(server.url, 48)
    page.ask(PROMPT, 48)
    wait_for(lambda: page.last_state() in ("done", "error"), what="the answer to end")
    assert page.last_state() == "done", page.text("#status")
    answer = page.text(".msg.assistant .answer")
    assert answer and answer == expected["choices"][0]["message"]["content"]  # greedy: the same tokens
    assert page.text(".msg.user") == PROMPT
    stats = page.text("#stats")
    tokens = expected["usage"]["completion_tokens"]
    assert re.search(rf"\b{tokens} tokens\b", stats) and re.search(r"[0-9.]+ tokens/s", stats), stats
    assert browser.execute_script("return document.querySelector('.msg.assistant .reasoning').hidden")
    shot = tmp_path / "chat-page.png"
    assert browser.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    browser.refresh()  # the key stays in the browser: the model is listed without typing it again
    wait_for(lambda: page.models() == ["tiny"], what="the model listed with the stored key")
    assert page.el("#api-key").get_attribute("value") == KEY


def test_stop_ends_a_long_answer(browser, server):
    page = ChatPage(browser, server.url)
    wait_for(lambda: page.models() == ["tiny"], what="the model list")
    page.ask("Write a very long story.", 1500)  # greedy: the same long reply each run
    wait_for(lambda: len(page.text(".msg.assistant .answer") or "") > 0, what="the first streamed text")
    assert page.el("#stop").is_enabled() and not page.el("#send").is_enabled()
    page.el("#stop").click()
    wait_for(lambda: page.last_state() == "stopped", 10, "the stream to stop")
    assert page.el("#send").is_enabled() and not page.el("#stop").is_enabled()
    stats = page.text("#stats")
    tokens = int(re.search(r"(\d+) tokens", stats).group(1))
    assert 0 < tokens < 1500, stats
    # the server aborted the request: it serves the next one at once
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200


def test_cli_chat_attaches_to_the_server(server):
    """`pagedserve chat --url`: no model loaded, the served one answers, key and all."""
    expected = api_answer(server.url, 12)["choices"][0]["message"]["content"]
    env = {**os.environ, "PAGEDSERVE_API_KEY": "", "OPENAI_API_KEY": ""}
    cmd = [sys.executable, "-m", "pagedserve.app.cli", "chat", "--url", server.url + "/v1", "--system", SYSTEM,
           "--max-tokens", "12"]
    r = subprocess.run([*cmd, "--api-key", KEY], input=PROMPT + "\n\n", capture_output=True, text=True,
                       timeout=120, env=env, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"> {expected}\n> " and "tiny at " in r.stderr  # greedy: the API's answer
    r = subprocess.run(cmd, input=PROMPT + "\n\n", capture_output=True, text=True, timeout=120, env=env,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 1 and "401" in r.stderr, r.stderr


def test_a_refused_request_shows_the_servers_message(browser, server):
    page = ChatPage(browser, server.url)
    wait_for(lambda: page.models() == ["tiny"], what="the model list")
    page.ask(PROMPT, 100_000)  # past the context: a 400 that says so
    wait_for(lambda: page.last_state() == "error", what="the error")
    assert "maximum context length" in page.text("#status")
    assert "maximum context length" in page.text(".msg.assistant .error")
    assert page.el("#send").is_enabled()


@pytest.fixture(scope="module")
def reasoning_server():
    # deepseek_r1: a reply starts inside the thinking, so the random model's reply is all reasoning
    s = ServerProcess("--reasoning-parser", "deepseek_r1")
    yield s
    assert s.stop() == 0, s.output()


def test_reasoning_is_shown_apart_from_the_answer(browser, reasoning_server):
    url = reasoning_server.url
    expected = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]}).json()
    thought = expected["choices"][0]["message"]["reasoning_content"]
    page = ChatPage(browser, url)
    browser.execute_script("localStorage.clear()")  # this server has no key
    browser.refresh()
    wait_for(lambda: page.models() == ["tiny"], what="the model list")
    page.ask(PROMPT, 24)
    wait_for(lambda: page.last_state() == "done", what="the answer to end")
    assert page.text(".msg.assistant .reasoning-text") == thought
    assert not browser.execute_script("return document.querySelector('.msg.assistant .reasoning').hidden")
    assert page.text(".msg.assistant .answer") == (expected["choices"][0]["message"]["content"] or "")


def screenshot(path: str) -> None:
    """The README's screenshot: the default model answering on the page."""
    from pagedserve.loadtest.local_server import LocalServer

    s = LocalServer(["--max-model-len", "2048"], log_prefix="pagedserve-screenshot-")
    driver = start_browser()
    try:
        page = ChatPage(driver, s.url)
        wait_for(lambda: page.models(), what="the model list")
        page.ask("What is a paged KV cache, in two sentences?", 120, temperature=0.2)
        wait_for(lambda: page.last_state() == "done", 300, "the answer")
        driver.save_screenshot(path)
    finally:
        driver.quit()
        s.stop()
    print(json.dumps({"screenshot": path}))


if __name__ == "__main__":
    screenshot(sys.argv[1] if len(sys.argv) > 1 else "docs/chat-page.png")
