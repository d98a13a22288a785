"""The GPU check's ``refusals`` phase (loadtest/micro/gpu_check.py): what CUDA refuses cleanly, the
position-table start-up case, and one host read per sampling step (gpu_check_sampler.py)."""
from __future__ import annotations

from pagedserve.loadtest.micro.gpu_check_common import (Ctx, Report, as_inputs, greedy, random_prompts, tiny_options,
                                             token_ids)
from pagedserve.loadtest.tiny_model import TINY_CONFIG


def phase_refusals(ctx: Ctx, rep: Report) -> None:
    from pagedserve.engine.llm import LLM
    from pagedserve.loadtest.micro.gpu_check_sampler import check_sampler_syncs

    check_sampler_syncs(rep, ctx.device)

    cases = [("kv_cache_dtype", "fp8", "kv-cache-dtype"), ("quantization", "int8", "int8"),
             ("quantization", "int4", "int4")]
    for option, value, word in cases:
        error = None
        try:
            if ctx.device == "cuda":
                with LLM(**tiny_options(ctx, **{option: value})):
                    pass
            elif option == "kv_cache_dtype":
                import torch

                from pagedserve.kernels.kv_cache_dtype import resolve

                resolve(value, torch.float32, "cuda")  # the check LLM makes; needs no GPU
            else:
                from pagedserve.gpu.models.loader import resolve_quantization

                resolve_quantization(value, "cuda")
        except Exception as e:  # noqa: BLE001 - any type, but it must say why, and not be a CUDA crash
            error = e
        message = f"{type(error).__name__}: {error}" if error is not None else None
        rep.check(f"{option}={value} on CUDA refused cleanly", error is not None and word in str(error).lower()
                  and "cuda error" not in str(error).lower(), error=message)
    # --quantization fp8 where there are no FP8 matmuls: on the CPU, and on a GPU before compute
    # capability 8.9 (asked about an A100's 8.0: the lent card has FP8)
    from pagedserve.gpu.models.quantization import check_mode

    for device, capability, word in (("cpu", None, "runs on cpu"), ("cuda", (8, 0), "compute capability 8.0")):
        error = None
        try:
            check_mode("fp8", device, capability)
        except Exception as e:  # noqa: BLE001 - it must be a ConfigError that names the option
            error = e
        rep.check(f"quantization=fp8 on {device} {capability or ''} refused by name".replace("  ", " "),
                  type(error).__name__ == "ConfigError" and "--quantization fp8" in str(error) and word in str(error),
                  error=f"{type(error).__name__}: {error}" if error is not None else None)
    # Fault 1: a position table (256) below max_num_batched_tokens (2048) must start: the profile
    # forward wraps its positions. On the GPU the KV budget comes from that forward (no override).
    small = {**TINY_CONFIG, "max_position_embeddings": 256}
    options = tiny_options(ctx, hf_config=small, max_model_len=256, max_num_batched_tokens=2048)
    if ctx.device == "cuda":
        options.pop("num_gpu_blocks_override")
        # 1 % of an H100 (0.8 GiB) is ~200k blocks of this tiny model: enough, and quick to set up.
        options["gpu_memory_utilization"] = 0.01
    with LLM(**options) as llm:
        out = token_ids(llm.generate(as_inputs(random_prompts(2, 10, 20, seed=5)), greedy(8)))
        runner = llm.parts.executor.runner
        hidden = runner.profile_forward()
        finite = bool(hidden.float().isfinite().all().item()) if hasattr(hidden, "float") else True
    rep.check("max_position_embeddings 256 < max_num_batched_tokens 2048 starts and generates",
              all(len(t) == 8 for t in out) and finite, blocks=runner.num_blocks)
