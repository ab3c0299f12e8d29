"""Speculative decoding end to end: every algorithm keeps the target's greedy tokens, a draft
that is the target accepts everything, sampling keeps the target's distribution, the EAGLE
heads match an independent PyTorch implementation, and bad configurations are refused."""

import numpy as np
import pytest
from safetensors.numpy import load_file
from scipy import stats
import torch
from transformers import AutoModelForCausalLM

from jaxrunner import Engine
from jaxrunner.sampling.batch import SamplingBatch
from jaxrunner.sampling.params import SamplingParams
from jaxrunner.speculative import acceptance
from tests.support.presets import SPECULATIVE_ENGINE
from tests.support.speculative import (
    chi2_pvalue,
    serve_checked,
    target_first_token_probs,
    torch_head,
)

STEPS = 3


def spec_args(algorithm, model_path, eagle_head, preset):
    args = dict(speculative_algorithm=algorithm, speculative_num_steps=STEPS)
    if algorithm == "STANDALONE":
        args["speculative_draft_model_path"] = str(model_path)
    elif algorithm in ("EAGLE", "EAGLE3"):
        args["speculative_draft_model_path"] = str(eagle_head(algorithm, preset))
    return args


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_every_algorithm_keeps_the_targets_greedy_tokens(preset, checkpoint, engine_kwargs,
                                                         eagle_head, greedy_workload):
    path = checkpoint(preset)
    prompts, params, want = greedy_workload(preset)
    for algorithm in ("EAGLE", "EAGLE3", "STANDALONE", "NGRAM"):
        outs = serve_checked(path, engine_kwargs, prompts, params,
                             **spec_args(algorithm, path, eagle_head, preset))
        assert [o["output_ids"] for o in outs] == want, algorithm
        for out, p in zip(outs, params):
            meta = out["meta_info"]
            assert meta["completion_tokens"] == p["max_new_tokens"]
            # The prefill gives the first token; every verify round at least one more.
            assert 1 <= meta["spec_verify_ct"] <= p["max_new_tokens"] - 1 or (
                p["max_new_tokens"] == 1), algorithm
        if algorithm == "STANDALONE":  # the target drafting for itself: every draft accepted
            for out, p in zip(outs, params):
                rounds = -(-(p["max_new_tokens"] - 1) // (STEPS + 1))
                assert out["meta_info"]["spec_verify_ct"] == rounds


def test_ngram_accepts_drafts_on_repeating_text(checkpoint, engine_kwargs):
    path = checkpoint("tiny-llama")
    engine = Engine(model_path=str(path), **dict(engine_kwargs, **SPECULATIVE_ENGINE),
                    speculative_algorithm="NGRAM", speculative_num_steps=STEPS)
    try:
        # Greedy decoding of a random model soon cycles, and a cycle is what n-grams find.
        out = engine.generate(input_ids=list(range(10, 30)) * 3, sampling_params={
            "max_new_tokens": 60, "temperature": 0.0, "ignore_eos": True})
        base = engine.generate(input_ids=list(range(10, 30)) * 3, sampling_params={
            "max_new_tokens": 60, "temperature": 0.0, "ignore_eos": True})
    finally:
        engine.shutdown()
    assert out["output_ids"] == base["output_ids"]
    assert out["meta_info"]["spec_verify_ct"] < 59, "no draft was ever accepted"


# ---- sampling keeps the target's distribution ----------------------------------------------


def _first_tokens(rule, logits, drafts, n):
    """The first token of n verify steps over the same logits and drafts, each with its own
    seed, through acceptance rule `rule`."""
    R, W, V = n, logits.shape[0], logits.shape[1]
    params = [SamplingParams(temperature=1.0, top_k=6, top_p=0.9).normalized()] * R
    batch = SamplingBatch.from_params(params, [0] * R, list(range(R)), R)
    _, tokens, _ = rule(np.broadcast_to(logits, (R, W, V)), np.broadcast_to(drafts, (R, W - 1)),
                        np.full(R, W - 1, np.int32), batch)
    return np.asarray(tokens)


def test_rejection_sampling_keeps_the_targets_distribution_and_a_wrong_rule_does_not():
    rng = np.random.default_rng(0)
    V, W, n = 12, 4, 20000
    logits = (2.0 * rng.standard_normal((W, V))).astype(np.float32)
    probs = target_first_token_probs(logits)
    # The draft proposes the target's second most likely token: often accepted, often not.
    drafts = np.array([np.argsort(-probs)[1], 3, 5], np.int32)
    first = _first_tokens(acceptance.accept_drafts, logits, drafts, n)[:, 0]
    counts = np.bincount(first, minlength=V)
    assert chi2_pvalue(counts, probs) > 1e-3
    assert 0.05 < np.mean(first == drafts[0]) < 0.95  # both branches of the rule ran

    def always_accept(logits, drafts, num_drafts, sampling):
        accept, tokens, logprobs = acceptance.accept_drafts(logits, drafts, num_drafts, sampling)
        return accept, np.concatenate([np.asarray(drafts), np.asarray(tokens)[:, -1:]], 1), None

    wrong = _first_tokens(always_accept, logits, drafts, n)[:, 0]
    assert chi2_pvalue(np.bincount(wrong, minlength=V), probs) < 1e-6


def test_speculative_sampling_keeps_the_engines_distribution(checkpoint, engine_kwargs):
    """The first two sampled tokens of a prompt, over 300 seeds, with and without NGRAM
    speculation: a two-sample chi-square test cannot tell them apart."""
    path = checkpoint("tiny-llama")
    prompt = list(range(40, 60)) * 2
    n = 300
    params = [{"max_new_tokens": 3, "temperature": 1.0, "seed": s, "ignore_eos": True}
              for s in range(n)]
    samples = {}
    for name, spec in (("plain", {}), ("ngram", dict(speculative_algorithm="NGRAM",
                                                     speculative_num_steps=STEPS))):
        engine = Engine(model_path=str(path), **dict(engine_kwargs, **SPECULATIVE_ENGINE),
                        **spec)
        try:
            outs = engine.generate(input_ids=[prompt] * n, sampling_params=params)
        finally:
            engine.shutdown()
        samples[name] = [tuple(o["output_ids"][:2]) for o in outs]
    for position in (0, 1):
        a = [s[position] for s in samples["plain"]]
        b = [s[position] for s in samples["ngram"]]
        values = sorted(set(a) | set(b))
        table = np.array([[a.count(v) for v in values], [b.count(v) for v in values]])
        table = table[:, table.sum(0) >= 10]
        if table.shape[1] > 1:
            assert stats.chi2_contingency(table).pvalue > 1e-3, position


# ---- the EAGLE heads against PyTorch -------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_eagle_heads_match_a_pytorch_implementation(algorithm, checkpoint, engine_kwargs,
                                                    eagle_head):
    path = checkpoint("tiny-llama")
    head_dir = eagle_head(algorithm, "tiny-llama")
    prompt = np.random.default_rng(3).integers(8, 1024, size=37).tolist()
    engine = Engine(model_path=str(path), **dict(engine_kwargs, **SPECULATIVE_ENGINE),
                    speculative_algorithm=algorithm, speculative_draft_model_path=str(head_dir),
                    speculative_num_steps=STEPS)
    try:
        req = engine.add_request(prompt, {"max_new_tokens": 8, "temperature": 0.0,
                                          "ignore_eos": True})
        while len(req.output_ids) < 1:  # the prefill: target, then the head over the prompt
            engine.step()
        draft = engine.worker.draft
        ours = np.asarray(draft.draft_state.hidden)[req.req_pool_idx]
        first_draft = int(np.asarray(draft.draft_state.tokens)[req.req_pool_idx, 0])
        engine.compile_monitor.allow()  # a tool's program, not a serving step
        our_logits = np.asarray(draft.compute_logits(ours[None]))[0]
        engine.compile_monitor.forbid()
        sampled = req.output_ids[0]
        while engine.has_unfinished_requests:
            engine.step()
    finally:
        engine.shutdown()
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        states = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        if algorithm == "EAGLE3":  # the inputs of the layers it reads, side by side
            hidden = torch.cat([states[i][0] for i in (0, 1, 1)], -1)
        else:
            hidden = states[-1][0]  # after the final norm
        out, logits = torch_head(head_dir, algorithm, target, prompt[1:] + [sampled], hidden)
    want, want_logits = out[-1].numpy(), logits[-1].numpy()
    assert np.abs(ours - want).max() / np.abs(want).max() < 1e-4
    assert np.abs(our_logits - want_logits).max() / np.abs(want_logits).max() < 1e-4
    best = int(np.argmax(want_logits))
    if algorithm == "EAGLE3":
        best += int(load_file(head_dir / "model.safetensors")["d2t"][best])
    assert first_draft == best


