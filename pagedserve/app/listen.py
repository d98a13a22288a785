"""The server's listening socket, bound before anything slow happens.

A model can take minutes to load; a busy port must be found before that, not after (vLLM binds
first for the same reason). The socket is bound here and handed to uvicorn
(``server.serve(sockets=[sock])``), which starts listening once the engine is up: until then
connections are refused, which clients and health checks already treat as "not ready".
"""
from __future__ import annotations

import errno
import logging
import socket

logger = logging.getLogger(__name__)


class ListenError(OSError):
    """The server cannot listen on the requested address; the message says what to change."""


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (without listening) a TCP socket on host:port. Raises ListenError with a one-line
    message when the address is busy, unknown or not allowed."""
    # As uvicorn chose: IPv6 for a host with a colon, IPv4 for every other (the resolver's first
    # answer for "localhost" is often ::1, which would leave 127.0.0.1 unserved).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenError(f"cannot listen on {host}:{port}: unknown host ({e.strerror}); "
                          "check --host") from None
    _, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn: a port left in TIME_WAIT by a previous run is reusable at once; a port
        # another process listens on still fails below.
        # IPV6_V6ONLY is left at the system default (dual stack on Linux), as uvicorn and vLLM
        # leave it: `--host ::` serves IPv4 clients too.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ListenError(f"cannot listen on {host}:{port}: the address is already in use; "
                              "stop the other server or choose another --port") from None
        if e.errno == errno.EACCES:
            raise ListenError(f"cannot listen on {host}:{port}: permission denied; choose a port "
                              "above 1023 or run with the right privileges") from None
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}; check --host and "
                          "--port") from None
    logger.debug("bound %s:%d", *sock.getsockname()[:2])
    return sock
