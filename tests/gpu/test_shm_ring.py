"""The step transports: ordering, splitting, wrap-around, back-pressure and dead peers, across
processes. Every behaviour test runs on both transports (gpu/transport.py): the shared-memory
ring and the pipe channel that replaces it on CPUs without x86 memory ordering."""
from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time

import pytest

from pagedserve.gpu.shm_ring import (RingClosed, RingPeerDied, RingTimeout, ShmRing, leftover_segments)
from pagedserve.gpu.transport import attach_channel, create_channel

CTX = multiprocessing.get_context("spawn")
SLOTS, SLOT_SIZE = 16, 256  # payload 240 bytes; the whole ring holds 3840 bytes
POOL_SEED = 1234


@pytest.fixture(params=["shm", "pipe"])
def transport(request) -> str:
    return request.param


def _create(kind: str, num_readers: int, num_slots: int, slot_size: int, **kwargs):
    return create_channel(num_readers, num_slots, slot_size, kind=kind, **kwargs)


def _fill_until_timeout(w, message: bytes, limit: int = 100_000) -> int:
    """Send ``message`` until a send times out (the buffer is full); returns how many fitted."""
    for sent in range(limit):
        try:
            w.send(message, timeout=0.05)
        except RingTimeout:
            return sent
    raise AssertionError(f"{limit} messages never filled the channel")


@pytest.fixture(autouse=True)
def no_leftover_segments(monkeypatch):
    """Every segment this test created is gone at its end (other tests may run at the same time,
    so only the names created here are checked, never all of /dev/shm)."""
    created: list[str] = []
    create = ShmRing.create.__func__

    def recording_create(cls, *args, **kwargs):
        ring = create(cls, *args, **kwargs)
        created.append(ring.name)
        return ring

    monkeypatch.setattr(ShmRing, "create", classmethod(recording_create))
    yield
    assert not set(created) & set(leftover_segments())


def _pool() -> bytes:
    return random.Random(POOL_SEED).randbytes(1 << 16)


def _messages(seed: int, count: int, payload: int):
    """Deterministic messages: 4-byte index + bytes of a random pool. Sizes from 1 byte to
    several slots, a few larger than the whole ring."""
    rnd = random.Random(seed)
    pool = _pool()
    for i in range(count):
        r = rnd.random()
        if r < 0.6:
            size = rnd.randint(1, payload)
        elif r < 0.995:
            size = rnd.randint(payload + 1, 4 * payload)
        else:
            size = rnd.randint(SLOTS * payload, SLOTS * payload * 3)
        off = rnd.randrange(len(pool) - size)
        head = i.to_bytes(4, "little")
        yield (head + pool[off:off + size])[:size] if size < 4 else head + pool[off:off + size - 4]


def _reader_main(spec, index: int, seed: int, count: int, conn, delay_every: int = 0) -> None:
    ring = attach_channel(spec, index)
    received, bad = 0, None
    try:
        for i, expected in enumerate(_messages(seed, count, ring.payload_size)):
            if delay_every and i % delay_every == 0:
                time.sleep(0.02)
            got = ring.recv(timeout=60)
            if bad is None and bytes(got) != expected:
                bad = (i, len(got), len(expected))
            received += 1
        conn.send((received, bad, ring.try_recv() is None))
    except BaseException as e:  # report, do not hang the test
        conn.send((received, repr(e), False))
    finally:
        ring.close()


def _stalling_reader(spec, index: int, consume: int, conn) -> None:
    ring = attach_channel(spec, index)
    for _ in range(consume):
        ring.recv(timeout=60)
    conn.send("stalled")
    time.sleep(120)


def _run_stress(kind: str, num_readers: int, count: int, seed: int, delay_every: int = 0) -> float:
    ring = _create(kind, num_readers, SLOTS, SLOT_SIZE, role="writer")
    procs, conns = [], []
    try:
        for i in range(num_readers):
            recv_conn, send_conn = CTX.Pipe(duplex=False)
            p = CTX.Process(target=_reader_main, args=(ring.spec, i, seed, count, send_conn, delay_every))
            p.start()
            send_conn.close()
            procs.append(p)
            conns.append(recv_conn)
        ring.peer_fds = [p.sentinel for p in procs]
        t0 = time.monotonic()
        for msg in _messages(seed, count, ring.payload_size):
            ring.send(msg, timeout=60)
        results = [c.recv() for c in conns]
        elapsed = time.monotonic() - t0
        for p in procs:
            p.join(10)
        assert results == [(count, None, True)] * num_readers
        assert all(p.exitcode == 0 for p in procs)
        return elapsed
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join()
        ring.close()


