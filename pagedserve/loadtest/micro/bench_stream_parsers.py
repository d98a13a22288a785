"""Time per character of the streaming tool-call and reasoning parsers (issue 37 item 2): one long
reply fed in small pieces, as the detokenizer hands them over, at 100k / 200k / 400k characters.
A parser that copies its whole buffer per piece costs time per character that grows with the
length (quadratic in all); a linear one keeps it flat. Not a test (tests/app/test_parsers_linear.py
holds each case to a ratio); run by hand on any revision that has the parsers:

    PYTHONPATH=. python -m pagedserve.loadtest.micro.bench_stream_parsers [--sizes 100000 200000 400000]
        [--piece 4] [--rounds 3] [--cases hermes pythonic ...]

Prints, per case, the median over rounds of process CPU time per character (steadier than wall
time on a shared machine) at each size and the ratio largest/smallest (1.0 = linear; quadratic
grows with the ratio of the sizes), and the load average.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

WORDS = "lorem ipsum dolor sit amet, consectetur adipiscing elit; sed do eiusmod tempor 0123 "


def filler(n: int) -> str:
    """n characters of plain text safe inside a JSON string, a Python string and XML-ish tags."""
    return (WORDS * (n // len(WORDS) + 1))[:n]


@dataclass(frozen=True)
class Case:
    name: str
    new_parser: Callable[[], object]
    text: Callable[[int], str]  # a reply of about n characters
    streamed: bool = True  # False: the whole reply at once, as a non-streamed answer (parse_whole)


class _ResponsesText:
    """The Responses API's output items fed a streamed answer (app/responses_api/output.py)."""

    def __init__(self) -> None:
        from pagedserve.app.responses_api.output import OutputItems

        self.items = OutputItems()

    def feed(self, text: str) -> list:
        return self.items.text(text)

    def finish(self) -> list:
        return self.items.close()


def _calls(n: int, one: str) -> str:
    return one * max(1, n // len(one))


def cases() -> list[Case]:
    from pagedserve.app.reasoning.parser import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
    from pagedserve.app.tools.mistral_parser import MistralToolParser
    from pagedserve.app.tools.parsers import HermesToolParser, Llama3JsonToolParser, NamedCallParser, RequiredCallsParser
    from pagedserve.app.tools.pythonic_parser import PythonicToolParser
    from pagedserve.app.tools.qwen3_coder_parser import Qwen3CoderToolParser

    qwen_tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}}]
    return [
        Case("hermes", HermesToolParser,
             lambda n: '<tool_call>{"name": "f", "arguments": {"x": "' + filler(n) + '"}}</tool_call>'),
        Case("hermes_many_whole", HermesToolParser,
             lambda n: _calls(n, '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n'), streamed=False),
        Case("hermes_trailing_ws", HermesToolParser,
             lambda n: '<tool_call>{"name": "f", "arguments": {}}</tool_call>' + " " * n),
        Case("llama3_json", Llama3JsonToolParser,
             lambda n: '{"name": "f", "parameters": {"x": "' + filler(n) + '"}}'),
        Case("llama3_json_many_whole", Llama3JsonToolParser,
             lambda n: _calls(n, '{"name": "f", "parameters": {"x": 1}}; '), streamed=False),
        Case("llama3_json_leading_ws", Llama3JsonToolParser, lambda n: "\n" * n + '{"name": "f"}'),
        Case("mistral_args", MistralToolParser,
             lambda n: '[TOOL_CALLS]f[ARGS]{"x": "' + filler(n) + '"}'),
        Case("mistral_array", MistralToolParser,
             lambda n: '[TOOL_CALLS][{"name": "f", "arguments": {"x": "' + filler(n) + '"}}]'),
        Case("mistral_many_whole", MistralToolParser,
             lambda n: _calls(n, '[TOOL_CALLS]f[ARGS]{"x": 1}'), streamed=False),
        Case("mistral_ws_after_tag", MistralToolParser, lambda n: "[TOOL_CALLS]" + " " * n + 'f[ARGS]{}'),
        Case("pythonic", PythonicToolParser, lambda n: '[f(x="' + filler(n) + '")]'),
        Case("pythonic_leading_ws", PythonicToolParser, lambda n: " " * n + '[f(x=1)]'),
        Case("qwen3_coder", lambda: Qwen3CoderToolParser(tools=qwen_tools),
             lambda n: "<tool_call>\n<function=f>\n<parameter=x>\n" + filler(n)
             + "\n</parameter>\n</function>\n</tool_call>"),
        Case("qwen3_coder_many_whole", lambda: Qwen3CoderToolParser(tools=qwen_tools),
             lambda n: _calls(n, "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n"
                                 "</tool_call>\n"), streamed=False),
        Case("qwen3_coder_many_params_whole", lambda: Qwen3CoderToolParser(tools=qwen_tools),
             lambda n: "<tool_call>\n<function=f>\n" + _calls(n, "<parameter=x>\n1\n</parameter>\n")
             + "</function>\n</tool_call>", streamed=False),
        Case("qwen3_coder_long_name", lambda: Qwen3CoderToolParser(tools=qwen_tools),
             lambda n: "<tool_call>\n<function=" + "f" * n + ">\n</function>\n</tool_call>"),
        Case("required", RequiredCallsParser,
             lambda n: '[{"name": "f", "parameters": {"x": "' + filler(n) + '"}}]'),
        Case("named", lambda: NamedCallParser("f"), lambda n: '{"x": "' + filler(n) + '"}'),
        Case("reasoning_deepseek_r1", DeepSeekR1ReasoningParser,
             lambda n: "<think>" + filler(n) + "</think>answer"),
        Case("reasoning_qwen3", Qwen3ReasoningParser, lambda n: "<think>" + filler(n) + "</think>answer"),
        Case("reasoning_leading_ws", Qwen3ReasoningParser, lambda n: "\n" * n + "<think>x</think>answer"),
        Case("responses_output_text", _ResponsesText, filler),
    ]


def run_once(case: Case, n: int, piece: int = 4) -> float:
    """Process CPU seconds to parse one reply of about ``n`` characters."""
    from pagedserve.app.tools.parsers import parse_whole

    text = case.text(n)
    parser = case.new_parser()
    if not case.streamed:  # as the non-streamed answer reads it
        c0 = time.process_time()
        parse_whole(parser, text)
        return time.process_time() - c0
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
    c0 = time.process_time()
    for p in pieces:
        parser.feed(p)
    parser.finish()
    return time.process_time() - c0


def per_char_us(case: Case, n: int, piece: int = 4, rounds: int = 3) -> float:
    return statistics.median(run_once(case, n, piece) for _ in range(rounds)) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 200_000, 400_000])
    parser.add_argument("--piece", type=int, default=4, help="characters per fed piece")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    args = parser.parse_args()
    chosen = [c for c in cases() if not args.cases or c.name in args.cases]
    sizes = sorted(args.sizes)
    print(f"load average {os.getloadavg()[0]:.1f}; pieces of {args.piece} characters; "
          f"median of {args.rounds}; us per character")
    print(f"{'case':<24}" + "".join(f"{s:>10,}" for s in sizes) + f"{'ratio':>8}")
    for case in chosen:
        us = [per_char_us(case, n, args.piece, args.rounds) for n in sizes]
        print(f"{case.name:<24}" + "".join(f"{u:>10.2f}" for u in us) + f"{us[-1] / us[0]:>8.2f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
