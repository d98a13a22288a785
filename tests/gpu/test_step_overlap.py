"""The engine loop sends step N+1 to the workers before it hands step N's outputs to the streams,
so detokenized deltas, SSE writes and client wake-ups run while the workers compute instead of
between two steps; the tokens are the offline engine's."""
from __future__ import annotations

import asyncio

from pagedserve.engine.sampling_params import SamplingParams
from tests.gpu.test_mp_equivalence import (prompts, stream_token_ids, tiny_checkpoint,  # noqa: F401 (fixture)
                                            token_ids)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_next_step_is_sent_before_the_last_outputs_are_delivered(tiny_checkpoint):  # noqa: F811
    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.engine.llm import LLM
    from pagedserve.contracts.config import EngineConfig

    options = {"model": tiny_checkpoint, "dtype": "float32", "kv_cache_memory": 1 / 16,
               "max_num_batched_tokens": 64}
    single = LLM(executor="inproc", **options)
    try:
        ref = token_ids(single.generate(prompts(), GREEDY, use_tqdm=False))
    finally:
        single.shutdown()

    async def run() -> tuple[list[list[int]], list[str]]:
        engine = AsyncEngine(EngineConfig.from_options(executor="mp", **options))
        await engine.start()
        events: list[str] = []
        ex = engine.parts.executor
        submit, collect, deliver = ex.submit_async, ex.collect_async, engine.deliver  # the step loop's sink

        async def logged_submit(step):
            events.append("send")
            await submit(step)

        async def logged_collect(step_id):
            out = await collect(step_id)
            events.append("reply")
            return out

        def logged_deliver(outputs):
            if outputs:
                events.append("deliver")
            return deliver(outputs)
        ex.submit_async, ex.collect_async, engine.deliver = logged_submit, logged_collect, logged_deliver
        try:
            outs = await stream_token_ids(engine, prompts(), GREEDY)
        finally:
            await engine.shutdown()
        return outs, events

    outs, events = asyncio.run(run())
    assert outs == ref
    # After every reply but the last, the next step goes out before that reply's outputs are
    # delivered; one step in flight at a time (no second send before a reply).
    replies = [i for i, e in enumerate(events) if e == "reply"]
    assert len(replies) > 10
    for i in replies[:-1]:
        assert events[i + 1] == "send", events[max(0, i - 3): i + 4]
    sent = 0
    for e in events:
        sent += e == "send"
        sent -= e == "reply"
        assert sent in (0, 1)
