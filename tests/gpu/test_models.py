"""Our model definitions vs transformers on small random configs (fp32): a full prompt in the
profile path, and the paged path with chunked prefill, mixed batches and decode steps that cross
block boundaries (metadata and KV cache built by hand here)."""
from __future__ import annotations

import os

import pytest
import torch

from pagedserve.contracts.config import ModelConfig
from pagedserve.gpu.forward_context import forward_context
from pagedserve.gpu.models.packed_linear import dense_weight  # a loaded linear layer's weight, packed or not
from pagedserve.kernels.metadata import AttentionMetadata

BLOCK = 8


def tiny_config(arch: str, **over) -> dict:
    if arch == "GPT2LMHeadModel":
        cfg = dict(model_type="gpt2", vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                   layer_norm_epsilon=1e-5, activation_function="gelu_new")
    else:
        cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
        cfg["model_type"] = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                             "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[arch]
        if arch == "MistralForCausalLM":
            cfg["sliding_window"] = None
        if arch == "Qwen3ForCausalLM":
            cfg["head_dim"] = 32  # not hidden / heads: the q/k/v widths differ from hidden
    cfg.update(over, architectures=[arch])
    return cfg


def save_hf_model(cfg: dict, path, seed: int = 0, **save_kwargs):
    """A transformers model with random weights (norms and biases randomised too), saved as
    safetensors; returns the model in fp32 eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    hf_cfg.architectures = cfg["architectures"]
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, **save_kwargs)
    return model


def load_ours(path, dtype=torch.float32):
    from pagedserve.gpu.models.loader import load_model

    return load_model(ModelConfig(model=str(path)), "cpu", dtype)


def make_meta(reqs: list[tuple[list[int], int, int]], block_size: int = BLOCK) -> AttentionMetadata:
    """reqs: (block table, tokens already cached, new tokens) per request, decodes first."""
    qsl, seq_lens, slots = [0], [], []
    for table, cached, new in reqs:
        qsl.append(qsl[-1] + new)
        seq_lens.append(cached + new)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
    width = max(len(t) for t, _, _ in reqs)
    tables = torch.tensor([t + [0] * (width - len(t)) for t, _, _ in reqs], dtype=torch.int32)
    num_decodes = 0
    for _, _, new in reqs:
        if new != 1:
            break
        num_decodes += 1
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables, slot_mapping=torch.tensor(slots, dtype=torch.int64), num_decodes=num_decodes,
        max_query_len=max(n for _, _, n in reqs), max_seq_len=max(seq_lens),
        query_start_loc_host=qsl, seq_lens_host=seq_lens)


def make_caches(model, num_blocks: int = 24, dtype=torch.float32):
    shape = (num_blocks, BLOCK, model.num_kv_heads, model.head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(model.num_layers)]


def paged_step(model, caches, reqs, tokens: list[list[int]]) -> torch.Tensor:
    """One flat step: reqs as in make_meta, tokens[i] = all tokens of request i; returns logits of
    every new token [T, V]."""
    ids, pos = [], []
    for (table, cached, new), toks in zip(reqs, tokens):
        ids += toks[cached:cached + new]
        pos += list(range(cached, cached + new))
    with torch.inference_mode(), forward_context(make_meta(reqs), caches):
        hidden = model(torch.tensor(ids), torch.tensor(pos))
        return model.compute_logits(hidden)


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str = ""):
    scale = max(1.0, ref.abs().max().item())
    err = (ours - ref).abs().max().item() / scale
    assert err < 1e-4, f"{what}: max abs diff {err:.3g} relative to scale {scale:.3g}"


ARCHS = {
    "llama": tiny_config("LlamaForCausalLM"),
    "llama3-tied-scaled": tiny_config(
        "LlamaForCausalLM", tie_word_embeddings=True, num_key_value_heads=1, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}),
    "llama-linear-rope-bias": tiny_config("LlamaForCausalLM", attention_bias=True, mlp_bias=True,
                                          rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": tiny_config("MistralForCausalLM"),
    "qwen2": tiny_config("Qwen2ForCausalLM"),
    "qwen3": tiny_config("Qwen3ForCausalLM"),
    "gpt2": tiny_config("GPT2LMHeadModel"),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    extra = {"max_shard_size": "40KB"} if request.param == "qwen2" else {}  # sharded checkpoint + index
    ref = save_hf_model(ARCHS[request.param], path, **extra)
    return request.param, ref, load_ours(path), path


def test_prompt_logits_match_transformers(pair):
    name, ref, ours, _ = pair
    ids = torch.randint(0, 97, (21,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
        with forward_context(None, []):
            got = ours.compute_logits(ours(ids, torch.arange(len(ids))))
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert_close(got, want, name)


def test_paged_chunked_prefill_and_decode_match(pair):
    """Two requests share steps: A prefills whole, then decodes while B prefills in two chunks
    (the first ending mid-block); then both decode across block boundaries. Every new token's
    logits equal transformers' logits at that position of the full sequence."""
    name, ref, ours, _ = pair
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 97, (16,), generator=g).tolist()  # A: 6 prompt + 10 decodes
    b = torch.randint(0, 97, (21,), generator=g).tolist()  # B: 13 prompt (7 + 6) + 8 decodes
    table_a, table_b = [5, 2, 9], [7, 1, 12]  # scattered, non-contiguous blocks
    with torch.inference_mode():
        ref_a, ref_b = ref(torch.tensor([a])).logits[0], ref(torch.tensor([b])).logits[0]
    caches = make_caches(ours)

    got = paged_step(ours, caches, [(table_a, 0, 6)], [a])
    assert_close(got, ref_a[:6], f"{name} A prefill")
    got = paged_step(ours, caches, [(table_a, 6, 1), (table_b, 0, 7)], [a, b])
    assert_close(got[0], ref_a[6], f"{name} A decode")
    assert_close(got[1:], ref_b[:7], f"{name} B chunk 1")
    got = paged_step(ours, caches, [(table_a, 7, 1), (table_b, 7, 6)], [a, b])
    assert_close(got[0], ref_a[7], f"{name} A decode across block boundary")
    assert_close(got[1:], ref_b[7:13], f"{name} B chunk 2")
    for step in range(8):  # A: positions 8..15, B: 13..20 (crosses 16)
        got = paged_step(ours, caches, [(table_a, 8 + step, 1), (table_b, 13 + step, 1)], [a, b])
        assert_close(got[0], ref_a[8 + step], f"{name} A decode {step}")
        assert_close(got[1], ref_b[13 + step], f"{name} B decode {step}")


