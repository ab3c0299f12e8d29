"""A model worker with the real one's verbs over a deterministic fake model, and no jax.

The fake keeps a "KV cache" of token ids: each step writes every real token's id at its
`out_cache_loc`, and a request's next token is a hash of the ids it can read through its page
table up to its `seq_len`. So the tokens it produces equal `reference_tokens` (the same hash over
prompt + outputs) only if the scheduler gave every step the right input ids, positions, pages,
prefix lengths and previous-step rows: a page booked twice, a prefix reused from the wrong
request, a chunk boundary off by one or a retraction that loses a token all change the output.
It also checks each batch against its bucket (padding rows empty, padding tokens on the dummy
page, no slot written twice).

Split prefill (`begin_split_prefill`, `forward_split_prefill`, `redirect_split_writes`): every
range of "layers" writes the batch's ids into the KV (as every layer range writes its layers'
KV), and the last range computes the tokens; so a page freed mid-split and handed to another
request while later ranges still write it changes that request's output.

A grammar's token bitmask (`vocab_mask_fn`, asked for after the "forward pass" as the real worker
does) moves a masked row's token to the first allowed id at or after the hash, cyclically.
"""

from dataclasses import dataclass, field

import numpy as np

from jaxrunner.batch.buckets import (
    all_buckets,
    executable_mode,
    pick_bucket,
    split_prefill_buckets,
    verify_buckets,
)
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.batch.schedule_batch import ModelWorkerBatch
from jaxrunner.config import EngineArgs
from jaxrunner.mem_cache.memory_pool import DUMMY_PAGE, PageAllocator, ReqToTokenPool

VOCAB = 1000
_MODULUS = (1 << 61) - 1


def next_token(sequence) -> int:
    """The fake model: a polynomial hash of the whole sequence, as a token id."""
    h = 17
    for t in sequence:
        h = (h * 1_000_003 + int(t) + 1) % _MODULUS
    return h % VOCAB


def reference_tokens(prompt: list[int], n: int, allowed=None) -> list[int]:
    """The fake model's output; `allowed(outputs so far)` -> the ids a grammar allows next."""
    seq = list(prompt)
    for _ in range(n):
        token = next_token(seq)
        if allowed is not None:
            token = masked_token(token, allowed(seq[len(prompt):]))
        seq.append(token)
    return seq[len(prompt):]


def masked_token(token: int, allowed) -> int:
    """The first allowed id at or after `token`, cyclically."""
    allowed = sorted(allowed)
    return next((t for t in allowed if t >= token), allowed[0])


@dataclass
class FakeResult:
    next_token_ids: np.ndarray
    logprobs: np.ndarray
    num_reqs: int
    read: bool = False

    def copy_to_host(self):
        self.read = True
        return self.next_token_ids[:self.num_reqs], self.logprobs[:self.num_reqs]

    def top_logprobs_to_host(self):
        raise NotImplementedError("the fake model has no log-probabilities")

    def input_logprobs_to_host(self):
        raise NotImplementedError("the fake model has no log-probabilities")

    def hidden_states_to_host(self):
        raise NotImplementedError("the fake model has no hidden states")

    def pooled_to_host(self):
        raise NotImplementedError("the fake model pools nothing")


