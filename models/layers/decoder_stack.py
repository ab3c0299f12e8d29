"""Running a causal LM's stacked decoder layers over one step: every family's models call this
(models/llama.py, models/gemma.py; split prefill's layer ranges too).

The layers are stacked modules, one per run of `ModelConfig.layer_runs`, each a period of
attention kinds repeated (models/layer_types.py). A run is one `lax.scan` over its repeats;
inside, each segment of the period (consecutive layers of one kind) is a nested scan, or a call
for a segment of one layer. A uniform run (a period of one layer) is a plain scan over its
layers, the program models had before kinds existed.

What a layer of one attention kind reads besides its weights is made once per step, outside
the scans (`KindInputs`): its cos/sin tables (the kind's rope), the attention backend with its
window, and its KV pool with that pool's view of the batch. The KV cache is one array
[L, pages, ...] (every layer in one pool, windows masked) or, with the SWA pool, the pair
(full layers [Lf, pages, ...], sliding layers [Ls, swa pages, ...]): the sliding layers then
read the SWA pool's pages (`ForwardBatch.swa`) and index their own pool by their rank among the
sliding layers. Each pool threads through the scans flat ([layers * pages, ...]: a free
reshape) as loop state and is updated in place.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.attention import AttentionBackend
from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.lora.layers import LoraLayer
from models.config import AttentionKind, LayerRun, ModelConfig
from models.layers.packed import filled, hollow
from models.layers.rope import step_cos_sin

FULL_POOL, SWA_POOL = 0, 1


@dataclass(frozen=True)
class KindInputs:
    """What the layers of one attention kind read in a step, besides their weights."""

    cos: jax.Array
    sin: jax.Array
    backend: AttentionBackend
    fb: ForwardBatch          # the batch with its pool's page table and slots
    meta: object              # the backend's metadata for `fb`
    pool: int                 # FULL_POOL or SWA_POOL


class StepLayers:
    """A step's per-kind inputs and KV pools for the layers of `cfg` (see the module
    docstring). `kv_cache`: one array, or the (full, SWA) pair."""

    def __init__(self, cfg: ModelConfig, fb: ForwardBatch, kv_cache, backend: AttentionBackend):
        self.cfg = cfg
        self.swa_pool = isinstance(kv_cache, tuple)
        self.shapes = tuple(c.shape for c in self.caches(kv_cache))
        kinds = cfg.attention_kinds
        self._pool_of = [self._pool(kind) for kind in kinds]
        # Each layer's index within its pool: its rank among the layers of that pool.
        ranks = [self._pool_of[:i].count(pool) for i, pool in enumerate(self._pool_of)]
        self._slot_table = np.asarray(ranks, np.int32)
        self._inputs: dict[AttentionKind, KindInputs] = {}
        metas = {}
        for kind in dict.fromkeys(kinds):
            pool = self._pool(kind)
            view = fb.swa_view() if pool == SWA_POOL else fb
            if pool not in metas:
                metas[pool] = backend.init_forward_metadata(view)
            cos, sin = step_cos_sin(kind.rope or cfg.rope, cfg.head_dim, fb.positions)
            kind_backend = backend.for_layers(sliding_window=kind.sliding_window,
                                              num_layers=self.shapes[pool][0])
            self._inputs[kind] = KindInputs(cos, sin, kind_backend, view, metas[pool], pool)

    def _pool(self, kind: AttentionKind) -> int:
        return SWA_POOL if self.swa_pool and kind.sliding_window is not None else FULL_POOL

    @staticmethod
    def caches(kv_cache) -> tuple:
        return kv_cache if isinstance(kv_cache, tuple) else (kv_cache,)

    def flat(self, kv_cache) -> tuple:
        """Each pool viewed as [layers * pages, ...] (free reshapes)."""
        return tuple(c.reshape(-1, *c.shape[2:]) for c in self.caches(kv_cache))

    def unflat(self, flats: tuple):
        """`flat`'s inverse, in the structure the step was given."""
        caches = tuple(f.reshape(shape) for f, shape in zip(flats, self.shapes))
        return caches if self.swa_pool else caches[0]

    def inputs(self, kind: AttentionKind) -> KindInputs:
        return self._inputs[kind]

    def slot(self, layer: jax.Array) -> jax.Array:
        """Layer `layer`'s index within its pool (its own index with one pool)."""
        if not self.swa_pool:
            return layer
        return jnp.asarray(self._slot_table)[layer]


