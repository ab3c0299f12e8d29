"""`SamplingBatch`: the per-row sampling parameters of one padded step, as host numpy arrays, and
`SlotInit`: the host data that (re)initialises request slots' device sampling state.

The scheduler packs requests' `SamplingParams` into them while building a `ModelWorkerBatch`, with
no jax involved; `jaxrunner.sampling.sampler` and `jaxrunner.sampling.penalties` register them as
pytrees, so the worker moves them to the device in the step's transfer and the compiled programs
take them as array data.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrunner.sampling.params import SamplingParams

# Field name -> dtype: the order is the pytree's leaf order.
FIELDS = {"temperatures": np.float32, "top_ps": np.float32, "top_ks": np.int32,
          "min_ps": np.float32, "seeds": np.uint32, "steps": np.int32,
          "slots": np.int32, "sampled": np.bool_, "frequency_penalties": np.float32,
          "presence_penalties": np.float32, "repetition_penalties": np.float32,
          "constrained": np.bool_, "top_logprobs_nums": np.int32}

# Entries of each slot's bias table on the device: `logit_bias` (at most
# sampling_params.MAX_LOGIT_BIAS) plus the EOS and stop ids `min_new_tokens` masks.
BIAS_TABLE_SIZE = 512
# A slot or row index past every array: scatters drop it (jax `mode="drop"`).
NO_SLOT = 2**30
# An entry of the bias table that applies for every step.
ALWAYS = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of a padded batch of R request slots; all fields are data."""

    temperatures: np.ndarray  # f32[R]; 0 = greedy
    top_ps: np.ndarray        # f32[R]; 1 = off
    top_ks: np.ndarray        # i32[R]; 0 = off (whole vocabulary)
    min_ps: np.ndarray        # f32[R]; 0 = off
    seeds: np.ndarray         # u32[R]; per request
    steps: np.ndarray         # i32[R]; tokens the request has sampled so far
    # i32[R]: the row's request slot in the device sampling state (penalties, logit bias,
    # min_new_tokens), or -1 for a row that uses none of it.
    slots: np.ndarray
    sampled: np.ndarray               # bool[R]: the row's token is a new output (not a chunk's)
    frequency_penalties: np.ndarray   # f32[R]; 0 = off
    presence_penalties: np.ndarray    # f32[R]; 0 = off
    repetition_penalties: np.ndarray  # f32[R]; 1 = off
    constrained: np.ndarray           # bool[R]: the vocabulary mask applies to the row
    top_logprobs_nums: np.ndarray     # i32[R]: alternatives to return (0..TOP_LOGPROBS)

    @classmethod
    def from_params(cls, params_list: list[SamplingParams], steps: list[int], seeds: list[int],
                    padded_size: int, *, slots: list[int] | None = None,
                    sampled: list[bool] | None = None, constrained: list[bool] | None = None,
                    top_logprobs_nums: list[int] | None = None) -> SamplingBatch:
        """Packs verified params into host numpy arrays; rows past len(params_list) are greedy.

        `seeds[i]` is request i's resolved seed (its `params.seed`, or one the engine drew), taken
        modulo 2**32. `slots[i]` is request i's slot (used only when its params need the device
        state), `sampled[i]` whether its token this step is an output (default: all are),
        `constrained[i]` whether a grammar masks it, `top_logprobs_nums[i]` how many
        alternatives it wants.
        """
        n = len(params_list)
        if not len(steps) == len(seeds) == n <= padded_size:
            raise ValueError(
                f"{n} params, {len(steps)} steps, {len(seeds)} seeds, padded_size {padded_size}")
        temperatures = np.zeros(padded_size, np.float32)
        top_ps = np.ones(padded_size, np.float32)
        top_ks = np.zeros(padded_size, np.int32)
        min_ps = np.zeros(padded_size, np.float32)
        slot_rows = np.full(padded_size, -1, np.int32)
        frequency = np.zeros(padded_size, np.float32)
        presence = np.zeros(padded_size, np.float32)
        repetition = np.ones(padded_size, np.float32)
        for i, p in enumerate(params_list):
            if p.uses_slot_state:
                if slots is None:
                    raise ValueError(f"request {i} needs a slot for penalties or logit_bias")
                slot_rows[i] = slots[i]
                frequency[i] = p.frequency_penalty
                presence[i] = p.presence_penalty
                repetition[i] = p.repetition_penalty
            if p.is_greedy:
                continue  # leave the neutral greedy row, so it never asks for the sort
            temperatures[i] = p.temperature
            top_ps[i] = p.top_p
            top_ks[i] = max(p.top_k, 0)  # -1 and 0 both mean off
            min_ps[i] = p.min_p
        seeds_u32 = np.zeros(padded_size, np.uint32)
        seeds_u32[:n] = [s % 2**32 for s in seeds]
        steps_i32 = np.zeros(padded_size, np.int32)
        steps_i32[:n] = steps
        return cls(temperatures, top_ps, top_ks, min_ps, seeds_u32, steps_i32, slot_rows,
                   _padded(sampled, n, padded_size, np.bool_, True), frequency, presence,
                   repetition, _padded(constrained, n, padded_size, np.bool_, False),
                   _padded(top_logprobs_nums, n, padded_size, np.int32, 0))

    @classmethod
    def padding(cls, padded_size: int) -> SamplingBatch:
        """All rows greedy padding (a data-parallel rank with no requests)."""
        return cls.from_params([], [], [], padded_size)


