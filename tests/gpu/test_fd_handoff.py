"""Channel fds handed to a process we did not spawn (a Ray actor): a spec splits into a picklable
skeleton plus its fds, the fds cross a Unix socket only for the token's holder, and the rebuilt
spec attaches as a working reader."""
from __future__ import annotations

import os
import pickle
import threading

import pytest

from pagedserve.gpu.fd_handoff import FdServer, rebuild_spec, receive_fds, split_spec
from pagedserve.gpu.transport import attach_channel, create_channel


@pytest.mark.parametrize("kind", ["shm", "pipe"])
def test_a_rebuilt_spec_attaches_and_reads_what_the_writer_sends(kind):
    writer = create_channel(1, 8, 4096, role="writer", kind=kind)
    try:
        skeleton, fds = split_spec(writer.spec)
        skeleton = pickle.loads(pickle.dumps(skeleton))  # it travels in a Ray call
        with FdServer(fds) as server:
            got: dict = {}
            t = threading.Thread(target=lambda: got.update(
                fds=receive_fds(server.address, server.token, len(fds))))
            t.start()
            server.serve(1, timeout=10)
            t.join(10)
        assert len(got["fds"]) == len(fds) and not set(got["fds"]) & set(fds)  # duplicates
        reader = attach_channel(rebuild_spec(skeleton, got["fds"]), 0)
        try:
            writer.send(b"step 1")
            assert bytes(reader.recv(timeout=5)) == b"step 1"
        finally:
            reader.close()
        for fd in got["fds"]:  # the attached end owned its fds and closed them
            with pytest.raises(OSError):
                os.fstat(fd)
    finally:
        writer.close()


def test_a_caller_without_the_token_gets_no_fds():
    r, w = os.pipe()
    try:
        with FdServer([r]) as server:
            got: dict = {}

            def stranger():
                try:
                    receive_fds(server.address, b"x" * 32, 1, timeout=5)
                except Exception as e:  # the server hangs up on it
                    got["error"] = e

            t = threading.Thread(target=stranger)
            t.start()
            with pytest.raises(TimeoutError):
                server.serve(1, timeout=1.0)
            t.join(10)
        assert "error" in got
    finally:
        os.close(r)
        os.close(w)


def test_a_silent_local_caller_cannot_block_the_handoff():
    """Issue 37, finding 8: a local process that connects to the abstract socket and says nothing
    used to hold serve() until its whole deadline (the Ray workers' start-up then failed). Each
    caller now has its own short deadline and callers are served side by side."""
    import socket
    import time

    r, w = os.pipe()
    silent = []
    try:
        with FdServer([r]) as server:
            for _ in range(3):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(server.address)
                silent.append(s)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(server.address)
            s.sendall(server.token[:5])  # starts, then stalls
            silent.append(s)
            got: dict = {}
            t = threading.Thread(target=lambda: got.update(fds=receive_fds(server.address, server.token, 1)))
            t.start()
            t0 = time.monotonic()
            server.serve(1, timeout=20)
            took = time.monotonic() - t0
            t.join(10)
        assert len(got["fds"]) == 1 and took < 3, took
        for fd in got["fds"]:
            os.close(fd)
    finally:
        for s in silent:
            s.close()
        os.close(r)
        os.close(w)


def test_another_user_gets_nothing_even_with_the_token():
    """Peer credentials: only a caller of this user (or one of the given worker pids) is read."""
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.skip("needs root to run a caller as another user")
    code = ("import os, sys\n"
            "from pagedserve.gpu.fd_handoff import receive_fds\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "try:\n"
            "    print(len(receive_fds('\\0' + sys.argv[1], bytes.fromhex(sys.argv[2]), 1, timeout=5)))\n"
            "except Exception as e:\n"
            "    print(type(e).__name__)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r, w = os.pipe()
    try:
        for allowed in (False, True):
            with FdServer([r]) as server:
                proc = subprocess.Popen([sys.executable, "-c", code, server.address[1:], server.token.hex()],
                                        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, "PYTHONPATH": root})
                if allowed:
                    server.allowed_pids = {proc.pid}
                    server.serve(1, timeout=20)
                else:
                    with pytest.raises(TimeoutError):
                        server.serve(1, timeout=3)
                out = proc.communicate(timeout=30)[0].strip()
            # refused: the server hangs up unread (no fds, or a broken pipe while sending the token)
            assert out == "1" if allowed else out in ("RuntimeError", "BrokenPipeError", "ConnectionResetError"), \
                (allowed, out)
    finally:
        os.close(r)
        os.close(w)
