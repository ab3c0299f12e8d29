"""The draft model's runner: an EAGLE or EAGLE-3 head, or a standalone model, on the target's
page ids.

Its KV cache has the target's page count and is indexed by the target's page tables: one page
allocator books both (the target's memory plan counts the draft's KV bytes per token), so a
request's pages hold its target and draft KV alike and are freed together. Besides the cache it
keeps the per-slot draft buffers (`speculative.steps.DraftState`) that its steps update in place.

It is built from the same pieces as the target's runner, not from the runner itself: the
target's memory plan and mesh, step programs of its own (jaxrunner/speculative/
draft_programs.py) and the compiler (runner/compiler.py).
"""

import dataclasses
from functools import partial

from flax import nnx
import jax
import numpy as np

from jaxrunner.attention import AttentionConfig, create_attention_backend, resolve_backend_name
from jaxrunner.attention.mla import latent_cache_width
from jaxrunner.batch.buckets import Bucket, executable_mode, pick_bucket
from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.mem_cache.kv_cache import TokenToKVPool, model_kv_bytes_per_token
from jaxrunner.runner.compiler import (
    Compiler,
    StepExecutables,
    StepInputs,
    program_fingerprint,
)
from jaxrunner.runner.model_layout import moe_runner_for
from jaxrunner.runner.model_runner import ModelRunner
from jaxrunner.runner.step_programs import StepModel, StepShapes
from jaxrunner.speculative.draft_programs import DraftPlan
from jaxrunner.speculative.steps import DraftState, head_logits
from models.eagle import HEAD_CLASSES, load_head
from models.layers.moe_parallel import MoeRunner
from models.loading.loader import load_model
from models.registry import model_class
from models.sharding import ShardedPlacer, sharded_model_config

HEADS = tuple(HEAD_CLASSES)


def draft_kv_bytes_per_token(layer_cfg, num_layers: int, args, dtype) -> int:
    """The draft's KV bytes per token per device (`args`: the EngineArgs, for a latent cache's
    row width on this platform)."""
    platform = jax.local_devices()[0].platform
    width = latent_cache_width(layer_cfg, resolve_backend_name(args.attention_backend, platform),
                               platform, args.pallas_interpret)
    return model_kv_bytes_per_token(sharded_model_config(layer_cfg, args.tp_size), num_layers,
                                    args.tp_size, dtype, width)


