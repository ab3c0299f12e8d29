"""Incremental detokenization on the tiny checkpoint's byte-level BPE: no partial characters,
no stop-string prefixes, and the streamed text equals the whole decode."""

import numpy as np
import pytest
from transformers import AutoTokenizer

from jaxrunner.server.detokenizer import IncrementalDetokenizer, decode, stop_holdback

TEXTS = ["héllo wörld — naïve café", "日本語のテキスト and 🎉🎉 emoji", "plain ascii text, nothing odd"]


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint("tiny-llama"))


def _stream(tokenizer, ids, stops=(), chunk=1, stopped_text=None):
    detok = IncrementalDetokenizer(tokenizer, stops)
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    text, rest = detok.finish(stopped_text)
    return deltas + [rest], text


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_multibyte_characters_are_never_split(tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 4  # the CJK and emoji become several byte tokens each
    deltas, final = _stream(tokenizer, ids, chunk=chunk)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == final == decode(tokenizer, ids) == text


def test_random_tokens_stream_to_the_whole_decode(tokenizer):
    # Random ids include lone continuation bytes: U+FFFD that no later token completes.
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, len(tokenizer), size=40).tolist()
        deltas, final = _stream(tokenizer, ids)
        assert "".join(deltas) == final == decode(tokenizer, ids)


def test_stop_string_prefix_is_held_back(tokenizer):
    text = "alpha beta gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "gamma"
    detok = IncrementalDetokenizer(tokenizer, [stop, "zzz"])
    sent = ""
    for t in ids:
        sent += detok.add([t])
        assert stop_holdback(sent, [stop]) == 0  # no prefix of "gamma" at the end, nor all of it
    # The engine would have stopped with the text cut before "gamma".
    _, rest = detok.finish(text[:text.find(stop)])
    assert sent + rest == "alpha beta "


def test_stop_holdback():
    assert stop_holdback("abc", ["cd"]) == 1
    assert stop_holdback("abc", ["bcd", "cd"]) == 2
    assert stop_holdback("abc", ["x"]) == 0
    assert stop_holdback("xabcy", ["bc"]) == 3  # a whole stop string: from it on
    assert stop_holdback("", ["a"]) == 0
