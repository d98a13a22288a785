"""A shared-memory ring buffer: one writer, N readers, fixed slots, no locks.

Why: a decode step's message is a few KiB and arrives every few milliseconds; a pipe or a
``multiprocessing.Queue`` (pickle + feeder thread + socket) costs hundreds of microseconds per
round trip, the ring a few tens.

Layout of the segment (all counters are little-endian u64, each on its own 64-byte line):

    line 0          magic, num_slots, slot_size, num_readers, closed flag, writer-waiting flag
    line 1 + i      reader i's read mark: how many slots it has consumed (monotonic)
    slots           num_slots x slot_size bytes; each slot = [seq u64][msg_len u64][payload]

Slot ``k % num_slots`` holds the k-th slot ever written once its ``seq`` equals ``k + 1``. The
writer fills the payload first and stores ``seq`` last, so a reader that sees the new ``seq``
sees the payload too. That holds only where the CPU keeps stores (and loads) in order, as x86
does (TSO): pure Python cannot issue memory barriers, so on weakly ordered CPUs (aarch64,
POWER, RISC-V) a reader could see the new ``seq`` before the payload. The ring therefore
REFUSES to run on anything but x86 (``RingUnsupported``); gpu/transport.py picks the pipe
channel (gpu/pipe_channel.py, ordered by the kernel) there instead. A message
longer than one payload spans consecutive slots; the writer publishes them one by one as room
appears, so a message may even be larger than the whole ring. The writer never reuses a slot
until every reader's mark has passed it: a slow reader makes the writer wait, never lose data.

Wake-ups: one eventfd per reader (writer -> reader, signalled after every message, so a reader
can block in ``select`` or an asyncio loop can ``add_reader`` it) and one eventfd for room
(reader -> writer, signalled only while the writer says it is waiting; the writer re-checks
every few milliseconds, so a missed signal costs a little latency, never a hang). Readers spin
for a short while on the sequence number before blocking, which is what makes round trips fast.

Every wait also watches "peer" fds (process sentinels: readable once the process is gone) and
an optional liveness callback, so a dead peer raises ``RingPeerDied`` instead of a hang.

The creator owns the segment: it unlinks it on ``close()``, when garbage collected, at
interpreter exit, and (through multiprocessing's resource tracker) when it is killed. Other
processes attach with ``ShmRing.attach(spec, ...)`` without registering the segment with a
resource tracker, so nobody unlinks it twice or too early. The ``RingSpec`` is picklable and
carries the eventfds as ``multiprocessing`` duplicable fds: pass it in the arguments of a
spawned ``multiprocessing.Process`` (that is when fds can travel).
"""
from __future__ import annotations

import logging
import os
import platform
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker, shared_memory

from pagedserve.gpu.ring_errors import (  # noqa: F401  (re-exported: callers import them from here)
    RingClosed, RingError, RingPeerDied, RingTimeout, RingUnsupported)
from pagedserve.gpu.transport_end import PassFd, TransportEnd, close_fds

logger = logging.getLogger(__name__)

NAME_PREFIX = "pagedserve-"
_MAGIC = 0x70616765_64726E67  # "pagedrng"
_LINE = 64
_SLOT_HEADER = 16
# u64 word indexes inside line 0
_W_MAGIC, _W_SLOTS, _W_SLOT_SIZE, _W_READERS, _W_CLOSED, _W_WRITER_WAITING = range(6)
_WRITER_RECHECK_S = 0.002  # the writer's sleep slice while the ring is full
_READER_SLICE_S = 0.1  # the reader's sleep slice (checks the liveness callback between)


# platform.machine() of CPUs with x86's total store order (the only ones the ring trusts).
X86_MACHINES = frozenset({"x86_64", "AMD64", "i386", "i686"})


def ring_is_safe_here() -> bool:
    return platform.machine() in X86_MACHINES


def check_memory_ordering() -> None:
    """Raise RingUnsupported on CPUs where a reader could see a slot's seq before its payload."""
    machine = platform.machine()
    if machine not in X86_MACHINES:
        raise RingUnsupported(
            f"the shared-memory ring needs x86 memory ordering (stores seen in order) and this CPU "
            f"is {machine or 'unknown'}: Python cannot issue the memory barriers a weakly ordered "
            f"CPU needs. Use the pipe transport (the default here; PAGEDSERVE_STEP_TRANSPORT=pipe)")


