"""A range of a causal LM's decoder layers, for split prefill (ForwardMode.SPLIT_PREFILL).

SGLang's PD multiplexing runs a prefill a few layers at a time (`forward_split_prefill(
split_index, next_split_index)`) so decode steps can run between the ranges. Here the range
bounds are array data, not part of the program: each run of layers (`ModelConfig.layer_runs`)
is a `lax.fori_loop` over the part of the range inside it (a loop over its repeats of a period
of attention kinds, each segment's part a loop of its own: models/layers/decoder_stack.py),
reading layer l's parameters out of the stacked [L, ...] arrays by a dynamic index. So ONE
executable per prefill bucket serves every range (any start, any length), where a scan of fixed length per range would need one per
(bucket, range length) and a range that crosses a run boundary (Qwen3-MoE's dense first layers)
would need more. The loop body is the scan's (one layer's program), so compile cost still does
not grow with depth; a layer outside the range is skipped by the loop bounds, not computed.

The residual stream between ranges stays on the device as a [C, D] array (C: the largest prefill
bucket's tokens, the same for every bucket, so one resident zeros buffer can enter the first
range). The KV cache is threaded through the loops as through the scans (flat [L * pages, ...],
updated in place).
"""

import jax
import jax.numpy as jnp

from jaxrunner.attention import AttentionBackend
from jaxrunner.batch.forward_batch import ForwardBatch
from models.layers.decoder_stack import run_layer_range
from models.layers.moe_parallel import MoeRunner


def forward_layer_range(model, fb: ForwardBatch, kv_cache, backend: AttentionBackend,
                        moe_runner: MoeRunner, hidden: jax.Array, begin: jax.Array,
                        end: jax.Array):
    """Runs decoder layers [begin, end) of `model` (a causal LM of this package's families) over
    a prepared forward batch.

    hidden [C, D]: the residual stream entering layer `begin` in its first T rows (ignored when
    `begin` is 0: the layers then start from the tokens' embeddings). begin, end: i32[].
    -> (the residual stream after layer `end - 1`, [C, D] with rows past T zero; the updated KV
    cache; i32[MoE layers, P]: the tokens each MoE layer in the range routed to each expert slot,
    zeros for the layers outside it).
    """
    T = fb.num_tokens
    x = jnp.where(begin == 0, model.embed_inputs(fb), hidden[:T])
    x, kv_cache, expert_counts = run_layer_range(model.config, model.model.layers, fb, kv_cache,
                                                 backend, moe_runner, x, begin, end)
    out = jnp.zeros_like(hidden).at[:T].set(x.astype(hidden.dtype))
    return out, kv_cache, expert_counts
