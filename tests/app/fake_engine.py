"""A tokenizer-free stand-in for engine.async_engine.AsyncEngine: an engine.client.EngineClient
(tests/engine/test_client_protocol.py checks it against the protocol).

Tokens are bytes: encode(text) = the UTF-8 bytes, decode(ids) = bytes(ids) decoded. A request
generates a scripted reply one token (byte) per delta, honouring max_tokens, stop strings,
logprobs and prompt_logprobs, so routes can be checked exactly without a model.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pagedserve.contracts.config import EngineConfig, ModelConfig
from pagedserve.engine.errors import EngineDeadError, EngineOverloadedError, RequestRejectedError
from pagedserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams


class FakeTokenizer:
    vocab_size = 256
    eos_token_ids = [0]
    all_special_ids = frozenset()
    chat_template: str | None = None
    max_token_chars: int | None = None  # no bound on a text prompt before it is tokenized

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([i]) for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])  # a token is a byte: 0xE2 alone is part of a character

    def token_to_id(self, token: str) -> int | None:
        return None


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_worker_restarts: int = 0
    lora_running: tuple = ()
    lora_waiting: tuple = ()
    max_lora: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


@dataclass
class Call:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    prompt: str | None
    priority: int
    cache_salt: str | None = None


class FakeStream:
    def __init__(self, engine: "FakeAsyncEngine", call: Call) -> None:
        self.engine = engine
        self.call = call
        self.outputs = engine.script(call)
        self.pos = 0
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.closed or self.pos >= len(self.outputs):
            raise StopAsyncIteration
        try:
            if self.pos == 0 and self.engine.first_output_gate is not None:
                await self.engine.first_output_gate.wait()  # the engine has not produced yet
            if self.engine.delay:
                await asyncio.sleep(self.engine.delay)
            else:
                await asyncio.sleep(0)
            if self.engine.fail_after is not None and self.pos >= self.engine.fail_after:
                raise EngineDeadError("the engine stopped: worker died")
        except BaseException:
            await self.aclose()
            raise
        out = self.outputs[self.pos]
        self.pos += 1
        if out.finished:
            self.closed = True
            self.engine.running.discard(self.call.request_id)
        return out

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.running.discard(self.call.request_id)
            self.engine.aborted.append(self.call.request_id)


class FakeAsyncEngine:
    def __init__(self, reply: str = "Hello world, this is a fake reply.", max_model_len: int = 128,
                 model_name: str = "fake-model") -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.config = EngineConfig(model=ModelConfig(max_model_len=max_model_len, served_model_name=model_name))
        self.num_deaths = 0
        self.tokenizer = FakeTokenizer()
        self.reply = reply
        self.calls: list[Call] = []
        self.aborted: list[str] = []
        self.running: set[str] = set()
        self.delay = 0.0
        self.first_output_gate: asyncio.Event | None = None
        self.fail_after: int | None = None
        self.pool_error: str | None = None  # pooling requests fail with this engine error
        self.overloaded = False
        self.dead = False
        self.reject: str | None = None
        self.stats_value = FakeStats()
        self.chat_calls: list[tuple] = []
        self.chat_tools: list = []  # the tools variable of each render_chat
        self.template_kwargs: list[dict] = []
        self.encode_calls: list[tuple[str, bool]] = []
        self.num_blocks = 64
        self.sampling_defaults: dict = {}  # the model's recommended sampling fields (--generation-config)

    async def start(self) -> None:
        pass

    async def shutdown(self, timeout_s: float = 0.0) -> None:
        pass

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encode_calls.append((text, add_special_tokens))
        return self.tokenizer.encode(text, add_special_tokens)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens)

    async def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str | None]:
        return self.tokenizer.convert_ids_to_tokens(token_ids)

    async def check_constraint(self, params) -> None:
        """Every constraint is accepted (the fake has no grammar engine)."""

    async def render_chat(self, messages, add_generation_prompt=True, continue_final_message=False,
                          **template_kwargs) -> str:
        self.chat_calls.append((messages, add_generation_prompt, continue_final_message))
        self.template_kwargs.append(template_kwargs)
        tools = template_kwargs.get("tools")
        self.chat_tools.append(tools)
        if tools is None and any(m["role"] == "tool" for m in messages):  # a template without tools
            raise ValueError("tool messages are not in this template")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if continue_final_message:
            text = text[:-1]
        if add_generation_prompt:
            text += "<assistant>"
        return text

    def generate(self, prompt_token_ids, params, request_id, prompt=None, priority=0,
                 cache_salt=None, lora_request=None) -> FakeStream:
        if self.dead:
            raise EngineDeadError("the engine stopped: test")
        if self.overloaded:
            raise EngineOverloadedError("3 requests are already waiting; retry shortly")
        if self.reject:
            raise RequestRejectedError(self.reject)
        assert isinstance(params, SamplingParams)
        call = Call(list(prompt_token_ids), params, request_id, prompt, priority, cache_salt)
        self.calls.append(call)
        self.running.add(request_id)
        return FakeStream(self, call)

    embedding_size = 8

    def pool(self, prompt_token_ids, params, request_id, prompt=None, priority=0,
             cache_salt=None) -> FakeStream:
        """A pooling request: one final output whose vector is ``fake_vector(ids, params)``."""
        from pagedserve.engine.pooling_params import PoolingParams

        if self.dead:
            raise EngineDeadError("the engine stopped: test")
        if self.overloaded:
            raise EngineOverloadedError("3 requests are already waiting; retry shortly")
        if self.reject:
            raise RequestRejectedError(self.reject)
        assert isinstance(params, PoolingParams)
        call = Call(list(prompt_token_ids), params, request_id, prompt, priority, cache_salt)
        self.calls.append(call)
        self.running.add(request_id)
        return FakeStream(self, call)

    def check_lora(self, lora_request) -> None:
        raise RequestRejectedError("LoRA is not enabled on the fake engine")

    def lora_requests_in_use(self, lora_int_id: int) -> int:
        return 0

    def forget_lora(self, lora_int_id: int) -> None:
        pass

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def is_healthy(self) -> bool:
        return not self.dead

    def health_status(self) -> str:
        return "dead" if self.dead else "ok"

    def replica_states(self) -> None:
        return None

    def stats(self) -> FakeStats:
        return self.stats_value

    @staticmethod
    def fake_vector(ids: list[int], params) -> list[float]:
        """Deterministic per input: value k is the mean of (t * (k + 1)) % 7 - 3 over the ids."""
        vec = [sum((t * (k + 1)) % 7 - 3 for t in ids) / len(ids) for k in range(FakeAsyncEngine.embedding_size)]
        if params.dimensions is not None:
            vec = vec[: params.dimensions]
        if params.normalize:
            norm = sum(v * v for v in vec) ** 0.5 or 1.0
            vec = [v / norm for v in vec]
        return vec

    def pooled(self, call: Call):
        from pagedserve.engine.pooling_outputs import PoolingOutput, PoolingRequestOutput, bytes_from_floats

        if self.pool_error is not None:  # a worker error on this request's step
            return PoolingRequestOutput(call.request_id, None, call.prompt_token_ids, True, call.prompt,
                                        "error", error=self.pool_error)
        vec = bytes_from_floats(self.fake_vector(call.prompt_token_ids, call.params))
        return PoolingRequestOutput(call.request_id, PoolingOutput(vec), call.prompt_token_ids, True,
                                    call.prompt, "stop")

    def reply_for(self, call: Call) -> str:
        """Sample i of a request answers the reply with its index in front (distinct choices)."""
        index = int(call.request_id.rsplit("-", 1)[1])
        return (f"[{index}] " if index else "") + self.reply

    def script(self, call: Call) -> list[RequestOutput]:
        p = call.params
        if not isinstance(p, SamplingParams):
            return [self.pooled(call)]
        ids = list(self.reply_for(call).encode("utf-8"))
        finish, stop_reason = "stop", None
        text = bytes(ids).decode("utf-8", errors="replace")
        for s in p.stop_strings:
            at = text.find(s)
            if at >= 0:
                keep = at + (len(s) if p.include_stop_str_in_output else 0)
                ids = list(text[:keep].encode("utf-8"))
                finish, stop_reason = "stop", s
                break
        if p.max_tokens is not None and len(ids) > p.max_tokens:
            ids = ids[: p.max_tokens]
            finish, stop_reason = "length", None
        metrics = RequestMetrics(arrival_time=time.monotonic(), first_scheduled_time=time.monotonic())
        prompt_lps = None
        if p.prompt_logprobs is not None:
            prompt_lps = [None] + [{t: Logprob(-1.0, 1)} for t in call.prompt_token_ids[1:]]
        outs = []
        for k, tid in enumerate(ids):
            lps = None
            if p.logprobs is not None:
                # the sampled token ranks first; the top-N set is it plus N - 1 alternatives
                entry = {tid: Logprob(-0.25, 1)}
                for j in range(p.logprobs - 1):
                    alt = 65 + j  # 'A', 'B', ...
                    if alt != tid:
                        entry[alt] = Logprob(-2.0 - j, j + 2)
                lps = [entry]
            last = k == len(ids) - 1
            comp = CompletionOutput(0, bytes([tid]).decode("utf-8", errors="replace"), [tid],
                                    logprobs=lps, finish_reason=finish if last else None,
                                    stop_reason=stop_reason if last else None)
            outs.append(RequestOutput(call.request_id, call.prompt, call.prompt_token_ids,
                                      prompt_lps if k == 0 else None, [comp], last, metrics))
        if not ids:
            comp = CompletionOutput(0, "", [], logprobs=[] if p.logprobs is not None else None,
                                    finish_reason=finish, stop_reason=stop_reason)
            outs.append(RequestOutput(call.request_id, call.prompt, call.prompt_token_ids,
                                      prompt_lps, [comp], True, metrics))
        return outs
