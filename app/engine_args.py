"""Engine options shared by `serve`, `generate`, `chat` and `bench`: one flag per config field."""
from __future__ import annotations

import argparse

from contracts.config import DEFAULT_STEP_TIMEOUT_S, EngineConfig, ModelConfig, PrepConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    g.add_argument("--hf-config", default=None,
                   help="HF config overrides as JSON or a JSON file; with --load-format dummy this is the "
                        "model (random weights), e.g. a tiny config for tests")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--quantization", "-q", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="weight-only quantization of the linear layers (CPU): auto keeps a GGUF file's "
                        "quantization (Q4_0/Q4_1/Q4_K as int4, Q8_0 and others as int8; full precision "
                        "for other checkpoints), none dequantizes to --dtype, int8 in groups of 32 with a "
                        "scale (GGUF Q8_0), int4 in groups of 32 with scale and minimum (GGUF Q4_1)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-logprobs", type=int, default=ModelConfig().max_logprobs,
                   help="most logprobs / top_logprobs / prompt_logprobs a request may ask for (vLLM's; "
                        "-1 = no cap; default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--prompt-admit-tokens", type=int, default=0,
                   help="a step takes no further waiting prompt once it holds this many prompt tokens "
                        "(one prompt's chunk may still fill --max-num-batched-tokens): when many prompts "
                        "arrive at once each gets its first token sooner; 0 = fill the token budget "
                        "(default: 256 for serve, 0 offline)")
    g.add_argument("--kv-cache-memory", type=float, default=4.0, help="KV cache budget in GiB (CPU)")
    g.add_argument("--num-gpu-blocks-override", dest="num_blocks", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache element type: auto (the model's dtype) or fp8 / fp8_e4m3 (CPU: one byte an "
                        "element, half the attention reads and twice the tokens per GiB)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="priority: lower value first, and a waiting request preempts running ones of "
                        "lower priority when blocks or slots run out")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="what a preempted request's KV blocks become: freed and recomputed on resume, "
                        "or copied to a host swap pool and back (recompute when the pool is full)")
    g.add_argument("--swap-space", type=float, default=4.0,
                   help="host swap pool per worker in GiB (--preemption-mode swap; pinned on CUDA)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split the layers into this many stages, one per group of tensor-parallel "
                        "ranks (world = tp x pp worker processes)")
    g.add_argument("--executor", "--distributed-executor-backend", dest="executor", default=None,
                   choices=["inproc", "mp", "ray"],
                   help="inproc (same process), mp (worker processes over shared memory) or ray "
                        "(Ray actors, one node or many; needs pip install 'pagedserve[ray]')")
    g.add_argument("--ray-placement-strategy", default="PACK",
                   choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
                   help="executor ray: how the placement group spreads the ranks over nodes")
    g.add_argument("--ray-address", default=None,
                   help="executor ray: the cluster to join (default: $RAY_ADDRESS, else a cluster "
                        "started with `ray start` here, else a local Ray instance)")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="no CUDA-graph decode runner (the default on CPU)")
    g.add_argument("--model-seed", dest="seed", type=int, default=0, help="seed of dummy (random) weights")
    g.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S,
                   help="seconds a step may take before the workers count as hung and the engine fails "
                        "as for a dead worker (executor mp; the first steps get the startup timeout); "
                        "0 = no limit (default: %(default)g)")
    p = parser.add_argument_group("request preparation (each kind in a bounded pool of its own; past its "
                                  "deadline a request gets 400 naming the flag; 0 = no limit)")
    prep = PrepConfig()
    p.add_argument("--grammar-compile-timeout", type=float, default=prep.grammar_compile_timeout,
                   help="seconds a structured-output grammar (JSON schema, regex, grammar) may take to "
                        "validate and compile for the vocabulary (default: %(default)g)")
    p.add_argument("--chat-template-timeout", type=float, default=prep.chat_template_timeout,
                   help="seconds rendering one request's chat template may take (default: %(default)g)")
    p.add_argument("--tokenize-timeout", type=float, default=prep.tokenize_timeout,
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


def engine_config_from_args(args: argparse.Namespace, default_executor: str | None = None) -> EngineConfig:
    """``default_executor`` None = auto: mp when tensor parallel, else in-process."""
    return EngineConfig.from_options(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        quantization=getattr(args, "quantization", "auto"),
        max_model_len=args.max_model_len,
        max_logprobs=getattr(args, "max_logprobs", ModelConfig().max_logprobs),
        seed=args.seed,
        hf_config=_json_arg(args.hf_config),
        served_model_name=getattr(args, "served_model_name", None),
        block_size=args.block_size,
        cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        kv_cache_memory_gib=args.kv_cache_memory,
        num_blocks=args.num_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
        executor=args.executor or default_executor,
        enforce_eager=args.enforce_eager,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prompt_admit_tokens=getattr(args, "prompt_admit_tokens", 0),
        policy=args.scheduling_policy,
        preemption_mode=getattr(args, "preemption_mode", "recompute"),
        swap_space_gib=getattr(args, "swap_space", 4.0),
        max_waiting_requests=getattr(args, "max_waiting_requests", 1024),
        step_timeout_s=getattr(args, "step_timeout", DEFAULT_STEP_TIMEOUT_S),
        restart_workers=getattr(args, "restart_workers", False),
        ray_placement_strategy=getattr(args, "ray_placement_strategy", "PACK"),
        ray_address=getattr(args, "ray_address", None),
        **{name: getattr(args, name) for name in ("grammar_compile_timeout", "chat_template_timeout",
                                                  "tokenize_timeout") if hasattr(args, name)},
    )
