// The chat page (GET /): talks to this server's /v1/models and /v1/chat/completions from the
// browser, same origin, JSON bodies. No build step, no dependencies. Text goes into the page as
// textContent only, never as HTML.
"use strict";

const KEY_STORAGE = "pagedserve.apiKey";
const $ = (id) => document.getElementById(id);
const conversation = [];  // the conversation sent with each request: {role, content} (answers, not reasoning)
let controller = null;  // the AbortController of the stream in flight

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(text, isError) {
  const el = $("status");
  el.textContent = text || "";
  el.classList.toggle("error", !!isError);
}

async function errorMessage(res) {
  try {
    const body = await res.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON */ }
  return res.status + " " + res.statusText;
}

async function loadModels() {
  const select = $("model");
  const previous = select.value;
  try {
    const res = await fetch("/v1/models", { headers: headers(false) });
    if (res.status === 401) {
      select.replaceChildren();
      setStatus("This server needs an API key: enter it above.", true);
      $("api-key").focus();
      return;
    }
    if (!res.ok) throw new Error(await errorMessage(res));
    const body = await res.json();
    select.replaceChildren(...body.data.map((m) => {
      const option = document.createElement("option");
      option.value = option.textContent = m.id;
      return option;
    }));
    if (previous && body.data.some((m) => m.id === previous)) select.value = previous;
    setStatus("");
  } catch (e) {
    setStatus("Could not list the models: " + e.message, true);
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  if (role === "assistant") {
    const details = document.createElement("details");
    details.className = "reasoning";
    details.hidden = true;
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const thought = document.createElement("div");
    thought.className = "reasoning-text";
    details.append(summary, thought);
    const answer = document.createElement("div");
    answer.className = "answer";
    div.append(details, answer);
  } else {
    div.textContent = text;
  }
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// Server-sent events from a fetch body: yields the data of each event (lines joined by "\n").
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    buffer = buffer.replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(l.startsWith("data: ") ? 6 : 5)).join("\n");
      if (data) yield data;  // comments (": ping") and empty events carry none
    }
  }
}

function showStats(tokens, started, firstAt, now) {
  if (!tokens) { $("stats").textContent = ""; return; }
  const parts = [tokens + " tokens"];
  if (firstAt !== null) {
    parts.push("first token " + Math.round(firstAt - started) + " ms");
    const seconds = (now - firstAt) / 1000;
    if (tokens > 1 && seconds > 0) parts.push(((tokens - 1) / seconds).toFixed(1) + " tokens/s");
  }
  $("stats").textContent = parts.join(" · ");
}

async function send(text) {
  const system = $("system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...conversation,
                    { role: "user", content: text }];
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant");
  const answer = div.querySelector(".answer");
  const details = div.querySelector(".reasoning");
  const thought = div.querySelector(".reasoning-text");
  div.dataset.state = "streaming";
  const body = {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true, continuous_usage_stats: true },
  };
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;

  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("");
  const started = performance.now();
  let firstAt = null, tokens = 0, deltas = 0, content = "";
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(true), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!res.ok) throw new Error(await errorMessage(res));
    for await (const data of sseData(res.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
      const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
      if (delta.reasoning_content) {
        details.hidden = false;
        if (!content) details.open = true;  // thinking: shown while it streams
        thought.textContent += delta.reasoning_content;
      }
      if (delta.content) {
        if (!content && !details.hidden) details.open = false;
        content += delta.content;
        answer.textContent = content;
      }
      if (delta.content || delta.reasoning_content) {
        deltas += 1;
        if (firstAt === null) firstAt = performance.now();
      }
      tokens = chunk.usage ? chunk.usage.completion_tokens : Math.max(tokens, deltas);
      showStats(tokens, started, firstAt, performance.now());
      div.scrollIntoView({ block: "end" });
    }
    div.dataset.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      div.dataset.state = "stopped";
    } else {
      div.dataset.state = "error";
      const err = document.createElement("div");
      err.className = "error";
      err.textContent = e.message;
      div.append(err);
      setStatus(e.message, true);
    }
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    if (content) conversation.push({ role: "assistant", content });
    else conversation.pop();  // nothing came back: the question is not part of the conversation
  }
}

function init() {
  const keyInput = $("api-key");
  keyInput.value = localStorage.getItem(KEY_STORAGE) || "";
  keyInput.addEventListener("change", () => {
    const key = keyInput.value.trim();
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
    loadModels();
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("new-chat").addEventListener("click", () => {
    if (controller) controller.abort();
    conversation.length = 0;
    $("messages").replaceChildren();
    $("stats").textContent = "";
  });
  loadModels();
}

init();
