"""The offline engine with the options real clients send: grammar-constrained output (JSON
schema, regex, EBNF) from a random model at temperature 1, penalties and logit_bias checked
token by token against Hugging Face's logits, min_new_tokens, and top/prompt log-probabilities
against a full log-softmax; all in batches mixed with plain requests, with no compile after
warm-up."""

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from jaxrunner import Engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                 "ok": {"type": "boolean"}},
                  "required": ["age", "ok"], "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"(yes|no)-[0-9]{2,4}"
EBNF = 'root ::= "[" num ("," num)? ("," num)? "]"\nnum ::= [1-9] [0-9]?'
EBNF_AS_REGEX = r"\[[1-9][0-9]?(,[1-9][0-9]?){0,2}\]"
SAMPLES = 64


@pytest.fixture(scope="module")
def engine(checkpoint, engine_kwargs):
    # No whitespace between JSON tokens: a random model would fill its budget with it.
    engine = Engine(model_path=str(checkpoint("tiny-llama")),
                    constrained_json_disable_any_whitespace=True, **engine_kwargs)
    yield engine
    engine.shutdown()


def _free_requests(n, seed):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(5, 1000, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]
    params = [{"max_new_tokens": 12, "temperature": 1.0, "seed": 1000 + i} for i in range(n)]
    return prompts, params


def test_constrained_outputs_satisfy_their_grammars_beside_unchanged_free_requests(engine):
    warm = engine.compile_monitor.count
    free_prompts, free_params = _free_requests(8, seed=0)
    alone = [o["output_ids"] for o in engine.generate(input_ids=free_prompts,
                                                      sampling_params=free_params)]
    kinds = [("json_schema", json.dumps(SCHEMA)), ("regex", REGEX), ("ebnf", EBNF)]
    prompts, params = [], []
    for k, (kind, text) in enumerate(kinds):
        for i in range(SAMPLES):
            prompts.append(engine.tokenizer.encode(f"Answer {i}:"))
            params.append({"max_new_tokens": 96, "temperature": 1.0, kind: text,
                           "seed": 7 * i + k})
    outs = engine.generate(input_ids=prompts + free_prompts, sampling_params=params + free_params)
    texts = [o["text"] for o in outs[:len(prompts)]]
    for o in outs[:len(prompts)]:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
    for text in texts[:SAMPLES]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert all(re.fullmatch(REGEX, t) for t in texts[SAMPLES:2 * SAMPLES]), texts[SAMPLES:]
    assert all(re.fullmatch(EBNF_AS_REGEX, t) for t in texts[2 * SAMPLES:]), texts[2 * SAMPLES:]
    assert len(set(texts[:SAMPLES])) > SAMPLES // 2, "temperature 1 should vary the outputs"
    assert [o["output_ids"] for o in outs[len(prompts):]] == alone
    assert engine.compile_monitor.count == warm
    assert engine.grammar_cache.misses == 3  # each distinct grammar compiled once


@pytest.mark.parametrize("kind,text,words", [
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "nope"}}}', "json_schema"),
    ("json_schema", "{not json", "json_schema"),
    ("regex", "(unclosed", "regex"),
    ("ebnf", "root ::= missing_rule", "ebnf"),
])
def test_an_invalid_grammar_is_refused_by_name_and_the_engine_keeps_serving(engine, kind, text,
                                                                            words):
    with pytest.raises(ValueError, match=words):
        engine.generate(input_ids=[1, 2, 3], sampling_params={kind: text})
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2


def _penalised(logits, p, prompt, outputs):
    """jaxrunner/sampling/penalties.py's formulas on one position's logits (float64)."""
    x = logits.astype(np.float64).copy()
    counts = np.bincount(outputs, minlength=len(x)) if outputs else np.zeros(len(x))
    seen = counts > 0
    seen[prompt] = True
    r = p.get("repetition_penalty", 1.0)
    x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    x -= p.get("frequency_penalty", 0.0) * counts + p.get("presence_penalty", 0.0) * (counts > 0)
    for token, bias in p.get("logit_bias", {}).items():
        x[int(token)] += bias
    return x


