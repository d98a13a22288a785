"""bench_lora's table: medians of interleaved rounds, each change the median of per-round ratios to
the base engine's figure of the same round (so a round where the whole box ran slow moves both)."""
from __future__ import annotations

from pagedserve.loadtest.micro.bench_lora import summary


def test_changes_are_medians_of_same_round_ratios():
    runs = {
        "base": {"single": [100.0, 50.0, 100.0], "c=16": [300.0, 150.0, 300.0]},
        # round 2 ran at half speed for everyone: same-round ratios stay 0.9 / 0.8
        "rank 16": {"single": [90.0, 45.0, 90.0], "c=16": [240.0, 120.0, 240.0],
                    "single base row": [100.0, 55.0, 100.0]},
    }
    base_line, rank_line = summary(runs).splitlines()[1:]
    assert "100.0 tok/s ( +0.0 %)" in base_line and "300.0 tok/s ( +0.0 %)" in base_line
    assert "90.0 tok/s (-10.0 %)" in rank_line
    assert "240.0 tok/s (-20.0 %)" in rank_line
    assert "100.0 tok/s ( +0.0 %)" in rank_line  # the base row against the base single stream