def _padded(values, n: int, size: int, dtype, default) -> np.ndarray:
    """`values` (n of them, or None for `default`) as an array of `size`, padding rows False/0."""
    out = np.zeros(size, dtype)
    out[:n] = default if values is None else values
    return out


@dataclasses.dataclass(frozen=True)
class SlotEntry:
    """One request slot to (re)initialise: its bias table and the tokens it has seen."""

    slot: int
    bias_ids: list[int]           # logit_bias and min_new_tokens entries, at most BIAS_TABLE_SIZE
    bias_values: list[float]
    bias_until: list[int]         # entry i applies while the request has sampled < until[i]
    prompt_ids: list[int]         # tokens the repetition penalty sees in the prompt
    output_ids: list[int]         # output tokens so far (a resumed request has some)


@dataclasses.dataclass(frozen=True)
class SlotInit:
    """Host arrays of one call of the slot-initialising program: B slots reset, N tokens."""

    rows: np.ndarray          # i32[B]: slots to reset (NO_SLOT: none)
    bias_ids: np.ndarray      # i32[B, K]
    bias_values: np.ndarray   # f32[B, K]
    bias_until: np.ndarray    # i32[B, K]
    token_slots: np.ndarray   # i32[N]: slot of each token entry (NO_SLOT: padding)
    token_ids: np.ndarray     # i32[N]
    token_in_prompt: np.ndarray  # bool[N]: a prompt token (else an output token, counted)

    @classmethod
    def pack(cls, entries: list[SlotEntry], max_rows: int, max_tokens: int) -> list[SlotInit]:
        """The calls that initialise `entries`: resets first, every prompt token before any
        output token, in as many calls of (max_rows, max_tokens) as it takes."""
        K = BIAS_TABLE_SIZE
        # Each (slot, prompt token) once: the program sets a prompt token's bit by adding it.
        prompt = dict.fromkeys((e.slot, t) for e in entries for t in e.prompt_ids)
        tokens = ([(slot, t, True) for slot, t in prompt]
                  + [(e.slot, t, False) for e in entries for t in e.output_ids])
        # Every reset must come before any token of its slot: a call resets, then scatters, so
        # the tokens start in the last call that resets.
        reset_calls = max(-(-len(entries) // max_rows), 1)
        token_calls = max(-(-len(tokens) // max_tokens), 1)
        out = []
        for c in range(reset_calls - 1 + token_calls):
            rows = np.full(max_rows, NO_SLOT, np.int32)
            ids = np.zeros((max_rows, K), np.int32)
            values = np.zeros((max_rows, K), np.float32)
            until = np.zeros((max_rows, K), np.int32)
            for i, e in enumerate(entries[c * max_rows:(c + 1) * max_rows]):
                if len(e.bias_ids) > K:
                    raise ValueError(f"{len(e.bias_ids)} bias entries exceed the table's {K}")
                rows[i] = e.slot
                ids[i, :len(e.bias_ids)] = e.bias_ids
                values[i, :len(e.bias_ids)] = e.bias_values
                until[i, :len(e.bias_ids)] = e.bias_until
            t = c - (reset_calls - 1)
            chunk = tokens[t * max_tokens:(t + 1) * max_tokens] if t >= 0 else []
            token_slots = np.full(max_tokens, NO_SLOT, np.int32)
            token_ids = np.zeros(max_tokens, np.int32)
            in_prompt = np.zeros(max_tokens, np.bool_)
            if chunk:
                token_slots[:len(chunk)], token_ids[:len(chunk)], in_prompt[:len(chunk)] = zip(
                    *chunk)
            out.append(cls(rows, ids, values, until, token_slots, token_ids, in_prompt))
        return out
