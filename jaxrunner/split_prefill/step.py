"""The compiled step of ForwardMode.SPLIT_PREFILL, and the device state a split prefill carries.

A split prefill runs one prefill batch a range of layers at a time
(jaxrunner/split_prefill/layer_range.py), so the scheduler can run decode steps of running requests
between its ranges: a long prompt then stalls decoding for one range, not for the whole model. The
batch is uploaded once; between ranges only its residual stream [C, D] lives on (on the device), and
the last range (the one that reaches the last layer) also applies the final norm and the LM head to
each request's last token, whose logits the usual sampler samples.

Range bounds are array data, so one executable per prefill bucket serves every range; the
steps of the other ranges skip the LM head (`lax.cond` on the bound).
"""

from dataclasses import dataclass

from flax import nnx
import jax
import jax.numpy as jnp

from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.runner.lm_step import LogitsOutput, no_input_logprobs
from jaxrunner.split_prefill.layer_range import forward_layer_range


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerRange:
    begin: jax.Array  # i32[]: first layer of the range
    end: jax.Array    # i32[]: one past its last layer


def split_prefill_step(graphdef, backend, moe_runner, state, kv_cache, fb: ForwardBatch,
                       hidden: jax.Array, layers: LayerRange):
    """Layers [begin, end) over a prefill batch. hidden [C, D]: the residual stream after layer
    begin - 1 (any array of that shape for begin == 0). -> ((a `LogitsOutput` whose logits
    f32[R, V] of each request's last token are zeros unless `end` is the last layer and whose
    expert counts are the range's MoE layers'; the residual stream after the range [C, D]),
    kv_cache)."""
    fb = fb.prepare()
    model = nnx.merge(graphdef, state)
    hidden, kv_cache, expert_counts = forward_layer_range(
        model, fb, kv_cache, backend, moe_runner, hidden, layers.begin, layers.end)
    R, V = fb.batch_size, model.config.vocab_size
    logits = jax.lax.cond(
        layers.end >= model.config.num_hidden_layers,
        lambda h: model.compute_logits(model.model.norm(h[fb.last_token_indices])),
        lambda h: jnp.zeros((R, V), jnp.float32), hidden)
    # No hidden-state capture and no prompt logprobs (the scheduler does not split a batch that
    # asks for them).
    output = LogitsOutput(logits, hidden[:0], expert_counts, *no_input_logprobs(fb.num_tokens))
    return (output, hidden), kv_cache


def abstract_layer_range() -> LayerRange:
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    return LayerRange(i32, i32)


@dataclass
class SplitPrefillState:
    """A split prefill in progress, on the device: the uploaded batch, its sampling arrays, and
    the residual stream after `layers_done` layers. The scheduler holds it with the batch and
    hands it back for each range; only the last range's samples ever reach the host."""

    forward_batch: ForwardBatch
    sampling: object               # the batch's SamplingBatch, on the device
    hidden: jax.Array              # [C, D]
    layers_done: int
    num_reqs: int
    num_tokens: int
    slot_entries: list
