"""POST /v1/chat/completions: messages through the chat template to one prompt, choices, and the
chat ``logprobs`` shape (content entries with bytes), full or streamed (role delta first)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.admission import check_choices, check_commitment
from app.beam_requests import beam_kwargs
from app.errors import APIError
from app.fanout import Choice, ClientDisconnected, end_unfinished
from app.prompt_options import check_truncate, chat_echo_text, chat_template_options, truncate_prompt
from app.protocol import ChatCompletionRequest, parse
from app.request_id import response_and_engine_ids
from app.responses import ORJSONResponse
from app.streaming import sse_response
from app.tools import output as tool_output
from app.tools import prompt as tool_prompt
from app.tools.plan import ToolConfig, ToolPlan, build_plan, keeps_special_tokens, structured_outputs_for
from app.structured_args import check_constraint


class ChatRoute:
    """Mixin of OpenAIServer (with RouteBase and ChoiceFanOut); ``chat_prompt`` also serves
    /tokenize with messages."""

    tool_config = ToolConfig()  # the server's tool flags (build_app sets them)

    def template_messages(self, messages: list[Any], tools: list[dict] | None = None,
                          chat_template: str | None = None) -> tuple[list[dict], list[dict] | None]:
        """The conversation and the ``tools`` variable for the chat template (the request's own
        ``chat_template`` or the model's): tools and tool-call turns natively when the template
        knows tools, else written out (app/tools/prompt.py)."""
        template = chat_template or self.engine.tokenizer.chat_template
        native = tool_prompt.template_knows_tools(template)
        out = tool_prompt.template_messages(messages, native)
        if tools and not native:
            return tool_prompt.with_default_tool_prompt(out, tools), None
        return out, tools or None

    async def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                          continue_final_message: bool, add_special_tokens: bool = False,
                          template_options: dict[str, Any] | None = None,
                          tools: list[dict] | None = None, bounded: bool = False,
                          keep: int | None = None) -> tuple[str | None, list[int]]:
        """``template_options`` (app/prompt_options.py) may override the two flags, as vLLM's
        chat_template_kwargs do; ``tools``: the template's tools variable (app/tools/prompt.py).
        ``bounded``: the rendered text must fit the context (a 400 before it is tokenized), or
        with ``keep`` (truncate_prompt_tokens) only its end is tokenized (the text is then None)."""
        from jinja2 import TemplateError

        template_options = dict(template_options or {})
        template_options.setdefault("add_generation_prompt", add_generation_prompt)
        template_options.setdefault("continue_final_message", continue_final_message)
        if tools:
            template_options["tools"] = tools
        try:
            text = await self.engine.render_chat(messages, **template_options)
        except (TemplateError, ValueError) as e:
            param = "chat_template" if "chat_template" in template_options else "messages"
            raise APIError.bad_request(f"the chat template could not render these messages: {e}",
                                       param=param) from None
        if bounded:
            fitted = self.fit_text(text, "messages", keep, "the conversation rendered by the chat template")
            text = text if fitted is text else None
        else:
            fitted = text
        ids = await self.engine.encode(fitted, add_special_tokens=add_special_tokens)
        return text, list(ids)

    async def chat_completions(self, request: Request) -> Response:
        req = parse(ChatCompletionRequest, await self.read_admitted(request, "chat"))
        req.check_supported()
        check_choices(req, 1, self.limits)
        check_truncate(req.truncate_prompt_tokens, self.engine.max_model_len)
        options = chat_template_options(req, self.trust_request_chat_template)
        self.check_model(req.model)  # after the body: what the schema refuses is a 400 first
        template = options.get("chat_template") or self.engine.tokenizer.chat_template
        plan = build_plan(req, self.tool_config, template)
        messages, tools = self.template_messages(req.messages, plan.tools, options.get("chat_template"))
        text, ids = await self.chat_prompt(
            messages, req.add_generation_prompt, req.continue_final_message, req.add_special_tokens,
            options, tools, bounded=True, keep=req.truncate_prompt_tokens)
        kept = truncate_prompt(ids, req.truncate_prompt_tokens)
        if len(kept) < len(ids):
            text, ids = None, kept
        requested = req.requested_max_tokens()
        try:
            max_tokens = self.max_tokens_for(len(ids), requested, None)
        except APIError as e:
            if req.max_completion_tokens is not None and e.param == "max_tokens":
                e.param = "max_completion_tokens"
            if e.param == "prompt":
                e.param = "messages"
            raise
        check_commitment(req, [len(ids)], [max_tokens], self.limits,
                         "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens")
        kw = req.sampling_kwargs()
        kw.update(beam_kwargs(req))  # use_beam_search (app/beam_requests.py)
        if plan.schema is not None:
            kw["structured_outputs"] = structured_outputs_for(plan)
        if keeps_special_tokens(plan, self.engine.tokenizer):
            kw["skip_special_tokens"] = False
        top = req.top_logprobs or 0
        if req.logprobs:
            kw["logprobs"] = top
        if req.prompt_logprobs is not None:
            kw["prompt_logprobs"] = req.prompt_logprobs
        request_id, engine_id = response_and_engine_ids(request, "chatcmpl", req.request_id)
        choices = self.make_choices(engine_id, [(text, ids)], req.n, kw, [max_tokens], req.seed,
                                    share_prompt_logprobs=True)  # the body has them once
        created = int(time.time())
        await check_constraint(self.engine, choices[0].params,
                               "tools" if plan.schema is not None else req.constraint_param())
        streams = await self.start(choices, req.priority, req.cache_salt)
        if req.stream:
            return sse_response(self.chat_stream(req, choices, streams, request_id, created, top, plan), streams,
                                on_close=lambda: end_unfinished(choices, ClientDisconnected()),
                                ping_interval=self.sse_ping_interval)
        body = await self.until_disconnect(
            request, self.chat_full(req, choices, streams, request_id, created, top, plan), streams, choices)
        return ORJSONResponse(body)

    def chat_logprobs(self, entries: list, k: int, as_ids: bool | None = False) -> dict[str, list]:
        content = []
        for tid, lp, top in entries:
            content.append({
                "token": self.logprob_token(tid, as_ids), "logprob": lp, "bytes": self.token_bytes(tid),
                "top_logprobs": [{"token": self.logprob_token(t, as_ids), "logprob": v,
                                  "bytes": self.token_bytes(t)} for t, v in top[:k]],
            })
        return {"content": content}

    async def chat_full(self, req: ChatCompletionRequest, choices: list[Choice], streams: list[Any],
                        request_id: str, created: int, top: int, plan: ToolPlan = ToolPlan()) -> dict[str, Any]:
        async for c, comp, new_ids in self.run(choices, streams):
            if req.logprobs:
                c.logprobs.extend(self.new_logprobs(comp, new_ids))
        out = []
        echo = chat_echo_text(req)
        as_ids = req.return_tokens_as_token_ids
        for c in choices:
            message, finish = {"role": "assistant", "content": echo + "".join(c.text)}, c.finish_reason
            if plan.active:
                message, finish = tool_output.full_message(plan, "".join(c.text), finish)
                if echo:  # as streamed: the echo goes first, as content
                    message["content"] = echo + (message["content"] or "")
            out.append({"index": c.index, "message": message,
                        "logprobs": self.chat_logprobs(c.logprobs, top, as_ids) if req.logprobs else None,
                        "finish_reason": finish, "stop_reason": c.stop_reason})
        prompt_logprobs = None
        if req.prompt_logprobs is not None:  # one prompt: vLLM puts them beside the choices
            prompt_logprobs = self.prompt_logprobs_body(choices[0].prompt_logprobs, choices[0].prompt_ids,
                                                        req.prompt_logprobs, as_ids)
        return {"id": request_id, "object": "chat.completion", "created": created,
                "model": self.model_name, "choices": out, "usage": self.usage(choices),
                "system_fingerprint": None, "prompt_logprobs": prompt_logprobs}

    async def chat_stream(self, req: ChatCompletionRequest, choices: list[Choice], streams: list[Any],
                          request_id: str, created: int, top: int,
                          plan: ToolPlan = ToolPlan()) -> AsyncIterator[dict[str, Any]]:
        tool_deltas = {c.index: tool_output.ToolDeltas(plan) for c in choices} if plan.active else None
        usage_field = {"usage": None} if req.include_usage else {}
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        # Each choice's role chunk goes out with its first output, not before the engine has
        # produced anything (benchmark clients time TTFT at the first chunk with choices).
        role_sent: set[int] = set()
        echo = chat_echo_text(req)
        async for c, comp, new_ids in self.run(choices, streams):
            if c.index not in role_sent:
                role_sent.add(c.index)
                yield {**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], **usage_field}
                if echo:
                    yield {**head, "choices": [{"index": c.index, "delta": {"content": echo},
                                                "logprobs": None, "finish_reason": None}], **usage_field}
            text = comp.text
            logprobs = None
            if req.logprobs:
                logprobs = self.chat_logprobs(self.new_logprobs(comp, new_ids), top,
                                              req.return_tokens_as_token_ids)
            delta, finish = ({"content": text} if text else {}), c.finish_reason
            if tool_deltas is not None:
                delta, finish = tool_deltas[c.index].delta(text, finish)
            if not delta and finish is None and not (logprobs and logprobs["content"]):
                continue
            choice: dict[str, Any] = {"index": c.index, "delta": delta,
                                      "logprobs": logprobs, "finish_reason": finish}
            if c.finish_reason is not None:
                choice["stop_reason"] = c.stop_reason
            yield {**head, "choices": [choice], **usage_field}
        if req.include_usage:
            yield {**head, "choices": [], "usage": self.usage(choices)}
