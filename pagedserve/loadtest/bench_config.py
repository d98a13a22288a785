"""What one serving benchmark run is asked to do (BenchConfig) and what one request measured
(RequestResult): the shapes the request, run, metrics and CLI modules of `bench serve` share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(slots=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = COMPLETIONS
    model: str | None = None
    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 100
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    random_input_len: int = 256
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    prefix_len: int = 512
    sharegpt_output_len: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    api_key: str | None = None
    tokenizer: str | None = None
    goodput: dict[str, float] = field(default_factory=dict)  # ttft / tpot / e2el -> ms
    request_timeout: float = 6 * 3600.0
    save_result: bool = False
    result_filename: str | None = None
    plot: str | None = None
    disable_tqdm: bool = False


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str = ""
    start: float = 0.0  # seconds since benchmark start
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # seconds since benchmark start
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    intended_prompt_len: int = 0
    output_len: int = 0
    text_len: int = 0
