"""`pagedserve chat`: a small interactive loop over the model's chat template; with --url, over a
running OpenAI-compatible server instead (app/chat_remote.py: no model is loaded here)."""
from __future__ import annotations

import argparse
import sys

from pagedserve.app.engine_args import add_engine_args, engine_config_from_args
from pagedserve.app.offline_cmd import _flat
from pagedserve.app.sampling_args import add_sampling_args, sampling_params_from_args
from pagedserve.contracts import env
from pagedserve.contracts.config import option_default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--url", default=None,
                        help="chat with a running OpenAI-compatible server at this URL (http://host:8000 or "
                             "http://host:8000/v1) instead of loading a model; --model then names the served "
                             "model (default: the first /v1/models lists) and the engine flags do not apply")
    parser.add_argument("--api-key", default=env.API_KEY.get(),
                        help="with --url: the bearer token the server asks for (default: $PAGEDSERVE_API_KEY, "
                             "else $OPENAI_API_KEY)")
    add_engine_args(parser)
    add_sampling_args(parser, max_tokens=256)


def run(args: argparse.Namespace) -> int:
    if args.url:
        from pagedserve.app.chat_remote import run_remote

        return run_remote(args, args.model if args.model != option_default("model") else None)
    from pagedserve.engine.llm import LLM

    llm = LLM(**_flat(engine_config_from_args(args)))
    params = sampling_params_from_args(args)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("Type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            prompt = {"prompt": llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                      "add_special_tokens": False}
            reply = []
            for delta in llm.stream(prompt, params):
                reply.append(delta.outputs[0].text)
                sys.stdout.write(delta.outputs[0].text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": "".join(reply)})
    finally:
        llm.shutdown()
    return 0
