"""A request's answer in SGLang's `/generate` shape, `{"output_ids", "meta_info", "text"}`: built
here for the offline engine (`Engine.output`) and the server's `/generate` (streamed or not) alike.

`meta_info`, as SGLang's tokenizer manager writes it:
- in every answer, streamed chunks too: `id` (the request's rid), `finish_reason` (None until the
  end), `prompt_tokens`, `completion_tokens`, `cached_tokens` (prompt tokens served from the prefix
  cache), `weight_version`; with `return_logprob`, the log-probability lists so far:
  `output_token_logprobs`, `output_top_logprobs` (with `top_logprobs_num`), and with
  `logprob_start_len` >= 0 the prompt's `input_token_logprobs` / `input_top_logprobs` from that
  position (None entries where nothing is computed: the first token, or a prompt not yet run);
  each entry a (logprob, token id, token text or None) tuple;
- once finished: `spec_verify_ct` (verify rounds) under speculative decoding, and `e2e_latency`
  (seconds) where the caller times the request (the server).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jaxrunner.batch.schedule_batch import Req


@dataclass
class Logprobs:
    """What a request with `return_logprob` asked for and has got so far."""

    output: Sequence[float]                    # per output token
    output_top: Sequence | None                # per output token [(logprob, id)]; None: not asked
    start: int                                 # logprob_start_len; -1: no prompt logprobs
    input: Sequence | None = None              # per prompt position; None: not computed
    input_top: Sequence | None = None

    @classmethod
    def of(cls, req: Req) -> "Logprobs":
        return cls(req.output_logprobs, req.output_top_logprobs if req.top_logprobs_num else None,
                   req.logprob_start_len, req.input_token_logprobs, req.input_top_logprobs)


def meta_info(rid, prompt_ids: Sequence[int], output_ids: Sequence[int],
              finish_reason: dict | None, *, cached_tokens: int, weight_version: str | None,
              logprobs: Logprobs | None = None, spec_verify_ct: int | None = None,
              e2e_latency: float | None = None,
              token_text: Callable[[int], str] | None = None) -> dict:
    """SGLang's `meta_info` of one request so far (see the module docstring). `logprobs`: None
    without `return_logprob`; `spec_verify_ct`: None without speculative decoding; `token_text`
    puts each logprob entry's token text in its third place (`return_text_in_logprobs`)."""
    meta = {"id": str(rid), "finish_reason": finish_reason, "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(output_ids), "cached_tokens": cached_tokens,
            "weight_version": weight_version}
    if logprobs is not None:
        meta.update(_logprob_lists(logprobs, prompt_ids, output_ids, token_text))
    if finish_reason is not None:
        if spec_verify_ct is not None:
            # Accept length = completion_tokens / spec_verify_ct.
            meta["spec_verify_ct"] = spec_verify_ct
        if e2e_latency is not None:
            meta["e2e_latency"] = e2e_latency
    return meta


def generate_answer(output_ids: Sequence[int], meta: dict, text: str | None) -> dict:
    """One request's `/generate` answer; `text` None without a tokenizer."""
    answer = {"output_ids": list(output_ids), "meta_info": meta}
    if text is not None:
        answer["text"] = text
    return answer


def _logprob_lists(logprobs: Logprobs, prompt_ids: Sequence[int], output_ids: Sequence[int],
                   token_text: Callable[[int], str] | None) -> dict:
    def entry(logprob, token):
        return (logprob, token, None if token_text is None else token_text(token))

    def alternatives(top):
        return None if top is None else [entry(lp, t) for lp, t in top]

    lists = {"output_token_logprobs": [entry(lp, t) for lp, t in zip(logprobs.output,
                                                                       output_ids)]}
    asked_top = logprobs.output_top is not None
    if asked_top:
        lists["output_top_logprobs"] = [alternatives(top) for top in logprobs.output_top]
    if logprobs.start >= 0:
        positions = range(logprobs.start, len(prompt_ids))
        values = logprobs.input or [None] * len(prompt_ids)
        lists["input_token_logprobs"] = [entry(values[p], prompt_ids[p]) for p in positions]
        if asked_top:
            tops = logprobs.input_top or [None] * len(prompt_ids)
            lists["input_top_logprobs"] = [alternatives(tops[p]) for p in positions]
    return lists
