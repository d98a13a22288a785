"""kill -9 of one pipeline stage under a real `pagedserve serve --pipeline-parallel-size 2` while a
completion streams: as for a dead worker without stages, the stream ends with an error (no hang,
even with the other stage blocked in a receive from the dead one), /health turns 503 and the
server exits clean on SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.test_server_e2e import ServerProcess
from tests.e2e.test_worker_death import (assert_dead_but_answering, assert_sigterm_exits_clean, children,
                                         mapped_segments, wait_health_503, workers_of)


@pytest.mark.parametrize("stage", [0, 1])
def test_kill9_a_stage_during_a_stream(stage):
    s = ServerProcess("--executor", "mp", "--pipeline-parallel-size", "2")
    try:
        kids, workers = children(s.proc.pid), workers_of(s.proc.pid)
        assert len(workers) == 2 and "2 worker process(es) ready" in s.output()
        segments = mapped_segments(s.proc.pid)
        victim = workers[stage]  # rank order = start order = pid order; stage s = rank s here
        body = {"model": "tiny", "prompt": "Go", "max_tokens": 1900, "ignore_eos": True, "stream": True,
                "temperature": 0}
        events: list[str] = []
        outcome: dict = {}
        killed = threading.Event()

        def stream() -> None:
            try:
                with httpx.stream("POST", s.url + "/v1/completions", json=body,
                                  timeout=httpx.Timeout(10.0, read=10.0)) as r:
                    outcome["status"] = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                        if len(events) == 3 and not killed.is_set():
                            os.kill(victim, signal.SIGKILL)
                            outcome["killed_at"] = time.monotonic()
                            killed.set()
                outcome["ended"] = "eof"
            except httpx.HTTPError as e:
                outcome["ended"] = f"{type(e).__name__}: {e}"
            outcome["end_at"] = time.monotonic()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert killed.wait(30), s.output()
        wait_health_503(s, outcome["killed_at"])
        reader.join(15)
        assert not reader.is_alive(), "the stream hung after a stage died"
        assert outcome["status"] == 200 and outcome["end_at"] - outcome["killed_at"] < 5
        if outcome["ended"] == "eof":
            assert events[-1] == "[DONE]", events[-3:]
            error = json.loads(events[-2])["error"]
            assert error["code"] == "engine_dead" and "killed by SIGKILL" in error["message"], error
        assert f"worker {stage} (pid {victim}) was killed by SIGKILL" in s.output()
        assert_dead_but_answering(s)
        assert_sigterm_exits_clean(s, kids, segments)
    finally:
        s.stop()
