"""Row buckets: the few row counts a BLAS matmul is run with, whatever the batch.

oneDNN builds and caches one primitive per distinct (weight shape, rows), ~0.3-1.8 MB each, up to
1,024 of them: called with the step's own row count, a server's RSS grows with every new prompt
length until that cache is full (~0.35 MiB per finished sequence on the default model, issue 35).
Rows padded to a bucket bound the primitives to a few dozen per weight shape, each built once at
start-up (gpu/models/packed_linear.py warm_row_buckets)."""
from __future__ import annotations


def row_bucket(rows: int) -> int:
    """The batch rows a BLAS matmul runs with: ``rows`` rounded up to 4, then to steps of 8 up
    to 32, 16 up to 128, 32 up to 256, 128 up to 1024 and 256 above, so 25 buckets cover 2048
    rows. The padding costs little where it is large (few rows: the weight read dominates) and
    at most ~14 % of the FLOPs from 32 rows up (loadtest/PERF.md)."""
    for limit, step in ((4, 4), (32, 8), (128, 16), (256, 32), (1024, 128)):
        if rows <= limit:
            return -(-rows // step) * step
    return -(-rows // 256) * 256


def buckets_upto(rows: int) -> list[int]:
    """Every bucket a batch of at most ``rows`` rows may run with."""
    out, m = [], 1
    while m <= rows:
        b = row_bucket(m)
        out.append(b)
        m = b + 1
    return out
