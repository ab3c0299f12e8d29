"""Host-side batches: `Req`, `ScheduleBatch` (requests and KV allocation) and `ModelWorkerBatch`
(the padded numpy arrays one model step needs).

Nothing here touches jax: ScheduleBatch never builds device arrays; ModelWorkerBatch pads to a
bucket exactly once, and the model worker moves it to the device in one transfer
(`ForwardBatch.init_new`).
"""

from dataclasses import dataclass, field

import numpy as np

from jaxrunner.batch.buckets import Bucket
from jaxrunner.batch.forward_mode import CaptureHiddenMode, ForwardMode
from jaxrunner.batch.input_embeds import EmbedOverride
from jaxrunner.mem_cache.memory_pool import DUMMY_PAGE, PageAllocator, ReqToTokenPool
from jaxrunner.mem_cache.swa_memory_pool import slide_window
from jaxrunner.sampling.batch import ALWAYS, SamplingBatch, SlotEntry
from jaxrunner.sampling.params import SamplingParams

# Token ids under a LoRA adapter are keyed in the prefix cache as id + (adapter uid << this):
# above any vocabulary, so different adapters' keys never compare equal. A cache namespace
# (`cache_salt`) adds its 64-bit id << NAMESPACE_KEY_SHIFT, above any adapter uid.
LORA_KEY_SHIFT = 40
NAMESPACE_KEY_SHIFT = 80


@dataclass(eq=False)
class Req:
    """One generation request and its progress.

    With overlapped scheduling a request may have one `pending` token: sampled on the device by
    the step in flight, not yet read back. It counts in `seq_len`, and the next step reads its id
    on the device.

    Log-probabilities: with `return_logprob`, `output_logprobs` gets each output token's and,
    when `top_logprobs_num` > 0, `output_top_logprobs` its most likely alternatives;
    `logprob_start_len` >= 0 also asks for the prompt's from that position on
    (`input_token_logprobs`, None for the first token, which has no context).
    """

    rid: int
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    max_new_tokens: int            # sampling_params.max_new_tokens, capped by the context length
    eos_token_ids: frozenset[int]
    return_logprob: bool = False
    priority: int = 0              # larger runs sooner
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    pending: int = 0
    req_pool_idx: int | None = None
    # Tokens whose KV is in the cache (or being written by the step in flight).
    num_computed_tokens: int = 0
    # Radix cache: the locked tree node of the matched prefix, and how many of the slot's
    # leading pages belong to the tree rather than to this request.
    prefix_node: object = None
    num_tree_pages: int = 0
    cached_tokens: int = 0         # prompt tokens served from the prefix cache
    num_retractions: int = 0
    spec_verify_ct: int = 0        # speculative rounds (verify steps) it took part in
    finished_reason: dict | None = None
    # Set when a stop string ended the request: the text, cut before the stop string.
    stopped_text: str | None = None
    # Embeddings that replace some prompt tokens' own (`input_embeds`, `replace_embeds`).
    embed_override: EmbedOverride | None = None
    # The request's grammar matcher (jaxrunner/sampling/grammar.py), when its output is constrained.
    grammar: object = None
    # The slot whose device sampling state holds this request's counts and bias table, once
    # initialised (None again when the request leaves its slot).
    sampling_slot: int | None = None
    top_logprobs_num: int = 0
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    logprob_start_len: int = -1    # -1: no prompt logprobs
    input_token_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_logprobs_done: bool = False
    # The LoRA adapter the request runs with (jaxrunner/lora/adapter.py: LoraAdapter; None: the
    # base model), and its device slot while the request is admitted (-1 otherwise).
    lora: object = None
    lora_slot: int = -1
    # The prefix-cache namespace of `cache_salt` (0: none): cached prefixes are shared only
    # within one.
    cache_namespace: int = 0
    # `return_hidden_states`: the states after the final norm, SGLang's layout: [the prompt
    # tokens' states], then one per generated token the model read (jaxrunner/hidden_states/).
    return_hidden_states: bool = False
    hidden_states: list = field(default_factory=list)
    # A pooling model's request (jaxrunner/pooling/): what it asks for (`PoolingRequest`), and
    # its result so far (the last chunk's pooled state, or the sum over its chunks for mean
    # pooling, over `pooled_tokens` tokens).
    pooling: object = None
    pooled: object = None
    pooled_tokens: int = 0

    @property
    def fill_ids(self) -> list[int]:
        """Prompt and known output tokens (not the pending one)."""
        return self.origin_input_ids + self.output_ids

    def cache_key(self, token_ids: list[int]) -> list[int]:
        """`token_ids` as the prefix cache keys them: under an adapter, moved into that
        adapter load's own id range, so the same text under two adapters (or the base) never
        shares KV."""
        offset = self.cache_namespace << NAMESPACE_KEY_SHIFT
        if self.lora is not None:
            offset += self.lora.uid << LORA_KEY_SHIFT
        if not offset:
            return token_ids
        return [t + offset for t in token_ids]

    def tokens(self, start: int, end: int) -> list[int]:
        """Known tokens `start:end` of prompt + output, without concatenating the sequence."""
        n_in = len(self.origin_input_ids)
        if start >= n_in:
            return self.output_ids[start - n_in:end - n_in]
        return self.origin_input_ids[start:end] + self.output_ids[:max(0, end - n_in)]

    def cacheable(self, num_tokens: int) -> int:
        """How many of the first `num_tokens` tokens the prefix cache may share: their KV
        depends on their ids alone, so not a token at or past the first given embedding (nor
        anything after it, whose attention saw it)."""
        if self.embed_override is None:
            return num_tokens
        return min(num_tokens, self.embed_override.first_position)

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids) + self.pending

    @property
    def num_outputs(self) -> int:
        """Output tokens sampled so far, the pending one included."""
        return len(self.output_ids) + self.pending

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet."""
        return self.logprob_start_len >= 0 and not self.input_logprobs_done

    @property
    def needs_prompt_pass(self) -> bool:
        """The prompt must run even with no token to generate: for its logprobs, or a pooling
        model's result."""
        return self.wants_input_logprobs or self.pooling is not None

    @property
    def cacheable_prefix_limit(self) -> int:
        """How many prompt tokens a cached prefix may cover: all but the last, less where every
        token's output is wanted (prompt logprobs from their start, hidden states, mean
        pooling needs every token's state)."""
        limit = self.cacheable(self.seq_len - 1)
        if self.wants_input_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        if self.return_hidden_states or (self.pooling is not None and self.pooling.mode == "mean"):
            limit = 0
        return limit

    def slot_entry(self) -> SlotEntry:
        """What the request's slot of the device sampling state must hold
        (jaxrunner/sampling/penalties.py): its logit_bias, its min_new_tokens mask, and the prompt
        and
        output tokens its penalties count."""
        p = self.sampling_params
        ids, values, until = [], [], []
        for token, bias in (p.logit_bias or {}).items():
            ids.append(token), values.append(bias), until.append(ALWAYS)
        if p.min_new_tokens > 0:
            # EOS ends a request only without ignore_eos.
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            for token in sorted(stops):
                ids.append(token), values.append(-np.inf), until.append(p.min_new_tokens)
        return SlotEntry(self.req_pool_idx, ids, values, until,
                         prompt_ids=self.origin_input_ids if p.repetition_penalty != 1.0 else [],
                         output_ids=list(self.output_ids) if p.has_penalties else [])


