"""The worker's pooler (gpu/pooling.py) and the pooling fields of the step messages."""
from __future__ import annotations

import msgspec
import pytest
import torch

from pagedserve.contracts.messages import (
    STEP_INPUT_DECODER, STEP_INPUT_ENCODER, STEP_OUTPUT_DECODER, NewSeq, PooledOutput, PoolingOptions,
    SamplingOptions, StepInput, StepOutput)
from pagedserve.gpu.pooling import Pooler


def expected(hidden: torch.Tensor, kind: str) -> torch.Tensor:
    return {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]


def vec(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.float32)


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
@pytest.mark.parametrize("chunks", [[20], [7, 7, 6], [1, 18, 1], [1] * 20])
def test_chunks_give_the_whole_prompt_vector(kind, chunks):
    torch.manual_seed(0)
    hidden = torch.randn(20, 16)
    pooler = Pooler(PoolingOptions(kind, normalize=False), 0)
    start, out = 0, None
    for k, n in enumerate(chunks):
        out = pooler.add(hidden[start:start + n], done=k == len(chunks) - 1)
        assert (out is None) == (k < len(chunks) - 1)
        start += n
    torch.testing.assert_close(vec(out), expected(hidden, kind), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_dimensions_truncate_then_normalise(kind):
    hidden = torch.randn(5, 16, dtype=torch.bfloat16)
    full = vec(Pooler(PoolingOptions(kind), 0).add(hidden, True))
    assert full.shape == (16,) and abs(float(full.norm()) - 1) < 1e-5
    short = vec(Pooler(PoolingOptions(kind, dimensions=4), 0).add(hidden, True))
    raw = expected(hidden.float(), kind)[:4]
    torch.testing.assert_close(short, raw / raw.norm(), rtol=1e-5, atol=1e-6)


def test_mean_and_cls_refuse_a_prefix_cache_start():
    Pooler(PoolingOptions("last"), 32)  # a hit never covers the last token: fine
    for kind in ("mean", "cls"):
        with pytest.raises(ValueError, match="prefix cache"):
            Pooler(PoolingOptions(kind), 32)
    with pytest.raises(ValueError, match="unknown pooling type"):
        Pooler(PoolingOptions("max"), 0)


def test_pooling_fields_survive_msgpack():
    new = NewSeq(3, [1, 2, 3], 3, 0, [1], SamplingOptions(), PoolingOptions("mean", False, 8))
    step = StepInput.pack(1, [new, NewSeq(4, [5], 1, 0, [2], SamplingOptions())], [3, 4], [3, 1])
    back = STEP_INPUT_DECODER.decode(STEP_INPUT_ENCODER.encode(step))
    assert back.new_seqs[0].pooling == PoolingOptions("mean", False, 8)
    assert back.new_seqs[1].pooling is None
    out = StepOutput.pack(1, [4], [9])
    out.pooled = [PooledOutput(3, torch.arange(4, dtype=torch.float32).numpy().tobytes())]
    back = STEP_OUTPUT_DECODER.decode(msgspec.msgpack.encode(out))
    assert back.pooled[0].seq_id == 3 and back.pooled[0].data.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert STEP_OUTPUT_DECODER.decode(msgspec.msgpack.encode(StepOutput.pack(2, [], []))).pooled is None
