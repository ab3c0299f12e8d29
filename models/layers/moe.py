"""The mixture-of-experts layer: route, sort by expert, grouped matmul, unsort, combine.

Shapes: N tokens, D hidden, I expert intermediate, E logical experts, P physical expert slots
(E plus redundant copies for load balancing), k experts per token, M = N * k (token, choice)
pairs.

A token's top-k logical experts are mapped to physical slots through `replicas` (the placement
as array data, so a new placement needs no compile): choice (t, j) of logical expert e goes to
replica `t mod num_replicas[e]` of e. Padded tokens route nowhere (slot P): they are neither
computed nor counted. The layer returns the routed (token, choice) count per physical slot with
its output, for the expert distribution recorder and EPLB.

The expert MLPs run as a grouped matmul over the pairs sorted by slot, in one of two forms
(`GROUPED_MATMULS`):
- `ragged_dot`: `jax.lax.ragged_dot`, XLA's grouped matmul (TPU and GPU lower it natively);
- `blocked`: each group's sorted rows covered by blocks of B rows, one expert per block, a loop
  over just the blocks the groups need (megablocks' layout). On a CPU XLA lowers ragged_dot to
  a loop far slower than this (scripts/bench_moe.py);
- `triton`: the Pallas GPU kernel (kernels_pallas/grouped_matmul): the blocked layout as one
  kernel launch. XLA:GPU lowers ragged_dot densely (every row times every expert).
`moe_reference` computes every expert for every token: the tests' reference, no serving path.

An expert MLP is act(x @ gate) * (x @ up) @ down, `act` SiLU; GPT-OSS's experts add a bias per
expert to each projection (`BiasedExperts`, the weights and biases travelling together as one
pytree, as quantized weights do) and gate with its clamped SwiGLU (`ExpertActivation`).
"""

from dataclasses import dataclass
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.grouped_matmul import grouped_matmul_gpu
from models.loading.moe_checkpoint import BIAS_SUFFIX
from models.quantization.config import QuantConfig
from models.quantization import mxfp4
from models.quantization.moe import SCALE_SUFFIX, QuantizedExperts, expert_matmul, ragged_matmul

GROUPED_MATMULS = ("blocked", "ragged_dot", "triton")
# Block rows of the blocked form: the expected rows per expert, rounded up to a power of two and
# clamped (few rows per block waste less padding; more rows make better matmuls).
MIN_BLOCK_ROWS, MAX_BLOCK_ROWS = 8, 128


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert gates: "silu" (silu(gate) * up) or "clamped_swiglu", GPT-OSS's (transformers'
    GptOssExperts): gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate). Static: part of the compiled program."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        if self.kind not in ("silu", "clamped_swiglu"):
            raise ValueError(f"expert activation {self.kind!r} is not one of silu, "
                             f"clamped_swiglu")

    def __call__(self, gate, up):
        if self.kind == "silu":
            return jax.nn.silu(gate) * up
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


SILU = ExpertActivation()


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class BiasedExperts:
    """Experts' weights [G, in, out] (float, or `QuantizedExperts`) with an output bias per
    expert [G, out] (or one expert's: [in, out], [out])."""

    kernel: Any
    bias: jax.Array

    @property
    def shape(self):
        return self.kernel.shape

    def __getitem__(self, index):
        return BiasedExperts(self.kernel[index], self.bias[index])


def _matmul(x, w):
    """x [..., in] @ one expert's weight (+ its bias)."""
    if isinstance(w, BiasedExperts):
        return expert_matmul(x, w.kernel) + w.bias.astype(x.dtype)
    return expert_matmul(x, w)


def _ragged(xs, w, group_sizes):
    """`ragged_matmul`, each row's group's bias added."""
    if not isinstance(w, BiasedExperts):
        return ragged_matmul(xs, w, group_sizes)
    group = jnp.repeat(jnp.arange(w.bias.shape[0]), group_sizes,
                       total_repeat_length=xs.shape[0])
    return ragged_matmul(xs, w.kernel, group_sizes) + w.bias[group].astype(xs.dtype)


def gpu_grouped_matmul(xs, w, group_sizes, *, interpret: bool = False):
    """`_ragged` through the Pallas GPU kernel (rows past the groups undefined); `interpret`
    runs it on any device (the tests)."""
    bias = None
    if isinstance(w, BiasedExperts):
        w, bias = w.kernel, w.bias
    if isinstance(w, mxfp4.Mxfp4Experts):
        raise NotImplementedError("MXFP4 experts run in the blocked grouped matmul "
                                  "(moe_runner_backend='blocked')")
    scale = None
    if isinstance(w, QuantizedExperts):
        w, scale = w.kernel, w.scale
    return grouped_matmul_gpu(xs, w, group_sizes, scale=scale, bias=bias, interpret=interpret)