@dataclass
class ModelWorkerBatch:
    """The padded numpy arrays of one step; shapes set by `bucket` (T tokens, R requests)."""

    forward_mode: ForwardMode      # the step's mode; `bucket.mode` is the executable's
    bucket: Bucket
    num_reqs: int                  # real requests; rows >= num_reqs are padding
    num_tokens: int                # real tokens; slots >= num_tokens are padding
    input_ids: np.ndarray          # i32[T]
    # i32[T]: row of the previous step's sampled tokens that holds this token (-1: input_ids has
    # it). Overlapped scheduling builds a step before the previous one's tokens are known.
    input_token_src: np.ndarray
    out_cache_loc: np.ndarray      # i32[T]: KV slot of each token; padding -> the dummy page
    seq_lens: np.ndarray           # i32[R]: KV length after this step; padding -> 0
    extend_seq_lens: np.ndarray    # i32[R]: new tokens per request (1 in decode); padding -> 0
    extend_prefix_lens: np.ndarray  # i32[R]: tokens already cached per request
    page_table: np.ndarray         # i32[R, max_pages_per_req]
    sampling: SamplingBatch        # numpy leaves, R rows
    # i32[T]: the prompt token after each token, for prompt logprobs; -1 (the default for all):
    # none wanted.
    logprob_target_ids: np.ndarray | None = None
    # Request slots whose device sampling state this step must (re)initialise before it samples.
    slot_entries: list[SlotEntry] = field(default_factory=list)
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    # i32[R]: each request's slot in the ReqToTokenPool (padding: -1).
    req_pool_indices: np.ndarray | None = None
    # i32[R]: the token after each request's chunk, -1 where it is the one this step samples
    # (a speculative draft's prefill reads the tokens one ahead).
    next_token_ids: np.ndarray | None = None
    # i32[T]: row of `input_embeds` that replaces the token's embedding, or -1 (None: all -1).
    input_embeds_src: np.ndarray | None = None
    input_embeds: np.ndarray | None = None  # [rows, D]: the step's given embeddings, or None
    # i32[T]: each token's LoRA adapter slot (jaxrunner/lora/); -1: the base model (None: all -1).
    lora_slots: np.ndarray | None = None
    # With a sliding-window KV pool (jaxrunner/mem_cache/swa_memory_pool.py): the windowed
    # layers' page table i32[R, max_pages_per_req] and KV slots i32[T]; None without one.
    swa_page_table: np.ndarray | None = None
    swa_out_cache_loc: np.ndarray | None = None

    def __post_init__(self):
        if self.lora_slots is None:
            self.lora_slots = np.full(self.bucket.num_tokens, -1, np.int32)
        if self.input_embeds_src is None:
            self.input_embeds_src = np.full(self.bucket.num_tokens, -1, np.int32)
        if self.logprob_target_ids is None:
            self.logprob_target_ids = np.full(self.input_ids.shape, -1, np.int32)

    @classmethod
    def padding(cls, bucket: Bucket, page_size: int, max_pages_per_req: int) -> "ModelWorkerBatch":
        """A batch of padding only (an IDLE data-parallel rank): no request, every token writes
        the dummy page."""
        T, R = bucket.num_tokens, bucket.num_reqs
        zeros_t, zeros_r = np.zeros(T, np.int32), np.zeros(R, np.int32)
        return cls(forward_mode=ForwardMode.IDLE, bucket=bucket, num_reqs=0, num_tokens=0,
                   input_ids=zeros_t, input_token_src=np.full(T, -1, np.int32),
                   out_cache_loc=np.full(T, DUMMY_PAGE * page_size, np.int32),
                   seq_lens=zeros_r, extend_seq_lens=zeros_r, extend_prefix_lens=zeros_r,
                   page_table=np.full((R, max_pages_per_req), DUMMY_PAGE, np.int32),
                   sampling=SamplingBatch.padding(R))


