"""A pipe-based step transport with ShmRing's interface: correct on any CPU.

Why: the shm ring publishes a message by storing its sequence number after the payload, and
pure Python has no memory barriers, so on weakly ordered CPUs (aarch64: Grace, Graviton) a
reader could see the number before the payload. A pipe moves bytes through the kernel, whose
read/write system calls order everything; it costs more per round trip (two syscalls per end,
no spinning), see ``pagedserve bench ipc``. gpu/transport.py picks which one runs.

One writer, N readers: one pipe per reader (the writer writes every message into each). Each
message is framed as ``[u64 little-endian length][payload]``; a length of 2**64 - 1 is the close
mark that ``mark_closed`` sends. Both ends are non-blocking: the writer waits for room with
``select`` (watching the peers, like the ring), the reader's fd is readable exactly when data
(or EOF) is there, so an asyncio loop can ``add_reader`` it and ``clear_wakeup`` has nothing to do.

Capacity: each pipe is sized to the ring's ``num_slots * slot_size`` (at least one page; the
kernel caps unprivileged sizes at /proc/sys/fs/pipe-max-size, 1 MiB by default), so a slow
reader holds the writer back as a full ring does. A frame of at most PIPE_BUF (4096) bytes is
written atomically or not at all, so a send that times out on it leaves the channel usable; a
larger frame may time out half written, after which the channel refuses further sends
(``RingError``) rather than let a reader decode a torn message (the executor fails anyway).

Death: every wait also watches the peers' fds (process sentinels) and the ``alive`` callback.
A reader whose pipe reaches EOF (every write end closed: the writer process is gone) raises
``RingPeerDied``; after the close mark it raises ``RingClosed``. A writer whose reader end is
gone gets EPIPE: ``RingPeerDied``. The ``PipeSpec`` travels to spawned children like a
``RingSpec``; ``attach`` closes the fds of other roles that came with it.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import struct
import time
import uuid
import weakref
from collections.abc import Callable, Sequence

from pagedserve.gpu.shm_ring import NAME_PREFIX, RingClosed, RingError, RingPeerDied
from pagedserve.gpu.transport_end import PassFd, TransportEnd, close_fds

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")
_CLOSE_MARK = (1 << 64) - 1
_PIPE_BUF = select.PIPE_BUF
_READ_CHUNK = 1 << 18
_WAIT_SLICE_S = 0.1  # how often a blocked end re-checks the liveness callback and the close flag
_SLOT_HEADER = 16  # the ring's per-slot header: payload_size mirrors the ring's for callers


class PipeSpec:
    """What another process needs to attach: the read and write end of each reader's pipe."""

    __slots__ = ("name", "num_slots", "slot_size", "num_readers", "_read_fds", "_write_fds")

    def __init__(self, name: str, num_slots: int, slot_size: int, num_readers: int,
                 read_fds: list[PassFd], write_fds: list[PassFd]):
        self.name = name
        self.num_slots = num_slots
        self.slot_size = slot_size
        self.num_readers = num_readers
        self._read_fds = read_fds
        self._write_fds = write_fds

    def __reduce__(self):
        return PipeSpec, (self.name, self.num_slots, self.slot_size, self.num_readers,
                          self._read_fds, self._write_fds)

    def __repr__(self) -> str:
        return f"PipeSpec({self.name!r}, readers={self.num_readers})"