class DraftRunner:
    """`kind` is "EAGLE", "EAGLE3", "NEXTN" or "STANDALONE"; `config` a head's config
    (models/eagle.py `head_config`) or the draft model's ModelConfig. Its weights are loaded once and kept: the engine's weight
    updates and memory release act on the target (`ModelRunner.weights`), not on the draft."""

    def __init__(self, target: ModelRunner, kind: str, config, path: str, window: int,
                 topk: int = 1, num_steps: int = 0):
        """`topk` > 1: drafting trees of `num_steps` levels in the verify window
        (jaxrunner/speculative/tree.py; an EAGLE head's: speculative/eagle_tree.py)."""
        self.target = target
        self.kind = kind
        self.head_config = config if kind in HEADS else None
        self.layer_config = config.layer if kind in HEADS else config
        self.args, self.parallel, self.dtype = target.args, target.parallel, target.dtype
        self.compile_monitor = target.compile_monitor
        # EAGLE-3 reads three of the target's layers side by side, EAGLE its last.
        hidden = (3 * self.head_config.target_hidden_size if kind == "EAGLE3"
                  else target.model_config.hidden_size)
        self.plan = DraftPlan(self.head_config is not None, window, topk, num_steps,
                              jax.ShapeDtypeStruct((hidden,), target.dtype))
        self.load_model(path)
        self.init_memory_pool()
        self.init_attention_backend()
        self.init_step_programs()
        self.precompile()

    # ---- initialisation ----

    def load_model(self, path: str) -> None:
        tp = self.parallel.tp_size
        self.sharded_config = layer = sharded_model_config(self.layer_config, tp)
        # An EAGLE head's layer is dense; a standalone draft, or DeepSeek's MTP layer, may be
        # MoE, run as the target's experts are.
        self.moe_runner = (moe_runner_for(layer, self.args, self.parallel,
                                          self.target.device.platform)
                           if layer.is_moe else MoeRunner())
        place = ShardedPlacer.for_model(self.parallel.mesh, self.layer_config,
                                        self.moe_runner.expert_axes)
        if self.head_config is not None:
            config = dataclasses.replace(self.head_config, layer=layer)
            model = load_head(self.kind, config, path, self.dtype, place, self.moe_runner)
        else:
            model = load_model(model_class(layer), layer, path, self.dtype, place)
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

    def init_memory_pool(self) -> None:
        """The KV cache on the target's pages, and the draft buffers: one row per request slot,
        and a last one padding rows write to."""
        target, cfg, window = self.target, self.sharded_config, self.plan.window
        self.max_pages_per_req = target.max_pages_per_req
        self.kv_sharding = self.parallel.kv_cache_sharding(cfg.mla is not None)
        width = latent_cache_width(cfg, target.attention_backend_name, target.platform,
                                   self.args.pallas_interpret)
        self.token_to_kv_pool = TokenToKVPool.for_model(cfg, self.num_layers,
                                                        target.token_to_kv_pool.shape[1],
                                                        self.args.page_size,
                                                        target.kv_cache_dtype, self.kv_sharding,
                                                        latent_width=width)
        self.num_slots = target.run_plan.memory.num_slots + 1
        replicated = self.parallel.replicated
        self.draft_state = DraftState(
            tokens=jax.device_put(np.zeros((self.num_slots, window), np.int32), replicated),
            hidden=jax.device_put(np.zeros((self.num_slots, self.hidden_width), self.dtype),
                                  replicated),
            parents=(jax.device_put(np.full((self.num_slots, window), -1, np.int32),
                                    replicated) if self.plan.tree else None))

    @property
    def trash_slot(self) -> int:
        return self.num_slots - 1

    def init_attention_backend(self) -> None:
        attn_config = AttentionConfig.for_model(self.sharded_config, page_size=self.args.page_size,
                                                num_layers=self.num_layers)
        self.attn_backend = create_attention_backend(self.target.attention_backend_name,
                                                     attn_config,
                                                     interpret=self.args.pallas_interpret,
                                                     mesh=self.parallel.mesh)

    def init_step_programs(self) -> None:
        """The draft's table of step programs, and the shapes of its steps' inputs: the
        target's, at the draft's hidden size (its input-embedding rows)."""
        args = self.args
        embeds = jax.ShapeDtypeStruct((args.max_prefill_tokens, self.sharded_config.hidden_size),
                                      self.dtype, sharding=self.target.io_sharding)
        shapes = StepShapes(args.max_running_requests, args.max_prefill_tokens, self.num_slots,
                            embeds)
        self.programs = self.plan.programs(
            StepModel(self.graphdef, self.attn_backend, self.moe_runner), self.target.graphdef,
            shapes)
        self.buckets = self.programs.buckets
        self.inputs = StepInputs(max(b.num_reqs for b in self.buckets), self.max_pages_per_req,
                                 embeds, self.parallel)

    def precompile(self) -> None:
        """Compiles every bucket's draft step, several at once, through an executable cache of
        its own (its key covers the target's programs: the draft's steps read the target's
        weights)."""
        target = self.target
        self.compiler = Compiler(target.device.platform, self.parallel.mesh,
                                 show_progress=self.args.show_progress)
        self.steps = StepExecutables(self.programs, self.jit_step, self, self.inputs,
                                     self.compiler, self.compile_monitor)
        self.executables = self.steps.executables
        self.no_prev_tokens, self.no_input_embeds = self.inputs.zeros()
        fingerprint = (program_fingerprint(
            self.state, self.token_to_kv_pool.spec, self.args, self.sharded_config,
            target.attention_backend_name, self.compiler.options, self.inputs.max_batch_rows,
            self.max_pages_per_req, self.parallel.mesh, ()), self.kind, self.plan,
            target._program_fingerprint())
        self.compiler.open_cache(self.args.compilation_cache_path, fingerprint)
        self.compiler.compile_all(self.steps.jobs())
        jax.block_until_ready(self.token_to_kv_pool.kv_cache)  # the zeros, written meanwhile

    def jit_step(self, step):
        """A draft step jitted: its KV cache and draft buffers donated."""
        replicated = self.parallel.replicated
        return jax.jit(step, donate_argnums=(2, 3),
                       out_shardings=(replicated, self.kv_sharding, replicated))

    def step_operands(self, abstract: bool = False) -> tuple:
        """(the draft's weights, the target's weights a head reads, KV cache, draft buffers)."""
        kv = self.token_to_kv_pool
        shared = self.target.state if self.head_config is not None else None
        return (self.state, shared, kv.spec if abstract else kv.kv_cache, self.draft_state)

    def store_step_operands(self, donated: tuple) -> None:
        self.token_to_kv_pool.kv_cache, self.draft_state = donated

    # ---- serving ----

    def forward(self, fb: ForwardBatch):
        """Runs one draft step through the step program of its mode (a tree drafter's
        TARGET_VERIFY-shaped tree step returns an EAGLE head's node scores f32[R, W],
        `eagle_tree_draft_step`); a mode the draft has no program for raises
        ForwardModeNotImplemented."""
        return self.steps.run(fb)

    def pick_bucket(self, mode: ForwardMode, num_tokens: int, num_reqs: int) -> Bucket:
        return pick_bucket(self.buckets, executable_mode(mode), num_tokens, num_reqs)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """The draft's logits over its own vocabulary for hidden states its steps output
        (tests and tools; compiles per shape)."""
        return _draft_logits(self.graphdef, self.state, self.target.graphdef, self.target.state,
                             hidden, self.head_config is not None)


@partial(jax.jit, static_argnums=(0, 2, 5))
def _draft_logits(graphdef, state, target_graphdef, target_state, hidden, head: bool):
    model = nnx.merge(graphdef, state)
    if head:  # EAGLE-3's own head, or the target's (EAGLE, NEXTN)
        return head_logits(model, hidden, nnx.merge(target_graphdef, target_state))
    return model.compute_logits(hidden)
