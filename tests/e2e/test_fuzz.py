"""Schemathesis fuzzes the published schema (GET /openapi.json) against a real server.

Stateless and property-based: for every operation it generates bodies that fit the schema
(positive) and bodies that break it (negative) and sends them to a `pagedserve serve` process
with a tiny random model. Every answer must be a status the schema documents, with the
documented body; never a 500, never a hang; a negative body must be refused with a 400 (the
schema is not stricter than the server), and a positive one is accepted unless a rule the
schema cannot state says no (the schema is not laxer than the server). The server must still
be healthy at the end.

The server runs with small limits so any generated request is bounded work: a context of
48 tokens bounds max_tokens, and past 8 waiting requests a wide n gets 503 + Retry-After.
PAGEDSERVE_FUZZ_EXAMPLES, PAGEDSERVE_FUZZ_SEED, PAGEDSERVE_FUZZ_FULL=1 and
PAGEDSERVE_FUZZ_SHRINK=1 make a longer, different or more readable run locally.
"""
from __future__ import annotations

import collections
import os
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.e2e.test_server_e2e import ServerProcess

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 48
MAX_WAITING = 8
SERVER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
               "--max-waiting-requests", str(MAX_WAITING), "--max-body-bytes", str(64 * 1024))
EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "25"))
SEED = int(os.environ.get("PAGEDSERVE_FUZZ_SEED", "20261123"))
FULL = os.environ.get("PAGEDSERVE_FUZZ_FULL") == "1"
# Shrinking a failure can take hypothesis five minutes per operation against a server; the
# report carries the failing request as a curl command anyway. PAGEDSERVE_FUZZ_SHRINK=1 shrinks.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + (
    [Phase.shrink] if os.environ.get("PAGEDSERVE_FUZZ_SHRINK") == "1" else [])
REQUEST_TIMEOUT_S = 120.0  # a loaded 2-core box (load 18) took >30 s for one request; a hang still fails

# 400s a schema-valid body may still get: rules across fields or against the running model
# that JSON Schema cannot state. Anything else refused with 400 means the schema is too lax.
SEMANTIC_400_PARAMS = {
    "best_of",  # must equal n
    "stream_options",  # only with stream: true
    "top_logprobs",  # only with logprobs: true
    "continue_final_message",  # not with add_generation_prompt; last message from the assistant
    "messages",  # the chat template refuses this conversation
    "input",  # /v1/responses: the chat template refuses it, or it holds no message (only reasoning items)
    "text.format",  # /v1/responses: the grammar engine must accept the schema
    "min_tokens",  # <= max_tokens
    "tool_choice",  # needs tools; "auto" needs --enable-auto-tool-choice; a named function in tools
    "tools",  # their parameters' $defs must agree; the grammar engine must accept the schemas
    "prompt_logprobs",  # not with stream: true
    # the grammar engine must accept the spec (a valid regex, a compilable grammar, a schema it enforces)
    "bad_words",  # each word must be non-empty
    "text_2",  # /score: one text on a side, or two lists of the same length
    "text_1",  # /score: a text the tokenizer reads as no token at all (control characters)
    "structured_outputs", "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
}
# constraints_unsatisfiable: allowed_token_ids / bad_words / min_tokens leave the structured output no token
# request_limit_exceeded: prompts x n past --max-request-choices, or the token commitment past
# --max-request-tokens (app/admission.py); each list's own bound is in the schema
# grammar_compile_timeout: a grammar the schema allows that compiles past --grammar-compile-timeout
SEMANTIC_400_CODES = {"context_length_exceeded", "constraints_unsatisfiable", "request_limit_exceeded",
                      "grammar_compile_timeout"}


@pytest.fixture(scope="module")
def fuzz_server():
    s = ServerProcess(*SERVER_ARGS)
    yield s
    assert s.stop() == 0, s.output()[-4000:]


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    # A body the schema refuses must be refused before anything else (not 404, never 5xx).
    config = SchemathesisConfig.from_dict({
        "seed": SEED, "checks": {"negative_data_rejection": {"expected-statuses": [400, 413, 415]}}})
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", config=config, timeout=10)