def test_model_attributes(pair):
    name, ref, ours, _ = pair
    cfg = ARCHS[name]
    assert ours.num_layers == cfg.get("num_hidden_layers", cfg.get("n_layer"))
    assert ours.num_kv_heads == cfg.get("num_key_value_heads", cfg.get("n_head"))
    assert ours.head_dim == cfg.get("head_dim", 16)
    tied = cfg.get("tie_word_embeddings", name == "gpt2")
    emb = ours.transformer.wte if name == "gpt2" else ours.model.embed_tokens
    assert (ours.lm_head.weight is emb.weight) == tied


def test_bfloat16_load_is_close(tmp_path):
    cfg = ARCHS["llama"]
    ref = save_hf_model(cfg, tmp_path)
    ours = load_ours(tmp_path, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ids = torch.arange(12) * 7 % 97
    with torch.inference_mode(), forward_context(None, []):
        got = ours.compute_logits(ours(ids, torch.arange(12)))
        want = ref(ids[None]).logits[0]
    assert got.dtype == torch.float32
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8


def test_dummy_weights_seeded_and_sane():
    from pagedserve.gpu.models.loader import load_model

    cfg = ARCHS["qwen3"]
    m1 = load_model(ModelConfig(load_format="dummy", hf_config=cfg, seed=3), "cpu", torch.float32)
    m2 = load_model(ModelConfig(load_format="dummy", hf_config=cfg, seed=3), "cpu", torch.float32)
    m3 = load_model(ModelConfig(load_format="dummy", hf_config=cfg, seed=4), "cpu", torch.float32)
    ids = torch.arange(10)
    outs = []
    with torch.inference_mode(), forward_context(None, []):
        for m in (m1, m2, m3):
            outs.append(m.compute_logits(m(ids, ids)))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])
    assert torch.isfinite(outs[0]).all() and 0 < outs[0].std() < 5
    assert torch.equal(m1.model.norm.weight, torch.ones(64))


