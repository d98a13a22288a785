"""Request-head and body timeouts (app/http_protocol.py) with HTTP/1.1 pipelining (review of
issue 10). A request queued behind a response in progress is held up by the server, not by its
client: uvicorn pauses reading at its headers until the earlier response ends. Its read clock
must not run meanwhile, and a late request must never cut the response in progress nor write
a 408 into the middle of it: the earlier response completes, then the late request is timed.
Plain uvicorn (no read timeouts) serves both of these cases in full."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from pagedserve.app.http_protocol import with_read_timeouts

TIMEOUT_S = 0.5  # header and body timeouts of the server under test
CHUNKS = 8
CHUNK_GAP_S = 0.25  # the stream lasts 2 s, four times the timeouts


async def app(scope, receive, send):
    """/stream: CHUNKS chunks, one every CHUNK_GAP_S, listening for a disconnect meanwhile (as
    sse-starlette does); anything else: echo the body."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/stream":
        gone = asyncio.ensure_future(receive())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        for i in range(CHUNKS):
            await send({"type": "http.response.body", "body": b"chunk%d\n" % i, "more_body": True})
            await asyncio.sleep(CHUNK_GAP_S)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        gone.cancel()
        return
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port():
    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="critical",
                            http=with_read_timeouts(TIMEOUT_S, TIMEOUT_S))
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(1000):
        if server.started:
            break
        time.sleep(0.01)
    assert server.started
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def read_all(conn: socket.socket, until: bytes | None = None) -> bytes:
    """Everything until the server closes, ``until`` arrives at the end, or 10 s pass."""
    conn.settimeout(10)
    data = b""
    while until is None or not data.endswith(until):
        try:
            got = conn.recv(65536)
        except (socket.timeout, ConnectionResetError):
            break
        if not got:
            break
        data += got
    return data


STREAM_REQUEST = b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n"
ECHO_HEAD = b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\n"
STREAM_END = b"0\r\n\r\n"  # the last chunk of a chunked body


def whole_stream(data: bytes) -> bytes:
    """The first response, up to and including its last chunk (AssertionError if cut)."""
    end = data.find(STREAM_END)
    assert end >= 0, f"the stream in progress was cut: {data!r}"
    head = data[:end + len(STREAM_END)]
    assert head.startswith(b"HTTP/1.1 200") and b"408" not in head, head
    assert all(b"chunk%d\n" % i in head for i in range(CHUNKS)), head
    return data[end + len(STREAM_END):]


def test_a_pipelined_body_the_server_is_not_reading_yet_is_not_late(port):
    """The client sends its whole body at once; part of it sits unread while the server holds
    the request behind the stream. Both responses come, in full."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(STREAM_REQUEST + ECHO_HEAD + b"abc")
        time.sleep(0.1)
        conn.sendall(b"defghij")
        rest = whole_stream(read_all(conn, until=b"abcdefghij"))
        assert rest.startswith(b"HTTP/1.1 200") and rest.endswith(b"\r\n\r\nabcdefghij"), rest


def test_a_pipelined_request_that_stalls_does_not_cut_the_response_in_progress(port):
    """The client stalls in a pipelined body for longer than the body timeout: the stream in
    progress still completes, and only then is the late request answered 408 (or closed)."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(STREAM_REQUEST + ECHO_HEAD + b"abc")  # 7 bytes of the body never come
        rest = whole_stream(read_all(conn))
        assert rest == b"" or rest.startswith(b"HTTP/1.1 408"), rest


def test_a_pipelined_head_that_stalls_does_not_cut_the_response_in_progress(port):
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(STREAM_REQUEST + b"GET /echo HTTP/1.1\r\nHo")  # the head never ends
        rest = whole_stream(read_all(conn))
        assert rest == b"" or rest.startswith(b"HTTP/1.1 408"), rest
