"""Mixture of experts (Qwen3-MoE, Mixtral) against transformers on random configs (fp32): the
router's choices and weights, prompt logits, the paged path, TP=2; and the grouped experts:
one gate/up and one down matmul per active expert, and no token ever meets the weights of an
expert it was not routed to."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpu.forward_context import forward_context
from pagedserve.gpu.models.moe import FusedExperts, route
from tests.gpu.test_models import assert_close, check_tensor_parallel, load_ours, make_caches, paged_step, save_hf_model

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
            tie_word_embeddings=False)
MOE = {
    # Qwen3-MoE: q/k norms, renormalised top-2 of 8, a dense layer among sparse ones.
    "qwen3moe": dict(BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True,
                     mlp_only_layers=[1]),
    # Qwen3-MoE without renormalisation (norm_topk_prob false), top-3.
    "qwen3moe-raw": dict(BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=6,
                         num_experts_per_tok=3, moe_intermediate_size=32, decoder_sparse_step=1,
                         norm_topk_prob=False, mlp_only_layers=[]),
    "mixtral": dict(BASE, model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=None),
}


@pytest.fixture(scope="module", params=list(MOE))
def moe_pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = save_hf_model(MOE[request.param], path)
    return request.param, ref, load_ours(path), path


def test_routing_equals_transformers(moe_pair):
    """The same experts (ties excluded) and weights as transformers' router on random states."""
    name, ref, ours, _ = moe_pair
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(3))
    hf_router, block = ref.model.layers[0].mlp.gate, ours.model.layers[0].mlp
    with torch.inference_mode():
        _, want_w, want_ids = hf_router(x)
        got_w, got_ids = block.route(x)
        probs = torch.softmax(F.linear(x, block.gate.weight), -1).sort(-1, descending=True).values
    k = want_ids.shape[1]
    clear = (probs[:, k - 1] - probs[:, k]) > 1e-6  # no tie at the cut
    assert clear.sum() > 190
    assert torch.equal(got_ids[clear], want_ids[clear])
    torch.testing.assert_close(got_w[clear], want_w[clear].float())


@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_the_c_decode_step_equals_transformers_block(moe_pair, m):
    """The MoE block's one-call C decode step (kernels/moe_cpu.py) against transformers'
    Qwen3MoeSparseMoeBlock on random rows (no tie at the top-k cut in these)."""
    from pagedserve.kernels import moe_cpu

    name, ref, ours, _ = moe_pair
    if not name.startswith("qwen3moe") or moe_cpu.library() is None:
        pytest.skip("the C step is for the Qwen3-MoE blocks here; or not built")
    block = ours.model.layers[0].mlp
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(20 + m))
    with torch.inference_mode():
        want = ref.model.layers[0].mlp(x[None])
        want = (want[0] if isinstance(want, tuple) else want)[0]
        got = block.c_step()(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_decode_rows_take_the_fused_c_layer_and_match_transformers(moe_pair, monkeypatch):
    """Qwen3-MoE and Mixtral layers take the fused decode layer (gpu/models/fast_decode.py): q/k norms
    inside fz_attn_in, fz_attn_out, then the MoE block's C step; decode logits match transformers."""
    from pagedserve.gpu.models import fast_decode

    name, ref, ours, _ = moe_pair
    assert all(layer.fast_decode is not None for layer in ours.model.layers), name
    taken = []
    real = fast_decode.FastDecodeLayer.forward

    def counting(self, rope, x, residual):
        out = real(self, rope, x, residual)
        taken.append((x.shape[0], out is not None))
        return out

    monkeypatch.setattr(fast_decode.FastDecodeLayer, "forward", counting)
    ids = torch.randint(0, 97, (14,), generator=torch.Generator().manual_seed(11)).tolist()
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0]
    caches = make_caches(ours)
    paged_step(ours, caches, [([3, 1, 4, 6], 0, 10)], [ids])
    for p in range(10, 14):
        got = paged_step(ours, caches, [([3, 1, 4, 6], p, 1)], [ids])
        assert_close(got[0], want[p], f"{name} decode {p}")
    assert (1, True) in taken and all(done for rows, done in taken if rows == 1)


def test_prompt_logits_match_transformers(moe_pair):
    name, ref, ours, _ = moe_pair
    ids = torch.randint(0, 97, (21,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
        with forward_context(None, []):
            got = ours.compute_logits(ours(ids, torch.arange(21)))
    assert_close(got, want, name)


def test_paged_chunked_prefill_and_decode_match(moe_pair):
    name, ref, ours, _ = moe_pair
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 97, (14,), generator=g).tolist(), torch.randint(0, 97, (17,), generator=g).tolist()
    with torch.inference_mode():
        ref_a, ref_b = ref(torch.tensor([a])).logits[0], ref(torch.tensor([b])).logits[0]
    caches = make_caches(ours)
    assert_close(paged_step(ours, caches, [([5, 2], 0, 6)], [a]), ref_a[:6], f"{name} A prefill")
    got = paged_step(ours, caches, [([5, 2], 6, 1), ([7, 1, 12], 0, 9)], [a, b])
    assert_close(got[0], ref_a[6], f"{name} A decode")
    assert_close(got[1:], ref_b[:9], f"{name} B chunk")
    for step in range(7):  # both decode: a batch of two rows through the experts
        got = paged_step(ours, caches, [([5, 2], 7 + step, 1), ([7, 1, 12], 9 + step, 1)], [a, b])
        assert_close(got[0], ref_a[7 + step], f"{name} A decode {step}")
        assert_close(got[1], ref_b[9 + step], f"{name} B decode {step}")


def _experts(seed=0, num_experts=6, hidden=16, inter=8):
    experts = FusedExperts(num_experts, hidden, inter)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=g) * 0.3)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=g) * 0.3)
    return experts