class ExpertMap(nnx.Variable):
    """Where the logical experts live (array data, not a parameter: the checkpoint has none)."""


def trivial_placement(num_experts: int, num_slots: int) -> np.ndarray:
    """i32[P]: the logical expert of each physical slot at start-up (slot p holds p mod E)."""
    return np.arange(num_slots, dtype=np.int32) % num_experts


def replica_tables(physical_to_logical: np.ndarray, num_experts: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """i32[..., P] slot -> logical expert  ->  (replicas i32[..., E, P - E + 1]: the slots of
    each expert, the first num_replicas of a row real and the rest repeating them;
    num_replicas i32[..., E]). Raises ValueError if some expert has no slot."""
    lead, num_slots = physical_to_logical.shape[:-1], physical_to_logical.shape[-1]
    width = num_slots - num_experts + 1
    flat = physical_to_logical.reshape(-1, num_slots)
    replicas = np.empty((len(flat), num_experts, width), np.int32)
    counts = np.empty((len(flat), num_experts), np.int32)
    for row, placement in enumerate(flat):
        for e in range(num_experts):
            slots = np.flatnonzero(placement == e)
            if len(slots) == 0:
                raise ValueError(f"placement {placement.tolist()} gives expert {e} no slot")
            replicas[row, e] = np.resize(slots, width)
            counts[row, e] = len(slots)
    return (replicas.reshape(*lead, num_experts, width), counts.reshape(*lead, num_experts))


class Router(nnx.Module):
    """Router logits x @ kernel [D, E] (HF's `gate`)."""

    def __init__(self, d_model: int, num_experts: int, dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(),
                                                                (d_model, num_experts), dtype))

    def __call__(self, x):
        return x @ self.kernel[...]


