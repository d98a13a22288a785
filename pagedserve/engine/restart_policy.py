"""How often --restart-workers may rebuild the worker pool (AsyncEngine asks it after each failure)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How often --restart-workers may rebuild the worker pool.

    A pool that fails each time it starts (a model that crashes its workers, a bad device)
    must not be rebuilt for ever, nor as fast as it dies: at most ``max_restarts`` restarts
    within ``window_s`` seconds; the first restart in a window is immediate, each further one
    waits ``backoff_s``, then twice that, ... up to ``max_backoff_s`` (the old pool is reaped
    first). One more failure within the window leaves the engine dead, with a message that says
    so. Failures further apart than the window are each a first failure.
    """

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 1:
            raise ValueError(f"RestartPolicy.max_restarts must be >= 1, got {self.max_restarts}")
        if self.window_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("RestartPolicy: window_s must be > 0, backoff_s and max_backoff_s >= 0")

    def delay(self, recent: int) -> float:
        """Seconds to wait before a restart when ``recent`` restarts happened within the window."""
        return 0.0 if recent == 0 else min(self.max_backoff_s, self.backoff_s * 2 ** (recent - 1))
