"""Hand a channel's fds (eventfds, pipe ends) to a process that was not spawned by us.

Why: a ``RingSpec`` / ``PipeSpec`` carries its wake-up fds as ``PassFd``, which travel only in
the arguments of a ``multiprocessing`` child. A Ray actor is started by the raylet, not by the
engine, so on the same node its fds come over a Unix socket instead (SCM_RIGHTS). The socket
is abstract (no file to clean up), lives only while the actors attach, and answers only a
caller that presents the random token sent along with the address (in the Ray call).

``split_spec`` turns a spec into a picklable skeleton (fds replaced by their index) plus the
fd list; ``rebuild_spec`` puts received fds back, marked as owned by the receiving end.
"""
from __future__ import annotations

import secrets
import socket
import time
import uuid

from gpu.transport_end import PassFd

_TOKEN_BYTES = 32


class _FdSlot:
    """Placeholder for the fd at ``index`` of the handed-over list."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __reduce__(self):
        return _FdSlot, (self.index,)


def split_spec(spec) -> tuple[tuple, list[int]]:
    """``(skeleton, fds)``: the spec's constructor arguments with every PassFd replaced."""
    cls, args = spec.__reduce__()
    fds: list[int] = []

    def strip(value):
        if isinstance(value, PassFd):
            fds.append(value.fd)
            return _FdSlot(len(fds) - 1)
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return (cls, tuple(strip(a) for a in args)), fds


def rebuild_spec(skeleton: tuple, fds: list[int]):
    """The spec again, its fds the received duplicates (the attaching end owns and closes them)."""
    cls, args = skeleton

    def fill(value):
        if isinstance(value, _FdSlot):
            return PassFd(fds[value.index], received=True)
        if isinstance(value, list):
            return [fill(v) for v in value]
        return value

    return cls(*(fill(a) for a in args))


class FdServer:
    """Serves one fd list to callers with the token, on an abstract Unix socket."""

    def __init__(self, fds: list[int]):
        self.fds = list(fds)
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self.address = "\0pagedserve-fds-" + uuid.uuid4().hex
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(16)

    def serve(self, count: int, timeout: float) -> None:
        """Hand the fds to ``count`` callers presenting the token, or raise TimeoutError."""
        deadline = time.monotonic() + timeout
        served = 0
        while served < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{count - served} worker(s) did not collect the channel fds in time")
            self._sock.settimeout(left)
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                token = _recv_exact(conn, _TOKEN_BYTES)
                if not secrets.compare_digest(token, self.token):
                    continue  # a stranger: nothing for it
                socket.send_fds(conn, [b"k"], self.fds)
                served += 1

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "FdServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def receive_fds(address: str, token: bytes, count: int, timeout: float = 30.0) -> list[int]:
    """The caller's side: duplicates of the server's ``count`` fds, now this process's."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(address)
        s.sendall(token)
        _, fds, _, _ = socket.recv_fds(s, 16, count)
    if len(fds) != count:
        for fd in fds:
            socket.close(fd)
        raise RuntimeError(f"expected {count} fds from the engine, got {len(fds)}")
    return fds
