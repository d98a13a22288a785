"""A progress bar while a checkpoint's weights load (tqdm, in bytes of the checkpoint, advanced per
tensor): drawn only when the load is large (``MIN_BYTES`` of tensors or more), on the first rank of
the worker group, and when stderr is a terminal, so a log file or a pipe never gets bar lines.
``TQDM_DISABLE=1`` turns it off everywhere (tqdm reads it)."""
from __future__ import annotations

import sys

MIN_BYTES = 256 * 1024 * 1024  # smaller checkpoints load in a second or two: no bar


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def _first_rank() -> bool:
    from pagedserve.gpu.parallel_state import get_pp_rank, get_tp_rank

    return get_tp_rank() == 0 and get_pp_rank() == 0


class LoadProgress:
    """``update(nbytes)`` after each tensor; ``finish()`` when every tensor is in (the bar ends at
    100% even where a few tensors, skipped ones, were never counted); a no-op when not drawn."""

    def __init__(self, total_bytes: int, desc: str = "Loading weights", file=None) -> None:
        stream = sys.stderr if file is None else file
        self.bar = None
        if total_bytes >= MIN_BYTES and _is_terminal(stream) and _first_rank():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                            file=stream, dynamic_ncols=True, mininterval=0.25)

    @property
    def shown(self) -> bool:
        return self.bar is not None

    def update(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(int(nbytes))

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.update(max(0, self.bar.total - self.bar.n))
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "LoadProgress":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.finish()
        self.close()


NO_PROGRESS = LoadProgress(0)  # for callers that pass none
