"""POST /v1/chat/completions: messages through the chat template to one prompt, choices, and the
chat ``logprobs`` shape (content entries with bytes), full or streamed (role delta first)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagedserve.app.admission import check_choices, check_commitment
from pagedserve.app.beam_requests import beam_kwargs
from pagedserve.app.errors import APIError
from pagedserve.app.chat_prompt import ChatPrompts
from pagedserve.app.fanout import Choice, ChoiceFanOut, ClientDisconnected, end_unfinished
from pagedserve.app.logprob_format import LogprobFormat
from pagedserve.app.prompt_options import check_truncate, chat_echo_text, chat_template_options, truncate_prompt
from pagedserve.app.protocol import ChatCompletionRequest, parse
from pagedserve.app.reasoning import output as reasoning_output
from pagedserve.app.reasoning.output import ReasoningDeltas, ReasoningPlan
from pagedserve.app.request_checks import RequestChecks
from pagedserve.app.request_id import response_and_engine_ids
from pagedserve.app.responses import ORJSONResponse
from pagedserve.app.streaming import DEFAULT_SSE_PING_INTERVAL, sse_response
from pagedserve.app.tools import output as tool_output
from pagedserve.app.tools.plan import ToolConfig, ToolPlan, build_plan, keeps_special_tokens, structured_outputs_for
from pagedserve.app.structured_args import check_constraint
from pagedserve.engine.client import EngineClient


@dataclass(slots=True)
class ChatStart:
    """A conversation's engine requests, started, and what reading their output needs."""

    choices: list[Choice]
    streams: list[Any]
    request_id: str
    created: int
    top: int  # top_logprobs
    plan: ToolPlan
    reasoning: ReasoningPlan


