"""The scheduler of a block-diffusion LM (`dllm_algorithm`): continuous batching of blocks.

A request's sequence is cut into blocks of B positions from position 0. Its prompt's whole
blocks are prefilled (EXTEND steps, block-causal: `dllm.step.block_bound`), reusing the longest
cached prefix of them (radix cache, whole blocks of whole pages). The first generated block
holds the rest of the prompt and mask tokens. Then every scheduler step is one DLLM_EXTEND step
over all running requests, whatever their block and step (the batch is bucketed by request
count, B tokens each):

- a request with undecided positions runs its block and takes the step's commits
  (`dllm.algorithm.low_confidence`, at most `dllm_steps_per_block` steps per block);
- a request whose block just got decided runs it once more, all tokens known, so its slots hold
  the block's final KV (the store pass: SDAR's `store_kv`, SGLang's last forward), and starts
  its next block of masks.

When a block is decided its tokens become the request's output: a stop token (EOS unless
`ignore_eos`, or `stop_token_ids`) ends the request there, and `max_new_tokens` cuts the block;
the final block needs no store pass. Admission books every page a request can reach (its prompt
and max_new_tokens, rounded up to whole blocks), so a running request never waits for pages
and nothing is retracted. On release the KV of whole blocks goes to the prefix cache. The KV
books and the finish rules are the plain scheduler's (jaxrunner/scheduler/kv_bookkeeping.py,
finish.py).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
import math

import numpy as np

from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.batch.schedule_batch import Req, ScheduleBatch
from jaxrunner.dllm.algorithm import DllmInput
from jaxrunner.mem_cache.radix_cache import RadixCache
from jaxrunner.scheduler.finish import FinishRules
from jaxrunner.scheduler.kv_bookkeeping import KvBookkeeping
from jaxrunner.scheduler.policy import order_waiting


@dataclass
class _Block:
    start: int                 # position of the block's first token
    tokens: list[int]          # B ids; the mask id where undecided
    steps: int = 0             # DLLM steps taken on it
    decided: bool = False      # all positions known: the next step is its store pass
    history: list[list[int]] = field(default_factory=list)  # the block after each step


class DllmScheduler:
    """The scheduler contract (jaxrunner/scheduler/base.py) for block-diffusion LMs."""

    num_retractions = 0  # admission books every page a request can reach: nothing is retracted

    def __init__(self, worker, decode_text: Callable[[list[int]], str] | None = None):
        """`worker`: the `ModelWorker` of a DLLM (`dllm_plan`, `forward_batch_dllm`).
        `decode_text` as for `Scheduler` (its finish rules; stop strings are refused here)."""
        self.worker = worker
        args = self.args = worker.args
        plan = worker.dllm_plan
        self.block_size, self.mask_id = plan.block_size, plan.mask_id
        self.steps_per_block = plan.steps_per_block
        self.page_size = args.page_size
        self.req_to_token_pool, self.allocator = worker.get_memory_pool(0)
        self.tree_cache = RadixCache(args.page_size, self.allocator,
                                     disable=args.disable_radix_cache)
        self.kv = KvBookkeeping(self.req_to_token_pool, self.allocator, self.tree_cache,
                                args.page_size)
        self.finish = FinishRules(decode_text)
        # Cached prefixes are whole blocks (a token's KV depends on its whole block) of whole
        # pages.
        self.align = math.lcm(self.block_size, self.page_size)
        # The last block must end within the context.
        self.max_len = worker.context_len // self.block_size * self.block_size
        self.waiting: list[Req] = []
        self.prefilling: list[Req] = []    # admitted, prompt blocks not all in the cache yet
        self.generating: list[Req] = []    # generating blocks
        self.chunked_req = None            # (Scheduler's field; prefills here are whole blocks)
        self.blocks: dict[int, _Block] = {}
        self._booked: dict[int, int] = {}  # rid -> pages the request may hold at most
        # rid -> every finished block's states after each of its steps, when `record_steps`
        # (tests compare them with the reference implementation).
        self.record_steps = False
        self.step_log: dict[int, list[list[list[int]]]] = {}
        self.forward_ct = 0
        self.num_dllm_steps = 0            # DLLM_EXTEND steps (store passes included)

    # ---- requests ----

    def check_request(self, req: Req) -> None:
        """Refuses, naming them, the options block-diffusion decoding does not implement, and
        caps max_new_tokens so the last block fits the context; raises ValueError."""
        p = req.sampling_params
        bad = []
        if p.grammar is not None:
            bad.append(p.grammar[0])
        if p.has_penalties or p.logit_bias or p.min_new_tokens:
            bad.append("penalties, logit_bias and min_new_tokens")
        if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
            bad.append("top_k, top_p and min_p")
        if p.stop or p.stop_regex:
            bad.append("stop strings (stop, stop_regex)")
        if req.return_logprob or req.logprob_start_len >= 0:
            bad.append("logprobs")
        if req.embed_override is not None:
            bad.append("input embeddings")
        if req.lora is not None:
            bad.append("LoRA adapters")
        if bad:
            raise ValueError(f"{', '.join(bad)} not implemented with dllm_algorithm "
                             f"{self.args.dllm_algorithm!r} (it samples by temperature and stops "
                             f"at stop_token_ids, EOS or max_new_tokens)")
        if self.mask_id in req.origin_input_ids:
            raise ValueError(f"the prompt holds the mask token ({self.mask_id}), which only "
                             f"undecided positions may hold")
        room = self.max_len - len(req.origin_input_ids)
        if room < 1 and req.max_new_tokens > 0:
            raise ValueError(f"a prompt of {len(req.origin_input_ids)} tokens leaves no room "
                             f"for a block of {self.block_size} within the context "
                             f"({self.worker.context_len})")
        req.max_new_tokens = min(req.max_new_tokens, room)

    @property
    def running(self) -> list[Req]:
        """Admitted requests: prefilling their prompt or generating."""
        return self.prefilling + self.generating

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.generating)

    def unfinished_requests(self) -> list[Req]:
        """Every request waiting, prefilling its prompt blocks or generating."""
        return [r for r in self.waiting + self.running if not r.finished]

    def memory_stats(self) -> dict[str, int]:
        """KV pages and request slots (`KvBookkeeping.memory_stats`) and the waiting
        requests."""
        return self.kv.memory_stats() | {"num_requests_waiting": len(self.waiting)}

    def add_request(self, req: Req) -> None:
        self.check_request(req)
        if req.max_new_tokens == 0:
            req.finished_reason = {"type": "length", "length": 0}
            return
        self.waiting.append(req)

    def abort_request(self, req: Req, message: str = "aborted") -> None:
        if req.finished:
            return
        for queue in (self.waiting, self.prefilling, self.generating):
            if req in queue:
                queue.remove(req)
        self._release_kv(req)
        req.finished_reason = {"type": "abort", "message": message}

    def flush_cache(self) -> bool:
        if self.has_work:
            return False
        self.tree_cache.reset()
        return True

    # ---- one step ----

    def step(self) -> list[Req]:
        """Runs one step (a prefill of prompt blocks, else a DLLM step); returns the requests
        whose output grew (finished ones included)."""
        chunks = self._admit()
        if chunks:
            self._prefill(chunks)
            return []
        if self.generating:
            return self._dllm_step()
        return []

    def _prompt_blocks(self, req: Req) -> int:
        """Tokens of the prompt's whole blocks: what the prefill computes."""
        return len(req.origin_input_ids) // self.block_size * self.block_size

    def _pages_at_most(self, req: Req) -> int:
        end = -(-(len(req.origin_input_ids) + req.max_new_tokens) // self.block_size)
        return -(-end * self.block_size // self.page_size)

    def _outstanding_pages(self) -> int:
        held = self.req_to_token_pool.num_pages
        return sum(max(0, self._booked[r.rid] - int(held[r.req_pool_idx]))
                   for r in self.running)

    def _admit(self) -> list[tuple[Req, int]]:
        """This step's prefill chunks (whole blocks within max_prefill_tokens): the requests
        still prefilling first, then waiting ones while request slots and pages last."""
        B, args = self.block_size, self.args
        budget = args.max_prefill_tokens // B * B
        chunks = []
        for req in self.prefilling:
            n = min(self._prompt_blocks(req) - req.num_computed_tokens, budget)
            if n > 0:
                chunks.append((req, n))
                budget -= n
        for req in order_waiting(self.waiting, args.schedule_policy, self.tree_cache):
            if len(self.running) >= args.max_running_requests:
                break
            prefill = self._prompt_blocks(req)
            match = self.tree_cache.match_prefix(req.origin_input_ids, max_tokens=prefill)
            usable = match.num_tokens // self.align * self.align
            if usable != match.num_tokens:  # a match ending inside a block: its blocks only
                match = self.tree_cache.match_prefix(req.origin_input_ids, max_tokens=usable)
            # Locking the matched prefix takes its pages out of the evictable ones.
            self.tree_cache.inc_lock_ref(match.node)
            available = self.kv.available_pages - self._outstanding_pages()
            if self._pages_at_most(req) - len(match.pages) > available:
                self.tree_cache.dec_lock_ref(match.node)
                break  # the head of the queue waits rather than being overtaken
            self.waiting.remove(req)
            self.kv.take_prefix(req, match)  # never retracted: its cached tokens are the match
            self._booked[req.rid] = self._pages_at_most(req)
            if match.num_tokens == prefill:
                self._start_block(req, prefill)
                continue
            self.prefilling.append(req)
            n = min(prefill - match.num_tokens, budget)
            if n > 0:
                chunks.append((req, n))
                budget -= n
        return chunks

    def _prefill(self, chunks: list[tuple[Req, int]]) -> None:
        reqs, lens = [r for r, _ in chunks], [n for _, n in chunks]
        batch = self._allocated(reqs, ForwardMode.EXTEND, lens)
        bucket = self.worker.pick_bucket(ForwardMode.EXTEND, batch.num_tokens, len(reqs))
        # The step's sampled token is not used: a DLLM request's tokens come from its blocks.
        self.worker.forward_batch_generation(batch.get_model_worker_batch(bucket))
        self.forward_ct += 1
        for req, n in chunks:
            req.num_computed_tokens += n
            if req.num_computed_tokens == self._prompt_blocks(req):
                self.prefilling.remove(req)
                self._start_block(req, req.num_computed_tokens)

    def _start_block(self, req: Req, start: int) -> None:
        """The block at `start`: the prompt's tokens there, masks after them."""
        known = req.tokens(start, start + self.block_size)
        self.blocks[req.rid] = _Block(start, known + [self.mask_id] * (self.block_size
                                                                       - len(known)))
        if req not in self.generating:
            self.generating.append(req)

    def _allocated(self, reqs, mode, lens) -> ScheduleBatch:
        return self.kv.allocate(ScheduleBatch(reqs, mode, lens, self.req_to_token_pool,
                                              self.allocator, self.page_size))

    def _dllm_step(self) -> list[Req]:
        B, reqs = self.block_size, list(self.generating)
        for req in reqs:  # the block's KV slots start where the committed KV ends
            req.num_computed_tokens = self.blocks[req.rid].start
        batch = self._allocated(reqs, ForwardMode.DLLM_EXTEND, [B] * len(reqs))
        bucket = self.worker.pick_bucket(ForwardMode.DLLM_EXTEND, len(reqs) * B, len(reqs))
        worker_batch = batch.get_model_worker_batch(bucket)
        R = bucket.num_reqs
        steps_left, temperature = np.ones(R, np.int32), np.zeros(R, np.float32)
        seeds, counters = np.zeros(R, np.int32), np.zeros(R, np.int32)
        for i, req in enumerate(reqs):
            block = self.blocks[req.rid]
            worker_batch.input_ids[i * B:(i + 1) * B] = block.tokens
            steps_left[i] = max(1, self.steps_per_block - block.steps)
            temperature[i] = req.sampling_params.temperature
            seeds[i] = req.seed % 2**31
            # One key per (block, step) of the request.
            counters[i] = block.start // B * self.steps_per_block + block.steps
        new_blocks = self.worker.forward_batch_dllm(
            worker_batch, DllmInput(steps_left, temperature, seeds, counters))
        self.forward_ct += 1
        self.num_dllm_steps += 1
        updated = []
        for req, tokens in zip(reqs, new_blocks):
            block = self.blocks[req.rid]
            if block.decided:  # the store pass: the block's KV is final
                req.num_computed_tokens = block.start + B
                self._start_block(req, block.start + B)
                continue
            block.tokens, block.steps = tokens.tolist(), block.steps + 1
            block.history.append(block.tokens)
            if self.mask_id in block.tokens:
                continue
            block.decided = True
            if self.record_steps:
                self.step_log.setdefault(req.rid, []).append(block.history)
            self._append_block(req, block)
            updated.append(req)
            if req.finished:
                self.generating.remove(req)
                self._release_kv(req)
        return updated

    def _append_block(self, req: Req, block: _Block) -> None:
        """The decided block's generated tokens become output, up to the first one that
        finishes the request (a stop token or max_new_tokens: `check_request` refuses the other
        finish rules' options)."""
        first = max(0, len(req.origin_input_ids) - block.start)  # past the prompt's tail
        for token in block.tokens[first:]:
            req.output_ids.append(token)
            self.finish.check(req)
            if req.finished:
                return

    def _release_kv(self, req: Req) -> None:
        """Whole cached blocks go to the prefix cache, the other pages to the allocator."""
        self.blocks.pop(req.rid, None)
        self._booked.pop(req.rid, None)
        self.kv.release(req, align=self.align)
