"""`ForwardBatch`: one step's inputs on the device, as a JAX pytree.

Arrays are data fields; the mode, the capture mode and the padded request count are static (meta)
fields, so they pick the compiled executable and never vary within one. Shapes: T padded tokens,
R padded requests, P pages per request slot, N rows of the previous step's samples, C rows of the
input-embedding override buffer (the largest prefill bucket's tokens), D the hidden size.

Input embeddings given instead of a token's own (`input_embeds`, `replace_embeds`) travel as a
[C, D] device buffer plus one i32[T] source row per token (-1: the token's own embedding). A
step without any passes the runner's resident zeros buffer, so only prefill steps that carry
overrides upload one; the per-token index is part of the one upload every step makes.

`init_new` uploads a `ModelWorkerBatch` in one transfer. What follows from it (the input ids still
on the device, positions, each token's request) is computed inside the compiled step by
`prepare()`, so a step is one device program: the fields it fills are None until then, and always
None at the executable's boundary, so every call of a bucket has the same pytree structure.
"""

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jaxrunner.batch.buckets import Bucket
from jaxrunner.batch.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.batch.schedule_batch import ModelWorkerBatch
from jaxrunner.lora.layers import LoraBatch
from jaxrunner.sampling.sampler import SamplingBatch


def _static():
    return field(metadata=dict(static=True))


def _from_worker_batch(*axes: str):
    """An i32 array uploaded from the `ModelWorkerBatch` field of the same name; `axes` name its
    dimensions (T padded tokens, R padded requests, P pages per request slot)."""
    return field(metadata=dict(worker_batch=axes))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ForwardBatch:
    forward_mode: ForwardMode = _static()
    capture_hidden_mode: CaptureHiddenMode = _static()
    batch_size: int = _static()           # R: padded request count

    # Uploaded by `init_new`: the `_from_worker_batch` fields come from the ModelWorkerBatch's
    # fields of the same names (the one list of them: WORKER_BATCH_FIELDS). Decode fills the
    # extend fields too (one token per request), so every mode has one layout.
    input_ids: jax.Array = _from_worker_batch("T")  # where input_token_src >= 0, a placeholder
    input_token_src: jax.Array = _from_worker_batch("T")  # row of prev_tokens holding it, or -1
    prev_tokens: jax.Array         # i32[N]: the previous step's samples (overlap), else zeros
    out_cache_loc: jax.Array = _from_worker_batch("T")  # KV slot per token (padding: page 0)
    seq_lens: jax.Array = _from_worker_batch("R")  # KV length after this step (0 for padding)
    extend_seq_lens: jax.Array = _from_worker_batch("R")  # new tokens per request
    extend_prefix_lens: jax.Array = _from_worker_batch("R")  # tokens already in the cache
    page_table: jax.Array = _from_worker_batch("R", "P")  # KV pages of each request
    # Row of input_embeds replacing the token's embedding, or -1.
    input_embeds_src: jax.Array = _from_worker_batch("T")
    input_embeds: jax.Array        # [C, D] model dtype: the step's override rows, or resident zeros
    # The prompt token after each token, whose log-probability the step returns (prompt
    # logprobs); -1 where none is wanted.
    logprob_target_ids: jax.Array = _from_worker_batch("T")
    # A sliding-window KV pool's page table and KV slots, which the windowed layers read in
    # place of `page_table` and `out_cache_loc` (jaxrunner/mem_cache/swa_memory_pool.py); None
    # in an engine without one, whose steps are then exactly what they were before.
    swa_page_table: jax.Array | None = _from_worker_batch("R", "P")
    swa_out_cache_loc: jax.Array | None = _from_worker_batch("T")
    # What a speculative mode needs besides (jaxrunner/speculative/spec_info.py); None else.
    spec_info: object = None
    # A LoRA engine's adapter pool and each token's slot (jaxrunner/lora/layers.py: LoraBatch);
    # None in an engine without LoRA, whose steps are then exactly what they were before.
    lora: object = None

    # Filled by `prepare()` inside the step.
    positions: jax.Array | None = None         # i32[T]: position of each token in its sequence
    extend_start_loc: jax.Array | None = None  # i32[R]: first token of each request
    token_to_req: jax.Array | None = None      # i32[T]: request row of each token (padding -> R-1)
    # i32[T]: token t attends to KV positions < kv_bound[t] (block-diffusion steps fill it, see
    # jaxrunner/dllm/); None: causal, position + 1.
    kv_bound: jax.Array | None = None
    # i32[T, NW]: a draft tree's verify step: bit j of token t's words (kernels_pallas/
    # ragged_paged_attention/tree_mask.py) says whether it sees its request's j-th new token,
    # ANDed with the causal rule; None: no tree.
    kv_tree_mask: jax.Array | None = None

    @property
    def num_tokens(self) -> int:
        """T (under DP attention the arrays carry a leading [dp] axis outside the step)."""
        return self.input_ids.shape[-1]

    @property
    def last_token_indices(self) -> jax.Array:
        """i32[R]: the index of each request's last token (the one whose logits are sampled)."""
        return jnp.maximum(self.extend_start_loc + self.extend_seq_lens - 1, 0)

    @classmethod
    def init_new(cls, batch: ModelWorkerBatch, prev_tokens: jax.Array, input_embeds: jax.Array,
                 sharding=None, lora_weights=None) -> tuple["ForwardBatch", SamplingBatch]:
        """The forward batch and the sampling arrays of `batch`: its host arrays, which the step
        and the sampler take as they are, or with `sharding` on the devices in one transfer.

        `prev_tokens` (i32[N] on the device) are the previous step's sampled tokens, which
        `batch.input_token_src` may point into (overlapped scheduling); without a previous step,
        the runner's zeros of the same shape. `input_embeds` ([C, D] on the device) holds the
        batch's override rows (`ModelRunner.input_embeds_for`). `lora_weights`: a LoRA engine's
        device pool (`jaxrunner/lora/pool.py`), read with the batch's per-token slots.
        """
        lora_slots = batch.lora_slots if lora_weights is not None else None
        host = ({name: getattr(batch, name) for name in WORKER_BATCH_FIELDS}, batch.sampling,
                lora_slots)
        # Without a sharding the step's executable takes the numpy arrays as they are and
        # moves them in its C++ call path: a Python device_put costs ~60 us per array (1.3 ms
        # of a batch's ~22 on a 2-core CPU), the executable's own transfer a few. The arrays
        # are fresh per batch (get_model_worker_batch), so nothing rewrites them in flight.
        arrays, sampling, lora_slots = host if sharding is None else jax.device_put(host,
                                                                                  sharding)
        forward_batch = cls(
            forward_mode=batch.forward_mode, capture_hidden_mode=batch.capture_hidden_mode,
            batch_size=batch.bucket.num_reqs, prev_tokens=prev_tokens, input_embeds=input_embeds,
            lora=None if lora_weights is None else LoraBatch(lora_weights, lora_slots), **arrays)
        return forward_batch, sampling

    @classmethod
    def abstract(cls, bucket: Bucket, capture: CaptureHiddenMode, *, max_pages_per_req: int,
                 prev_tokens, input_embeds, spec_info=None, lora=None,
                 windowed: bool = False) -> "ForwardBatch":
        """The ForwardBatch of `bucket` as shapes (`jax.ShapeDtypeStruct`s), for lowering its
        step: the uploaded fields from their axes (the sliding-window pool's where `windowed`),
        the rest as given (the fields `prepare` fills are None, as at every call)."""
        dims = dict(T=bucket.num_tokens, R=bucket.num_reqs, P=max_pages_per_req)
        arrays = {name: (jax.ShapeDtypeStruct(tuple(dims[axis] for axis in axes), jnp.int32)
                         if windowed or name not in SWA_FIELDS else None)
                  for name, axes in WORKER_BATCH_FIELDS.items()}
        return cls(forward_mode=bucket.mode, capture_hidden_mode=capture,
                   batch_size=bucket.num_reqs, prev_tokens=prev_tokens, input_embeds=input_embeds,
                   spec_info=spec_info, lora=lora, **arrays)

    def embed_inputs(self, embed_tokens) -> jax.Array:
        """[T, D]: each token's embedding (`embed_tokens(ids)`), or the row of `input_embeds` that
        replaces it. Decode tokens are always sampled ids, so decode steps skip the splice."""
        x = embed_tokens(self.input_ids)
        if self.forward_mode.is_decode():
            return x
        src = self.input_embeds_src
        given = self.input_embeds[jnp.clip(src, 0, self.input_embeds.shape[0] - 1)]
        return jnp.where((src >= 0)[:, None], given.astype(x.dtype), x)

    def prepare(self) -> "ForwardBatch":
        """Inside the step: the input ids still on the device, then positions and each token's
        request row."""
        src = self.input_token_src
        from_prev = self.prev_tokens[jnp.clip(src, 0, self.prev_tokens.shape[0] - 1)]
        input_ids = jnp.where(src >= 0, from_prev, self.input_ids)
        positions, extend_start_loc, token_to_req = compute_positions(
            self.extend_prefix_lens, self.extend_seq_lens, self.num_tokens)
        return self.replace(input_ids=input_ids, positions=positions,
                            extend_start_loc=extend_start_loc, token_to_req=token_to_req)

    def replace(self, **changes) -> "ForwardBatch":
        return dataclasses.replace(self, **changes)

    def windowed_pool(self) -> "ForwardBatch":
        """This batch as the windowed layers of a sliding-window KV pool see it: their page
        table and KV slots in place of the full layers'."""
        return self.replace(page_table=self.swa_page_table, out_cache_loc=self.swa_out_cache_loc)