@dataclass
class FakeWorker:
    """`ModelWorker`'s verbs and facts (jaxrunner/worker/contract.py: WorkerProtocol) over the
    fake model; the features it lacks are None (`lora_registry` too), as on a worker without
    them."""

    # Not dataclass fields: the features a plain dense model's worker has none of.
    model_runner = dllm_plan = expert_recorder = eplb_manager = None
    dp_size = 1

    args: EngineArgs
    num_pages: int
    context_len: int = 2048
    vocab_size: int = VOCAB
    batches: list[ModelWorkerBatch] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)  # the bitmasks asked for, in order
    num_layers: int = 4
    lora_registry: object = None
    # What each launch ran, in order: a batch's mode name, or ("RANGE", end) for a split range.
    events: list = field(default_factory=list)
    split_prefill_ranges: list = field(init=False)  # `args.split_prefill_ranges(num_layers)`

    def __post_init__(self):
        ps = self.args.page_size
        self.req_to_token_pool = ReqToTokenPool(self.args.max_running_requests + 1,
                                                -(-self.context_len // ps))
        self.allocator = PageAllocator(self.num_pages)
        self.kv = np.full(self.num_pages * ps, -1, np.int64)
        self.buckets = all_buckets(self.args.max_prefill_tokens, self.args.max_running_requests)
        if self.args.enable_split_prefill:
            self.buckets += split_prefill_buckets(self.args.max_prefill_tokens,
                                                  self.args.max_running_requests)
        self.rows = max(b.num_reqs for b in self.buckets)
        self.split_prefill_ranges = self.args.split_prefill_ranges(self.num_layers)

    @classmethod
    def create(cls, num_pages: int = 512, **overrides) -> "FakeWorker":
        args = dict(model_path="fake", page_size=4, max_running_requests=8,
                    max_prefill_tokens=64, disable_overlap_schedule=True)
        return cls(EngineArgs(**dict(args, **overrides)), num_pages)

    @property
    def max_total_tokens(self) -> int:
        return (self.num_pages - 1) * self.args.page_size  # the dummy page holds none

    def get_memory_pool(self, dp_rank: int = 0):
        return self.req_to_token_pool, self.allocator

    def forward_batch_dllm(self, batch: ModelWorkerBatch, info):
        raise NotImplementedError("the fake model has no DLLM_EXTEND step")

    def check_device_state(self) -> None:
        """The fake model keeps its KV on the host: nothing to lose."""

    def pick_bucket(self, mode, num_tokens, num_reqs):
        return pick_bucket(self.buckets, executable_mode(mode), num_tokens, num_reqs)

    def begin_split_prefill(self, batch: ModelWorkerBatch, prev: FakeResult | None = None):
        assert batch.forward_mode == ForwardMode.SPLIT_PREFILL
        self.batches.append(batch)
        return FakeSplit(batch, self._input_ids(batch, prev), prev)

    def forward_split_prefill(self, split: "FakeSplit", end: int, vocab_mask_fn=None):
        assert end > split.layers_done, "a range ran twice"
        batch, ps = split.batch, self.args.page_size
        split.layers_done = end
        self.events.append(("RANGE", end))
        n = batch.num_tokens
        real = batch.out_cache_loc[:n] // ps != DUMMY_PAGE
        self.kv[batch.out_cache_loc[:n][real]] = split.ids[:n][real]
        if end < self.num_layers:
            return None
        return self._generate(batch, split.prev, vocab_mask_fn, split.dropped)

    def redirect_split_writes(self, split: "FakeSplit", out_cache_loc: np.ndarray) -> None:
        ps, starts = self.args.page_size, np.cumsum(split.batch.extend_seq_lens)
        split.batch.out_cache_loc = out_cache_loc.copy()
        for i in range(split.batch.num_reqs):
            slots = out_cache_loc[starts[i] - split.batch.extend_seq_lens[i]:starts[i]]
            if (slots // ps == DUMMY_PAGE).all():
                split.dropped.add(i)

    def _input_ids(self, batch: ModelWorkerBatch, prev: FakeResult | None) -> np.ndarray:
        ids = batch.input_ids.astype(np.int64)
        src = batch.input_token_src
        if (src >= 0).any():
            assert prev is not None, "a token on the device, but no step in flight"
            ids = np.where(src >= 0, prev.next_token_ids[np.clip(src, 0, None)], ids)
        return ids

    def forward_batch_generation(self, batch: ModelWorkerBatch, prev: FakeResult | None = None,
                                 vocab_mask_fn=None):
        self.batches.append(batch)
        self.events.append(batch.forward_mode.name)
        return self._generate(batch, prev, vocab_mask_fn)

    def _generate(self, batch: ModelWorkerBatch, prev, vocab_mask_fn, dropped=()):
        """One step; the rows in `dropped` (aborted mid-split, writing the dummy page) get
        token 0."""
        bucket, ps = batch.bucket, self.args.page_size
        T, R, n, r = bucket.num_tokens, bucket.num_reqs, batch.num_tokens, batch.num_reqs
        assert batch.input_ids.shape == (T,) and batch.seq_lens.shape == (R,)
        assert n <= T and r <= R and int(batch.extend_seq_lens.sum()) == n
        assert not batch.seq_lens[r:].any() and not batch.extend_seq_lens[r:].any()
        assert (batch.out_cache_loc[n:] // ps == DUMMY_PAGE).all(), "padding off the dummy page"
        written = batch.out_cache_loc[:n]
        real = written // ps != DUMMY_PAGE
        real_slots = written[real]
        assert len(set(real_slots.tolist())) == len(real_slots), "two tokens write one KV slot"
        assert dropped or real.all(), "a real token writes the dummy page"
        ids = self._input_ids(batch, prev)
        self.kv[real_slots] = ids[:n][real]
        tokens = np.zeros(self.rows, np.int32)
        start = 0
        for i in range(r):
            length, new = int(batch.seq_lens[i]), int(batch.extend_seq_lens[i])
            if i in dropped:
                start += new
                continue
            assert int(batch.extend_prefix_lens[i]) + new == length
            positions = np.arange(length)
            pages = batch.page_table[i][positions // ps]
            assert (pages != DUMMY_PAGE).all(), "a request reads the dummy page"
            seq = self.kv[pages * ps + positions % ps]
            assert (seq >= 0).all(), "a request reads KV that was never written"
            # Its new tokens are the last `new` of what it reads: positions and slots agree.
            assert (seq[length - new:] == ids[start:start + new]).all()
            tokens[i] = next_token(seq)
            start += new
        if vocab_mask_fn is not None:
            mask = vocab_mask_fn()
            self.masks.append(mask)
            bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
            for i in np.flatnonzero(batch.sampling.constrained):
                tokens[i] = masked_token(int(tokens[i]), np.flatnonzero(bits[i]))
        return FakeResult(tokens, np.zeros(self.rows, np.float32), r)


@dataclass
class FakeSplit:
    """The fake's split prefill in progress."""

    batch: ModelWorkerBatch
    ids: np.ndarray
    prev: FakeResult | None
    layers_done: int = 0
    dropped: set = field(default_factory=set)


@dataclass
class FakeSpecRound:
    accept_len: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray


@dataclass
class FakeSpecWorker(FakeWorker):
    """The speculative worker's verbs over the fake model: `speculative_window`, `propose` and
    `forward_batch_speculative`. Each draft is the reference token, or (with probability `miss`)
    a wrong one, so rounds accept a random number of drafts; every slot of the window writes the
    token it holds into the "KV cache", as the target's verify step does, so a page given back
    too early or a slot past the accepted tokens read later changes the output."""

    window: int = 4
    miss: float = 0.3
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        self.buckets = self.buckets + verify_buckets(self.args.max_running_requests, self.window)
        self.rng = np.random.default_rng(self.seed)
        self.rounds = 0

    @property
    def speculative_window(self) -> int:
        return self.window

    def propose(self, reqs):
        return None

    def forward_batch_speculative(self, batch: ModelWorkerBatch, limits, proposal=None):
        """A verify round: each request's window holds its last token and W - 1 drafts."""
        self.batches.append(batch)
        self.rounds += 1
        ps, W, r = self.args.page_size, self.window, batch.num_reqs
        assert batch.bucket.num_tokens == batch.bucket.num_reqs * W
        accept_len = np.zeros(r, np.int32)
        tokens = np.zeros((r, W), np.int32)
        for i in range(r):
            length = int(batch.seq_lens[i])       # the prefix and the window
            prefix = int(batch.extend_prefix_lens[i])
            assert length == prefix + W and int(batch.extend_seq_lens[i]) == W
            positions = np.arange(prefix)
            pages = batch.page_table[i][positions // ps]
            context = self.kv[pages * ps + positions % ps]
            assert (pages != DUMMY_PAGE).all() and (context >= 0).all(), "a lost prefix"
            first = int(batch.input_ids[i * W])
            truth = reference_tokens(list(context) + [first], W)
            drafts = [t if self.rng.random() >= self.miss else (t + 1) % VOCAB
                      for t in truth[:W - 1]]
            slots = batch.out_cache_loc[i * W:(i + 1) * W]
            for token, slot in zip([first] + drafts, slots):
                if slot // ps != DUMMY_PAGE:
                    self.kv[slot] = token
            n = 0
            while n < min(W - 1, limits[i]) and drafts[n] == truth[n]:
                n += 1
            accept_len[i] = n
            tokens[i, :n + 1] = truth[:n + 1]
        return FakeSpecRound(accept_len, tokens, np.zeros((r, W), np.float32))
