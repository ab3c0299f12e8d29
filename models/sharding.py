"""Tensor-parallel partition rules for the Llama family, and the loader's `place` that puts each
checkpoint tensor straight into its shards.

Megatron layout: q/k/v/gate/up are column-parallel (output features over `tensor`), o/down are
row-parallel (input features over `tensor`; XLA all-reduces their partial sums), the embedding
and the LM head are vocab-parallel. Norms are replicated. GSPMD derives every activation's
sharding from these; attention runs per shard under `shard_map` (jaxrunner/attention/sharded.py).

MoE experts [P, in, out] per layer: with expert parallelism their slot axis is split over the
expert axes (models/layers/moe_parallel.py); without, each expert is split as a dense MLP is
(gate/up by output features, down by input features). The router is replicated.

When `tp_size` exceeds the KV head count, k_proj/v_proj output heads are repeated at load time so
the model holds `tp_size` KV heads, one per shard: q head h of the repeated model reads KV head
h // (H / tp_size), which is original head h // (H / K), so GQA is unchanged.
"""

import dataclasses
import re

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxrunner.parallel.mesh import TENSOR_AXIS, check_tp_size, effective_kv_heads
from models.config import ModelConfig
from models.loading.loader import ParamSource, is_stacked, read_full
from models.loading.moe_checkpoint import BIAS_SUFFIX, is_expert_param
from models.quantization.moe import SCALE_SUFFIX

T = TENSOR_AXIS
# (nnx parameter path regex, PartitionSpec); the first match wins, no match means replicated.
# Linear kernels are [in, out]; the embedding is [vocab, hidden]. The stacked decoder layers'
# parameters have a leading [L] axis on top, never sharded.
PARTITION_RULES: list[tuple[str, P]] = [
    (r"self_attn\.(q|k|v)_proj\.kernel$", P(None, T)),
    (r"self_attn\.(q|k|v)_proj\.bias$", P(T)),
    (r"self_attn\.o_proj\.kernel$", P(T, None)),
    (r"mlp\.(gate|up)_proj\.kernel$", P(None, T)),
    (r"mlp\.(gate|up)_proj\.bias$", P(T)),
    (r"mlp\.down_proj\.kernel$", P(T, None)),
    (r"mlp\.experts\.(gate|up)_proj$", P(None, None, T)),
    (r"mlp\.experts\.down_proj$", P(None, T, None)),
    # Multi-head latent attention (models/layers/mla.py): the per-head projections split by
    # heads; the latent's own (q_a_proj, kv_a_proj_with_mqa) are replicated, as is the cache.
    (r"self_attn\.(q_b|kv_b)_proj\.kernel$", P(None, T)),
    # DeepSeekMoE's shared experts: a dense MLP's split.
    (r"mlp\.shared_experts\.(gate|up)_proj\.kernel$", P(None, T)),
    (r"mlp\.shared_experts\.down_proj\.kernel$", P(T, None)),
    (r"embed_tokens\.embedding$", P(T, None)),
    (r"lm_head\.kernel$", P(None, T)),
]
_KV_PROJ = re.compile(r"self_attn\.(k|v)_proj\.(kernel|bias|weight_scale)$")


def path_name(path: tuple) -> str:
    """('model', 'layers', 'mlp', 'up_proj', 'kernel') -> 'model.layers.mlp.up_proj.kernel'."""
    return ".".join(str(p) for p in path)


_EXPERTS = re.compile(r"mlp\.experts\.(gate|up|down)_proj$")


def partition_spec(path: tuple, expert_axes: tuple[str, ...] = ()) -> P:
    """The parameter's PartitionSpec; `expert_axes` (expert parallelism) split expert slots."""
    if path[-1] == "weight_scale":  # a quantized linear's scales shard with its kernel
        return partition_spec(path[:-1] + ("kernel",), expert_axes)
    if is_expert_param(path) and path[-1].endswith(SCALE_SUFFIX):
        # A quantized expert's scales [L, P, 1, out]: its kernel's spec, in-features unsplit.
        kernel = partition_spec(path[:-1] + (path[-1].removesuffix(SCALE_SUFFIX),), expert_axes)
        return P(*kernel[:2], None, *kernel[3:])
    if is_expert_param(path) and path[-1].endswith(BIAS_SUFFIX):
        # An expert's bias [L, P, out] (GPT-OSS): its kernel's spec without the in-features.
        kernel = partition_spec(path[:-1] + (path[-1].removesuffix(BIAS_SUFFIX),), expert_axes)
        return P(*kernel[:2], *kernel[3:])
    name = path_name(path)
    if expert_axes and _EXPERTS.search(name):
        return P(None, expert_axes, None, None)
    for pattern, spec in PARTITION_RULES:
        if re.search(pattern, name):
            return P(None, *spec) if is_stacked(path) else spec
    return P()


