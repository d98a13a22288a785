"""Hand a channel's fds (eventfds, pipe ends) to a process that was not spawned by us.

Why: a ``RingSpec`` / ``PipeSpec`` carries its wake-up fds as ``PassFd``, which travel only in
the arguments of a ``multiprocessing`` child. A Ray actor is started by the raylet, not by the
engine, so on the same node its fds come over a Unix socket instead (SCM_RIGHTS). The socket
is abstract (no file to clean up), lives only while the actors attach, and answers only a
caller of this user (or one of the workers' pids, by its peer credentials) that presents the random
token sent along with the address (in the Ray call), each caller within its own short deadline.

``split_spec`` turns a spec into a picklable skeleton (fds replaced by their index) plus the
fd list; ``rebuild_spec`` puts received fds back, marked as owned by the receiving end.
"""
from __future__ import annotations

import logging
import os
import secrets
import selectors
import socket
import struct
import time
import uuid
from collections.abc import Iterable

from pagedserve.gpu.transport_end import PassFd

logger = logging.getLogger(__name__)

_TOKEN_BYTES = 32
PEER_TIMEOUT_S = 2.0  # for one caller to send its token (a worker sends it as soon as it connects)
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


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
    """Serves one fd list to callers with the token, on an abstract Unix socket.

    An abstract socket has no file permissions: any local process may connect. So a caller is read
    only if its peer credentials (SO_PEERCRED) name this user or one of ``allowed_pids`` (the
    workers' processes); others are hung up on unread. Callers are served side by side, each with
    its own deadline (``PEER_TIMEOUT_S``) to send the token, so a caller that connects and stays
    silent never holds the handoff up (issue 37)."""

    def __init__(self, fds: list[int], allowed_pids: Iterable[int] = ()):
        self.fds = list(fds)
        self.allowed_pids = set(allowed_pids)
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self.address = "\0pagedserve-fds-" + uuid.uuid4().hex
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(16)

    def serve(self, count: int, timeout: float) -> None:
        """Hand the fds to ``count`` callers presenting the token, or raise TimeoutError."""
        deadline = time.monotonic() + timeout
        served = 0
        pending: dict[socket.socket, tuple[bytearray, float]] = {}  # caller -> (token so far, its deadline)
        sel = selectors.DefaultSelector()
        self._sock.setblocking(False)
        sel.register(self._sock, selectors.EVENT_READ, None)

        def drop(conn: socket.socket) -> None:
            pending.pop(conn, None)
            sel.unregister(conn)
            conn.close()

        try:
            while served < count:
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(f"{count - served} worker(s) did not collect the channel fds in time")
                for conn, (_, until) in list(pending.items()):
                    if now >= until:  # silent or slow: hung up on, the others go on
                        drop(conn)
                wake = min([deadline, *(until for _, until in pending.values())])
                for key, _ in sel.select(max(0.0, wake - now)):
                    if key.data is None:
                        self._accept(sel, pending, now)
                        continue
                    conn = key.data
                    token, until = pending[conn]
                    try:
                        chunk = conn.recv(_TOKEN_BYTES - len(token))
                    except BlockingIOError:
                        continue
                    except OSError:
                        drop(conn)
                        continue
                    if not chunk:
                        drop(conn)
                        continue
                    token += chunk
                    if len(token) < _TOKEN_BYTES:
                        continue
                    if secrets.compare_digest(bytes(token), self.token):
                        try:
                            conn.setblocking(True)
                            conn.settimeout(PEER_TIMEOUT_S)
                            socket.send_fds(conn, [b"k"], self.fds)
                            served += 1
                        except OSError:
                            pass
                    drop(conn)  # a stranger with a wrong token gets nothing
        finally:
            for conn in list(pending):
                drop(conn)
            sel.close()
            self._sock.setblocking(True)

    def _accept(self, sel, pending: dict, now: float) -> None:
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        if not self._trusted(conn):
            conn.close()
            return
        conn.setblocking(False)
        pending[conn] = (bytearray(), now + PEER_TIMEOUT_S)
        sel.register(conn, selectors.EVENT_READ, conn)

    def _trusted(self, conn: socket.socket) -> bool:
        """Whether the caller is this user or one of the allowed pids (SO_PEERCRED)."""
        try:
            pid, uid, _ = _CREDS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
        except OSError:
            return False
        if uid == os.geteuid() or pid in self.allowed_pids:
            return True
        logger.warning("fd handoff: refused a connection from pid %d (uid %d), not a worker of this server",
                       pid, uid)
        return False

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
