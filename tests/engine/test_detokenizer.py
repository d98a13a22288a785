from pagedserve.engine.detokenizer import IncrementalDetokenizer
from tests.engine.fakes import EOS, FakeTokenizer

tok = FakeTokenizer()


def feed(detok, ids, check_stop=True):
    """Feed ids one by one; returns (deltas, stop string or None)."""
    deltas = []
    for t in ids:
        stop = detok.add_token(t, check_stop)
        deltas.append(detok.take_delta())
        if stop is not None:
            return deltas, stop
    return deltas, None


def test_multibyte_split_across_tokens_never_broken():
    ids = tok.byte_ids("aé€😀b")  # 1 + 2 + 3 + 4 + 1 bytes
    d = IncrementalDetokenizer(tok, tok.encode("hi"))
    deltas, _ = feed(d, ids)
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == "aé€😀b"
    assert deltas[:3] == ["a", "", "é"]  # the first byte of é is held back
    assert deltas[-5:] == ["", "", "", "😀", "b"]


def test_incomplete_char_at_end_is_flushed_as_decode_would():
    d = IncrementalDetokenizer(tok, [5])
    deltas, _ = feed(d, tok.byte_ids("x") + tok.byte_ids("é")[:1])
    assert "".join(deltas) == "x"
    d.flush()
    assert d.take_delta() == "\ufffd"
    assert d.text == tok.decode(tok.byte_ids("x") + tok.byte_ids("é")[:1])


def test_special_tokens_skipped_or_kept():
    d = IncrementalDetokenizer(tok, [5], skip_special_tokens=True)
    assert "".join(feed(d, [tok.word(" hello"), EOS, tok.word("!")])[0]) == " hello!"
    d = IncrementalDetokenizer(tok, [5], skip_special_tokens=False)
    assert "".join(feed(d, [tok.word(" hello"), EOS])[0]) == " hello</s>"


def test_stop_string_across_tokens_held_back_then_cut():
    d = IncrementalDetokenizer(tok, [5], stop=["STOP"])
    deltas, stop = feed(d, tok.byte_ids("abST") + tok.byte_ids("OPzz"))
    assert stop == "STOP"
    assert deltas[:4] == ["a", "b", "", ""]  # "S", "ST" could begin the stop string
    assert "".join(deltas) == "ab" and d.text == "ab"
    # nothing is emitted after a stop
    assert d.add_token(tok.byte_ids("q")[0]) is None and d.take_delta() == ""
    d.flush()
    assert d.take_delta() == ""


def test_false_alarm_is_released():
    d = IncrementalDetokenizer(tok, [5], stop=["STOP"])
    deltas, stop = feed(d, tok.byte_ids("STOx!"))
    assert stop is None
    assert deltas == ["", "", "", "STOx", "!"]


def test_held_text_released_on_flush():
    d = IncrementalDetokenizer(tok, [5], stop=["STOP"])
    deltas, _ = feed(d, tok.byte_ids("aST"))
    assert "".join(deltas) == "a"
    d.flush()
    assert d.take_delta() == "ST"


def test_stop_string_at_very_start():
    d = IncrementalDetokenizer(tok, [5], stop=["STOP"])
    deltas, stop = feed(d, [tok.word("STOP"), tok.word(" hello")])
    assert stop == "STOP" and deltas == [""] and d.text == ""


def test_include_stop_str_in_output_and_text_after_stop_dropped():
    d = IncrementalDetokenizer(tok, [5], stop=["lo w"], include_stop_str_in_output=True)
    deltas, stop = feed(d, [tok.word(" hello"), tok.word(" world")])
    assert stop == "lo w"
    assert "".join(deltas) == " hello w"  # cut right after the stop string, "orld" never emitted


def test_earliest_of_several_stop_strings_wins():
    d = IncrementalDetokenizer(tok, [5], stop=["world", "o w"])
    _, stop = feed(d, [tok.word(" hello"), tok.word(" world")])
    assert stop == "o w" and d.text == " hell"


def test_stop_check_disabled_before_min_tokens():
    d = IncrementalDetokenizer(tok, [5], stop=["!"])
    deltas, stop = feed(d, [tok.word("!")], check_stop=False)
    assert stop is None
    _, stop = feed(d, tok.byte_ids("a!"))
    assert stop == "!" and d.text == "!a"


