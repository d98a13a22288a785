"""`pagedserve` command line. Each subcommand lives in its own module, imported lazily so
`pagedserve --help` stays fast: the module exposes ``add_arguments(parser)`` and ``run(args)``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from pagedserve.contracts.cpu_threads import openmp_defaults

# subcommand -> module implementing it
COMMANDS = {
    "serve": ("pagedserve.app.serve_cmd", "Serve a model over an OpenAI-compatible HTTP API"),
    "generate": ("pagedserve.app.offline_cmd", "Generate text for one prompt, streamed to the terminal"),
    "chat": ("pagedserve.app.chat_cmd", "Interactive chat through the model's chat template"),
    "env": ("pagedserve.app.env_cmd", "The PAGEDSERVE_* environment switches: values, defaults, what each does"),
}
BENCH_COMMANDS = {
    "throughput": ("pagedserve.loadtest.micro.bench_throughput", "Offline throughput on a workload file (default W1)"),
    "latency": ("pagedserve.loadtest.micro.bench_latency", "One request's prefill time and decode speed"),
    "spec-decode": ("pagedserve.loadtest.micro.bench_spec_decode",
                    "ngram speculative decoding against plain decoding (quote workload, c=1 and batched)"),
    "serve": ("pagedserve.loadtest.bench", "Serving benchmark against any OpenAI-compatible server"),
    "ipc": ("pagedserve.loadtest.micro.bench_ipc", "Round trip of step messages: shm ring vs multiprocessing.Queue"),
    "soak": ("pagedserve.loadtest.soak", "Thousands of mixed requests, then proof nothing leaked (RSS, fds, KV)"),
    "startup": ("pagedserve.loadtest.bench_startup", "Cold start: `serve` process start to /health 200 (median of N)"),
}


def version() -> str:
    """The installed distribution's version (pagedserve.__version__, as /version says)."""
    from pagedserve import __version__

    return __version__


def _add(sub, name: str, module: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(_module=module)
    importlib.import_module(module).add_arguments(parser)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM inference server")
    parser.add_argument("--version", "-V", action="version", version=f"pagedserve {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    # Import only the chosen subcommand's module so startup stays quick.
    wanted = argv[0] if argv else None
    for name, (module, help_text) in COMMANDS.items():
        if wanted in (None, name, "-h", "--help"):
            _add(sub, name, module, help_text) if wanted == name else sub.add_parser(name, help=help_text)
    bench = sub.add_parser("bench", help="Benchmarks")
    if wanted == "bench":
        bench_sub = bench.add_subparsers(dest="bench_command", required=True)
        which = argv[1] if len(argv) > 1 else None
        for name, (module, help_text) in BENCH_COMMANDS.items():
            if which == name:
                _add(bench_sub, name, module, help_text)
            else:
                bench_sub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    openmp_defaults()  # before any subcommand imports torch (libgomp reads it once, at load)
    args = build_parser(argv).parse_args(argv)
    if not hasattr(args, "_module"):  # optional: argparse sets it only when a subcommand was given
        build_parser(argv).parse_args(argv + ["--help"])
        return 2
    result = importlib.import_module(args._module).run(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
