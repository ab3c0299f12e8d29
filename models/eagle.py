"""EAGLE and EAGLE-3 draft heads, from their published checkpoint formats (and the registry of
draft heads: DeepSeek's MTP layer, models/deepseek_mtp.py, drafts as one).

Both heads read the target's token embeddings and hidden states and predict the next token one
position ahead; neither has an embedding of its own (they use the target's, passed in).

EAGLE (EAGLE-1/2; SGLang's `LlamaForCausalLMEagle`): `fc` maps [embed(t_{p+1}); h_p] (2D) to D,
then one Llama decoder layer without its input norm (`layers.0.*`); the output, un-normed, is
both the next step's hidden state and, through the target's LM head, the logits. Tensors:
`fc.weight`, `fc.bias` (when the checkpoint has it), `layers.0.self_attn.*`, `layers.0.mlp.*`,
`layers.0.post_attention_layernorm.weight`.

EAGLE-3 (`LlamaForCausalLMEagle3`): the target's hidden state is three of its layers' inputs
concatenated (3 D_target), mapped by `fc` to D; the decoder layer (`midlayer.*`) norms the
embedding (`input_layernorm`) and the hidden state (`hidden_norm`) and attends over their
concatenation (q/k/v read 2D); `norm` and its own `lm_head` give logits over a reduced draft
vocabulary, mapped to target ids by `d2t` (target id = draft id + d2t[draft id]). The hidden
state passed on is the residual stream before `norm`. Tensors: `fc.weight`, `midlayer.*`,
`norm.weight`, `lm_head.weight`, `d2t` (and `t2d`, unused).

Shapes: T tokens, D the head's hidden size, Dt the target's, V the target vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from flax import nnx
import jax.numpy as jnp

from jaxrunner.attention import AttentionBackend
from jaxrunner.batch.forward_batch import ForwardBatch
from models.config import ModelConfig
from models.deepseek_mtp import MtpHead, MtpHeadConfig
from models.layers.moe_parallel import MoeRunner
from models.layers.rope import step_cos_sin
from models.llama import MLP, Attention, Linear, RMSNorm
from models.loading.loader import load_model
from models.loading.weights import checkpoint_tensor_names

ALGORITHMS = ("EAGLE", "EAGLE3")
# Checkpoint tensors the heads do not use: the target's embedding is used instead of a copy,
# and t2d is d2t's inverse.
IGNORED_TENSORS = ("embed_tokens.weight", "t2d")


@dataclasses.dataclass(frozen=True)
class DraftHeadConfig:
    """What an EAGLE or EAGLE-3 head needs, read from its config.json and checked against the
    target's config."""

    algorithm: str
    layer: ModelConfig            # the head's decoder layer: hidden size, heads, rope, norms
    target_hidden_size: int
    vocab_size: int               # the target's vocabulary (the embedding the head reads)
    draft_vocab_size: int         # rows of the head's LM head (EAGLE: the target's vocabulary)
    fc_bias: bool
    aux_layer_ids: tuple[int, ...]  # EAGLE-3: the target layers whose inputs it reads

    @property
    def num_hidden_layers(self) -> int:
        return 1

    @classmethod
    def from_pretrained(cls, path: str | Path, algorithm: str,
                        target: ModelConfig) -> DraftHeadConfig:
        """Raises ValueError naming what does not fit the target."""
        if algorithm not in ALGORITHMS:
            raise ValueError(f"no draft head for speculative algorithm {algorithm!r}")
        path = Path(path)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in draft checkpoint {path}")
        d = json.loads(config_path.read_text())
        # The head's layer is a Llama layer whatever `architectures` says (EAGLE checkpoints
        # write LlamaForCausalLM, LlamaForCausalLMEagle or LlamaForCausalLMEagle3).
        layer = ModelConfig.from_dict(dict(d, architectures=["LlamaForCausalLM"]))
        where = f"draft checkpoint {path}"
        if layer.num_hidden_layers != 1:
            raise ValueError(f"{where}: {algorithm} heads with num_hidden_layers="
                             f"{layer.num_hidden_layers} are not supported (every published "
                             f"head has one decoder layer)")
        if layer.vocab_size != target.vocab_size:
            raise ValueError(f"{where}: vocab_size {layer.vocab_size} differs from the target's "
                             f"{target.vocab_size}; the head reads the target's embeddings")
        names = set(checkpoint_tensor_names(path))
        if algorithm == "EAGLE":
            target_hidden = layer.hidden_size
            draft_vocab = target.vocab_size
            fc_bias = "fc.bias" in names
            aux = ()
        else:
            target_hidden = int(d.get("target_hidden_size") or layer.hidden_size)
            draft_vocab = int(d.get("draft_vocab_size") or layer.vocab_size)
            fc_bias = bool(d.get("bias", False))
            ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            aux = tuple(int(i) for i in ids) if ids else default_aux_layers(
                target.num_hidden_layers)
            if len(aux) != 3:
                raise ValueError(f"{where}: EAGLE-3 reads three target layers, got {aux}")
            bad = [i for i in aux if not 0 <= i < target.num_hidden_layers]
            if bad:
                raise ValueError(f"{where}: aux hidden state layers {bad} are outside the "
                                 f"target's {target.num_hidden_layers} layers")
            if not 0 < draft_vocab <= target.vocab_size:
                raise ValueError(f"{where}: draft_vocab_size {draft_vocab} must be in "
                                 f"[1, {target.vocab_size}]")
        if target_hidden != target.hidden_size:
            raise ValueError(f"{where}: its hidden states are {target_hidden} wide but the "
                             f"target's hidden_size is {target.hidden_size}")
        if algorithm == "EAGLE" and layer.hidden_size != target.hidden_size:
            raise ValueError(f"{where}: an EAGLE head's hidden_size ({layer.hidden_size}) must "
                             f"be the target's ({target.hidden_size}): it feeds the target's "
                             f"LM head")
        return cls(algorithm=algorithm, layer=layer, target_hidden_size=target_hidden,
                   vocab_size=target.vocab_size, draft_vocab_size=draft_vocab, fc_bias=fc_bias,
                   aux_layer_ids=aux)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """SGLang's default for EAGLE-3 without `eagle_aux_hidden_state_layer_ids`: the inputs of
    layers 2, L // 2 and L - 3, clamped into a shallow model's range."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


class EagleLayer(nnx.Module):
    """A Llama decoder layer; EAGLE's has no input norm, EAGLE-3's norms two inputs."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, *, eagle3: bool):
        D = cfg.hidden_size
        if eagle3:
            self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
            self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, d_in=2 * D if eagle3 else D)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)


