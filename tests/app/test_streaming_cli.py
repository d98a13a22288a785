"""merge_async_iterators semantics and the serve command's flags."""
from __future__ import annotations

import argparse
import asyncio

import pytest

from pagedserve.app.streaming import merge_async_iterators, sse_event


class Source:
    def __init__(self, items, delay=0.0, fail_at=None):
        self.items, self.delay, self.fail_at = list(items), delay, fail_at
        self.closed = False
        self.pos = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(self.delay)
        if self.fail_at is not None and self.pos == self.fail_at:
            raise RuntimeError("source failed")
        if self.pos >= len(self.items):
            raise StopAsyncIteration
        self.pos += 1
        return self.items[self.pos - 1]

    async def aclose(self):
        self.closed = True


async def test_merge_interleaves_and_keeps_per_source_order():
    a, b = Source("abc", 0.001), Source("xyz", 0.0015)
    got = [x async for x in merge_async_iterators([a, b])]
    assert sorted(got) == sorted([(0, "a"), (0, "b"), (0, "c"), (1, "x"), (1, "y"), (1, "z")])
    assert [v for i, v in got if i == 0] == list("abc") and [v for i, v in got if i == 1] == list("xyz")
    assert a.closed and b.closed


async def test_merge_error_propagates_and_closes_all():
    a, b = Source("abcdef", 0.01), Source("xy", 0.001, fail_at=1)
    with pytest.raises(RuntimeError, match="source failed"):
        async for _ in merge_async_iterators([a, b]):
            pass
    assert a.closed and b.closed and a.pos < 6


async def test_merge_consumer_leaving_early_closes_all():
    a, b = Source("abcdef", 0.001), Source("uvwxyz", 0.001)
    merged = merge_async_iterators([a, b])
    async for _ in merged:
        break
    await merged.aclose()
    assert a.closed and b.closed


async def test_merge_single_source_closed_on_cancel():
    a = Source("abcdef", 1.0)

    async def consume():
        async for _ in merge_async_iterators([a]):
            pass

    t = asyncio.ensure_future(consume())
    await asyncio.sleep(0.01)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert a.closed


def test_sse_event_framing():
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()


def parse_serve(argv, monkeypatch, env_key=None):
    import importlib

    if env_key is None:
        monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("PAGEDSERVE_API_KEY", env_key)
    import pagedserve.app.serve_cmd as serve_cmd
    importlib.reload(serve_cmd)
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    return parser.parse_args(argv)


def test_serve_flags_defaults_and_engine_config(monkeypatch):
    from pagedserve.app.engine_args import engine_config_from_args

    args = parse_serve([], monkeypatch)
    assert (args.host, args.port, args.api_key, args.served_model_name) == ("127.0.0.1", 8000, None, None)
    assert args.max_waiting_requests == 1024 and args.shutdown_timeout == 30.0 and args.log_level == "info"
    args = parse_serve(["--served-model-name", "m", "--max-waiting-requests", "7", "--port", "9",
                        "--api-key", "k", "--max-num-seqs", "4"], monkeypatch)
    config = engine_config_from_args(args, default_executor="inproc")
    assert config.model.served_model_name == "m"
    assert config.scheduler.max_waiting_requests == 7 and config.scheduler.max_num_seqs == 4
    assert config.parallel.executor == "inproc" and args.api_key == "k"


def test_serve_api_key_from_env(monkeypatch):
    assert parse_serve([], monkeypatch, env_key="from-env").api_key == "from-env"
    assert parse_serve(["--api-key", "flag"], monkeypatch, env_key="from-env").api_key == "flag"
