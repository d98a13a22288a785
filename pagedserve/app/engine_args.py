"""Engine options shared by `serve`, `generate`, `chat` and `bench`: one flag per config field.

A flag's dest is the option's name (what ``LLM(...)`` takes) and its default is the config
field's (contracts/config.py): the default is written once, there.
"""
from __future__ import annotations

import argparse

from pagedserve.contracts.config import (LORA_DTYPES, PREEMPTION_MODES, RAY_PLACEMENT_STRATEGIES, SCHEDULING_POLICIES,
                              STEP_TRANSPORTS, ConfigError, EngineConfig, option_default, option_field)


def flag(group, *names: str, dest: str | None = None, **kwargs) -> None:
    """Add an engine option's flag: dest = the option name (from the first long flag unless
    given), default = its config field's."""
    dest = dest or names[0].lstrip("-").replace("-", "_")
    option_field(dest)  # an engine option, by its current name
    group.add_argument(*names, dest=dest, default=option_default(dest), **kwargs)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    flag(g, "--model", help="GGUF file, HF directory, or a Hugging Face model id: org/name (config, tokenizer "
                            "and safetensors, or a GGUF repo's file), org/name:Q4_K_M (a GGUF repo's file of "
                            "that quant tag) or org/name/FILE.gguf; downloaded into the HF cache unless there "
                            "(HF_TOKEN, HF_HUB_OFFLINE=1 and HF_ENDPOINT apply) (default: SmolLM2-135M-Instruct)")
    flag(g, "--revision", help="the Hub revision of a model id: a branch, tag or commit (default: main)")
    flag(g, "--download-dir",
         help="where a model id is downloaded (a huggingface_hub cache; default: $HF_HUB_CACHE or $HF_HOME/hub)")
    flag(g, "--load-format", choices=["auto", "gguf", "safetensors", "dummy"])
    flag(g, "--hf-config",
         help="HF config overrides as JSON or a JSON file; with --load-format dummy this is the "
              "model (random weights), e.g. a tiny config for tests")
    flag(g, "--dtype", choices=["auto", "bfloat16", "float16", "float32", "half", "float"],
         help="weights' and activations' type (half = float16, float = float32, as in vLLM); auto: on "
              "a GPU the checkpoint's fp16/bf16 (fp32 ones in bf16), on the CPU bf16 where native else fp32")
    flag(g, "--chat-template",
         help="a Jinja chat template (a file, or the template text) in place of the model's")
    flag(g, "--quantization", "-q", choices=["auto", "none", "int8", "int4", "fp8"],
         help="quantization of the linear layers: auto keeps a GGUF file's quantization on the CPU "
              "(Q4_0/Q4_1/Q4_K as int4, Q8_0 and others as int8) and an FP8 checkpoint's on an FP8 GPU "
              "(full precision for other checkpoints), none dequantizes to --dtype, int8 in groups of "
              "32 with a scale (GGUF Q8_0, CPU), int4 in groups of 32 with scale and minimum (GGUF "
              "Q4_1, CPU), fp8 e4m3 weights per output channel and activations per token (vLLM's "
              "fp8; GPUs of compute capability >= 8.9: Ada, Hopper, Blackwell)")
    flag(g, "--generation-config",
         help="where requests' default temperature / top_p / top_k / min_p / repetition_penalty come "
              "from: auto = the model's generation_config.json or GGUF general.sampling.* keys; vllm = "
              "none (the engine's defaults); or a directory holding a generation_config.json. A "
              "request's own fields override them (default: %(default)s)")
    flag(g, "--max-model-len", type=int)
    flag(g, "--max-logprobs", type=int,
         help="most logprobs / top_logprobs / prompt_logprobs a request may ask for (vLLM's; "
              "-1 = no cap; default: %(default)s)")
    flag(g, "--max-num-seqs", type=int)
    flag(g, "--max-num-batched-tokens", type=int)
    flag(g, "--prompt-admit-tokens", type=int,
         help="a step takes no further waiting prompt once it holds this many prompt tokens "
              "(one prompt's chunk may still fill --max-num-batched-tokens): when many prompts "
              "arrive at once each gets its first token sooner; 0 = fill the token budget "
              "(default: 256 for serve, 0 offline)")
    flag(g, "--kv-cache-memory", type=float, help="KV cache budget in GiB (CPU)")
    flag(g, "--gpu-memory-utilization", type=float,
         help="CUDA: the fraction of the GPU's memory this server may use for weights, activations "
              "and the KV cache, refused when more than that is not free at start (default: %(default)g)")
    flag(g, "--num-gpu-blocks-override", type=int)
    flag(g, "--block-size", type=int)
    flag(g, "--kv-cache-dtype",
         help="KV cache element type: auto (the model's dtype; bfloat16 for an fp32 model with "
              "quantized weights on CPU), bfloat16 (CPU under an fp32 model: half the bytes) or "
              "fp8 / fp8_e4m3 (CPU: one byte an element, twice the tokens per GiB of bf16)")
    flag(g, "--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    flag(g, "--scheduling-policy", choices=SCHEDULING_POLICIES,
         help="priority: lower value first, and a waiting request preempts running ones of "
              "lower priority when blocks or slots run out")
    flag(g, "--preemption-mode", choices=PREEMPTION_MODES,
         help="what a preempted request's KV blocks become: freed and recomputed on resume, "
              "or copied to a host swap pool and back (recompute when the pool is full)")
    flag(g, "--swap-space", type=float,
         help="host swap pool per worker in GiB (--preemption-mode swap; pinned on CUDA)")
    flag(g, "--device", choices=["auto", "cpu", "cuda"],
         help="auto: CUDA when torch can use a GPU, else the CPU; cuda is refused at start when it "
              "cannot, saying why (a CPU build of torch, a driver older than its CUDA)")
    flag(g, "--tensor-parallel-size", "-tp", type=int)
    flag(g, "--pipeline-parallel-size", "-pp", type=int,
         help="split the layers into this many stages, one per group of tensor-parallel "
              "ranks (world = tp x pp worker processes)")
    flag(g, "--executor", "--distributed-executor-backend",
         choices=["inproc", "mp", "ray"],
         help="inproc (same process), mp (worker processes over shared memory) or ray "
              "(Ray actors, one node or many; needs pip install 'pagedserve[ray]')")
    flag(g, "--ray-placement-strategy",
         choices=RAY_PLACEMENT_STRATEGIES,
         help="executor ray: how the placement group spreads the ranks over nodes")
    flag(g, "--ray-address",
         help="executor ray: the cluster to join (default: $RAY_ADDRESS, else a cluster "
              "started with `ray start` here, else a local Ray instance)")
    flag(g, "--worker-threads", type=int,
         help="torch threads per worker process (default: $PAGEDSERVE_WORKER_THREADS, else the "
              "CPUs this process may use divided among the workers)")
    flag(g, "--step-transport", choices=STEP_TRANSPORTS,
         help="executor mp / ray on one node: how steps reach the workers, the shared-memory ring "
              "(x86 only) or pipes (default: $PAGEDSERVE_STEP_TRANSPORT, else the ring on x86)")
    flag(g, "--enforce-eager", action="store_true",
         help="no CUDA-graph decode runner (the default on CPU)")
    flag(g, "--model-seed", type=int, help="seed of dummy (random) weights")
    flag(g, "--speculative-config",
         help='speculative decoding as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 3, '
              '"prompt_lookup_max": 4, "prompt_lookup_min": 2} (prompt lookup), optional '
              '"disable_by_batch_size": N (no drafts in a step with N or more running sequences)')
    flag(g, "--step-timeout", type=float,
         help="seconds a step may take before the workers count as hung and the engine fails "
              "as for a dead worker (executor mp; the first steps get the startup timeout); "
              "0 = no limit (default: %(default)g)")
    lora = parser.add_argument_group("multi-LoRA (PEFT adapters over the base model)")
    flag(lora, "--enable-lora", action="store_true",
         help="serve LoRA adapters: a request picks one by its model name (serve: --lora-modules)")
    flag(lora, "--max-loras", type=int, help="distinct adapters one step may run (default: %(default)s)")
    flag(lora, "--max-lora-rank", type=int, help="highest adapter rank accepted (default: %(default)s)")
    flag(lora, "--max-cpu-loras", type=int,
         help="adapters each worker keeps loaded in host memory (default: --max-loras)")
    flag(lora, "--lora-dtype", choices=list(LORA_DTYPES),
         help="dtype of the adapter weights: auto = the model's, but bfloat16 over quantized base "
              "weights with fp32 activations (default: %(default)s)")
    p = parser.add_argument_group("request preparation (each kind in a bounded pool of its own; past its "
                                  "deadline a request gets 400 naming the flag; 0 = no limit)")
    flag(p, "--grammar-compile-timeout", type=float,
         help="seconds a structured-output grammar (JSON schema, regex, grammar) may take to "
              "validate and compile for the vocabulary (default: %(default)g)")
    flag(p, "--chat-template-timeout", type=float,
         help="seconds rendering one request's chat template may take (default: %(default)g)")
    flag(p, "--tokenize-timeout", type=float,
         help="seconds tokenizing or detokenizing one prompt may take (default: %(default)g)")


def _json_arg(value: str | None) -> dict | None:
    if value is None:
        return None
    import json
    import os

    if os.path.isfile(value):
        with open(value) as f:
            return json.load(f)
    return json.loads(value)


def _is_option(name: str) -> bool:
    try:
        option_field(name)
    except ConfigError:
        return False
    return True


def engine_config_from_args(args: argparse.Namespace, default_executor: str | None = None) -> EngineConfig:
    """The config of the engine options this parser defined (``flag`` gave each its option name);
    an option a subcommand lacks keeps its field's default. ``default_executor`` None = auto: mp
    when tensor parallel, else in-process."""
    options = {name: value for name, value in vars(args).items() if _is_option(name)}
    options["hf_config"] = _json_arg(options.get("hf_config"))
    options["executor"] = options.get("executor") or default_executor
    return EngineConfig.from_options(**options)