def test_tensor_parallel_shards_are_slices_of_full_weights(tmp_path):
    """Built for rank r of 2, each fused/sharded parameter holds exactly its slice of the
    checkpoint (heads for qkv, rows for gate/up and vocab, columns for o/down)."""
    from pagedserve.gpu.parallel_state import init_tensor_parallel, reset_tensor_parallel

    cfg = ARCHS["qwen2"]
    ref = save_hf_model(cfg, tmp_path)
    sd = ref.state_dict()
    try:
        for rank in (0, 1):
            init_tensor_parallel(rank, 2)
            m = load_ours(tmp_path)
            attn = m.model.layers[1].self_attn
            q = sd["model.layers.1.self_attn.q_proj.weight"][rank * 32:(rank + 1) * 32]
            k = sd["model.layers.1.self_attn.k_proj.weight"][rank * 16:(rank + 1) * 16]
            v = sd["model.layers.1.self_attn.v_proj.weight"][rank * 16:(rank + 1) * 16]
            assert torch.equal(dense_weight(attn.qkv_proj), torch.cat([q, k, v]))
            kb = sd["model.layers.1.self_attn.k_proj.bias"][rank * 16:(rank + 1) * 16]
            assert torch.equal(attn.qkv_proj.bias[32:48], kb)
            o = sd["model.layers.1.self_attn.o_proj.weight"][:, rank * 32:(rank + 1) * 32]
            assert torch.equal(dense_weight(attn.o_proj), o)
            mlp = m.model.layers[1].mlp
            gate = sd["model.layers.1.mlp.gate_proj.weight"][rank * 48:(rank + 1) * 48]
            up = sd["model.layers.1.mlp.up_proj.weight"][rank * 48:(rank + 1) * 48]
            assert torch.equal(dense_weight(mlp.gate_up_proj), torch.cat([gate, up]))
            assert torch.equal(dense_weight(mlp.down_proj),
                               sd["model.layers.1.mlp.down_proj.weight"][:, rank * 48:(rank + 1) * 48])
            emb = m.model.embed_tokens.weight  # 97 rows -> 49 per rank, the last one zero-padded
            full = sd["model.embed_tokens.weight"]
            assert torch.equal(emb[: 49 - rank], full[rank * 49:(rank + 1) * 49])
            assert m.num_kv_heads == 1
    finally:
        reset_tensor_parallel()


def test_parallel_state_identity_at_size_one():
    from pagedserve.gpu.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce

    x = torch.randn(3, 4)
    assert get_tp_rank() == 0 and get_tp_size() == 1
    assert tp_all_reduce(x) is x and tp_all_gather(x, dim=-1) is x


def _tp_worker(rank: int, world: int, init_file: str, dirs: list[str], out_file: str) -> None:
    import torch.distributed as dist

    from pagedserve.gpu.parallel_state import init_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    init_tensor_parallel(rank, world, dist.group.WORLD)
    results = []
    ids = torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(5))
    for d in dirs:
        model = load_ours(d)
        head = model.lm_head  # really sharded: 97 vocab rows -> 49 per rank (packed from GGUF, or not)
        assert (dense_weight(head).shape[0] if head.qweight is None else head.qweight.out_features) == 49
        with torch.inference_mode(), forward_context(None, []):
            full = model.compute_logits(model(ids, torch.arange(11)))
        caches = make_caches(model)
        toks = ids.tolist()
        first = paged_step(model, caches, [([4, 2], 0, 10)], [toks])
        step = paged_step(model, caches, [([4, 2], 10, 1)], [toks])
        results.append((full, torch.cat([first, step])))
    if rank == 0:
        torch.save(results, out_file)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without interpreter teardown: gloo's background threads can abort a normal exit.
    os._exit(0)


def check_tensor_parallel(tmp_path, configs: dict[str, dict]) -> None:
    """Save each config's random transformers model, run it on two gloo ranks (``_tp_worker``) and
    compare the logits, full prompt and paged, with the single-rank model's."""
    import multiprocessing as mp

    dirs = []
    for name, cfg in configs.items():
        d = tmp_path / name
        save_hf_model(cfg, d)
        dirs.append(str(d))
    out = str(tmp_path / "tp.pt")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_tp_worker, args=(r, 2, str(tmp_path / "init"), dirs, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results = torch.load(out)
    ids = torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(5))
    for name, d, (full, paged) in zip(configs, dirs, results):
        model = load_ours(d)
        with torch.inference_mode(), forward_context(None, []):
            want = model.compute_logits(model(ids, torch.arange(11)))
        assert full.shape == want.shape == (11, 97)
        assert_close(full, want, f"{name} tp=2")
        assert_close(paged, want, f"{name} tp=2 paged")


def test_tensor_parallel_forward_matches_single_rank(tmp_path):
    """Two gloo ranks (row-parallel all-reduce, vocab-parallel embedding with padding, gathered
    logits, kv heads split or replicated) give the single-rank logits."""
    names = ["qwen2", "llama3-tied-scaled", "gpt2"]  # kv heads 2 -> 1 per rank; 1 -> replicated
    check_tensor_parallel(tmp_path, {name: ARCHS[name] for name in names})
