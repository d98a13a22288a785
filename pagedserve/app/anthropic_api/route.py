"""POST /v1/messages and /v1/messages/count_tokens: the request becomes the chat request it means
(app/anthropic_api/translate.py) and runs on the chat route's path (``ChatRoute.start``: admission,
template, tools, reasoning split, sampling, the engine call); the reply comes back as content
blocks (``thinking``, ``text``, ``tool_use``), whole or as Anthropic's typed SSE events
(``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``, ``ping``). Every error answers in Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``)."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pagedserve.app.admission import check_body
from pagedserve.app.chat_route import ChatRoute
from pagedserve.app.errors import APIError, to_api_error
from pagedserve.app.fanout import ClientDisconnected, end_unfinished
from pagedserve.app.prompt_options import chat_template_options
from pagedserve.app.protocol import ChatCompletionRequest, parse
from pagedserve.app.responses import ORJSONResponse
from pagedserve.app.streaming import sse_response, typed_sse_event
from pagedserve.app.tools.plan import build_plan
from pagedserve.app.anthropic_api.errors import error_body, error_response  # noqa: F401  (the route's error shape)
from pagedserve.app.anthropic_api.translate import chat_body
from pagedserve.app.translated_chat import ChatPieces, read_body, start_chat

Event = dict[str, Any]
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def _tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def _input(arguments: str) -> Any:
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesRoute:
    def __init__(self, chat: ChatRoute) -> None:
        self.chat = chat

    async def messages(self, request: Request) -> Response:
        try:
            return await self._messages(request)
        except (ClientDisconnected, ClientDisconnect):
            raise
        except Exception as e:  # noqa: BLE001 - every error leaves in Anthropic's shape
            return error_response(to_api_error(e))

    async def count_tokens(self, request: Request) -> Response:
        try:
            data = await read_body(self.chat, request)
            body = chat_body({**data, "max_tokens": 1} if isinstance(data, dict) else data)
            check_body("chat", body, self.chat.checks.limits, self.chat.engine.tokenizer.vocab_size,
                       self.chat.engine.max_model_len)
            req = parse(ChatCompletionRequest, body)
            req.check_supported()
            options = chat_template_options(req, self.chat.trust_request_chat_template)
            self.chat.checks.check_model(req.model)
            template = options.get("chat_template") or self.chat.engine.tokenizer.chat_template
            plan = build_plan(req, self.chat.tool_config, template)
            messages, tools = await self.chat.prompts.template_messages(req.messages, plan.tools,
                                                                        options.get("chat_template"))
            _, ids = await self.chat.prompts.chat_prompt(messages, req.add_generation_prompt, req.continue_final_message,
                                                         False, options, tools, bounded=True)
            return ORJSONResponse({"input_tokens": len(ids)})
        except (ClientDisconnected, ClientDisconnect):
            raise
        except Exception as e:  # noqa: BLE001
            return error_response(to_api_error(e))

    async def _messages(self, request: Request) -> Response:
        data = await read_body(self.chat, request)
        body = chat_body(data)
        stream = data.get("stream") is True
        stop_sequences = tuple(body.get("stop") or ())
        run = await start_chat(self.chat, request, body, "msg")
        reply = Reply(ChatPieces(run, self.chat), self.chat.model_name, stop_sequences)
        if stream:
            return sse_response(reply.events(), run.streams,
                                on_close=lambda: end_unfinished(run.choices, ClientDisconnected()),
                                ping_interval=self.chat.sse_ping_interval, frame=typed_sse_event, done=None)
        body_out = await self.chat.fanout.until_disconnect(request, reply.whole(), run.streams, run.choices)
        return ORJSONResponse(body_out)


class Reply:
    """One message: its content blocks, built from the pieces as they come."""

    def __init__(self, pieces: ChatPieces, model_name: str, stop_sequences: tuple[str, ...]) -> None:
        self.pieces = pieces
        self.model_name = model_name
        self.stop_sequences = stop_sequences
        self.id = pieces.run.request_id
        self.blocks: list[dict[str, Any]] = []
        self._args: dict[int, list[str]] = {}  # block index -> a tool_use block's argument pieces
        self._calls: dict[int, int] = {}  # tool-call index -> block index

    def stop(self) -> tuple[str | None, str | None]:
        finish = self.pieces.finish_reason
        reason = self.pieces.choice.stop_reason
        if finish == "stop" and isinstance(reason, str) and reason in self.stop_sequences:
            return "stop_sequence", reason
        return _STOP_REASONS.get(finish or "", "end_turn"), None

    def usage(self) -> dict[str, Any]:
        return {"input_tokens": self.pieces.prompt_tokens, "output_tokens": self.pieces.output_tokens}

    def message(self, content: list[dict[str, Any]], final: bool) -> dict[str, Any]:
        stop_reason, stop_sequence = self.stop() if final else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model_name,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self.usage() if final else {"input_tokens": self.pieces.prompt_tokens, "output_tokens": 0}}

    def _add(self, piece: Any) -> list[Event]:
        """The piece into the blocks; the events that say so."""
        events: list[Event] = []
        last = self.blocks[-1] if self.blocks else None
        if piece.kind in ("thinking", "text"):
            field = piece.kind
            if last is None or last["type"] != piece.kind:
                block = {"type": "thinking", "thinking": "", "signature": ""} if field == "thinking" \
                    else {"type": "text", "text": ""}
                events += self._open(block)
                last = self.blocks[-1]
            last[field] += piece.text
            delta = {"type": "thinking_delta", "thinking": piece.text} if field == "thinking" \
                else {"type": "text_delta", "text": piece.text}
            events.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})
            return events
        call = piece.call
        if call.id is not None:
            events += self._open({"type": "tool_use", "id": _tool_use_id(), "name": call.name, "input": {}})
            self._calls[call.index] = len(self.blocks) - 1
            self._args[len(self.blocks) - 1] = []
        index = self._calls[call.index]
        if call.arguments:
            self._args[index].append(call.arguments)
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
        return events

    def _open(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.blocks.append(block)
        start = dict(block)
        if start["type"] == "text":
            start["text"] = ""
        elif start["type"] == "thinking":
            start["thinking"] = ""
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start}]

    def _close(self) -> list[Event]:
        if not self.blocks or self.blocks[-1].get("_closed"):
            return []
        index = len(self.blocks) - 1
        block = self.blocks[index]
        block["_closed"] = True
        if block["type"] == "tool_use":
            block["input"] = _input("".join(self._args.pop(index, [])))
        return [{"type": "content_block_stop", "index": index}]

    def _content(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in b.items() if k != "_closed"} for b in self.blocks]

    async def whole(self) -> dict[str, Any]:
        async for piece in self.pieces.pieces():
            self._add(piece)
        self._close()
        return self.message(self._content(), True)

    async def events(self) -> AsyncIterator[Event]:
        yield {"type": "message_start", "message": self.message([], False)}
        yield {"type": "ping"}
        try:
            async for piece in self.pieces.pieces():
                for event in self._add(piece):
                    yield event
            for event in self._close():
                yield event
            stop_reason, stop_sequence = self.stop()
            yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                   "usage": self.usage()}
            yield {"type": "message_stop"}
        except Exception as e:  # noqa: BLE001 - reported in the stream, as Anthropic's error event
            yield error_body(to_api_error(e))


def routes(chat: ChatRoute, wrap: Any) -> list[Any]:
    """The Messages API's routes (``wrap``: app.server's, for disconnects and the LoRA scope)."""
    from starlette.routing import Route

    api = MessagesRoute(chat)
    return [Route("/v1/messages", wrap(api.messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", wrap(api.count_tokens), methods=["POST"])]
