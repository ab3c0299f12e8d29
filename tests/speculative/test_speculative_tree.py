"""Tree drafting (speculative_eagle_topk > 1): the tree's construction, greedy acceptance along
it and the accepted path's KV move, on small hand-made cases; sampled acceptance keeps the
target's distribution (chi-square, and a wrong rule fails it); then end to end, a standalone
draft that is the target keeps the greedy tokens and accepts the tree's full depth."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner import Engine
from jaxrunner.sampling.batch import SamplingBatch
from jaxrunner.sampling.params import SamplingParams
from jaxrunner.speculative.tree import accept_tree_greedy, ancestry, compact_path_kv, expand, select
from jaxrunner.speculative.tree_sampling import accept_tree_sampled
from tests.support.engine import CompileCounter, assert_no_kv_cache_copy
from tests.support.speculative import chi2_pvalue, serve_checked, target_first_token_probs

# 8 nodes: the 7 best of the tree's 10 candidates. The full-depth check needs the target's
# greedy path to survive the pruning by cumulative score (SGLang's rule, which does not promise
# it); on this workload it does with 7 nodes, and with 5 four requests lose a round.
TOPK, STEPS, NODES = 2, 3, 8

# A tree of 6 slots: 0 root; 1, 2 its children; 3 under 1; 4 under 3; 5 under 2.
PARENTS = np.array([[-1, 0, 0, 1, 3, 2]], np.int32)


def test_ancestry_gives_each_node_its_path_and_depth():
    sees, depth = ancestry(jnp.asarray(PARENTS), max_depth=3)
    assert depth.tolist() == [[0, 1, 1, 2, 3, 2]]
    assert np.flatnonzero(np.asarray(sees[0, 4])).tolist() == [0, 1, 3, 4]
    assert np.flatnonzero(np.asarray(sees[0, 5])).tolist() == [0, 2, 5]


def test_select_keeps_the_best_nodes_with_their_parents():
    # Step 0: children a (-1), b (-2) of the root; step 1: a's children (-1.5, -3), b's (-2.2, -9).
    tokens = jnp.asarray([[10, 11, 20, 21, 30, 31]], jnp.int32)
    scores = jnp.asarray([[-1.0, -2.0, -1.5, -3.0, -2.2, -9.0]])
    parents = jnp.asarray([[-1, -1, 0, 0, 1, 1]], jnp.int32)
    chosen, tree_parents, cand = select(tokens, scores, parents, num_nodes=5)
    # The best four: a, b, a's first, b's first, in candidate order (parents first).
    assert chosen.tolist() == [[10, 11, 20, 30]]
    assert tree_parents.tolist() == [[-1, 0, 0, 1, 2]]
    assert cand.tolist() == [[0, 1, 2, 4]]


def test_expand_scores_children_by_their_path():
    logprobs = jnp.log(jnp.asarray([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]]))
    tokens, scores, parent = expand(logprobs, jnp.asarray([[-1.0, -2.0]]), topk=2)
    assert tokens.tolist() == [[0, 1, 2, 0]]
    assert parent.tolist() == [[0, 0, 1, 1]]
    np.testing.assert_allclose(scores, [[-1 + np.log(.5), -1 + np.log(.3), -2 + np.log(.8),
                                         -2 + np.log(.1)]], rtol=1e-6)


def _logits_choosing(next_tokens, vocab=40):
    """f32[1, N, V] whose argmax at slot j is next_tokens[j]."""
    logits = np.zeros((1, len(next_tokens), vocab), np.float32)
    logits[0, np.arange(len(next_tokens)), next_tokens] = 5.0
    return jnp.asarray(logits)


def test_greedy_acceptance_takes_the_deepest_matching_path():
    tokens = jnp.asarray([[7, 11, 12, 13, 14, 15]], jnp.int32)
    # The target continues 7 -> 11 -> 13 -> 14 -> 33: the path 0-1-3-4 matches throughout.
    logits = _logits_choosing([11, 13, 30, 14, 33, 31])
    has_kv = jnp.ones((1, 6), bool)
    accept, out, logprobs, path = accept_tree_greedy(logits, tokens, jnp.asarray(PARENTS),
                                                     jnp.asarray([3]), has_kv, 3)
    assert accept.tolist() == [3]
    assert out.tolist() == [[11, 13, 14, 33, 0, 0]]
    assert path[0, :4].tolist() == [0, 1, 3, 4]
    # Each token is its slot's argmax: 5 against 39 zeros.
    np.testing.assert_allclose(logprobs[0, :4], 5 - np.log(np.exp(5) + 39), rtol=1e-5)
    # A limit of one draft stops at node 1; a node without KV (slot 3) cuts its subtree.
    accept, out, _, _ = accept_tree_greedy(logits, tokens, jnp.asarray(PARENTS),
                                           jnp.asarray([1]), has_kv, 3)
    assert (accept.tolist(), out[0, :2].tolist()) == ([1], [11, 13])
    accept, _, _, _ = accept_tree_greedy(logits, tokens, jnp.asarray(PARENTS), jnp.asarray([3]),
                                         has_kv.at[0, 3].set(False), 3)
    assert accept.tolist() == [1]
    # The other branch: the target takes 12 after the root, then 15.
    accept, out, _, path = accept_tree_greedy(_logits_choosing([12, 0, 15, 0, 0, 9]), tokens,
                                              jnp.asarray(PARENTS), jnp.asarray([3]), has_kv, 3)
    assert (accept.tolist(), out[0, :3].tolist(), path[0, :3].tolist()) == (
        [2], [12, 15, 9], [0, 2, 5])


def test_compact_moves_the_path_next_to_the_prefix_in_every_layer():
    layers, pages, page_size = 2, 6, 4
    cache = jnp.arange(layers * pages * page_size * 2, dtype=jnp.float32).reshape(
        layers, pages, page_size, 2, 1)
    slots = jnp.asarray([[8, 9, 10, 11, 12, 13]], jnp.int32)
    path = jnp.asarray([[0, 2, 5, 0, 0, 0]], jnp.int32)
    new = compact_path_kv(cache, slots, path, jnp.asarray([2]))
    rows, new_rows = (np.asarray(x).reshape(layers, pages * page_size, 2)
                      for x in (cache, new))
    for layer in range(layers):
        want = rows[layer].copy()
        want[9], want[10] = rows[layer][10], rows[layer][13]
        np.testing.assert_array_equal(new_rows[layer], want)


# ---- end to end ---------------------------------------------------------------------------

TREE = dict(speculative_algorithm="STANDALONE", speculative_eagle_topk=TOPK,
            speculative_num_steps=STEPS, speculative_num_draft_tokens=NODES)


def test_a_tree_keeps_the_greedy_tokens_and_accepts_the_full_depth(checkpoint, engine_kwargs,
                                                                   greedy_workload):
    """Ragged requests sharing prefixes, chunked: identical greedy tokens, 0 compiles after
    warm-up and every page free (`serve_checked`), and every round accepts all STEPS levels of
    the tree plus the target's token."""
    path = checkpoint("tiny-llama")
    prompts, params, want = greedy_workload("tiny-llama")

    def more_checks(engine):
        # The tree steps (and the path's KV move) copy no KV cache.
        assert_no_kv_cache_copy(engine.runner)
        assert_no_kv_cache_copy(engine.worker.draft)
        # Sampled requests run through the same executables, reproducibly by seed.
        sampled = [{"max_new_tokens": 9, "temperature": 0.9, "seed": seed, "ignore_eos": True}
                   for seed in (5, 5, 6)]
        with CompileCounter() as counter:
            outs = engine.generate(input_ids=[prompts[0]] * 3, sampling_params=sampled)
        assert counter.count == 0
        assert outs[0]["output_ids"] == outs[1]["output_ids"] != outs[2]["output_ids"]

    outs = serve_checked(path, engine_kwargs, prompts, params, check=more_checks, **TREE,
                         speculative_draft_model_path=str(path))
    assert [o["output_ids"] for o in outs] == want
    for out, p in zip(outs, params):
        rounds = -(-(p["max_new_tokens"] - 1) // (STEPS + 1))
        assert out["meta_info"]["spec_verify_ct"] == rounds


def _tree_samples(logits, tokens, n):
    """The accepted lengths and tokens of n verify steps over the same logits and tree
    (`PARENTS`), each with its own seed: temperature 1, top-k 6, top-p 0.9."""
    params = [SamplingParams(temperature=1.0, top_k=6, top_p=0.9).normalized()] * n
    batch = SamplingBatch.from_params(params, [0] * n, list(range(n)), n)
    N, V = logits.shape
    accept, out, _, _ = accept_tree_sampled(
        jnp.broadcast_to(logits, (n, N, V)), jnp.broadcast_to(jnp.asarray(tokens), (n, N)),
        jnp.broadcast_to(jnp.asarray(PARENTS), (n, N)), jnp.full(n, 3), jnp.ones((n, N), bool),
        batch, 3)
    return np.asarray(accept), np.asarray(out)


def test_tree_sampling_keeps_the_targets_distribution_and_a_wrong_rule_does_not():
    rng = np.random.default_rng(1)
    V, n = 12, 20000
    logits = (2.0 * rng.standard_normal((6, V))).astype(np.float32)
    probs = target_first_token_probs(logits)
    order = np.argsort(-probs)
    # The root's children are the target's two most likely tokens; slot 1 has child 3.
    tokens = np.array([0, order[0], order[1], 3, 5, 7], np.int32)
    accept, out = _tree_samples(jnp.asarray(logits), tokens, n)
    first = out[:, 0]
    assert chi2_pvalue(np.bincount(first, minlength=V), probs) > 1e-3
    # Every branch ran: the first child, the second after it, neither.
    for token in (order[0], order[1]):
        assert 0.05 < np.mean(first == token) < 0.95
    assert 0.02 < np.mean(accept == 0) < 0.95
    # One level down: after the first child, the next token has slot 1's distribution.
    second = out[first == order[0], 1]
    assert chi2_pvalue(np.bincount(second, minlength=V), target_first_token_probs(logits[1:])
                        ) > 1e-3
    # A wrong rule: when both children are rejected, draw from p rather than from p without
    # them (the siblings' residual).
    wrong = first.copy()
    redo = accept == 0
    wrong[redo] = rng.choice(V, size=int(redo.sum()), p=probs)
    assert chi2_pvalue(np.bincount(wrong, minlength=V), probs) < 1e-6


@pytest.mark.parametrize("spec,message", [
    (dict(TREE, speculative_num_draft_tokens=4), "too small for the draft tree"),
    (dict(TREE, speculative_num_draft_tokens=12), "exceeds the root and the 10 candidates"),
])
def test_bad_tree_arguments_are_refused(checkpoint, spec, message):
    path = str(checkpoint("tiny-llama"))
    with pytest.raises(ValueError, match=message):
        Engine(model_path=path, **dict(spec, speculative_draft_model_path=path))
