"""The server's options, once (issue 38 item 7): `serve`'s flags and ``build_app`` share one
ServerConfig, its defaults written in one place."""
from __future__ import annotations

import dataclasses

import pytest

from pagedserve.app.cli import build_parser
from pagedserve.app.server_config import SERVER_OPTION_FLAGS, ServerConfig, server_option_default


def _serve_args(*argv: str):
    return build_parser(["serve", *argv]).parse_args(["serve", *argv])


def test_every_flag_default_is_the_config_default():
    args = _serve_args()
    for name, dest in SERVER_OPTION_FLAGS.items():
        default = getattr(args, dest)
        want = server_option_default(name)
        assert default == want or (default in ([], ()) and want is None), (name, default, want)


def test_table_names_fields_and_flags():
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    assert set(SERVER_OPTION_FLAGS) <= fields
    args = _serve_args()
    for dest in SERVER_OPTION_FLAGS.values():
        assert hasattr(args, dest), dest


def test_from_args_carries_every_flag():
    args = _serve_args("--max-body-bytes", "123", "--sse-ping-interval", "2.5", "--api-key", "k",
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--show-model-paths",
                       "--served-model-name", "a", "b", "--trust-request-chat-template",
                       "--enable-prompt-tokens-details", "--max-runtime-loras", "3")
    c = ServerConfig.from_args(args, served_model_name="a")
    assert (c.max_body_bytes, c.sse_ping_interval, c.api_key) == (123, 2.5, "k")
    assert c.tool_config.enable_auto_tool_choice and c.tool_config.tool_call_parser == "hermes"
    assert c.show_model_paths and c.trust_request_chat_template and c.enable_prompt_tokens_details
    assert c.other_names == ("b",) and c.max_runtime_loras == 3 and c.served_model_name == "a"


def test_build_app_takes_a_config_or_its_keywords_not_both():
    from pagedserve.app.server import build_app
    from tests.app.fake_engine import FakeAsyncEngine

    with pytest.raises(TypeError, match="not both"):
        build_app(FakeAsyncEngine(), ServerConfig(), api_key="k")
    with pytest.raises(TypeError):
        build_app(FakeAsyncEngine(), no_such_option=1)