def test_grouped_experts_equal_the_per_token_definition_with_one_matmul_pair_per_active_expert(monkeypatch):
    experts = _experts()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 16, generator=g)
    weights, ids = route(torch.randn(40, 6, generator=g), 2, True)
    ids[:, :] = torch.where(ids == 5, 4, ids)  # expert 5 never chosen
    ids[ids[:, 0] == ids[:, 1], 1] = 0
    want = torch.zeros_like(x)
    for t in range(40):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = F.linear(x[t], experts.w13[e]).chunk(2)
            want[t] += weights[t, j] * F.linear(F.silu(gate) * up, experts.w2[e])
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    with torch.no_grad():
        got = experts.forward(x, weights, ids)
    monkeypatch.undo()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    active = int((torch.bincount(ids.reshape(-1), minlength=6) > 0).sum())
    assert len(calls) == 2 * active and sum(calls) == 2 * 40 * 2  # every (token, expert) pair once, twice


def test_a_token_never_meets_another_experts_weights():
    """Poison every expert but the ones a token chose (NaN weights): its output stays finite and
    equal to the unpoisoned one — rows of one expert are multiplied by that expert alone."""
    experts = _experts(seed=2)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(4))
    weights = torch.full((12, 2), 0.5)
    ids = torch.tensor([[0, 1]] * 6 + [[2, 3]] * 6)
    with torch.no_grad():
        clean = experts.forward(x, weights, ids)
        experts.w13[4:] = float("nan")
        experts.w2[4:] = float("nan")
        assert torch.equal(experts.forward(x, weights, ids), clean)
        experts.w13[2] = float("nan")  # chosen by the last six tokens only
        out = experts.forward(x, weights, ids)
    assert torch.equal(out[:6], clean[:6]) and torch.isnan(out[6:]).all()


def test_tensor_parallel_forward_matches_single_rank(tmp_path):
    """Two gloo ranks, each with half of every expert's intermediate rows: the single-rank logits."""
    check_tensor_parallel(tmp_path, {name: MOE[name] for name in ["qwen3moe", "mixtral"]})


def test_pipeline_stages_equal_one_model(moe_pair):
    from tests.gpu.test_model_families import pipeline_stages_equal_one_model

    name, _, ours, path = moe_pair
    ids = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode(), forward_context(None, []):
        want = ours.compute_logits(ours(ids, torch.arange(13)))
    pipeline_stages_equal_one_model(path, ids, want, name)


def test_int8_experts_are_packed_and_stay_close(moe_pair):
    """--quantization int8 packs every expert (the full-precision stacks freed); the logits stay
    within 8 % of the fp32 model's scale, the same top token at most positions."""
    from pagedserve.contracts.config import ModelConfig
    from pagedserve.gpu.models.loader import load_model
    from pagedserve.gpu.models.moe import FusedExperts

    name, _, ours, path = moe_pair
    packed = load_model(ModelConfig(model=str(path), quantization="int8"), "cpu", torch.float32)
    experts = [m for m in packed.modules() if isinstance(m, FusedExperts)]
    assert experts and all(m.qexperts is not None and m.w13.numel() == 0 == m.w2.numel() for m in experts)
    ids = torch.randint(0, 97, (21,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), forward_context(None, []):
        want = ours.compute_logits(ours(ids, torch.arange(21)))
        got = packed.compute_logits(packed(ids, torch.arange(21)))
    assert (got - want).abs().max() < 0.08 * want.abs().max(), name
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8, name


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_packed_experts_compute_what_their_dequantized_weights_do(mode):
    """The packed path (one kernel call per active expert and projection) equals the
    full-precision path on the weights the packing stands for."""
    from pagedserve.gpu.models.moe import quantize_experts

    holder = nn.Module()
    holder.experts = _experts(seed=5, num_experts=4, hidden=64, inter=64)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(10, 64, generator=g)
    weights, ids = route(torch.randn(10, 4, generator=g), 2, True)
    quantize_experts(holder, mode)
    plain = _experts(num_experts=4, hidden=64, inter=64)
    with torch.no_grad():
        for e, (w13, w2) in enumerate(holder.experts.qexperts):
            plain.w13[e], plain.w2[e] = w13.dequantize(), w2.dequantize()
        got, want = holder.experts.forward(x, weights, ids), plain.forward(x, weights, ids)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
