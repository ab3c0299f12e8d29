"""Tree drafting with EAGLE and EAGLE-3 heads (speculative_eagle_topk > 1,
jaxrunner/speculative/eagle_tree.py) and NGRAM tries: the greedy tokens of ragged, chunked
requests sharing prefixes are the target's, with 0 compiles after warm-up and every page free;
every EAGLE node's draft score (its path's cumulative log-probability) is the one an independent
PyTorch head gives when it drafts the node's path as a chain, each step reading the previous
step's output; sampled requests run reproducibly by seed; NGRAM's tries merge the
continuations of recent matches."""

import dataclasses

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file
import torch
from transformers import AutoModelForCausalLM

from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.speculative.ngram import NgramProposer
from tests.support.engine import CompileCounter, assert_no_kv_cache_copy
from tests.support.speculative import serve_checked, torch_head

TOPK, STEPS, NODES = 2, 3, 7


def _depths(parents):
    depth = np.zeros(len(parents), int)
    for j in range(1, len(parents)):
        depth[j] = depth[parents[j]] + 1
    return depth


def _two_rounds(engine, prompt, continuation):
    """The trees of the first two rounds of `prompt` alone on `engine`, read as its tree step
    wrote them: [(known tokens before the round, tree tokens i32[N] with the root at 0, parents
    i32[N], node scores f32[N])]. In the first, the path to a deepest node is overwritten with
    `continuation` (the target's greedy tokens after the first), so the target accepts it: the
    second round's head then reads the hidden states the verify captured along a path."""
    req = engine.add_request(prompt, {"max_new_tokens": 12, "temperature": 0.0,
                                      "ignore_eos": True})
    while len(req.output_ids) < 1:  # the prefill: the target's, then the head's
        engine.step()
    draft = engine.worker.draft
    slot = req.req_pool_idx
    rounds = []
    forward = draft.forward

    def spy(fb):
        scores = forward(fb)
        if fb.forward_mode != ForwardMode.TARGET_VERIFY:  # the tree step's only
            return scores
        state = draft.draft_state
        _, tokens, parents = jax.device_get((scores, state.tokens, state.parents))
        rounds.append((prompt + list(req.output_ids),
                       np.concatenate([[req.output_ids[-1]], tokens[slot, :NODES - 1]]),
                       parents[slot], np.asarray(scores)[0]))
        if len(rounds) == 1:  # a path of the target's own tokens
            depth = _depths(parents[slot])
            node = int(np.argmax(depth))
            tokens = tokens.copy()
            while node > 0:
                tokens[slot, node - 1] = continuation[depth[node] - 1]
                node = parents[slot][node]
            draft.draft_state = dataclasses.replace(
                state, tokens=jax.device_put(tokens, state.tokens.sharding))
        return scores

    draft.forward = spy
    try:
        for _ in range(2):
            engine.step()
    finally:
        del draft.forward
    assert len(rounds[1][0]) == len(prompt) + 1 + STEPS + 1, "the given path was not accepted"
    while engine.has_unfinished_requests:
        engine.step()
    return rounds


def _reference_scores(head_dir, algorithm, target_path, known, tokens, parents):
    """Each node's score from `torch_head` drafting its path as a chain after the `known`
    tokens: the head over them with the target's hidden states, then over the path's tokens,
    each reading the head's previous output."""
    prompt, root = known[:-1], known[-1]
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    eagle3 = algorithm == "EAGLE3"
    to_draft = None
    if eagle3:  # target id = draft id + d2t[draft id]
        d2t = load_file(head_dir / "model.safetensors")["d2t"]
        to_draft = {int(i + d2t[i]): i for i in range(len(d2t))}
    with torch.no_grad():
        states = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        hidden = torch.cat([states[i][0] for i in (0, 1, 1)], -1) if eagle3 else states[-1][0]
        cache = {}

        def after(path):
            """(log-probs over the draft vocabulary, output) of the head after `path`."""
            if path not in cache:
                own = [after(path[:i])[1] for i in range(len(path))]
                out, logits = torch_head(head_dir, algorithm, target,
                                         prompt[1:] + [root] + list(path), hidden,
                                         torch.stack(own) if own else None)
                cache[path] = (torch.log_softmax(logits[-1], -1).numpy(), out[-1])
            return cache[path]

        scores, in_topk = [0.0], []
        for j in range(1, len(tokens)):
            path, node = [], j
            while node > 0:
                path.append(int(tokens[node]))
                node = parents[node]
            path = tuple(reversed(path))
            total = 0.0
            for depth, token in enumerate(path):
                logprobs = after(path[:depth])[0]
                draft_id = to_draft[token] if eagle3 else token
                total += logprobs[draft_id]
                in_topk.append(logprobs[draft_id] >= np.sort(logprobs)[-TOPK] - 1e-4)
            scores.append(total)
    return np.asarray(scores), in_topk


