"""Beam search on the default model, fp32: the top beam equals transformers'
``generate(num_beams=k, do_sample=False)`` at a fixed length (ignore_eos; EOS is an ordinary
token on both sides), and the beams are ranked by cum_logprob / len ** length_penalty."""
from __future__ import annotations

import os

import pytest
import torch

from pagedserve.engine.sampling_params import BeamSearchParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hf_model(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(default_model_path), os.path.basename(default_model_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    return tok, model


@pytest.fixture(scope="module")
def llm(default_model_path):
    from pagedserve.engine.llm import LLM

    llm = LLM(default_model_path, dtype="float32", quantization="none", kv_cache_memory=0.25,
              enforce_eager=True)
    yield llm
    llm.shutdown()


def hf_beam(tok, model, prompt_ids: list[int], k: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, num_beams=k, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.eos_token_id or 0, length_penalty=1.0, early_stopping=False)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("k", [2, 4])
def test_top_beam_equals_transformers(llm, hf_model, k):
    tok, model = hf_model
    params = BeamSearchParams(beam_width=k, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        prompt_ids = llm.tokenizer.encode(prompt)
        want = hf_beam(tok, model, prompt_ids, k)
        best = out.sequences[0]
        assert len(out.sequences) == k
        assert best.output_tokens == want, f"{prompt!r}: ours {best.output_text!r} vs HF {tok.decode(want)!r}"
        assert best.tokens == prompt_ids + want
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        assert all(s.score == pytest.approx(s.cum_logprob / NEW_TOKENS) for s in out.sequences)


def test_eos_allowed_finished_beams_ranked_and_blocks_freed(llm):
    params = BeamSearchParams(beam_width=3, max_tokens=40, length_penalty=1.0)
    out = llm.beam_search([{"prompt": llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]), "add_special_tokens": False}], params)[0]
    seqs = out.sequences
    assert len(seqs) == 3 and seqs[0].finish_reason == "stop"
    assert "Paris" in seqs[0].output_text
    scores = [s.score for s in seqs]
    assert scores == sorted(scores, reverse=True)
    for s in seqs:
        assert s.score == pytest.approx(s.cum_logprob / len(s.output_tokens))
    bm = llm.core.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_out_of_vocabulary_stop_ids_beside_another_request_change_nothing(llm):
    """Issue 22 (security): tens of thousands of stop ids that cannot occur made a beam row ask
    for more logprobs than the vocabulary, and its candidates then included the next row's tokens
    and logprobs (another request's). The beams must be the same as without them, whatever runs
    beside them in the same steps."""
    from pagedserve.engine.sampling_params import SamplingParams

    vocab = llm.core.vocab_size
    ids = llm.tokenizer.encode(PROMPTS[2])
    base = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    want = [(s.output_tokens, round(s.cum_logprob, 4)) for s in llm.beam_search([ids], base)[0].sequences]
    hostile = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True,
                               stop_token_ids=list(range(vocab, vocab + 40_000)))
    llm.core.add_request("beam", None, ids, hostile)
    for i in range(3):  # neighbours after the beam rows, asking for logprobs too
        llm.core.add_request(f"n{i}", None, llm.tokenizer.encode(PROMPTS[i]),
                             SamplingParams(temperature=0.0, max_tokens=6, logprobs=5))
    out = llm._run(["beam", "n0", "n1", "n2"], use_tqdm=False)[0]
    assert llm.core.requests == {}
    assert [(o.token_ids, round(o.cumulative_logprob, 4)) for o in out.outputs] == want