class ChatRoute:
    """POST /v1/chat/completions over its collaborators: the request checks, the chat prompts,
    the fan-out of choices and the logprob format."""

    def __init__(self, engine: EngineClient, served_model_name: str, checks: RequestChecks,
                 prompts: ChatPrompts, fanout: ChoiceFanOut, logprob_format: LogprobFormat,
                 tool_config: ToolConfig = ToolConfig(), sse_ping_interval: float = DEFAULT_SSE_PING_INTERVAL,
                 trust_request_chat_template: bool = False, reasoning_parser: str | None = None) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.checks = checks
        self.prompts = prompts
        self.fanout = fanout
        self.logprob_format = logprob_format
        self.tool_config = tool_config  # the server's tool flags (--enable-auto-tool-choice, ...)
        self.sse_ping_interval = sse_ping_interval  # seconds between SSE comment pings; 0 = none
        self.trust_request_chat_template = trust_request_chat_template  # a request's own template is rendered
        self.reasoning_parser = reasoning_parser  # --reasoning-parser: <think> apart from the answer

    async def chat_completions(self, request: Request) -> Response:
        req = parse(ChatCompletionRequest, await self.checks.read_admitted(request, "chat"))
        run = await self.start(request, req, "chatcmpl")
        choices, streams, top = run.choices, run.streams, run.top
        request_id, created, plan, reasoning = run.request_id, run.created, run.plan, run.reasoning
        if req.stream:
            return sse_response(self.chat_stream(req, choices, streams, request_id, created, top, plan, reasoning),
                                streams,
                                on_close=lambda: end_unfinished(choices, ClientDisconnected()),
                                ping_interval=self.sse_ping_interval)
        body = await self.fanout.until_disconnect(
            request, self.chat_full(req, choices, streams, request_id, created, top, plan, reasoning), streams,
            choices)
        return ORJSONResponse(body)

    async def start(self, request: Request, req: ChatCompletionRequest, id_prefix: str) -> ChatStart:
        """Checks, the prompt, the sampling settings and the engine requests of one conversation
        (shared with /v1/responses, which speaks through a ChatCompletionRequest)."""
        req.check_supported()
        check_choices(req, 1, self.checks.limits)
        check_truncate(req.truncate_prompt_tokens, self.engine.max_model_len)
        options = chat_template_options(req, self.trust_request_chat_template)
        lora = self.checks.check_model(req.model)  # after the body: what the schema refuses is a 400 first
        template = options.get("chat_template") or self.engine.tokenizer.chat_template
        plan = build_plan(req, self.tool_config, template)
        messages, tools = await self.prompts.template_messages(req.messages, plan.tools, options.get("chat_template"))
        text, ids = await self.prompts.chat_prompt(
            messages, req.add_generation_prompt, req.continue_final_message, req.add_special_tokens,
            options, tools, bounded=True, keep=req.truncate_prompt_tokens)
        reasoning = self.reasoning_plan(text, req.include_reasoning)
        kept = truncate_prompt(ids, req.truncate_prompt_tokens)
        if len(kept) < len(ids):
            text, ids = None, kept
        requested = req.requested_max_tokens()
        try:
            max_tokens = self.checks.max_tokens_for(len(ids), requested, None)
        except APIError as e:
            if req.max_completion_tokens is not None and e.param == "max_tokens":
                e.param = "max_completion_tokens"
            if e.param == "prompt":
                e.param = "messages"
            raise
        check_commitment(req, [len(ids)], [max_tokens], self.checks.limits,
                         "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens")
        kw = {**self.engine.sampling_defaults, **req.sampling_kwargs()}  # the request's own fields win
        kw.update(beam_kwargs(req))  # use_beam_search (app/beam_requests.py)
        if plan.schema is not None:
            kw["structured_outputs"] = structured_outputs_for(plan)
        if kw.get("structured_outputs") is not None:  # the grammar binds the answer, after the thinking
            kw["structured_outputs"].start_after = reasoning_output.grammar_start(reasoning)
        if (keeps_special_tokens(plan, self.engine.tokenizer)
                or reasoning_output.keeps_special_tokens(reasoning, self.engine.tokenizer)):
            kw["skip_special_tokens"] = False
        top = req.top_logprobs or 0
        if req.logprobs:
            kw["logprobs"] = top
        if req.prompt_logprobs is not None:
            kw["prompt_logprobs"] = req.prompt_logprobs
        request_id, engine_id = response_and_engine_ids(request, id_prefix, req.request_id)
        choices = self.fanout.make_choices(engine_id, [(text, ids)], req.n, kw, [max_tokens], req.seed,
                                    share_prompt_logprobs=True)  # the body has them once
        created = int(time.time())
        await check_constraint(self.engine, choices[0].params,
                               "tools" if plan.schema is not None else req.constraint_param())
        streams = await self.fanout.start(choices, req.priority, req.cache_salt, lora)
        return ChatStart(choices, streams, request_id, created, top, plan, reasoning)

    def reasoning_plan(self, prompt: str | None, include: bool = True) -> ReasoningPlan:
        """The request's reasoning split (``prompt``: the rendered conversation, which may open or
        close the thinking)."""
        if self.reasoning_parser is None:
            return ReasoningPlan()
        return ReasoningPlan(self.reasoning_parser, prompt, include)

    def chat_logprobs(self, entries: list, k: int, as_ids: bool | None = False) -> dict[str, list]:
        content = []
        for tid, lp, top in entries:
            fmt = self.logprob_format
            content.append({
                "token": fmt.logprob_token(tid, as_ids), "logprob": lp, "bytes": fmt.token_bytes(tid),
                "top_logprobs": [{"token": fmt.logprob_token(t, as_ids), "logprob": v,
                                  "bytes": fmt.token_bytes(t)} for t, v in top[:k]],
            })
        return {"content": content}

    async def chat_full(self, req: ChatCompletionRequest, choices: list[Choice], streams: list[Any],
                        request_id: str, created: int, top: int, plan: ToolPlan = ToolPlan(),
                        reasoning: ReasoningPlan = ReasoningPlan()) -> dict[str, Any]:
        async for c, comp, new_ids in self.fanout.run(choices, streams):
            if req.logprobs:
                c.logprobs.extend(self.fanout.new_logprobs(comp, new_ids))
        out = []
        echo = chat_echo_text(req)
        as_ids = req.return_tokens_as_token_ids
        for c in choices:
            thought, answer = reasoning_output.split_whole(reasoning, "".join(c.text))
            message, finish = {"role": "assistant", "content": echo + answer}, c.finish_reason
            if plan.active:
                message, finish = tool_output.full_message(plan, answer, finish)
                if echo:  # as streamed: the echo goes first, as content
                    message["content"] = echo + (message["content"] or "")
            if thought is not None:  # vLLM: no answer after the reasoning is a null content
                message["content"] = message["content"] or None
                message.update(reasoning.fields(thought))
            out.append({"index": c.index, "message": message,
                        "logprobs": self.chat_logprobs(c.logprobs, top, as_ids) if req.logprobs else None,
                        "finish_reason": finish, "stop_reason": c.stop_reason})
        prompt_logprobs = None
        if req.prompt_logprobs is not None:  # one prompt: vLLM puts them beside the choices
            prompt_logprobs = self.logprob_format.prompt_logprobs_body(
                choices[0].prompt_logprobs, choices[0].prompt_ids, req.prompt_logprobs, as_ids)
        return {"id": request_id, "object": "chat.completion", "created": created,
                "model": self.model_name, "choices": out, "usage": self.fanout.usage(choices),
                "system_fingerprint": None, "prompt_logprobs": prompt_logprobs}

    async def chat_stream(self, req: ChatCompletionRequest, choices: list[Choice], streams: list[Any],
                          request_id: str, created: int, top: int,
                          plan: ToolPlan = ToolPlan(),
                          reasoning: ReasoningPlan = ReasoningPlan()) -> AsyncIterator[dict[str, Any]]:
        tool_deltas = {c.index: tool_output.ToolDeltas(plan) for c in choices} if plan.active else None
        thinking = {c.index: ReasoningDeltas(reasoning) for c in choices} if reasoning.active else None
        def usage_field() -> dict[str, Any]:  # continuous_usage_stats: the usage so far on every chunk
            if req.continuous_usage:
                return {"usage": self.fanout.usage(choices)}
            return {"usage": None} if req.include_usage else {}

        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        # Each choice's role chunk goes out with its first output, not before the engine has
        # produced anything (benchmark clients time TTFT at the first chunk with choices).
        role_sent: set[int] = set()
        echo = chat_echo_text(req)
        async for c, comp, new_ids in self.fanout.run(choices, streams):
            if c.index not in role_sent:
                role_sent.add(c.index)
                yield {**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], **usage_field()}
                if echo:
                    yield {**head, "choices": [{"index": c.index, "delta": {"content": echo},
                                                "logprobs": None, "finish_reason": None}], **usage_field()}
            text = comp.text
            logprobs = None
            if req.logprobs:
                logprobs = self.chat_logprobs(self.fanout.new_logprobs(comp, new_ids), top,
                                              req.return_tokens_as_token_ids)
            thought = ""
            if thinking is not None:  # the answer part goes on to the tool parser
                split = thinking[c.index].split(text, c.finish_reason is not None)
                thought, text = split.reasoning, split.content
            delta, finish = ({"content": text} if text else {}), c.finish_reason
            if tool_deltas is not None:
                delta, finish = tool_deltas[c.index].delta(text, finish)
            if thought:
                delta = {**reasoning.fields(thought), **delta}
            if not delta and finish is None and not (logprobs and logprobs["content"]):
                continue
            choice: dict[str, Any] = {"index": c.index, "delta": delta,
                                      "logprobs": logprobs, "finish_reason": finish}
            if c.finish_reason is not None:
                choice["stop_reason"] = c.stop_reason
            yield {**head, "choices": [choice], **usage_field()}
        if req.include_usage:
            yield {**head, "choices": [], "usage": self.fanout.usage(choices)}
