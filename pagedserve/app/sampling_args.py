"""Sampling flags shared by `generate` and `chat`."""
from __future__ import annotations

import argparse


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace):
    from pagedserve.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)
