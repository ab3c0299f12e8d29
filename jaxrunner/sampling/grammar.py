"""Grammar-constrained decoding on the host, with llguidance.

A request with `json_schema`, `regex` or `ebnf` gets a `GrammarMatcher`: llguidance's matcher,
which fills the request's row of the step's token bitmask (bit v % 32 of word v // 32 set = token
v allowed; the sampler sets the other tokens' logits to -inf, jaxrunner/sampling/step.py) and
advances on each accepted token. When the grammar is complete (no token can extend it) the
request finishes.

Compiling a grammar (building its lexer over the vocabulary) is the expensive part, so
`GrammarCache` compiles each distinct grammar once and gives every request a copy of the compiled
matcher. It is thread-safe: the server compiles in worker threads, off the engine loop, and the
llguidance tokenizer (about a second for a large vocabulary) is built on first use.
"""

from __future__ import annotations

from collections import OrderedDict
import json
import threading

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

# Distinct compiled grammars kept; the least recently used is dropped past this.
CACHE_SIZE = 256
# The "JSON object" of OpenAI's response_format {"type": "json_object"}.
JSON_OBJECT_SCHEMA = '{"type": "object"}'

_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _parallel_executor() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


class GrammarMatcher:
    """One request's grammar state. Pickles as its grammar's key (multi-host followers rebuild
    the matcher from their own cache, `GrammarCache.matcher`)."""

    def __init__(self, matcher: llguidance.LLMatcher, key: tuple[str, str]):
        self.matcher = matcher
        self.key = key

    def accept_token(self, token: int) -> bool:
        """Advances on a sampled token; False (and the matcher in its error state) if the
        grammar does not allow it."""
        return self.matcher.consume_token(token)

    @property
    def is_terminated(self) -> bool:
        """No token but EOS can follow: the output is complete (or the matcher failed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    @staticmethod
    def fill_bitmasks(rows: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """Fills `bitmask[row]` (i32[R, ceil(V / 32)]) for every (matcher, row), in parallel."""
        llguidance.numpy.fill_next_token_bitmask_par(
            _parallel_executor(), [(m.matcher, row) for m, row in rows], bitmask)

    def __reduce__(self):
        return (_unbuilt_matcher, (self.key,))


def _unbuilt_matcher(key: tuple[str, str]) -> GrammarMatcher:
    """A matcher as unpickled: its key only, until a cache builds it (`GrammarCache.rebuild`)."""
    return GrammarMatcher(None, key)


def grammar_source(kind: str, text: str, json_options: dict | None = None) -> str:
    """The llguidance grammar of a `json_schema`, `regex` or `ebnf` constraint (EBNF: the GBNF
    of llama.cpp or Lark, as llguidance reads them). Raises ValueError naming the field."""
    try:
        if kind == "json_schema":
            schema = json.loads(text)
            if not isinstance(schema, dict) and not isinstance(schema, bool):
                raise ValueError("a JSON schema is an object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=json_options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "ebnf":
            return llguidance.grammar_from("ebnf", text)
    except ValueError as e:  # json.JSONDecodeError is one
        raise ValueError(f"invalid {kind}: {e}") from None
    raise ValueError(f"unknown grammar kind {kind!r}; one of json_schema, regex, ebnf")


class GrammarCache:
    """Compiles grammars once per distinct (kind, text) and hands out fresh matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, *,
                 json_whitespace_pattern: str | None = None,
                 json_disable_any_whitespace: bool = False):
        """`tokenizer`: the checkpoint's Hugging Face (fast) tokenizer. The JSON options are
        SGLang's `constrained_json_*` engine arguments."""
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._json_options = {}
        if json_whitespace_pattern is not None:
            self._json_options["whitespace_pattern"] = json_whitespace_pattern
        if json_disable_any_whitespace:
            self._json_options["whitespace_flexible"] = False
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self.hits = self.misses = 0

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos)
            return self._tokenizer

    def matcher(self, kind: str, text: str) -> GrammarMatcher:
        """A fresh matcher for the grammar; raises ValueError naming an invalid one."""
        key = (kind, text)
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
                self.hits += 1
        if template is None:
            template = self._compile(kind, text)  # outside the lock: compiles run in parallel
            with self._lock:
                self.misses += 1
                self._compiled[key] = template
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return GrammarMatcher(template.deep_copy(), key)

    def rebuild(self, matcher: GrammarMatcher) -> GrammarMatcher:
        """The matcher of an unpickled `GrammarMatcher` (its grammar's start state)."""
        return self.matcher(*matcher.key)

    def _compile(self, kind: str, text: str) -> llguidance.LLMatcher:
        tokenizer = self._ll_tokenizer()
        source = grammar_source(kind, text, self._json_options or None)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, tokenizer)
        if is_error:
            raise ValueError(f"invalid {kind}: {messages[0]}")
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {kind}: {matcher.get_error()}")
        return matcher
