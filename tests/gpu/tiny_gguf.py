"""Write a transformers model as llama.cpp's converter (convert_hf_to_gguf.py) writes its
architecture: ``gemma2`` / ``gemma3`` (norm scales stored as 1 + w, q/k rows not permuted),
``phi3`` (fused attn_qkv, gate and up fused into ffn_up, LongRoPE factors as tensors)."""
from __future__ import annotations

import math

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType as T

_GEMMA = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_PHI3 = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
         "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str, table: dict) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)  # model.layers.N.<module>.<weight>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{table[module]}.{kind}"


def write_gguf(model, arch: str, path, qtype: T = T.F32) -> None:
    """``model`` (a transformers Gemma2/Gemma3/Phi3 causal LM) as a GGUF file at ``path``; 2-D
    weights in ``qtype`` (norms and embeddings' neighbours stay F32 as llama.cpp keeps them)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = cfg.head_dim
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_tokenizer_model("gpt2")
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    rope = cfg.rope_parameters
    if arch == "gemma2":
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(cfg.sliding_window)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    elif arch == "gemma3":
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_sliding_window(cfg.sliding_window)
    else:  # phi3
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_dimension_count(int(head_dim * getattr(cfg, "partial_rotary_factor", 1.0)))
        if cfg.sliding_window:
            w.add_sliding_window(cfg.sliding_window)
        original = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    table = _PHI3 if arch == "phi3" else _GEMMA
    tied = cfg.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        data = tensor.detach().float().numpy()
        if arch != "phi3" and name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp stores Gemma's norm scale 1 + w
        gname = _gguf_name(name, table)
        if data.ndim == 2 and qtype != T.F32 and "token_embd" not in gname:
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
