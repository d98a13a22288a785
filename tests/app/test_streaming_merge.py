"""merge_async_iterators (n > 1, several prompts) pulls from the engine streams only as fast as
its consumer reads (issue 10, fault 8): a slow client leaves the deltas in the engine's
per-request collectors, where they merge, instead of in an unbounded queue of its own."""
from __future__ import annotations

import asyncio

from pagedserve.app.streaming import merge_async_iterators


class Counting:
    """An endless-enough async iterator that records how many items were pulled from it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pulled = 0
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> int:
        await asyncio.sleep(0)
        if self.pulled >= self.n:
            raise StopAsyncIteration
        self.pulled += 1
        return self.pulled

    async def aclose(self) -> None:
        self.closed = True


async def test_a_slow_consumer_bounds_what_is_pulled():
    streams = [Counting(200) for _ in range(3)]
    merged = merge_async_iterators(streams)
    first = await merged.__anext__()
    assert first[1] == 1
    for _ in range(50):  # the consumer stops reading for a while
        await asyncio.sleep(0)
    # Each pump may hold one item in the hand-off queue and one in its hand, nothing more.
    assert sum(s.pulled for s in streams) <= 3 * 2 + 1, [s.pulled for s in streams]
    await merged.aclose()
    assert all(s.closed for s in streams)


async def test_everything_arrives_in_per_stream_order():
    streams = [Counting(40) for _ in range(4)]
    got: dict[int, list[int]] = {i: [] for i in range(4)}
    async for i, item in merge_async_iterators(streams):
        got[i].append(item)
        if item % 7 == 0:
            await asyncio.sleep(0.001)
    assert got == {i: list(range(1, 41)) for i in range(4)}


async def test_an_error_reaches_the_consumer_and_closes_the_others():
    class Failing(Counting):
        async def __anext__(self) -> int:
            if self.pulled == 3:
                raise RuntimeError("engine failed")
            return await super().__anext__()

    streams = [Counting(100), Failing(100)]
    seen = 0
    try:
        async for _ in merge_async_iterators(streams):
            seen += 1
    except RuntimeError as e:
        assert str(e) == "engine failed"
    else:
        raise AssertionError("the error was lost")
    assert seen >= 3 and all(s.closed for s in streams)