class RingSpec:
    """Everything another process needs to attach: name, geometry and the wake-up fds."""

    __slots__ = ("name", "num_slots", "slot_size", "num_readers", "_data_fds", "_space_fd")

    def __init__(self, name: str, num_slots: int, slot_size: int, num_readers: int,
                 data_fds: list[PassFd], space_fd: PassFd):
        self.name = name
        self.num_slots = num_slots
        self.slot_size = slot_size
        self.num_readers = num_readers
        self._data_fds = data_fds
        self._space_fd = space_fd

    def __reduce__(self):
        return RingSpec, (self.name, self.num_slots, self.slot_size, self.num_readers,
                          self._data_fds, self._space_fd)

    def __repr__(self) -> str:
        return (f"RingSpec({self.name!r}, slots={self.num_slots}, slot_size={self.slot_size}, "
                f"readers={self.num_readers})")


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Open an existing segment without registering it with this process's resource tracker.

    Python < 3.13 registers every attached segment, and a tracker unlinks what is registered
    when its process tree exits: an attaching worker must not own the segment.
    """
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


def _cleanup(shm: shared_memory.SharedMemory | None, unlink: bool, fds: list[int],
             views: list[memoryview]) -> None:
    """Release the mapping, unlink the segment (owner only) and close owned fds. Idempotent."""
    for view in views:
        view.release()
    views.clear()
    if shm is not None:
        try:
            shm.close()
        except BufferError:  # a view is still exported: the mapping goes away with the process
            pass
        if unlink:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
    close_fds(fds)


class ShmRing(TransportEnd):
    """One end of a ring: the writer or reader ``i``. Create with ``create`` or ``attach``."""

    _kind = "ring"

    def __init__(self, shm: shared_memory.SharedMemory, spec: RingSpec, *, owner: bool,
                 role: int | str | None, owned_fds: list[int],
                 peer_fds: Sequence[int] = (), alive: Callable[[], bool] | None = None,
                 spin_us: float = 100.0, spin_yield: bool = True):
        self.spec = spec
        self.owner = owner
        self.num_slots = spec.num_slots
        self.slot_size = spec.slot_size
        self.num_readers = spec.num_readers
        self.payload_size = spec.slot_size - _SLOT_HEADER
        self.peer_fds: list[int] = list(peer_fds)
        self.alive = alive
        self.spin_ns = int(spin_us * 1000)
        # Yield the CPU between checks: on a machine with more runnable processes than cores,
        # a waiter that spins without yielding delays the very process it waits for.
        self.spin_yield = spin_yield
        self._shm = shm
        self._buf = shm.buf
        self._u64 = shm.buf.cast("Q")
        self._slots_off = _LINE * (1 + spec.num_readers)
        self._data_fds = [p.fd for p in spec._data_fds]
        self._space_fd = spec._space_fd.fd
        self._role: int | str | None = None
        # writer state
        self._wcount = 0
        self._min_mark = 0
        # reader state
        self._rcount = 0
        self._partial: bytearray | None = None
        self._partial_pos = 0
        self._finalizer = weakref.finalize(self, _cleanup, shm, owner, owned_fds, [self._u64])
        if role is not None:
            self.set_role(role)

    # ---------------------------------------------------------------- construction

    @classmethod
    def create(cls, num_readers: int, num_slots: int = 64, slot_size: int = 16384, *,
               role: int | str | None = None, **kwargs) -> "ShmRing":
        """Create a new segment (this process owns and unlinks it) and its wake-up fds."""
        check_memory_ordering()
        if num_readers < 1 or num_slots < 2 or slot_size < _SLOT_HEADER + 8:
            raise ValueError("a ring needs >= 1 reader, >= 2 slots and slots of >= 24 bytes")
        slot_size = -(-slot_size // _LINE) * _LINE
        size = _LINE * (1 + num_readers) + num_slots * slot_size
        name = NAME_PREFIX + uuid.uuid4().hex
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        fds: list[int] = []
        try:
            for _ in range(num_readers + 1):
                fds.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
        except BaseException:
            _cleanup(shm, True, fds, [])
            raise
        u64 = shm.buf.cast("Q")
        u64[_W_SLOTS], u64[_W_SLOT_SIZE], u64[_W_READERS] = num_slots, slot_size, num_readers
        u64[_W_MAGIC] = _MAGIC
        u64.release()
        spec = RingSpec(name, num_slots, slot_size, num_readers,
                        [PassFd(fd) for fd in fds[:num_readers]], PassFd(fds[num_readers]))
        return cls(shm, spec, owner=True, role=role, owned_fds=fds, **kwargs)

    @classmethod
    def attach(cls, spec: RingSpec, role: int | str, **kwargs) -> "ShmRing":
        """Attach to a ring created by another process (typically received by a spawned child).

        Attach each spec at most once per process: the end owns (and closes) the fds that came
        with it. A ring has one writer end for its whole life (its position is not shared).
        """
        check_memory_ordering()
        shm = _attach_untracked(spec.name)
        u64 = shm.buf.cast("Q")
        matches = u64[_W_MAGIC] == _MAGIC and u64[_W_SLOTS] == spec.num_slots
        u64.release()
        if not matches:
            shm.close()
            raise RingError(f"shared memory {spec.name} is not a ring matching {spec!r}")
        # fds duplicated into this process by the spawn machinery belong to this end; in the
        # creating process they stay the creator's.
        owned = [p.fd for p in [*spec._data_fds, spec._space_fd] if p.received]
        return cls(shm, spec, owner=False, role=role, owned_fds=owned, **kwargs)

    def set_role(self, role: int | str) -> None:
        """``"writer"`` or a reader index; a reader resumes at its read mark in shared memory."""
        if role != "writer" and not (isinstance(role, int) and 0 <= role < self.num_readers):
            raise ValueError(f"role must be 'writer' or a reader index < {self.num_readers}")
        self._role = role
        if role != "writer":
            self._rcount = self._u64[self._mark_word(role)]

    def _mark_word(self, reader: int) -> int:
        return (_LINE * (1 + reader)) >> 3

    # ---------------------------------------------------------------- common

    @property
    def name(self) -> str:
        return self.spec.name

    def fileno(self) -> int:
        """The fd that becomes readable when this reader may have a message (for add_reader)."""
        if not isinstance(self._role, int):
            raise RingError("fileno() is the wake-up fd of a reader end")
        return self._data_fds[self._role]

    def clear_wakeup(self) -> None:
        """Reset this reader's eventfd (call before polling with ``try_recv``)."""
        try:
            os.read(self.fileno(), 8)
        except BlockingIOError:
            pass

    def mark_closed(self) -> None:
        """Tell every end that no more messages will come (readers drain, then RingClosed)."""
        if not self._finalizer.alive:
            return
        self._u64[_W_CLOSED] = 1
        for fd in self._data_fds + [self._space_fd]:
            try:
                os.eventfd_write(fd, 1)
            except OSError:
                pass

    @property
    def is_closed(self) -> bool:
        """This end was closed (or finalized at exit), or the ring was marked closed."""
        return not self._finalizer.alive or self._u64[_W_CLOSED] == 1

    def close(self) -> None:
        """Drop the mapping; the owner also unlinks the segment. Safe to call twice."""
        self._finalizer()

    # ---------------------------------------------------------------- writer

    def send(self, data, timeout: float | None = None) -> None:
        """Write one message (any bytes-like), waiting for room as needed; never truncates."""
        if self._role != "writer":
            raise RingError("send() needs the writer end")
        self._ensure_open()
        mv = memoryview(data).cast("B")
        length = len(mv)
        payload = self.payload_size
        deadline = None if timeout is None else time.monotonic() + timeout
        u64, buf, n, slot_size, slots_off = self._u64, self._buf, self.num_slots, self.slot_size, self._slots_off
        pos = 0
        unsignalled = False
        while True:
            w = self._wcount
            if w - self._min_mark >= n and not self._room(w):
                if unsignalled:  # let readers drain the part of a big message already written
                    self._signal_readers()
                    unsignalled = False
                self._wait_room(w, deadline)
            base = slots_off + (w % n) * slot_size
            take = min(payload, length - pos)
            start = base + _SLOT_HEADER
            buf[start:start + take] = mv[pos:pos + take]
            word = base >> 3
            u64[word + 1] = length
            u64[word] = w + 1  # publish: stored after the payload
            self._wcount = w + 1
            unsignalled = True
            pos += take
            if pos >= length:
                break
        self._signal_readers()

    def _signal_readers(self) -> None:
        for fd in self._data_fds:
            os.eventfd_write(fd, 1)

    def _room(self, w: int) -> bool:
        u64 = self._u64
        self._min_mark = min(u64[self._mark_word(i)] for i in range(self.num_readers))
        return w - self._min_mark < self.num_slots

    def _wait_room(self, w: int, deadline: float | None) -> None:
        u64 = self._u64
        spin_end = time.perf_counter_ns() + self.spin_ns // 2
        while time.perf_counter_ns() < spin_end:
            if self._room(w):
                return
            if self.spin_yield:
                os.sched_yield()
        while True:
            if u64[_W_CLOSED]:
                raise RingClosed(f"ring {self.name} was closed while the writer waited for room")
            u64[_W_WRITER_WAITING] = 1
            if self._room(w):
                u64[_W_WRITER_WAITING] = 0
                return
            try:
                readable, _ = self._select_slice(
                    [self._space_fd], [], deadline, _WRITER_RECHECK_S,
                    f"no room in ring {self.name}: a reader is not consuming")
            except RingTimeout:
                u64[_W_WRITER_WAITING] = 0
                raise
            if self._space_fd in readable:
                try:
                    os.read(self._space_fd, 8)
                except BlockingIOError:
                    pass
            if self._room(w):
                u64[_W_WRITER_WAITING] = 0
                return
            self._check_peers(readable)

    # ---------------------------------------------------------------- reader

    def try_recv(self):
        """Return the next complete message (bytes-like) or None without blocking."""
        self._ensure_open()
        u64, n, slot_size, slots_off = self._u64, self.num_slots, self.slot_size, self._slots_off
        payload = self.payload_size
        while True:
            r = self._rcount
            base = slots_off + (r % n) * slot_size
            word = base >> 3
            if u64[word] != r + 1:
                return None
            start = base + _SLOT_HEADER
            if self._partial is None:
                length = u64[word + 1]
                if length <= payload:
                    data = bytes(self._buf[start:start + length])
                    self._advance(r + 1)
                    return data
                self._partial = bytearray(length)
                self._partial_pos = 0
            out, pos = self._partial, self._partial_pos
            take = min(payload, len(out) - pos)
            out[pos:pos + take] = self._buf[start:start + take]
            self._advance(r + 1)
            pos += take
            if pos == len(out):
                self._partial = None
                return out
            self._partial_pos = pos

    def _advance(self, count: int) -> None:
        self._rcount = count
        u64 = self._u64
        u64[self._mark_word(self._role)] = count
        if u64[_W_WRITER_WAITING]:
            os.eventfd_write(self._space_fd, 1)

    def recv(self, timeout: float | None = None):
        """Wait for the next message: spin on the sequence number briefly, then block."""
        if not isinstance(self._role, int):
            raise RingError("recv() needs a reader end")
        data = self.try_recv()
        if data is not None:
            return data
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.wait(deadline)
            data = self.try_recv()
            if data is not None:
                return data

    def _data_ready(self) -> bool:
        r = self._rcount
        return self._u64[(self._slots_off + (r % self.num_slots) * self.slot_size) >> 3] == r + 1

    def wait(self, deadline: float | None = None) -> None:
        """Reader: return once a slot is ready (spin, then block); ``deadline`` is monotonic."""
        spin_end = time.perf_counter_ns() + self.spin_ns
        while time.perf_counter_ns() < spin_end:
            if self._data_ready():
                return
            if self.spin_yield:
                os.sched_yield()
        fd = self._data_fds[self._role]
        while True:
            if self._data_ready():
                return
            if self._u64[_W_CLOSED]:
                raise RingClosed(f"ring {self.name} is closed")
            readable, _ = self._select_slice([fd], [], deadline, _READER_SLICE_S,
                                             f"no message on ring {self.name} in time")
            if fd in readable:
                try:
                    os.read(fd, 8)
                except BlockingIOError:
                    pass
            if self._data_ready():
                return
            self._check_peers(readable)


def leftover_segments() -> list[str]:
    """Names of this project's segments still in /dev/shm (tests, diagnostics)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX))
    except FileNotFoundError:
        return []