# 100k messages per reader count keeps each run within ~10 s on a loaded 2-core machine.
@pytest.mark.parametrize("num_readers", [1, 3])
def test_stress_every_message_once_in_order_byte_identical(transport, num_readers):
    _run_stress(transport, num_readers, 100_000, seed=num_readers)


def test_slow_reader_makes_writer_wait_never_overwrite(transport):
    # one fast and one slow reader: the writer must wait for the slow one at every wrap
    count = 400
    ring = _create(transport, 2, SLOTS, SLOT_SIZE, role="writer")
    procs, conns = [], []
    try:
        for i, delay in enumerate([0, 10]):
            recv_conn, send_conn = CTX.Pipe(duplex=False)
            p = CTX.Process(target=_reader_main, args=(ring.spec, i, 7, count, send_conn, delay))
            p.start()
            send_conn.close()
            procs.append(p)
            conns.append(recv_conn)
        ring.peer_fds = [p.sentinel for p in procs]
        t0 = time.monotonic()
        for msg in _messages(7, count, ring.payload_size):
            ring.send(msg, timeout=60)
        assert time.monotonic() - t0 > 0.3  # 40 delays of 20 ms held the writer back
        assert [c.recv() for c in conns] == [(count, None, True)] * 2
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
        ring.close()


def test_full_ring_blocks_writer_until_the_reader_consumes():
    with ShmRing.create(1, 4, 64, role="writer") as w:
        r = ShmRing.attach(w.spec, 0)
        for i in range(4):
            w.send(bytes([i]) * 48)  # one slot each
        with pytest.raises(RingTimeout):
            w.send(b"x", timeout=0.05)
        assert r.recv() == bytes([0]) * 48  # slot 0 was not overwritten
        w.send(b"fifth", timeout=1)
        assert [bytes(r.recv(timeout=1)) for _ in range(4)] == [bytes([i]) * 48 for i in (1, 2, 3)] + [b"fifth"]
        assert r.try_recv() is None
        r.close()


def test_full_channel_times_out_cleanly_and_loses_nothing(transport):
    """A send that times out on a full channel leaves it usable; nothing queued is overwritten."""
    with _create(transport, 1, 4, 64, role="writer") as w:
        r = attach_channel(w.spec, 0)
        msgs = [i.to_bytes(4, "little") * 12 for i in range(100_000)]  # 48 bytes each
        fitted = 0
        while True:  # fill it (numbered messages) until one send times out
            try:
                w.send(msgs[fitted], timeout=0.05)
            except RingTimeout:
                break
            fitted += 1
            assert fitted < len(msgs), "the channel never filled"
        assert fitted >= 4
        got = [bytes(r.recv(timeout=1)) for _ in range(fitted)]
        assert got == msgs[:fitted]
        assert r.try_recv() is None  # the timed-out message was not half delivered
        w.send(b"after", timeout=1)
        assert r.recv(timeout=1) == b"after"
        r.close()


def test_message_larger_than_the_ring_streams_through(transport):
    with _create(transport, 1, 4, 64, role="writer") as w:  # 4 x 48 byte payloads / one page of pipe
        r = attach_channel(w.spec, 0)
        big = os.urandom(10_000)
        got = []
        t = threading.Thread(target=lambda: got.append(bytes(r.recv(timeout=10))))
        t.start()
        w.send(big, timeout=10)
        t.join()
        assert got == [big]
        w.send(b"")  # an empty message is a message
        assert r.recv(timeout=1) == b""
        r.close()


def test_reader_killed_mid_run_is_detected_by_the_writer(transport):
    ring = _create(transport, 3, SLOTS, SLOT_SIZE, role="writer")
    procs, conns = [], []
    try:
        for i in range(3):
            recv_conn, send_conn = CTX.Pipe(duplex=False)
            target = _stalling_reader if i == 1 else _reader_main
            args = (ring.spec, i, 50, send_conn) if i == 1 else (ring.spec, i, 3, 10**6, send_conn)
            p = CTX.Process(target=target, args=args, daemon=True)
            p.start()
            send_conn.close()
            procs.append(p)
            conns.append(recv_conn)
        ring.peer_fds = [p.sentinel for p in procs]
        msgs = _messages(3, 10**6, ring.payload_size)
        for _ in range(50):
            ring.send(next(msgs), timeout=30)
        assert conns[1].recv() == "stalled"
        killed_at = None

        def kill_later():
            nonlocal killed_at
            time.sleep(0.3)
            killed_at = time.monotonic()
            os.kill(procs[1].pid, signal.SIGKILL)

        threading.Thread(target=kill_later).start()
        with pytest.raises(RingPeerDied):
            for msg in msgs:  # fills the ring, then waits for reader 1 until it dies
                ring.send(msg)
        assert killed_at is not None and time.monotonic() - killed_at < 2
    finally:
        for p in procs:
            p.kill()
            p.join()
        ring.close()


