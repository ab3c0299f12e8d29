"""The DLLM_EXTEND step: the model over every request's current block, then the commits.

Each request brings exactly B tokens (its block: prompt tokens, committed tokens and mask
tokens), request r's at rows [r B, (r + 1) B); padding requests bring none. Attention is
block-causal: a token sees the cached KV of the blocks before its own and every position of its
own block (`block_bound`). The step writes the block's K/V to its slots each time; the slots hold
the final block's KV once the block is decided and has run once more (the scheduler's store
pass), which is what the next block reads.
"""

from flax import nnx
import jax
import jax.numpy as jnp

from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.dllm.algorithm import low_confidence


def block_bound(fb: ForwardBatch, block_size: int) -> jax.Array:
    """i32[T] (`ForwardBatch.kv_bound`): token t sees the KV positions before the end of its
    block of `block_size`, never past its request's length. Prefill of whole prompt blocks and
    DLLM steps alike (the positions say which block a token is in)."""
    end = (fb.positions // block_size + 1) * block_size
    return jnp.minimum(end, fb.seq_lens[fb.token_to_req]).astype(jnp.int32)


def dllm_step(graphdef, backend, moe_runner, block_size: int, mask_id: int, threshold: float,
              state, kv_cache, fb: ForwardBatch):
    """(weights, kv_cache, fb with `spec_info` a DllmInput) -> (i32[R, B] the blocks after this
    step's commits, kv_cache)."""
    info = fb.spec_info
    fb = fb.prepare()
    fb = fb.replace(kv_bound=block_bound(fb, block_size))
    model = nnx.merge(graphdef, state)
    hidden, kv_cache, _, _ = model(fb, kv_cache, backend, moe_runner, aux_layers=())
    R = fb.batch_size
    logits = model.compute_logits(hidden).reshape(R, fb.num_tokens // R, -1)
    tokens = fb.input_ids.reshape(R, -1)
    return low_confidence(logits, tokens, info, mask_id=mask_id, threshold=threshold), kv_cache
