"""Which address family a host name binds (review of issue 10, fault 7). Before the port was
bound up front, uvicorn bound it: IPv4 for every host without a colon, so `--host localhost`
served 127.0.0.1. Taking the resolver's first answer instead binds [::1] only (IPV6_V6ONLY) on
the many Linux hosts whose /etc/hosts lists ``::1 localhost`` (glibc sorts ::1 first), and
`curl http://127.0.0.1:PORT` is refused. The resolver is faked here to answer as such a host."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pagedserve.app.listen import bind_socket

_real_getaddrinfo = socket.getaddrinfo


def ipv6_first_resolver(host, port, family=0, type=0, proto=0, flags=0):
    if host != "localhost":
        return _real_getaddrinfo(host, port, family, type, proto, flags)
    v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))
    v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))
    return {socket.AF_UNSPEC: [v6, v4], socket.AF_INET: [v4], socket.AF_INET6: [v6]}[family]


def test_a_host_name_binds_ipv4_as_uvicorn_did(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", ipv6_first_resolver)
    with bind_socket("localhost", 0) as sock:
        assert sock.family == socket.AF_INET
        host, port = sock.getsockname()[:2]
        assert host == "127.0.0.1"
        sock.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass


def test_an_ipv6_literal_still_binds_ipv6():
    with bind_socket("::1", 0) as sock:
        assert sock.family == socket.AF_INET6 and sock.getsockname()[0] == "::1"


def _system_dual_stack() -> bool:
    try:
        return Path("/proc/sys/net/ipv6/bindv6only").read_text().strip() == "0"
    except OSError:
        return False


@pytest.mark.skipif(not _system_dual_stack(), reason="this host's IPv6 sockets are IPv6-only by default")
def test_the_ipv6_wildcard_serves_ipv4_too_as_uvicorn_did():
    """`--host ::` is how a server listens on every interface of a dual-stack host (uvicorn and
    vLLM leave IPV6_V6ONLY at the system default, 0 on Linux); setting it to 1 refused IPv4."""
    with bind_socket("::", 0) as sock:
        sock.listen()
        with socket.create_connection(("127.0.0.1", sock.getsockname()[1]), timeout=5):
            pass
