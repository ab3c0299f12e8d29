"""`SamplingBatch`: the per-row sampling parameters of one padded step, as host numpy arrays.

The scheduler packs requests' `SamplingParams` into it while building a `ModelWorkerBatch`, with
no jax involved; `jaxrunner.sampler` registers it as a pytree, so the worker moves it to the
device in the step's one transfer and the compiled sampler takes it as array data.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrunner.sampling_params import SamplingParams

# Field name -> dtype: the order is the pytree's leaf order.
FIELDS = {"temperatures": np.float32, "top_ps": np.float32, "top_ks": np.int32,
          "min_ps": np.float32, "seeds": np.uint32, "steps": np.int32}


@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of a padded batch of R request slots; all fields are data."""

    temperatures: np.ndarray  # f32[R]; 0 = greedy
    top_ps: np.ndarray        # f32[R]; 1 = off
    top_ks: np.ndarray        # i32[R]; 0 = off (whole vocabulary)
    min_ps: np.ndarray        # f32[R]; 0 = off
    seeds: np.ndarray         # u32[R]; per request
    steps: np.ndarray         # i32[R]; tokens the request has sampled so far

    @classmethod
    def from_params(cls, params_list: list[SamplingParams], steps: list[int], seeds: list[int],
                    padded_size: int) -> SamplingBatch:
        """Packs verified params into host numpy arrays; rows past len(params_list) are greedy.

        `seeds[i]` is request i's resolved seed (its `params.seed`, or one the engine drew), taken
        modulo 2**32.
        """
        n = len(params_list)
        if not len(steps) == len(seeds) == n <= padded_size:
            raise ValueError(
                f"{n} params, {len(steps)} steps, {len(seeds)} seeds, padded_size {padded_size}")
        temperatures = np.zeros(padded_size, np.float32)
        top_ps = np.ones(padded_size, np.float32)
        top_ks = np.zeros(padded_size, np.int32)
        min_ps = np.zeros(padded_size, np.float32)
        for i, p in enumerate(params_list):
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
        return cls(temperatures, top_ps, top_ks, min_ps, seeds_u32, steps_i32)

    @classmethod
    def padding(cls, padded_size: int) -> SamplingBatch:
        """All rows greedy padding (a data-parallel rank with no requests)."""
        return cls.from_params([], [], [], padded_size)
