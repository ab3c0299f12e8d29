"""The dimensions of multi-head latent attention (models/layers/mla.py), jax-free: the model
config, the memory plan and the attention backends read them.

A token's KV in one layer is one latent row: the normalised compressed KV `c_kv`
[kv_lora_rank] and the shared rope key `k_pe` [qk_rope_head_dim], side by side
(`latent_dim`, 576 for DeepSeek V2/V3). Keys and values of every head are `kv_b_proj` of
`c_kv`; absorbed into the queries, attention is multi-query over the latent rows, whose first
`kv_lora_rank` entries are the values.
"""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None      # None: a plain q_proj (DeepSeek-V2-Lite)
    # The rope dims rotate in adjacent pairs (x0, x1), (x2, x3), ... as DeepSeek lays them out;
    # False: NeoX halves, as Llama (transformers' `rope_interleave`).
    rope_interleave: bool
    softmax_scale: float         # multiplies q . k: qk_head_dim ** -0.5, YaRN's mscale folded in

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """The width of a token's cached latent row: c_kv then k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature term: 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(qk_head_dim: int, rope) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under a scaled rope with
    `mscale_all_dim` (transformers' `yarn_apply_mscale`: DeepSeek scales q . k as a whole, the
    non-rotary dims too). `rope`: a models.config.RopeConfig."""
    scale = qk_head_dim ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale
