"""Test doubles for the engine: a byte-level tokenizer and an executor that mirrors the worker.

FakeExecutor keeps the worker's per-sequence state exactly as contracts/messages.py describes, writes
(token, position) into a fake paged KV cache at ``table[t // B] * B + t % B`` and, before a
sequence samples, checks that its whole context is in the cache at the right slots (so a wrong
prefix-cache hit, a lost block or a bad preemption shows up as an assertion).
"""
from __future__ import annotations

from pagedserve.contracts.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.contracts.messages import SampledLogprobs, StepInput, StepOutput
from pagedserve.gpu.executor import Executor
from pagedserve.gpu.spec_verify import draft_slices, num_accepted
from pagedserve.gpu.worker import decode_step, encode_step

PAD, BOS, EOS = 0, 1, 2
BYTE0 = 3  # ids 3..258 are the bytes 0..255
WORDS = [" hello", " world", "STOP", "ab", "é", "!", " the", "\n"]
WORD0 = BYTE0 + 256
VOCAB = WORD0 + len(WORDS)


class FakeTokenizer:
    eos_token_ids = [EOS]
    bos_token_id = BOS
    all_special_ids = {PAD, BOS, EOS}
    vocab_size = VOCAB
    chat_template = None
    max_token_chars = None  # no bound on a text prompt's length before it is tokenized
    _special_text = {PAD: "<pad>", BOS: "<s>", EOS: "</s>"}

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        if token_id in self._special_text:
            return b"" if skip_special_tokens else self._special_text[token_id].encode()
        if BYTE0 <= token_id < WORD0:
            return bytes([token_id - BYTE0])
        return WORDS[token_id - WORD0].encode()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decode_calls = getattr(self, "decode_calls", 0) + 1
        return b"".join(self.token_bytes(t, skip_special_tokens) for t in ids).decode("utf-8", errors="replace")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [BYTE0 + b for b in text.encode()]

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.decode([i], skip_special_tokens=False) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return None

    def word(self, w: str) -> int:
        return WORD0 + WORDS.index(w)

    def byte_ids(self, s: str) -> list[int]:
        return [BYTE0 + b for b in s.encode()]


def default_next_token(tokens: list[int], options, num_prompt: int) -> int:
    """Deterministic 'model': a function of the sequence's tokens (and seed when sampling)."""
    key = tuple(tokens) if options.temperature == 0 else (options.seed, tuple(tokens))
    return BYTE0 + 32 + hash(key) % 90  # printable ASCII, never EOS


class _WorkerSeq:
    __slots__ = ("token_ids", "num_prompt", "computed", "table", "options")

    def __init__(self, ns):
        self.token_ids = list(ns.token_ids)
        self.num_prompt = ns.num_prompt_tokens
        self.computed = ns.num_computed_tokens
        self.table = list(ns.block_ids)
        self.options = ns.sampling


