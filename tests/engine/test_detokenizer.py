from engine.detokenizer import IncrementalDetokenizer
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