def attend_layer(layer, x, kind: AttentionKind, steps: StepLayers, flats: tuple, index, valid,
                 moe_runner, lora: LoraLayer):
    """Decoder layer `layer` (merged; global index `index`) of kind `kind` over `x` ->
    (x, the pools with its KV written, its routed counts or None)."""
    inputs = steps.inputs(kind)
    x, pool_cache, counts = layer(x, inputs.cos, inputs.sin, flats[inputs.pool],
                                  steps.slot(index), inputs.fb, inputs.backend, inputs.meta,
                                  valid, moe_runner, lora)
    flats = flats[:inputs.pool] + (pool_cache,) + flats[inputs.pool + 1:]
    return x, flats, counts


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
    flats = steps.flat(kv_cache)
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
            x, flats, aux = carry
            state, index, lora_weights = layer_inputs
            state = filled(state, packed, index - start)
            if aux_layers:
                # Written only at the layers asked for (the rows naming this layer).
                hit = wanted == index
                aux = jax.lax.cond(jnp.any(hit),
                                   lambda a: jnp.where(hit[:, None, None], x[None], a),
                                   lambda a: a, aux)
            x, flats, layer_counts = attend_layer(
                nnx.merge(graphdef, state), x, kind, steps, flats, index, valid, moe_runner,
                LoraLayer(lora_weights, onehot, active))
            return (x, flats, aux), layer_counts

        index = run.start + jnp.arange(run.num_layers, dtype=jnp.int32)
        (x, flats, aux), run_counts = scan_run(run, body, (x, flats, aux),
                                               (layers_state, index, run_lora))
        if run.moe:
            counts.append(run_counts)
    return x, steps.unflat(flats), aux, _expert_counts(cfg, counts)


def run_layer_range(cfg: ModelConfig, stacks, fb: ForwardBatch, kv_cache,
                    backend: AttentionBackend, moe_runner, x: jax.Array, begin: jax.Array,
                    end: jax.Array):
    """Decoder layers [begin, end) over `x` [T, D], each layer's parameters read out of its
    run's stack by a dynamic index (jaxrunner/split_prefill/layer_range.py) -> (x, the updated
    KV cache, i32[MoE layers, P] routed counts, zeros for the MoE layers outside the range)."""
    steps = StepLayers(cfg, fb, kv_cache, backend)
    valid = jnp.arange(fb.num_tokens) < jnp.sum(fb.extend_seq_lens)  # padding routes nowhere
    flats = steps.flat(kv_cache)
    counts = []
    for run, layers in zip(cfg.layer_runs, stacks):
        graphdef, layers_state = nnx.split(layers)
        layers_state, packed = hollow(layers_state)  # packed weights stay whole
        run_counts = jnp.zeros((run.num_layers if run.moe else 0, cfg.num_physical_experts),
                               jnp.int32)

        def body(kind, index, carry, graphdef=graphdef, layers_state=layers_state,
                 packed=packed, run=run):
            x, flats, run_counts = carry
            i = index - run.start
            state = filled(jax.tree.map(lambda p: jax.lax.dynamic_index_in_dim(
                p, i, keepdims=False), layers_state), packed, i)
            x, flats, layer_counts = attend_layer(nnx.merge(graphdef, state), x, kind, steps,
                                                  flats, index, valid, moe_runner,
                                                  LoraLayer({}))
            if layer_counts is not None:
                run_counts = jax.lax.dynamic_update_index_in_dim(run_counts, layer_counts, i, 0)
            return x, flats, run_counts

        x, flats, run_counts = loop_run(run, body, (x, flats, run_counts), begin, end)
        if run.moe:
            counts.append(run_counts)
    return x, steps.unflat(flats), _expert_counts(cfg, counts)


def _expert_counts(cfg: ModelConfig, counts: list) -> jax.Array:
    return (jnp.concatenate(counts) if counts
            else jnp.zeros((0, cfg.num_physical_experts), jnp.int32))
