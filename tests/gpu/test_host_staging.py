"""gpu/host_staging.py: a step's index arrays packed side by side and unpacked as device views
(forced through ordinary memory on CPU; pinned with one non-blocking copy on CUDA), and the
model runner's prepared batch identical whether it stages or not."""
from __future__ import annotations

import numpy as np
import torch

from pagedserve.gpu.host_staging import HostStaging


def test_arrays_round_trip_with_alignment_and_shapes():
    st = HostStaging("cpu", force=True)
    ids = [5, 7, 11]  # 24 bytes of int64
    qsl = [0, 1, 3]  # 12 bytes of int32: the next array starts 4 bytes later, aligned
    tables = np.array([[1, 2], [3, 4]], dtype=np.int32)
    slots = np.array([9, 10, 11], dtype=np.int64)
    a, b, c, d = st.stage([(ids, torch.long, (3,)), (qsl, torch.int32, (3,)), (tables, torch.int32, (2, 2)),
                           (slots, torch.long, (3,))])
    assert a.dtype == torch.long and a.tolist() == ids
    assert b.dtype == torch.int32 and b.tolist() == qsl
    assert c.shape == (2, 2) and c.tolist() == tables.tolist()
    assert d.tolist() == slots.tolist()
    # the next stage call (other buffer) and the one after (this buffer again) leave these intact
    st.stage([([1] * 40, torch.long, (40,))])
    st.stage([([2] * 4000, torch.long, (4000,))])
    assert a.tolist() == ids and d.tolist() == slots.tolist()


def test_off_cuda_nothing_is_staged():
    st = HostStaging("cpu")
    (x,) = st.stage([([1, 2], torch.int32, (2,))])
    assert not st.enabled and x.tolist() == [1, 2] and st._buffers == [None, None]


def test_prepared_batch_is_the_same_staged_or_not():
    from pagedserve.contracts.config import EngineConfig
    from pagedserve.gpu.batch import BatchRequest
    from pagedserve.gpu.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig.from_options(block_size=4))
    reqs = [BatchRequest([7], 5, [3, 1]), BatchRequest([8], 2, [2]),
            BatchRequest([1, 2, 3, 4, 5], 3, [4, 6, 0]), BatchRequest([9, 9], 0, [5])]
    plain = runner.prepare(reqs)
    runner.staging = HostStaging("cpu", force=True)
    staged = runner.prepare(reqs)
    for a, b in ((plain.input_ids, staged.input_ids), (plain.positions, staged.positions)):
        assert torch.equal(a, b) and a.dtype == b.dtype
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        a, b = getattr(plain.meta, name), getattr(staged.meta, name)
        assert torch.equal(a, b) and a.dtype == b.dtype, name
    # slots: request 2's tokens at positions 3..7 of blocks [4, 6, 0] (block size 4)
    assert staged.meta.slot_mapping.tolist()[2:7] == [4 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3]
    assert plain.meta.num_decodes == staged.meta.num_decodes == 2
