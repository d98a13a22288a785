"""Write a random-weight Qwen3-MoE GGUF that llama.cpp can load, to compare decode speed on the
same file (issue 25: "against llama.cpp on the same GGUF").

    python -m pagedserve.loadtest.micro.moe_gguf OUT.gguf [--layers 12 --hidden 768 --experts 32 --top-k 4 --expert-size 256]

The shape is loadtest/micro/bench_moe.py's MoE config. Weights are normal(0, 0.02): attention Q8_0,
experts Q4_1 (as the default model's file: 4-bit linears, an 8-bit embedding), norms F32. The
tokenizer (vocabulary, merges, special ids) is copied from the default model's GGUF, which has
the 49152-token vocabulary these configs use: llama.cpp refuses a file without one.
"""
from __future__ import annotations

import argparse

import numpy as np


def _copy_tokenizer(writer, source: str) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(source)

    def field(name):
        f = reader.fields.get(name)
        return None if f is None else f.contents()

    writer.add_tokenizer_model(field("tokenizer.ggml.model"))
    if field("tokenizer.ggml.pre") is not None:
        writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(field("tokenizer.ggml.tokens"))
    if field("tokenizer.ggml.token_type") is not None:
        writer.add_token_types(field("tokenizer.ggml.token_type"))
    if field("tokenizer.ggml.merges") is not None:
        writer.add_token_merges(field("tokenizer.ggml.merges"))
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("padding_token_id", writer.add_pad_token_id), ("unknown_token_id", writer.add_unk_token_id)):
        value = field(f"tokenizer.ggml.{key}")
        if value is not None:
            add(int(value))


def write(path: str, layers: int, hidden: int, experts: int, top_k: int, expert_size: int, seed: int = 0) -> None:
    import gguf
    from gguf.constants import GGMLQuantizationType as T
    from gguf.quants import quantize

    from pagedserve.contracts.config import default_model_path

    rng = np.random.default_rng(seed)
    heads, kv_heads, head_dim, vocab = hidden // 64, max(1, hidden // 256), 64, 49152
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_name("pagedserve random qwen3moe")
    for key, value in (("block_count", layers), ("context_length", 4096), ("embedding_length", hidden),
                       ("feed_forward_length", expert_size * top_k), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("attention.key_length", head_dim),
                       ("attention.value_length", head_dim), ("expert_count", experts),
                       ("expert_used_count", top_k), ("expert_feed_forward_length", expert_size),
                       ("vocab_size", vocab)):
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_float32("qwen3moe.rope.freq_base", 1e6)
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    _copy_tokenizer(w, default_model_path())

    def put(name: str, shape: tuple[int, ...], qtype=T.F32, ones: bool = False) -> None:
        x = np.ones(shape, np.float32) if ones else (rng.standard_normal(shape, dtype=np.float32) * 0.02)
        if qtype == T.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)

    put("token_embd.weight", (vocab, hidden), T.Q8_0)  # tied: no output.weight
    put("output_norm.weight", (hidden,), ones=True)
    for i in range(layers):
        b = f"blk.{i}"
        for n in ("attn_norm", "ffn_norm"):
            put(f"{b}.{n}.weight", (hidden,), ones=True)
        for n in ("attn_q_norm", "attn_k_norm"):
            put(f"{b}.{n}.weight", (head_dim,), ones=True)
        put(f"{b}.attn_q.weight", (heads * head_dim, hidden), T.Q8_0)
        put(f"{b}.attn_k.weight", (kv_heads * head_dim, hidden), T.Q8_0)
        put(f"{b}.attn_v.weight", (kv_heads * head_dim, hidden), T.Q8_0)
        put(f"{b}.attn_output.weight", (hidden, heads * head_dim), T.Q8_0)
        put(f"{b}.ffn_gate_inp.weight", (experts, hidden))
        put(f"{b}.ffn_gate_exps.weight", (experts, expert_size, hidden), T.Q4_1)
        put(f"{b}.ffn_up_exps.weight", (experts, expert_size, hidden), T.Q4_1)
        put(f"{b}.ffn_down_exps.weight", (experts, hidden, expert_size), T.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-size", type=int, default=256)
    args = parser.parse_args(argv)
    write(args.out, args.layers, args.hidden, args.experts, args.top_k, args.expert_size)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
