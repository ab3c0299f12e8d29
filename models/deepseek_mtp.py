"""DeepSeek-V3's multi-token-prediction (MTP) layer as a speculative draft head
(`speculative_algorithm="NEXTN"`, SGLang's name).

The checkpoint's MTP layer k (`model.layers.{L + k}`, models/loading/mtp_checkpoint.py) predicts
the token after next: for position p it combines the embedding of token p + 1 with the target's
hidden state at p (after the final norm),

    x = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])

runs one decoder layer of the target's kind (MLA over a latent cache of its own, DeepSeekMoE),
and normalises the result (`shared_head.norm`); the target's LM head gives its logits. It reads
what an EAGLE head reads, so it drafts with EAGLE's step programs (jaxrunner/speculative/
steps.py): its prefill after the target's, a draft step per further draft (its own output as
the next hidden state, as SGLang chains one MTP layer), and DRAFT_EXTEND over the accepted
tokens. The first MTP layer is used; its copies of the embedding and the LM head are not read.
"""

import dataclasses
import functools
from pathlib import Path

from flax import nnx
import jax
import jax.numpy as jnp

from jaxrunner.attention import AttentionBackend
from jaxrunner.batch.forward_batch import ForwardBatch
from models.config import LayerRun, ModelConfig
from models.deepseek import DeepseekDecoderLayer
from models.layers.moe_parallel import MoeRunner
from models.layers.rope import step_cos_sin
from models.llama import Linear, RMSNorm, stacked_layers
from models.loading.loader import load_model
from models.loading.mtp_checkpoint import HEAD_TENSORS, MtpCheckpoint
from models.loading.weights import checkpoint_tensor_names


@dataclasses.dataclass(frozen=True)
class MtpHeadConfig:
    """The MTP layer of a DeepSeek target: `layer` is the target's config as one MoE layer."""

    layer: ModelConfig
    checkpoint_layer: int          # its index in the checkpoint: the target's layer count
    aux_layer_ids: tuple[int, ...] = ()  # EAGLE-3's notion: none

    @property
    def num_hidden_layers(self) -> int:
        return 1

    @classmethod
    def from_target(cls, path: str | Path, target: ModelConfig) -> "MtpHeadConfig":
        """The first MTP layer of the checkpoint at `path` (the target's own, usually).
        Raises ValueError when the target has none."""
        family = target.family
        nextn = family.num_nextn_predict_layers if family is not None else 0
        if not target.is_moe or nextn < 1:
            raise ValueError(f"speculative_algorithm 'NEXTN' needs a checkpoint with "
                             f"multi-token-prediction layers; {target.architecture} at {path} "
                             f"has num_nextn_predict_layers={nextn}")
        index = target.num_hidden_layers
        prefix = f"model.layers.{index}."
        names = {n[len(prefix):] for n in checkpoint_tensor_names(path) if n.startswith(prefix)}
        missing = [t + "weight" for t in HEAD_TENSORS if t + "weight" not in names]
        if missing:
            raise ValueError(f"speculative_algorithm 'NEXTN': checkpoint {path} lacks the MTP "
                             f"layer's {[prefix + m for m in missing]}")
        layer = dataclasses.replace(target, num_hidden_layers=1, mlp_only_layers=())
        return cls(layer=layer, checkpoint_layer=index)

    def load(self, path, dtype, place, moe_runner: MoeRunner) -> "MtpHead":
        """The head with its weights from the checkpoint at `path`, placed by `place`
        (models/loading/loader.py), its experts run by `moe_runner`."""
        return load_model(functools.partial(MtpHead, moe_runner=moe_runner), self.layer, path,
                          dtype, place,
                          open_checkpoint=lambda d: MtpCheckpoint(d, self.checkpoint_layer))


class _MtpDecoder(nnx.Module):
    """The MTP layer's decoder layer, stacked as the causal LM's runs are ([1, ...]), so the
    loader reads it as `model.layers.0.*`."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        run = LayerRun(start=0, num_layers=1, moe=True)
        self.layers = nnx.List([stacked_layers(cfg, run, dtype, rngs, DeepseekDecoderLayer)])


class _SharedHead(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype):
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class MtpHead(nnx.Module):
    """`__call__` -> (hidden [T, D] after shared_head.norm, cache); logits through the target's
    LM head (it has no `lm_head` of its own)."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs,
                 moe_runner: MoeRunner = MoeRunner()):
        """`cfg`: the MTP layer's (`MtpHeadConfig.layer`)."""
        D = cfg.hidden_size
        self.config, self.moe_runner = cfg, moe_runner
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        # DeepSeek publishes eh_proj unquantized in its fp8 checkpoints.
        self.eh_proj = Linear(2 * D, D, bias=False, dtype=dtype, rngs=rngs)
        self.model = _MtpDecoder(cfg, dtype, rngs)
        self.shared_head = _SharedHead(cfg, dtype)

    def __call__(self, fb: ForwardBatch, kv_cache, backend: AttentionBackend, embeds, hidden):
        """embeds [T, D]: the target's embeddings of the tokens one ahead; hidden [T, D]: the
        target's last hidden state (after its norm), or this head's previous output. kv_cache:
        the head's latent cache [1, pages, page_size, W]."""
        cfg = self.config
        x = self.eh_proj(jnp.concatenate([self.enorm(embeds),
                                          self.hnorm(hidden.astype(embeds.dtype))], axis=-1))
        graphdef, state = nnx.split(self.model.layers[0])
        layer = nnx.merge(graphdef, jax.tree.map(lambda p: p[0], state))
        cos, sin = step_cos_sin(cfg.rope, cfg.head_dim, fb.positions)
        valid = jnp.arange(fb.num_tokens) < jnp.sum(fb.extend_seq_lens)  # padding routes nowhere
        flat = kv_cache.reshape(-1, *kv_cache.shape[2:])
        x, flat, _ = layer(x, cos, sin, flat, jnp.int32(0), fb, backend,
                           backend.init_forward_metadata(fb), valid, self.moe_runner)
        return self.shared_head.norm(x), flat.reshape(kv_cache.shape)

    def to_target_ids(self, draft_ids):
        return draft_ids
