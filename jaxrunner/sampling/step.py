"""The compiled sampling program of one step: logits -> penalties and bias -> grammar mask ->
`sampler.sample` -> log-probabilities, the top alternatives, and the slots' token counts.

    (SamplerOutput, SlotState) = sampling_step(logits, batch, state, vocab_mask, num_rows=N)

- Penalties, `logit_bias` and `min_new_tokens` (jaxrunner/sampling/penalties.py) apply to the rows with a
  slot (`batch.slots >= 0`), the grammar's token bitmask (`vocab_mask` i32[R, ceil(V / 32)], bit
  v % 32 of word v // 32 set = token v allowed) to the `constrained` rows. Both are skipped with
  one `lax.cond` when no row asks for either, so plain batches run the sampler they ran before.
- Log-probabilities are the model's own: `log_softmax(logits)` before any of the above, as vLLM
  reports them by default. `top_ids`/`top_logprobs` are its `TOP_LOGPROBS` largest entries
  (`lax.top_k`), computed only when some row asks for alternatives.
- The state is donated: the token counts are updated in place, in the program that samples, so
  the next (overlapped) step reads them on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxrunner.sampling.penalties import SlotState, apply_slot_state, count_tokens
from jaxrunner.sampling.sampler import SamplingBatch, sample

# The most alternatives a request can ask for (OpenAI's `top_logprobs` limit).
TOP_LOGPROBS = 20


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    tokens: jax.Array        # i32[N]: row i is request i's token; rows past R are padding
    logprobs: jax.Array      # f32[N]: log p(token) under the model
    top_ids: jax.Array       # i32[R, TOP_LOGPROBS]: the most likely tokens, best first
    top_logprobs: jax.Array  # f32[R, TOP_LOGPROBS]


def vocab_mask_width(vocab_size: int) -> int:
    """Words of the token bitmask per row."""
    return -(-vocab_size // 32)


def apply_vocab_mask(logits: jax.Array, vocab_mask: jax.Array, rows: jax.Array) -> jax.Array:
    """-inf on the tokens whose bit is clear, in the rows where `rows` is set."""
    R, V = logits.shape
    bits = (vocab_mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
    allowed = bits.reshape(R, -1)[:, :V].astype(jnp.bool_)
    return jnp.where(allowed | ~rows[:, None], logits, -jnp.inf)


def sampling_step(logits: jax.Array, batch: SamplingBatch, state: SlotState,
                  vocab_mask: jax.Array, *, num_rows: int) -> tuple[SamplerOutput, SlotState]:
    """See the module docstring. `logits` f32[R, V] (other floats are upcast)."""
    raw = logits.astype(jnp.float32)
    R = raw.shape[0]

    def adjusted_tokens(raw):
        # Rows without a slot or a grammar pass through both unchanged.
        x = apply_slot_state(raw, batch, state)
        x = apply_vocab_mask(x, vocab_mask, batch.constrained)
        return sample(x, batch)[0]

    # One branch for the whole sampler, returning only the tokens: a conditional whose output
    # is the [R, V] logits makes XLA's CPU backend copy them (10 ms a step at 128 x 32k).
    tokens = jax.lax.cond(jnp.any(batch.slots >= 0) | jnp.any(batch.constrained),
                          adjusted_tokens, lambda raw: sample(raw, batch)[0], raw)
    normaliser = jax.nn.logsumexp(raw, axis=-1)  # [R]
    logprobs = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0] - normaliser

    def top_alternatives():
        values, ids = jax.lax.top_k(raw, TOP_LOGPROBS)
        return ids.astype(jnp.int32), values - normaliser[:, None]

    top_ids, top_logprobs = jax.lax.cond(
        jnp.any(batch.top_logprobs_nums > 0), top_alternatives,
        lambda: (jnp.zeros((R, TOP_LOGPROBS), jnp.int32),
                 jnp.zeros((R, TOP_LOGPROBS), jnp.float32)))
    state = count_tokens(state, batch, tokens)
    pad = (0, num_rows - R)
    return SamplerOutput(jnp.pad(tokens, pad), jnp.pad(logprobs, pad), top_ids,
                         top_logprobs), state
