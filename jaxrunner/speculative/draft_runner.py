"""The draft model's runner: an EAGLE or EAGLE-3 head, or a standalone model, on the target's
page ids.

Its KV cache has the target's page count and is indexed by the target's page tables: one page
allocator books both (the target's KV budget counts the draft's bytes per token), so a request's
pages hold its target and draft KV alike and are freed together. Besides the cache it keeps the
per-slot draft buffers (`speculative.steps.DraftState`) that its steps update in place. It
compiles, by bucket: EXTEND (the draft's prefill after the target's), DECODE (one draft step of a
chain's round) and, for EAGLE heads, DRAFT_EXTEND (the draft over a verify step's accepted
tokens); a tree drafter its tree step (TARGET_VERIFY-shaped) instead of DECODE, and DRAFT_EXTEND.
"""

import dataclasses
from functools import partial

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.attention import AttentionConfig, create_attention_backend, resolve_backend_name
from jaxrunner.batch.buckets import (
    Bucket,
    decode_buckets,
    executable_mode,
    extend_buckets,
    pick_bucket,
    verify_buckets,
)
from jaxrunner.batch.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.mem_cache.kv_cache import TokenToKVPool, kv_bytes_per_token
from jaxrunner.runner.model_runner import ForwardModeNotImplemented, ModelRunner, _forward_step
from jaxrunner.speculative.eagle_tree import eagle_tree_draft_step
from jaxrunner.speculative.spec_info import (
    DraftDecodeInput,
    DraftExtendInput,
    DraftPrefillInput,
    TreeCatchupInput,
    TreeDraftInput,
)
from jaxrunner.speculative.steps import (
    DraftState,
    draft_decode_step,
    draft_extend_step,
    draft_prefill_step,
)
from jaxrunner.speculative.tree_steps import tree_catchup_step, tree_draft_step
from models.eagle import HEAD_CLASSES, IGNORED_TENSORS, DraftHeadConfig
from models.layers.moe_parallel import MoeRunner
from models.loading.loader import load_model
from models.registry import model_class
from models.sharding import ShardedPlacer, sharded_model_config

HEADS = tuple(HEAD_CLASSES)