def test_stalled_reader_without_sentinel_times_out_or_fails_liveness(transport):
    with _create(transport, 2, 4, 64, role="writer") as w:
        alive = [True]
        w.alive = lambda: alive[0]
        assert _fill_until_timeout(w, b"a") >= 4
        alive[0] = False
        with pytest.raises(RingPeerDied):
            w.send(b"b", timeout=5)


def _writer_then_exit(spec) -> None:
    ring = attach_channel(spec, "writer")
    ring.send(b"last words")
    ring.close()


def test_reader_sees_dead_writer_and_closed_ring(transport):
    ring = _create(transport, 1, SLOTS, SLOT_SIZE, role=0)
    try:
        p = CTX.Process(target=_writer_then_exit, args=(ring.spec,))
        p.start()
        ring.peer_fds = [p.sentinel]
        assert ring.recv(timeout=30) == b"last words"  # data before death is still delivered
        t0 = time.monotonic()
        with pytest.raises(RingPeerDied):
            ring.recv(timeout=30)
        assert time.monotonic() - t0 < 2
        p.join()
        ring.peer_fds = []
        ring.mark_closed()
        with pytest.raises(RingClosed):
            ring.recv(timeout=5)
    finally:
        ring.close()


def test_names_are_unique_and_unlinked_by_the_creator_only():
    a = ShmRing.create(1, 4, 64, role="writer")
    b = ShmRing.create(1, 4, 64)
    assert a.name != b.name and a.name.startswith("pagedserve-")
    r = ShmRing.attach(a.spec, 0)
    r.close()  # an attached end never unlinks
    assert os.path.exists(f"/dev/shm/{a.name}")
    a.send(b"still works")
    a.close()
    a.close()
    del b  # garbage collection unlinks too
    assert not os.path.exists(f"/dev/shm/{a.name}")


def test_writer_close_reaches_readers_as_ring_closed(transport):
    with _create(transport, 2, SLOTS, SLOT_SIZE, role="writer") as w:
        readers = [attach_channel(w.spec, i) for i in range(2)]
        w.send(b"one")
        w.mark_closed()
        for r in readers:
            assert r.recv(timeout=1) == b"one"  # readers drain, then see the close
            with pytest.raises(RingClosed):
                r.recv(timeout=1)
            r.close()


def _fds() -> set[int]:
    return set(int(n) for n in os.listdir("/proc/self/fd"))


def test_pipe_channel_closes_every_fd_it_opened():
    before = _fds()
    w = _create("pipe", 3, SLOTS, SLOT_SIZE, role="writer")
    readers = [attach_channel(w.spec, i) for i in range(3)]
    w.send(b"x")
    assert [r.recv(timeout=1) for r in readers] == [b"x"] * 3
    for r in readers:
        r.close()
    w.close()
    w.close()
    assert _fds() <= before


@pytest.fixture
def high_fds():
    """Hold every fd below 1100, so what the test opens next gets an fd past select()'s limit of
    1024 (a server with many connections hands its rings such fds)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1400:
        if hard != resource.RLIM_INFINITY and hard < 1400:
            pytest.skip(f"the fd limit ({hard}) is too low to open fds past 1024")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1400, hard))
    held = [os.open(os.devnull, os.O_RDONLY)]
    while held[-1] < 1100:
        held.append(os.open(os.devnull, os.O_RDONLY))
    yield
    for fd in held:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_waits_work_with_fds_past_1024(transport, high_fds):
    """A full channel, an empty one and a dead peer, all with fds >= 1024: select() raised
    ValueError ("filedescriptor out of range") there."""
    with _create(transport, 1, 4, 64, role="writer") as w:
        r = attach_channel(w.spec, 0)
        fitted = _fill_until_timeout(w, b"x" * 48)  # the writer waits for room, then times out
        assert fitted >= 4
        assert [bytes(r.recv(timeout=1)) for _ in range(fitted)] == [b"x" * 48] * fitted
        with pytest.raises(RingTimeout):  # the reader waits for data, then times out
            r.recv(timeout=0.05)
        sentinel_r, sentinel_w = os.pipe()  # a peer's sentinel: readable once the peer is gone
        assert sentinel_r >= 1024
        w.peer_fds = [sentinel_r]
        _fill_until_timeout(w, b"y" * 48)
        os.close(sentinel_w)
        with pytest.raises(RingPeerDied):
            w.send(b"z" * 48, timeout=5)
        os.close(sentinel_r)
        r.close()
