"""Pure-jnp reference for ragged paged attention over a latent KV cache (multi-head latent
attention in the absorbed form, models/layers/mla.py).

Every query token gathers all pages of its sequence and does a masked softmax over them, as the
per-head reference does (kernels_pallas/ragged_paged_attention/reference.py): the oracle the
Pallas kernels are tested against and the `"reference"` backend. Not meant to be fast.
"""

import jax
import jax.numpy as jnp

from kernels_pallas.ragged_paged_attention.reference import token_metadata

# Query tokens processed together by `lax.map`; bounds the gathered KV held at once.
_TOKENS_PER_MAP_STEP = 16


def mla_paged_attention_reference(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                                  sm_scale: float, value_dim: int):
    """Latent paged attention in plain jnp; same contract as `mla_paged_attention`.

    Padded query tokens return zeros. Computation is in float32; the output [T, num_heads,
    value_dim] has q's dtype.
    """
    num_tokens = q.shape[0]
    _, page_size, latent_dim = kv_cache.shape
    max_kv_len = page_indices.shape[1] * page_size
    seq_ids, positions, is_real = token_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)

    def attend_one_token(args):
        q_t, seq, pos, real = args  # [num_heads, latent_dim], scalars
        rows = kv_cache[page_indices[seq]].reshape(max_kv_len, latent_dim).astype(jnp.float32)
        k_pos = jnp.arange(max_kv_len)
        visible = real & (k_pos <= pos) & (k_pos < kv_lens[seq])
        logits = jnp.einsum("hd,ld->hl", q_t.astype(jnp.float32), rows,
                            precision="highest") * sm_scale
        logits = jnp.where(visible, logits, -jnp.inf)
        # Unused pages may hold NaN: zero the rows where invisible so 0 * NaN cannot reach the sum.
        values = jnp.where(visible[:, None], rows[:, :value_dim], 0.0)
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # all-masked row (padding)
        probs = jnp.exp(logits - row_max)
        denom = jnp.sum(probs, axis=-1, keepdims=True)
        out = jnp.einsum("hl,lv->hv", probs, values, precision="highest")
        return out / jnp.where(denom > 0, denom, 1.0)

    out = jax.lax.map(attend_one_token, (q, seq_ids, positions, is_real),
                      batch_size=_TOKENS_PER_MAP_STEP)
    return out.astype(q.dtype)