class FakeExecutor(Executor):
    def __init__(self, num_blocks: int, block_size: int, next_token=default_next_token, num_swap_blocks: int = 0,
                 top_logprobs=None):
        """``top_logprobs(tokens, options, num_prompt) -> [(token, logprob)]`` best first: when
        given, a sequence asking for logprobs gets them from it and samples their first token
        (a greedy model with real alternatives, for beam search)."""
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        self.host_kv: dict[tuple[int, int], tuple[int, int]] = {}  # (host block, offset) -> (token, position)
        self.block_size = block_size
        self.next_token = next_token
        self.top_logprobs = top_logprobs
        self.num_copied_blocks = 0
        self.seqs: dict[int, _WorkerSeq] = {}
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (token id, position)
        self.steps: list[StepInput] = []
        self.error: str | None = None  # set to make the next step fail
        self.num_verified: list[tuple[int, int]] = []  # (drafts, accepted) of each verified row

    def slot(self, s: _WorkerSeq, t: int) -> int:
        B = self.block_size
        block = s.table[t // B]
        assert block != 0, "a token was placed in the null block"
        return block * B + t % B

    def execute(self, step: StepInput) -> StepOutput:
        # What the multi-process executor does: the step must survive msgpack unchanged.
        wire = decode_step(encode_step(step))  # StepEncodeError as there
        assert wire == step, "the step changed through msgpack"
        step = wire
        self.steps.append(step)
        self._swap(step)
        for sid in step.finished_seq_ids:
            assert sid in self.seqs, f"finished id {sid} unknown to the worker"
            del self.seqs[sid]
        B = self.block_size
        for src, dst in step.blocks_to_copy:  # copy-on-write, before the new seqs (contracts/messages.py)
            assert src != dst and 0 not in (src, dst)
            for t in range(B):
                if src * B + t in self.kv:
                    self.kv[dst * B + t] = self.kv[src * B + t]
                else:
                    self.kv.pop(dst * B + t, None)
            self.num_copied_blocks += 1
        for ns in step.new_seqs:
            assert ns.seq_id not in self.seqs, f"seq {ns.seq_id} registered twice"
            s = _WorkerSeq(ns)
            assert s.computed < len(s.token_ids)
            for t in range(s.computed):  # a prefix-cache hit must point at the right K/V
                assert self.kv.get(self.slot(s, t)) == (s.token_ids[t], t), f"bad cached prefix at {t}"
            self.seqs[ns.seq_id] = s
        assert len(step.seq_ids) == len(step.num_new_tokens)
        assert len(step.new_block_seqs) == len(step.new_block_ids)
        pair_seqs = list(step.new_block_seqs)
        assert pair_seqs == sorted(pair_seqs), "block pairs must be in batch order"
        assert all(0 <= i < len(step.seq_ids) for i in pair_seqs)
        assert len(set(step.seq_ids)) == len(step.seq_ids)
        decode_flags = [n == 1 for n in step.num_new_tokens]
        assert decode_flags == sorted(decode_flags, reverse=True), "decodes must come first"
        if self.error is not None:
            err, self.error = self.error, None
            return StepOutput(step.step_id, error=err)
        owners: dict[int, int] = {}
        for sid, s in self.seqs.items():
            for b in s.table:
                owners[b] = owners.get(b, 0) + 1
        for b in step.new_block_ids:
            owners[b] = owners.get(b, 0) + 1
        for i, b in zip(step.new_block_seqs, step.new_block_ids):
            self.seqs[step.seq_ids[i]].table.append(b)
        out_ids, out_tokens, out_lps = [], [], []
        any_lp = False
        drafts = draft_slices(step)
        counts: list[int] = []  # tokens per sampling sequence (speculative decoding)
        for idx, (sid, n) in enumerate(zip(step.seq_ids, step.num_new_tokens)):
            s = self.seqs[sid]
            if drafts is not None and drafts[idx]:
                self._verify(s, sid, n, drafts[idx], owners, out_ids, out_tokens, out_lps, counts)
                any_lp = any_lp or s.options.logprobs is not None
                continue
            assert n >= 1 and s.computed + n <= len(s.token_ids), (sid, n, s.computed, len(s.token_ids))
            assert len(s.table) * self.block_size >= s.computed + n, "block table too short"
            for t in range(s.computed, s.computed + n):
                block = s.table[t // self.block_size]
                assert owners[block] == 1, f"write into block {block} shared by {owners[block]} seqs"
                self.kv[self.slot(s, t)] = (s.token_ids[t], t)
            s.computed += n
            if s.computed == len(s.token_ids):
                for t in range(len(s.token_ids)):
                    assert self.kv.get(self.slot(s, t)) == (s.token_ids[t], t), f"seq {sid}: bad K/V at {t}"
                top = None
                if self.top_logprobs is not None and s.options.logprobs is not None:
                    top = self.top_logprobs(s.token_ids, s.options, s.num_prompt)
                    tok = top[0][0]
                else:
                    tok = self.next_token(s.token_ids, s.options, s.num_prompt)
                generated = len(s.token_ids) - s.num_prompt
                if generated < s.options.min_tokens and tok in s.options.min_tokens_blocked_ids:
                    tok = BYTE0 + ord("x")
                s.token_ids.append(tok)
                out_ids.append(sid)
                out_tokens.append(tok)
                counts.append(1)
                if s.options.logprobs is not None and top is not None:
                    any_lp = True
                    out_lps.append(SampledLogprobs(top[0][1], list(top[: s.options.logprobs])))
                elif s.options.logprobs is not None:
                    any_lp = True
                    top = [(tok, -0.25), (BYTE0 + ord("y"), -1.5)][: s.options.logprobs]
                    out_lps.append(SampledLogprobs(-0.25, top))
                else:
                    out_lps.append(None)
        return StepOutput.pack(step.step_id, out_ids, out_tokens, logprobs=out_lps if any_lp else None,
                               num_tokens=counts if drafts is not None else None)

    def _verify(self, s, sid, n, drafts, owners, out_ids, out_tokens, out_lps, counts) -> None:
        """A decode with drafts (contracts/messages.py step 4b): write the K/V of its last token and
        of each draft, sample every position with the 'model', keep the accepted prefix plus one."""
        B = self.block_size
        assert n == 1 + len(drafts) and s.computed + 1 == len(s.token_ids), (sid, n, s.computed, len(s.token_ids))
        assert len(s.table) * B >= s.computed + n, "block table too short for the drafts"
        tokens = s.token_ids + drafts
        for t in range(s.computed, s.computed + n):
            block = s.table[t // B]
            assert owners[block] == 1, f"write into block {block} shared by {owners[block]} seqs"
            self.kv[self.slot(s, t)] = (tokens[t], t)
        for t in range(len(tokens)):
            assert self.kv.get(self.slot(s, t)) == (tokens[t], t), f"seq {sid}: bad K/V at {t}"
        sampled = [self.next_token(tokens[:len(s.token_ids) + j], s.options, s.num_prompt)
                   for j in range(len(drafts) + 1)]
        a = num_accepted(sampled, drafts)
        kept = sampled[:a + 1]
        s.token_ids.extend(kept)
        s.computed += 1 + a
        del s.table[-(-len(s.token_ids) // B):]
        self.num_verified.append((len(drafts), a))
        out_ids.append(sid)
        out_tokens.extend(kept)
        counts.append(a + 1)
        for tok in kept:
            out_lps.append(SampledLogprobs(-0.25, [(tok, -0.25)]) if s.options.logprobs is not None else None)

    def _swap(self, step: StepInput) -> None:
        """Swap-outs (device -> host) then swap-ins (host -> device), before anything else."""
        B = self.block_size
        out_hosts = [h for _, h in step.blocks_to_swap_out]
        in_devs = [d for _, d in step.blocks_to_swap_in]
        assert len(set(out_hosts)) == len(out_hosts), "two swap-outs into one host block"
        assert len(set(in_devs)) == len(in_devs), "two swap-ins into one device block"
        for dev, host in step.blocks_to_swap_out:
            assert 0 < dev < self.num_blocks and 0 <= host < self.num_swap_blocks, (dev, host)
            for o in range(B):
                self._copy(self.kv, dev * B + o, self.host_kv, (host, o))
        for host, dev in step.blocks_to_swap_in:
            assert 0 < dev < self.num_blocks and 0 <= host < self.num_swap_blocks, (dev, host)
            for o in range(B):
                self._copy(self.host_kv, (host, o), self.kv, dev * B + o)

    @staticmethod
    def _copy(src: dict, src_key, dst: dict, dst_key) -> None:
        value = src.get(src_key)
        if value is None:
            dst.pop(dst_key, None)
        else:
            dst[dst_key] = value

    async def execute_async(self, step):
        return self.execute(step)

    def shutdown(self):
        pass

    def check_health(self):
        pass

    async def check_health_async(self):
        self.check_health()


def make_config(num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 64,
                max_num_seqs: int = 16, max_model_len: int = 256, policy: str = "fcfs",
                prefix_caching: bool = True, preemption_mode: str = "recompute",
                num_swap_blocks: int | None = None, speculative: dict | None = None) -> EngineConfig:
    from pagedserve.contracts.config import SpeculativeConfig

    return EngineConfig(
        model=ModelConfig(max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks, enable_prefix_caching=prefix_caching,
                          num_swap_blocks=num_swap_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  policy=policy, preemption_mode=preemption_mode),
        speculative=SpeculativeConfig.from_option(speculative),
    )


def make_core(next_token=default_next_token, top_logprobs=None, **kw):
    from pagedserve.engine.core import EngineCore

    config = make_config(**kw)
    executor = FakeExecutor(config.cache.num_gpu_blocks_override, config.cache.block_size, next_token,
                            num_swap_blocks=config.cache.num_swap_blocks or 0, top_logprobs=top_logprobs)
    return EngineCore(config, executor, FakeTokenizer()), executor


def run_to_completion(core, max_steps: int = 10_000, check=None) -> dict:
    """Step until idle; returns request id -> merged RequestOutput."""
    from pagedserve.engine.outputs import merge_delta

    results = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            break
        for d in core.step():
            results[d.request_id] = d if d.request_id not in results else merge_delta(results[d.request_id], d)
        if check is not None:
            check(core)
    else:
        raise AssertionError("the engine did not finish")
    return results
