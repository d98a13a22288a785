"""POST /v1/responses: the request becomes the chat request it means (app/responses_api/items.py)
and runs on the chat route's path (``ChatRoute.start``: template, tools, reasoning split, sampling,
engine requests); the reply comes back as output items, whole or as typed SSE events
(``response.created`` ... ``response.completed``). Nothing is stored: ``previous_response_id`` is
a 400."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagedserve.app.chat_route import ChatRoute, ChatStart
from pagedserve.app.errors import APIError, to_api_error
from pagedserve.app.fanout import ChoiceFanOut, ClientDisconnected, end_unfinished
from pagedserve.app.protocol import ChatCompletionRequest, parse
from pagedserve.app.reasoning.output import ReasoningDeltas, split_whole
from pagedserve.app.responses import ORJSONResponse
from pagedserve.app.responses_api.items import PARAM_NAMES, chat_body
from pagedserve.app.responses_api.output import Event, OutputItems
from pagedserve.app.responses_api.protocol import ResponsesRequest
from pagedserve.app.streaming import DEFAULT_SSE_PING_INTERVAL, sse_response, typed_sse_event
from pagedserve.app.tools.calls import CallDelta, ParsedDelta
from pagedserve.app.tools.parsers import parse_whole


class ResponsesRoute:
    def __init__(self, chat: ChatRoute, sse_ping_interval: float = DEFAULT_SSE_PING_INTERVAL) -> None:
        self.chat = chat
        self.sse_ping_interval = sse_ping_interval

    async def responses(self, request: Request) -> Response:
        req = parse(ResponsesRequest, await self.chat.checks.read_admitted(request, "responses"))
        req.check_supported()
        try:
            chat_req = parse(ChatCompletionRequest, chat_body(req))
            run = await self.chat.start(request, chat_req, "resp")
        except APIError as e:  # name the field as this request named it
            head, _, rest = (e.param or "").partition(".")
            if head in PARAM_NAMES:
                e.param = PARAM_NAMES[head] + ("." + rest if rest else "")
            raise
        reply = Reply(req, run, self.chat.model_name, self.chat.fanout)
        if req.stream:
            return sse_response(reply.events(self.chat.fanout), run.streams,
                                on_close=lambda: end_unfinished(run.choices, ClientDisconnected()),
                                ping_interval=self.sse_ping_interval, frame=typed_sse_event, done=None)
        body = await self.chat.fanout.until_disconnect(request, reply.whole(self.chat.fanout), run.streams,
                                                       run.choices)
        return ORJSONResponse(body)


class Reply:
    """One response: its engine request (one choice) read into output items."""

    def __init__(self, req: ResponsesRequest, run: ChatStart, model_name: str, fanout: ChoiceFanOut) -> None:
        self.req = req
        self.run = run
        self.model_name = model_name
        self.fanout = fanout  # what usage may tell (ChoiceFanOut.cached_tokens)
        self.items = OutputItems()
        self.reasoning_tokens = 0  # tokens generated before the reasoning ended

    async def whole(self, fanout: ChoiceFanOut) -> dict[str, Any]:
        counter = ReasoningDeltas(self.run.reasoning) if self.run.reasoning.active else None
        async for c, comp, new_ids in fanout.run(self.run.choices, self.run.streams):
            self._count(counter, comp.text, len(new_ids), c.finish_reason is not None)
        c = self.run.choices[0]
        thought, answer = split_whole(self.run.reasoning, "".join(c.text))
        if thought and self.run.reasoning.include:
            self.items.reasoning(thought)
        plan = self.run.plan
        content, calls = answer, []
        if plan.active:
            parser = plan.new_parser()
            content, calls = parse_whole(parser, answer)
            if plan.mode == "auto" and parser.failed:
                content, calls = answer, []  # as chat: calls that do not parse come back as text
        self.items.text(content)  # as streamed: any text the parser released, even before calls
        for i, call in enumerate(calls):
            fn = call["function"]
            self.items.call(CallDelta(i, call["id"], fn["name"], fn["arguments"]))
        status = self._status()
        self.items.close("incomplete" if status == "incomplete" else "completed")
        return self.body(status)

    async def events(self, fanout: ChoiceFanOut) -> AsyncIterator[Event]:
        seq = 0

        def numbered(event: Event) -> Event:
            nonlocal seq
            event["sequence_number"] = seq
            seq += 1
            return event

        yield numbered({"type": "response.created", "response": self.body("in_progress")})
        yield numbered({"type": "response.in_progress", "response": self.body("in_progress")})
        plan, reasoning = self.run.plan, self.run.reasoning
        thinking = ReasoningDeltas(reasoning) if reasoning.active else None
        counter = ReasoningDeltas(reasoning) if reasoning.active else None
        parser = plan.new_parser() if plan.active else None
        try:
            async for c, comp, new_ids in fanout.run(self.run.choices, self.run.streams):
                finished = c.finish_reason is not None
                self._count(counter, comp.text, len(new_ids), finished)
                text, out = comp.text, []
                if thinking is not None:
                    split = thinking.split(text, finished)
                    text = split.content
                    if reasoning.include:
                        out += self.items.reasoning(split.reasoning)
                if parser is None:
                    out += self.items.text(text)
                else:
                    d = parser.feed(text) if text else ParsedDelta()
                    if finished:
                        tail = parser.finish()
                        d.content += tail.content
                        d.calls += tail.calls
                    out += self.items.text(d.content)
                    for call in d.calls:
                        out += self.items.call(call)
                for event in out:
                    yield numbered(event)
            status = self._status()
            for event in self.items.close("incomplete" if status == "incomplete" else "completed"):
                yield numbered(event)
            yield numbered({"type": f"response.{status}", "response": self.body(status)})
        except Exception as e:  # noqa: BLE001 - reported in the stream, as OpenAI's error event
            err = to_api_error(e)
            yield numbered({"type": "error", "code": err.code, "message": err.message, "param": err.param})

    def _count(self, counter: ReasoningDeltas | None, text: str, num_tokens: int, finished: bool) -> None:
        if counter is not None and not counter.parser.ended:
            self.reasoning_tokens += num_tokens
            counter.split(text, finished)

    def _status(self) -> str:
        return "incomplete" if self.run.choices[0].finish_reason == "length" else "completed"

    def body(self, status: str) -> dict[str, Any]:
        req, c = self.req, self.run.choices[0]
        params = c.params
        fmt = req.text.format if req.text is not None else None
        usage = None
        if status != "in_progress":
            output = len(c.token_ids)
            cached = self.fanout.cached_tokens(c, req.cache_salt)
            usage = {"input_tokens": len(c.prompt_ids), "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens": output, "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                     "total_tokens": len(c.prompt_ids) + output}
        choice = req.tool_choice
        return {
            "id": self.run.request_id, "object": "response", "created_at": self.run.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.model_name,
            "output": [dict(item) for item in self.items.items] if status != "in_progress" else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": False,
            "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": (choice if isinstance(choice, str) or choice is None
                            else choice.model_dump(exclude_none=True)) or ("auto" if req.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "truncation": "disabled", "usage": usage, "user": req.user, "metadata": req.metadata or {},
        }
