"""Every engine app/ may be given implements engine.client.EngineClient, and every tokenizer it
exposes engine.client.TokenizerClient: each protocol member present, methods with a compatible
signature (same parameter names, kinds and defaults in the same order; extra parameters only
with a default) and async where the protocol's is. isinstance() with runtime_checkable would
only check that the names exist.

Also: the executors that split a step into submit / collect implement all four of them."""
from __future__ import annotations

import inspect

import pytest

from pagedserve.engine.client import EngineClient, TokenizerClient

P = inspect.Parameter


def protocol_members(protocol) -> tuple[list[str], list[str]]:
    """(data members, methods) the protocol declares."""
    methods = [n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")]
    data = [n for n in protocol.__annotations__ if not n.startswith("_")]
    return data, methods


def has_member(obj, name: str) -> bool:
    """Declared on the instance or its class, without running a property (an engine that has not
    started has no core to compute ``embedding_size`` from)."""
    try:
        inspect.getattr_static(obj, name)
        return True
    except AttributeError:
        return False


def signature_problems(want, got) -> list[str]:
    """Why ``got`` (an implementation) cannot stand where ``want`` (the protocol's) is called."""
    problems = []
    if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(got):
        problems.append("async" if inspect.iscoroutinefunction(want) else "not async")
    w = [p for p in inspect.signature(want).parameters.values() if p.name != "self"]
    g = [p for p in inspect.signature(got).parameters.values() if p.name != "self"]
    g_by_name = {p.name: p for p in g}
    has_var_kw = any(p.kind is P.VAR_KEYWORD for p in g)
    positional = [p for p in g if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    for i, p in enumerate(x for x in w if x.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)):
        if i >= len(positional) or positional[i].name != p.name:
            problems.append(f"positional parameter {i} must be {p.name!r}")
            continue
        q = positional[i]
        if p.default is not P.empty and q.default != p.default:
            problems.append(f"{p.name}: default {q.default!r}, the protocol's is {p.default!r}")
    for p in w:
        if p.kind is P.KEYWORD_ONLY and p.name not in g_by_name and not has_var_kw:
            problems.append(f"keyword {p.name!r} missing")
        if p.kind is P.VAR_KEYWORD and not has_var_kw:
            problems.append(f"**{p.name} missing")
    names = {p.name for p in w}
    for q in g:
        if q.name not in names and q.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) and q.default is P.empty:
            problems.append(f"extra parameter {q.name!r} without a default")
    return problems


def conformance_problems(obj, protocol) -> list[str]:
    data, methods = protocol_members(protocol)
    problems = [f"{n}: missing" for n in data if not has_member(obj, n)]
    for n in methods:
        if not has_member(obj, n):
            problems.append(f"{n}(): missing")
            continue
        impl = getattr(obj, n)
        if not callable(impl):
            problems.append(f"{n}: not callable")
            continue
        problems += [f"{n}(): {p}" for p in signature_problems(getattr(protocol, n), impl)]
    return problems


def _async_engine():
    from pagedserve.engine.async_engine import AsyncEngine
    from tests.engine.fakes import make_config

    return AsyncEngine(make_config())


def _replicated_engine():
    from pagedserve.engine.replicas import ReplicatedEngine
    from tests.engine.fakes import make_config

    return ReplicatedEngine(make_config(), 2)


def _fake_engine():
    from tests.app.fake_engine import FakeAsyncEngine

    return FakeAsyncEngine()


def _pool_engine():
    from tests.app.test_prep_routes import PoolEngine

    return PoolEngine()


@pytest.mark.parametrize("build", [_async_engine, _replicated_engine, _fake_engine, _pool_engine],
                         ids=["AsyncEngine", "ReplicatedEngine", "FakeAsyncEngine", "PoolEngine"])
def test_engine_implements_engine_client(build):
    assert conformance_problems(build(), EngineClient) == []


def _real_tokenizer():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    from pagedserve.engine.tokenizer import Tokenizer, _Specials

    backend = HFTokenizer(WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    return Tokenizer(backend, _Specials(), None, "test")


def _engine_fake_tokenizer():
    from tests.engine.fakes import FakeTokenizer

    return FakeTokenizer()


def _app_fake_tokenizer():
    from tests.app.fake_engine import FakeTokenizer

    return FakeTokenizer()


@pytest.mark.parametrize("build", [_real_tokenizer, _engine_fake_tokenizer, _app_fake_tokenizer],
                         ids=["Tokenizer", "engine-fakes", "app-fake"])
def test_tokenizer_implements_tokenizer_client(build):
    assert conformance_problems(build(), TokenizerClient) == []


def test_the_checker_sees_a_wrong_signature():
    class Wrong:
        def decode(self, ids, skip_special_tokens=False):  # another default
            return ""

        async def encode(self, text):  # async, and add_special_tokens missing
            return []

    problems = conformance_problems(Wrong(), TokenizerClient)
    assert "decode(): skip_special_tokens: default False, the protocol's is True" in problems
    assert "encode(): not async" in problems
    assert "encode(): positional parameter 1 must be 'add_special_tokens'" in problems
    assert "vocab_size: missing" in problems and "token_bytes(): missing" in problems


def test_step_splitting_executors_implement_submit_and_collect():
    from pagedserve.gpu.executor import Executor, InprocExecutor
    from pagedserve.gpu.mp_executor import MultiprocExecutor
    from pagedserve.gpu.ray_call_executor import RayCallExecutor
    from pagedserve.gpu.ray_executor import RayRingExecutor

    assert not Executor.splits_steps and not InprocExecutor.splits_steps
    for cls in (MultiprocExecutor, RayRingExecutor, RayCallExecutor):
        assert cls.splits_steps, cls
        for name in ("submit", "collect", "submit_async", "collect_async", "max_in_flight"):
            assert getattr(cls, name) is not getattr(Executor, name), (cls, name)
            if name != "max_in_flight":
                assert signature_problems(getattr(Executor, name), getattr(cls, name)) == [], (cls, name)
