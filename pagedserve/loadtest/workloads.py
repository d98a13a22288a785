"""Workloads shared by bench.py and locustfile.py.

A workload is a list of :class:`SampleRequest` (prompt text, the prompt length the
server's tokenizer should see, and the number of tokens to ask for). Prompts are built
against a tokenizer so the lengths are real for the server under test: a local one
(``--tokenizer`` path), the server's own ``POST /tokenize`` + ``/detokenize`` (ours and
vLLM both have them), or, when neither is available, an approximate word-based one.
"""
from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Protocol

import httpx

logger = logging.getLogger(__name__)

# Plain English words: the random workload samples token ids from what these tokenize
# to, so decoding stays valid UTF-8 and re-tokenizing is stable for any tokenizer.
_WORDS = """
time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work
government number night point home water room mother area money story fact month lot
right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea
kid body information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher force
education foot boy age policy process music market sense nation plan college interest
death experience effect use class control care field development role effort rate heart
drug show leader light voice wife police mind price report decision son view relationship
town road arm difference value building action model season society tax director
position player record paper space ground form event official matter center couple site
project activity star table need court oil situation cost industry figure street image
phone data picture practice piece land product doctor wall patient worker news test
movie north love support technology step baby computer type attention film tree source
organization hair window evidence population truth song energy river garden bridge
quickly slowly green blue yellow purple orange silver golden ancient modern simple
complex bright dark quiet loud gentle rough smooth sharp heavy light warm cold fresh
run walk jump swim read write build carry follow answer listen learn teach grow open
close begin finish travel measure compute remember imagine explain describe discover
one two three four five six seven eight nine ten hundred thousand million first second
""".split()


class TokenizerLike(Protocol):
    """What a workload needs from a tokenizer: text <-> ids without special tokens."""

    source: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens the tokenizer sees for `prompt` (+ system_prompt), no special tokens
    output_len: int  # max_tokens to request
    system_prompt: str | None = None  # shared-prefix workload: the long common part

    def completion_prompt(self) -> str:
        return (self.system_prompt or "") + self.prompt

    def chat_messages(self) -> list[dict]:
        messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": self.prompt})
        return messages


# --------------------------------------------------------------------------- tokenizers


class LocalTokenizer:
    """A tokenizer file on disk: a GGUF file, a tokenizer.json, or a HF tokenizer directory."""

    def __init__(self, path: str):
        self.source = f"local:{path}"
        self._tok = None
        self._hf = None
        if path.endswith(".gguf"):
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(
                os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
            )
        else:
            tj = path if path.endswith(".json") else os.path.join(path, "tokenizer.json")
            if os.path.isfile(tj):
                from tokenizers import Tokenizer

                self._tok = Tokenizer.from_file(tj)
            else:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str) -> list[int]:
        if self._tok is not None:
            return self._tok.encode(text, add_special_tokens=False).ids
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self._tok is not None:
            return self._tok.decode(ids, skip_special_tokens=True)
        return self._hf.decode(ids, skip_special_tokens=True)


class ServerTokenizer:
    """The server's own tokenizer through vLLM-style ``POST /tokenize`` and ``/detokenize``."""

    def __init__(self, base_url: str, model: str | None, headers: dict | None = None, timeout: float = 30.0):
        self.source = f"server:{base_url.rstrip('/')}/tokenize"
        self._model = model
        self._client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers or {}, timeout=timeout)

    @classmethod
    def probe(cls, base_url: str, model: str | None, headers: dict | None = None) -> "ServerTokenizer | None":
        """Return a ServerTokenizer if the server answers /tokenize and /detokenize sensibly."""
        tok = cls(base_url, model, headers)
        try:
            ids = tok.encode("hello world")
            if not ids or "hello" not in tok.decode(ids):
                raise ValueError("round trip failed")
            return tok
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            logger.debug("server tokenizer unavailable at %s: %s", base_url, e)
            tok.close()
            return None

    def _post(self, path: str, body: dict) -> dict:
        if self._model:
            body["model"] = self._model
        r = self._client.post(path, json=body)
        if r.status_code != 200:
            raise ValueError(f"{path} returned {r.status_code}: {r.text[:200]}")
        return r.json()

    def encode(self, text: str) -> list[int]:
        out = self._post("/tokenize", {"prompt": text, "add_special_tokens": False})
        return [int(t) for t in out["tokens"]]

    def decode(self, ids: list[int]) -> str:
        out = self._post("/detokenize", {"tokens": list(ids)})
        return str(out["prompt"])

    def close(self) -> None:
        self._client.close()


