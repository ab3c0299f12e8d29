"""Per-request-slot sampling state on the device: what penalties, `logit_bias` and
`min_new_tokens` need from one step to the next.

`SlotState` has one row per request slot (`Req.req_pool_idx`, the slots of `ReqToTokenPool`):

- `output_counts` i32[S, V]: how often each token was sampled (frequency, presence, and the
  output half of the repetition penalty). The sampler adds each step's tokens in the same
  program that samples them, so with overlapped scheduling the next step already sees them.
- `prompt_bits` u32[S, ceil(V / 32)]: the tokens of the prompt, one bit each (the repetition
  penalty covers prompt and output, as in SGLang and vLLM). Bits in 32-bit words, not a bool
  [S, V]: XLA:TPU compiles a scatter into a bool or int8 array slowly (`init_slots` at 257 slots
  and a 128k vocabulary for v6e: 94-120 s with the bool mask, 2.6 s with the bits), and the bits
  take an eighth of the bytes. A bit is set by adding it, so `SlotInit.pack` sends each (slot,
  prompt token) once after the slot's reset.
- a bias table of `BIAS_TABLE_SIZE` (token id, value, until) entries: `logit_bias`, and -inf on
  the EOS and stop ids while the request has sampled fewer than `min_new_tokens`.

Size: at a 152k vocabulary and 257 slots the counts take 156 MB and the prompt bits 5 MB; the
engine sets it aside before sizing the KV cache. A row is written only when a request that uses
it takes the slot (`init_slots`, from `SlotInit` host data: reset, then its prompt and any output
it already has, e.g. after a retraction) and read only by the rows of such requests, so requests
that ask for none of this pay nothing but two predicates.

The formulas (`apply_slot_state`), on the raw logits x of a row with slot s:
    seen = prompt_mask(s) | (output_counts[s] > 0)
    x = where(seen, where(x > 0, x / repetition, x * repetition), x)
    x = x - frequency * output_counts[s] - presence * (output_counts[s] > 0)
    x[bias_ids[s, k]] += bias_values[s, k]   for every entry with step < bias_until[s, k]
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxrunner.sampling.batch import BIAS_TABLE_SIZE, SamplingBatch, SlotInit

# Slots reset and tokens scattered by one call of the initialising program.
INIT_ROWS = 16
INIT_TOKENS = 2048


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SlotState:
    output_counts: jax.Array  # i32[S, V]
    prompt_bits: jax.Array    # u32[S, ceil(V / 32)]
    bias_ids: jax.Array       # i32[S, K]
    bias_values: jax.Array    # f32[S, K]
    bias_until: jax.Array     # i32[S, K]

    @property
    def num_slots(self) -> int:
        return self.output_counts.shape[-2]

    def prompt_mask(self, rows: jax.Array) -> jax.Array:
        """bool[R, V]: whether each token is in the prompt of slot `rows[r]`."""
        words = self.prompt_bits[rows]  # [R, W]
        bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
        return bits.reshape(rows.shape[0], -1)[:, :self.output_counts.shape[-1]].astype(jnp.bool_)


jax.tree_util.register_dataclass(
    SlotInit, data_fields=["rows", "bias_ids", "bias_values", "bias_until", "token_slots",
                           "token_ids", "token_in_prompt"], meta_fields=[])


def slot_state_spec(num_slots: int, vocab_size: int, sharding=None) -> SlotState:
    """Shapes and dtypes of the state, for lowering and allocation."""
    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    S, V, K = num_slots, vocab_size, BIAS_TABLE_SIZE
    return SlotState(spec((S, V), jnp.int32), spec((S, -(-V // 32)), jnp.uint32),
                     spec((S, K), jnp.int32),
                     spec((S, K), jnp.float32), spec((S, K), jnp.int32))


def slot_state_bytes(num_slots: int, vocab_size: int) -> int:
    return sum(int(s.size) * s.dtype.itemsize
               for s in jax.tree.leaves(slot_state_spec(num_slots, vocab_size)))


def slot_init_spec() -> SlotInit:
    """Shapes and dtypes of one initialising call."""
    B, K, N = INIT_ROWS, BIAS_TABLE_SIZE, INIT_TOKENS
    i32, f32 = jnp.int32, jnp.float32
    return SlotInit(*(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((B,), i32), ((B, K), i32), ((B, K), f32), ((B, K), i32), ((N,), i32), ((N,), i32),
        ((N,), jnp.bool_))))


def zeros_slot_state(num_slots: int, vocab_size: int, sharding=None,
                     dp_size: int = 1) -> SlotState:
    """A fresh state (under DP attention one per rank, stacked), made on the devices."""
    lead = () if dp_size == 1 else (dp_size,)
    spec = slot_state_spec(num_slots, vocab_size)
    make = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(lead + s.shape, s.dtype), spec),
                   out_shardings=sharding)
    return make()


def init_slots(state: SlotState, init: SlotInit) -> SlotState:
    """Resets `init.rows` (their counts, prompt tokens and bias tables), then records the
    prompt tokens and counts the output tokens of the token entries. Padding rows and entries
    (NO_SLOT) are dropped. A prompt token's bit is added, so it must come once per reset
    (`SlotInit.pack` sends each once)."""
    rows = init.rows
    counts = state.output_counts.at[rows].set(0, mode="drop")
    prompt = state.prompt_bits.at[rows].set(0, mode="drop")
    bias_ids = state.bias_ids.at[rows].set(init.bias_ids, mode="drop")
    bias_values = state.bias_values.at[rows].set(init.bias_values, mode="drop")
    bias_until = state.bias_until.at[rows].set(init.bias_until, mode="drop")
    slots, ids, in_prompt = init.token_slots, init.token_ids, init.token_in_prompt
    bit = jnp.where(in_prompt, jnp.left_shift(jnp.uint32(1), (ids & 31).astype(jnp.uint32)), 0)
    prompt = prompt.at[slots, ids >> 5].add(bit.astype(jnp.uint32), mode="drop")  # distinct: or
    counts = counts.at[slots, ids].add((~in_prompt).astype(jnp.int32), mode="drop")
    return SlotState(counts, prompt, bias_ids, bias_values, bias_until)


def apply_slot_state(logits: jax.Array, batch: SamplingBatch, state: SlotState) -> jax.Array:
    """The module docstring's formulas on f32[R, V] logits, for the rows whose `slots` >= 0;
    other rows come back unchanged."""
    uses = batch.slots >= 0  # [R]
    rows = jnp.clip(batch.slots, 0, state.num_slots - 1)
    counts = state.output_counts[rows]  # [R, V]
    seen = state.prompt_mask(rows) | (counts > 0)
    rep = batch.repetition_penalties[:, None]
    penalised = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    penalised = (penalised - batch.frequency_penalties[:, None] * counts
                 - batch.presence_penalties[:, None] * (counts > 0))
    active = (batch.steps[:, None] < state.bias_until[rows]) & uses[:, None]  # [R, K]
    bias = jnp.where(active, state.bias_values[rows], 0.0)
    row_ids = jnp.arange(logits.shape[0])[:, None]
    penalised = penalised.at[row_ids, state.bias_ids[rows]].add(bias)
    return jnp.where(uses[:, None], penalised, logits)


def count_tokens(state: SlotState, batch: SamplingBatch, tokens: jax.Array) -> SlotState:
    """Adds each row's sampled token to its slot's counts (rows that use the state and whose
    token is an output)."""
    slots = jnp.where((batch.slots >= 0) & batch.sampled, batch.slots, state.num_slots)
    counts = state.output_counts.at[slots, tokens].add(1, mode="drop")
    return SlotState(counts, state.prompt_bits, state.bias_ids, state.bias_values,
                     state.bias_until)
