"""`ForwardBatch`: one step's inputs on the device, as a JAX pytree.

Arrays are data fields; the mode and the capture mode are static (meta) fields, so they pick the
compiled executable and never vary within one. Shapes: T padded tokens, R padded requests,
P pages per request slot.
"""

import dataclasses
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.sampler import SamplingBatch
from jaxrunner.schedule_batch import ModelWorkerBatch


def _static():
    return field(metadata=dict(static=True))


@partial(jax.tree_util.register_dataclass)
@dataclass(frozen=True)
class ForwardBatch:
    forward_mode: ForwardMode = _static()
    capture_hidden_mode: CaptureHiddenMode = _static()
    batch_size: int = _static()           # R: padded request count

    input_ids: jax.Array           # i32[T]
    req_pool_indices: jax.Array    # i32[R]
    seq_lens: jax.Array            # i32[R]: KV length after this step (0 for padding)
    out_cache_loc: jax.Array       # i32[T]: KV slot written by each token
    positions: jax.Array           # i32[T]: position of each token in its sequence
    seq_lens_sum: jax.Array        # i32[]
    # Extend fields; decode fills them too (one token per request), so every mode has one layout.
    extend_num_tokens: jax.Array   # i32[]: real tokens (T counts padding)
    extend_seq_lens: jax.Array     # i32[R]
    extend_prefix_lens: jax.Array  # i32[R]
    extend_start_loc: jax.Array    # i32[R]: first token of each request in input_ids
    # What attention needs.
    token_to_req: jax.Array        # i32[T]: request row of each token (padding -> R-1)
    page_table: jax.Array          # i32[R, P]: KV pages of each request

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def last_token_indices(self) -> jax.Array:
        """i32[R]: the index of each request's last token (the one whose logits are sampled)."""
        return jnp.maximum(self.extend_start_loc + self.extend_seq_lens - 1, 0)

    @classmethod
    def init_new(cls, batch: ModelWorkerBatch,
                 capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL,
                 prev_tokens: jax.Array | None = None) -> tuple["ForwardBatch", SamplingBatch]:
        """Moves `batch` to the device in one transfer and computes positions there.

        `prev_tokens` (i32[N] on the device) are the previous step's sampled tokens, which
        `batch.input_token_src` may point into (overlapped scheduling). Returns the forward batch
        and the sampling arrays, both on the device.
        """
        arrays = (batch.input_ids, batch.input_token_src, batch.req_pool_indices, batch.seq_lens,
                  batch.out_cache_loc, batch.extend_seq_lens, batch.extend_prefix_lens,
                  batch.page_table, batch.sampling)
        if prev_tokens is None:
            arrays += (np.zeros(1, np.int32),)
        (input_ids, input_token_src, req_pool_indices, seq_lens, out_cache_loc, extend_seq_lens,
         extend_prefix_lens, page_table, sampling, *rest) = jax.device_put(arrays)
        prev_tokens = rest[0] if prev_tokens is None else prev_tokens
        input_ids, positions, extend_start_loc, token_to_req, seq_lens_sum, extend_num_tokens = (
            prepare_on_device(input_ids, input_token_src, prev_tokens, extend_prefix_lens,
                               extend_seq_lens, seq_lens, num_tokens=batch.bucket.num_tokens))
        forward_batch = cls(
            forward_mode=batch.forward_mode, capture_hidden_mode=capture_hidden_mode,
            batch_size=batch.bucket.num_reqs, input_ids=input_ids,
            req_pool_indices=req_pool_indices, seq_lens=seq_lens, out_cache_loc=out_cache_loc,
            positions=positions, seq_lens_sum=seq_lens_sum, extend_num_tokens=extend_num_tokens,
            extend_seq_lens=extend_seq_lens, extend_prefix_lens=extend_prefix_lens,
            extend_start_loc=extend_start_loc, token_to_req=token_to_req, page_table=page_table)
        return forward_batch, sampling

    def replace(self, **changes) -> "ForwardBatch":
        return dataclasses.replace(self, **changes)


@partial(jax.jit, static_argnames="num_tokens")
def prepare_on_device(input_ids, input_token_src, prev_tokens, extend_prefix_lens,
                       extend_seq_lens, seq_lens, *, num_tokens: int):
    """Fills tokens still on the device from the previous step's samples, then positions."""
    from_prev = prev_tokens[jnp.clip(input_token_src, 0, prev_tokens.shape[0] - 1)]
    input_ids = jnp.where(input_token_src >= 0, from_prev, input_ids)
    return (input_ids, *compute_positions(extend_prefix_lens, extend_seq_lens, seq_lens,
                                          num_tokens=num_tokens))


@partial(jax.jit, static_argnames="num_tokens")
def compute_positions(extend_prefix_lens, extend_seq_lens, seq_lens, *, num_tokens: int):
    """Positions and request rows of the T flattened tokens.

    Token j of request r sits at position `extend_prefix_lens[r] + j` (decode: `seq_len - 1`).
    Padding tokens get position 0 and the last request row, which has length 0 or is a real
    request whose mask excludes them (attention masks on `token < extend_num_tokens`).
    """
    extend_start_loc = jnp.cumsum(extend_seq_lens) - extend_seq_lens
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    # Request of each token: how many requests start at or before it, minus one.
    token_to_req = jnp.searchsorted(extend_start_loc + extend_seq_lens, token, side="right")
    token_to_req = jnp.minimum(token_to_req, extend_seq_lens.shape[0] - 1).astype(jnp.int32)
    extend_num_tokens = jnp.sum(extend_seq_lens)
    positions = extend_prefix_lens[token_to_req] + token - extend_start_loc[token_to_req]
    positions = jnp.where(token < extend_num_tokens, positions, 0).astype(jnp.int32)
    return (positions, extend_start_loc.astype(jnp.int32), token_to_req,
            jnp.sum(seq_lens).astype(jnp.int32), extend_num_tokens.astype(jnp.int32))