class _HeadBase(nnx.Module):
    def _attend_and_mlp(self, layer: EagleLayer, x, residual, fb, kv_cache, backend):
        """The layer after its input: attention over the head's cache, then the MLP; returns
        the residual stream after the layer and the updated cache."""
        cfg = self.config.layer
        meta = backend.init_forward_metadata(fb)
        cos, sin = step_cos_sin(cfg.rope, cfg.head_dim, fb.positions)
        flat = kv_cache.reshape(-1, *kv_cache.shape[2:])
        h, flat = layer.self_attn(x, cos, sin, flat, jnp.int32(0), fb, backend, meta)
        residual = residual + h
        out = residual + layer.mlp(layer.post_attention_layernorm(residual))
        return out, flat.reshape(kv_cache.shape)


class EagleHead(_HeadBase):
    """EAGLE-1/2: `__call__` -> (hidden [T, D], cache); logits through the target's LM head."""

    def __init__(self, config: DraftHeadConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.config = config
        D = config.layer.hidden_size
        self.fc = Linear(2 * D, D, bias=config.fc_bias, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([EagleLayer(config.layer, dtype, rngs, eagle3=False)])

    def __call__(self, fb: ForwardBatch, kv_cache, backend: AttentionBackend, embeds, hidden):
        """embeds [T, D]: the target's embeddings of the tokens; hidden [T, D]: the target's
        last hidden state (after its norm) one position back, or the head's own output."""
        x = self.fc(jnp.concatenate([embeds, hidden.astype(embeds.dtype)], axis=-1))
        return self._attend_and_mlp(self.layers[0], x, x, fb, kv_cache, backend)

    def to_target_ids(self, draft_ids):
        return draft_ids


class Eagle3Head(_HeadBase):
    """EAGLE-3: `__call__` -> (hidden [T, D] before `norm`, cache); `compute_logits` over the
    draft vocabulary, `to_target_ids` maps its ids."""

    def __init__(self, config: DraftHeadConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.config = config
        D = config.layer.hidden_size
        self.fc = Linear(3 * config.target_hidden_size, D, bias=config.fc_bias, dtype=dtype,
                         rngs=rngs)
        self.midlayer = EagleLayer(config.layer, dtype, rngs, eagle3=True)
        self.norm = RMSNorm(D, config.layer.rms_norm_eps, dtype)
        self.lm_head = Linear(D, config.draft_vocab_size, bias=False, dtype=dtype, rngs=rngs)
        self.d2t = nnx.Variable(jnp.zeros((config.draft_vocab_size,), jnp.int32))

    def __call__(self, fb: ForwardBatch, kv_cache, backend: AttentionBackend, embeds, hidden):
        """embeds [T, D]; hidden [T, 3 Dt] (the target's three layers, mapped by fc) or [T, D]
        (the head's own previous output)."""
        hidden = hidden.astype(embeds.dtype)
        if hidden.shape[-1] != self.config.layer.hidden_size:
            hidden = self.fc(hidden)
        layer = self.midlayer
        x = jnp.concatenate([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], axis=-1)
        return self._attend_and_mlp(layer, x, hidden, fb, kv_cache, backend)

    def compute_logits(self, hidden):
        return self.lm_head(self.norm(hidden)).astype(jnp.float32)

    def to_target_ids(self, draft_ids):
        return draft_ids + self.d2t[...][draft_ids]


HEAD_CLASSES = {"EAGLE": EagleHead, "EAGLE3": Eagle3Head, "NEXTN": MtpHead}


def head_config(algorithm: str, path: str | Path, target: ModelConfig):
    """The draft head config of `algorithm` (a key of HEAD_CLASSES) at `path` for `target`:
    an EAGLE head's own checkpoint, or a DeepSeek checkpoint's MTP layer (NEXTN)."""
    if algorithm == "NEXTN":
        return MtpHeadConfig.from_target(path, target)
    return DraftHeadConfig.from_pretrained(path, algorithm, target)


def load_head(algorithm: str, config, path: str | Path, dtype, place, moe_runner: MoeRunner):
    """The draft head of `algorithm` with its weights, placed by `place`; `config` as
    `head_config` made it (its `layer` as sharded), `moe_runner` how a MoE layer's experts run
    (the MTP layer's)."""
    if algorithm == "NEXTN":
        return config.load(path, dtype, place, moe_runner)
    return load_model(HEAD_CLASSES[algorithm], config, path, dtype, place,
                      ignore=IGNORED_TENSORS)
