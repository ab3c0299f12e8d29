"""The draft tree's mask (`kv_tree_mask`: a verify token sees the prefix and its tree ancestors)
in every kernel, against a float64 oracle and the jnp reference.

Trees are random (each node's parent any earlier node), from 3 to 40 tokens per request, so one
and two mask words both run; one case sets random bits (not a tree) so a kernel that only
follows a tree's shape cannot pass. Unused pages are NaN as in the causal tests.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.attention import AttentionConfig, NativeAttentionBackend
from jaxrunner.batch.forward_batch import ForwardBatch
import kernels_cpu
from kernels_pallas import pack_tree_mask, ragged_paged_attention_reference
from tests.support.attention import (
    PALLAS_KERNELS,
    SMALL_BLOCKS,
    dense_attention,
    kernel_runs,
    make_batch,
)
from tests.support.ragged_cases import Case, make_inputs, tolerance

# (case, random bits instead of a tree)
CASES = [
    (Case(seqs=((4, 12), (7, 7), (5, 37)), group=2), False),
    (Case(seqs=((40, 50), (3, 20)), num_kv_heads=1, group=4, page_size=16), False),
    (Case(seqs=((6, 30), (16, 16)), group=2, dtype="bfloat16"), False),
    (Case(seqs=((8, 24), (5, 9)), group=2, soft_cap=5.0, q_scale=4.0), True),
]


def random_tree(rng, n: int) -> np.ndarray:
    """bool[n, n]: node i sees node j (j an ancestor of i, or i itself); node 0 is the root."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    seen = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            seen[i, j] = True
            j = parent[j]
    return seen


def with_tree(case: Case, random_bits: bool, seed: int):
    """The case's inputs with a tree mask (padded tokens get garbage words), and each
    sequence's bool[q_len, q_len] visibility of its new tokens."""
    inputs = make_inputs(case, seed=seed)
    rng = np.random.default_rng(seed + 1)
    width = max(q for q, _ in case.seqs)
    rows, trees = [], []
    for q_len, _ in case.seqs:
        seen = rng.random((q_len, q_len)) < 0.5 if random_bits else random_tree(rng, q_len)
        trees.append(seen)
        rows.append(np.pad(seen, ((0, 0), (0, width - q_len))))
    visible = np.concatenate(rows + [rng.random((case.padded_tokens, width)) < 0.5])
    inputs.kwargs["kv_tree_mask"] = pack_tree_mask(jnp.asarray(visible))
    return inputs, trees


def tree_oracle(case: Case, inputs, trees) -> np.ndarray:
    """Dense float64 attention per sequence: causal, and of the new tokens only the seen ones."""
    out, start = [], 0
    for (q_len, kv_len), k, v, seen in zip(case.seqs, inputs.k64, inputs.v64, trees):
        q = inputs.q64[start:start + q_len]
        start += q_len
        k, v = np.repeat(k, case.group, axis=1), np.repeat(v, case.group, axis=1)
        logits = np.einsum("qhd,khd->hqk", q, k) * inputs.kwargs["sm_scale"]
        if case.soft_cap:
            logits = case.soft_cap * np.tanh(logits / case.soft_cap)
        prefix = kv_len - q_len
        k_pos = np.arange(kv_len)[None, :]
        visible = k_pos <= np.arange(prefix, kv_len)[:, None]
        visible[:, prefix:] &= seen
        logits = np.where(visible, logits, -np.inf)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        out.append(np.einsum("hqk,khd->qhd", probs / probs.sum(-1, keepdims=True), v))
    return np.concatenate(out)


def _check(case, inputs, out, expected):
    n = inputs.num_real_tokens
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert np.isfinite(out).all(), "NaN/inf in the output (padded rows included)"
    tol = tolerance(case.dtype)
    np.testing.assert_allclose(out[:n], np.asarray(expected[:n], np.float32), atol=tol, rtol=tol)


def _reference(inputs):
    return ragged_paged_attention_reference(*inputs.args, **inputs.kwargs)


@pytest.mark.parametrize("case, random_bits", CASES, ids=str)
def test_reference_tree_matches_float64_oracle(case, random_bits):
    inputs, trees = with_tree(case, random_bits, seed=4)
    out = jax.jit(lambda *a: ragged_paged_attention_reference(*a, **inputs.kwargs))(*inputs.args)
    _check(case, inputs, out, tree_oracle(case, inputs, trees))


