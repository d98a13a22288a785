"""The decode graph runner on CPU (padded static-buffer path, run eagerly): a decode batch padded
to a capture size gives the logits of the unpadded eager run, padding rows never write the KV
cache, and static buffers left over from a larger step never leak into a smaller one."""
from __future__ import annotations

import random

import pytest
import torch

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.contracts.config import EngineConfig, default_model_path
from pagedserve.gpu.batch import BatchRequest
from pagedserve.gpu.model_runner import ModelRunner
from tests.tiny import TINY_CONFIG, tiny_llm

# Untied embeddings: a random model with tied ones mostly repeats its last input token.
UNTIED = {**TINY_CONFIG, "tie_word_embeddings": False}
BLOCK = 16
NUM_SEQS = 16
MAX_MODEL_LEN = 256  # 16 block-table columns in the static buffers


def make_runner(enforce_eager: bool, sizes: list[int] | None = None) -> ModelRunner:
    from pagedserve.engine.bootstrap import resolve_config

    options = {"model": default_model_path(), "load_format": "dummy", "hf_config": UNTIED,
               "dtype": "float32", "num_gpu_blocks_override": 128, "block_size": BLOCK,
               "max_model_len": MAX_MODEL_LEN, "enforce_eager": enforce_eager}
    if sizes is not None:
        options["cuda_graph_batch_sizes"] = sizes
    config, _ = resolve_config(EngineConfig.from_options(**options))
    runner = ModelRunner(config)
    runner.initialize()
    return runner


class Seqs:
    """NUM_SEQS prompts of different lengths (1 to 4 blocks), each with its own blocks."""

    def __init__(self, seed: int = 0):
        rng = random.Random(seed)
        self.tokens = [[rng.randrange(100, 40000) for _ in range(rng.randrange(2, 60))]
                       for _ in range(NUM_SEQS)]
        self.tables = []
        next_block = 1  # block 0 stays the null block the padding rows point at
        for t in self.tokens:
            need = -(-(len(t) + 40) // BLOCK)
            self.tables.append(list(range(next_block, next_block + need)))
            next_block += need
        assert next_block <= 128

    def prefill(self) -> list[BatchRequest]:
        return [BatchRequest(list(t), 0, table) for t, table in zip(self.tokens, self.tables)]

    def decode(self, idx: list[int], tokens: list[int] | None = None) -> list[BatchRequest]:
        """The next token of each chosen sequence (its last known token if none is given yet)."""
        toks = tokens or [self.tokens[i][-1] for i in idx]
        return [BatchRequest([tok], len(self.tokens[i]) - (tokens is None), self.tables[i])
                for i, tok in zip(idx, toks)]


def copy_caches(src: ModelRunner, dst: ModelRunner) -> None:
    for (sk, sv), (dk, dv) in zip(src.kv_caches, dst.kv_caches):
        dk.copy_(sk)
        dv.copy_(sv)


def record_padding(runner: ModelRunner) -> list[tuple[int, int]]:
    """Log (real batch, padded batch) of every step the graph runner takes."""
    gr = runner.graph_runner
    log: list[tuple[int, int]] = []
    fill = gr._fill

    def spy(input_ids, positions, meta):
        size = fill(input_ids, positions, meta)
        log.append((meta.num_requests, size))
        return size

    gr._fill = spy
    return log


@pytest.fixture(scope="module")
def eager() -> ModelRunner:
    r = make_runner(True)
    assert r.graph_runner is None
    return r


SIZE_LISTS = [[1, 2, 4, 8, 16], [3, 5, 12]]


@pytest.mark.parametrize("sizes", SIZE_LISTS, ids=str)
def test_padded_decode_equals_unpadded_for_every_capture_size(eager, sizes):
    seqs = Seqs()
    graph = make_runner(False, sizes)
    assert graph.graph_runner is not None and graph.graph_runner.sizes == sorted(sizes)
    log = record_padding(graph)
    for k, v in eager.kv_caches:  # the eager runner is shared: start from a clean cache
        k.zero_()
        v.zero_()
    ref_prefill = eager.forward(seqs.prefill())
    torch.testing.assert_close(graph.forward(seqs.prefill()), ref_prefill, rtol=0, atol=0)
    assert log == []  # prefill never takes the padded path

    # Decoding the last prompt token again rewrites the same slot with the same values, so each
    # batch below starts from the same cache in both runners. Small after large and large after
    # small: stale rows of the static buffers must never matter.
    order = list(range(1, NUM_SEQS + 1)) + list(range(NUM_SEQS, 0, -1)) + [16, 1, 7, 13, 2, 9]
    rng = random.Random(1)
    for n in order:
        idx = sorted(rng.sample(range(NUM_SEQS), n))
        want = eager.forward(seqs.decode(idx))
        got = graph.forward(seqs.decode(idx))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"batch of {n}")
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    padded = {n: size for n, size in log}
    fits = [n for n in order if n <= max(sizes)]
    assert sorted(padded) == sorted(set(fits))  # every batch that fits went through the runner
    for n, size in padded.items():
        assert size == min(s for s in sizes if s >= n)
    assert any(size > n for n, size in padded.items())  # and padding really happened
    for a, b in zip(graph.kv_caches, eager.kv_caches):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_multi_step_greedy_decode_equals_eager(eager):
    """Real decoding: each step a different subset of sequences advances by its greedy token."""
    seqs = Seqs(seed=4)
    graph = make_runner(False, [1, 2, 4, 8])  # batches over 8 fall back to the eager path
    log = record_padding(graph)
    first = eager.forward(seqs.prefill()).argmax(-1).tolist()
    assert graph.forward(seqs.prefill()).argmax(-1).tolist() == first
    for seq, tok in zip(seqs.tokens, first):
        seq.append(tok)
    rng = random.Random(2)
    for step in range(30):
        n = rng.choice([1, 3, 5, 6, 8, 11, 16])
        idx = sorted(rng.sample(range(NUM_SEQS), n))
        batch = [BatchRequest([seqs.tokens[i][-1]], len(seqs.tokens[i]) - 1, seqs.tables[i]) for i in idx]
        want = eager.forward(batch)
        got = graph.forward(batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step}, batch of {n}")
        for i, tok in zip(idx, want.argmax(-1).tolist()):
            seqs.tokens[i].append(tok)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert any(size > n for n, size in log) and len(log) < 30  # padded steps and eager ones


