"""StructuredOutputsParams.start_after: the grammar binds only after the sequence has generated the
marker's tokens (a reasoning model's "</think>"), so the thinking before it is free and the answer
after it fits the grammar."""
from __future__ import annotations

import re

import numpy as np
import pytest

from pagedserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.engine.structured_output.constraint import SeqConstraint
from tests.tiny import tiny_llm

REGEX = r"[a-c]{2,5}@(x|y)\.com"
PROMPT = [1, 504, 2000, 30, 77]


class FakeMatcher:
    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return False

    def fill(self, mask: np.ndarray, row: int) -> None:
        mask[row] = 7  # a recognisable row: the grammar's


def test_the_matcher_waits_for_the_whole_marker():
    c = SeqConstraint(wait_for=(5, 6))
    c.matcher = FakeMatcher()
    mask = np.zeros((1, 4), dtype=np.int32)
    for token in (5, 9, 6, 5):  # 5 then 9: no marker yet; 6 alone: no marker
        c.fill(mask, 0, [], 0)
        assert (mask[0] == -1).all()  # free while waiting
        assert c.accept(token)
    assert c.accept(6)  # ... 5, 6: the marker is complete
    assert c.matcher.accepted == []
    c.fill(mask, 0, [], 0)
    assert (mask[0] == 7).all()
    assert c.accept(42) and c.matcher.accepted == [42]
    sib = SeqConstraint(wait_for=(5, 6)).sibling()
    assert sib.wait_for == (5, 6)  # each sequence of a request waits on its own


def test_start_after_is_not_part_of_the_grammar():
    a = StructuredOutputsParams(regex=REGEX)
    b = StructuredOutputsParams(regex=REGEX, start_after="</think>")
    assert a.key == b.key  # one compile serves both
    with pytest.raises(ValueError, match="start_after"):
        StructuredOutputsParams(regex=REGEX, start_after="")


@pytest.fixture(scope="module")
def llm():
    llm = tiny_llm()
    yield llm
    llm.shutdown()


def test_free_until_the_marker_then_the_grammar(llm):
    marker = " the"
    (marker_id,) = llm.tokenizer.encode(marker, add_special_tokens=False)
    bias = {marker_id: 100.0}  # the random model writes the marker first, unless a grammar forbids it
    after = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40, logit_bias=bias,
                           structured_outputs=StructuredOutputsParams(regex=REGEX, start_after=marker))
    from_start = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40, logit_bias=bias,
                                structured_outputs=StructuredOutputsParams(regex=REGEX))
    outs = llm.generate([PROMPT, PROMPT], [after, from_start], use_tqdm=False)
    for c in outs[0].outputs:
        assert c.token_ids[0] == marker_id and c.finish_reason == "stop", c.text
        assert c.text.startswith(marker) and re.fullmatch(REGEX, c.text[len(marker):]), c.text
    for c in outs[1].outputs:
        assert marker_id not in c.token_ids and re.fullmatch(REGEX, c.text), c.text
