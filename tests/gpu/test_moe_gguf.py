"""Quantized experts: a qwen3moe GGUF file (as llama.cpp lays it out: ``ffn_*_exps`` 3D tensors,
Q4_1 / Q4_0 experts, Q8_0 attention) loads with its experts kept packed, and computes what
transformers computes with the file's dequantized weights (up to the kernel's activation
rounding); ``--quantization int8`` packs a safetensors checkpoint's experts too."""
from __future__ import annotations

import numpy as np
import pytest

from tests.needs import require
import torch

gguf = require("gguf")

from gguf.constants import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from pagedserve.contracts.config import ModelConfig  # noqa: E402
from pagedserve.gpu.forward_context import forward_context  # noqa: E402
from tests.gpu.test_moe import BASE, load_ours  # noqa: E402
from tests.gpu.test_models import save_hf_model  # noqa: E402

CFG = dict(BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=16,
           intermediate_size=64, moe_intermediate_size=64, num_experts=6, num_experts_per_tok=2,
           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=10000.0)
QTYPE = {"ffn_gate_exps": T.Q4_1, "ffn_up_exps": T.Q4_1, "ffn_down_exps": T.Q4_0}


def _write_gguf(ref, path) -> None:
    """The HF model as a qwen3moe GGUF; each quantized tensor's dequantized values are written
    back into ``ref`` so it computes with exactly the file's weights."""
    sd = ref.state_dict()
    L = CFG["num_hidden_layers"]
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in (("block_count", L), ("context_length", CFG["max_position_embeddings"]),
                       ("embedding_length", CFG["hidden_size"]), ("feed_forward_length", CFG["intermediate_size"]),
                       ("attention.head_count", CFG["num_attention_heads"]),
                       ("attention.head_count_kv", CFG["num_key_value_heads"]), ("attention.key_length", 16),
                       ("attention.value_length", 16), ("expert_count", CFG["num_experts"]),
                       ("expert_used_count", CFG["num_experts_per_tok"]),
                       ("expert_feed_forward_length", CFG["moe_intermediate_size"]), ("vocab_size", 97)):
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_float32("qwen3moe.rope.freq_base", CFG["rope_theta"])
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", CFG["rms_norm_eps"])

    def put(name: str, target, qtype=T.F32) -> None:
        """``target``: an HF state-dict name, or a tensor (a view into one)."""
        t = sd[target] if isinstance(target, str) else target
        x = np.ascontiguousarray(t.detach().numpy(), dtype=np.float32)
        if qtype == T.F32:
            w.add_tensor(name, x)
            return
        q = quantize(x, qtype)
        with torch.no_grad():
            t.copy_(torch.from_numpy(dequantize(q, qtype).reshape(x.shape).copy()))
        w.add_tensor(name, q, raw_dtype=qtype)

    put("token_embd.weight", "model.embed_tokens.weight")
    put("output_norm.weight", "model.norm.weight")
    put("output.weight", "lm_head.weight", T.Q8_0)
    inter = CFG["moe_intermediate_size"]
    for i in range(L):
        p = f"model.layers.{i}"
        for g, h in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                     ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
                     ("ffn_gate_inp", "mlp.gate")):
            put(f"blk.{i}.{g}.weight", f"{p}.{h}.weight")
        for g, h in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            put(f"blk.{i}.{g}.weight", f"{p}.self_attn.{h}.weight", T.Q8_0)
        # transformers 5 keeps the experts stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I]
        gate_up, down = sd[f"{p}.mlp.experts.gate_up_proj"], sd[f"{p}.mlp.experts.down_proj"]
        put(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :inter], QTYPE["ffn_gate_exps"])
        put(f"blk.{i}.ffn_up_exps.weight", gate_up[:, inter:], QTYPE["ffn_up_exps"])
        put(f"blk.{i}.ffn_down_exps.weight", down, QTYPE["ffn_down_exps"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe-gguf")
    ref = save_hf_model(CFG, path / "hf")
    _write_gguf(ref, path / "model.gguf")
    return ref, path


def _logits(model, ids):
    with torch.inference_mode(), forward_context(None, []):
        return model.compute_logits(model(ids, torch.arange(len(ids))))


def test_gguf_experts_load_packed_and_match_the_dequantized_model(files):
    from pagedserve.gpu.models.loader import load_model
    from pagedserve.gpu.models.moe import FusedExperts

    ref, path = files
    ours = load_model(ModelConfig(model=str(path / "model.gguf")), "cpu", torch.float32)
    blocks = [m for m in ours.modules() if isinstance(m, FusedExperts)]
    assert len(blocks) == CFG["num_hidden_layers"]
    for b in blocks:
        assert b.qexperts is not None and b.w13.numel() == 0 and b.w2.numel() == 0  # no fp32 copy kept
        assert {gu.mode for gu, _ in b.qexperts} == {"q4_1"} and {d.mode for _, d in b.qexperts} == {"q4_1"}
    ids = torch.randint(0, 97, (29,), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
    got = _logits(ours, ids)
    err = (got - want).abs().max() / want.abs().max()
    assert err < 2e-2, f"relative error {err:.3g}"  # the kernel rounds activations to 15 bits a row
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_gguf_experts_in_full_precision_under_quantization_none(files):
    from pagedserve.gpu.models.loader import load_model

    ref, path = files
    ours = load_model(ModelConfig(model=str(path / "model.gguf"), quantization="none"), "cpu", torch.float32)
    block = ours.model.layers[0].mlp.experts
    assert block.qexperts is None and block.w13.numel() > 0
    ids = torch.randint(0, 97, (17,), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
    got = _logits(ours, ids)
    assert (got - want).abs().max() / want.abs().max() < 1e-4


def test_int8_packs_the_experts_of_a_safetensors_checkpoint(files):
    from pagedserve.gpu.models.loader import load_model

    ref, path = files
    ours = load_model(ModelConfig(model=str(path / "hf"), quantization="int8"), "cpu", torch.float32)
    for layer in ours.model.layers:
        assert layer.mlp.experts.qexperts is not None and layer.mlp.experts.w13.numel() == 0
        assert {gu.mode for gu, _ in layer.mlp.experts.qexperts} == {"q8_0"}
    dense = load_model(ModelConfig(model=str(path / "hf"), quantization="none"), "cpu", torch.float32)
    # A packed block computes what the dense block computes with the packed weights' values
    packed, plain = ours.model.layers[0].mlp, dense.model.layers[0].mlp
    with torch.no_grad():
        for e, (gu, down) in enumerate(packed.experts.qexperts):
            plain.experts.w13[e].copy_(gu.dequantize())
            plain.experts.w2[e].copy_(down.dequantize())
    x = torch.randn(9, CFG["hidden_size"], generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        got, want = packed.forward(x), plain.forward(x)
    assert (got - want).abs().max() / want.abs().max() < 2e-3


def test_packed_experts_under_tensor_parallel_2_match_one_rank(files, tmp_path):
    """Two gloo ranks, each keeping its rows (gate, up) or groups of columns (down) of every
    packed expert, give the single rank's logits."""
    import multiprocessing as mp

    from tests.gpu.test_models import _tp_worker

    _, path = files
    model_file = str(path / "model.gguf")
    out = str(tmp_path / "tp.pt")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_tp_worker, args=(r, 2, str(tmp_path / "init"), [model_file], out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    (full, paged), = torch.load(out)
    ids = torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(5))
    want = _logits(load_ours(model_file), ids)
    # Each rank rounds its half of a row-parallel input to 15 bits against that half's own
    # maximum (the packed kernels' activation rounding), one rank against the whole row's: the
    # results differ by a few 1e-4 of the logits' scale (measured 1.5e-4), not the fp32 1e-4.
    for got in (full, paged):
        assert (got - want).abs().max() / want.abs().max() < 1e-3
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_bad_expert_tensors_are_clear_errors(tmp_path):
    """An expert index past the config's count, a wrong expert shape, a missing expert."""
    from safetensors.torch import load_file, save_file

    from pagedserve.contracts.errors import ModelLoadError
    from tests.gpu.test_moe import MOE

    save_hf_model(MOE["mixtral"], tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.block_sparse_moe.experts.{}.{}.weight"
    inter, hidden = MOE["mixtral"]["intermediate_size"], MOE["mixtral"]["hidden_size"]
    cases = [({name.format(9, "w1"): torch.zeros(inter, hidden)}, None, "expert 9"),
             ({name.format(1, "w2"): torch.zeros(hidden, inter - 8)}, None, "shape mismatch"),
             ({}, name.format(1, "w3"), "missing")]
    for extra, drop, message in cases:
        t = {k: v for k, v in tensors.items() if k != drop}
        t.update(extra)
        save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=message):
            load_ours(tmp_path)
