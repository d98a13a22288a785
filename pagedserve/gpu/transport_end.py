"""What one end of a step transport (ShmRing, PipeChannel) does the same way in both: pass its
fds to a spawned worker (PassFd), close them, refuse use after close, act as a context manager,
and block in poll() over its own fds plus the peers' sentinel fds in short slices up to a
deadline, re-checking the ``alive`` callback in between. One copy keeps the two transports' death and timeout behaviour identical.
poll(), not select(): select() refuses fds >= 1024, which a busy server hands out."""
from __future__ import annotations

import errno
import math
import os
import select
import time
from collections.abc import Callable, Sequence
from multiprocessing.reduction import DupFd
from typing import Self

from pagedserve.gpu.ring_errors import RingClosed, RingPeerDied, RingTimeout


def close_fds(fds: list[int]) -> None:
    """Close every fd in ``fds`` (one already closed is skipped) and empty the list, so that a
    second call (a finalizer after an explicit close) does nothing."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class PassFd:
    """An fd that travels to a spawned child by multiprocessing's fd passing."""

    __slots__ = ("fd", "received")

    def __init__(self, fd: int, received: bool = False):
        self.fd = fd
        self.received = received  # True in the process that got a duplicate: it must close it

    def __reduce__(self):
        return _rebuild_pass_fd, (DupFd(self.fd),)


def _rebuild_pass_fd(dup) -> "PassFd":
    return PassFd(dup.detach(), received=True)


class TransportEnd:
    """Base of ShmRing and PipeChannel. Subclasses set ``_kind`` (the word in error messages),
    ``peer_fds``, ``alive``, a ``name`` and a ``_finalizer`` that closes the end."""

    _kind = "transport"
    name: str
    peer_fds: list[int]
    alive: Callable[[], bool] | None

    def _ensure_open(self) -> None:
        if not self._finalizer.alive:
            raise RingClosed(f"this end of {self._kind} {self.name} is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_peers(self, readable: list[int]) -> None:
        """RingPeerDied if a peer's sentinel fired or the ``alive`` callback says no."""
        if any(fd in self.peer_fds for fd in readable):
            raise RingPeerDied(f"a process at the other end of {self._kind} {self.name} exited")
        if self.alive is not None and not self.alive():
            raise RingPeerDied(f"a process at the other end of {self._kind} {self.name} is gone")

    def _select_slice(self, read_fds: Sequence[int], write_fds: Sequence[int],
                      deadline: float | None, slice_s: float,
                      timeout_message: str) -> tuple[list[int], list[int]]:
        """One bounded select over ``read_fds`` + the peers' fds and ``write_fds``: at most
        ``slice_s``, less near the monotonic ``deadline``; RingTimeout once it has passed."""
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RingTimeout(timeout_message)
            slice_s = min(slice_s, left)
        return wait_fds([*read_fds, *self.peer_fds], write_fds, slice_s)


# What select() counts as ready: readable also at hang-up or error (a read then says why),
# writable also at error (a write then says why).
_READ_EVENTS = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR
_POLL_READ = select.POLLIN | select.POLLPRI
_WRITE_EVENTS = select.POLLOUT | select.POLLERR


def wait_fds(read_fds: Sequence[int], write_fds: Sequence[int],
             timeout_s: float) -> tuple[list[int], list[int]]:
    """select()'s answer (the ready read fds, the ready write fds) from one poll(), which takes
    any fd number. A closed fd raises OSError(EBADF), as select() does."""
    poller = select.poll()
    for fd in read_fds:
        poller.register(fd, _POLL_READ)
    for fd in write_fds:  # (register again = modify: an fd in both lists is watched for both)
        poller.register(fd, _POLL_READ | select.POLLOUT if fd in read_fds else select.POLLOUT)
    events = poller.poll(max(0, math.ceil(timeout_s * 1000)))
    readable: list[int] = []
    writable: list[int] = []
    for fd, ev in events:
        if ev & select.POLLNVAL:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        if ev & _READ_EVENTS and fd in read_fds:
            readable.append(fd)
        if ev & _WRITE_EVENTS and fd in write_fds:
            writable.append(fd)
    return readable, writable