def test_tree_mask_changes_the_output():
    """A tree that is not a chain gives other outputs than causal attention (so the tree
    tests above cannot pass by ignoring the mask)."""
    case = CASES[0][0]
    inputs, _ = with_tree(case, False, seed=4)
    causal = dict(inputs.kwargs, kv_tree_mask=None)
    plain = ragged_paged_attention_reference(*inputs.args, **causal)
    tree = _reference(inputs)
    assert not np.allclose(np.asarray(plain), np.asarray(tree), atol=1e-3)


@pytest.mark.parametrize("case, random_bits", CASES, ids=str)
def test_cpu_kernel_with_tree(case, random_bits):
    inputs, trees = with_tree(case, random_bits, seed=6)
    out = jax.jit(lambda *a: kernels_cpu.ragged_paged_attention_cpu(*a, **inputs.kwargs))(
        *inputs.args)
    _check(case, inputs, out, _reference(inputs))
    assert (np.asarray(out)[inputs.num_real_tokens:] == 0).all()


@pytest.mark.parametrize("backend, interpret", kernel_runs())
@pytest.mark.parametrize("case, random_bits", CASES[:2] + CASES[3:], ids=str)
def test_pallas_kernel_with_tree(case, random_bits, backend, interpret):
    inputs, _ = with_tree(case, random_bits, seed=6)
    out = PALLAS_KERNELS[backend](*inputs.args, **inputs.kwargs, block_sizes=SMALL_BLOCKS[backend],
                                  interpret=interpret)
    _check(case, inputs, out, _reference(inputs))


def test_bad_tree_mask_shape_is_rejected():
    inputs = make_inputs(Case(seqs=((4, 8),)), seed=0)
    T = inputs.args[0].shape[0]
    for bad in (jnp.zeros((T, 3), jnp.int32), jnp.zeros((T - 1, 1), jnp.int32),
                jnp.zeros((T, 1), jnp.float32)):
        with pytest.raises(ValueError, match="kv_tree_mask must be i32"):
            kernels_cpu.ragged_paged_attention_cpu(*inputs.args, **inputs.kwargs,
                                                   kv_tree_mask=bad)


def test_native_backend_with_tree():
    """`ForwardBatch.kv_tree_mask` in the native backend: a verify-shaped batch (requests of W
    tree tokens on prefixes, one tree from scratch), against dense attention per token."""
    prefix_lens, new_lens, T, R = [9, 0, 21], [5, 6, 5], 18, 4
    cfg = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, sm_scale=0.25)
    rng = np.random.default_rng(7)
    cache, q, k_new, v_new, full_k, full_v, wb = make_batch(
        rng, prefix_lens, new_lens, cfg, num_pages=40, T=T, R=R, max_pages=8)
    trees = [random_tree(rng, n) for n in new_lens]
    visible = np.zeros((T, max(new_lens)), bool)
    start = 0
    for seen, n in zip(trees, new_lens):
        visible[start:start + n, :n] = seen
        start += n
    backend = NativeAttentionBackend(cfg)
    fb, _ = ForwardBatch.init_new(wb, jnp.zeros(4, jnp.int32), jnp.zeros((1, 1)))

    @jax.jit
    def run(q, k, v, cache, fb, mask):
        fb = fb.prepare().replace(kv_tree_mask=mask)
        return backend.forward(q, k, v, cache, jnp.int32(0), fb,
                               backend.init_forward_metadata(fb))[0]

    out = np.asarray(run(q, k_new, v_new, cache, fb, pack_tree_mask(jnp.asarray(visible))))
    start = 0
    for i, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        for j in range(n):  # one query at a time over its prefix and tree ancestors
            keys = np.concatenate([np.arange(p), p + np.flatnonzero(trees[i][j])])
            want = dense_attention(q[start + j:start + j + 1], full_k[i][keys], full_v[i][keys],
                                   np.array([len(keys) - 1]), len(keys), cfg.sm_scale)
            np.testing.assert_allclose(out[start + j:start + j + 1], want, rtol=1e-5, atol=1e-5)
        start += n
    assert np.isfinite(out).all()