# ---- bad configurations ----------------------------------------------------------------------


@pytest.mark.parametrize("spec,message", [
    (dict(speculative_algorithm="MEDUSA"), "speculative_algorithm must be one of"),
    (dict(speculative_algorithm="EAGLE"), "needs speculative_draft_model_path"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=3,
          speculative_num_draft_tokens=3), "too small"),
    (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=2, speculative_num_steps=3,
          speculative_num_draft_tokens=8), "the 6 nodes of 2 n-gram continuations"),
    (dict(speculative_algorithm="NGRAM", enable_mixed_chunk=True), "enable_mixed_chunk"),
])
def test_bad_speculative_arguments_are_refused(checkpoint, spec, message):
    with pytest.raises(ValueError, match=message):
        Engine(model_path=str(checkpoint("tiny-llama")), **spec)


def test_a_draft_that_cannot_serve_the_target_is_refused(checkpoint, eagle_head, tmp_path):
    import json
    import shutil
    target = checkpoint("tiny-llama")
    other_vocab = shutil.copytree(target, tmp_path / "other-vocab")
    config = json.loads((other_vocab / "config.json").read_text())
    (other_vocab / "config.json").write_text(json.dumps(dict(config, vocab_size=2048)))
    with pytest.raises(ValueError, match="vocab_size 2048 differs"):
        Engine(model_path=str(target), speculative_algorithm="STANDALONE",
               speculative_draft_model_path=str(other_vocab))
    narrow = shutil.copytree(eagle_head("EAGLE", "tiny-llama"), tmp_path / "narrow-eagle")
    config = json.loads((narrow / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps(dict(config, hidden_size=128)))
    with pytest.raises(ValueError, match="hidden"):
        Engine(model_path=str(target), speculative_algorithm="EAGLE",
               speculative_draft_model_path=str(narrow))


def test_serve_takes_the_speculative_flags_and_metrics_report_the_accept_length():
    import argparse

    from jaxrunner.cli import add_serve_args, engine_args_from
    from jaxrunner.config import EngineArgs
    from jaxrunner.server.metrics import ServerMetrics

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    ns = parser.parse_args(["--model-path", "m", "--speculative-algorithm", "NGRAM",
                            "--speculative-num-steps", "5"])
    args = EngineArgs(**engine_args_from(ns))
    assert (args.speculative_algorithm, args.speculative_window) == ("NGRAM", 6)

    metrics = ServerMetrics(lambda: {})
    metrics.observe_finished("length", 10, 1.0, completion_tokens=12, spec_verify_ct=4)
    metrics.observe_finished("length", 10, 1.0, completion_tokens=9, spec_verify_ct=3)
    metrics.observe_finished("length", 10, 1.0, completion_tokens=5)  # not speculative
    text = metrics.render().decode()
    assert "jaxrunner_spec_accept_length 3.0" in text
    assert "jaxrunner_spec_verify_steps_total 7.0" in text
