"""Speculative decoding end to end: every algorithm keeps the target's greedy tokens, a draft
that is the target accepts everything, sampling keeps the target's distribution, the EAGLE
heads match an independent PyTorch implementation, and bad configurations are refused."""

import numpy as np
import pytest
from safetensors.numpy import load_file
from scipy import stats
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from jaxrunner import Engine
from jaxrunner.sampling.batch import SamplingBatch
from jaxrunner.sampling.params import SamplingParams
from jaxrunner.speculative import acceptance
from models.testing.random_checkpoint import make_eagle_checkpoint
from tests.engine.test_engine import CompileCounter

# Few buckets (batches of 2 and 4 requests, prefill steps of 32 tokens), so every engine
# compiles about a dozen programs; 16 requests then run in waves, chunked and sharing prefixes.
SPEC_ENGINE = dict(max_running_requests=4, max_prefill_tokens=32, max_total_tokens=8192)
STEPS = 3


@pytest.fixture(scope="session")
def eagle_head(checkpoint_root):
    made = {}

    def get(algorithm, target_preset):
        key = (algorithm, target_preset)
        if key not in made:
            out = checkpoint_root / f"{target_preset}-{algorithm.lower()}"
            made[key] = make_eagle_checkpoint(out, algorithm, target_preset,
                                              aux_layer_ids=[0, 1, 1])
        return made[key]
    return get


