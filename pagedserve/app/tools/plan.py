"""What a chat request's tool fields mean for this request: ``ToolPlan``.

- no tools, or ``tool_choice: "none"``: no tools in the prompt, the reply is plain content.
- ``"auto"`` (the default when tools are given): tools in the prompt, the reply parsed by the
  server's tool parser. Needs ``--enable-auto-tool-choice`` (400 otherwise, as vLLM).
- ``"required"``: the output is constrained (structured outputs) to a JSON array of
  ``{"name", "parameters"}`` objects, one of the given functions each, with arguments valid for
  that function's parameters schema; at most one when ``parallel_tool_calls`` is false.
- a named function: the output is constrained to that function's parameters schema.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.app.errors import APIError
from pagedserve.app.tools.parsers import AUTO_PARSERS, NamedCallParser, RequiredCallsParser

if TYPE_CHECKING:
    from pagedserve.app.protocol import ChatCompletionRequest
    from pagedserve.engine.client import TokenizerClient

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# Markers in a chat template that name the tool-call format its model was trained on.
_TEMPLATE_FAMILIES = (("<function=", "qwen3_coder"), ("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                      ("<|python_tag|>", "llama3_json"))
DEFAULT_PARSER = "hermes"  # also the format of the default tool prompt (app/tools/prompt.py)


@dataclass(frozen=True)
class ToolConfig:
    """The server's tool flags."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # None = chosen by the model's chat template

    def parser_name(self, chat_template: str | None) -> str:
        if self.tool_call_parser:
            return self.tool_call_parser
        for marker, name in _TEMPLATE_FAMILIES:
            if chat_template and marker in chat_template:
                return name
        return DEFAULT_PARSER


@dataclass
class ToolPlan:
    mode: str = "off"  # off | auto | required | named
    tools: list[dict] = field(default_factory=list)
    function_name: str | None = None
    max_calls: int | None = None
    parser_name: str | None = None
    schema: dict | None = None  # JSON schema the output is constrained to (required, named)

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def new_parser(self):
        if self.mode == "auto":
            return AUTO_PARSERS[self.parser_name](max_calls=self.max_calls, tools=self.tools)
        if self.mode == "required":
            return RequiredCallsParser(max_calls=self.max_calls)
        return NamedCallParser(self.function_name)


def build_plan(req: Any, config: ToolConfig, chat_template: str | None) -> ToolPlan:
    """The plan for a ChatCompletionRequest; a 400 for a choice the request or server cannot serve."""
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError.bad_request("tool_choice needs tools: give the functions in 'tools'",
                                       param="tool_choice")
        return ToolPlan()
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan()
    plan = ToolPlan(tools=[t.as_dict() for t in tools],
                    max_calls=1 if req.parallel_tool_calls is False else None)
    if choice == "auto":
        if not config.enable_auto_tool_choice:
            raise APIError.bad_request(
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                '(and optionally --tool-call-parser); use tool_choice "required", a named function '
                'or "none" instead', param="tool_choice")
        plan.mode, plan.parser_name = "auto", config.parser_name(chat_template)
        return plan
    _check_not_constrained_twice(req)
    if choice == "required":
        plan.mode = "required"
        plan.schema = required_schema(tools, plan.max_calls)
        return plan
    name = choice.function.name
    match = [t for t in tools if t.function.name == name]
    if not match:
        raise APIError.bad_request(f"tool_choice names the function {name!r}, which is not in "
                                   "'tools'", param="tool_choice")
    plan.mode, plan.function_name, plan.max_calls = "named", name, 1
    plan.schema = copy.deepcopy(match[0].function.parameters or _EMPTY_PARAMETERS)
    return plan


def required_schema(tools: list[Any], max_calls: int | None) -> dict:
    """vLLM's schema for tool_choice "required": an array of calls, each one of the functions."""
    defs: dict[str, Any] = {}
    branches = []
    for t in tools:
        params = copy.deepcopy(t.function.parameters or _EMPTY_PARAMETERS)
        for name, schema in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != schema:
                raise APIError.bad_request(f"tools define '$defs/{name}' differently; give shared "
                                           "definitions one meaning", param="tools")
            defs[name] = schema
        branches.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                        "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": branches}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def _check_not_constrained_twice(req: ChatCompletionRequest) -> None:
    fmt = req.response_format
    taken = [name for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                               "guided_grammar") if getattr(req, name) is not None]
    if fmt is not None and fmt.type != "text":
        taken.append("response_format")
    if taken:
        raise APIError.bad_request(f"tool_choice 'required' or a named function constrains the output "
                                   f"already; it cannot be combined with {taken[0]}", param=taken[0])


def structured_outputs_for(plan: ToolPlan) -> Any:
    """The engine's structured-outputs setting for a constrained plan."""
    try:
        from pagedserve.engine.sampling_params import StructuredOutputsParams
    except ImportError:
        raise APIError.unsupported("tool_choice", "tool_choice 'required' or a named function needs "
                                   "structured outputs, which this server does not have") from None
    return StructuredOutputsParams(json=plan.schema)


def keeps_special_tokens(plan: ToolPlan, tokenizer: TokenizerClient) -> bool:
    """Must the reply keep special tokens for the parser to see the call tags?"""
    if plan.mode != "auto":
        return False
    parser = AUTO_PARSERS[plan.parser_name]
    specials = tokenizer.all_special_ids
    if not specials or parser.start_tag is None:
        return False
    return tokenizer.token_to_id(parser.start_tag) in specials
