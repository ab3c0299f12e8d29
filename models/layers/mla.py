"""Multi-head latent attention (DeepSeek V2/V3) over a cache of one latent row per token.

A token's keys and values are made from a low-rank latent: `kv_a_proj_with_mqa` gives the
compressed KV `c_kv` [R] (normalised by `kv_a_layernorm`) and one rope key `k_pe` [Dr] shared by
every head; `kv_b_proj` [R -> H * (Dn + Dv)] would expand `c_kv` into each head's no-rope key
and value. The cache holds only the latent row [c_kv | k_pe] (R + Dr: 576 for DeepSeek V3), and
attention runs in the absorbed form, for prefill and decode alike:

    score_h(t, s) = q_nope_h(t) . (W_UK_h c(s)) + q_pe_h(t) . k_pe(s)
                  = [W_UK_h^T q_nope_h(t) | q_pe_h(t)] . [c(s) | k_pe(s)]
    out_h(t)      = W_UV_h (sum_s p_h(t, s) c(s))

so the backend sees multi-query attention: H query heads of width R + Dr over one shared KV row
whose first R entries are the values (`AttentionConfig.value_dim`), and a step reads R + Dr
values per cached token and layer. Shapes: T tokens, D hidden, H heads, R kv_lora_rank, Dn/Dr
the no-rope/rope query-key dims, Dv the value dim.

Rope is applied to the last Dr dims of q and to k_pe; with `rope_interleave` (DeepSeek's
layout) the rotated pairs are adjacent dims (x0, x1), (x2, x3), ..., which are gathered into
halves first. q and k get the same permutation, so their dot product is transformers'.
"""

from flax import nnx
import jax.numpy as jnp

from jaxrunner.attention import AttentionBackend
from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.lora.layers import NO_LORA, LoraLayer
from models.config import ModelConfig
from models.layers.rope import apply_rope_cos_sin
from models.llama import Linear, RMSNorm
from models.quantization.linear import QuantConfig

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon, not the
# config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class KvUpProjection(nnx.Module):
    """kv_b_proj's weight `kernel` [R, H * (Dn + Dv)] (HF's [out, in] transposed; with `quant`
    in its weight dtype, `weight_scale` beside it, as a quantized Linear). It is never
    multiplied as a Linear: each head's two parts are absorbed into the query and the output."""

    def __init__(self, d_in: int, d_out: int, dtype, rngs: nnx.Rngs,
                 quant: QuantConfig | None = None):
        self.quant = quant
        if quant is None:
            self.kernel = nnx.Param(
                nnx.initializers.lecun_normal()(rngs.params(), (d_in, d_out), dtype))
        else:  # loaded from the checkpoint, never initialised
            self.kernel = nnx.Param(jnp.zeros((d_in, d_out), quant.weight_dtype))
            self.weight_scale = nnx.Param(jnp.ones(quant.scale_shape(d_in, d_out), jnp.float32))

    def weight(self, dtype):
        """The real weight [R, H * (Dn + Dv)] in `dtype` (a quantized one times its scales)."""
        kernel = self.kernel[...]
        if self.quant is None:
            return kernel.astype(dtype)
        scale = self.weight_scale[...]
        if self.quant.block_size is not None:
            bo, bi = self.quant.block_size
            scale = jnp.repeat(jnp.repeat(scale, bi, axis=0), bo, axis=1)
            scale = scale[:kernel.shape[0], :kernel.shape[1]]
        return (kernel.astype(jnp.float32) * scale).astype(dtype)


def deinterleave(x):
    """[..., Dr] with rope pairs in adjacent dims -> the pairs' first and second halves."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class MultiLatentAttention(nnx.Module):
    """HF's DeepseekV2Attention / DeepseekV3Attention (attribute names as theirs)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        mla, quant, bias = cfg.mla, cfg.quantization, cfg.attention_bias
        H, D, R = cfg.num_attention_heads, cfg.hidden_size, mla.kv_lora_rank
        self.mla, self.num_heads = mla, H
        if mla.q_lora_rank is None:
            self.q_proj = Linear(D, H * mla.qk_head_dim, bias=False, dtype=dtype, rngs=rngs,
                                 quant=quant)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(D, mla.q_lora_rank, bias=bias, dtype=dtype, rngs=rngs,
                                   quant=quant)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = Linear(mla.q_lora_rank, H * mla.qk_head_dim, bias=False,
                                   dtype=dtype, rngs=rngs, quant=quant)
        self.kv_a_proj_with_mqa = Linear(D, mla.latent_dim, bias=bias, dtype=dtype, rngs=rngs,
                                         quant=quant)
        self.kv_a_layernorm = RMSNorm(R, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = KvUpProjection(R, H * (mla.qk_nope_head_dim + mla.v_head_dim), dtype,
                                        rngs, quant)
        self.o_proj = Linear(H * mla.v_head_dim, D, bias=bias, dtype=dtype, rngs=rngs,
                             quant=quant)

    def _queries(self, x):
        """x [T, D] -> q [T, H, Dn + Dr]."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.reshape(x.shape[0], self.num_heads, self.mla.qk_head_dim)

    def _rope(self, x, cos, sin):
        """Rotates x [T, heads, Dr] (cos/sin [T, Dr])."""
        if self.mla.rope_interleave:
            x = deinterleave(x)
        return apply_rope_cos_sin(x, cos, sin)

    def __call__(self, x, cos, sin, kv_cache, layer, fb: ForwardBatch,
                 backend: AttentionBackend, meta, lora: LoraLayer = NO_LORA):
        """x [T, D] -> (out [T, D], kv_cache with this layer's latent rows written). `lora` is
        accepted for the decoder layer's one signature; the engine refuses LoRA with MLA."""
        mla, H, R, Dn = self.mla, self.num_heads, self.mla.kv_lora_rank, self.mla.qk_nope_head_dim
        T = x.shape[0]
        q = self._queries(x)
        latent = self.kv_a_proj_with_mqa(x)                                  # [T, R + Dr]
        c_kv = self.kv_a_layernorm(latent[:, :R])
        k_pe = self._rope(latent[:, None, R:], cos, sin)                     # [T, 1, Dr]
        q_pe = self._rope(q[..., Dn:], cos, sin)                             # [T, H, Dr]
        w = self.kv_b_proj.weight(x.dtype).reshape(R, H, Dn + mla.v_head_dim)
        q_latent = jnp.einsum("thn,rhn->thr", q[..., :Dn], w[..., :Dn])      # W_UK absorbed
        query = jnp.concatenate([q_latent, q_pe], axis=-1)                   # [T, H, R + Dr]
        rows = jnp.concatenate([c_kv[:, None, :], k_pe], axis=-1)            # [T, 1, R + Dr]
        out, kv_cache = backend.forward(query, rows, None, kv_cache, layer, fb, meta)
        out = jnp.einsum("thr,rhv->thv", out, w[..., Dn:])                   # W_UV: [T, H, Dv]
        return self.o_proj(out.reshape(T, H * mla.v_head_dim)), kv_cache
