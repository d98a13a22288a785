"""Mixture-of-experts models (Qwen3-MoE, Mixtral; gpu/models/moe.py) against transformers' own
classes on small random configs, fp32: prompt logits and the paged path with chunked prefill;
routing equal to transformers'; a token's output never reads an expert it was not routed to;
greedy generation through the engine (chunked prefill and prefix caching on) equal to
transformers' greedy generation; tensor parallelism (experts' intermediate dimension sharded)."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from gpu.forward_context import forward_context
from tests.gpu.test_models import (_tp_worker, assert_close, load_ours, make_caches, paged_step,
                                   save_hf_model)

BASE = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
MOE = {
    # layer 1 dense (mlp_only_layers), top-2 of 8 renormalised; head_dim != hidden / heads
    "qwen3moe": dict(BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=32,
                     intermediate_size=96, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], rope_theta=10000.0),
    # every second layer sparse, top-3 of 6 and the weights left as the softmax gave them
    "qwen3moe-unnormalised": dict(BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                                  intermediate_size=80, moe_intermediate_size=40, num_experts=6,
                                  num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2,
                                  mlp_only_layers=[], rope_theta=10000.0),
    "mixtral": dict(BASE, model_type="mixtral", architectures=["MixtralForCausalLM"], intermediate_size=48,
                    num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6, sliding_window=None),
}


@pytest.fixture(scope="module", params=list(MOE))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = save_hf_model(MOE[request.param], path)
    return request.param, ref, load_ours(path), path


def test_prompt_logits_match_transformers(pair):
    name, ref, ours, _ = pair
    ids = torch.randint(0, 97, (37,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
        with forward_context(None, []):
            got = ours.compute_logits(ours(ids, torch.arange(len(ids))))
    assert_close(got, want, name)


def test_sparse_and_dense_layers_follow_the_config(pair):
    from gpu.models.layers import GatedMLP
    from gpu.models.moe import SparseMoeBlock

    name, ref, ours, _ = pair
    kinds = [type(layer.mlp) for layer in ours.model.layers]
    ref_kinds = ["Sparse" in type(layer.mlp).__name__ for layer in ref.model.layers]
    assert [k is SparseMoeBlock for k in kinds] == ref_kinds and any(ref_kinds)
    assert all(k in (SparseMoeBlock, GatedMLP) for k in kinds)


def test_paged_chunked_prefill_and_decode_match(pair):
    name, ref, ours, _ = pair
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 97, (16,), generator=g).tolist()
    b = torch.randint(0, 97, (21,), generator=g).tolist()
    table_a, table_b = [5, 2, 9], [7, 1, 12]
    with torch.inference_mode():
        ref_a, ref_b = ref(torch.tensor([a])).logits[0], ref(torch.tensor([b])).logits[0]
    caches = make_caches(ours)
    assert_close(paged_step(ours, caches, [(table_a, 0, 6)], [a]), ref_a[:6], f"{name} A prefill")
    got = paged_step(ours, caches, [(table_a, 6, 1), (table_b, 0, 7)], [a, b])
    assert_close(got[0], ref_a[6], f"{name} A decode")
    assert_close(got[1:], ref_b[:7], f"{name} B chunk 1")
    got = paged_step(ours, caches, [(table_a, 7, 1), (table_b, 7, 6)], [a, b])
    assert_close(got[1:], ref_b[7:13], f"{name} B chunk 2")
    for step in range(8):
        got = paged_step(ours, caches, [(table_a, 8 + step, 1), (table_b, 13 + step, 1)], [a, b])
        assert_close(got[0], ref_a[8 + step], f"{name} A decode {step}")
        assert_close(got[1], ref_b[13 + step], f"{name} B decode {step}")


def _sparse_pairs(ours, ref):
    for mine, theirs in zip(ours.model.layers, ref.model.layers):
        if "Sparse" in type(theirs.mlp).__name__:
            yield mine.mlp, theirs.mlp


def test_routing_equals_transformers(pair):
    """Experts chosen and their weights, per token, on random hidden states (ties excluded: a
    token whose k-th and k+1-th router probabilities are within 1e-6 is skipped)."""
    name, ref, ours, _ = pair
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(3))
    checked = 0
    for mine, theirs in _sparse_pairs(ours, ref):
        with torch.inference_mode():
            _, ref_w, ref_ids = theirs.gate(x)
            w, ids = mine.route(x)
            probs = torch.softmax(theirs.gate(x)[0].float(), dim=-1).sort(dim=-1, descending=True).values
        k = mine.top_k
        clear = (probs[:, k - 1] - probs[:, k]).abs() > 1e-6
        assert clear.sum() > 150
        # the same set of experts, each with the same weight
        order, ref_order = ids.sort(dim=-1), ref_ids.sort(dim=-1)
        assert torch.equal(order.values[clear], ref_order.values[clear]), name
        assert torch.allclose(w.gather(1, order.indices)[clear], ref_w.gather(1, ref_order.indices)[clear],
                              atol=1e-6), name
        sums = w.sum(dim=-1)
        if mine.renormalize:
            assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)
        else:
            assert (sums < 1 - 1e-3).all()
        checked += 1
    assert checked


def test_a_token_never_reads_an_expert_it_was_not_routed_to(pair):
    """Every expert no token of the batch chose is overwritten with NaN: the outputs stay
    finite and unchanged. Then each token alone: its output reads only its own experts."""
    _, _, ours, _ = pair
    block = next(layer.mlp for layer in ours.model.layers if hasattr(layer.mlp, "route"))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        want = block.forward(x)
        _, ids = block.route(x)
        for t in range(x.shape[0]):
            saved = (block.w13.data.clone(), block.w2.data.clone())
            others = [e for e in range(block.num_experts) if e not in ids[t].tolist()]
            block.w13.data[others] = float("nan")
            block.w2.data[others] = float("nan")
            try:
                alone = block.forward(x[t:t + 1])
            finally:
                block.w13.data.copy_(saved[0])
                block.w2.data.copy_(saved[1])
            assert torch.isfinite(alone).all()
            assert torch.allclose(alone[0], want[t], atol=1e-5)


def test_greedy_generation_through_the_engine_equals_transformers(tmp_path):
    """8 prompts x 32 greedy tokens, chunked prefill (small token budget) and prefix caching on
    (the last prompt, sent after the others, reuses the cached blocks of a 40-token prefix), equal
    to transformers' generate."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import Tokenizer

    cfg = dict(MOE["qwen3moe"], vocab_size=49152)
    ref = save_hf_model(cfg, tmp_path)
    Tokenizer.from_model()._tok.save(str(tmp_path / "tokenizer.json"))
    g = torch.Generator().manual_seed(6)
    shared = torch.randint(100, 40000, (40,), generator=g).tolist()
    prompts = [torch.randint(100, 40000, (int(n),), generator=g).tolist() for n in (5, 17, 33, 48, 9, 60)]
    prompts += [shared + [101, 102], shared + [103]]
    want = []
    with torch.inference_mode():
        for p in prompts:
            out = ref.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
            want.append(out[0, len(p):].tolist())
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=1 / 16, max_num_batched_tokens=32,
              enable_prefix_caching=True, executor="inproc")
    try:
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        got = []
        for batch in (prompts[:7], prompts[7:]):
            got += [o.outputs[0].token_ids for o in
                    llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)]
        assert llm.core.stats().prefix_cache_hits >= 32
    finally:
        llm.shutdown()
    assert got == want


