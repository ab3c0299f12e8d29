"""Parity with Hugging Face in bfloat16, as real checkpoints run by default: the engine in
bfloat16 against transformers in bfloat16, each judged against the same model in float32.

Two bfloat16 implementations of one network cannot agree bit for bit (they round at different
points: fused kernels, accumulation order), so the bound is relative to what bfloat16 itself
costs: our logits may be no farther from the float32 logits than 1.5x Hugging Face's bfloat16
logits are (both are roundings of the same float32 computation; 1.5x leaves room for rounding at
other points, not for a wrong formula, which shows at float32 in test_hf_parity.py).

Hugging Face's greedy reference recomputes the whole sequence each step (no KV cache), so its
tokens are the argmax of the logits compared below: its cached decoding in bfloat16 strays
further (seen here picking a token 0.64 below the best in float32, where its own whole-sequence
pass, ours and float32 agree).

Greedy tokens: where the float32 logits of two candidate tokens are closer than bfloat16's
noise at that position, either implementation may pick either (Hugging Face's own bfloat16 and
float32 runs part ways there too). So over 32 positions teacher-forced on Hugging Face's
bfloat16 continuation, our argmax must equal its token everywhere but at such near-ties (ours at
most 2.5x the position's largest bfloat16 error below its token in float32: ours at most 1.5x
it, plus its own; ours may be the better one by any margin, since its generate runs other
shapes than the teacher-forced pass and so may round to a worse token), and free-running greedy decoding must give its tokens exactly until it meets a near-tie
(the first 16 tokens and more, for the prompts that meet none before).
MoE models are left out: a router near-tie switches an expert, a discrete jump both
implementations take at different tokens (seen here up to 0.24 of the logit scale in either).
"""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from tests.support.parity import prefill_logits, prompts_of_lengths

NEW_TOKENS = 32
PROMPT_LENS = [1, 7, 16, 33, 64, 100, 5, 170]  # ragged, crossing page boundaries
OURS_OVER_HF = 1.5      # our bfloat16 error / Hugging Face's, both against float32
TIE = 2.5               # a near-tie: float32 gap within this many times the position's noise
# One prompt per prefill step (prompts up to 170 tokens, continued by 32), few buckets.
BF16_ENGINE = dict(dtype="bfloat16", max_running_requests=8, max_prefill_tokens=256,
                   max_total_tokens=4096)


# Gemma: (1 + w) norms in float32 before the cast, embeddings scaled in bfloat16, soft caps.
@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3", "tiny-gemma2",
                                        "tiny-gemma3"])
def models(request, checkpoint, engine_kwargs):
    path = checkpoint(request.param)
    engine = Engine(model_path=str(path), **dict(engine_kwargs, **BF16_ENGINE))
    hf = {dtype: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
          for dtype in (torch.bfloat16, torch.float32)}
    yield engine, hf[torch.bfloat16], hf[torch.float32]
    engine.shutdown()


def _logits(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def test_bf16_prefill_logits_are_as_close_to_float32_as_hf_bf16(models):
    engine, hf16, hf32 = models
    for prompt in prompts_of_lengths(engine.model_config.vocab_size, PROMPT_LENS):
        (ours,), _ = prefill_logits(engine, [prompt])
        want, theirs = _logits(hf32, prompt), _logits(hf16, prompt)
        scale = np.abs(want).max()
        ours_err, hf_err = np.abs(ours - want).max() / scale, np.abs(theirs - want).max() / scale
        assert ours_err <= OURS_OVER_HF * hf_err, (len(prompt), ours_err, hf_err)


def test_bf16_greedy_tokens_match_hf_bf16_but_at_near_ties(models):
    engine, hf16, hf32 = models
    prompts = prompts_of_lengths(engine.model_config.vocab_size, PROMPT_LENS, seed=1)
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    mismatches = checked = early = 0
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():  # each step a whole forward pass, as the logits below
            theirs = hf16.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                   min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=False)
        theirs = theirs[0, len(prompt):].tolist()
        # Teacher-forced on their continuation: the logits that chose each of its tokens.
        seq, at = prompt + theirs, slice(len(prompt) - 1, -1)
        (ours,), _ = prefill_logits(engine, [seq])
        ours, l16, l32 = ours[at], _logits(hf16, seq)[at], _logits(hf32, seq)[at]
        noise = np.abs(l16 - l32).max(-1)                       # per position
        picked = ours.argmax(-1)
        ties = []
        for t in np.flatnonzero(picked != np.array(theirs)):
            # How far below Hugging Face's token ours is in float32 (negative: ours is the
            # better one there; its generate ran other shapes than this pass, so its token need
            # not be this pass's argmax).
            gap = l32[t, theirs[t]] - l32[t, picked[t]]
            assert gap <= TIE * noise[t], (len(prompt), t, gap, noise[t])
            ties.append(int(t))
        # Free-running: the same tokens until a near-tie (the same context up to there).
        got = out["output_ids"]
        d = next((t for t in range(NEW_TOKENS) if got[t] != theirs[t]), NEW_TOKENS)
        if d < NEW_TOKENS:
            gap = l32[d, theirs[d]] - l32[d, got[d]]
            assert gap <= TIE * noise[d], (len(prompt), d, gap, noise[d])
        mismatches, checked = mismatches + len(ties), checked + NEW_TOKENS
        early += d < 16
    assert mismatches <= 0.1 * checked, f"{mismatches} near-tie flips in {checked} positions"
    print(f"{early} of {len(prompts)} prompts met a near-tie within 16 tokens")
