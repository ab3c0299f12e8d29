"""The speculative worker (SGLang's EAGLEWorker / NGRAMWorker): the target's ModelWorker and a
draft behind the worker's verbs.

A round for the running requests (`forward_batch_speculative`), all on the device until its
accepted tokens come back, for a request whose m known tokens end in t_{m-1} (target KV holds
positions 0 .. m-2, the draft's the same):

1. draft: D = speculative_num_steps drafts per request, written to the draft's token buffer.
   EAGLE heads have the first from the last round (or their prefill) and run D - 1 draft steps;
   a standalone draft runs D steps from t_{m-1}; NGRAM looks them up on the host.
2. TARGET_VERIFY: the target over [t_{m-1}, d_1 .. d_D] at positions m-1 .. m-1+D, accepting
   the longest valid prefix of the drafts plus one token of its own
   (`speculative.acceptance`).
3. the draft catches up: an EAGLE head's DRAFT_EXTEND over the accepted tokens with the
   target's hidden states there (its output is the next round's first draft); a standalone
   draft's one more step over d_D (the only accepted token whose KV it has not written).

A tree round (speculative_eagle_topk > 1, `_tree_round`) drafts a tree of W nodes in the window
instead (speculative.tree, speculative.eagle_tree; NGRAM's tries on the host), verifies it with
a tree mask and moves the accepted path's KV next to the prefix; the catch-up is the same.

Both KV caches then hold positions 0 .. m'-2 for the m' = m + accepted + 1 known tokens, the
invariant the next round starts from. Pages past that go back to the allocator (the scheduler
trims them). Overlap scheduling is off under speculation: the next round's KV allocation and
drafts depend on how many tokens this one accepted, which only the host's read of it tells.
"""

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np

from jaxrunner.batch.buckets import Bucket
from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.batch.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.batch.schedule_batch import ModelWorkerBatch
from jaxrunner.config import EngineArgs
from jaxrunner.mem_cache.kv_cache import kv_cache_dtype
from jaxrunner.runner.compile_guard import CompileMonitor
from jaxrunner.runner.model_runner import ModelRunner
from jaxrunner.runner.step_programs import ForwardModeNotImplemented
from jaxrunner.speculative.draft_runner import HEADS, DraftRunner, draft_kv_bytes_per_token
from jaxrunner.speculative.ngram import NgramProposer
from jaxrunner.speculative.plan import SpeculativePlan
from jaxrunner.speculative.spec_info import (
    DraftDecodeInput,
    DraftExtendInput,
    DraftPrefillInput,
    TreeCatchupInput,
    TreeDraftInput,
    VerifyInput,
)
from jaxrunner.split_prefill.step import SplitPrefillState
from jaxrunner.worker.model_worker import GenerationBatchResult, ModelWorker, check_kv_cache
from models.config import ModelConfig
from models.eagle import head_config


@dataclass
class SpecRoundResult:
    """What a round gives each real request, on the host."""

    accept_len: np.ndarray   # i32[n]: accepted drafts
    tokens: np.ndarray       # i32[n, W]: the accepted drafts, then the target's token
    logprobs: np.ndarray     # f32[n, W]


def _draft_config(args: EngineArgs, target: ModelConfig):
    algorithm, path = args.speculative_algorithm, args.speculative_draft_path
    if algorithm in HEADS:
        config = head_config(algorithm, path, target)
        return config, config.layer, 1
    if algorithm == "STANDALONE":
        config = ModelConfig.from_pretrained(path)
        if config.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {path}: vocab_size {config.vocab_size} differs from "
                             f"the target's {target.vocab_size}")
        return config, config, config.num_hidden_layers
    return None, None, 0


_NO_SPLIT_PREFILL = ("forward mode SPLIT_PREFILL is not implemented with speculative decoding "
                     "(enable_split_prefill with speculative_algorithm)")


