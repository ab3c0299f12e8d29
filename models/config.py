"""Model configuration parsed from a Hugging Face `config.json`.

`ModelConfig` holds exactly what the JAX model needs, with each architecture's quirks resolved here
once (which projections carry a bias, whether a sliding window applies, where head_dim comes
from), so the model code reads plain fields instead of re-deriving Hugging Face defaults.

Both config forms in the wild are accepted: transformers 4 (`rope_theta` + `rope_scaling`) and
transformers 5 (`rope_parameters`).

Mixture-of-experts models (Qwen3-MoE, Mixtral) add the expert fields: `num_experts` routed experts
of `moe_intermediate_size`, `num_experts_per_tok` chosen per token by a softmax router,
renormalised over the chosen ones when `norm_topk_prob`. Qwen3-MoE may keep some layers dense
(`mlp_only_layers`, `decoder_sparse_step`); `layer_runs` groups consecutive layers of one kind.

Each layer's attention kind (full, or a sliding window with its own rope) is data of the config:
`layer_types` per layer, the rules in models/layer_types.py. A family whose config.json needs
more than the shared keys normalises it in its own module first (Gemma: models/gemma_config.py),
registered in `FAMILY_CONFIGS`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from models import deepseek_config, gemma_config, gpt_oss_config
from models.layer_types import (
    FULL_ATTENTION,
    LAYER_TYPES,
    SLIDING_ATTENTION,
    layer_windows,
    periodic_runs,
    segments,
)
from models.layers.mla_config import MlaConfig
from models.quantization.config import QuantConfig, from_hf_config

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    # SDAR (JetAstra): a block-diffusion LM whose network is Qwen3's (jaxrunner/dllm/).
    "SDARForCausalLM",
    # Multi-head latent attention and DeepSeekMoE (models/deepseek.py).
    *deepseek_config.ARCHITECTURES,
    # Gemma 2 and 3 (models/gemma.py).
    *gemma_config.ARCHITECTURES,
    # Attention sinks, alternating windows, biased experts (models/gpt_oss.py).
    *gpt_oss_config.ARCHITECTURES,
)
# Families that normalise their config.json first: architecture -> d -> (the dict in the shared
# keys' form, ModelConfig fields the family sets itself).
FAMILY_CONFIGS: dict[str, Any] = {
    **dict.fromkeys(gemma_config.ARCHITECTURES, gemma_config.normalize),
    **dict.fromkeys(gpt_oss_config.ARCHITECTURES, gpt_oss_config.normalised),
}
# Checkpoints of pooling models (embeddings, classification / reward scores): the causal LM
# family whose decoder they hold, and their head. A causal LM checkpoint that ships a
# sentence-transformers pooling config (modules.json: Qwen3-Embedding, gte-Qwen2) is an
# embedding model too.
POOLING_ARCHITECTURES = {
    f"{family}{suffix}": (f"{family}ForCausalLM", head)
    for family in ("Llama", "Mistral", "Qwen2", "Qwen3")
    for suffix, head in (("Model", "embedding"), ("ForSequenceClassification", "classification"))
}
HEADS = ("lm", "embedding", "classification")
POOLING_MODES = ("last", "mean")
# Block-diffusion LMs: served only with `dllm_algorithm`, and need `mask_token_id`.
DLLM_ARCHITECTURES = ("SDARForCausalLM",)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", *deepseek_config.ARCHITECTURES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# config.json `hidden_act` values the dense MLP computes (models/llama.py `activation`);
# experts compute SiLU only.
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast",
                         "relu")

# Hugging Face's own defaults for keys that configs may leave out.
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6
# HF Qwen3Config defaults head_dim to 128 rather than hidden/heads (Qwen3MoeConfig does not).
_QWEN3_DEFAULT_HEAD_DIM = 128
# HF Qwen3MoeConfig's defaults for its expert keys (Mixtral's config names them differently).
_QWEN3_MOE_DEFAULTS = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                           norm_topk_prob=False, decoder_sparse_step=1)

_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: `theta` plus the optional frequency scaling."""

    theta: float
    rope_type: str = "default"  # "default" | "linear" | "llama3" | "yarn"
    factor: float = 1.0
    low_freq_factor: float | None = None  # llama3 only
    high_freq_factor: float | None = None  # llama3 only
    original_max_position_embeddings: int | None = None  # llama3 and yarn
    # YaRN only (transformers' names and defaults): the ramp's bounds in rotations, and the
    # cos/sin scaling, given (`attention_factor`) or derived from `factor` and the mscales.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> RopeConfig:
        """Reads rope parameters from a config dict in transformers 4 or 5 form."""
        params = d.get("rope_parameters")
        if params is not None:  # transformers 5
            theta = params.get("rope_theta") or d.get("rope_theta") or _DEFAULT_ROPE_THETA
            scaling = params
        else:  # transformers 4
            theta = d.get("rope_theta") or _DEFAULT_ROPE_THETA
            scaling = d.get("rope_scaling") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        partial = scaling.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
        if rope_type == "default":
            return cls(theta=float(theta))
        # Phi-3 style configs keep the pretraining length beside the rope parameters, and
        # transformers prefers that one; else the rope parameters', else max_position_embeddings.
        original_max = d.get("original_max_position_embeddings") or scaling.get(
            "original_max_position_embeddings", d.get("max_position_embeddings"))
        if rope_type == "yarn":
            return cls._yarn(float(theta), scaling, original_max, d.get("max_position_embeddings"))
        if "factor" not in scaling:
            raise ValueError(f"rope type {rope_type!r} needs 'factor' in its rope parameters")
        if rope_type == "linear":
            return cls(theta=float(theta), rope_type="linear", factor=float(scaling["factor"]))
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in scaling:
                raise ValueError(f"rope type 'llama3' needs {key!r} in its rope parameters")
        if original_max is None:
            raise ValueError("rope type 'llama3' needs 'original_max_position_embeddings'")
        return cls(
            theta=float(theta),
            rope_type="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(original_max),
        )

    @classmethod
    def _yarn(cls, theta: float, scaling: dict, original_max, max_positions) -> RopeConfig:
        if original_max is None:
            raise ValueError("rope type 'yarn' needs 'original_max_position_embeddings'")
        factor = scaling.get("factor")
        if factor is None:  # DeepSeek-V3 style: the ratio of the two context lengths
            if max_positions is None:
                raise ValueError("rope type 'yarn' needs 'factor' or max_position_embeddings")
            factor = max_positions / original_max
        if not isinstance(factor, (int, float)) or factor < 1.0:
            raise ValueError(f"rope type 'yarn' needs factor >= 1, got {factor!r}")
        optional = {key: (None if scaling.get(key) is None else float(scaling[key]))
                    for key in ("mscale", "mscale_all_dim", "attention_factor")}
        return cls(theta=theta, rope_type="yarn", factor=float(factor),
                   original_max_position_embeddings=int(original_max),
                   # transformers reads `or`: a null or 0 takes the default too
                   beta_fast=float(scaling.get("beta_fast") or 32.0),
                   beta_slow=float(scaling.get("beta_slow") or 1.0),
                   truncate=bool(scaling.get("truncate", True)), **optional)


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """How a decoder layer attends: over the whole context (`sliding_window` None) or over the
    last `sliding_window` positions, with the model's rope (`rope` None) or its own (Gemma 3's
    local layers). Layers of one kind share one compiled layer program."""

    sliding_window: int | None = None
    rope: RopeConfig | None = None