def draft_kv_bytes_per_token(layer_cfg, num_layers: int, tp_size: int, dtype) -> int:
    """The draft's KV bytes per token per device."""
    kv_heads = sharded_model_config(layer_cfg, tp_size).num_key_value_heads
    return kv_bytes_per_token(num_layers, kv_heads // tp_size, layer_cfg.head_dim, dtype)


def _standalone_step(step, state, shared, kv_cache, draft, fb):
    """A standalone draft's prefill is the model's plain step (its logits are not used)."""
    _, kv_cache = step(state, kv_cache, fb)
    return None, kv_cache, draft


class DraftRunner(ModelRunner):
    """`kind` is "EAGLE", "EAGLE3" or "STANDALONE"; `config` a DraftHeadConfig (heads) or the
    draft model's ModelConfig. Its weights are loaded once and kept: the engine's weight
    updates and memory release act on the target (`ModelRunner.weights`), not on the draft."""

    state = None  # the draft's own weights, a plain attribute (the target's is `weights.state`)

    def __init__(self, target: ModelRunner, kind: str, config, path: str, window: int,
                 topk: int = 1, num_steps: int = 0):
        """`topk` > 1: drafting trees of `num_steps` levels in the verify window
        (jaxrunner/speculative/tree.py; an EAGLE head's: speculative/eagle_tree.py)."""
        self.target = target
        self.topk, self.num_steps = topk, num_steps
        self.kind = kind
        self.head_config = config if kind in HEADS else None
        self.layer_config = config.layer if kind in HEADS else config
        self.draft_path = path
        self.window = window
        self.abstract = False
        self.speculative = None
        self.model_config = self.layer_config
        self.parallel = target.parallel
        self.device = target.device
        self.compile_monitor = target.compile_monitor
        self.context_len = target.context_len
        self.released_tags = set()
        self.args = dataclasses.replace(target.args, model_path=path)
        self.load_model()
        self.kv_cache_dtype = target.kv_cache_dtype
        self.init_memory_pool()
        self.init_attention_backend()
        self.buckets = self.plan_buckets()
        self.precompile()

    # ---- initialisation ----

    def load_model(self) -> None:
        self.dtype = self.target.dtype
        tp = self.parallel.tp_size
        self.sharded_config = layer = sharded_model_config(self.layer_config, tp)
        # A head's layer is dense; a standalone draft may be a MoE model, run as the target's.
        self.moe_runner = MoeRunner() if self.head_config is not None else self._moe_runner(layer)
        place = ShardedPlacer.for_model(self.parallel.mesh, self.layer_config,
                                        self.moe_runner.expert_axes)
        if self.head_config is not None:
            config = dataclasses.replace(self.head_config, layer=layer)
            model = load_model(HEAD_CLASSES[self.kind], config, self.draft_path, self.dtype,
                               place, ignore=IGNORED_TENSORS)
        else:
            model = load_model(model_class(layer), layer, self.draft_path, self.dtype, place)
        self.graphdef, self.state = nnx.split(model)
        self.weights_bytes = sum(x.addressable_shards[0].data.nbytes
                                 for x in jax.tree.leaves(self.state))

    @property
    def num_layers(self) -> int:
        return 1 if self.head_config is not None else self.layer_config.num_hidden_layers

    @property
    def hidden_width(self) -> int:
        """What the draft's next step reads of its own output (0: nothing, a standalone model)."""
        return self.layer_config.hidden_size if self.head_config is not None else 0

    @property
    def target_hidden_width(self) -> int:
        """What the draft reads of the target: EAGLE-3 three layers, EAGLE the last."""
        if self.kind == "EAGLE3":
            return 3 * self.head_config.target_hidden_size
        return self.target.model_config.hidden_size

    def init_memory_pool(self) -> None:
        target, cfg = self.target, self.sharded_config
        num_pages = target.token_to_kv_pool.shape[1]
        self.max_total_tokens = target.max_total_tokens
        self.max_pages_per_req = target.max_pages_per_req
        self.token_to_kv_pool = TokenToKVPool(self.num_layers, num_pages, self.args.page_size,
                                              cfg.num_key_value_heads, cfg.head_dim,
                                              self.kv_cache_dtype, self.parallel.kv_cache)
        # One row per request slot, and a last one padding rows write to.
        self.num_slots = target.req_to_token_pools[0].num_slots + 1
        replicated = self.parallel.replicated
        self.draft_state = DraftState(
            tokens=jax.device_put(np.zeros((self.num_slots, self.window), np.int32), replicated),
            hidden=jax.device_put(np.zeros((self.num_slots, self.hidden_width), self.dtype),
                                  replicated),
            parents=(jax.device_put(np.full((self.num_slots, self.window), -1, np.int32),
                                    replicated) if self.tree else None))

    @property
    def tree(self) -> bool:
        return self.topk > 1

    @property
    def trash_slot(self) -> int:
        return self.num_slots - 1

    def init_attention_backend(self) -> None:
        cfg = self.sharded_config
        self.attention_backend_name = resolve_backend_name(self.args.attention_backend,
                                                           self.device.platform)
        attn_config = AttentionConfig(
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, page_size=self.args.page_size, sm_scale=cfg.head_dim ** -0.5,
            num_layers=self.num_layers, sliding_window=cfg.sliding_window)
        self.attn_backend = create_attention_backend(self.attention_backend_name, attn_config,
                                                     interpret=self.args.pallas_interpret,
                                                     mesh=self.parallel.mesh)

    def plan_buckets(self) -> list[Bucket]:
        args = self.args
        buckets = extend_buckets(args.max_prefill_tokens, args.max_running_requests)
        if not self.tree:  # a chain's draft steps; a tree drafts in one window-shaped step
            buckets += decode_buckets(args.max_running_requests)
        if self.head_config is not None or self.tree:
            buckets += verify_buckets(args.max_running_requests, self.window,
                                      ForwardMode.DRAFT_EXTEND)
        if self.tree:  # the tree step, over the verify window
            buckets += verify_buckets(args.max_running_requests, self.window)
        return buckets

    def capture_for(self, bucket: Bucket) -> CaptureHiddenMode:
        return CaptureHiddenMode.NULL

    def sample_sizes(self) -> list[int]:
        return []  # drafts are the argmax, inside the draft steps

    def _program_fingerprint(self) -> tuple:
        # The draft's steps also take the target's weights (its embedding and LM head).
        return (super()._program_fingerprint(), self.kind, self.window, self.topk,
                self.num_steps, self.target._program_fingerprint())

    # ---- the step programs ----

    def step_function(self, mode: ForwardMode):
        backend, target = self.attn_backend, self.target.graphdef
        if mode == ForwardMode.EXTEND:
            if self.head_config is None:
                return partial(_standalone_step,
                               partial(_forward_step, self.graphdef, backend, self.moe_runner, ()))
            return partial(draft_prefill_step, self.graphdef, backend, target)
        if mode == ForwardMode.DECODE:
            return partial(draft_decode_step, self.graphdef, backend, target)
        if self.tree and mode == ForwardMode.TARGET_VERIFY:
            if self.head_config is not None:
                return partial(eagle_tree_draft_step, self.graphdef, backend, target, self.topk,
                               self.num_steps)
            return partial(tree_draft_step, self.graphdef, backend, self.moe_runner, self.topk,
                           self.num_steps)
        if self.tree and self.head_config is None and mode == ForwardMode.DRAFT_EXTEND:
            return partial(tree_catchup_step, self.graphdef, backend, self.moe_runner)
        if mode == ForwardMode.DRAFT_EXTEND:
            return partial(draft_extend_step, self.graphdef, backend, target)
        raise ForwardModeNotImplemented(f"a draft runner has no forward mode {mode.name}")

    def jit_step(self, mode: ForwardMode):
        replicated = self.parallel.replicated
        return jax.jit(self.step_function(mode), donate_argnums=(2, 3),
                       out_shardings=(replicated, self.parallel.kv_cache, replicated))

    def step_operands(self, abstract: bool = False) -> tuple:
        kv = self.token_to_kv_pool
        shared = self.target.state if self.head_config is not None else None
        return (self.state, shared, kv.spec if abstract else kv.kv_cache, self.draft_state)

    def store_step_operands(self, donated: tuple) -> None:
        self.token_to_kv_pool.kv_cache, self.draft_state = donated

    def spec_info_spec(self, bucket: Bucket):
        R, T = bucket.num_reqs, bucket.num_tokens

        def i32(*shape):
            return jax.ShapeDtypeStruct(shape, jnp.int32)

        hidden = jax.ShapeDtypeStruct((T, self.target_hidden_width), self.target.dtype)
        if bucket.mode == ForwardMode.EXTEND:
            return None if self.head_config is None else DraftPrefillInput(i32(R), hidden)
        if bucket.mode == ForwardMode.DECODE:
            return DraftDecodeInput(i32(R), i32(), jax.ShapeDtypeStruct((R,), jnp.bool_))
        if bucket.mode == ForwardMode.TARGET_VERIFY:
            return TreeDraftInput(i32(R))
        if self.tree and self.head_config is None:
            return TreeCatchupInput(i32(R, self.window))
        return DraftExtendInput(i32(R), i32(R, self.window), i32(R), hidden)

    # ---- serving ----

    def forward_draft_extend(self, fb):
        if self.head_config is None and not self.tree:
            return super().forward_draft_extend(fb)
        return self._replay(Bucket(ForwardMode.DRAFT_EXTEND, fb.num_tokens, fb.batch_size), fb)

    def forward_target_verify(self, fb):
        """A tree drafter's tree step (TARGET_VERIFY-shaped: the verify window); an EAGLE
        head's returns the tree's node scores f32[R, W] (`eagle_tree_draft_step`)."""
        if not self.tree:
            raise ForwardModeNotImplemented("a chain draft runner has no TARGET_VERIFY step")
        return self._replay(Bucket(ForwardMode.TARGET_VERIFY, fb.num_tokens, fb.batch_size), fb)

    def pick_bucket(self, mode: ForwardMode, num_tokens: int, num_reqs: int) -> Bucket:
        return pick_bucket(self.buckets, executable_mode(mode), num_tokens, num_reqs)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """The draft's logits over its own vocabulary for hidden states its steps output
        (tests and tools; compiles per shape)."""
        return _draft_logits(self.graphdef, self.state, self.target.graphdef, self.target.state,
                             hidden)


@partial(jax.jit, static_argnums=(0, 2))
def _draft_logits(graphdef, state, target_graphdef, target_state, hidden):
    model = nnx.merge(graphdef, state)
    if hasattr(model, "lm_head") and not hasattr(model, "model"):  # EAGLE-3's own head
        return model.compute_logits(hidden)
    if not hasattr(model, "model"):  # EAGLE: the target's head
        return nnx.merge(target_graphdef, target_state).compute_logits(hidden)
    return model.compute_logits(hidden)
