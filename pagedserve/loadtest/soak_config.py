"""What one soak run is asked to do: the knobs shared by the runner, the server readings and the
summary of `bench soak` (a module of its own so none of them has to import another for it).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SoakConfig:
    base_url: str
    requests: int = 5000
    concurrency: int = 16
    warmup: int = 200
    seed: int = 0
    max_tokens: int = 24
    model: str | None = None
    max_model_len: int | None = None
    server_pid: int | None = None  # None: found from the port when the server is local
    request_timeout: float = 120.0
    idle_timeout: float = 60.0
    max_rss_growth_pct: float = 5.0
    fd_tolerance: int = 4
    progress: bool = False
    hostile_scale: float = 1.0  # list sizes of hostile requests (1.0 = those of issue 22)
    no_hostile: bool = False
    max_loop_lag_s: float = 1.0
    lag_poll_s: float = 1.0
    also_models: tuple[str, ...] = ()  # served names (LoRA adapters) the requests take turns with
