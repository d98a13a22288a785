"""Request models of OpenAI's tool fields (``tools``, ``tool_choice``, assistant ``tool_calls``).

Part of the published schema (app/openapi.py builds it from app/protocol.py, which uses these).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.app.json_types import LIMIT_KEY, Name

# OpenAI's function names are 1..64 characters; this server bounds them by --max-name-chars.
FunctionName = Annotated[str, Field(min_length=1, json_schema_extra={LIMIT_KEY: "max_name_chars"})]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)


class FunctionDefinition(_Model):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Model):
    type: Literal["function"]
    function: FunctionDefinition

    def as_dict(self) -> dict[str, Any]:
        """The tool as templates and the default tool prompt show it (unset fields left out)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(_Model):
    name: FunctionName


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class FunctionCall(_Model):
    name: Name
    arguments: str


class ToolCall(_Model):
    """A call in an assistant message of the conversation (as the API returned it)."""

    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall
