"""Random ragged batches for the attention tests, and a naive float64 oracle.

Every slot of the KV cache that no real token owns is NaN: the tail of each sequence's last
page, the unused page_indices entries, and the pages of padded sequences. A kernel that lets any
of it reach a real token's output fails the comparison.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from kernels_pallas import ragged_paged_attention_reference


@dataclasses.dataclass(frozen=True)
class Case:
    """One ragged batch: `seqs` lists (q_len, kv_len) per real sequence."""
    seqs: tuple[tuple[int, int], ...]
    num_kv_heads: int = 2
    group: int = 1  # query heads per KV head
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "float32"
    sliding_window: int | None = None
    soft_cap: float | None = None
    padded_seqs: int = 1  # sequences past num_seqs
    padded_tokens: int = 3  # query tokens past cu_q_lens[num_seqs]
    q_scale: float = 1.0  # larger q makes the soft cap bite
    # kv_bound: None (causal), "block:B" (block-diffusion: a token sees to the end of its block
    # of B positions), or "random" (any bound in [1, kv_len], above or below the causal one).
    bound: str | None = None
    kv_dtype: str | None = None  # the cache's dtype when it differs from q's (fp8)
    sinks: bool = False  # a random attention-sink logit per query head (GPT-OSS)

    def __str__(self):
        fields = [f"seqs{list(self.seqs)}", f"kvh{self.num_kv_heads}", f"g{self.group}",
                  f"d{self.head_dim}", f"ps{self.page_size}", self.dtype]
        if self.sliding_window:
            fields.append(f"win{self.sliding_window}")
        if self.soft_cap:
            fields.append(f"cap{self.soft_cap}")
        if self.bound:
            fields.append(f"bound-{self.bound}")
        if self.kv_dtype:
            fields.append(f"kv-{self.kv_dtype}")
        if self.sinks:
            fields.append("sinks")
        return "-".join(fields).replace(" ", "")


@dataclasses.dataclass
class Inputs:
    args: tuple  # (q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs) as jax arrays
    kwargs: dict  # sm_scale, sliding_window, soft_cap
    num_real_tokens: int
    q64: np.ndarray  # [T, num_q_heads, head_dim] float64, as rounded to the case dtype
    k64: list  # per sequence [kv_len, num_kv_heads, head_dim] float64
    v64: list
    bounds: list | None = None  # per sequence i32[q_len]: the kv_bound of its tokens


def make_inputs(case: Case, seed: int = 0) -> Inputs:
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(case.dtype)
    kvh, page_size, head_dim = case.num_kv_heads, case.page_size, case.head_dim
    num_q_heads = kvh * case.group
    pages_needed = [math.ceil(kv_len / page_size) for _, kv_len in case.seqs]
    pages_per_seq = max(pages_needed) + 1  # at least one unused entry per sequence
    num_spare_pages = 3  # all-NaN pages that unused page_indices entries point at
    num_pages = 1 + sum(pages_needed) + num_spare_pages  # page 0 is the dummy page
    max_num_seqs = len(case.seqs) + case.padded_seqs

    kv_dtype = jnp.dtype(case.kv_dtype or case.dtype)

    def rounded(shape, scale=1.0, dtype=dtype):
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)

    kv_cache = np.full((num_pages, page_size, 2 * kvh, head_dim), np.nan, np.float32)
    page_order = rng.permutation(np.arange(1, num_pages))
    used, spare = page_order[:sum(pages_needed)], page_order[sum(pages_needed):]
    page_indices = rng.choice(spare, size=(max_num_seqs, pages_per_seq)).astype(np.int32)
    kv_lens = np.zeros(max_num_seqs, np.int32)
    k64, v64 = [], []
    next_page = 0
    for s, (q_len, kv_len) in enumerate(case.seqs):
        assert 0 < q_len <= kv_len, (q_len, kv_len)
        kv_lens[s] = kv_len
        pages = used[next_page:next_page + pages_needed[s]]
        next_page += pages_needed[s]
        page_indices[s, :len(pages)] = pages
        shape = (kv_len, kvh, head_dim)
        k, v = rounded(shape, dtype=kv_dtype), rounded(shape, dtype=kv_dtype)
        k64.append(k)
        v64.append(v)
        for pos in range(kv_len):
            page, offset = pages[pos // page_size], pos % page_size
            kv_cache[page, offset, 0::2] = k[pos]
            kv_cache[page, offset, 1::2] = v[pos]

    q_lens = [q_len for q_len, _ in case.seqs] + [0] * case.padded_seqs
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_real_tokens = int(cu_q_lens[-1])
    q64 = rounded((num_real_tokens + case.padded_tokens, num_q_heads, head_dim), case.q_scale)
    args = (jnp.asarray(q64, dtype), jnp.asarray(kv_cache, kv_dtype), jnp.asarray(kv_lens),
            jnp.asarray(page_indices), jnp.asarray(cu_q_lens),
            jnp.asarray([len(case.seqs)], jnp.int32))
    kwargs = dict(sm_scale=head_dim ** -0.5, sliding_window=case.sliding_window,
                  soft_cap=case.soft_cap)
    if case.sinks:
        # Around the logits' own scale, so the sink takes a real share of some rows, not all.
        kwargs["sinks"] = jnp.asarray(rng.uniform(-2.0, 3.0, num_q_heads).astype(np.float32))
    bounds = None
    if case.bound is not None:
        bounds = [_bounds(case.bound, q_len, kv_len, rng) for q_len, kv_len in case.seqs]
        # Padded tokens get garbage bounds: a kernel must ignore them.
        pad = rng.integers(0, 1000, case.padded_tokens)
        kwargs["kv_bound"] = jnp.asarray(np.concatenate(bounds + [pad]).astype(np.int32))
    return Inputs(args, kwargs, num_real_tokens, q64, k64, v64, bounds)


def _bounds(kind: str, q_len: int, kv_len: int, rng) -> np.ndarray:
    pos = np.arange(kv_len - q_len, kv_len)
    if kind == "random":
        return rng.integers(1, kv_len + 1, q_len)
    block = int(kind.removeprefix("block:"))
    return np.minimum((pos // block + 1) * block, kv_len)


def naive_attention(case: Case, inputs: Inputs) -> np.ndarray:
    """Dense causal (or kv_bound) attention per sequence in float64 from the unpaged K/V: the
    oracle.

    Returns [num_real_tokens, num_q_heads, head_dim].
    """
    sm_scale = inputs.kwargs["sm_scale"]
    out = []
    q_start = 0
    for s, ((q_len, kv_len), k, v) in enumerate(zip(case.seqs, inputs.k64, inputs.v64)):
        q = inputs.q64[q_start:q_start + q_len]  # [q_len, num_q_heads, head_dim]
        q_start += q_len
        k = np.repeat(k, case.group, axis=1)  # [kv_len, num_q_heads, head_dim]
        v = np.repeat(v, case.group, axis=1)
        logits = np.einsum("qhd,khd->hqk", q, k) * sm_scale
        if case.soft_cap:
            logits = case.soft_cap * np.tanh(logits / case.soft_cap)
        q_pos = np.arange(kv_len - q_len, kv_len)[:, None]
        k_pos = np.arange(kv_len)[None, :]
        visible = k_pos <= q_pos if inputs.bounds is None else k_pos < inputs.bounds[s][:, None]
        if case.sliding_window:
            visible &= k_pos > q_pos - case.sliding_window
        logits = np.where(visible, logits, -np.inf)
        row_max = logits.max(axis=-1, keepdims=True)
        probs = np.exp(logits - row_max)
        denom = probs.sum(axis=-1, keepdims=True)
        if "sinks" in inputs.kwargs:  # [H] logits in the denominator only
            sinks = np.asarray(inputs.kwargs["sinks"], np.float64)[:, None, None]
            denom = denom + np.exp(sinks - row_max)
        probs /= denom
        out.append(np.einsum("hqk,khd->qhd", probs, v))
    return np.concatenate(out)


def tolerance(dtype: str) -> float:
    return {"float32": 1e-5, "bfloat16": 2e-2}[dtype]


def assert_matches_reference(case: Case, inputs: Inputs, out) -> None:
    """A kernel's output `out` is finite everywhere (padded rows included) and, on the real
    tokens, the jnp reference's within the case dtype's tolerance."""
    expected = ragged_paged_attention_reference(*inputs.args, **inputs.kwargs)
    n = inputs.num_real_tokens
    out = np.asarray(out.astype(np.float32))
    assert np.isfinite(out).all(), "NaN/inf in the output (padded rows included)"
    tol = tolerance(case.dtype)
    np.testing.assert_allclose(out[:n], np.asarray(expected[:n].astype(np.float32)),
                               atol=tol, rtol=tol)
