"""The measured-transport interface both `bench ipc` modules share (kept apart so neither imports
the other: bench_ipc loads bench_ipc_ray only when asked for the Ray rows)."""
from __future__ import annotations

from pagedserve.contracts.messages import StepInput
from pagedserve.gpu.worker import encode_step


class _Echo:
    """One measured transport: ``prepare`` (untimed), ``round_trip`` (timed), ``close()``."""

    raw = False  # True: the message is encoded before timing and echoed as bytes

    def prepare(self, step: StepInput):
        return encode_step(step) if self.raw else step

    def round_trip(self, step):
        raise NotImplementedError

    def close(self) -> None:
        pass
