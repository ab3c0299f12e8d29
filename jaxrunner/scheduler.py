"""The scheduler: continuous batching over the model runner, FCFS.

Each `step()` runs one model step: a prefill (EXTEND) batch when waiting requests fit, otherwise a
DECODE step over every running request. New requests join between decode steps; a finished
request gives its pages back at once. Prompts longer than `max_prefill_tokens` are prefilled in
chunks over several steps.

Admission reserves the pages a request may ever need (prompt + max_new_tokens), so a decode step
can always get its pages: the engine never runs out of KV memory mid-request.
"""

from collections import deque
from collections.abc import Callable

import numpy as np

from jaxrunner.buckets import pick_bucket
from jaxrunner.forward_batch import ForwardBatch
from jaxrunner.forward_mode import ForwardMode
from jaxrunner.model_runner import ModelRunner
from jaxrunner.schedule_batch import Req, ScheduleBatch


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class Scheduler:
    def __init__(self, runner: ModelRunner, decode_text: Callable[[list[int]], str] | None = None):
        """`decode_text` turns token ids into text; needed only for stop strings."""
        self.runner = runner
        self.args = runner.args
        self.page_size = runner.args.page_size
        self.decode_text = decode_text
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []      # prefill done, decoding
        self.prefilling: list[Req] = []   # admitted, prompt partly in the cache (chunked)
        self.forward_ct = 0

    # ---- bookkeeping ----

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def add_request(self, req: Req) -> None:
        if req.max_new_tokens == 0:
            req.finished_reason = {"type": "length", "length": 0}
            return
        self.waiting.append(req)

    def _reserved_pages(self, req: Req) -> int:
        """Pages `req` may still allocate before it finishes."""
        total = _pages(len(req.origin_input_ids) + req.max_new_tokens, self.page_size)
        held = 0 if req.req_pool_idx is None else int(self.runner.req_to_token_pool.num_pages[req.req_pool_idx])
        return total - held

    def abort_request(self, req: Req, message: str = "aborted") -> None:
        """Drops a request wherever it is; its pages go back at once."""
        if req.finished:
            return
        for queue in (self.waiting, self.running, self.prefilling):
            if req in queue:
                queue.remove(req)
        self._free(req)
        req.finished_reason = {"type": "abort", "message": message}

    def _free(self, req: Req) -> None:
        if req.req_pool_idx is not None:
            pages = self.runner.req_to_token_pool.free_slot(req.req_pool_idx)
            self.runner.allocator.free(pages)
            req.req_pool_idx = None

    # ---- batch building ----

    def _get_new_batch_prefill(self) -> ScheduleBatch | None:
        budget = self.args.max_prefill_tokens
        max_reqs = self.args.max_running_requests
        reqs, lens = [], []
        # Requests already partly prefilled continue first; their pages are reserved.
        for req in self.prefilling:
            if budget == 0:
                break
            n = min(len(req.origin_input_ids) - req.num_computed_tokens, budget)
            reqs.append(req)
            lens.append(n)
            budget -= n
        spare = self.runner.allocator.num_free - sum(
            self._reserved_pages(r) for r in self.running + self.prefilling)
        while (self.waiting and budget > 0
               and len(self.running) + len(self.prefilling) + len(reqs) - len(self.prefilling) < max_reqs):
            req = self.waiting[0]
            need = self._reserved_pages(req)
            if need > spare:
                break  # FCFS: the head waits for pages rather than being overtaken
            self.waiting.popleft()
            spare -= need
            n = min(len(req.origin_input_ids), budget)
            reqs.append(req)
            lens.append(n)
            budget -= n
            if n < len(req.origin_input_ids):
                self.prefilling.append(req)
        if not reqs:
            return None
        return self._schedule_batch(reqs, ForwardMode.EXTEND, lens)

    def _schedule_batch(self, reqs, mode, lens) -> ScheduleBatch:
        batch = ScheduleBatch(reqs, mode, lens, self.runner.req_to_token_pool,
                              self.runner.allocator, self.page_size)
        if not batch.alloc_kv():
            raise RuntimeError("KV allocation failed despite reservation (scheduler bug)")
        return batch

    # ---- one step ----

    def step(self) -> list[Req]:
        """Runs one model step; returns the requests that got a new token in it (finished ones
        included: `req.finished`)."""
        batch = self._get_new_batch_prefill()
        if batch is None:
            if not self.running:
                return []
            batch = self._schedule_batch(list(self.running), ForwardMode.DECODE,
                                         [1] * len(self.running))
        tokens, logprobs = self._run_batch(batch)
        return self._process_batch_result(batch, tokens, logprobs)

    def _run_batch(self, batch: ScheduleBatch) -> tuple[np.ndarray, np.ndarray]:
        bucket = pick_bucket(self.runner.buckets, batch.forward_mode, batch.num_tokens,
                             len(batch.reqs))
        worker_batch = batch.get_model_worker_batch(bucket)
        forward_batch, sampling = ForwardBatch.init_new(worker_batch)
        logits_output = self.runner.forward(forward_batch)
        tokens, logprobs = self.runner.sample(logits_output, sampling)
        self.forward_ct += 1
        return np.asarray(tokens), np.asarray(logprobs)

    def _process_batch_result(self, batch: ScheduleBatch, tokens, logprobs) -> list[Req]:
        advanced = []
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            req.num_computed_tokens += n
            if not req.prefill_done:
                continue  # a prompt chunk: its sampled token is not an output
            if batch.forward_mode == ForwardMode.EXTEND:
                if req in self.prefilling:
                    self.prefilling.remove(req)
                self.running.append(req)
            req.output_ids.append(int(tokens[i]))
            if req.return_logprob:
                req.output_logprobs.append(float(logprobs[i]))
            self._check_finished(req)
            if req.finished:
                self._free(req)
                self.running.remove(req)
            advanced.append(req)
        return advanced

    def _check_finished(self, req: Req) -> None:
        token = req.output_ids[-1]
        params = req.sampling_params
        if not params.ignore_eos and token in req.eos_token_ids:
            req.finished_reason = {"type": "stop", "matched": token}
        elif token in params.stop_token_ids:
            req.finished_reason = {"type": "stop", "matched": token}
        elif params.stop and self._match_stop_string(req):
            pass
        elif len(req.output_ids) >= req.max_new_tokens:
            req.finished_reason = {"type": "length", "length": req.max_new_tokens}

    def _match_stop_string(self, req: Req) -> bool:
        if self.decode_text is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set)")
        # A stop string of L characters ends within the last L tokens (each decodes to at least
        # one character, or a partial one that the next token completes).
        longest = max(len(s) for s in req.sampling_params.stop)
        tail = self.decode_text(req.output_ids[-(longest + 2):])
        hits = [s for s in req.sampling_params.stop if s in tail]
        if not hits:
            return False
        text = self.decode_text(req.output_ids)
        cut = min((text.find(s), s) for s in hits if s in text) if any(s in text for s in hits) else None
        if cut is None:
            return False
        req.stopped_text = text[:cut[0]]
        req.finished_reason = {"type": "stop", "matched": cut[1]}
        return True
