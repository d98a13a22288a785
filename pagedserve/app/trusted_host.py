"""Which ``Host`` headers the server answers: the defence against DNS rebinding.

A web page on ``attacker.example`` can make its own name resolve to 127.0.0.1 and then read the
answers of a server listening there as same-origin responses. Its requests always carry
``Host: attacker.example``, so a server that answers only the names it is reached by cannot be
read that way. Without --api-key (a page cannot send the key) ``serve`` answers only: the address
it is bound to, ``localhost`` / 127.0.0.1 / ::1, and --allowed-hosts (exact names or
``*.example.com``; ``*`` turns the check off). Bound to every address (0.0.0.0, ::) it also answers
any IP literal: the machine may be reached by any of its addresses, and a rebinding page's Host is
never an IP literal. With --api-key the check applies only when --allowed-hosts is given.

Starlette's TrustedHostMiddleware does the same matching; this one answers in OpenAI's error format
(400, code ``invalid_host``) like every other refusal, and knows IP literals.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.app.errors import APIError

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("", "0.0.0.0", "::")


def host_name(header: str | None) -> str | None:
    """The name (or IP, without brackets) of a Host header, lower-case; None when it is not one."""
    if not header or any(c in header for c in " \t/?#@\\"):
        return None
    try:
        parts = urlsplit("//" + header)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        return None
    name = parts.hostname
    return name.rstrip(".") if name else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class TrustedHosts:
    """Host names served: exact names, ``*.suffix`` patterns, ``*`` (any); ``any_ip``: every IP literal."""

    names: tuple[str, ...]
    any_ip: bool = False

    @classmethod
    def for_server(cls, bind_host: str, api_key: str | None,
                   allowed_hosts: Sequence[str] | None) -> "TrustedHosts | None":
        """What `serve --host BIND_HOST` answers; None = every host (an API key and no --allowed-hosts)."""
        if api_key and not allowed_hosts:
            return None
        bind = (bind_host or "").strip("[]").lower()
        names = [*LOCAL_NAMES, *([bind] if bind not in WILDCARD_BINDS else []),
                 *(h.strip().lower().rstrip(".") for h in allowed_hosts or () if h.strip())]
        for pattern in names:
            if "*" in pattern[1:] or (pattern.startswith("*") and pattern != "*" and not pattern.startswith("*.")):
                raise ValueError(f"--allowed-hosts {pattern!r}: a pattern is a name, '*.example.com' or '*'")
        return cls(tuple(dict.fromkeys(names)), any_ip=bind in WILDCARD_BINDS)

    def allows(self, header: str | None) -> bool:
        name = host_name(header)
        if name is None:
            return False
        for pattern in self.names:
            if pattern == "*" or name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])):
                return True
        return self.any_ip and _is_ip(name)


class HostCheckMiddleware:
    """400 (OpenAI format) for a request whose Host header ``hosts`` does not allow."""

    def __init__(self, app: ASGIApp, hosts: TrustedHosts) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope["headers"]:
            if name == b"host":
                header = value.decode("latin-1")
                break
        if self.hosts.allows(header):
            await self.app(scope, receive, send)
            return
        from pagedserve.app.responses import error_response

        err = APIError.bad_request("Invalid Host header: this server answers only the address it is bound to, "
                                   "localhost and the names given with --allowed-hosts (a defence against DNS "
                                   "rebinding).", code="invalid_host")
        await error_response(err)(scope, receive, send)