def test_penalties_and_bias_pick_each_token_as_the_formulas_say(engine, hf_llama):
    """Greedy requests with penalties, in one batch with plain ones: every output token is the
    argmax of HF's logits at its position after the formulas, with the counts of the tokens
    before it (so the device's counts follow the request step by step)."""
    rng = np.random.default_rng(1)
    # The first prompt makes this model repeat a token (which frequency penalties act on).
    prompts = [[1, 2, 3, 4]] + [rng.integers(5, 1000, size=n).tolist() for n in (30, 17, 5, 22)]
    params = [{"frequency_penalty": 2.0},
              {"presence_penalty": 2.0, "repetition_penalty": 1.5},
              {"repetition_penalty": 0.7, "frequency_penalty": -0.5},
              {"logit_bias": {"7": 8.0, "500": -100.0}, "frequency_penalty": 0.4},
              {}]
    params = [dict(p, max_new_tokens=24, temperature=0.0, ignore_eos=True) for p in params]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    changed = []  # per request: tokens the formulas changed (the test must test something)
    for prompt, p, out in zip(prompts, params, outs):
        ids = out["output_ids"]
        with torch.no_grad():
            logits = hf_llama(torch.tensor([prompt + ids])).logits[0].numpy()
        changed.append(0)
        for i, token in enumerate(ids):
            raw = logits[len(prompt) + i - 1]
            x = _penalised(raw, p, prompt, ids[:i])
            top2 = np.sort(x)[-2:]
            if top2[1] - top2[0] > 1e-3:  # skip float ties between HF and us
                assert token == np.argmax(x), (p, i)
            changed[-1] += int(np.argmax(x) != np.argmax(raw))
    assert all(changed[:4]) and changed[4] == 0, changed


def test_min_new_tokens_masks_eos_until_reached(engine):
    eos = engine.model_config.eos_token_ids[0]
    params = {"max_new_tokens": 20, "temperature": 1.0, "min_new_tokens": 5,
              "logit_bias": {str(eos): 100.0}}
    outs = engine.generate(input_ids=[[5, 6, 7]] * 4, sampling_params=[
        dict(params, seed=i) for i in range(4)])
    for out in outs:  # EOS is all but certain from the 6th token on, and impossible before
        assert out["output_ids"][-1] == eos and len(out["output_ids"]) == 6
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_top_and_prompt_logprobs_equal_a_full_log_softmax(engine, hf_llama):
    """Output top-k and prompt log-probabilities (a prompt longer than the chunk size, one
    with a cached prefix, and one from logprob_start_len 3) against HF's log-softmax."""
    rng = np.random.default_rng(2)
    long_prompt = rng.integers(5, 1000, size=600).tolist()  # two chunks of 512
    short = rng.integers(5, 1000, size=40).tolist()
    engine.generate(input_ids=short + [9] * 8, sampling_params={"max_new_tokens": 1})  # cache it
    prompts, starts = [long_prompt, short, short[:20]], [0, 0, 3]
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6,
                                                               "temperature": 1.0},
                           return_logprob=True, top_logprobs_num=5, logprob_start_len=starts)
    for prompt, start, out in zip(prompts, starts, outs):
        meta = out["meta_info"]
        ids = out["output_ids"]
        with torch.no_grad():
            want = _log_softmax(hf_llama(torch.tensor([prompt + ids])).logits[0].numpy())
        inputs = meta["input_token_logprobs"]
        assert [t for _, t, _ in inputs] == prompt[start:]
        assert (inputs[0][0] is None) == (start == 0)
        for p in range(max(start, 1), len(prompt)):
            lp, token, _ = inputs[p - start]
            assert abs(lp - want[p - 1, token]) < 1e-4, p
            top = meta["input_top_logprobs"][p - start]
            order = np.argsort(-want[p - 1])[:5]
            assert [t for _, t, _ in top] == order.tolist()
            np.testing.assert_allclose([v for v, _, _ in top], want[p - 1, order], atol=1e-4)
        for i, (lp, token, _) in enumerate(meta["output_token_logprobs"]):
            row = want[len(prompt) + i - 1]
            assert token == ids[i] and abs(lp - row[token]) < 1e-4
            order = np.argsort(-row)[:5]
            top = meta["output_top_logprobs"][i]
            assert [t for _, t, _ in top] == order.tolist()
            np.testing.assert_allclose([v for v, _, _ in top], row[order], atol=1e-4)
    assert outs[1]["meta_info"]["cached_tokens"] == 0  # its prompt logprobs were computed


def test_n_samples_of_a_prompt_and_an_echo_only_request(engine):
    """`n` in sampling_params gives n different samples; max_new_tokens 0 with prompt
    logprobs runs the prefill and returns no tokens."""
    outs = engine.generate(input_ids=list(range(5, 45)),
                           sampling_params={"n": 4, "max_new_tokens": 8, "temperature": 1.0,
                                            "seed": 3})
    assert len(outs) == 4 and len({tuple(o["output_ids"]) for o in outs}) > 1
    assert [o["meta_info"]["cached_tokens"] for o in outs][1:] == [32] * 3
    out = engine.generate(input_ids=list(range(5, 25)), sampling_params={"max_new_tokens": 0},
                          return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == []
    lps = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
    assert lps[0] is None and all(lp is not None and lp < 0 for lp in lps[1:])
