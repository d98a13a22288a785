"""What pooling requests hand back, shaped like vLLM's (``LLM.encode`` / ``LLM.embed`` /
``LLM.score``, and the AsyncEngine stream of a pooling request).

A pooling request yields exactly one output, the final one (``finished=True``). The vector
travels as float32 bytes in native byte order (``data_bytes``): the HTTP layer base64-encodes
those bytes as they are, and ``data`` / ``embedding`` turn them into Python floats on demand.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from pagedserve.engine.outputs import RequestMetrics


def floats_from_bytes(data: bytes) -> list[float]:
    return memoryview(data).cast("f").tolist()


def bytes_from_floats(values: list[float]) -> bytes:
    return array("f", values).tobytes()


@dataclass(slots=True)
class PoolingOutput:
    data_bytes: bytes  # float32, native byte order

    @property
    def data(self) -> list[float]:
        return floats_from_bytes(self.data_bytes)

    def __len__(self) -> int:
        return len(self.data_bytes) // 4


@dataclass(slots=True)
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput | None  # None when the request was aborted or failed
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    finish_reason: str | None = None  # "stop" (pooled) | "abort" | "error"
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = field(default=None)


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        if out.outputs is None:
            raise RuntimeError(f"request {out.request_id} has no embedding: "
                               f"{out.error or out.finish_reason or 'not finished'}")
        return cls(out.request_id, EmbeddingOutput(out.outputs.data), out.prompt_token_ids,
                   out.finished, out.prompt)


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # both texts' tokens, first then second
    finished: bool = True


def cosine(a: bytes, b: bytes) -> float:
    """Cosine similarity of two float32 vectors given as bytes (the score of a pair)."""
    x, y = memoryview(a).cast("f"), memoryview(b).cast("f")
    if len(x) != len(y):
        raise ValueError(f"cannot compare vectors of {len(x)} and {len(y)} values")
    dot = nx = ny = 0.0
    for u, v in zip(x, y):
        dot += u * v
        nx += u * u
        ny += v * v
    if nx == 0.0 or ny == 0.0:
        return 0.0
    return dot / (nx ** 0.5 * ny ** 0.5)