class PipeChannel(TransportEnd):
    """One end of a pipe channel: the writer or reader ``i``. Create with ``create`` or ``attach``."""

    _kind = "channel"

    def __init__(self, spec: PipeSpec, *, role: int | str, owned_fds: list[int],
                 peer_fds: Sequence[int] = (), alive: Callable[[], bool] | None = None):
        if role != "writer" and not (isinstance(role, int) and 0 <= role < spec.num_readers):
            raise ValueError(f"role must be 'writer' or a reader index < {spec.num_readers}")
        self.spec = spec
        self.num_readers = spec.num_readers
        self.payload_size = spec.slot_size - _SLOT_HEADER
        self.peer_fds: list[int] = list(peer_fds)
        self.alive = alive
        self._role = role
        self._write_fds = [p.fd for p in spec._write_fds]
        self._read_fd = spec._read_fds[role].fd if isinstance(role, int) else -1
        self._buf = bytearray()  # reader: bytes read but not yet returned
        self._chunk = bytearray(_READ_CHUNK) if isinstance(role, int) else None
        self._closed_seen = False  # reader: got the close mark
        self._eof = False
        self._marked_closed = False
        self._broken: str | None = None  # writer: why sends are refused (a torn frame)
        self._owned = owned_fds
        self._finalizer = weakref.finalize(self, close_fds, owned_fds)

    # ---------------------------------------------------------------- construction

    @classmethod
    def create(cls, num_readers: int, num_slots: int = 64, slot_size: int = 16384, *,
               role: int | str | None = None, **kwargs) -> "PipeChannel":
        """Make one pipe per reader, sized like the ring would be; this end is ``role``."""
        if num_readers < 1:
            raise ValueError("a channel needs >= 1 reader")
        fds: list[int] = []
        read_fds, write_fds = [], []
        try:
            for _ in range(num_readers):
                r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                fds += [r, w]
                _size_pipe(w, num_slots * slot_size)
                read_fds.append(PassFd(r))
                write_fds.append(PassFd(w))
        except BaseException:
            close_fds(fds)
            raise
        spec = PipeSpec(NAME_PREFIX + "pipe-" + uuid.uuid4().hex, num_slots, slot_size, num_readers,
                        read_fds, write_fds)
        return cls(spec, role="writer" if role is None else role, owned_fds=fds, **kwargs)

    @classmethod
    def attach(cls, spec: PipeSpec, role: int | str, **kwargs) -> "PipeChannel":
        """Attach to a channel created by another process (or this one, as tests do).

        In a process that received the spec by pickling (a spawned child), the fds came as
        duplicates: this end keeps the ones its role uses and closes the others, so the
        writer's death reaches the reader as EOF and the reader's as EPIPE."""
        received = [p for p in [*spec._read_fds, *spec._write_fds] if p.received]
        if role == "writer":
            keep = {p.fd for p in spec._write_fds}
        elif isinstance(role, int) and 0 <= role < spec.num_readers:
            keep = {spec._read_fds[role].fd}
        else:
            raise ValueError(f"role must be 'writer' or a reader index < {spec.num_readers}")
        close_fds([p.fd for p in received if p.fd not in keep])
        owned = [p.fd for p in received if p.fd in keep]
        return cls(spec, role=role, owned_fds=owned, **kwargs)

    # ---------------------------------------------------------------- common

    @property
    def name(self) -> str:
        return self.spec.name

    def fileno(self) -> int:
        """The fd that becomes readable when this reader may have a message (for add_reader)."""
        if not isinstance(self._role, int):
            raise RingError("fileno() is the read end of a reader")
        return self._read_fd

    def clear_wakeup(self) -> None:
        """Nothing to reset: the pipe is readable exactly while data is there."""

    def mark_closed(self) -> None:
        """No more messages: readers get what was sent, then RingClosed. Never blocks."""
        if not self._finalizer.alive or self._marked_closed:
            return
        self._marked_closed = True
        if self._role == "writer" and self._broken is None:
            mark = _HEADER.pack(_CLOSE_MARK)
            for fd in self._write_fds:
                try:
                    os.write(fd, mark)  # 8 bytes < PIPE_BUF: all or nothing
                except OSError:  # full or gone: the reader learns from EOF or its peers instead
                    pass

    @property
    def is_closed(self) -> bool:
        return not self._finalizer.alive or self._marked_closed or self._closed_seen

    def close(self) -> None:
        """Close the fds this end owns. Safe to call twice."""
        self._finalizer()

    # ---------------------------------------------------------------- writer

    def send(self, data, timeout: float | None = None) -> None:
        """Write one message (any bytes-like) to every reader, waiting for room as needed."""
        if self._role != "writer":
            raise RingError("send() needs the writer end")
        self._ensure_open()
        if self._broken is not None:
            raise RingError(self._broken)
        if self._marked_closed:
            raise RingClosed(f"channel {self.name} was closed")
        mv = memoryview(data).cast("B")
        frame = memoryview(_HEADER.pack(len(mv)) + bytes(mv))
        deadline = None if timeout is None else time.monotonic() + timeout
        for i, fd in enumerate(self._write_fds):
            pos = 0
            while pos < len(frame):
                try:
                    pos += os.write(fd, frame[pos:])
                    continue
                except BlockingIOError:
                    pass
                except BrokenPipeError:
                    raise RingPeerDied(f"reader {i} of channel {self.name} is gone") from None
                try:
                    self._wait_writable(fd, deadline)
                except RingError:
                    if pos or i:  # a reader already has part of this message
                        self._broken = (f"channel {self.name} is unusable: a send stopped half way "
                                        "through a message")
                    raise

    def _wait_writable(self, fd: int, deadline: float | None) -> None:
        while True:
            if self._marked_closed:
                raise RingClosed(f"channel {self.name} was closed while the writer waited for room")
            readable, writable = self._select_slice(
                [], [fd], deadline, _WAIT_SLICE_S,
                f"no room in channel {self.name}: a reader is not consuming")
            if writable:
                return
            self._check_peers(readable)

    # ---------------------------------------------------------------- reader

    def _fill(self) -> None:
        """Move whatever the pipe holds into the buffer, without blocking."""
        chunk = self._chunk
        while not self._eof:
            try:
                n = os.readv(self._read_fd, [chunk])
            except BlockingIOError:
                return
            if n == 0:
                self._eof = True
                return
            with memoryview(chunk) as mv:
                self._buf += mv[:n]
            if n < _READ_CHUNK:
                return

    def _next_frame(self) -> bytes | None:
        buf = self._buf
        if self._closed_seen or len(buf) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(buf)
        if length == _CLOSE_MARK:
            self._closed_seen = True
            del buf[:_HEADER.size]
            return None
        end = _HEADER.size + length
        if len(buf) < end:
            return None
        with memoryview(buf) as mv:
            data = bytes(mv[_HEADER.size:end])
        del buf[:end]
        return data

    def try_recv(self):
        """Return the next complete message or None without blocking; raises RingPeerDied once
        the writer is gone (EOF) and nothing is left (the loop's add_reader would spin on EOF)."""
        self._ensure_open()
        if not isinstance(self._role, int):
            raise RingError("try_recv() needs a reader end")
        data = self._next_frame()
        if data is not None:
            return data
        self._fill()
        data = self._next_frame()
        if data is None and self._eof and not self._closed_seen:
            raise RingPeerDied(f"the writer of channel {self.name} is gone")
        return data

    def recv(self, timeout: float | None = None):
        """Wait for the next message."""
        if not isinstance(self._role, int):
            raise RingError("recv() needs a reader end")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            data = self.try_recv()
            if data is not None:
                return data
            self.wait(deadline)

    def _frame_ready(self) -> bool:
        buf = self._buf
        if len(buf) < _HEADER.size:
            return False
        (length,) = _HEADER.unpack_from(buf)
        return length == _CLOSE_MARK or len(buf) >= _HEADER.size + length

    def wait(self, deadline: float | None = None) -> None:
        """Reader: return once data may be ready; ``deadline`` is monotonic."""
        self._ensure_open()
        fd = self._read_fd
        while True:
            if self._frame_ready() or self._eof:
                return
            if self._closed_seen or self._marked_closed:
                raise RingClosed(f"channel {self.name} is closed")
            readable, _ = self._select_slice([fd], [], deadline, _WAIT_SLICE_S,
                                             f"no message on channel {self.name} in time")
            if fd in readable:
                return
            self._check_peers(readable)


def _size_pipe(fd: int, size: int) -> None:
    """Ask for a pipe of ``size`` bytes (at least a page); keep the default if refused."""
    want = max(size, os.sysconf("SC_PAGE_SIZE"))
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, want)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EINVAL, errno.EBUSY):
            raise
        logger.debug("pipe size %d refused (%s); keeping %d bytes", want, e,
                     fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ))