FULL_ATTENTION_KIND = AttentionKind()


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """Layers [start, start + num_layers), all dense or all MoE: `period` (their attention
    kinds) repeated `repeats` times (models/layer_types.py)."""

    start: int
    num_layers: int
    moe: bool
    period: tuple[AttentionKind, ...] = (FULL_ATTENTION_KIND,)

    @property
    def repeats(self) -> int:
        return self.num_layers // len(self.period)

    @property
    def segments(self) -> tuple[tuple[int, int, AttentionKind], ...]:
        """The period's (offset, count, kind) runs of consecutive layers of one kind."""
        return segments(self.period)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the model needs from a Hugging Face checkpoint's config.json.

    `attention_bias` means q/k/v projections carry a bias; whether o_proj does too is the
    `o_proj_bias` property (Qwen2: no; Llama/Qwen3: same as attention_bias). `mlp_bias`: the
    dense MLP's three projections carry one (Llama's option).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    rope: RopeConfig
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str
    # Mixture of experts (num_experts 0: a dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    # Expert slots the model holds: num_experts plus redundant copies for load balancing (EPLB);
    # set by the engine (models/sharding.py), never by config.json.
    num_physical_experts: int = 0
    # Quantized decoder projections (models/quantization/linear.py): the checkpoint's
    # `quantization_config`, or the engine's `quantization` argument (set by the engine).
    quantization: QuantConfig | None = None
    # The attention layers hold per-layer k/v scales of an fp8 KV cache
    # (models/quantization/kv_scales.py), read from the checkpoint where it has them, else 1.0; set
    # by the engine, never by config.json.
    kv_scales: bool = False
    # Block-diffusion LMs (DLLM_ARCHITECTURES): the token a block's undecided positions hold,
    # and the block length the model was trained with (None where the config names none).
    mask_token_id: int | None = None
    dllm_block_size: int | None = None
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # Each layer's attention type, transformers' names (models/layer_types.py); () means every
    # layer slides when `sliding_window` is set, else none does.
    layer_types: tuple[str, ...] = ()
    # The rope of the sliding layers where it differs from `rope` (Gemma 3's local base).
    sliding_rope: RopeConfig | None = None
    # Attention logits' scale (Gemma: query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5.
    attention_scale: float | None = None
    # Soft caps (Gemma 2): cap * tanh(x / cap) on the attention logits, and on the final logits.
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Multi-head latent attention's dimensions (models/layers/mla_config.py): the attention
    # caches one latent row per token instead of per-head K/V. None: per-head attention.
    mla: MlaConfig | None = None
    # A family's own config object, for what only that family reads (DeepSeek's:
    # models/deepseek_config.py); None for the Llama family.
    family: Any = None
    # What the decoder's last hidden states feed: "lm" (the LM head: a generative model),
    # "embedding" (pooled into a vector) or "classification" (pooled, then `score`: num_labels
    # logits, a reward model's score). Pooling: a request's "last" token or the "mean" of its
    # tokens; `normalize`: L2-normalised (sentence-transformers' Normalize module).
    head: str = "lm"
    pooling: str = "last"
    normalize: bool = False
    num_labels: int = 0
    id2label: tuple[str, ...] = ()
    # Matryoshka embeddings (config.json's `is_matryoshka`, SGLang's rule): whether requests may
    # truncate them (`dimensions`), and to which sizes (None: any up to hidden_size).
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @property
    def sm_scale(self) -> float:
        """What the attention multiplies q.k by."""
        return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale

    @property
    def attention_kinds(self) -> tuple[AttentionKind, ...]:
        """Each layer's attention kind, in order."""
        types = self.layer_types or (
            (SLIDING_ATTENTION if self.sliding_window else FULL_ATTENTION,)
            * self.num_hidden_layers)
        sliding = AttentionKind(self.sliding_window, self.sliding_rope)
        return tuple(sliding if t == SLIDING_ATTENTION and self.sliding_window else
                     FULL_ATTENTION_KIND for t in types)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """The layers that attend over a window, in order."""
        return tuple(i for i, kind in enumerate(self.attention_kinds)
                     if kind.sliding_window is not None)

    @property
    def is_generation(self) -> bool:
        """A generative model (SGLang's `is_generation`); else a pooling model."""
        return self.head == "lm"

    @property
    def is_dllm(self) -> bool:
        return self.architecture in DLLM_ARCHITECTURES

    def resolve_dtype(self, name: str) -> str:
        """The weights dtype an engine `dtype` argument names: "auto" is the checkpoint's
        `torch_dtype` when it is float32 or bfloat16, else bfloat16."""
        if name != "auto":
            return name
        return self.torch_dtype if self.torch_dtype in ("float32", "bfloat16") else "bfloat16"

    @property
    def o_proj_bias(self) -> bool:
        """Whether o_proj has a bias (Qwen2 biases q/k/v only)."""
        return self.attention_bias and self.architecture != "Qwen2ForCausalLM"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """HF Qwen3-MoE's rule (Mixtral: every layer): sparse unless listed in
        `mlp_only_layers`, and then every `decoder_sparse_step`-th layer."""
        return (self.is_moe and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The indices of the MoE layers, in order."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def layer_runs(self) -> tuple[LayerRun, ...]:
        """Runs of consecutive layers of one MLP kind (dense or MoE), each a period of attention
        kinds repeated (models/layer_types.py), in order: each run is one stacked module scanned
        on its own, so compile cost grows with the runs and their periods' segments, not with
        depth (one run of period 1 for a uniform model)."""
        kinds = self.attention_kinds
        runs: list[LayerRun] = []
        start = 0
        for i in range(1, self.num_hidden_layers + 1):
            if i < self.num_hidden_layers and self.is_moe_layer(i) == self.is_moe_layer(start):
                continue
            for offset, length, period in periodic_runs(kinds[start:i]):
                runs.append(LayerRun(start + offset, length, self.is_moe_layer(start),
                                     kinds[start + offset:start + offset + period]))
            start = i
        return tuple(runs)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Reads `config.json` (and `generation_config.json` if present) from a checkpoint dir."""
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        d = _read_json(config_path)
        generation_path = model_dir / "generation_config.json"
        generation = _read_json(generation_path) if generation_path.is_file() else {}
        try:
            cfg = cls.from_dict(d, generation_config=generation)
        except (KeyError, ValueError) as e:
            raise ValueError(f"{config_path}: {e}") from e
        pooling = _sentence_transformers_pooling(model_dir)
        if pooling is not None and cfg.head != "classification":
            cfg = dataclasses.replace(cfg, head="embedding", pooling=pooling[0],
                                      normalize=pooling[1])
        return cfg

    def as_embedding(self) -> ModelConfig:
        """This checkpoint served as an embedding model (the engine's `is_embedding`): the
        last token's hidden state, normalised, unless its pooling config says otherwise."""
        if self.head != "lm":
            return self
        return dataclasses.replace(self, head="embedding", pooling="last", normalize=True)

    @classmethod
    def from_dict(
        cls, d: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Builds a config from a parsed config.json dict (plus an optional generation config)."""
        architectures = d.get("architectures") or []
        if not architectures:
            raise ValueError("config has no 'architectures' entry")
        arch, head = POOLING_ARCHITECTURES.get(architectures[0], (architectures[0], "lm"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES + tuple(POOLING_ARCHITECTURES))}"
            )
        family_fields = {}
        if arch in FAMILY_CONFIGS:
            d, family_fields = FAMILY_CONFIGS[arch](d)
        missing = [k for k in _REQUIRED_KEYS if d.get(k) is None]
        if missing:
            raise ValueError(f"config is missing required key(s): {', '.join(missing)}")

        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim")
        if head_dim is None:
            qwen3 = arch in ("Qwen3ForCausalLM", "SDARForCausalLM")  # not Qwen3-MoE
            head_dim = _QWEN3_DEFAULT_HEAD_DIM if qwen3 else d["hidden_size"] // heads

        if arch == "Qwen2ForCausalLM":
            attention_bias = True
        elif arch == "MistralForCausalLM":
            attention_bias = False  # HF Mistral ignores attention_bias
        else:
            attention_bias = bool(d.get("attention_bias"))

        sliding_window, layer_types = layer_windows(arch, d,
                                                    normalised=arch in FAMILY_CONFIGS)
        rope, sliding_rope = _rope_per_layer_type(d)

        eos = _as_id_tuple(d.get("eos_token_id"))
        eos += _as_id_tuple((generation_config or {}).get("eos_token_id"))
        dtype = d.get("torch_dtype") or d.get("dtype") or "float32"

        common = dict(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps") or _DEFAULT_RMS_NORM_EPS),
            max_position_embeddings=int(d["max_position_embeddings"]),
            tie_word_embeddings=bool(d.get("tie_word_embeddings")),
            attention_bias=attention_bias,
            # Only HF Llama's MLP reads mlp_bias; the others' have no biases.
            mlp_bias=arch == "LlamaForCausalLM" and bool(d.get("mlp_bias")),
            hidden_act=_hidden_act(arch, d),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "SDARForCausalLM"),
            sliding_window=sliding_window,
            layer_types=layer_types,
            rope=rope,
            sliding_rope=sliding_rope,
            eos_token_ids=tuple(dict.fromkeys(eos)),  # merge, keep order, drop duplicates
            bos_token_id=d.get("bos_token_id"),
            torch_dtype=str(dtype).removeprefix("torch."),
            mask_token_id=None if d.get("mask_token_id") is None else int(d["mask_token_id"]),
            dllm_block_size=None if d.get("block_size") is None else int(d["block_size"]),
            quantization=from_hf_config(d.get("quantization_config")),
            **_head_fields(head, d),
            is_matryoshka=bool(d.get("is_matryoshka")),
            matryoshka_dimensions=(None if d.get("matryoshka_dimensions") is None
                                   else tuple(int(x) for x in d["matryoshka_dimensions"])),
        ) | family_fields
        if arch in deepseek_config.ARCHITECTURES:
            return cls(**(common | deepseek_config.model_fields(arch, d, rope)))
        return cls(**common, **_moe_fields(arch, d))


def _head_fields(head: str, d: dict[str, Any]) -> dict[str, Any]:
    """The pooling fields of a checkpoint with `head` (transformers' defaults: a classifier
    pools the last token, 2 labels named LABEL_i unless `id2label` names them)."""
    if head == "lm":
        return {}
    if head == "embedding":  # a bare decoder: SGLang's default pooling
        return dict(head=head, pooling="last", normalize=True)
    id2label = d.get("id2label") or {}
    num_labels = int(d.get("num_labels") or len(id2label) or 2)
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}")))
                   for i in range(num_labels))
    return dict(head=head, pooling="last", normalize=False, num_labels=num_labels,
                id2label=labels)


def _sentence_transformers_pooling(model_dir: Path) -> tuple[str, bool] | None:
    """(pooling mode, normalize) of a checkpoint's sentence-transformers config (modules.json
    and its Pooling module's config.json), or None without one. Raises ValueError for a
    pooling mode not implemented."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return None
    modules = _read_json(modules_path)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    if "Pooling" not in kinds:
        return None
    config = _read_json(model_dir / kinds["Pooling"].get("path", "") / "config.json")
    modes = [mode for key, mode in (("pooling_mode_lasttoken", "last"),
                                    ("pooling_mode_mean_tokens", "mean")) if config.get(key)]
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v
                    and k not in ("pooling_mode_lasttoken", "pooling_mode_mean_tokens"))
    if others or len(modes) != 1:
        raise ValueError(f"{model_dir}: sentence-transformers pooling {others or modes} is not "
                         f"supported (one of pooling_mode_lasttoken, pooling_mode_mean_tokens)")
    return modes[0], "Normalize" in kinds


def _hidden_act(arch: str, d: dict[str, Any]) -> str:
    act = d.get("hidden_act") or "silu"
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    if arch in MOE_ARCHITECTURES and act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported for {arch}: experts compute "
                         f"silu only")
    return act


def _rope_per_layer_type(d: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """(the rope of the full-attention layers, that of the sliding ones where it differs):
    transformers 5 writes per-type parameters as `rope_parameters` keyed by layer type."""
    params = d.get("rope_parameters")
    if not (isinstance(params, dict) and set(params) & set(LAYER_TYPES)):
        return RopeConfig.from_hf_config(d), None
    unknown = sorted(set(params) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"rope_parameters for layer types {unknown} are not supported")
    full, sliding = (RopeConfig.from_hf_config(dict(d, rope_parameters=params.get(t) or {}))
                     for t in (FULL_ATTENTION, SLIDING_ATTENTION))
    return full, (None if sliding == full else sliding)


def _moe_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """The expert fields of a MoE config (none for a dense one), checked."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    if arch == "MixtralForCausalLM":
        # Mixtral's experts are its MLPs: intermediate_size wide, top-k always renormalised.
        fields = dict(num_experts=d.get("num_local_experts", 8),
                      num_experts_per_tok=d.get("num_experts_per_tok", 2),
                      moe_intermediate_size=d["intermediate_size"], norm_topk_prob=True,
                      mlp_only_layers=(), decoder_sparse_step=1)
    else:
        def get(key):
            value = d.get(key)
            return _QWEN3_MOE_DEFAULTS[key] if value is None else value
        # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts.
        experts = d.get("num_experts", d.get("num_local_experts"))
        fields = dict(num_experts=_QWEN3_MOE_DEFAULTS["num_experts"] if experts is None
                      else experts,
                      num_experts_per_tok=get("num_experts_per_tok"),
                      moe_intermediate_size=get("moe_intermediate_size"),
                      norm_topk_prob=bool(get("norm_topk_prob")),
                      mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
                      decoder_sparse_step=get("decoder_sparse_step"))
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "decoder_sparse_step"):
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if fields["num_experts_per_tok"] > fields["num_experts"]:
        raise ValueError(f"num_experts_per_tok ({fields['num_experts_per_tok']}) exceeds the "
                         f"number of experts ({fields['num_experts']})")
    fields["num_physical_experts"] = fields["num_experts"]
    return fields


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