def sharded_model_config(cfg: ModelConfig, tp_size: int,
                         num_redundant_experts: int = 0) -> ModelConfig:
    """The config the sharded model is built from: KV heads repeated up to `tp_size`, and a MoE
    model's expert slots: its experts plus `num_redundant_experts` copies (EPLB).

    Raises ValueError when the heads cannot be split `tp_size` ways.
    """
    check_tp_size(cfg.num_attention_heads, cfg.num_key_value_heads, tp_size)
    kv = effective_kv_heads(cfg.num_key_value_heads, tp_size)
    quant = cfg.quantization
    if (kv > cfg.num_key_value_heads and quant is not None and quant.block_size is not None
            and cfg.head_dim % quant.block_size[0]):
        # Repeating a KV head repeats its scales' blocks, which must then cover whole heads.
        raise ValueError(f"tp_size {tp_size} repeats KV heads, which needs head_dim "
                         f"({cfg.head_dim}) a multiple of the quantization block "
                         f"({quant.block_size[0]})")
    if num_redundant_experts and not cfg.is_moe:
        raise ValueError(f"ep_num_redundant_experts={num_redundant_experts} needs a MoE model; "
                         f"{cfg.architecture} has no experts")
    return dataclasses.replace(cfg, num_key_value_heads=kv,
                               num_physical_experts=cfg.num_experts + num_redundant_experts)


def repeat_kv_heads(array: np.ndarray, num_kv_heads: int, repeats: int) -> np.ndarray:
    """k/v projection kernel [D, K * Dh] or bias [K * Dh] -> K * repeats heads, each head's copies
    adjacent (head i of the result is head i // repeats of the input)."""
    *lead, features = array.shape
    heads = array.reshape(*lead, num_kv_heads, features // num_kv_heads)
    return np.repeat(heads, repeats, axis=-2).reshape(*lead, features * repeats)


@dataclasses.dataclass(frozen=True)
class ShardedPlacer:
    """`place(path, array, dtype) -> jax.Array` for `models.loading.loader.load_model`.

    Each device receives only its slice (`jax.make_array_from_callback`), read a layer at a time,
    so a host holds at most one device's part of one parameter; in a multi-host run each process
    fills its own devices.
    """

    mesh: jax.sharding.Mesh
    num_kv_heads: int   # in the checkpoint
    kv_repeats: int     # copies of each KV head the sharded model holds
    expert_axes: tuple[str, ...] = ()   # mesh axes splitting the expert slots (EP), if any

    @classmethod
    def for_model(cls, mesh, cfg: ModelConfig, expert_axes: tuple[str, ...] = ()
                  ) -> "ShardedPlacer":
        """`cfg` is the checkpoint's config (before `sharded_model_config`)."""
        tp_size = mesh.shape[TENSOR_AXIS]
        kv = effective_kv_heads(cfg.num_key_value_heads, tp_size)
        return cls(mesh, cfg.num_key_value_heads, kv // cfg.num_key_value_heads, expert_axes)

    def sharding(self, path: tuple, shape: tuple) -> NamedSharding:
        spec = partition_spec(path, self.expert_axes)
        # A dimension the mesh does not divide (an odd vocabulary) stays whole on every device.
        for dim, axes in zip(shape, spec):
            if axes is None:
                continue
            ways = int(np.prod([self.mesh.shape[a] for a in np.atleast_1d(axes)]))
            if dim % ways:
                return NamedSharding(self.mesh, P())
        return NamedSharding(self.mesh, spec)

    def layer_sharding(self, path: tuple, shape: tuple) -> NamedSharding:
        """The sharding of one layer of the stacked parameter `path` of `shape` [L, ...]."""
        return NamedSharding(self.mesh, P(*self.sharding(path, shape).spec[1:]))

    def repeat_heads(self, path: tuple, array):
        """A k/v projection's tensor (our layout) with its KV heads repeated as the sharded
        model holds them; any other tensor as it is. Works on numpy and on traced arrays. (A
        tensor of the wrong size passes through whole, for the caller's shape check to name.)"""
        if (self.kv_repeats > 1 and _KV_PROJ.search(path_name(path))
                and array.shape[-1] % self.num_kv_heads == 0):
            return repeat_kv_heads(array, self.num_kv_heads, self.kv_repeats)
        return array

    def unrepeat_heads(self, path: tuple, array):
        """The inverse of `repeat_heads`: the checkpoint's KV heads of a k/v projection's tensor
        (our layout); works on traced arrays."""
        if self.kv_repeats > 1 and _KV_PROJ.search(path_name(path)):
            *lead, features = array.shape
            heads = array.reshape(*lead, self.num_kv_heads, self.kv_repeats,
                                  features // (self.num_kv_heads * self.kv_repeats))
            return heads[..., 0, :].reshape(*lead, features // self.kv_repeats)
        return array

    def __call__(self, source: ParamSource, dtype) -> jax.Array:
        source = source.map(lambda a: self.repeat_heads(source.path, a))
        sharding = self.sharding(source.path, source.shape)
        return jax.make_array_from_callback(source.shape, sharding,
                                            lambda index: read_full(source, dtype, index))

    def place_layer(self, source: ParamSource, layer: int, dtype) -> jax.Array:
        """Layer `layer` of a stacked parameter alone, sharded as that layer is in the whole."""
        source = source.map(lambda a: self.repeat_heads(source.path, a))
        sharding = self.layer_sharding(source.path, source.shape)
        return jax.make_array_from_callback(
            source.shape[1:], sharding,
            lambda index: read_full(source, dtype, (slice(layer, layer + 1), *index))[0])
