"""IncrementalDetokenizer: streamed text equals the full decode, whole characters only, stop strings."""

import pytest

from mmjax.data.tokenizer import Tokenizer, train_bpe_tokenizer
from mmjax.serving.detokenize import MAX_PENDING_TOKENS, IncrementalDetokenizer

TEXT = "héllo 世界 🙂 naïve café, 日本語のテキスト 🚀🎉 done. STOP here"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    # a tiny vocab keeps most multi-byte characters split across several byte tokens
    corpus = ["hello world, the quick brown fox jumps over the lazy dog. done. STOP here"] * 20
    return Tokenizer.from_file(train_bpe_tokenizer(corpus, 300, tmp_path_factory.mktemp("tok")))


def stream(tok, ids, prompt=(1,), **kw):
    d = IncrementalDetokenizer(tok, list(prompt), **kw)
    pieces = [d.push(i) for i in ids]
    pieces.append(d.flush())
    return d, pieces


def test_multibyte_stream_is_full_decode_without_replacement_chars(tok):
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    # some token ends inside a character, or this test would not exercise the hold-back
    assert any("\ufffd" in tok.decode(ids[:n]) for n in range(1, len(ids)))
    d, pieces = stream(tok, ids, prompt=tok.encode("prompt 世"))
    assert "".join(pieces) == TEXT == d.text
    assert not any("\ufffd" in p for p in pieces)
    assert not d.stopped


def test_window_stays_bounded(tok):
    d = IncrementalDetokenizer(tok, [1])
    for i in tok.encode(TEXT * 20):
        d.push(i)
        # context (the last decoded chunk) + pending tokens only, never the whole output
        assert len(d._ids) <= 2 * (MAX_PENDING_TOKENS + 1)
    assert d.text == TEXT * 20


def test_eos_in_prompt_and_output_hides_no_text(tok):
    prompt = [*tok.encode("hi"), tok.eos_id, tok.user_id]
    ids = tok.encode("ab") + [tok.eos_id] + tok.encode("cd")  # ignore_eos: generation went on
    d, pieces = stream(tok, ids, prompt=prompt)
    assert "".join(pieces) == "abcd"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tok, include):
    ids = tok.encode(TEXT)
    d, pieces = stream(tok, ids, stop=["STOP"], include_stop_str=include)
    expected = TEXT[:TEXT.index("STOP")] + ("STOP" if include else "")
    assert d.stopped and d.stop_str == "STOP"
    assert "".join(pieces) == expected == d.text
    assert not any("S" in p for p in pieces[:-1] if not include)  # no partial stop string ever streamed
    assert d.push(ids[0]) == ""  # tokens after the stop are ignored


def test_partial_stop_held_then_released(tok):
    text = "done. STOrm STOP"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [1], stop=["STOP"])
    seen, held = "", set()
    for i in ids:
        seen += d.push(i)
        # whatever was streamed never ends with a proper prefix of the stop string; that tail is held back
        assert not any(seen.endswith("STOP"[:n]) for n in range(1, 4))
        assert d.text.startswith(seen)
        held.add(d.text[len(seen):])
        if d.stopped:
            break
    assert "STO" in held  # "STO" of "STOrm" was held, then released once "r" ruled the stop out
    assert seen == "done. STOrm " == d.text and d.stopped


def test_partial_stop_at_end_is_flushed(tok):
    d = IncrementalDetokenizer(tok, [1], stop=["STOP here"])
    out = "".join(d.push(i) for i in tok.encode("done. STOP"))
    assert out == "done. " and not d.stopped
    assert d.flush() == "STOP" and d.text == "done. STOP"


def test_earliest_of_several_stops_wins(tok):
    d, pieces = stream(tok, tok.encode("the quick brown fox"), stop=["fox", "quick"])
    assert d.stop_str == "quick" and "".join(pieces) == "the "


def test_batched_push_and_raw_tokenizers_object(tok):
    ids = tok.encode(TEXT)
    d = IncrementalDetokenizer(tok._tok, [1])  # a bare tokenizers.Tokenizer works too
    out = d.push(ids[:7]) + d.push(ids[7:]) + d.flush()
    assert out == TEXT


def test_invalid_bytes_are_released_not_held_forever(tok):
    lone = [i for i in tok.encode("世") if "\ufffd" in tok.decode([i])][:1]  # a lone leading byte
    ids = lone * 6 + tok.encode("ok")
    d, pieces = stream(tok, ids)
    assert "".join(pieces) == d.text and d.text.endswith("ok") and len(d._ids) <= 2 * (MAX_PENDING_TOKENS + 1)


def test_a_tokenizer_without_text_costs_nothing_and_refuses_stop_strings():
    """`decodes_text = False` (an engine-core process's tokenizer): no decode call, no text, no stop strings."""

    class NoText:
        decodes_text = False

        def decode(self, ids):
            raise AssertionError("decoded")

    d = IncrementalDetokenizer(NoText(), [1, 2, 3])
    assert d.push([4, 5]) == "" and d.push(6) == "" and d.flush() == "" and d.text == ""
    assert d.push_each([7, 8], last=True) == [([7, 8], "")] and d.push_each([]) == []  # one piece, no per-token work
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(NoText(), [1], stop=["x"])


def test_push_each_splits_by_token_and_ends_at_the_stop(tok):
    """push_each: a piece per token holding the text it released (the one push at a time would), the held-back
    text joining the last piece when the request ends; a stop string ends the pieces at the token completing it."""
    ids = tok.encode(TEXT)
    d, one_at_a_time = stream(tok, ids)
    e = IncrementalDetokenizer(tok, [1])
    pieces = e.push_each(ids[:9]) + e.push_each(ids[9:], last=True)
    assert [p[0] for p in pieces] == [[i] for i in ids]
    assert [t for _, t in pieces] == one_at_a_time[:-2] + [one_at_a_time[-2] + one_at_a_time[-1]]
    assert any(t == "" for _, t in pieces) and "".join(t for _, t in pieces) == TEXT
    s = IncrementalDetokenizer(tok, [1], stop=["STOP"])
    pieces = s.push_each(ids, last=True)
    assert s.stopped and "".join(t for _, t in pieces) == TEXT[:TEXT.index("STOP")]
    assert tok.decode([i for p, _ in pieces for i in p]).endswith("STOP")  # the token completing it is the last
    assert not tok.decode([i for p, _ in pieces[:-1] for i in p]).endswith("STOP")
    held = IncrementalDetokenizer(tok, [1], stop=["STOP here"])
    assert held.push_each(tok.encode("done. STOP"), last=True)[-1][1].endswith("STOP")  # flushed with the last
    assert held.push_each([], last=True) == []
