"""The padded shapes the engine compiles, in one place.

Every batch is padded to a `Bucket` before it reaches the device; the model runner compiles one
executable per bucket at start-up and looks it up at run time (a miss is a bug, not a compile).
Decode buckets are keyed by the padded batch size (SGLang's CUDA-graph batch sizes); extend
buckets by padded token count and padded request count.
"""

from dataclasses import dataclass

from jaxrunner.batch.forward_mode import ForwardMode

MIN_EXTEND_TOKENS = 32
# Request counts of extend buckets: 2, 8, 64, 512, ... (8x), capped by the token count and the
# running requests. Few requests per prefill step is the common case, and each extra size is one
# more executable to compile at start-up per token size (~0.5 s on a 2-core CPU), while a padded
# request row costs only its LM-head and sampler row (about 0.2 ms of a 256-token prefill's 80 ms
# for the small model there). The smallest is 2, not 1, so every request count an extend step
# has is also a decode batch size and the sampler needs no executable of its own for it.
MIN_EXTEND_REQS = 2
EXTEND_REQS_GROWTH = 8


@dataclass(frozen=True, order=True)
class Bucket:
    """The static shape of one compiled step."""

    mode: ForwardMode     # DECODE, EXTEND, or a speculative mode
    num_tokens: int       # padded token count T
    num_reqs: int         # padded request count R

    def __post_init__(self):
        if self.mode == ForwardMode.DECODE and self.num_tokens != self.num_reqs:
            raise ValueError(f"a decode bucket has one token per request, got {self}")
        if self.mode.is_batch_size_bucketed() and self.num_tokens % self.num_reqs:
            raise ValueError(f"a {self.mode.name} bucket has a fixed token count per request, "
                             f"got {self}")


def _extend_reqs(hi: int) -> list[int]:
    """2, 8, 64, 512, ... below `hi`, then `hi` itself."""
    sizes, size = [], MIN_EXTEND_REQS
    while size < hi:
        sizes.append(size)
        size = 8 if size == MIN_EXTEND_REQS else size * EXTEND_REQS_GROWTH
    sizes.append(hi)
    return sizes


# The smallest decode bucket. With one token, XLA turns the KV-cache scatter into a bounds-checked
# dynamic-update-slice that reads the old slot, and then copies every layer's whole cache each
# step (seen on CPU: 600 ms instead of 10 ms). A padding row is far cheaper.
MIN_DECODE_BATCH = 2


# Decode batch sizes past 16 grow by a step of DECODE_STEP rows, doubled whenever the size
# reaches 8 steps (16, 24, ..., 64, 80, ..., 128, 160, ...): a batch pads by fewer than 8 rows
# up to 64 and by less than a quarter past it. A decode step costs about its padded row count;
# with powers of two a batch of 33 ran as 64.
DECODE_STEP = 8


def _decode_sizes(top: int) -> list[int]:
    sizes, size, step = [], MIN_DECODE_BATCH, DECODE_STEP
    while size < min(top, 16):
        sizes.append(size)
        size *= 2
    while size < top:
        sizes.append(size)
        if size >= 8 * step:
            step *= 2
        size += step
    return sizes + [top]


def decode_buckets(max_running_requests: int) -> list[Bucket]:
    """Batch sizes 2, 4, 8, 16, 24, ..., 64, 80, ... up to `max_running_requests` (at least 2)."""
    top = max(MIN_DECODE_BATCH, max_running_requests)
    return [Bucket(ForwardMode.DECODE, b, b) for b in _decode_sizes(top)]


def _token_sizes(lo: int, hi: int) -> list[int]:
    """32, 48, 64, 96, 128, 192, ... up to `hi`: powers of two and the sizes 1.5x above them,
    so a prefill step (which costs about its padded token count) pads by a third at most."""
    sizes, size = {hi}, lo
    while size < hi:
        sizes.update((size, size * 3 // 2))
        size *= 2
    return sorted(s for s in sizes if s <= hi)


def extend_buckets(max_prefill_tokens: int, max_running_requests: int) -> list[Bucket]:
    """Token counts 32, 48, 64, 96, ... up to `max_prefill_tokens`, each with request counts
    2, 8, 64, ... up to min(tokens, max_running_requests)."""
    token_sizes = _token_sizes(min(MIN_EXTEND_TOKENS, max_prefill_tokens), max_prefill_tokens)
    buckets = []
    for tokens in token_sizes:
        max_reqs = max(MIN_EXTEND_REQS, min(tokens, max_running_requests))
        for reqs in _extend_reqs(max_reqs):
            buckets.append(Bucket(ForwardMode.EXTEND, tokens, reqs))
    return buckets


def verify_buckets(max_running_requests: int, window: int,
                   mode: ForwardMode = ForwardMode.TARGET_VERIFY) -> list[Bucket]:
    """Speculative steps of `window` tokens per request (TARGET_VERIFY, DRAFT_EXTEND), at the
    decode batch sizes."""
    return [Bucket(mode, b.num_reqs * window, b.num_reqs)
            for b in decode_buckets(max_running_requests)]


def split_prefill_buckets(max_prefill_tokens: int, max_running_requests: int) -> list[Bucket]:
    """A split prefill's range step at every prefill bucket's shape (the layer range is data)."""
    return [Bucket(ForwardMode.SPLIT_PREFILL, b.num_tokens, b.num_reqs)
            for b in extend_buckets(max_prefill_tokens, max_running_requests)]


def all_buckets(max_prefill_tokens: int, max_running_requests: int) -> list[Bucket]:
    return (decode_buckets(max_running_requests)
            + extend_buckets(max_prefill_tokens, max_running_requests))


def executable_mode(mode: ForwardMode) -> ForwardMode:
    """The bucket family a batch of `mode` runs in: DECODE, or EXTEND for EXTEND and MIXED (a
    MIXED batch's decode rows are one-token chunks)."""
    if mode.is_decode():
        return ForwardMode.DECODE
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        return ForwardMode.EXTEND
    if mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND, ForwardMode.SPLIT_PREFILL,
                ForwardMode.DLLM_EXTEND):
        return mode
    raise ValueError(f"forward mode {mode.name} has no buckets")


def pick_bucket(buckets: list[Bucket], mode: ForwardMode, num_tokens: int, num_reqs: int) -> Bucket:
    """The smallest bucket of `mode` that holds the batch (fewest padded tokens, then requests)."""
    fitting = [b for b in buckets
               if b.mode == mode and b.num_tokens >= num_tokens and b.num_reqs >= num_reqs]
    if not fitting:
        raise ValueError(f"no {mode.name} bucket holds {num_tokens} tokens and {num_reqs} requests")
    return min(fitting, key=lambda b: (b.num_tokens, b.num_reqs))


def sample_batch_sizes(buckets: list[Bucket]) -> list[int]:
    """The padded request counts the sampler is compiled for."""
    return sorted({b.num_reqs for b in buckets})
