"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, and the MoE Qwen3-MoE, Mixtral) in
flax nnx.

The three families differ by two switches read from the config: Qwen2 adds biases to the q/k/v
projections (`attention_bias`), Qwen3 RMS-normalises q and k per head (`qk_norm`). Attribute
names follow Hugging Face's, so the checkpoint mapping in `models/loading/loader.py` stays a short
table. A MoE model's layers hold a `SparseMoeBlock` (models/layers/moe.py) as their `mlp`. Shapes: T
tokens, D hidden, H query heads, K KV heads, Dh head dim, F intermediate, V vocab, L layers, P
physical expert slots.

The decoder layers are stacked modules whose parameters carry a leading [L] axis, run by
`jax.lax.scan`: the compiled step holds one layer's program whatever the depth, so compiling a
32-layer model costs what an 8-layer one does. A model whose layers are not all of one kind
(Qwen3-MoE's `mlp_only_layers`) has one stacked module per run of consecutive layers of a kind
(`ModelConfig.layer_runs`), each scanned in turn: compile cost grows with the runs, not the
depth; layers of different attention kinds (Qwen2's windows on some layers) are periods of a run
(models/layer_types.py). The KV cache of every layer is one array that the scans carry as loop
state (models/layers/decoder_stack.py).
"""

import functools

from flax import nnx
import jax
import jax.numpy as jnp

from jaxrunner.attention import AttentionBackend
from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.lora.layers import NO_LORA, LoraLayer
from models.config import LayerRun, ModelConfig
from models.layers.decoder_stack import run_decoder_layers
from models.layers.moe import SparseMoeBlock
from models.layers.moe_parallel import MoeRunner
from models.layers.packed import PackedWeight
from models.layers.rope import apply_rope_cos_sin
from models.quantization.linear import QuantConfig, quantized_matmul


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel stored [in, out]. With `quant`, kernel is int8 or fp8 and
    `weight_scale` its float32 scales (models/quantization/linear.py)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs,
                 quant: QuantConfig | None = None):
        self.quant = quant
        if quant is None:
            self.kernel = nnx.Param(
                nnx.initializers.lecun_normal()(rngs.params(), (d_in, d_out), dtype))
        else:
            # Loaded from the checkpoint, never initialised: zeros of the right shapes.
            self.kernel = nnx.Param(jnp.zeros((d_in, d_out), quant.weight_dtype))
            self.weight_scale = nnx.Param(jnp.ones(quant.scale_shape(d_in, d_out), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x):
        kernel = self.kernel.get_value()
        if isinstance(kernel, PackedWeight):  # a CPU's packed kernel (models/layers/packed.py)
            y = kernel(x)
        elif self.quant is None:
            y = x @ kernel
        else:
            y = quantized_matmul(x, self.kernel[...], self.weight_scale[...], self.quant)
        return y + self.bias[...] if self.bias is not None else y


def pack_linears(graphdef, state, panel: int):
    """(graphdef, state) with every float32 or bfloat16, unquantized `Linear` kernel a
    `PackedWeight` of `panel` columns (models/layers/packed.py; the model runner does this on a
    CPU),
    and how many it packed."""
    model = nnx.merge(graphdef, state)
    packed = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and node.quant is None:
            kernel = node.kernel.get_value()
            if not isinstance(kernel, PackedWeight) and kernel.dtype in (jnp.float32,
                                                                         jnp.bfloat16):
                node.kernel.set_value(PackedWeight.pack(kernel, panel, stacked=kernel.ndim == 3))
                packed += 1
    return *nnx.split(model), packed


class RMSNorm(nnx.Module):
    """Hugging Face's RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def normalized(self, x):
        """x over its root mean square, in float32."""
        xf = x.astype(jnp.float32)
        return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)

    def __call__(self, x):
        return self.weight[...] * self.normalized(x).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with rope. Another family's attention changes the q/k norms'
    class (`norm_class`: Gemma's (1 + w) norm, models/gemma.py)."""

    norm_class = RMSNorm

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, d_in: int | None = None):
        """`d_in`: the q/k/v projections' input width (EAGLE-3's layer reads [embed; hidden])."""
        H, K, Dh, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        d_in = d_in or D
        quant = cfg.quantization.dense if cfg.quantization else None
        self.num_heads, self.num_kv_heads, self.head_dim = H, K, Dh
        bias = cfg.attention_bias
        self.q_proj = Linear(d_in, H * Dh, bias=bias, dtype=dtype, rngs=rngs, quant=quant)
        self.k_proj = Linear(d_in, K * Dh, bias=bias, dtype=dtype, rngs=rngs, quant=quant)
        self.v_proj = Linear(d_in, K * Dh, bias=bias, dtype=dtype, rngs=rngs, quant=quant)
        self.o_proj = Linear(H * Dh, D, bias=cfg.o_proj_bias, dtype=dtype, rngs=rngs,
                             quant=quant)
        if cfg.qk_norm:
            self.q_norm = self.norm_class(Dh, cfg.rms_norm_eps, dtype)
            self.k_norm = self.norm_class(Dh, cfg.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        # An fp8 KV cache's scales of this layer (models/quantization/kv_scales.py), [L] once
        # stacked.
        if cfg.kv_scales:
            self.k_scale = nnx.Param(jnp.ones((), jnp.float32))
            self.v_scale = nnx.Param(jnp.ones((), jnp.float32))
        else:
            self.k_scale = self.v_scale = None

    def attention_sinks(self):
        """f32[H] sink logits of this layer's softmax (GPT-OSS: models/gpt_oss.py); None: none."""
        return None

    def __call__(self, x, cos, sin, kv_cache, layer, fb: ForwardBatch, backend: AttentionBackend,
                 meta, lora: LoraLayer = NO_LORA):
        T = x.shape[0]
        q = lora.apply("q_proj", x, self.q_proj(x)).reshape(T, self.num_heads, self.head_dim)
        k = lora.apply("k_proj", x, self.k_proj(x)).reshape(T, self.num_kv_heads, self.head_dim)
        v = lora.apply("v_proj", x, self.v_proj(x)).reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope_cos_sin(q, cos, sin), apply_rope_cos_sin(k, cos, sin)
        sinks = self.attention_sinks()
        if self.k_scale is None:
            out, kv_cache = backend.forward(q, k, v, kv_cache, layer, fb, meta, sinks)
        else:
            out, kv_cache = backend.forward_scaled(q, k, v, kv_cache, layer, fb, meta,
                                                   self.k_scale[...], self.v_scale[...], sinks)
        out = out.reshape(T, self.num_heads * self.head_dim)
        return lora.apply("o_proj", out, self.o_proj(out)), kv_cache


def activation(name: str):
    """transformers' ACT2FN entry `name` (one of config.SUPPORTED_ACTIVATIONS)."""
    if name in ("silu", "swish"):
        return jax.nn.silu
    if name == "gelu":  # exact, through erf
        return functools.partial(jax.nn.gelu, approximate=False)
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):  # the tanh approximation
        return functools.partial(jax.nn.gelu, approximate=True)
    if name == "relu":
        return jax.nn.relu
    raise ValueError(f"hidden_act {name!r} is not supported")


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.hidden_act = cfg.hidden_act
        D, F, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        quant = cfg.quantization.dense if cfg.quantization else None
        self.gate_proj = Linear(D, F, bias=bias, dtype=dtype, rngs=rngs, quant=quant)
        self.up_proj = Linear(D, F, bias=bias, dtype=dtype, rngs=rngs, quant=quant)
        self.down_proj = Linear(F, D, bias=bias, dtype=dtype, rngs=rngs, quant=quant)

    def __call__(self, x, lora: LoraLayer = NO_LORA):
        h = (activation(self.hidden_act)(lora.apply("gate_proj", x, self.gate_proj(x)))
             * lora.apply("up_proj", x, self.up_proj(x)))
        return lora.apply("down_proj", h, self.down_proj(h))


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP. Another family's layer changes the attention and the MoE
    block (`attention_class`, `moe_class`: models/deepseek.py)."""

    attention_class = Attention
    moe_class = SparseMoeBlock

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, *, moe: bool = False):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = self.attention_class(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = self.moe_class(cfg, dtype, rngs) if moe else MLP(cfg, dtype, rngs)

    def __call__(self, x, cos, sin, kv_cache, layer, fb, backend, meta, valid, moe_runner,
                 lora: LoraLayer = NO_LORA):
        """-> (x, kv_cache, i32[P] routed choices per expert slot; None for a dense layer).
        `lora`: this layer's adapters (a MoE layer's experts take none)."""
        h, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, layer, fb,
                                     backend, meta, lora)
        x = x + h
        h = self.post_attention_layernorm(x)
        if not isinstance(self.mlp, MLP):  # a MoE block
            h, counts = self.mlp(h, valid, moe_runner)
            return x + h, kv_cache, counts
        return x + self.mlp(h, lora), kv_cache, None


class LlamaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs,
                 layer_class: type[DecoderLayer] = DecoderLayer):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs)
        # One stacked module per run of layers of one kind: layers[r] holds the layers of
        # cfg.layer_runs[r].
        self.layers = nnx.List([stacked_layers(cfg, run, dtype, rngs, layer_class)
                                for run in cfg.layer_runs])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


def stacked_layers(cfg: ModelConfig, run: LayerRun, dtype, rngs: nnx.Rngs,
                   layer_class: type[DecoderLayer] = DecoderLayer) -> DecoderLayer:
    """The `run.num_layers` decoder layers of a run as one module whose parameters have a
    leading [L] axis (each layer initialised from its own split of `rngs`)."""
    @nnx.split_rngs(splits=run.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return layer_class(cfg, dtype, rngs, moe=run.moe)

    return create(rngs)


class LlamaForCausalLM(nnx.Module):
    """The causal LM: `__call__` runs the decoder over a forward batch, `compute_logits` the head.
    A family built on it names its own decoder layer (`decoder_layer`)."""

    decoder_layer: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = LlamaModel(cfg, dtype, rngs, self.decoder_layer)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs))

    def __call__(self, fb: ForwardBatch, kv_cache: jax.Array, backend: AttentionBackend,
                 moe_runner: MoeRunner = MoeRunner(), aux_layers: tuple[int, ...] = ()):
        """kv_cache [L, pages, page_size, 2K, Dh] (or the pools of models/layers/decoder_stack.py)
        -> (hidden states [T, D] after the final norm, the updated KV cache, the residual stream entering each of `aux_layers` [A, T, D] or
        None without them (EAGLE-3's draft reads three of them), i32[number of MoE layers, P]:
        the (token, choice) pairs each MoE layer routed to each expert slot, padding excluded;
        [0, P] for a dense model).

        Each scan's loop state is (activations, the cache viewed as [L * pages, ...]: a free
        reshape); its loop data are each layer's parameters and index
        (models/layers/decoder_stack.py). Layer l writes its new K/V into, and attends over, the
        rows of its own pages (`AttentionBackend.page_offset`), so the cache is updated in place
        through every loop and never copied (the caller donates it;
        `tests/engine/test_engine.py` checks the compiled HLO). `moe_runner` says how the
        experts run (grouped matmul, expert parallelism).
        """
        x, kv_cache, aux, expert_counts = run_decoder_layers(
            self.config, self.model.layers, fb, kv_cache, backend, moe_runner,
            self.embed_inputs(fb), aux_layers)
        return self.model.norm(x), kv_cache, aux, expert_counts

    def embed_inputs(self, fb: ForwardBatch):
        """[T, D]: the residual stream entering the first layer."""
        return fb.embed_inputs(self.model.embed_tokens)

    def compute_logits(self, hidden):
        """hidden [N, D] -> float32 logits [N, V]."""
        if self.lm_head is None:
            logits = self.model.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        return logits.astype(jnp.float32)
