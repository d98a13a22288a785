"""Tool-call parsers on scripted model text: whole, split at every character, tricky shapes."""
from __future__ import annotations

import json
import random

import pytest

from pagedserve.app.tools.json_scan import JsonScanError, JsonScanner
from pagedserve.app.tools.parsers import HermesToolParser, NamedCallParser, RequiredCallsParser, parse_whole

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'


def stream(parser, pieces):
    """Feed pieces; return (content, calls reassembled as a client does, the deltas)."""
    content, calls, deltas = "", {}, []
    for i, piece in enumerate(pieces):
        d = parser.feed(piece)
        ds = [d] + ([parser.finish()] if i == len(pieces) - 1 else [])
        for d in ds:
            deltas.append(d)
            content += d.content
            for c in d.calls:
                if c.index not in calls:
                    assert c.id and c.id.startswith("call_") and c.name, c  # first delta: id, name
                    calls[c.index] = {"name": c.name, "arguments": c.arguments}
                else:
                    assert c.id is None and c.name is None
                    calls[c.index]["arguments"] += c.arguments
    return content, [calls[i] for i in sorted(calls)], deltas


def chars(text):
    return list(text)


def random_pieces(text, seed):
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        out.append(text[i:i + n])
        i += n
    return out


def whole(parser, text):
    content, calls = parse_whole(parser, text)
    return content, [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]


def test_one_call():
    content, calls = whole(HermesToolParser(), CALL)
    assert content == ""
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "c"}


@pytest.mark.parametrize("split", ["chars", "random1", "random2", "whole"])
def test_split_anywhere_gives_the_same_result(split):
    text = "Let me look that up.\n" + CALL + "\n" + CALL2 + "\n"
    pieces = {"chars": chars(text), "random1": random_pieces(text, 1),
              "random2": random_pieces(text, 2), "whole": [text]}[split]
    content, calls, deltas = stream(HermesToolParser(), pieces)
    assert content == "Let me look that up.\n"
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert calls[1]["arguments"] == '{"tz": "CET"}'
    assert (content, calls) == whole(HermesToolParser(), text)
    assert not any("<" in d.content for d in deltas)  # the tag never leaks as content


def test_arguments_stream_in_pieces():
    _, _, deltas = stream(HermesToolParser(), chars(CALL))
    pieces = [c.arguments for d in deltas for c in d.calls if c.id is None and c.arguments]
    assert len(pieces) > 5 and "".join(pieces).endswith('"c"}')


def test_text_that_only_looks_like_a_tag_is_content():
    text = "a <b> and <tool_cal"
    content, calls, _ = stream(HermesToolParser(), chars(text))
    assert content == text and calls == []
    assert whole(HermesToolParser(), "x < y") == ("x < y", [])


def test_malformed_json_is_returned_as_content():
    bad = '<tool_call>\n{"name": "f", "arguments": {"a": 1,,}}\n</tool_call>'
    parser = HermesToolParser()
    content, calls = parse_whole(parser, "Sure. " + bad)
    assert parser.failed
    # announced before the break: the stream cannot take it back, the rest is content
    content, calls, _ = stream(HermesToolParser(), chars("Sure. " + bad))
    assert content.startswith("Sure. ") and content.endswith(",}}\n</tool_call>")
    # broken before the call is announced: the whole block is content
    early = '<tool_call>\n{"nme": 3 x}</tool_call> tail'
    content, calls, _ = stream(HermesToolParser(), chars(early))
    assert content == early and calls == []


def test_unfinished_call_at_the_end():
    parser = HermesToolParser()
    parse_whole(parser, '<tool_call>{"name": "f", "argu')
    assert parser.failed
    content, calls, _ = stream(HermesToolParser(), chars('<tool_call>{"name": '))
    assert content == '<tool_call>{"name": ' and calls == []


def test_missing_end_tag_and_no_arguments():
    content, calls = whole(HermesToolParser(), '<tool_call>{"name": "now"}')
    assert content == "" and calls == [{"name": "now", "arguments": "{}"}]


def test_arguments_before_name_and_string_arguments():
    text = '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>'
    assert stream(HermesToolParser(), chars(text))[1] == [{"name": "search", "arguments": '{"q": "x"}'}]
    text = '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
    assert whole(HermesToolParser(), text)[1] == [{"name": "search", "arguments": '{"q": "x"}'}]