@pytest.mark.parametrize("n", [1, 3, 5, 7, 13])
def test_padding_rows_never_write_the_kv_cache(eager, n):
    seqs = Seqs(seed=2)
    graph = make_runner(False, [2, 4, 8, 16])  # every n below is padded
    eager.forward(seqs.prefill())
    copy_caches(eager, graph)
    # Fill the null block with a sentinel: padding rows point at it, so a write would show.
    for k, v in graph.kv_caches:
        k[0].fill_(7.0)
        v[0].fill_(-7.0)
    before = [(k.clone(), v.clone()) for k, v in graph.kv_caches]
    idx = list(range(0, 2 * n, 2))[:n] if 2 * n <= NUM_SEQS else list(range(n))
    new_tokens = [1000 + i for i in idx]
    log = record_padding(graph)
    graph.forward(seqs.decode(idx, new_tokens))
    assert log and log[0][1] > n  # padded
    slots = torch.tensor([seqs.tables[i][len(seqs.tokens[i]) // BLOCK] * BLOCK + len(seqs.tokens[i]) % BLOCK
                          for i in idx])
    for (k0, v0), (k1, v1) in zip(before, graph.kv_caches):
        for old, new in ((k0, k1), (v0, v1)):
            old, new = old.flatten(0, 1), new.flatten(0, 1)  # [slots, heads, dim]
            changed = (old != new).any(dim=(1, 2)).nonzero().flatten()
            assert changed.tolist() == sorted(slots.tolist())


def test_engine_graph_runner_equals_eager():
    prompts = [[random.Random(s).randrange(100, 40000) for _ in range(3 + 5 * s)] for s in range(16)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for enforce_eager in (True, False):
        # Capture sizes up to 8: the 16 decodes run eagerly, then padded as requests finish.
        llm = tiny_llm(hf_config=UNTIED, enforce_eager=enforce_eager, cuda_graph_batch_sizes=[1, 2, 4, 8],
                       max_num_batched_tokens=64)
        try:
            runner = llm.parts.executor.runner
            assert (runner.graph_runner is None) == enforce_eager
            log = [] if enforce_eager else record_padding(runner)
            outs[enforce_eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()
    assert len({tuple(t) for t in outs[True]}) == len(prompts)
    assert outs[False] == outs[True]
    assert any(size > n for n, size in log)  # the padded path ran inside the engine