def workload(vocab, n=16, seed=0):
    """Ragged prompts in families sharing a prefix, some of them repeating themselves (so
    n-gram lookup has something to find)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(8, vocab, size=int(rng.integers(20, 70))).tolist() for _ in range(3)]
    prompts = []
    for i in range(n):
        suffix = rng.integers(8, vocab, size=int(rng.integers(1, 30))).tolist()
        prompts.append(prefixes[i % 3] + suffix + (suffix[:8] * 2 if i % 2 else []))
    params = [{"max_new_tokens": int(rng.integers(4, 24)), "temperature": 0.0,
               "ignore_eos": True} for _ in range(n)]
    return prompts, params


def run(model_path, engine_kwargs, prompts, params, check=None, **spec):
    """The outputs of `prompts` on an engine with `spec`, checked for compiles, refusals and
    leaks; `check(engine)` checks more before it shuts down."""
    engine = Engine(model_path=str(model_path), **dict(engine_kwargs, **SPEC_ENGINE, **spec))
    try:
        half = len(prompts) // 2
        with CompileCounter() as counter:
            outs = (engine.generate(input_ids=prompts[:half], sampling_params=params[:half])
                    + engine.generate(input_ids=prompts[half:], sampling_params=params[half:]))
        assert counter.count == 0, f"{counter.count} compiles after warm-up"
        if spec:  # the draft would not see given embeddings: refused, and serving goes on
            hidden = engine.model_config.hidden_size
            with pytest.raises(ValueError, match="speculative decoding"):
                engine.generate(input_embeds=np.zeros((3, hidden), np.float32),
                                sampling_params=params[0])
        assert engine.flush_cache()
        scheduler = engine.scheduler
        assert scheduler.allocator.num_free == scheduler.allocator.capacity, "pages leaked"
        assert scheduler.req_to_token_pool.num_free_slots == scheduler.req_to_token_pool.num_slots
        if check is not None:
            check(engine)
        return outs
    finally:
        engine.shutdown()


def spec_args(algorithm, model_path, eagle_head, preset):
    args = dict(speculative_algorithm=algorithm, speculative_num_steps=STEPS)
    if algorithm == "STANDALONE":
        args["speculative_draft_model_path"] = str(model_path)
    elif algorithm in ("EAGLE", "EAGLE3"):
        args["speculative_draft_model_path"] = str(eagle_head(algorithm, preset))
    return args


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_every_algorithm_keeps_the_targets_greedy_tokens(preset, checkpoint, engine_kwargs,
                                                         eagle_head):
    path = checkpoint(preset)
    prompts, params = workload(1024)
    want = [o["output_ids"] for o in run(path, engine_kwargs, prompts, params)]
    for algorithm in ("EAGLE", "EAGLE3", "STANDALONE", "NGRAM"):
        outs = run(path, engine_kwargs, prompts, params,
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
    engine = Engine(model_path=str(path), **dict(engine_kwargs, **SPEC_ENGINE),
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


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs * counts.sum() >= 5  # merge the rare outcomes into one cell
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return stats.chisquare(observed, expected).pvalue


def _first_tokens(rule, logits, drafts, n):
    """The first token of n verify steps over the same logits and drafts, each with its own
    seed, through acceptance rule `rule`."""
    R, W, V = n, logits.shape[0], logits.shape[1]
    params = [SamplingParams(temperature=1.0, top_k=6, top_p=0.9).normalized()] * R
    batch = SamplingBatch.from_params(params, [0] * R, list(range(R)), R)
    _, tokens, _ = rule(np.broadcast_to(logits, (R, W, V)), np.broadcast_to(drafts, (R, W - 1)),
                        np.full(R, W - 1, np.int32), batch)
    return np.asarray(tokens)


def _target_first_token_probs(logits):
    """p_0 after temperature 1, top-k 6 and top-p 0.9, in numpy."""
    z = np.asarray(logits[0], np.float64)
    order = np.argsort(-z)
    keep = np.zeros_like(z, bool)
    keep[order[:6]] = True
    p = np.exp(z - z.max()) * keep
    p /= p.sum()
    sorted_p = p[order]
    cum = np.cumsum(sorted_p) - sorted_p
    kept = order[(cum < 0.9) & (sorted_p > 0)]
    q = np.zeros_like(p)
    q[kept] = p[kept]
    return q / q.sum()


def test_rejection_sampling_keeps_the_targets_distribution_and_a_wrong_rule_does_not():
    rng = np.random.default_rng(0)
    V, W, n = 12, 4, 20000
    logits = (2.0 * rng.standard_normal((W, V))).astype(np.float32)
    probs = _target_first_token_probs(logits)
    # The draft proposes the target's second most likely token: often accepted, often not.
    drafts = np.array([np.argsort(-probs)[1], 3, 5], np.int32)
    first = _first_tokens(acceptance.accept_drafts, logits, drafts, n)[:, 0]
    counts = np.bincount(first, minlength=V)
    assert _chi2_pvalue(counts, probs) > 1e-3
    assert 0.05 < np.mean(first == drafts[0]) < 0.95  # both branches of the rule ran

    def always_accept(logits, drafts, num_drafts, sampling):
        accept, tokens, logprobs = acceptance.accept_drafts(logits, drafts, num_drafts, sampling)
        return accept, np.concatenate([np.asarray(drafts), np.asarray(tokens)[:, -1:]], 1), None

    wrong = _first_tokens(always_accept, logits, drafts, n)[:, 0]
    assert _chi2_pvalue(np.bincount(wrong, minlength=V), probs) < 1e-6


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
        engine = Engine(model_path=str(path), **dict(engine_kwargs, **SPEC_ENGINE), **spec)
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


def _rms(x, w, eps):
    return w * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps))


def torch_head(head_dir, algorithm, target, tokens_next, hidden, own=None):
    """An independent EAGLE / EAGLE-3 head: tokens_next [P] (the token after each position),
    hidden [P, Hc] (the target's; or its first P - Q rows, then `own` [Q, D]: the head's own
    outputs, as its draft steps read them) -> (output [P, D], logits [P, V_draft])."""
    w = {k: torch.from_numpy(np.asarray(v)) for k, v in load_file(head_dir / "model.safetensors").items()}
    cfg = LlamaConfig.from_pretrained(head_dir)
    eps, nh, nkv = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.head_dim
    embeds = target.model.embed_tokens(torch.tensor(tokens_next))
    eagle3 = algorithm == "EAGLE3"
    p = "midlayer." if eagle3 else "layers.0."
    if own is not None and not eagle3:
        hidden = torch.cat([hidden, own], 0)
    if eagle3:
        h = hidden @ w["fc.weight"].T
        if own is not None:  # the head's own outputs skip fc
            h = torch.cat([h, own], 0)
        x = torch.cat([_rms(embeds, w[p + "input_layernorm.weight"], eps),
                       _rms(h, w[p + "hidden_norm.weight"], eps)], -1)
        residual = h
    else:
        x = torch.cat([embeds, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
        residual = x
    P = x.shape[0]
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(1, P, nh, hd).transpose(1, 2)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(1, P, nkv, hd).transpose(1, 2)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(1, P, nkv, hd).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(cfg)(v, torch.arange(P)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = (q @ k.transpose(-1, -2)) / hd ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(P, P, dtype=torch.bool), 1), -torch.inf)
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(P, nh * hd)
    residual = residual + attn @ w[p + "self_attn.o_proj.weight"].T
    hn = _rms(residual, w[p + "post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(hn @ w[p + "mlp.gate_proj.weight"].T)
           * (hn @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    out = residual + mlp
    if eagle3:
        logits = _rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T
    else:
        logits = target.lm_head(out)
    return out, logits


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_eagle_heads_match_a_pytorch_implementation(algorithm, checkpoint, engine_kwargs,
                                                    eagle_head):
    path = checkpoint("tiny-llama")
    head_dir = eagle_head(algorithm, "tiny-llama")
    prompt = np.random.default_rng(3).integers(8, 1024, size=37).tolist()
    engine = Engine(model_path=str(path), **dict(engine_kwargs, **SPEC_ENGINE),
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