def test_parallel_calls_off_keeps_the_first():
    content, calls, _ = stream(HermesToolParser(max_calls=1), chars(CALL + CALL2))
    assert content == "" and [c["name"] for c in calls] == ["get_weather"]


def test_text_after_calls():
    content, calls = whole(HermesToolParser(), CALL + "\n\nDone, calling it.")
    assert content == "\n\nDone, calling it." and len(calls) == 1


def test_strings_with_tags_and_escapes_inside_arguments():
    text = ('<tool_call>{"name": "echo", "arguments": {"s": "</tool_call> \\"q\\" \\u00e9 {[", '
            '"n": [1, -2.5e+3, true, null]}}</tool_call>')
    content, calls, _ = stream(HermesToolParser(), chars(text))
    assert content == ""
    assert json.loads(calls[0]["arguments"]) == {"s": '</tool_call> "q" é {[', "n": [1, -2500.0, True, None]}


def test_required_array_streamed_and_whole():
    text = '[{"name": "a", "parameters": {"x": [1, 2]}}, {"name": "b", "parameters": {}}]'
    content, calls, _ = stream(RequiredCallsParser(), chars(text))
    assert content == "" and calls == [{"name": "a", "arguments": '{"x": [1, 2]}'},
                                       {"name": "b", "arguments": "{}"}]
    assert whole(RequiredCallsParser(), text) == ("", calls)
    assert stream(RequiredCallsParser(max_calls=1), chars(text))[1] == calls[:1]


def test_named_call_is_the_whole_reply():
    content, calls, _ = stream(NamedCallParser("f"), [" ", '{"a"', ": 1}"])
    assert content == "" and calls == [{"name": "f", "arguments": '{"a": 1}'}]


@pytest.mark.parametrize("text", ['{"a": 1}', '{"a": [1, {"b": "c\\n"}], "d": -0.5E-2}', "{}",
                                  '{"k": false, "l": null, "m": "\\ud83d\\ude00"}'])
def test_scanner_accepts_json(text):
    s = JsonScanner(_Null())
    s.feed(text)
    assert s.done


@pytest.mark.parametrize("text", ['{"a" 1}', '{"a": 01}', '{"a": tru}', '{"a": "\\x"}', '{a: 1}',
                                  '{"a": 1,}', '{"a": [1,]}', '{"a": 1}}', '{"a": -}', '{"a": 1.}',
                                  '{"a": "x\ny"}', "[1]"])
def test_scanner_refuses_invalid_json(text):
    s = JsonScanner(_Null())
    with pytest.raises(JsonScanError):
        s.feed(text)
        assert s.done, "incomplete"
        raise JsonScanError("complete but should not be")


class _Null:
    def call_start(self, pos): pass
    def call_key(self, key): pass
    def value_start(self, pos): pass
    def value_end(self, pos): pass
    def call_end(self, pos): pass


LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"tz": "CET"}}'


@pytest.mark.parametrize("split", ["chars", "random", "whole"])
def test_llama3_json_calls(split):
    from pagedserve.app.tools.parsers import Llama3JsonToolParser

    pieces = {"chars": chars(LLAMA), "random": random_pieces(LLAMA, 3), "whole": [LLAMA]}[split]
    content, calls, _ = stream(Llama3JsonToolParser(), pieces)
    assert content == "" and calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                       {"name": "get_time", "arguments": '{"tz": "CET"}'}]
    assert whole(Llama3JsonToolParser(), LLAMA.replace("<|python_tag|>", "")) == ("", calls)


def test_llama3_json_plain_reply_and_broken_call():
    from pagedserve.app.tools.parsers import Llama3JsonToolParser

    assert stream(Llama3JsonToolParser(), chars("It is {warm}."))[:2] == ("It is {warm}.", [])
    assert stream(Llama3JsonToolParser(), ["<|py"])[:2] == ("<|py", [])
    parser = Llama3JsonToolParser()
    parse_whole(parser, '{"name": "f", "parameters": {"a": }}')
    assert parser.failed


def test_parser_is_chosen_by_the_chat_template():
    from pagedserve.app.tools.plan import ToolConfig

    assert ToolConfig().parser_name("... <tool_call> ...") == "hermes"
    assert ToolConfig().parser_name("... <|python_tag|> ...") == "llama3_json"
    assert ToolConfig().parser_name(None) == "hermes"  # the default tool prompt's format
    assert ToolConfig(tool_call_parser="llama3_json").parser_name("<tool_call>") == "llama3_json"
