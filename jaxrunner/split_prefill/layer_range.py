"""A range of a causal LM's decoder layers, for split prefill (ForwardMode.SPLIT_PREFILL).

SGLang's PD multiplexing runs a prefill a few layers at a time (`forward_split_prefill(
split_index, next_split_index)`) so decode steps can run between the ranges. Here the range
bounds are array data, not part of the program: each run of layers (`ModelConfig.layer_runs`)
is a `lax.fori_loop` over the part of the range inside it, reading layer l's parameters out of
the stacked [L, ...] arrays by a dynamic index. So ONE executable per prefill bucket serves
every range (any start, any length), where a scan of fixed length per range would need one per
(bucket, range length) and a range that crosses a run boundary (Qwen3-MoE's dense first layers)
would need more. The loop body is the scan's (one layer's program), so compile cost still does
not grow with depth; a layer outside the range is skipped by the loop bounds, not computed.

The residual stream between ranges stays on the device as a [C, D] array (C: the largest prefill
bucket's tokens, the same for every bucket, so one resident zeros buffer can enter the first
range). The KV cache is threaded through the loops as through the scans (flat [L * pages, ...],
updated in place).
"""

from flax import nnx
import jax
import jax.numpy as jnp

from jaxrunner.attention import AttentionBackend
from jaxrunner.batch.forward_batch import ForwardBatch
from models.layers.moe_parallel import MoeRunner
from models.layers.packed import filled, hollow
from models.layers.rope import step_cos_sin


def forward_layer_range(model, fb: ForwardBatch, kv_cache: jax.Array, backend: AttentionBackend,
                        moe_runner: MoeRunner, hidden: jax.Array, begin: jax.Array,
                        end: jax.Array):
    """Runs decoder layers [begin, end) of `model` (a LlamaForCausalLM) over a prepared forward
    batch.

    hidden [C, D]: the residual stream entering layer `begin` in its first T rows (ignored when
    `begin` is 0: the layers then start from the tokens' embeddings). begin, end: i32[].
    -> (the residual stream after layer `end - 1`, [C, D] with rows past T zero; the updated KV
    cache; i32[MoE layers, P]: the tokens each MoE layer in the range routed to each expert slot,
    zeros for the layers outside it).
    """
    cfg = model.config
    T = fb.num_tokens
    meta = backend.init_forward_metadata(fb)
    cos, sin = step_cos_sin(cfg.rope, cfg.head_dim, fb.positions)
    x = jnp.where(begin == 0, fb.embed_inputs(model.model.embed_tokens), hidden[:T])
    valid = jnp.arange(T) < jnp.sum(fb.extend_seq_lens)  # padding routes nowhere
    flat = kv_cache.reshape(-1, *kv_cache.shape[2:])
    counts = []
    for run, layers in zip(cfg.layer_runs, model.model.layers):
        graphdef, layers_state = nnx.split(layers)
        layers_state, stacks = hollow(layers_state)  # packed weights stay whole
        run_counts = jnp.zeros((run.num_layers if run.moe else 0, cfg.num_physical_experts),
                               jnp.int32)

        def body(index, carry, graphdef=graphdef, layers_state=layers_state, stacks=stacks,
                 run=run):
            x, flat_cache, run_counts = carry
            i = index - run.start
            state = filled(jax.tree.map(lambda p: jax.lax.dynamic_index_in_dim(
                p, i, keepdims=False), layers_state), stacks, i)
            layer = nnx.merge(graphdef, state)
            x, flat_cache, layer_counts = layer(x, cos, sin, flat_cache, index, fb, backend,
                                                meta, valid, moe_runner)
            if layer_counts is not None:
                run_counts = jax.lax.dynamic_update_index_in_dim(run_counts, layer_counts, i, 0)
            return x, flat_cache, run_counts

        lo = jnp.clip(begin, run.start, run.start + run.num_layers)
        hi = jnp.clip(end, lo, run.start + run.num_layers)
        x, flat, run_counts = jax.lax.fori_loop(lo, hi, body, (x, flat, run_counts))
        if run.moe:
            counts.append(run_counts)
    expert_counts = (jnp.concatenate(counts) if counts
                     else jnp.zeros((0, cfg.num_physical_experts), jnp.int32))
    out = jnp.zeros_like(hidden).at[:T].set(x.astype(hidden.dtype))
    return out, flat.reshape(kv_cache.shape), expert_counts