class Experts(nnx.Module):
    """The expert MLPs' weights, one row per physical slot: gate/up [P, D, I], down [P, I, D];
    with `quant`, in its weight dtype with per-output-channel scales `<name>_scale` [P, 1, out]
    (models/quantization/moe.py), or MXFP4's blocks [P, in / 2, out] and scales `<name>_scale`
    [P, in / 32, out] (models/quantization/mxfp4.py); with `bias`, a bias per slot
    `<name>_bias` [P, out]."""

    LEAVES = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, num_slots: int, d_model: int, d_ff: int, dtype, rngs: nnx.Rngs,
                 quant: QuantConfig | None = None, bias: bool = False):
        shapes = {"gate_proj": (num_slots, d_model, d_ff), "up_proj": (num_slots, d_model, d_ff),
                  "down_proj": (num_slots, d_ff, d_model)}
        self.quantized = quant is not None
        self.mxfp4 = quant is not None and quant.method == "mxfp4"
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1)
        for name, shape in shapes.items():
            if quant is None:
                setattr(self, name, nnx.Param(init(rngs.params(), shape, dtype)))
            elif quant.method == "mxfp4":  # loaded from the checkpoint, never initialised
                slots, d_in, d_out = shape
                mxfp4.check_shape(d_in)
                setattr(self, name, nnx.Param(jnp.zeros((slots, d_in // 2, d_out), jnp.uint8)))
                setattr(self, name + SCALE_SUFFIX, nnx.Param(
                    jnp.zeros((slots, d_in // mxfp4.BLOCK, d_out), jnp.uint8)))
            else:  # loaded from the checkpoint, never initialised
                setattr(self, name, nnx.Param(jnp.zeros(shape, quant.weight_dtype)))
                setattr(self, name + SCALE_SUFFIX,
                        nnx.Param(jnp.ones((num_slots, 1, shape[-1]), jnp.float32)))
            if bias:
                setattr(self, name + BIAS_SUFFIX,
                        nnx.Param(jnp.zeros((num_slots, shape[-1]), dtype)))
        self.biased = bias

    def weights(self):
        """(gate, up, down): arrays, or `QuantizedExperts` when quantized, each inside a
        `BiasedExperts` with its bias when the experts have biases."""
        if not self.quantized:
            weights = tuple(getattr(self, n)[...] for n in self.LEAVES)
        elif self.mxfp4:
            weights = tuple(mxfp4.Mxfp4Experts(getattr(self, n)[...],
                                               getattr(self, n + SCALE_SUFFIX)[...])
                            for n in self.LEAVES)
        else:
            weights = tuple(QuantizedExperts(getattr(self, n)[...],
                                             getattr(self, n + SCALE_SUFFIX)[...])
                            for n in self.LEAVES)
        if not self.biased:
            return weights
        return tuple(BiasedExperts(w, getattr(self, n + BIAS_SUFFIX)[...])
                     for w, n in zip(weights, self.LEAVES))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Routing:
    slots: jax.Array     # i32[N, k]: physical slot of each choice; P for a padded token
    weights: jax.Array   # [N, k]: its weight in the token's output (0 for a padded token)


def route(x, router_logits, replicas, num_replicas, valid, *, top_k: int, norm_topk_prob: bool,
          num_slots: int) -> tuple[Routing, jax.Array]:
    """x [N, D], router logits [N, E], replicas i32[E, R+1], num_replicas i32[E], valid bool[N]
    -> (the routing, i32[P] choices per slot). As HF: softmax in float32, top-k, optionally
    renormalised over the k, cast to x's dtype."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)                        # [N, k]
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return place_choices(weights.astype(x.dtype), experts, replicas, num_replicas, valid,
                         num_slots=num_slots)


def place_choices(weights, experts, replicas, num_replicas, valid, *, num_slots: int
                  ) -> tuple[Routing, jax.Array]:
    """Each token's chosen logical experts i32[N, k] and their weights [N, k] -> (the routing
    over physical slots, i32[P] choices per slot): choice (t, j) of expert e goes to replica
    `t mod num_replicas[e]`; padded tokens (not `valid`) route nowhere."""
    token = jnp.arange(experts.shape[0], dtype=jnp.int32)[:, None]
    slots = replicas[experts, token % num_replicas[experts]]
    slots = jnp.where(valid[:, None], slots, num_slots)
    weights = jnp.where(valid[:, None], weights, 0)
    counts = jnp.zeros((num_slots + 1,), jnp.int32).at[slots.reshape(-1)].add(1)[:num_slots]
    return Routing(slots, weights), counts


def block_rows(num_pairs: int, num_slots: int) -> int:
    """Rows per block of the blocked grouped matmul for `num_pairs` pairs over `num_slots`."""
    expected = max(1, -(-num_pairs // num_slots))
    return int(min(MAX_BLOCK_ROWS, max(MIN_BLOCK_ROWS, 1 << (expected - 1).bit_length())))


def blocked_mlp(xs, group_sizes, wg, wu, wd, rows_per_block: int,
                activation: ExpertActivation = SILU):
    """The expert MLP of each row of xs [M, D] (sorted by group; rows past sum(group_sizes) are
    not computed and come back 0), group g by wg/wu [G, D, I], wd [G, I, D].

    Each group is covered by whole blocks of B rows, and a loop runs as many blocks as the
    groups need (a dynamic trip count: empty groups and unused blocks cost nothing). A block
    reads its B rows in place from the sorted rows; its rows past the group's end belong to the
    next group, whose blocks come later and overwrite them, so they are not written."""
    M, D = xs.shape
    G, B = group_sizes.shape[0], rows_per_block
    blocks = (group_sizes + B - 1) // B
    block_end = jnp.cumsum(blocks)
    group_start = jnp.cumsum(group_sizes) - group_sizes
    xs = jnp.pad(xs, ((0, B), (0, 0)))  # the last block may read past the end

    def block(b, out):
        g = jnp.minimum(jnp.sum(b >= block_end), G - 1)
        start = group_start[g] + (b - (block_end[g] - blocks[g])) * B
        xb = jax.lax.dynamic_slice_in_dim(xs, start, B)
        h = activation(_matmul(xb, wg[g]), _matmul(xb, wu[g]))
        y = _matmul(h, wd[g])
        in_group = start + jnp.arange(B) < group_start[g] + group_sizes[g]
        kept = jnp.where(in_group[:, None], y, jax.lax.dynamic_slice_in_dim(out, start, B))
        return jax.lax.dynamic_update_slice_in_dim(out, kept, start, 0)

    out = jax.lax.fori_loop(0, block_end[-1], block, jnp.zeros((M + B, D), xs.dtype))
    return out[:M]


def ragged_dot_mlp(xs, group_sizes, wg, wu, wd, activation: ExpertActivation = SILU,
                   matmul=_ragged):
    """`blocked_mlp` through `jax.lax.ragged_dot`, or another grouped `matmul` of its signature
    (`gpu_grouped_matmul`)."""
    in_group = jnp.arange(xs.shape[0]) < jnp.sum(group_sizes)
    h = activation(matmul(xs, wg, group_sizes), matmul(xs, wu, group_sizes))
    return jnp.where(in_group[:, None], matmul(h, wd, group_sizes), 0)


def expert_mlp(x, routing: Routing, wg, wu, wd, first_slot, grouped_matmul: str,
               total_slots: int, activation: ExpertActivation = SILU):
    """The experts of slots [first_slot, first_slot + G) (wg/wu [G, D, I], wd [G, I, D]) applied
    to the tokens routed to them, weighted: float32 [N, D], 0 where no choice of a token is
    here. Sort the (token, choice) pairs by slot, grouped matmul, scatter-add back."""
    N, k = routing.slots.shape
    G = wg.shape[0]
    local = routing.slots.reshape(-1) - first_slot
    local = jnp.where((local >= 0) & (local < G), local, G)         # G: not here
    order = jnp.argsort(local, stable=True)
    token = (order // k).astype(jnp.int32)
    group_sizes = jnp.zeros((G + 1,), jnp.int32).at[local].add(1)[:G]
    xs = x[token]
    if grouped_matmul == "blocked":
        ys = blocked_mlp(xs, group_sizes, wg, wu, wd, block_rows(N * k, total_slots),
                         activation)
    elif grouped_matmul == "ragged_dot":
        ys = ragged_dot_mlp(xs, group_sizes, wg, wu, wd, activation)
    elif grouped_matmul == "triton":
        ys = ragged_dot_mlp(xs, group_sizes, wg, wu, wd, activation, gpu_grouped_matmul)
    else:
        raise ValueError(f"grouped matmul {grouped_matmul!r} is not one of {GROUPED_MATMULS}")
    weight = jnp.where(local[order] < G, routing.weights.reshape(-1)[order], 0)
    ys = ys.astype(jnp.float32) * weight.astype(jnp.float32)[:, None]
    return jnp.zeros((N, x.shape[1]), jnp.float32).at[token].add(ys)


def moe_reference(x, routing: Routing, wg, wu, wd, activation: ExpertActivation = SILU,
                  biases=None):
    """Every expert on every token, then the routed ones picked: the tests' reference.
    `biases`: (gate [P, I], up [P, I], down [P, D]) or None."""
    bg, bu, bd = biases if biases is not None else (0, 0, 0)
    h = activation(jnp.einsum("nd,pdi->npi", x, wg) + bg, jnp.einsum("nd,pdi->npi", x, wu) + bu)
    y = jnp.einsum("npi,pid->npd", h, wd) + bd                            # [N, P, D]
    num_slots = wg.shape[0]
    picked = jnp.take_along_axis(y, jnp.minimum(routing.slots, num_slots - 1)[..., None], axis=1)
    weight = jnp.where(routing.slots < num_slots, routing.weights, 0)
    return jnp.sum(picked * weight[..., None], axis=1)


class SparseMoeBlock(nnx.Module):
    """HF's Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock: router `gate`, `experts`, and the
    placement tables (`replicas`, `num_replicas`) the router reads."""

    def __init__(self, cfg, dtype, rngs: nnx.Rngs):
        E, P = cfg.num_experts, cfg.num_physical_experts
        self.gate = Router(cfg.hidden_size, E, dtype, rngs)
        self.experts = Experts(P, cfg.hidden_size, cfg.moe_intermediate_size, dtype, rngs,
                               quant=cfg.quantization)
        replicas, num_replicas = replica_tables(trivial_placement(E, P), E)
        self.replicas = ExpertMap(jnp.asarray(replicas))
        self.num_replicas = ExpertMap(jnp.asarray(num_replicas))
        self.top_k, self.norm_topk_prob, self.num_slots = (cfg.num_experts_per_tok,
                                                          cfg.norm_topk_prob, P)

    def __call__(self, x, valid, runner):
        """x [N, D], valid bool[N], runner a `models.layers.moe_parallel.MoeRunner` -> (y [N, D],
        i32[P] routed choices per slot)."""
        routing, counts = route(x, self.gate(x), self.replicas[...], self.num_replicas[...],
                                valid, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob,
                                num_slots=self.num_slots)
        return runner(x, routing, *self.experts.weights()), counts
