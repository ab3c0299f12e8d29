"""Router options of the MoE layer beyond softmax top-k (DeepSeekMoE's): sigmoid scores, expert
groups, the aux-loss-free correction bias, and a scaling of the chosen weights.

`choose_experts` turns a token's router logits into its k experts and their weights; the MoE
layer then places the choices on physical slots (`models.layers.moe.place_choices`) as for any
router. Shapes: N tokens, E logical experts, G groups, k experts per token.

- scoring: "softmax" (DeepSeek-V2) or "sigmoid" (V3) of the float32 logits.
- topk_method: "greedy" (the top k scores), "group_limited_greedy" (V2: only experts of the
  `topk_groups` groups whose best score is highest), "noaux_tc" (V3: experts ranked by score +
  `e_score_correction_bias`, within the `topk_groups` groups whose two best biased scores sum
  highest). The bias only ranks: a chosen expert's weight is its unbiased score.
- the k weights are renormalised to sum to 1 (`norm_topk_prob`), then multiplied by
  `scaling_factor` (`routed_scaling_factor`).
"""

from dataclasses import dataclass

from flax import nnx
import jax
import jax.numpy as jnp

SCORINGS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    topk_method: str = "greedy"
    num_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = False
    scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"router scoring {self.scoring!r} is not one of {SCORINGS}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"router topk_method {self.topk_method!r} is not one of "
                             f"{TOPK_METHODS}")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError(f"{self.num_groups} expert groups (top {self.topk_groups}) do not "
                             f"split {self.num_experts} experts")

    @property
    def correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"


def choose_experts(router_logits, bias, cfg: RouterConfig):
    """f32 router logits [N, E] (and the correction bias f32[E], or None) -> (f32 weights
    [N, k], i32 logical experts [N, k])."""
    logits = router_logits.astype(jnp.float32)
    scores = (jax.nn.softmax(logits, axis=-1) if cfg.scoring == "softmax"
              else jax.nn.sigmoid(logits))
    ranked = scores + bias if cfg.correction_bias else scores
    if cfg.topk_method != "greedy" and cfg.num_groups > 1:
        ranked = _best_groups_only(ranked, cfg)
    _, experts = jax.lax.top_k(ranked, cfg.top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * jnp.float32(cfg.scaling_factor), experts.astype(jnp.int32)


def _best_groups_only(ranked, cfg: RouterConfig):
    """`ranked` [N, E] with every expert outside its token's `topk_groups` best groups at -inf.
    A group scores its best expert (group_limited_greedy) or its two best summed (noaux_tc)."""
    N, E = ranked.shape
    grouped = ranked.reshape(N, cfg.num_groups, E // cfg.num_groups)
    if cfg.topk_method == "noaux_tc":
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    else:
        group_scores = jnp.max(grouped, axis=-1)
    _, groups = jax.lax.top_k(group_scores, cfg.topk_groups)                 # [N, topk_groups]
    chosen = jnp.any(groups[:, :, None] == jnp.arange(cfg.num_groups)[None, None], axis=1)
    return jnp.where(chosen[:, :, None], grouped, -jnp.inf).reshape(N, E)


class ScoringRouter(nnx.Module):
    """The router's float32 weights `kernel` [D, E] (HF's `gate.weight`, kept in float32 as
    transformers keeps it) and, for noaux_tc, `e_score_correction_bias` f32[E]."""

    def __init__(self, d_model: int, cfg: RouterConfig, rngs: nnx.Rngs):
        self.config = cfg
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(
            rngs.params(), (d_model, cfg.num_experts), jnp.float32))
        self.e_score_correction_bias = (nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32))
                                        if cfg.correction_bias else None)

    def __call__(self, x):
        """x [N, D] -> (f32 weights [N, k], i32 experts [N, k])."""
        logits = x.astype(jnp.float32) @ self.kernel[...]
        bias = (self.e_score_correction_bias[...] if self.e_score_correction_bias is not None
                else None)
        return choose_experts(logits, bias, self.config)
