"""Running a causal LM's stacked decoder layers over one step: every family's models call this
(models/llama.py, models/gemma.py; split prefill's layer ranges too).

The layers are stacked modules, one per run of `ModelConfig.layer_runs`, each a period of
attention kinds repeated (models/layer_types.py). A run is one `lax.scan` over its repeats;
inside, each segment of the period (consecutive layers of one kind) is a nested scan, or a call
for a segment of one layer. A uniform run (a period of one layer) is a plain scan over its
layers, the program models had before kinds existed.

What a layer of one attention kind reads besides its weights is made once per step, outside
the scans (`KindInputs`): its cos/sin tables (the kind's rope), the attention backend with its
window, and the batch as its pages see it. The KV cache is one array [L, pages, ...] (every
layer in one pool, windows masked), or with a sliding-window pool one run of both pools' pages
(jaxrunner/mem_cache/kv_cache.py) whose windowed layers read the batch's `swa_page_table` and
`swa_out_cache_loc`; it threads through the scans flat ([L * pages, ...]: a free reshape) as
loop state and is updated in place.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from flax import nnx
import jax
import jax.numpy as jnp

from jaxrunner.attention import AttentionBackend
from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.lora.layers import LoraLayer
from models.config import AttentionKind, LayerRun, ModelConfig
from models.layers.packed import filled, hollow
from models.layers.rope import step_cos_sin

@dataclass(frozen=True)
class KindInputs:
    """What the layers of one attention kind read in a step, besides their weights."""

    cos: jax.Array
    sin: jax.Array
    backend: AttentionBackend
    fb: ForwardBatch  # the step's batch, with the windowed pool's pages for windowed layers
    meta: object      # the backend's metadata of `fb`


class StepLayers:
    """A step's per-kind inputs for the layers of `cfg` (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, fb: ForwardBatch, kv_cache, backend: AttentionBackend):
        self.shape = kv_cache.shape
        meta = backend.init_forward_metadata(fb)
        windowed_fb = windowed_meta = None
        if fb.swa_page_table is not None:
            windowed_fb = fb.windowed_pool()
            windowed_meta = backend.init_forward_metadata(windowed_fb)
        self._inputs: dict[AttentionKind, KindInputs] = {}
        for kind in dict.fromkeys(cfg.attention_kinds):
            cos, sin = step_cos_sin(kind.rope or cfg.rope, cfg.head_dim, fb.positions)
            kind_backend = backend.for_layers(sliding_window=kind.sliding_window,
                                              num_layers=self.shape[0])
            own_pool = kind.sliding_window is not None and windowed_fb is not None
            self._inputs[kind] = KindInputs(cos, sin, kind_backend,
                                            windowed_fb if own_pool else fb,
                                            windowed_meta if own_pool else meta)

    def flat(self, kv_cache) -> jax.Array:
        """The cache viewed as [layers * pages, ...] (a free reshape)."""
        return kv_cache.reshape(-1, *kv_cache.shape[2:])

    def unflat(self, flat: jax.Array) -> jax.Array:
        """`flat`'s inverse."""
        return flat.reshape(self.shape)

    def inputs(self, kind: AttentionKind) -> KindInputs:
        return self._inputs[kind]


def attend_layer(layer, x, kind: AttentionKind, steps: StepLayers, flat: jax.Array, index,
                 valid, moe_runner, lora: LoraLayer):
    """Decoder layer `layer` (merged; global index `index`) of kind `kind` over `x` ->
    (x, the cache with its KV written, its routed counts or None)."""
    inputs = steps.inputs(kind)
    return layer(x, inputs.cos, inputs.sin, flat, index, inputs.fb, inputs.backend, inputs.meta,
                 valid, moe_runner, lora)


def scan_run(run: LayerRun, fn: Callable, carry, xs):
    """`fn(kind, carry, layer_xs) -> (carry, out)` over the layers of `run` in order, `xs`
    holding each layer's loop data on a leading [run.num_layers] axis; -> (carry, outs stacked
    on the same axis)."""
    if len(run.period) == 1:
        return jax.lax.scan(partial(fn, run.period[0]), carry, xs)
    period = len(run.period)
    xs = jax.tree.map(lambda a: a.reshape(run.repeats, period, *a.shape[1:]), xs)

    def one_period(carry, period_xs):
        outs = []
        for offset, count, kind in run.segments:
            seg = jax.tree.map(lambda a, o=offset, n=count: a[o:o + n], period_xs)
            if count == 1:
                carry, out = fn(kind, carry, jax.tree.map(lambda a: a[0], seg))
                out = jax.tree.map(lambda o: o[None], out)
            else:
                carry, out = jax.lax.scan(partial(fn, kind), carry, seg)
            outs.append(out)
        return carry, jax.tree.map(lambda *o: jnp.concatenate(o), *outs)

    carry, outs = jax.lax.scan(one_period, carry, xs)
    return carry, jax.tree.map(lambda o: o.reshape(run.num_layers, *o.shape[2:]), outs)


def loop_run(run: LayerRun, fn: Callable, carry, begin: jax.Array, end: jax.Array):
    """`fn(kind, index, carry) -> carry` for the layers of `run` inside [begin, end), in order,
    with bounds as array data (split prefill: one program for every range)."""
    stop = run.start + run.num_layers
    if len(run.period) == 1:
        lo = jnp.clip(begin, run.start, stop)
        return jax.lax.fori_loop(lo, jnp.clip(end, lo, stop), partial(fn, run.period[0]), carry)
    period = len(run.period)

    def one_period(repeat, carry):
        base = run.start + repeat * period
        for offset, count, kind in run.segments:
            lo = jnp.clip(begin, base + offset, base + offset + count)
            hi = jnp.clip(end, lo, base + offset + count)
            carry = jax.lax.fori_loop(lo, hi, partial(fn, kind), carry)
        return carry

    first = jnp.clip((begin - run.start) // period, 0, run.repeats)
    last = jnp.clip((end - run.start + period - 1) // period, first, run.repeats)
    return jax.lax.fori_loop(first, last, one_period, carry)


def run_decoder_layers(cfg: ModelConfig, stacks, fb: ForwardBatch, kv_cache,
                       backend: AttentionBackend, moe_runner, x: jax.Array,
                       aux_layers: tuple[int, ...] = ()):
    """Every decoder layer over the step's tokens `x` [T, D] -> (x after the last layer, the
    updated KV cache, the residual stream entering each of `aux_layers` [A, T, D] or None,
    i32[MoE layers, P] routed counts). `stacks`: one stacked module per run of
    `cfg.layer_runs`."""
    steps = StepLayers(cfg, fb, kv_cache, backend)
    valid = jnp.arange(fb.num_tokens) < jnp.sum(fb.extend_seq_lens)  # padding routes nowhere
    cache = steps.flat(kv_cache)
    wanted = jnp.asarray(aux_layers, jnp.int32)
    aux = jnp.zeros((len(aux_layers),) + x.shape, x.dtype) if aux_layers else None
    counts = []
    # LoRA (jaxrunner/lora/layers.py): the pool's [L, S, ...] rows ride the scan with the
    # weights; without it the loop data hold nothing more and the program is unchanged.
    onehot = fb.lora.onehot(x.dtype) if fb.lora is not None else None
    active = fb.lora.any_adapter if fb.lora is not None else None
    for run, layers in zip(cfg.layer_runs, stacks):
        graphdef, layers_state = nnx.split(layers)
        # Packed weights stay whole: the body multiplies by its layer of each stack.
        layers_state, packed = hollow(layers_state)
        run_lora = fb.lora.layers(run.start, run.num_layers) if fb.lora is not None else {}

        def body(kind, carry, layer_inputs, graphdef=graphdef, packed=packed, start=run.start):
            x, cache, aux = carry
            state, index, lora_weights = layer_inputs
            state = filled(state, packed, index - start)
            if aux_layers:
                # Written only at the layers asked for (the rows naming this layer).
                hit = wanted == index
                aux = jax.lax.cond(jnp.any(hit),
                                   lambda a: jnp.where(hit[:, None, None], x[None], a),
                                   lambda a: a, aux)
            x, cache, layer_counts = attend_layer(
                nnx.merge(graphdef, state), x, kind, steps, cache, index, valid, moe_runner,
                LoraLayer(lora_weights, onehot, active))
            return (x, cache, aux), layer_counts

        index = run.start + jnp.arange(run.num_layers, dtype=jnp.int32)
        (x, cache, aux), run_counts = scan_run(run, body, (x, cache, aux),
                                               (layers_state, index, run_lora))
        if run.moe:
            counts.append(run_counts)
    return x, steps.unflat(cache), aux, _expert_counts(cfg, counts)


def run_layer_range(cfg: ModelConfig, stacks, fb: ForwardBatch, kv_cache,
                    backend: AttentionBackend, moe_runner, x: jax.Array, begin: jax.Array,
                    end: jax.Array):
    """Decoder layers [begin, end) over `x` [T, D], each layer's parameters read out of its
    run's stack by a dynamic index (jaxrunner/split_prefill/layer_range.py) -> (x, the updated
    KV cache, i32[MoE layers, P] routed counts, zeros for the MoE layers outside the range)."""
    steps = StepLayers(cfg, fb, kv_cache, backend)
    valid = jnp.arange(fb.num_tokens) < jnp.sum(fb.extend_seq_lens)  # padding routes nowhere
    cache = steps.flat(kv_cache)
    counts = []
    for run, layers in zip(cfg.layer_runs, stacks):
        graphdef, layers_state = nnx.split(layers)
        layers_state, packed = hollow(layers_state)  # packed weights stay whole
        run_counts = jnp.zeros((run.num_layers if run.moe else 0, cfg.num_physical_experts),
                               jnp.int32)

        def body(kind, index, carry, graphdef=graphdef, layers_state=layers_state,
                 packed=packed, run=run):
            x, cache, run_counts = carry
            i = index - run.start
            state = filled(jax.tree.map(lambda p: jax.lax.dynamic_index_in_dim(
                p, i, keepdims=False), layers_state), packed, i)
            x, cache, layer_counts = attend_layer(nnx.merge(graphdef, state), x, kind, steps,
                                                  cache, index, valid, moe_runner,
                                                  LoraLayer({}))
            if layer_counts is not None:
                run_counts = jax.lax.dynamic_update_index_in_dim(run_counts, layer_counts, i, 0)
            return x, cache, run_counts

        x, cache, run_counts = loop_run(run, body, (x, cache, run_counts), begin, end)
        if run.moe:
            counts.append(run_counts)
    return x, steps.unflat(cache), _expert_counts(cfg, counts)


def _expert_counts(cfg: ModelConfig, counts: list) -> jax.Array:
    return (jnp.concatenate(counts) if counts
            else jnp.zeros((0, cfg.num_physical_experts), jnp.int32))