def _sampled_runs_are_reproducible(engine, prompt):
    """Sampled requests run through the serving executables, reproducibly by seed."""
    sampled = [{"max_new_tokens": 9, "temperature": 0.9, "seed": seed, "ignore_eos": True}
               for seed in (5, 5, 6)]
    with CompileCounter() as counter:
        outs = engine.generate(input_ids=[prompt] * 3, sampling_params=sampled)
    assert counter.count == 0
    assert outs[0]["output_ids"] == outs[1]["output_ids"] != outs[2]["output_ids"]


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_an_eagle_tree_keeps_the_greedy_tokens_and_drafts_as_the_chain_would(
        algorithm, checkpoint, engine_kwargs, eagle_head, greedy_workload):
    path = checkpoint("tiny-llama")
    head_dir = eagle_head(algorithm, "tiny-llama")
    prompts, params, want = greedy_workload("tiny-llama")
    prompt = np.random.default_rng(3).integers(8, 1024, size=37).tolist()
    seen = {}

    def more_checks(engine):
        assert_no_kv_cache_copy(engine.runner)
        assert_no_kv_cache_copy(engine.worker.draft)
        with CompileCounter() as counter:
            greedy = engine.generate(input_ids=prompt, sampling_params={
                "max_new_tokens": 1 + STEPS, "temperature": 0.0})["output_ids"]
            seen["rounds"] = _two_rounds(engine, prompt, greedy[1:])
        assert counter.count == 0
        _sampled_runs_are_reproducible(engine, prompts[0])

    outs = serve_checked(path, engine_kwargs, prompts, params, check=more_checks,
               speculative_algorithm=algorithm, speculative_draft_model_path=str(head_dir),
               speculative_eagle_topk=TOPK, speculative_num_steps=STEPS,
               speculative_num_draft_tokens=NODES)
    assert [o["output_ids"] for o in outs] == want
    for out, p in zip(outs, params):
        assert 1 <= out["meta_info"]["spec_verify_ct"] <= p["max_new_tokens"] - 1
    for known, tokens, parents, scores in seen["rounds"]:
        # A full tree: every slot a node under an earlier one, levels 1 .. STEPS.
        assert parents[0] == -1 and all(0 <= parents[j] < j for j in range(1, NODES))
        assert _depths(parents).max() == STEPS
        want, in_topk = _reference_scores(head_dir, algorithm, path, known, tokens, parents)
        np.testing.assert_allclose(scores, want, atol=1e-4 * max(1.0, np.abs(want).max()))
        assert all(in_topk)


# ---- NGRAM tries ---------------------------------------------------------------------------


def test_ngram_tries_merge_the_continuations_of_recent_matches():
    proposer = NgramProposer(max_match=3, min_match=1, num_drafts=6, max_requests=4, keep=2)
    # [1, 2, 3] recurs ending at 2 and 6: the most recent continues 7 5 1, the older 9 1 2.
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert proposer.propose_tree(0, tokens, topk=2, depth=3, max_nodes=6) == (
        [7, 5, 1, 9, 1, 2], [0, 1, 2, 0, 4, 5])
    assert proposer.propose_tree(0, tokens, topk=2, depth=3, max_nodes=4) == (
        [7, 5, 1, 9], [0, 1, 2, 0])
    assert proposer.propose(0, tokens) == [7, 5, 1, 2, 3]  # the chain: the most recent
    # A continuation already in the trie adds nothing and does not count.
    assert proposer.propose_tree(1, [1, 2, 9, 1, 2, 9, 1, 2], topk=2, depth=2, max_nodes=6) == (
        [9, 1], [0, 1])


def test_ngram_trees_keep_the_greedy_tokens_and_accept_drafts(checkpoint, engine_kwargs,
                                                              greedy_workload):
    prompts, params, want = greedy_workload("tiny-llama")
    outs = serve_checked(checkpoint("tiny-llama"), engine_kwargs, prompts, params,
               check=lambda engine: _sampled_runs_are_reproducible(engine, prompts[1]),
               speculative_algorithm="NGRAM", speculative_eagle_topk=TOPK,
               speculative_num_steps=STEPS, speculative_num_draft_tokens=NODES)
    assert [o["output_ids"] for o in outs] == want
    verify = [o["meta_info"]["spec_verify_ct"] for o in outs]
    # The workload's repeating prompts give the tries something the target accepts.
    assert sum(p["max_new_tokens"] - 1 for p in params) > sum(verify)
