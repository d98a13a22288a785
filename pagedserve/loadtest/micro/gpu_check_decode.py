"""The GPU check's ``decode_1b`` phase (loadtest/micro/gpu_check.py): a ~1.2B random Llama's decode
step against the memory-bandwidth floor; its model and step metadata are also used by
loadtest/micro/gpu_profile_decode.py and gpu_attention_sweep.py."""
from __future__ import annotations

import statistics
import time

from pagedserve.loadtest.micro.gpu_check_common import Ctx, Report, decode_run, random_prompts, synchronize, tiny_options
from pagedserve.loadtest.tiny_model import TINY_CONFIG


def _copy_bandwidth(device: str) -> float:
    """Bytes read plus written per second by a large device-to-device copy (median of 10)."""
    import torch

    n = (1 << 30) if device == "cuda" else (64 << 20)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(times[2:])


def _decode_meta(batch: int, context: int, block_size: int, device: str):
    import torch

    from pagedserve.kernels.metadata import AttentionMetadata

    per = -(-context // block_size)
    tables = torch.arange(1, 1 + batch * per, dtype=torch.int32).view(batch, per)
    slots = tables[:, (context - 1) // block_size].long() * block_size + (context - 1) % block_size
    starts = list(range(batch + 1))
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_tables=tables.to(device), slot_mapping=slots.to(device), num_decodes=batch, max_query_len=1,
        max_seq_len=context, query_start_loc_host=starts, seq_lens_host=[context] * batch)


def _time_ms(fn, device: str, repeats: int) -> float:
    for _ in range(3):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def layer_weight_bytes(model) -> int:
    """The bytes a decode step reads of the decoder layers' weights (not the embedding, not the
    head): full-precision parameters plus quantized layers' packed weights (fp8: 1 byte each)."""
    dense = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if "embed" not in name and "lm_head" not in name)
    packed = sum(m.qweight.nbytes() for name, m in model.named_modules()
                 if getattr(m, "qweight", None) is not None and "lm_head" not in name and "embed" not in name)
    return dense + packed


def time_decode_steps(ctx: Ctx, rep: Report, llm, batches: list[int], context: int, repeats: int,
                      bandwidth: float, weight_bytes: int, label: str = "decode step") -> list[dict]:
    """Each batch size's decode step at ``context`` tokens (graph replay where captured, and eager)
    against the floor (weight_bytes + the batch's K/V bytes) / bandwidth; one figure per batch."""
    import torch

    from pagedserve.gpu.forward_context import forward_context

    runner = llm.parts.executor.runner
    model, gr = runner.model, runner.graph_runner
    kv_per_token = runner.kv_bytes_per_block() // runner.block_size
    rows = []
    for b in batches:
        meta = _decode_meta(b, context, runner.block_size, ctx.device)
        ids = torch.randint(100, 40000, (b,), device=ctx.device)
        pos = torch.full((b,), context - 1, dtype=torch.long, device=ctx.device)
        size = gr._fill(ids, pos, meta)
        static = gr._static_meta(size, meta.block_tables.shape[1], meta.seq_lens_host, context)
        graph = gr.graphs.get(size)

        def eager():
            with torch.inference_mode(), forward_context(static, runner.kv_caches):
                model(gr.input_ids[:size], gr.positions[:size])

        eager_ms = _time_ms(eager, ctx.device, repeats)
        graph_ms = _time_ms(graph.replay, ctx.device, repeats) if graph is not None else None
        floor_ms = (weight_bytes + b * context * kv_per_token) / bandwidth * 1e3
        best = graph_ms if graph_ms is not None else eager_ms
        rows.append({"batch": b, "graph_ms": graph_ms, "eager_ms": eager_ms, "floor_ms": floor_ms,
                     "floor_fraction": floor_ms / best, "tokens_per_s": b / best * 1e3})
        rep.figure(f"{label} batch {b}", rows[-1])
    return rows


# The ~1.2B Llama of the decode phase (and of loadtest/micro/gpu_profile_decode.py).
CONFIG_1B = {**TINY_CONFIG, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64}


def phase_decode_1b(ctx: Ctx, rep: Report) -> None:
    from pagedserve.engine.llm import LLM

    dry = ctx.dry_run
    if dry:
        cfg = {**TINY_CONFIG, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
        batches, context, dtype, repeats = [1, 4], 64, "float32", 5
    else:
        cfg = CONFIG_1B
        batches, context, dtype, repeats = [1, 16, 64, 256], 1024, "bfloat16", 30
    bandwidth = _copy_bandwidth(ctx.device)
    rep.figure("copy bandwidth GB/s (read + write)", bandwidth / 1e9)
    blocks = max(batches) * -(-context // 16) + 64
    options = tiny_options(ctx, hf_config=cfg, dtype=dtype, enforce_eager=False, cuda_graph_batch_sizes=batches,
                           num_gpu_blocks_override=blocks, max_model_len=2048)
    with LLM(**options) as llm:
        runner = llm.parts.executor.runner
        model = runner.model
        weight_bytes = layer_weight_bytes(model)
        kv_per_token = runner.kv_bytes_per_block() // runner.block_size
        rep.figure("model", {"parameters": sum(p.numel() for p in model.parameters()), "dtype": dtype,
                             "layer_weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
                             "context": context})
        rows = time_decode_steps(ctx, rep, llm, batches, context, repeats, bandwidth, weight_bytes)
        if not dry:
            rep.check("every batch size has a captured graph", all(r["graph_ms"] is not None for r in rows))
            rep.figure("targets (reported, not gating)", {
                "batch1_at_70pct_of_floor": rows[0]["floor_fraction"] >= 0.7,
                "graphs_2x_eager_at_batch1": rows[0]["eager_ms"] >= 2 * rows[0]["graph_ms"],
                "batch64_within_1.5x_of_floor": rows[2]["floor_fraction"] >= 1 / 1.5})
        else:
            rep.skip("graph timings", "no CUDA device (dry run): the padded eager path is timed")
        n = max(batches[-1] // 4, 1) if not dry else 4
        first = decode_run(llm, random_prompts(n, 128, 128, seed=3), 16 if dry else 64)
        rep.figure("LLM decode run, first (its first prefill compiles the Triton prefill kernel)", first)
        run = decode_run(llm, random_prompts(n, 128, 128, seed=4), 16 if dry else 64)
        rep.figure("LLM decode run", run)