def test_multibyte_stop_string():
    d = IncrementalDetokenizer(tok, [5], stop=["é!"])
    deltas, stop = feed(d, tok.byte_ids("aé!b"))
    assert stop == "é!" and "".join(deltas) == "a"


# ---------------------------------------------------------------- many stop strings (issue 22)

import random  # noqa: E402

from pagedserve.engine.stop_matcher import StopMatcher  # noqa: E402
from tests.engine.detok_reference import ReferenceDetokenizer  # noqa: E402


def _trace(detok, ids, checks):
    out = []
    for t, check in zip(ids, checks):
        out.append((detok.add_token(t, check), detok.take_delta()))
        if detok.stopped:
            break
    detok.flush()
    out.append((detok.take_delta(), detok.text, detok.stopped))
    return out


def test_many_overlapping_stop_strings_equal_the_per_string_search():
    """The automaton gives exactly what trying every stop string gave: the earliest match wins,
    the first listed among those starting there; text that may begin one is held back; min_tokens
    (stop checks off, then on: a match already in the window is found); multi-byte characters and
    tokens that decode to several characters."""
    rng = random.Random(22)
    alphabet = "abé!"
    pieces = [tok.byte_ids(c) for c in alphabet] + [[tok.word(" hello")], [tok.word("ab")], [tok.word("é")]]
    for case in range(1500):
        stop = list(dict.fromkeys("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
                                  for _ in range(rng.randint(1, 12))))
        ids = [t for _ in range(rng.randint(1, 20)) for t in rng.choice(pieces)]
        off = rng.choice([0, 0, rng.randint(1, 8)])
        checks = [i >= off if rng.random() < 0.8 else rng.random() < 0.5 for i in range(len(ids))]
        include = rng.random() < 0.3
        kw = dict(stop=stop, include_stop_str_in_output=include)
        want = _trace(ReferenceDetokenizer(tok, [5], **kw), ids, checks)
        got = _trace(IncrementalDetokenizer(tok, [5], **kw), ids, checks)
        assert got == want, f"case {case}: {kw} ids {ids} checks {checks}"


class _CountedStr(str):
    """A stop string that counts every time Python code looks at it."""
    looks = 0

    def _count(name):
        def f(self, *a):
            _CountedStr.looks += 1
            return getattr(str, name)(self, *a)
        return f

    for _name in ("__len__", "__getitem__", "__iter__", "find", "rfind", "startswith", "endswith"):
        locals()[_name] = _count(_name)
    del _name


def test_a_token_examines_no_stop_string_once_the_matcher_is_built():
    """Issue 22: 40,000 stop strings froze the loop (every string tried at every token). The
    strings are read once, to build the automaton; a token then reads none of them."""
    stops = [_CountedStr(f"zq{i}x") for i in range(5000)] + [_CountedStr("STOP")]
    d = IncrementalDetokenizer(tok, [5], stop=stops)
    _CountedStr.looks = 0
    deltas, stop = feed(d, tok.byte_ids("hello zq12 world zq499 and zq4999") + [tok.word("STOP")])
    assert stop == "STOP" and "".join(deltas) == "hello zq12 world zq499 and zq4999"
    assert _CountedStr.looks <= 1  # the matched string's length, for the cut


def test_the_matcher_is_built_once_and_shared():
    stops = ["a", "bb", "ccc"]
    d1 = IncrementalDetokenizer(tok, [5], stop=list(stops))
    d2 = IncrementalDetokenizer(tok, [5], stop=list(stops))
    assert d1._matcher is d2._matcher
    m = StopMatcher.get(stops)
    assert IncrementalDetokenizer(tok, [5], stop=m)._matcher is m is d1._matcher


def test_n_choices_of_a_request_share_one_matcher():
    from pagedserve.engine.sampling_params import SamplingParams
    from tests.engine.fakes import make_core

    core, _ = make_core()
    core.add_request("r", None, [5, 6], SamplingParams(n=4, stop=[f"s{i}" for i in range(100)]))
    matchers = {id(s.detok._matcher) for s in core.requests["r"].seqs}
    assert len(matchers) == 1
