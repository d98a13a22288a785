"""`pagedserve generate "prompt"`: stream one completion to the terminal."""
from __future__ import annotations

import argparse
import sys

from pagedserve.app.engine_args import add_engine_args, engine_config_from_args
from pagedserve.app.sampling_args import add_sampling_args, sampling_params_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="prompt text")
    add_engine_args(parser)
    add_sampling_args(parser)


def run(args: argparse.Namespace) -> int:
    from pagedserve.engine.llm import LLM

    config = engine_config_from_args(args)
    llm = LLM(**_flat(config))
    params = sampling_params_from_args(args)
    try:
        sys.stdout.write(args.prompt)
        finish = None
        for delta in llm.stream(args.prompt, params):
            out = delta.outputs[0]
            sys.stdout.write(out.text)
            sys.stdout.flush()
            finish = out.finish_reason or finish
        sys.stdout.write("\n")
        print(f"[finish_reason: {finish}]", file=sys.stderr)
    finally:
        llm.shutdown()
    return 0


def _flat(config) -> dict:
    """EngineConfig back to the flat options LLM(...) takes."""
    return config.options()
