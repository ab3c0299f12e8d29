"""The scheduler: continuous batching over the model worker, with a radix prefix cache, chunked
prefill, MIXED batches, retraction under KV pressure, and overlapped host work.

Each `step()` launches one model step and returns the requests whose new tokens it learned:

- Waiting requests are admitted (FCFS or longest-prefix-match, with priorities) into a prefill
  batch within a token budget; a prompt longer than the chunk size is prefilled a chunk per step.
  A request reuses the KV pages of its longest cached prefix (radix cache) and computes the rest.
- Running requests decode one token per step; while a prefill chunk runs they ride along in the
  same MIXED batch, so long prompts never stall decoding.
- A decode step that cannot get pages evicts unused cached prefixes, then retracts the newest
  requests: their KV goes to the prefix cache and they wait to resume from it. Nothing is lost.
- Overlap: step n+1 is built and launched before step n's tokens are read back; the requests
  decoding in both read step n's tokens on the device. The host's bookkeeping for step n then
  runs while the device computes step n+1.
- Grammars: the token bitmask of step n+1 depends on step n's tokens, so a step with a
  constrained request launches its forward pass, then reads step n back (advancing the
  grammars) and fills the bitmask while the device runs the model, and only then launches its
  sampler. The forward pass still overlaps the host's work; what is lost is the sampler's own
  overlap: the device waits for the mask between the model and the sampler.
- `n` samples of one prompt share its KV: a request whose prompt equals one admitted in the
  same step waits a step, and then finds that prompt in the prefix cache.
- Split prefill (`enable_split_prefill`, jaxrunner/split_prefill/schedule.py): a prefill batch runs a
  range of layers per step, with a decode step of the running requests after each range.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.batch.schedule_batch import Req, ScheduleBatch
from jaxrunner.mem_cache.radix_cache import RadixCache
from jaxrunner.scheduler.policy import (
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO,
    NEW_TOKEN_RATIO_DECAY,
    PrefillBudget,
    future_pages,
    order_waiting,
)
from jaxrunner.scheduler.request_output import (
    fill_vocab_mask,
    match_stop_regex,
    record_input_logprobs,
    record_output_top_logprobs,
    stop_at_first,
)
from jaxrunner.split_prefill.schedule import SplitPrefill, splittable


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass
class LaunchedBatch:
    """A step on the device whose tokens the host has not read yet."""

    batch: ScheduleBatch
    result: object            # the worker's GenerationBatchResult: `copy_to_host()` waits
    samples: list[bool]       # per row: does this step sample the request's next token
    rows: dict[int, int]      # rid -> row, for the next step's on-device input tokens
    prefixes: list[int]       # per row: the request's tokens computed before this step


class Scheduler:
    def __init__(self, worker, decode_text: Callable[[list[int]], str] | None = None,
                 *, dp_rank: int = 0, overlap: bool | None = None):
        """`worker` is the `ModelWorker` (or anything with its verbs: `args`,
        `get_memory_pool`, `pick_bucket`, `forward_batch_generation`). `decode_text` turns token
        ids into text; needed only for stop strings. A DP attention rank books into its own
        memory pool (`dp_rank`) and never launches steps itself (DataParallelScheduler does).
        `overlap` defaults to `not args.disable_overlap_schedule`."""
        self.worker = worker
        args = self.args = worker.args
        self.page_size = args.page_size
        self.decode_text = decode_text
        self.req_to_token_pool, self.allocator = worker.get_memory_pool(dp_rank)
        self.tree_cache = RadixCache(args.page_size, self.allocator,
                                     disable=args.disable_radix_cache)
        self.chunk_size = args.chunk_size
        # Speculative decoding: running requests take verify rounds of this many tokens each
        # (jaxrunner/speculative/spec_worker.py), and never overlap: a round's allocation and
        # drafts depend on how many tokens the previous one accepted.
        self.spec_window = getattr(worker, "speculative_window", None)
        self.overlap = not args.disable_overlap_schedule if overlap is None else overlap
        self.overlap = self.overlap and self.spec_window is None
        # A LoRA engine's adapters and device slots (jaxrunner/lora/registry.py), else None.
        self.lora = getattr(worker, "lora_registry", None)
        self.waiting: list[Req] = []
        self.running: list[Req] = []       # prefilled, decoding
        self.chunked_req: Req | None = None  # admitted, its prompt partly computed
        self.in_flight: LaunchedBatch | None = None
        self.init_new_token_ratio = INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness
        self.min_new_token_ratio = MIN_NEW_TOKEN_RATIO * args.schedule_conservativeness
        self.new_token_ratio = self.init_new_token_ratio
        self.forward_ct = 0
        self.num_retractions = 0
        self._flushed: list[Req] = []      # results read early (before a retraction)
        self.split: SplitPrefill | None = None  # a prefill batch run a layer range per step
        self._range_ran = False            # the last step was a split range: decode next

    # ---- requests ----

    @property
    def has_work(self) -> bool:
        """Requests are waiting or running (a step in flight for finished ones only is not
        work: its tokens are surplus)."""
        return bool(self.waiting or self.running or self.chunked_req or self.split or (
            self.in_flight and not all(r.finished for r in self.in_flight.batch.reqs)))

    def unfinished_requests(self) -> list[Req]:
        """Every request waiting, being prefilled (whole, chunked or split) or decoding."""
        reqs = self.waiting + self.running + ([self.chunked_req] if self.chunked_req else [])
        reqs += self.split.reqs if self.split is not None else []
        return [r for r in dict.fromkeys(reqs) if not r.finished]

    def add_request(self, req: Req) -> None:
        if req.max_new_tokens == 0 and not req.wants_input_logprobs:
            req.finished_reason = {"type": "length", "length": 0}
            return
        self.waiting.append(req)

    def abort_request(self, req: Req, message: str = "aborted") -> None:
        """Drops a request wherever it is; its pages go back at once (its KV to the cache)."""
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        if self.split is not None and req in self.split.reqs:
            self._drop_from_split(req)
        self._release_kv(req)
        req.finished_reason = {"type": "abort", "message": message}

    def flush_cache(self) -> bool:
        """Empties the prefix cache; only when no request is in the system (else False)."""
        if self.has_work:
            return False
        if self.in_flight is not None:
            self.process_batch_result(self.in_flight)
            self.in_flight = None
        self.tree_cache.reset()
        return True

    # ---- one step ----

    def step(self) -> list[Req]:
        """Launches one model step; returns the requests that got new tokens (finished ones
        included: `req.finished`). With overlap, a step's tokens are returned by the next call."""
        batch = self.get_next_batch()
        if batch is not None and batch.forward_mode.is_target_verify():
            updated, self._flushed = self._flushed, []
            return updated + self._run_speculative(batch)
        if batch is not None and batch.forward_mode.is_split_prefill():
            launched = self._launch_split_range(batch)  # None until the last range
        else:
            launched = self._launch(batch) if batch is not None else None
        updated, self._flushed = self._flushed, []
        if self.overlap:
            if self.in_flight is not None:
                updated += self.process_batch_result(self.in_flight)
            self.in_flight = launched
        elif launched is not None:
            updated += self.process_batch_result(launched)
        return updated

    def get_next_batch(self) -> ScheduleBatch | None:
        """This step's batch with its KV pages allocated, or None when there is nothing to run."""
        if self._range_ran:
            # One decode step after each range of a split prefill.
            self._range_ran = False
            decoding = self._decodable() and self._ensure_decode_pages(self._decodable())
            if decoding:
                return self._decode_batch(decoding)
        if self.split is not None:
            return self.split.batch
        mixed = self.args.enable_mixed_chunk
        decoding = self._decodable()
        if decoding and mixed:
            decoding = self._ensure_decode_pages(decoding)
        prefill = self._admit_prefill(decoding if mixed else [])
        if prefill is not None:
            reqs, lens = prefill
            if mixed and decoding:
                return self._schedule(reqs + decoding, ForwardMode.MIXED,
                                      lens + [1] * len(decoding))
            # Split only with requests to decode between the ranges: alone, a prefill runs
            # fastest in one step.
            if self.args.enable_split_prefill and decoding and splittable(reqs):
                return self._schedule(reqs, ForwardMode.SPLIT_PREFILL, lens)
            return self._schedule(reqs, ForwardMode.EXTEND, lens)
        if decoding and not mixed:
            decoding = self._ensure_decode_pages(decoding)
        if not decoding:
            return None
        return self._decode_batch(decoding)

    def _decode_batch(self, decoding: list[Req]) -> ScheduleBatch:
        """A decode step (a verify round under speculation) of `decoding`, pages ensured."""
        self.new_token_ratio = max(self.min_new_token_ratio,
                                   self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        if self.spec_window is not None:
            return self._schedule(decoding, ForwardMode.TARGET_VERIFY,
                                  [self.spec_window] * len(decoding),
                                  [self._spec_kv_len(r) for r in decoding])
        return self._schedule(decoding, ForwardMode.DECODE, [1] * len(decoding))

    def _decodable(self) -> list[Req]:
        """Running requests that need another step (not those whose last sampled token, still
        on the device, already reaches max_new_tokens)."""
        return [r for r in self.running if r.num_outputs < r.max_new_tokens]

    # ---- prefill admission ----

    def _admit_prefill(self, decoding: list[Req]) -> tuple[list[Req], list[int]] | None:
        """Prefill chunks for this step: the chunked request's next chunk, then waiting requests
        in policy order while tokens, request slots and pages last. `decoding` are the running
        requests riding along (MIXED); their tokens and new pages come off the budget first."""
        if not self.waiting and self.chunked_req is None:
            return None  # the common decode step: skip the page accounting below
        args = self.args
        reserved = sum(future_pages(r, self.page_size, self.new_token_ratio) for r in self.running)
        budget = PrefillBudget(
            tokens=args.max_prefill_tokens - len(decoding),
            reqs=args.max_running_requests - len(self.running) - (self.chunked_req is not None),
            pages=(self.allocator.num_free + self.tree_cache.evictable_pages - reserved
                   - self._decode_pages(decoding)))
        reqs, lens = [], []
        partial = None  # the request this step leaves with its prompt unfinished: at most one
        if self.chunked_req is not None:
            req = self.chunked_req
            n = min(req.seq_len - req.num_computed_tokens, self.chunk_size, budget.tokens)
            held = int(self.req_to_token_pool.num_pages[req.req_pool_idx])
            pages = _pages(req.num_computed_tokens + n, self.page_size) - held
            available = (self.allocator.num_free + self.tree_cache.evictable_pages
                         - self._decode_pages(decoding))
            if n <= 0 or pages > available:
                return None  # decoding requests must finish (or be retracted) first
            reqs.append(req)
            lens.append(n)
            budget.tokens -= n
            budget.pages -= pages
            if req.num_computed_tokens + n < req.seq_len:
                partial = req
        # Prompts admitted this step: an equal one waits a step to share its KV (n samples).
        prompts = set()
        # A chunked prompt's last chunk leaves room for new requests in the same step.
        for req in order_waiting(self.waiting, args.schedule_policy, self.tree_cache):
            if partial is not None or budget.tokens <= 0 or budget.reqs <= 0:
                break
            prompt = self._shared_prompt_key(req)
            if prompt is not None and prompt in prompts:
                break
            # Prompt logprobs are computed, not read from the cache, from their first position.
            limit = req.cacheable(req.seq_len - 1)
            if req.wants_input_logprobs:
                limit = min(limit, max(req.logprob_start_len - 1, 0))
            match = self.tree_cache.match_prefix(req.cache_key(req.fill_ids), max_tokens=limit)
            remaining = req.seq_len - match.num_tokens
            # A prompt longer than what is left of the budget is chunked to fill it (as SGLang
            # does): the step then runs in its bucket without padding tokens.
            n = min(remaining, self.chunk_size, budget.tokens)
            pages = (_pages(match.num_tokens + n, self.page_size) - len(match.pages)
                     + future_pages(req, self.page_size, self.new_token_ratio))
            # Locking the matched prefix takes its pages out of the evictable ones.
            evictable = self.tree_cache.evictable_pages
            self.tree_cache.inc_lock_ref(match.node)
            pages += evictable - self.tree_cache.evictable_pages
            if not budget.fits(n, pages):
                self.tree_cache.dec_lock_ref(match.node)
                break  # the head of the queue waits rather than being overtaken
            if not self._acquire_lora(req):
                # Every adapter slot is pinned by other adapters' requests: this one waits for
                # a slot; requests of resident adapters (and the base) may go ahead.
                self.tree_cache.dec_lock_ref(match.node)
                continue
            budget.take(n, pages)
            self._take_prefix(req, match)
            self.waiting.remove(req)
            reqs.append(req)
            lens.append(n)
            if prompt is not None:
                prompts.add(prompt)
            if n < remaining:
                partial = self.chunked_req = req
        return (reqs, lens) if reqs else None

    def _shared_prompt_key(self, req: Req) -> tuple[int, ...] | None:
        """The prompt, when another request with it could reuse its KV (a whole page of it
        would be cached); else None."""
        if self.tree_cache.disable or len(req.origin_input_ids) <= self.page_size:
            return None
        return tuple(req.cache_key(req.origin_input_ids))

    def _acquire_lora(self, req: Req) -> bool:
        """Pins a device slot holding the request's adapter (copying it in if it is not
        resident); False when no slot can be had now. Base-model requests need none."""
        if req.lora is None:
            return True
        slot = self.lora.acquire(req.lora)
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def _take_prefix(self, req: Req, match) -> None:
        """Gives `req` a slot whose first pages are the matched (and locked) prefix."""
        req.req_pool_idx = self.req_to_token_pool.alloc_slot()
        self.req_to_token_pool.append_pages(req.req_pool_idx, match.pages)
        req.prefix_node = match.node
        req.num_tree_pages = len(match.pages)
        req.num_computed_tokens = match.num_tokens
        if req.num_retractions == 0:
            req.cached_tokens = match.num_tokens

    # ---- decode pages, eviction, retraction ----

    def _ensure_decode_pages(self, decoding: list[Req]) -> list[Req]:
        """Makes room for one more token per request: evict cached prefixes, then retract the
        newest requests until the rest fit."""
        need = self._decode_pages(decoding)
        if need <= self._free_after_eviction(need):
            return decoding
        # Retraction changes the running set: first learn what the step in flight produced.
        if self.in_flight is not None:
            self._flushed += self.process_batch_result(self.in_flight)
            self.in_flight = None
        decoding = self._decodable()
        while decoding and self._decode_pages(decoding) > self._free_after_eviction(
                self._decode_pages(decoding)):
            if self.split is not None:  # it holds the newest pages, and has no tokens yet
                self._retract_split()
                continue
            newest = max(decoding, key=lambda r: r.rid)
            self._retract(newest)
            decoding.remove(newest)
        self.new_token_ratio = self.init_new_token_ratio
        return decoding

    def _retract_split(self) -> None:
        """Puts a split prefill's requests back in the queue; the ranges already launched write
        only their own pages, which go back now (their prefixes to the cache)."""
        split, self.split = self.split, None
        for req in split.live_reqs():
            if req is self.chunked_req:
                self.chunked_req = None
            self._release_kv(req)
            req.num_retractions += 1
            self.num_retractions += 1
            self.waiting.append(req)

    def _drop_from_split(self, req: Req) -> None:
        """An aborted request leaves its split prefill: the remaining ranges write its tokens'
        KV to the dummy page (its pages are freed by the caller); a split left with no request
        runs no further range."""
        split = self.split
        if all(r is req for r in split.live_reqs()):
            self.split = None
            return
        self.worker.redirect_split_writes(split.state, split.drop_writes(req, self.page_size))

    def _launch_split_range(self, batch: ScheduleBatch) -> LaunchedBatch | None:
        """Launches the next layer range of the split prefill of `batch` (uploading the batch
        at its first range); the last range's step is booked as a launched prefill step."""
        split = self.split
        if split is None:  # its first range
            prev = self.in_flight.result if self.in_flight is not None else None
            split = self.split = SplitPrefill.begin(self.worker, batch, prev)
        self._range_ran = True
        last = split.at_last_range
        result = self.worker.forward_split_prefill(split.state, split.next_end)
        split.next_range += 1
        if not last:
            return None
        self.split = None
        return self.record_launch(batch, result)

    def _decode_pages(self, reqs: list[Req]) -> int:
        """Pages a decode step over `reqs` adds: one per request whose next token starts one
        (a verify round: the pages of its window)."""
        held = self.req_to_token_pool.num_pages
        if self.spec_window is not None:
            return sum(max(0, _pages(r.num_computed_tokens + self._spec_kv_len(r), self.page_size)
                           - int(held[r.req_pool_idx])) for r in reqs)
        return sum(1 for r in reqs if r.num_computed_tokens // self.page_size >= held[r.req_pool_idx])

    def _spec_kv_len(self, req: Req) -> int:
        """Tokens of a verify round's window that get KV slots: all W, but never past the
        pages a request may hold (its context)."""
        room = self.req_to_token_pool.max_pages_per_req * self.page_size - req.num_computed_tokens
        return min(self.spec_window, room)

    def _free_after_eviction(self, need: int) -> int:
        free = self.allocator.num_free
        if need > free:
            self.tree_cache.evict(need - free)
        return self.allocator.num_free

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self._release_kv(req)
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.append(req)  # its old rid puts it first in FCFS order

    def _cache_prefilled(self, req: Req) -> None:
        """Shares a freshly prefilled prompt at once (SGLang's cache_unfinished_req): its whole
        pages go into the prefix cache, so requests with the same prefix that arrive while this
        one still decodes reuse them. Where the tree already held some of them (another request
        got there first), the request switches to the tree's pages and frees its duplicates."""
        if self.tree_cache.disable:
            return
        pool, ps = self.req_to_token_pool, self.page_size
        known = req.cache_key(req.fill_ids)
        whole = req.cacheable(min(req.num_computed_tokens, len(known))) // ps
        if whole <= req.num_tree_pages:
            return
        pages = pool.pages(req.req_pool_idx).tolist()
        cached = self.tree_cache.insert(known[:whole * ps], pages[:whole]) // ps
        match = self.tree_cache.match_prefix(known[:whole * ps])
        self.allocator.free(pages[req.num_tree_pages:cached])  # duplicates of the tree's pages
        pool.page_table[req.req_pool_idx, :whole] = match.pages
        self.tree_cache.inc_lock_ref(match.node)
        if req.prefix_node is not None:
            self.tree_cache.dec_lock_ref(req.prefix_node)
        req.prefix_node, req.num_tree_pages = match.node, whole

    def _release_kv(self, req: Req) -> None:
        """Returns a request's KV: whole pages of known tokens go to the prefix cache, the rest
        to the allocator; its lock on the matched prefix is dropped."""
        if req.req_pool_idx is None:
            return
        pool, ps = self.req_to_token_pool, self.page_size
        pages = pool.pages(req.req_pool_idx).tolist()
        known = req.cache_key(req.fill_ids)
        whole = req.cacheable(min(req.num_computed_tokens, len(known))) // ps
        if self.tree_cache.disable:
            self.allocator.free(pages)
        else:
            cached = self.tree_cache.insert(known[:whole * ps], pages[:whole]) // ps
            # The tree had pages [:cached] already (ours for [num_tree_pages:cached] are
            # duplicates) and now keeps [cached:whole]; a partial last page is ours to free.
            self.allocator.free(pages[req.num_tree_pages:cached] + pages[whole:])
        if req.prefix_node is not None:
            self.tree_cache.dec_lock_ref(req.prefix_node)
        pool.free_slot(req.req_pool_idx)
        if req.lora_slot >= 0:
            self.lora.release(req.lora_slot)
            req.lora_slot = -1
        req.req_pool_idx = req.prefix_node = req.sampling_slot = None
        req.num_tree_pages = req.num_computed_tokens = 0

    # ---- launching and reading back ----

    def _schedule(self, reqs: list[Req], mode: ForwardMode, lens: list[int],
                  kv_lens: list[int] | None = None) -> ScheduleBatch:
        prev_rows = self.in_flight.rows if self.in_flight is not None else {}
        batch = ScheduleBatch(reqs, mode, lens, self.req_to_token_pool,
                              self.allocator, self.page_size, prev_rows, kv_lens)
        need = batch.pages_needed()
        self._free_after_eviction(need)
        if not batch.alloc_kv():
            raise RuntimeError(f"KV allocation of {need} pages failed after admission "
                               f"(free {self.allocator.num_free}): scheduler bug")
        return batch

    def _launch(self, batch: ScheduleBatch) -> LaunchedBatch:
        if not any(r.grammar is not None for r in batch.reqs):
            return self.record_launch(batch, self._run_batch(batch))
        launched = None

        def vocab_mask(num_rows: int):
            # The forward pass is on the device: book it, then learn the step before it (whose
            # tokens advance the grammars) while the model runs, then fill the bitmask.
            nonlocal launched
            launched = self.record_launch(batch, None)
            if self.in_flight is not None:
                self._flushed += self.process_batch_result(self.in_flight)
                self.in_flight = None
            return fill_vocab_mask(batch.reqs, num_rows, self.worker.vocab_size)

        result = self._run_batch(batch, vocab_mask)
        launched.result = result
        return launched

    def _run_batch(self, batch: ScheduleBatch, vocab_mask=None):
        """Launches the device step of `batch` through the worker; does not wait for it.
        `vocab_mask(num_rows)`, if given, is called once the forward pass is launched."""
        bucket = self.worker.pick_bucket(batch.forward_mode, batch.num_tokens, len(batch.reqs))
        prev = self.in_flight.result if self.in_flight is not None else None
        mask_fn = None if vocab_mask is None else (lambda: vocab_mask(bucket.num_reqs))
        return self.worker.forward_batch_generation(batch.get_model_worker_batch(bucket), prev,
                                                    mask_fn)

    def record_launch(self, batch: ScheduleBatch, result) -> LaunchedBatch:
        """Books a launched step: the requests' computed tokens and pending samples. `result`
        (row i: request i) is the worker's, read back only in `process_batch_result`."""
        self.forward_ct += 1
        samples, prefixes = [], []
        for req, n in zip(batch.reqs, batch.extend_lens):
            prefixes.append(req.num_computed_tokens)
            if req.finished:  # aborted while its split prefill ran
                samples.append(False)
                continue
            req.num_computed_tokens += n
            sampled = req.num_computed_tokens == req.seq_len
            samples.append(sampled)
            if sampled:
                req.pending += 1
                if req is self.chunked_req:
                    self.chunked_req = None
                if req not in self.running:
                    self.running.append(req)
                    self._cache_prefilled(req)
        return LaunchedBatch(batch, result, samples, {r.rid: i for i, r in enumerate(batch.reqs)},
                             prefixes)

    def process_batch_result(self, launched: LaunchedBatch) -> list[Req]:
        """Reads a launched step's tokens back and advances its requests: new outputs, finished
        requests (their KV released); returns the requests that got a token."""
        result, reqs = launched.result, launched.batch.reqs
        tokens, logprobs = result.copy_to_host()
        top = (result.top_logprobs_to_host()
               if any(r.return_logprob and r.top_logprobs_num for r in reqs) else None)
        inputs = (result.input_logprobs_to_host()
                  if any(r.wants_input_logprobs for r in reqs) else None)
        updated, starts = [], np.cumsum([0] + launched.batch.extend_lens)
        for i, req in enumerate(reqs):
            if inputs is not None and req.wants_input_logprobs and not req.finished:
                record_input_logprobs(req, inputs, int(starts[i]), launched.prefixes[i],
                                      launched.batch.extend_lens[i])
            if not launched.samples[i]:
                continue
            req.pending -= 1
            if req.finished:
                continue  # aborted, or finished by the step before (this token is surplus)
            if req.max_new_tokens == 0:  # prefilled for its prompt logprobs only
                req.finished_reason = {"type": "length", "length": 0}
            else:
                self._append_token(req, int(tokens[i]), float(logprobs[i]),
                                   None if top is None else (top[0][i], top[1][i]))
            if req.finished:
                self.running.remove(req)
                self._release_kv(req)
            updated.append(req)
        return updated

    def _run_speculative(self, batch: ScheduleBatch) -> list[Req]:
        """One verify round for the running requests: launch it, then append each request's
        accepted tokens (stopping where it finishes) and give back the pages past its KV."""
        self.forward_ct += 1
        bucket = self.worker.pick_bucket(batch.forward_mode, batch.num_tokens, len(batch.reqs))
        worker_batch = batch.get_model_worker_batch(bucket)
        # At most the drafts that have KV slots and that the output budget can still use (the
        # target's own token comes on top).
        limits = [min(kv - 1, r.max_new_tokens - r.num_outputs - 1)
                  for r, kv in zip(batch.reqs, batch.kv_lens)]
        result = self.worker.forward_batch_speculative(worker_batch, limits,
                                                       self.worker.propose(batch.reqs))
        updated = []
        for i, req in enumerate(batch.reqs):
            req.spec_verify_ct += 1
            accepted = int(result.accept_len[i])
            appended = 0
            for token, logprob in zip(result.tokens[i, :accepted + 1],
                                      result.logprobs[i, :accepted + 1]):
                self._append_token(req, int(token), float(logprob), None)
                appended += 1
                if req.finished:
                    break
            # KV now holds the window's first token and the accepted drafts appended.
            req.num_computed_tokens += 1 + min(appended, accepted)
            if req.finished:
                self.running.remove(req)
                self._release_kv(req)
            else:
                keep = _pages(req.num_computed_tokens, self.page_size)
                self.allocator.free(self.req_to_token_pool.truncate(req.req_pool_idx, keep))
            updated.append(req)
        return updated

    def _append_token(self, req: Req, token: int, logprob: float, top) -> None:
        req.output_ids.append(token)
        if req.return_logprob:
            req.output_logprobs.append(logprob)
            if req.top_logprobs_num:
                record_output_top_logprobs(req, *top)
        if req.grammar is not None and not req.grammar.accept_token(token):
            req.finished_reason = {"type": "abort",
                                   "message": f"grammar error: {req.grammar.error}"}
            return
        self._check_finished(req)

    def _check_finished(self, req: Req) -> None:
        token = req.output_ids[-1]
        params = req.sampling_params
        if req.grammar is not None and req.grammar.is_terminated:
            # Complete: EOS (which the grammar then allows) or nothing more can follow.
            req.finished_reason = {"type": "stop",
                                   "matched": token if token in req.eos_token_ids else None}
        elif len(req.output_ids) < params.min_new_tokens:
            pass  # EOS and stop ids are masked on the device; stop strings wait too
        elif not params.ignore_eos and token in req.eos_token_ids:
            req.finished_reason = {"type": "stop", "matched": token}
        elif token in params.stop_token_ids:
            req.finished_reason = {"type": "stop", "matched": token}
        elif params.stop and self._match_stop_string(req):
            pass
        elif params.stop_regex and self._match_stop_regex(req):
            pass
        if req.finished_reason is None and len(req.output_ids) >= req.max_new_tokens:
            req.finished_reason = {"type": "length", "length": req.max_new_tokens}

    def _match_stop_regex(self, req: Req) -> bool:
        if self.decode_text is None:
            raise ValueError("stop_regex needs a tokenizer (skip_tokenizer_init is set)")
        return match_stop_regex(req, self.decode_text)

    def _match_stop_string(self, req: Req) -> bool:
        if self.decode_text is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set)")
        # A stop string of L characters ends within the last L tokens (each decodes to at least
        # one character, or a partial one that the next token completes).
        longest = max(len(s) for s in req.sampling_params.stop)
        tail = self.decode_text(req.output_ids[-(longest + 2):])
        if not any(s in tail for s in req.sampling_params.stop):
            return False
        text = self.decode_text(req.output_ids)
        return stop_at_first(req, text, [(text.find(s), s) for s in req.sampling_params.stop
                                         if s in text])