class ApproxTokenizer:
    """Fallback when no real tokenizer is reachable: one word ~ one token. Lengths are approximate."""

    source = "approximate (1 word ~ 1 token)"

    def encode(self, text: str) -> list[int]:
        return [_WORD_INDEX.get(w, len(_WORDS)) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(_WORDS[i % len(_WORDS)] for i in ids)


_WORD_INDEX = {w: i for i, w in enumerate(_WORDS)}


def load_tokenizer(
    path: str | None, base_url: str | None = None, model: str | None = None, headers: dict | None = None
) -> TokenizerLike:
    """A local tokenizer if `path` is given, else the server's, else the approximate fallback."""
    if path:
        return LocalTokenizer(path)
    if base_url:
        tok = ServerTokenizer.probe(base_url, model, headers)
        if tok is not None:
            return tok
        logger.warning(
            "%s has no usable /tokenize endpoint and no --tokenizer was given: prompt lengths are "
            "APPROXIMATE (one word ~ one token)", base_url,
        )
    return ApproxTokenizer()


# --------------------------------------------------------------------------- prompt building


def _token_pool(tokenizer: TokenizerLike) -> list[int]:
    """Distinct token ids of plain words (with a leading space so they join cleanly)."""
    ids: set[int] = set()
    chunk = 64
    for i in range(0, len(_WORDS), chunk):
        ids.update(tokenizer.encode(" " + " ".join(_WORDS[i : i + chunk])))
    return sorted(ids)


def make_prompt(tokenizer: TokenizerLike, pool: list[int], length: int, rng: random.Random) -> tuple[str, int]:
    """Random token ids -> text whose re-tokenization has `length` tokens (±1 at worst).

    Decoding and re-encoding can merge or split tokens at the seams, so the text is
    re-tokenized and trimmed or extended until the count lands on the target.
    """
    if length <= 0:
        return "", 0
    ids = [rng.choice(pool) for _ in range(length)]
    text = tokenizer.decode(ids)
    best_text, best_n = text, None
    for _ in range(8):
        enc = tokenizer.encode(text)
        n = len(enc)
        if best_n is None or abs(n - length) < abs(best_n - length):
            best_text, best_n = text, n
        if n == length:
            break
        if n > length:
            text = tokenizer.decode(enc[:length])
        else:
            text = tokenizer.decode(enc + [rng.choice(pool) for _ in range(length - n)])
    return best_text, int(best_n or 0)


def _sample_len(mean: int, range_ratio: float, rng: random.Random) -> int:
    """Uniform in [mean*(1-r), mean*(1+r)], at least 1 (range ratio as in vllm bench)."""
    if range_ratio <= 0:
        return max(1, mean)
    lo = max(1, int(mean * (1 - range_ratio)))
    hi = max(lo, int(mean * (1 + range_ratio)))
    return rng.randint(lo, hi)


def random_requests(
    tokenizer: TokenizerLike,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    rng = random.Random(seed)
    pool = _token_pool(tokenizer)
    out = []
    for _ in range(num_prompts):
        target = _sample_len(input_len, range_ratio, rng)
        text, n = make_prompt(tokenizer, pool, target, rng)
        out.append(SampleRequest(prompt=text, prompt_len=n, output_len=_sample_len(output_len, range_ratio, rng)))
    return out


def prefix_requests(
    tokenizer: TokenizerLike,
    num_prompts: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Many requests sharing one long prefix (a system prompt for chat), each with its own suffix."""
    rng = random.Random(seed)
    pool = _token_pool(tokenizer)
    prefix, _ = make_prompt(tokenizer, pool, prefix_len, rng)
    out = []
    for _ in range(num_prompts):
        target = _sample_len(input_len, range_ratio, rng)
        text, _ = make_prompt(tokenizer, pool, target, rng)
        # A separator keeps the suffix from merging with the prefix's last token; the length
        # is what the tokenizer sees for the whole completion prompt.
        out.append(
            SampleRequest(
                prompt="\n" + text,
                prompt_len=len(tokenizer.encode(prefix + "\n" + text)),
                output_len=_sample_len(output_len, range_ratio, rng),
                system_prompt=prefix,
            )
        )
    return out


def sharegpt_requests(
    tokenizer: TokenizerLike,
    path: str,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[SampleRequest]:
    """First human turn of ShareGPT-style conversations; output length = the reply's length
    (or `output_len`). Filters like vllm bench: drop too short (<4) or too long pairs."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    rng = random.Random(seed)
    convs = [d for d in data if isinstance(d, dict) and len(d.get("conversations", [])) >= 2]
    rng.shuffle(convs)
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) >= num_prompts:
            break
        turns = conv["conversations"]
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        p_len = len(tokenizer.encode(prompt))
        o_len = output_len if output_len else len(tokenizer.encode(reply))
        if p_len < 4 or (output_len is None and o_len < 4):
            continue
        if p_len > max_prompt_len or p_len + o_len > max_total_len:
            continue
        out.append(SampleRequest(prompt=prompt, prompt_len=p_len, output_len=o_len))
    if len(out) < num_prompts:
        logger.warning("%s gave only %d usable conversations of %d asked", path, len(out), num_prompts)
    return out


# The "quote" workload: the answer quotes the prompt (repeat a passage, edit code given in full),
# where prompt-lookup speculative decoding pays off. Passages written for this benchmark.
QUOTE_PASSAGES = [
    "The river town wakes before the sun. Bakers light their ovens, fishermen check their nets, and the "
    "first bus rolls down the hill with its lights still on. By seven the market square is full of voices, "
    "and by nine the bells of the old church have rung twice.",
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError(\"window must be positive\")\n"
    "    out = []\n    total = 0.0\n    for i, v in enumerate(values):\n        total += v\n"
    "        if i >= window:\n            total -= values[i - window]\n"
    "        out.append(total / min(i + 1, window))\n    return out\n",
    "Dear team, the quarterly review will take place on Thursday at ten in room four. Please bring your "
    "project notes, the updated budget sheet and a short list of risks for the next quarter. Lunch will be "
    "served after the meeting.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def is_empty(self):\n        return not self.items\n",
    "To reset the device, hold the power button for ten seconds until the light blinks twice. Release the "
    "button, wait for the light to turn green, then connect the cable again. If the light stays red, repeat "
    "the steps once more before calling support.",
    "SELECT customer_id, COUNT(*) AS orders, SUM(total) AS spent\nFROM orders\nWHERE created_at >= "
    "'2024-01-01'\nGROUP BY customer_id\nHAVING COUNT(*) > 3\nORDER BY spent DESC\nLIMIT 20;\n",
]
QUOTE_INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:\n\n",
    "Copy this text back to me without changing anything:\n\n",
]


def quote_requests(tokenizer: TokenizerLike, num_prompts: int, output_len: int, seed: int = 0) -> list[SampleRequest]:
    """Chat requests whose answer quotes the prompt: an instruction to repeat one passage."""
    rng = random.Random(seed)
    out = []
    for i in range(num_prompts):
        prompt = rng.choice(QUOTE_INSTRUCTIONS) + QUOTE_PASSAGES[i % len(QUOTE_PASSAGES)]
        out.append(SampleRequest(prompt=prompt, prompt_len=len(tokenizer.encode(prompt)), output_len=output_len))
    return out


def build_requests(
    dataset_name: str,
    tokenizer: TokenizerLike,
    num_prompts: int,
    *,
    input_len: int = 256,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 512,
    dataset_path: str | None = None,
    sharegpt_output_len: int | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    if dataset_name == "random":
        return random_requests(tokenizer, num_prompts, input_len, output_len, range_ratio, seed)
    if dataset_name == "prefix":
        return prefix_requests(tokenizer, num_prompts, prefix_len, input_len, output_len, range_ratio, seed)
    if dataset_name == "quote":
        return quote_requests(tokenizer, num_prompts, output_len, seed)
    if dataset_name == "sharegpt":
        if not dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
        return sharegpt_requests(tokenizer, dataset_path, num_prompts, seed, sharegpt_output_len)
    raise ValueError(f"unknown dataset {dataset_name!r}: use random, sharegpt, prefix or quote")