def test_bad_expert_tensors_are_clear_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    from contracts.errors import ModelLoadError

    save_hf_model(MOE["mixtral"], tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.block_sparse_moe.experts.9.w1.weight"] = torch.zeros(48, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="expert 9"):
        load_ours(tmp_path)
    del tensors["model.layers.0.block_sparse_moe.experts.9.w1.weight"]
    tensors["model.layers.0.block_sparse_moe.experts.1.w2.weight"] = torch.zeros(64, 40)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="expert 1 down projection"):
        load_ours(tmp_path)
    del tensors["model.layers.0.block_sparse_moe.experts.1.w2.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing"):
        load_ours(tmp_path)


def test_tensor_parallel_2_matches_single_rank(tmp_path):
    """Two gloo ranks, each with half of every expert's intermediate dimension."""
    names = ["qwen3moe", "mixtral"]
    dirs = []
    for name in names:
        d = tmp_path / name
        save_hf_model(MOE[name], d)
        dirs.append(str(d))
    out = str(tmp_path / "tp.pt")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_tp_worker, args=(r, 2, str(tmp_path / "init"), dirs, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results = torch.load(out)
    ids = torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(5))
    for name, d, (full, paged) in zip(names, dirs, results):
        model = load_ours(d)
        with torch.inference_mode(), forward_context(None, []):
            want = model.compute_logits(model(ids, torch.arange(11)))
        assert_close(full, want, f"{name} tp=2")
        assert_close(paged, want, f"{name} tp=2 paged")
