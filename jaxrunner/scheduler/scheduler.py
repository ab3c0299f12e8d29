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
- Grammars (grammar_mask.py): a step with a constrained request reads step n back while its
  forward pass runs, to fill its bitmask; only its sampler waits for the host.
- `n` samples of one prompt share its KV: a request whose prompt equals one admitted in the
  same step waits a step, and then finds that prompt in the prefix cache.

The features live beside it: the decode strategy (decode.py: plain DECODE steps, or speculative
verify rounds from jaxrunner/speculative/round.py), split prefill's state and steps
(jaxrunner/split_prefill/schedule.py: a prefill batch runs a range of layers per step, with a
decode step of the running requests after each range), LoRA slots (lora_slots.py); the KV books
(kv_bookkeeping.py) and finish rules (finish.py) are shared with the block-diffusion scheduler.
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
from jaxrunner.scheduler.decode import DecodeStrategy, PlainDecode, pages_for
from jaxrunner.scheduler.faults import fail_requests
from jaxrunner.scheduler.finish import FinishRules
from jaxrunner.scheduler.grammar_mask import is_constrained, launch_with_vocab_mask
from jaxrunner.scheduler.kv_bookkeeping import KvBookkeeping
from jaxrunner.scheduler.lora_slots import acquire_lora_slot, release_lora_slot
from jaxrunner.scheduler.request_output import StepOutputs, record_input_logprobs
from jaxrunner.split_prefill.schedule import SplitPrefillSchedule


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
                 *, dp_rank: int = 0, overlap: bool | None = None,
                 decode: DecodeStrategy | None = None):
        """`worker` is the `ModelWorker` (or anything with its verbs: `args`,
        `get_memory_pool`, `pick_bucket`, `forward_batch_generation`, `lora_registry`, and the
        split-prefill verbs). `decode_text` turns token ids into text; needed only for stop
        strings. A DP attention rank books into its own memory pool (`dp_rank`) and never
        launches steps itself (DataParallelScheduler does). `overlap` defaults to
        `not args.disable_overlap_schedule`; `decode` to `PlainDecode()`."""
        self.worker = worker
        args = self.args = worker.args
        self.page_size = args.page_size
        self.finish = FinishRules(decode_text)
        self.req_to_token_pool, self.allocator = worker.get_memory_pool(dp_rank)
        self.tree_cache = RadixCache(args.page_size, self.allocator,
                                     disable=args.disable_radix_cache)
        self.kv = KvBookkeeping(self.req_to_token_pool, self.allocator, self.tree_cache,
                                args.page_size)
        self.chunk_size = args.chunk_size
        self.decode = PlainDecode() if decode is None else decode
        self.overlap = not args.disable_overlap_schedule if overlap is None else overlap
        self.overlap = self.overlap and self.decode.overlaps
        # A LoRA engine's adapters and device slots (jaxrunner/lora/registry.py), else None.
        self.lora = worker.lora_registry
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
        self.split_prefill = SplitPrefillSchedule(worker, args.page_size,
                                                  args.enable_split_prefill)

    # ---- requests ----

    @property
    def has_work(self) -> bool:
        """Requests are waiting or running (a step in flight for finished ones only is not
        work: its tokens are surplus)."""
        return bool(self.waiting or self.running or self.chunked_req
                    or self.split_prefill.in_progress or (
                        self.in_flight
                        and not all(r.finished for r in self.in_flight.batch.reqs)))

    def unfinished_requests(self) -> list[Req]:
        """Every request waiting, being prefilled (whole, chunked or split) or decoding."""
        reqs = self.waiting + self.running + ([self.chunked_req] if self.chunked_req else [])
        reqs += self.split_prefill.reqs
        return [r for r in dict.fromkeys(reqs) if not r.finished]

    def check_request(self, req: Req) -> None:
        """Refuses a request this scheduler cannot serve (ValueError); every request a valid
        engine makes can be served here."""

    def memory_stats(self) -> dict[str, int]:
        """KV pages and request slots (`KvBookkeeping.memory_stats`) and the waiting
        requests."""
        return self.kv.memory_stats() | {"num_requests_waiting": len(self.waiting)}

    def add_request(self, req: Req) -> None:
        if req.max_new_tokens == 0 and not req.needs_prompt_pass:
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
        self.split_prefill.drop(req)
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
            # The decode strategy's round, read back at once.
            self.forward_ct += 1
            updated, self._flushed = self._flushed, []
            prefixes = [r.num_computed_tokens for r in batch.reqs]
            try:
                return updated + self.decode.run_round(batch, self.worker, self.finish,
                                                       self.kv, self._retire)
            except Exception as e:  # the round's requests fail; the others go on
                return updated + fail_requests(self, batch.reqs, prefixes, e)
        launched = self._launch_contained(batch) if batch is not None else None
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
        if self.split_prefill.decode_turn():
            # One decode step after each range of a split prefill.
            decoding = self._decodable() and self._ensure_decode_pages(self._decodable())
            if decoding:
                return self._decode_batch(decoding)
        if self.split_prefill.in_progress:
            return self.split_prefill.batch
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
            if self.split_prefill.should_split(reqs, decoding):
                return self._schedule(reqs, ForwardMode.SPLIT_PREFILL, lens)
            return self._schedule(reqs, ForwardMode.EXTEND, lens)
        if decoding and not mixed:
            decoding = self._ensure_decode_pages(decoding)
        if not decoding:
            return None
        return self._decode_batch(decoding)

    def _decode_batch(self, decoding: list[Req]) -> ScheduleBatch:
        """The decode strategy's step (or round) of `decoding`, pages ensured."""
        self.new_token_ratio = max(self.min_new_token_ratio,
                                   self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return self._schedule(decoding, *self.decode.schedule(decoding, self.kv))

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
        decode_pages = self._decode_pages(decoding)
        swa = self.kv.available_swa_pages
        budget = PrefillBudget(
            tokens=args.max_prefill_tokens - len(decoding),
            reqs=args.max_running_requests - len(self.running) - (self.chunked_req is not None),
            pages=self.kv.available_pages - reserved - decode_pages,
            swa_pages=None if swa is None else swa - decode_pages)
        reqs, lens = [], []
        partial = None  # the request this step leaves with its prompt unfinished: at most one
        if self.chunked_req is not None:
            req = self.chunked_req
            n = min(req.seq_len - req.num_computed_tokens, self.chunk_size, budget.tokens)
            held = int(self.req_to_token_pool.num_pages[req.req_pool_idx])
            pages = pages_for(req.num_computed_tokens + n, self.page_size) - held
            available = self.kv.available_pages - decode_pages
            if n <= 0 or pages > available or (swa is not None and pages > budget.swa_pages):
                return None  # decoding requests must finish (or be retracted) first
            reqs.append(req)
            lens.append(n)
            budget.tokens -= n
            budget.pages -= pages
            if swa is not None:
                budget.swa_pages -= pages
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
            match = self.kv.match(req.cache_key(req.fill_ids),
                                  max_tokens=req.cacheable_prefix_limit)
            remaining = req.seq_len - match.num_tokens
            # A prompt longer than what is left of the budget is chunked to fill it (as SGLang
            # does): the step then runs in its bucket without padding tokens.
            n = min(remaining, self.chunk_size, budget.tokens)
            new_pages = pages_for(match.num_tokens + n, self.page_size) - len(match.pages)
            pages = new_pages + future_pages(req, self.page_size, self.new_token_ratio)
            # Locking the matched prefix takes its pages out of the evictable ones.
            evictable = self.tree_cache.evictable_pages
            self.tree_cache.inc_lock_ref(match.node)
            pages += evictable - self.tree_cache.evictable_pages
            swa_pages = new_pages + self.kv.window_cost(match)
            if not budget.fits(n, pages, swa_pages):
                self.tree_cache.dec_lock_ref(match.node)
                break  # the head of the queue waits rather than being overtaken
            if not acquire_lora_slot(self.lora, req):
                # Every adapter slot is pinned by other adapters' requests: this one waits for
                # a slot; requests of resident adapters (and the base) may go ahead.
                self.tree_cache.dec_lock_ref(match.node)
                continue
            budget.take(n, pages, swa_pages)
            self.kv.take_prefix(req, match)
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

    # ---- decode pages, eviction, retraction ----

    def _ensure_decode_pages(self, decoding: list[Req]) -> list[Req]:
        """Makes room for one more token per request: evict cached prefixes, then retract the
        newest requests until the rest fit."""
        need = self._decode_pages(decoding)
        if need <= self.kv.free_after_eviction(need):
            return decoding
        # Retraction changes the running set: first learn what the step in flight produced.
        if self.in_flight is not None:
            self._flushed += self.process_batch_result(self.in_flight)
            self.in_flight = None
        decoding = self._decodable()
        while decoding and self._decode_pages(decoding) > self.kv.free_after_eviction(
                self._decode_pages(decoding)):
            if self.split_prefill.in_progress:  # the newest pages, and no tokens yet
                self._retract_split()
                continue
            newest = max(decoding, key=lambda r: r.rid)
            self.running.remove(newest)
            self._requeue(newest)
            decoding.remove(newest)
        self.new_token_ratio = self.init_new_token_ratio
        return decoding

    def _retract_split(self) -> None:
        """Puts a split prefill's requests back in the queue; their pages go back now (their
        prefixes to the cache)."""
        for req in self.split_prefill.retract():
            if req is self.chunked_req:
                self.chunked_req = None
            self._requeue(req)

    def _requeue(self, req: Req) -> None:
        """Retracts an admitted request: its KV goes back (its prefix to the cache) and it
        waits to resume from there."""
        self._release_kv(req)
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.append(req)  # its old rid puts it first in FCFS order

    def _decode_pages(self, reqs: list[Req]) -> int:
        """Pages the decode strategy's next step over `reqs` adds."""
        return self.decode.new_pages(reqs, self.kv)

    def _retire(self, req: Req) -> None:
        """A finished request leaves the running set; its KV goes back."""
        self.running.remove(req)
        self._release_kv(req)

    def _release_kv(self, req: Req) -> None:
        """Returns a request's KV (its whole pages of known tokens to the prefix cache) and its
        LoRA slot."""
        self.kv.release(req)
        release_lora_slot(self.lora, req)

    # ---- launching and reading back ----

    def _schedule(self, reqs: list[Req], mode: ForwardMode, lens: list[int],
                  kv_lens: list[int] | None = None) -> ScheduleBatch:
        prev_rows = self.in_flight.rows if self.in_flight is not None else {}
        return self.kv.allocate(ScheduleBatch(reqs, mode, lens, self.req_to_token_pool,
                                              self.allocator, self.page_size, prev_rows,
                                              kv_lens))

    def _launch_contained(self, batch: ScheduleBatch) -> LaunchedBatch | None:
        """Launches `batch` (a split prefill's next range: None until its last); a launch that
        raises fails the batch's requests (scheduler/faults.py) and launches nothing."""
        prefixes = [r.num_computed_tokens for r in batch.reqs]
        try:
            if batch.forward_mode.is_split_prefill():
                return self._launch_split_range(batch)
            return self._launch(batch)
        except Exception as e:
            if self.split_prefill.in_progress:
                self.split_prefill.retract()  # the split ends; its requests fail below
            self._flushed += fail_requests(self, batch.reqs, prefixes, e)
            return None

    def _launch(self, batch: ScheduleBatch) -> LaunchedBatch:
        if not is_constrained(batch):
            return self.record_launch(batch, self._run_batch(batch))
        return launch_with_vocab_mask(batch, self._run_batch, self._book_before_mask,
                                      self.worker.vocab_size)

    def _launch_split_range(self, batch: ScheduleBatch) -> LaunchedBatch | None:
        """Launches the next layer range of the split prefill of `batch`; its last range's step
        is booked as a launched prefill step (None before)."""
        prev = self.in_flight.result if self.in_flight is not None else None
        result = self.split_prefill.run_range(batch, prev)
        return None if result is None else self.record_launch(batch, result)

    def _book_before_mask(self, batch: ScheduleBatch) -> LaunchedBatch:
        """Books a constrained step whose forward pass is on the device, and reads back the
        step before it: its tokens advance the grammars that fill this step's bitmask."""
        launched = self.record_launch(batch, None)
        if self.in_flight is not None:
            self._flushed += self.process_batch_result(self.in_flight)
            self.in_flight = None
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
                    self.kv.cache_prefilled(req)
            elif self.kv.allocator.windowed:
                # A chunk of a prompt: with a sliding-window pool its pages go to the prefix
                # cache now, before the window passes them (a request's own pages lose their
                # twins at once; the tree's keep them for any prefix of it, until reclaimed).
                self.kv.cache_prefilled(req)
        return LaunchedBatch(batch, result, samples, {r.rid: i for i, r in enumerate(batch.reqs)},
                             prefixes)

    def process_batch_result(self, launched: LaunchedBatch) -> list[Req]:
        """Reads a launched step's tokens back and advances its requests: new outputs, finished
        requests (their KV released); returns the requests that got a token. A read-back that
        raises fails the step's requests (scheduler/faults.py), which are returned too."""
        try:
            return self._read_back(launched)
        except Exception as e:
            return fail_requests(self, launched.batch.reqs, launched.prefixes, e)

    def _read_back(self, launched: LaunchedBatch) -> list[Req]:
        result, reqs = launched.result, launched.batch.reqs
        tokens, logprobs = result.copy_to_host()
        top = (result.top_logprobs_to_host()
               if any(r.return_logprob and r.top_logprobs_num for r in reqs) else None)
        inputs = (result.input_logprobs_to_host()
                  if any(r.wants_input_logprobs for r in reqs) else None)
        step_outputs = StepOutputs.read(result, reqs)
        updated, starts = [], np.cumsum([0] + launched.batch.extend_lens)
        for i, req in enumerate(reqs):
            if inputs is not None and req.wants_input_logprobs and not req.finished:
                record_input_logprobs(req, inputs, int(starts[i]), launched.prefixes[i],
                                      launched.batch.extend_lens[i])
            step_outputs.record(req, i, int(starts[i]), launched.prefixes[i],
                                launched.batch.extend_lens[i])
            if not launched.samples[i]:
                continue
            req.pending -= 1
            if req.finished:
                continue  # aborted, or finished by the step before (this token is surplus)
            if req.max_new_tokens == 0:  # prefilled for its prompt logprobs only
                req.finished_reason = {"type": "length", "length": 0}
            else:
                self.finish.append_token(req, int(tokens[i]), float(logprobs[i]),
                                         None if top is None else (top[0][i], top[1][i]))
            if req.finished:
                self._retire(req)
            updated.append(req)
        return updated