@pytest.fixture(scope="module")
def fuzz_log():
    """Every fuzz request's (operation, status); the last test reports and checks them."""
    return {"statuses": collections.Counter(), "n": 0, "t0": time.monotonic(), "request_s": 0.0,
            "slowest": (0.0, "")}


# ---- regressions found by the fuzzer (each failed before its fix) ----------------------------


def test_huge_logit_bias_token_id_is_a_400_not_an_engine_death(fuzz_server):
    # A token id past int64 could not be serialized to the workers: the engine loop died and
    # every later request got 503.
    r = httpx.post(fuzz_server.url + "/v1/completions", timeout=REQUEST_TIMEOUT_S,
                   json={"prompt": "hi", "max_tokens": 2, "logit_bias": {str(10**20): 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    # a stop id past the vocabulary that fits int64 is accepted and has no effect; a logit_bias
    # id past it is a 400, as in OpenAI and vLLM (issue 22)
    r = httpx.post(fuzz_server.url + "/v1/completions", timeout=REQUEST_TIMEOUT_S,
                   json={"prompt": "hi", "max_tokens": 2, "logit_bias": {str(10**17): 100}})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"], r.text
    r = httpx.post(fuzz_server.url + "/v1/completions", timeout=REQUEST_TIMEOUT_S,
                   json={"prompt": "hi", "max_tokens": 2, "min_tokens": 1, "stop_token_ids": [10**17]})
    assert r.status_code == 200, r.text
    assert httpx.get(fuzz_server.url + "/health").status_code == 200


def test_subnormal_repetition_penalty_is_a_400_not_a_failed_step(fuzz_server):
    # repetition_penalty 5e-324 (> 0, so it passed) divided logits into +inf; the sampler's
    # top-p histogram then indexed with NaN and the worker step failed: a 500 for this request
    # and for every request batched with it.
    r = httpx.post(fuzz_server.url + "/v1/completions", timeout=REQUEST_TIMEOUT_S,
                   json={"prompt": "0", "repetition_penalty": 5e-324, "top_p": 0.5, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
    assert httpx.get(fuzz_server.url + "/health").status_code == 200


# ---- the fuzz run ---------------------------------------------------------------------------

# (method, path, has a body): every operation of the document (checked below).
OPERATIONS = [
    ("POST", "/v1/completions", True), ("POST", "/v1/chat/completions", True), ("POST", "/v1/responses", True),
    ("POST", "/tokenize", True), ("POST", "/detokenize", True),
    ("POST", "/v1/embeddings", True), ("POST", "/v1/score", True), ("POST", "/score", True),
    ("GET", "/v1/models", False), ("GET", "/health", False), ("GET", "/version", False),
    ("GET", "/metrics", False), ("GET", "/ping", False), ("POST", "/ping", False),
]
CASES = [(m, p, mode) for m, p, body in OPERATIONS
         for mode in (("positive", "negative") if body else ("positive",))]


def test_the_served_document_lists_the_fuzzed_operations(api_schema):
    listed = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert listed == {(m, p) for m, p, _ in OPERATIONS}


# schemathesis.pytest.from_fixture cannot run under pytest 9 (it reads a removed private
# attribute), so each operation's strategy is drawn inside a plain hypothesis test.
@pytest.mark.parametrize("method, path, mode", CASES, ids=[f"{m} {p} {mode}" for m, p, mode in CASES])
def test_fuzz(api_schema, fuzz_server, fuzz_log, method, path, mode):
    strategy = api_schema[path][method].as_strategy(generation_mode=GenerationMode(mode))

    @seed(SEED)
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              database=None, print_blob=True, phases=PHASES)
    @given(case=strategy)
    def one(case):
        check_one(case, fuzz_server.url, fuzz_log)

    one()


def check_one(case, url: str, fuzz_log: dict) -> None:
    t0 = time.monotonic()
    response = case.call(base_url=url, timeout=REQUEST_TIMEOUT_S)
    took = time.monotonic() - t0
    status = response.status_code
    fuzz_log["n"] += 1
    fuzz_log["request_s"] += took
    fuzz_log["slowest"] = max(fuzz_log["slowest"], (took, case.as_curl_command()[:300]))
    fuzz_log["statuses"][f"{case.operation.label} {status}"] += 1
    assert status < 500 or status == 503, (
        f"{status} for {case.as_curl_command()}\n{response.text[:2000]}")
    case.validate_response(response, checks=[
        status_code_conformance, content_type_conformance, response_headers_conformance,
        response_schema_conformance, negative_data_rejection])
    if not case.meta.generation.mode.is_negative and status == 400:
        err = response.json()["error"]
        beam_rule = isinstance(case.body, dict) and case.body.get("use_beam_search") is True and (
            err["message"].endswith("cannot be combined with use_beam_search"))  # app/beam_requests.py
        assert err["param"] in SEMANTIC_400_PARAMS or err["code"] in SEMANTIC_400_CODES or beam_rule, (
            f"a body the schema allows was refused (the schema is laxer than the server): "
            f"{err}\n{case.as_curl_command()}")
    if status == 503:
        assert response.headers.get("retry-after") or response.json()["error"]["code"] != "overloaded"


# The coverage phase: schemathesis' deterministic boundary cases (n = 0 and 129, a missing
# required field, each wrong type, ...) and every other HTTP method. On the generating routes
# only the negative ones by default: they are cheap (refused before the engine) and find where
# the schema's edges are; the ~300 positive ones each generate (PAGEDSERVE_FUZZ_FULL=1 adds
# them: about 2.5 minutes here).
@pytest.mark.parametrize("method, path", [(m, p) for m, p, body in OPERATIONS if body])
def test_coverage_boundaries(api_schema, fuzz_server, fuzz_log, method, path):
    op = api_schema[path][method]
    modes = list(GenerationMode)
    if path in ("/v1/completions", "/v1/chat/completions", "/v1/responses") and not FULL:
        modes = [GenerationMode.NEGATIVE]
    cases = api_schema.iter_coverage_cases(
        op, generation_modes=modes,
        generation_config=api_schema.config.generation_for(operation=op))
    n = 0
    for case in cases:
        n += 1
        if case.method.upper() != method:
            response = case.call(base_url=fuzz_server.url, timeout=REQUEST_TIMEOUT_S)
            fuzz_log["n"] += 1
            fuzz_log["statuses"][f"{case.method.upper()} {path} {response.status_code}"] += 1
            assert response.status_code == 405 and response.headers.get("allow"), case.as_curl_command()
            continue
        check_one(case, fuzz_server.url, fuzz_log)
    assert n > 10


def test_server_healthy_after_fuzz(fuzz_server, fuzz_log):
    elapsed = time.monotonic() - fuzz_log["t0"]
    print(f"\nfuzz: {fuzz_log['n']} requests in {elapsed:.1f} s (seed {SEED}, {EXAMPLES} examples "
          f"per operation); {fuzz_log['request_s']:.1f} s waiting for the server, slowest "
          f"{fuzz_log['slowest'][0]:.2f} s: {fuzz_log['slowest'][1]}")
    for key, count in sorted(fuzz_log["statuses"].items()):
        print(f"  {key}: {count}")
    assert fuzz_log["n"] >= 8, "the fuzzer sent (almost) nothing"
    assert httpx.get(fuzz_server.url + "/health", timeout=5).status_code == 200
    r = httpx.post(fuzz_server.url + "/v1/completions", timeout=REQUEST_TIMEOUT_S,
                   json={"prompt": "still serving", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
