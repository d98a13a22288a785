"""The decode gather buffers are reused across calls; a buffer first made under
torch.inference_mode (as the model runner runs) must not break a later call outside it."""
import torch

from pagedserve.kernels import torch_attention
from tests.kernels.paged_batch import make_batch, naive_attention


def test_workspace_made_in_inference_mode_is_usable_outside_it():
    torch_attention._workspace.clear()
    batch = make_batch([(20, 1), (33, 1)], 4, 2, 16, 8, seed=1)
    with torch.inference_mode():
        torch_attention.paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    got = torch_attention.paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    torch.testing.assert_close(got.float(), naive_attention(batch, 0.25).float(), atol=2e-5, rtol=1e-4)