class SpeculativeWorker:
    """`ModelWorker`'s verbs (worker/contract.py: WorkerProtocol), plus `propose`,
    `forward_batch_speculative` and `speculative_window` (SpeculativeWorkerProtocol). What the
    scheduler reads of the worker is the target's."""

    args: EngineArgs
    model_runner: ModelRunner
    max_total_tokens: int
    context_len: int
    vocab_size: int
    speculative_window: int
    split_prefill_ranges: list[tuple[int, int]]
    dp_size = 1
    dllm_plan = None
    lora_registry = None  # LoRA is refused under speculation (resolve_lora_args)
    # Refused under speculation (Engine._expert_tools, EngineArgs): verify steps drop the
    # target's routed counts.
    expert_recorder = eplb_manager = None

    def __init__(self, args: EngineArgs, model_config: ModelConfig,
                 compile_monitor: CompileMonitor | None = None):
        self.algorithm = args.speculative_algorithm
        self.speculative_window = window = args.speculative_window
        self.num_drafts = window - 1
        draft_config, layer, num_layers = _draft_config(args, model_config)
        dtype = jax.numpy.dtype(model_config.resolve_dtype(args.dtype))
        kv_dtype = kv_cache_dtype(args.kv_cache_dtype, dtype)
        heads = self.algorithm in HEADS
        # Trees: speculative.tree (a standalone draft's, NGRAM's tries), speculative.eagle_tree.
        self.tree_steps = args.speculative_num_steps if args.speculative_eagle_topk > 1 else 0
        if self.tree_steps and (model_config.sliding_window
                                or (layer is not None and layer.sliding_window)):
            # The kernels count a window back from a token's KV slot, a tree node's position is
            # its depth: the window would be off by the node's slot minus its depth.
            raise ValueError("speculative_eagle_topk > 1 (tree drafting) is not implemented for "
                             "sliding-window attention models")
        plan = SpeculativePlan(
            tree_steps=self.tree_steps,
            window=window,
            aux_layers=draft_config.aux_layer_ids if heads else (),
            capture=heads, draft_buffer=draft_config is not None,
            draft_kv_bytes_per_token=(draft_kv_bytes_per_token(layer, num_layers, args,
                                                               kv_dtype) if layer else 0))
        self.target = target = ModelWorker(args, model_config, compile_monitor, speculative=plan)
        self.model_runner = runner = target.model_runner
        self.args, self.max_total_tokens = target.args, target.max_total_tokens
        self.context_len, self.vocab_size = target.context_len, target.vocab_size
        self.split_prefill_ranges = target.split_prefill_ranges
        self.draft = (DraftRunner(runner, self.algorithm, draft_config,
                                  args.speculative_draft_path, window,
                                  args.speculative_eagle_topk, args.speculative_num_steps)
                      if draft_config is not None else None)
        self.topk = args.speculative_eagle_topk
        self.ngram = (NgramProposer(args.speculative_ngram_max_match,
                                    args.speculative_ngram_min_match, self.num_drafts,
                                    4 * self.args.max_running_requests, keep=self.topk)
                      if self.algorithm == "NGRAM" else None)
        runner.warm_compile_count = runner.compile_monitor.count

    # ---- what the scheduler needs to know (the target's) ----

    def get_memory_pool(self, dp_rank: int = 0):
        return self.target.get_memory_pool(dp_rank)

    def pick_bucket(self, mode: ForwardMode, num_tokens: int, num_reqs: int) -> Bucket:
        return self.target.pick_bucket(mode, num_tokens, num_reqs)

    # ---- what config.py refuses to combine with speculative decoding ----

    def forward_batch_dllm(self, batch: ModelWorkerBatch, info) -> np.ndarray:
        raise ForwardModeNotImplemented("forward mode DLLM_EXTEND is not implemented with "
                                        "speculative decoding (dllm_algorithm)")

    def begin_split_prefill(self, batch: ModelWorkerBatch,
                            prev: GenerationBatchResult | None = None) -> SplitPrefillState:
        raise ForwardModeNotImplemented(_NO_SPLIT_PREFILL)

    def forward_split_prefill(self, split: SplitPrefillState, end: int, vocab_mask_fn=None
                              ) -> GenerationBatchResult | None:
        raise ForwardModeNotImplemented(_NO_SPLIT_PREFILL)

    def redirect_split_writes(self, split: SplitPrefillState, out_cache_loc: np.ndarray) -> None:
        raise ForwardModeNotImplemented(_NO_SPLIT_PREFILL)

    def check_device_state(self) -> None:
        """The target's KV cache and the draft's (each donated to its steps) survived."""
        self.target.check_device_state()
        if self.draft is not None:
            check_kv_cache(self.draft.token_to_kv_pool, "draft model's")

    # ---- prefill: the target, then the draft over the same tokens ----

    def forward_batch_generation(self, batch: ModelWorkerBatch,
                                 prev: GenerationBatchResult | None = None,
                                 vocab_mask_fn=None) -> GenerationBatchResult:
        """A prefill step of the target (its first token sampled as usual; grammars are
        refused under speculation, so `vocab_mask_fn` gives no mask), then the draft's."""
        if self.algorithm in HEADS:
            batch = dataclasses.replace(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        result = self.target.forward_batch_generation(batch, prev, vocab_mask_fn)
        if self.draft is None:
            return result
        draft = self.draft
        if self.algorithm in HEADS:
            fb, _ = ForwardBatch.init_new(self._shifted_one_ahead(batch), result.next_token_ids,
                                          draft.no_input_embeds)
            fb = fb.replace(spec_info=DraftPrefillInput(
                slots=jax.device_put(self._slot_rows(batch)),
                hidden_states=result.logits_output.hidden_states))
        else:
            fb, _ = ForwardBatch.init_new(batch, draft.no_prev_tokens, draft.no_input_embeds)
        draft.forward(fb)
        return result

    @staticmethod
    def _shifted_one_ahead(batch: ModelWorkerBatch) -> ModelWorkerBatch:
        """The batch with each token replaced by the one after it (an EAGLE head's position p
        reads token p + 1): the next in its chunk, the token after the chunk, or, where that is
        the one this step samples, row i of the step's samples."""
        ids = np.zeros_like(batch.input_ids)
        ids[:-1] = batch.input_ids[1:]
        src = np.full_like(batch.input_token_src, -1)
        lens = batch.extend_seq_lens[:batch.num_reqs]
        last = np.cumsum(lens) - 1
        following = batch.next_token_ids[:batch.num_reqs]
        ids[last] = np.maximum(following, 0)
        src[last] = np.where(following >= 0, -1, np.arange(batch.num_reqs))
        return dataclasses.replace(batch, input_ids=ids, input_token_src=src.astype(np.int32),
                                   capture_hidden_mode=CaptureHiddenMode.NULL)

    def _slot_rows(self, batch: ModelWorkerBatch) -> np.ndarray:
        """Each request's row of the draft buffers; padding rows write the trash row."""
        slots = batch.req_pool_indices
        return np.where(slots >= 0, slots, self.draft.trash_slot).astype(np.int32)

    # ---- a round ----

    def propose(self, reqs) -> tuple[np.ndarray, np.ndarray] | None:
        """NGRAM's drafts [n, D] and their counts [n] for `reqs` (a tree: its nodes [n, W - 1]
        and parent slots [n, W], `speculative.tree`'s layout), from the host; None when a draft
        model drafts on the device."""
        if self.ngram is None:
            return None
        if self.tree_steps:
            return self._propose_trees(reqs)
        drafts = np.zeros((len(reqs), self.num_drafts), np.int32)
        counts = np.zeros(len(reqs), np.int32)
        for i, req in enumerate(reqs):
            found = self.ngram.propose(req.rid, req.fill_ids)
            drafts[i, :len(found)] = found
            counts[i] = len(found)
        self.ngram.retain(r.rid for r in reqs)
        return drafts, counts

    def _propose_trees(self, reqs) -> tuple[np.ndarray, np.ndarray]:
        W = self.speculative_window
        drafts = np.zeros((len(reqs), W - 1), np.int32)
        parents = np.full((len(reqs), W), -1, np.int32)  # unfilled slots: lone nodes
        for i, req in enumerate(reqs):
            nodes, up = self.ngram.propose_tree(req.rid, req.fill_ids, self.topk,
                                                self.tree_steps, W - 1)
            drafts[i, :len(nodes)] = nodes
            parents[i, 1:1 + len(up)] = up
        self.ngram.retain(r.rid for r in reqs)
        return drafts, parents

    def forward_batch_speculative(self, batch: ModelWorkerBatch, limits: list[int],
                                  proposal: tuple[np.ndarray, np.ndarray] | None = None
                                  ) -> SpecRoundResult:
        """One round for `batch` (TARGET_VERIFY-shaped: W slots per request from its last
        known token, pages allocated for them); returns its accepted tokens. `limits[i]`: the
        most drafts request i may accept (its KV slots and output budget)."""
        if self.tree_steps:
            return self._tree_round(batch, limits, proposal)
        runner, draft = self.target.model_runner, self.draft
        R, D = batch.bucket.num_reqs, self.num_drafts
        n = batch.num_reqs
        if draft is not None:
            slots = self._slot_rows(batch)
            if self.algorithm in HEADS:
                steps = [(col, col - 1, False) for col in range(1, D)]
            else:
                steps = [(col, col, col == 0) for col in range(D)]
            for col, offset, from_host in steps:
                self._draft_step(batch, slots, col, offset, from_host)
            drafts = draft.draft_state.tokens
            num_drafts = np.zeros(R, np.int32)
            num_drafts[:n] = D
        else:
            slots = np.zeros(R, np.int32)
            drafts = np.zeros((R, D), np.int32)
            num_drafts = np.zeros(R, np.int32)
            host_drafts, counts = proposal
            drafts[:n], num_drafts[:n] = host_drafts, counts
        num_drafts[:n] = np.clip(np.minimum(num_drafts[:n], limits), 0, D)
        fb, sampling = ForwardBatch.init_new(batch, runner.no_prev_tokens, runner.no_input_embeds)
        slots_dev, num_drafts_dev = jax.device_put((slots, num_drafts))
        out = runner.forward(fb.replace(spec_info=VerifyInput(
            drafts=drafts, slots=slots_dev, num_drafts=num_drafts_dev, sampling=sampling)))
        if self.algorithm in HEADS:
            extend = dataclasses.replace(
                batch, forward_mode=ForwardMode.DRAFT_EXTEND,
                bucket=Bucket(ForwardMode.DRAFT_EXTEND, batch.bucket.num_tokens, R))
            fb, _ = ForwardBatch.init_new(extend, draft.no_prev_tokens, draft.no_input_embeds)
            draft.forward(fb.replace(spec_info=DraftExtendInput(
                slots=slots_dev, tokens=out.tokens, accept_len=out.accept_len,
                hidden_states=out.hidden_states)))
        elif draft is not None:
            self._draft_step(batch, slots, D, D, False)
        accept_len, tokens, logprobs = jax.device_get((out.accept_len, out.tokens,
                                                       out.logprobs))
        return SpecRoundResult(accept_len[:n], tokens[:n], logprobs[:n])

    def _tree_round(self, batch: ModelWorkerBatch, limits: list[int],
                    proposal: tuple[np.ndarray, np.ndarray] | None) -> SpecRoundResult:
        """A round with a draft tree (jaxrunner/speculative/tree.py): the draft's tree step over
        the window (NGRAM: the host's tries, `proposal`), the target's tree verify, the draft's
        catch-up over the accepted path (an EAGLE head's DRAFT_EXTEND with the target's hidden
        states along it)."""
        runner, draft = self.target.model_runner, self.draft
        R, n = batch.bucket.num_reqs, batch.num_reqs
        num_drafts = np.zeros(R, np.int32)
        num_drafts[:n] = np.clip(limits, 0, self.tree_steps)
        if draft is None:
            return self._ngram_tree_round(batch, num_drafts, proposal)
        slots, num_drafts = jax.device_put((self._slot_rows(batch), num_drafts))
        fb, _ = ForwardBatch.init_new(batch, draft.no_prev_tokens, draft.no_input_embeds)
        draft.forward(fb.replace(spec_info=TreeDraftInput(slots=slots)))
        fb, sampling = ForwardBatch.init_new(batch, runner.no_prev_tokens, runner.no_input_embeds)
        state = draft.draft_state
        out = runner.forward(fb.replace(spec_info=VerifyInput(
            drafts=state.tokens, slots=slots, num_drafts=num_drafts, sampling=sampling,
            parents=state.parents)))
        extend = dataclasses.replace(
            batch, forward_mode=ForwardMode.DRAFT_EXTEND,
            bucket=Bucket(ForwardMode.DRAFT_EXTEND, batch.bucket.num_tokens, R))
        fb, _ = ForwardBatch.init_new(extend, draft.no_prev_tokens, draft.no_input_embeds)
        if self.algorithm in HEADS:  # the chain's DRAFT_EXTEND over the accepted path
            info = DraftExtendInput(slots=slots, tokens=out.tokens, accept_len=out.accept_len,
                                    hidden_states=out.hidden_states)
        else:
            info = TreeCatchupInput(tokens=out.tokens)
        draft.forward(fb.replace(spec_info=info))
        accept_len, tokens, logprobs = jax.device_get((out.accept_len, out.tokens,
                                                       out.logprobs))
        return SpecRoundResult(accept_len[:n], tokens[:n], logprobs[:n])

    def _ngram_tree_round(self, batch: ModelWorkerBatch, num_drafts: np.ndarray,
                          proposal: tuple[np.ndarray, np.ndarray]) -> SpecRoundResult:
        """The target's tree verify of the host's tries (rows by request: `slots` 0 .. R-1)."""
        runner = self.target.model_runner
        R, n, W = batch.bucket.num_reqs, batch.num_reqs, self.speculative_window
        drafts = np.zeros((R, W - 1), np.int32)
        parents = np.full((R, W), -1, np.int32)
        drafts[:n], parents[:n] = proposal
        fb, sampling = ForwardBatch.init_new(batch, runner.no_prev_tokens, runner.no_input_embeds)
        out = runner.forward(fb.replace(spec_info=VerifyInput(
            drafts=drafts, slots=np.arange(R, dtype=np.int32), num_drafts=num_drafts,
            sampling=sampling, parents=parents)))
        accept_len, tokens, logprobs = jax.device_get((out.accept_len, out.tokens,
                                                       out.logprobs))
        return SpecRoundResult(accept_len[:n], tokens[:n], logprobs[:n])

    def _draft_step(self, batch: ModelWorkerBatch, slots: np.ndarray, col: int, offset: int,
                    from_host: bool) -> None:
        """One draft step at position m-1+offset of every request, writing column `col`."""
        draft = self.draft
        R = batch.bucket.num_reqs
        W = batch.bucket.num_tokens // R
        real = batch.extend_seq_lens > 0
        pos = batch.extend_prefix_lens + offset
        step = ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE, bucket=Bucket(ForwardMode.DECODE, R, R),
            num_reqs=batch.num_reqs, num_tokens=batch.num_reqs,
            input_ids=batch.input_ids[::W].copy(), input_token_src=np.full(R, -1, np.int32),
            # The verify step's slot for this position (the dummy page past the KV slots).
            out_cache_loc=batch.out_cache_loc.reshape(R, W)[:, offset].copy(),
            seq_lens=np.where(real, pos + 1, 0).astype(np.int32),
            extend_seq_lens=real.astype(np.int32),
            extend_prefix_lens=np.where(real, pos, 0).astype(np.int32),
            page_table=batch.page_table, sampling=batch.sampling)
        fb, _ = ForwardBatch.init_new(step, draft.no_prev_tokens, draft.no_input_embeds)
        info = jax.device_put(DraftDecodeInput(slots=slots, step=np.int32(col),
                                               from_host=np.full(R, from_host)))
        draft.forward(fb.replace(spec_info=info))
