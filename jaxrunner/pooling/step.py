"""The pooling step: a prefill chunk through the decoder, then each request's pooled state
through the head."""

from dataclasses import dataclass

from flax import nnx
import jax
import jax.numpy as jnp

from jaxrunner.batch.forward_batch import ForwardBatch


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PoolerOutput:
    # f32[R, E]: each request's result for this chunk: its last token's state (or the sum of
    # its tokens' states, mean pooling) through the head (E: hidden size, or num_labels).
    pooled: jax.Array
    expert_counts: jax.Array   # i32[MoE layers, P], as LogitsOutput's


def pooling_step(graphdef, backend, moe_runner, mode: str, state, kv_cache, fb: ForwardBatch):
    """The compiled step of a pooling model; `mode` "last" or "mean" (a static choice of the
    model's, not a per-batch one). Padding tokens and padded requests pool nothing."""
    fb = fb.prepare()
    model = nnx.merge(graphdef, state)
    hidden, kv_cache, _, expert_counts = model(fb, kv_cache, backend, moe_runner)
    if mode == "mean":
        valid = jnp.arange(fb.num_tokens) < jnp.sum(fb.extend_seq_lens)
        pooled = jax.ops.segment_sum(jnp.where(valid[:, None], hidden, 0).astype(jnp.float32),
                                     fb.token_to_req, num_segments=fb.batch_size)
    else:
        pooled = hidden[fb.last_token_indices]
    return PoolerOutput(model.head(pooled), expert_counts), kv_cache
