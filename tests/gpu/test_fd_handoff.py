"""Channel fds handed to a process we did not spawn (a Ray actor): a spec splits into a picklable
skeleton plus its fds, the fds cross a Unix socket only for the token's holder, and the rebuilt
spec attaches as a working reader."""
from __future__ import annotations

import os
import pickle
import threading

import pytest

from gpu.fd_handoff import FdServer, rebuild_spec, receive_fds, split_spec
from gpu.transport import attach_channel, create_channel


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
