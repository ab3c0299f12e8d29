"""Request validation in one place: the offline `Engine` and the HTTP server both turn a
request's inputs into `Req`s here, so they accept and refuse exactly the same things with the
same messages.

`RequestFactory.make` checks the prompt (token ids in the vocabulary, room for one new token),
the sampling params (`SamplingParams.verify`), the log-probability options and the output budget,
compiles the grammar (through the thread-safe `GrammarCache`: the server calls this from worker
threads, off the engine loop), and draws the request's id and seed. Every error is a ValueError
that names the field and the problem.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import hashlib
import itertools
import numbers
import random
import threading

from jaxrunner.batch.schedule_batch import Req
from jaxrunner.pooling.output import PoolingRequest
from jaxrunner.sampling.batch import BIAS_TABLE_SIZE
from jaxrunner.sampling.grammar import GrammarCache
from jaxrunner.sampling.params import SamplingParams
from jaxrunner.sampling.step import TOP_LOGPROBS


class RequestFactory:
    """Validated `Req`s for one engine. Thread-safe."""

    def __init__(self, vocab_size: int, eos_token_ids, max_req_len: int,
                 grammar_cache: GrammarCache | None, has_tokenizer: bool, random_seed: int,
                 speculative: str | None = None, check: Callable[[Req], None] | None = None,
                 model_config=None, hidden_states: bool = False):
        """`max_req_len`: the most tokens (prompt + output) one request may reach.
        `grammar_cache` None: no tokenizer, so no grammars. `speculative`: the engine's
        speculative algorithm (its verify rounds accept by temperature / top-k / top-p / min-p
        only, so options that change the sampler are refused). `check`: the scheduler's own
        refusals (a block-diffusion LM's, `DllmScheduler.check_request`), raising ValueError.
        `model_config`: a pooling model's config makes every request a pooling request (its
        prompt run, nothing generated). `hidden_states`: requests may ask for hidden states
        (`enable_return_hidden_states`)."""
        self.pooling_config = (None if model_config is None or model_config.is_generation
                               else model_config)
        self.hidden_states = hidden_states
        self.speculative = speculative
        self.check = check
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_req_len = max_req_len
        self.grammar_cache = grammar_cache
        self.has_tokenizer = has_tokenizer
        self._rids = itertools.count()
        self._seeds = random.Random(random_seed)
        self._lock = threading.Lock()

    def make_group(self, input_ids, sampling_params: dict | SamplingParams | None = None,
                   **kwargs) -> list[Req]:
        """`sampling_params.n` requests of one prompt (n samples: seeds `seed + j` when a seed
        is given, so they differ); the keyword arguments are `make`'s."""
        params = self.parse_params(sampling_params)
        if not isinstance(params.n, int) or isinstance(params.n, bool) or not 1 <= params.n:
            raise ValueError(f"n={params.n!r} must be an int >= 1")
        reqs = []
        for j in range(params.n):
            sample = dataclasses.replace(params, n=1, seed=None if params.seed is None
                                         else params.seed + j)
            reqs.append(self.make(input_ids, sample, **kwargs))
        return reqs

    def make(self, input_ids, sampling_params: dict | SamplingParams | None = None, *,
             return_logprob: bool = False, priority: int = 0, top_logprobs_num: int = 0,
             logprob_start_len: int = -1, strict_budget: bool = False,
             embed_override=None, lora=None, cache_salt: str | None = None,
             return_hidden_states: bool = False, dimensions: int | None = None) -> Req:
        """One validated request. `strict_budget`: a prompt + max_new_tokens past the context
        is an error (the server's rule, as OpenAI's); otherwise max_new_tokens is capped.
        `embed_override`: given embeddings of some prompt positions (`input_embeds.py`).
        `lora`: the LoRA adapter to run with (`lora.registry.LoraRegistry.get`), or None.
        `cache_salt`: shares cached prefixes only with requests of the same salt.
        `return_hidden_states`: the hidden states of its tokens (`Req.hidden_states`).
        `dimensions`: a pooling model's Matryoshka truncation."""
        if self.pooling_config is not None:
            return self._make_pooling(input_ids, sampling_params, priority, dimensions,
                                      return_logprob, embed_override, lora)
        if dimensions is not None:
            raise ValueError("dimensions applies to embedding models; this one generates")
        if return_hidden_states and not self.hidden_states:
            raise ValueError("return_hidden_states needs an engine started with "
                             "enable_return_hidden_states (--enable-return-hidden-states)")
        ids = self.check_prompt(input_ids)
        if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        params = self.parse_params(sampling_params)
        params.verify(self.vocab_size)
        if params.n != 1:
            raise ValueError(f"n={params.n}: one request is one sample (make_group makes n)")
        params = params.normalized()
        self._check_text_options(params)
        self._check_bias_table(params)
        room = self.max_req_len - len(ids)
        if strict_budget and params.max_new_tokens > room:
            # SGLang's wording, which its clients match on.
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.max_req_len} tokens. You requested a total of "
                f"{len(ids) + params.max_new_tokens} tokens: {len(ids)} tokens from the input "
                f"messages and {params.max_new_tokens} tokens for the completion. Please reduce "
                f"the number of tokens in the input messages or the completion to fit within "
                f"the limit.")
        top, start = self._check_logprob_options(return_logprob, top_logprobs_num,
                                                 logprob_start_len, len(ids))
        if self.speculative is not None:
            self._check_speculative(params, top, start)
        grammar = None
        if params.grammar is not None:
            if self.grammar_cache is None:
                raise ValueError(f"{params.grammar[0]} needs a tokenizer "
                                 "(skip_tokenizer_init is set)")
            grammar = self.grammar_cache.matcher(*params.grammar)
        with self._lock:
            rid = next(self._rids)
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        req = Req(rid=rid, origin_input_ids=ids, sampling_params=params, seed=seed,
                  max_new_tokens=min(params.max_new_tokens, room),
                  eos_token_ids=self.eos_token_ids, return_logprob=bool(return_logprob),
                  priority=int(priority), grammar=grammar, top_logprobs_num=top,
                  logprob_start_len=start, embed_override=embed_override, lora=lora,
                  cache_namespace=cache_namespace(cache_salt),
                  return_hidden_states=bool(return_hidden_states))
        if self.check is not None:
            self.check(req)
        return req

    def _make_pooling(self, input_ids, sampling_params, priority, dimensions, return_logprob,
                      embed_override, lora) -> Req:
        """A pooling model's request: its prompt runs, nothing is generated."""
        bad = [name for name, given in (
            ("sampling_params", sampling_params not in (None, {})),
            ("return_logprob", bool(return_logprob)), ("input embeddings", embed_override),
            ("lora_path", lora)) if given]
        if bad:
            raise ValueError(f"{', '.join(bad)} not implemented for a pooling model: it "
                             f"returns an embedding or scores, nothing generated")
        ids = self.check_prompt(input_ids)
        if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        pooling = PoolingRequest.of(self.pooling_config, dimensions)
        with self._lock:
            rid = next(self._rids)
        return Req(rid=rid, origin_input_ids=ids, sampling_params=SamplingParams().normalized(),
                   seed=0, max_new_tokens=0, eos_token_ids=self.eos_token_ids,
                   priority=int(priority), pooling=pooling)

    def _check_speculative(self, params: SamplingParams, top: int, start: int) -> None:
        """What speculative decoding does not implement, refused by name."""
        bad = []
        if params.grammar is not None:
            bad.append(params.grammar[0])
        if params.uses_slot_state:
            bad.append("penalties, logit_bias and min_new_tokens")
        if top:
            bad.append("top_logprobs_num")
        if start >= 0:
            bad.append("prompt logprobs (logprob_start_len)")
        if bad:
            raise ValueError(f"{', '.join(bad)} not implemented with speculative decoding "
                             f"({self.speculative})")

    @staticmethod
    def parse_params(params: dict | SamplingParams | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if isinstance(params, dict):
            try:
                return SamplingParams.from_dict(params)
            except TypeError as e:
                raise ValueError(str(e)) from None
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a dict")
        return params

    def check_prompt(self, input_ids) -> list[int]:
        """The prompt as a list of ints; raises for an empty or over-long one or a token
        outside the vocabulary."""
        if input_ids is None or len(input_ids) == 0:
            raise ValueError("empty prompt")
        vocab = self.vocab_size
        for t in input_ids:
            if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"token id {t!r} is outside the vocabulary [0, {vocab})")
        if len(input_ids) >= self.max_req_len:
            raise ValueError(f"The input ({len(input_ids)} tokens) is longer than the model's "
                             f"context length ({self.max_req_len} tokens).")
        return [int(t) for t in input_ids]

    def _check_text_options(self, params: SamplingParams) -> None:
        if self.has_tokenizer:
            return
        for name in ("stop", "stop_regex"):
            if getattr(params, name):
                raise ValueError(f"{name} needs a tokenizer (skip_tokenizer_init is set)")

    def _check_bias_table(self, params: SamplingParams) -> None:
        entries = len(params.logit_bias or {})
        if params.min_new_tokens > 0:
            entries += len(set(params.stop_token_ids) | self.eos_token_ids)
        if entries > BIAS_TABLE_SIZE:
            raise ValueError(f"logit_bias and the stop ids min_new_tokens masks come to "
                             f"{entries} entries, more than the {BIAS_TABLE_SIZE} a request has")

    @staticmethod
    def _check_logprob_options(return_logprob, top_logprobs_num, logprob_start_len,
                               prompt_len: int) -> tuple[int, int]:
        if not isinstance(return_logprob, bool):
            raise ValueError(f"return_logprob must be a bool, got {return_logprob!r}")
        for name, value in (("top_logprobs_num", top_logprobs_num),
                            ("logprob_start_len", logprob_start_len)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if not 0 <= top_logprobs_num <= TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num={top_logprobs_num} must be in "
                             f"[0, {TOP_LOGPROBS}]")
        if not -1 <= logprob_start_len < prompt_len:
            raise ValueError(f"logprob_start_len={logprob_start_len} must be -1 (no prompt "
                             f"logprobs) or a position of the prompt [0, {prompt_len})")
        if not return_logprob:
            if top_logprobs_num or logprob_start_len != -1:
                raise ValueError("top_logprobs_num and logprob_start_len need return_logprob")
            return 0, -1
        return int(top_logprobs_num), int(logprob_start_len)


def cache_namespace(salt: str | None) -> int:
    """The prefix-cache namespace of a `cache_salt`: 0 for none, else a 64-bit digest of it."""
    if salt is None:
        return 0
    if not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string, got {salt!r}")
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little") or 1