class ScheduleBatch:
    """The requests of one step and their KV allocation.

    `extend_lens[i]` is how many of request i's tokens this step computes: the rest of its prompt
    (or a chunk of it) when prefilling, 1 when decoding. `prev_rows` maps a request whose last
    token is pending to its row in the step in flight.
    """

    def __init__(self, reqs: list[Req], forward_mode: ForwardMode, extend_lens: list[int],
                 req_to_token_pool: ReqToTokenPool, allocator: PageAllocator, page_size: int,
                 prev_rows: dict[int, int] | None = None, kv_lens: list[int] | None = None):
        """`kv_lens[i]` (default `extend_lens[i]`): how many of request i's tokens get KV slots;
        the rest write the dummy page (a verify step's drafts past the context length)."""
        self.reqs = reqs
        self.forward_mode = forward_mode
        self.extend_lens = extend_lens
        self.kv_lens = extend_lens if kv_lens is None else kv_lens
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.prev_rows = prev_rows or {}

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def _new_pages(self, req: Req, n: int) -> int:
        """Pages `req` must add so its next `n` tokens have KV slots."""
        held = 0 if req.req_pool_idx is None else int(self.req_to_token_pool.num_pages[req.req_pool_idx])
        return max(0, -(-(req.num_computed_tokens + n) // self.page_size) - held)

    def pages_needed(self) -> int:
        return sum(self._new_pages(req, n) for req, n in zip(self.reqs, self.kv_lens))

    def alloc_kv(self) -> bool:
        """Gives each request a slot and the pages for its new tokens; all or nothing."""
        for req in self.reqs:  # windowed twins the requests' windows have passed go first
            slide_window(self.allocator, self.req_to_token_pool, req)
        needs = [self._new_pages(req, n) for req, n in zip(self.reqs, self.kv_lens)]
        pages = self.allocator.alloc(sum(needs))
        if pages is None:
            return False
        for req, need in zip(self.reqs, needs):
            if req.req_pool_idx is None:
                req.req_pool_idx = self.req_to_token_pool.alloc_slot()
            self.req_to_token_pool.append_pages(req.req_pool_idx, pages[:need])
            pages = pages[need:]
        return True

    def get_model_worker_batch(self, bucket: Bucket) -> ModelWorkerBatch:
        """Pads this step's arrays to `bucket`."""
        T, R = bucket.num_tokens, bucket.num_reqs
        num_reqs, num_tokens = len(self.reqs), self.num_tokens
        if num_reqs > R or num_tokens > T:
            raise ValueError(f"{num_reqs} requests / {num_tokens} tokens do not fit {bucket}")
        input_ids = np.zeros(T, np.int32)
        input_token_src = np.full(T, -1, np.int32)
        out_cache_loc = np.full(T, DUMMY_PAGE * self.page_size, np.int32)
        seq_lens = np.zeros(R, np.int32)
        extend_seq_lens = np.zeros(R, np.int32)
        extend_prefix_lens = np.zeros(R, np.int32)
        page_table = np.full((R, self.req_to_token_pool.max_pages_per_req), DUMMY_PAGE, np.int32)
        req_pool_indices = np.full(R, -1, np.int32)
        next_token_ids = np.zeros(R, np.int32)
        # A verify step's tokens past the first are the drafts, filled on the device; a DLLM
        # step's block is filled by its scheduler (jaxrunner/dllm/scheduler.py).
        verify = self.forward_mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DLLM_EXTEND)
        input_embeds_src = np.full(T, -1, np.int32)
        lora_slots = np.full(T, -1, np.int32)
        given_embeds = []
        logprob_target_ids = np.full(T, -1, np.int32)
        slot_entries, sampled = [], []

        start = 0
        for i, (req, n, kv_n) in enumerate(zip(self.reqs, self.extend_lens, self.kv_lens)):
            prefix = req.num_computed_tokens
            slot = req.req_pool_idx
            known = req.tokens(prefix, prefix + n)
            input_ids[start:start + len(known)] = known
            if len(known) < n and not verify:  # the last token is still on the device
                input_token_src[start + n - 1] = self.prev_rows[req.rid]
            following = req.tokens(prefix + n, prefix + n + 1)
            next_token_ids[i] = following[0] if following else -1
            req_pool_indices[i] = slot
            token_idx = np.arange(prefix, prefix + kv_n)
            pages = self.req_to_token_pool.page_table[slot]
            out_cache_loc[start:start + kv_n] = (pages[token_idx // self.page_size]
                                                 * self.page_size + token_idx % self.page_size)
            seq_lens[i] = prefix + n
            extend_seq_lens[i] = n
            extend_prefix_lens[i] = prefix
            page_table[i] = pages
            if req.embed_override is not None:
                positions, rows = req.embed_override.rows_in(prefix, prefix + n)
                if len(positions):
                    first = sum(len(r) for r in given_embeds)
                    input_embeds_src[start + positions - prefix] = first + np.arange(len(rows))
                    given_embeds.append(rows)
            if req.wants_input_logprobs:
                # Token p predicts prompt token p + 1.
                prompt = req.origin_input_ids
                first = max(prefix, req.logprob_start_len - 1)
                last = min(prefix + n, len(prompt) - 1)
                if first < last:
                    logprob_target_ids[start + first - prefix:start + last - prefix] = \
                        prompt[first + 1:last + 1]
            if req.sampling_params.uses_slot_state and req.sampling_slot != slot:
                # The request is new to this slot (admitted, or resumed after a retraction).
                slot_entries.append(req.slot_entry())
                req.sampling_slot = slot
            lora_slots[start:start + n] = req.lora_slot
            sampled.append(prefix + n == req.seq_len)
            start += n

        sampling = SamplingBatch.from_params(
            [r.sampling_params for r in self.reqs], steps=[r.num_outputs for r in self.reqs],
            seeds=[r.seed for r in self.reqs], padded_size=R,
            slots=[r.req_pool_idx for r in self.reqs], sampled=sampled,
            constrained=[r.grammar is not None and s for r, s in zip(self.reqs, sampled)],
            top_logprobs_nums=[r.top_logprobs_num for r in self.reqs])
        return ModelWorkerBatch(
            forward_mode=self.forward_mode, bucket=bucket, num_reqs=num_reqs,
            num_tokens=num_tokens, input_ids=input_ids, input_token_src=input_token_src,
            out_cache_loc=out_cache_loc, seq_lens=seq_lens,
            extend_seq_lens=extend_seq_lens, extend_prefix_lens=extend_prefix_lens,
            page_table=page_table, sampling=sampling, req_pool_indices=req_pool_indices,
            next_token_ids=next_token_ids, input_embeds_src=input_embeds_src,
            input_embeds=np.concatenate(given_embeds) if given_embeds else None,
            logprob_target_ids=logprob_target_ids, slot_entries=slot_entries,
            lora_slots=lora_slots,
            # Read off the allocator now: a twin the next batch's slide frees is still in this
            # batch's table (the steps run in order on the device).
            swa_page_table=self.allocator.twins(page_table) if self.allocator.windowed else None,
            swa_out_cache_loc=(self.allocator.twin_slots(out_cache_loc)
                               if self.allocator.windowed else None))
