"""Step messages: packed int columns survive msgpack and pickle, and read back as ints."""
from __future__ import annotations

import pickle

import pytest

from pagedserve.contracts.messages import (STEP_INPUT_DECODER, STEP_INPUT_ENCODER, STEP_OUTPUT_DECODER, NewSeq,
                          SampledLogprobs, SamplingOptions, StepInput, StepOutput)


def _step() -> StepInput:
    new = NewSeq(7, [1, 2, 3], 3, 0, [4], SamplingOptions(temperature=0.0))
    # seq 2**40 needs int64; seq 7 (batch index 2) gets two blocks, seq 5 (index 0) one
    return StepInput.pack(11, [new], [5, 2**40, 7], [1, 1, 3], [0, 2, 2], [90, 91, 92], [3])


@pytest.mark.parametrize("roundtrip", ["msgpack", "pickle"])
def test_step_input_columns_round_trip(roundtrip):
    step = _step()
    if roundtrip == "msgpack":
        back = STEP_INPUT_DECODER.decode(STEP_INPUT_ENCODER.encode(step))
    else:
        back = pickle.loads(pickle.dumps(step))
    assert back == step
    assert back.seq_ids.tolist() == [5, 2**40, 7]
    assert back.num_new_tokens.tolist() == [1, 1, 3]
    assert list(zip(back.new_block_seqs, back.new_block_ids)) == [(0, 90), (2, 91), (2, 92)]
    assert back.finished_seq_ids == [3] and back.new_seqs[0].token_ids == [1, 2, 3]
    assert [type(v) for v in back.seq_ids] == [int, int, int]


def test_decode_step_without_blocks_has_empty_columns():
    step = STEP_INPUT_DECODER.decode(STEP_INPUT_ENCODER.encode(StepInput.pack(1, [], [4, 5], [1, 1])))
    assert len(step.new_block_seqs) == len(step.new_block_ids) == 0
    assert not StepInput.pack(2, [], [], []).seq_ids  # an empty step is falsy, as the runner checks


def test_step_output_round_trip_and_error_default():
    out = StepOutput.pack(3, [5, 2**40], [17, 2**31 - 1], logprobs=[SampledLogprobs(-0.5, [(17, -0.5)]), None])
    back = STEP_OUTPUT_DECODER.decode(STEP_INPUT_ENCODER.encode(out))
    assert back.seq_ids.tolist() == [5, 2**40] and back.token_ids.tolist() == [17, 2**31 - 1]
    assert back.logprobs[0].top == [(17, -0.5)] and back.logprobs[1] is None
    failed = STEP_OUTPUT_DECODER.decode(STEP_INPUT_ENCODER.encode(StepOutput(4, error="boom")))
    assert (failed.error, failed.seq_ids.tolist(), failed.token_ids.tolist()) == ("boom", [], [])


def test_out_of_range_values_fail_on_the_producer_side():
    with pytest.raises(OverflowError):
        StepInput.pack(1, [], [1], [1], [0], [2**31])  # block ids are int32
    with pytest.raises(OverflowError):
        StepOutput.pack(1, [1], [-2**31 - 1])


def test_columns_are_read_only_views():
    step = _step()
    with pytest.raises(TypeError):
        step.seq_ids[0] = 9
    with pytest.raises(AttributeError):
        step.seq_ids = [9]
