"""The GPU check's sampler part (issue 24 item 7): a step of each common kind reads the device
once. On CUDA under ``torch.cuda.set_sync_debug_mode("error")``, which raises at any operation
that makes the host wait for the GPU (``item``, ``nonzero``, a boolean-mask index, a copy from
pageable memory), lifted only inside gpu.sampling_host.to_host, whose calls are counted; greedy
tokens must equal the CPU's; the step time at 64 rows of the default vocabulary is reported; a
failure names the line that waited. In --dry-run (CPU) the same count, with gpu.sync_watch
standing in for the sync debug mode (tests/gpu/test_sampler_sync.py uses it too)."""
from __future__ import annotations

import contextlib
import time
import traceback

import torch

from pagedserve.contracts.messages import SamplingOptions as O

KINDS = {
    "greedy": [O(temperature=0.0)] * 4,
    "temperature": [O(temperature=0.8, seed=i) for i in range(4)],
    "top_k": [O(temperature=0.9, top_k=20, seed=i) for i in range(4)],
    "top_p": [O(temperature=0.7, top_p=0.9, seed=i) for i in range(4)],
    "mixed + min_p": [O(temperature=0.0), O(temperature=0.8, seed=1), O(top_k=5, seed=2), O(min_p=0.05, seed=3),
                      O(top_p=0.8, top_k=50, seed=4)],
    "logprobs": [O(temperature=0.0, logprobs=3), O(temperature=0.0), O(top_p=0.9, temperature=0.5, seed=6, logprobs=5)],
    "penalties + bias": [O(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, seed=7),
                         O(temperature=0.0, logit_bias={7: 50.0}), O(min_tokens=5, min_tokens_blocked_ids=(1, 2), seed=8)],
}


@contextlib.contextmanager
def _counted_reads(device: str):
    """Counts gpu.sampling_host.to_host calls; on CUDA any other sync raises meanwhile."""
    import pagedserve.gpu.sampling_host as host
    real = host.to_host
    count = [0]

    def to_host(t):
        count[0] += 1
        if device != "cuda":
            return real(t)
        torch.cuda.set_sync_debug_mode("default")
        try:
            return real(t)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    host.to_host = to_host
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        watch = contextlib.nullcontext([])
    else:
        from pagedserve.gpu.sync_watch import SyncWatch

        watch = SyncWatch()
    try:
        with watch as events:
            yield count, events
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        host.to_host = real


def _where(e: BaseException) -> str:
    """The innermost frames of the project's code in e's traceback: the line that waited."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/gpu/" in f.filename or "/kernels/" in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.line}"
                       for f in reversed(frames[-3:]))


def _step(sampler, logits, options):
    token_ids = [[0, 1, 2, 3] for _ in options]
    return sampler.sample(logits.clone(), options, token_ids, [2] * len(options))


def check_sampler_syncs(rep, device: str) -> None:
    """``rep``: gpu_check.Report. One check per kind, and the step time on CUDA. On the CPU the
    C pass and the sparse penalty pass are set aside meanwhile: every row takes CUDA's path."""
    import pagedserve.gpu.sampling_logits as logits_mod
    from pagedserve.kernels import sample_cpu

    library, dense = sample_cpu.library, logits_mod.dense_penalties
    sample_cpu.library = lambda: None
    logits_mod.dense_penalties = lambda logits: True
    try:
        _check(rep, device)
    finally:
        sample_cpu.library, logits_mod.dense_penalties = library, dense


def _check(rep, device: str) -> None:
    from pagedserve.gpu.sampler import Sampler

    sampler = Sampler()
    vocab = 49152
    for kind, options in KINDS.items():
        torch.manual_seed(0)
        cpu_logits = torch.randn(len(options), vocab) * 8  # peaked, as a language model's mostly are
        logits = cpu_logits.to(device)
        _step(sampler, logits, options)  # warm-up: pinned memory, first kernels
        error = None
        with _counted_reads(device) as (count, events):
            try:
                out = _step(sampler, logits, options)
            except RuntimeError as e:  # the sync debug mode raises at the operation that waited
                error, out = f"{str(e)[:200]} at {_where(e)}", None
        ok = error is None and count[0] == 1 and not events
        info = {"host_reads": count[0], "error": error, **({"waits": events} if events else {})}
        if out is not None and device == "cuda":
            want = sampler._sample_general(cpu_logits.clone(), options, [[0, 1, 2, 3]] * len(options),
                                           [2] * len(options), None).token_ids
            greedy_rows = [i for i, o in enumerate(options) if o.temperature == 0.0]
            ok = ok and all(out.token_ids[i] == want[i] for i in greedy_rows)
            info["agree_with_cpu"] = sum(a == b for a, b in zip(out.token_ids, want))
        rep.check(f"sampler {kind}: one host read per step", ok, **info)
    # The rare path, for the record: a flat row whose top-p nucleus lies beyond the first 256
    # candidates is drawn again after the step's read.
    flat = [O(top_p=0.95, seed=1)]
    logits = (torch.randn(1, vocab) * 0.5).to(device)
    _step(sampler, logits, flat)
    with _counted_reads("cpu") as (count, _):  # counted only: its second read is expected
        _step(sampler, logits, flat)
    rep.figure("sampler host reads, top-p nucleus beyond the candidates (rare path)", count[0])
    if device != "cuda":
        rep.skip("sampler step time", "CUDA only")
        return
    for kind in ("greedy", "top_p"):
        options = [KINDS[kind][0]] * 64
        logits = torch.randn(64, vocab, device=device) * 8
        times = []
        for _ in range(12):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _step(sampler, logits, options)
            times.append(time.perf_counter() - t0)
        rep.figure(f"sampler ms, 64 rows x {vocab} ({kind})", round(1000 * sorted(times)[len(times) // 2], 3))
