"""`vllm serve` flags pagedserve does not implement: refused by name with the reason, never ignored,
so a launch command brought over from vLLM fails at once and says what to change (argparse alone
would only say "unrecognized arguments"). A flag this server (or a later change) does implement is
never shadowed: ``add_refused_vllm_flags`` skips any flag the parser already has."""
from __future__ import annotations

import argparse

_HUB = "the model id's --revision is the tokenizer's and the code's"
REFUSED: dict[str, str] = {
    "--trust-remote-code": "pagedserve runs only its own model code (gpu/models), never code from a "
                           "model's repository; drop the flag",
    "--tokenizer": "the tokenizer is the model's own (its directory or GGUF file)",
    "--tokenizer-mode": "the tokenizer is the model's own (tokenizers' fast tokenizer)",
    "--tokenizer-revision": _HUB,
    "--code-revision": _HUB,
    "--seed": "there is no global sampling seed: give requests a `seed` (--model-seed seeds dummy weights)",
    "--hf-overrides": "use --hf-config (a JSON object or file of config.json overrides)",
    "--rope-scaling": "set rope_scaling through --hf-config",
    "--rope-theta": "set rope_theta through --hf-config",
    "--max-seq-len-to-capture": "CUDA graphs are captured for decode batch sizes only",
    "--cpu-offload-gb": "weights are not offloaded",
    "--kv-transfer-config": "disaggregated prefill is not implemented",
    "--limit-mm-per-prompt": "multimodal inputs are not supported",
    "--mm-processor-kwargs": "multimodal inputs are not supported",
    "--disable-sliding-window": "not supported",
    "--enable-sleep-mode": "sleep mode is not implemented",
    "--guided-decoding-backend": "structured outputs always use xgrammar",
    "--structured-outputs-config": "structured outputs always use xgrammar",
    "--compilation-config": "torch.compile is not used (CUDA graphs: --enforce-eager turns them off)",
    "--override-generation-config": "use --generation-config PATH (a directory with a generation_config.json)",
    "--task": "every model serves generation and embeddings per request (no --task)",
    "--runner": "every model serves generation and embeddings per request (no --runner)",
    "--tool-parser-plugin": "tool parsers are built in (--tool-call-parser)",
    "--reasoning-parser-plugin": "reasoning parsers are built in (--reasoning-parser)",
    "--chat-template-content-format": "message content is text (strings or text parts)",
    "--response-role": "replies are always the assistant's",
    "--root-path": "not supported: serve behind a proxy that strips the prefix",
    "--middleware": "custom ASGI middleware is not supported",
    "--uvicorn-log-level": "use --log-level",
    "--api-server-count": "one API server process per engine (use --data-parallel-size for replicas)",
    "--otlp-traces-endpoint": "tracing is not implemented",
    "--disable-custom-all-reduce": "not applicable: tensor parallelism uses torch.distributed",
}


class _Refused(argparse.Action):
    def __init__(self, option_strings, dest, reason: str = "", **kwargs) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is a vLLM flag pagedserve does not implement: {self.reason}")


def add_refused_vllm_flags(parser: argparse.ArgumentParser) -> None:
    for name, reason in REFUSED.items():
        try:
            parser.add_argument(name, action=_Refused, reason=reason)
        except argparse.ArgumentError:  # implemented here after all: the real flag stands
            continue