# The fields a ForwardBatch uploads from its ModelWorkerBatch, and the axes of each.
WORKER_BATCH_FIELDS: dict[str, tuple[str, ...]] = {
    f.name: f.metadata["worker_batch"] for f in dataclasses.fields(ForwardBatch)
    if "worker_batch" in f.metadata}
SWA_FIELDS = ("swa_page_table", "swa_out_cache_loc")


def compute_positions(extend_prefix_lens, extend_seq_lens, num_tokens: int):
    """Positions, first-token offsets and request rows of the T flattened tokens.

    Token j of request r sits at position `extend_prefix_lens[r] + j` (decode: `seq_len - 1`).
    Padding tokens get position 0 and the last request row, which has length 0 or is a real
    request whose attention excludes them.
    """
    extend_start_loc = jnp.cumsum(extend_seq_lens) - extend_seq_lens
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    # Request of each token: how many requests end at or before it. A [T, R] comparison rather
    # than a search: as fast on the device and several times cheaper to trace at start-up.
    ends = extend_start_loc + extend_seq_lens
    token_to_req = jnp.sum(token[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)
    token_to_req = jnp.minimum(token_to_req, extend_seq_lens.shape[0] - 1)
    positions = extend_prefix_lens[token_to_req] + token - extend_start_loc[token_to_req]
    positions = jnp.where(token < jnp.sum(extend_seq_lens), positions, 0).astype(jnp.int32)
    return positions, extend_start_loc.astype(jnp.int32), token_to_req
