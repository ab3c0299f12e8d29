"""What kind of step the model runs, with SGLang's names and predicates.

`ForwardMode` decides which executable a batch replays and how positions and attention metadata
are computed; `CaptureHiddenMode` says which hidden states a step returns (for speculative
decoding's draft model).
"""

from enum import IntEnum, auto


class ForwardMode(IntEnum):
    EXTEND = auto()         # prefill, possibly on top of a cached prefix
    DECODE = auto()         # one new token per request
    MIXED = auto()          # a prefill chunk with running decode requests riding along
    IDLE = auto()           # no work on this data-parallel rank; runs only to keep ranks in step
    TARGET_VERIFY = auto()  # speculative decoding: the target model checks draft tokens
    DRAFT_EXTEND = auto()   # speculative decoding: the draft model extends after verification
    SPLIT_PREFILL = auto()  # a prefill split over several steps (PD multiplexing)
    DLLM_EXTEND = auto()    # diffusion LLM block extend

    def is_extend(self) -> bool:
        """Every mode whose tokens are laid out as ragged per-request chunks."""
        return self in _EXTEND_MODES

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND

    def is_split_prefill(self) -> bool:
        return self == ForwardMode.SPLIT_PREFILL

    def is_dllm_extend(self) -> bool:
        return self == ForwardMode.DLLM_EXTEND

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_batch_size_bucketed(self) -> bool:
        """The analogue of SGLang's `is_cuda_graph`: modes whose executable is chosen by the
        padded batch size alone (a fixed number of tokens per request), where SGLang would
        replay a captured CUDA graph."""
        return self in _BATCH_SIZE_BUCKETED_MODES

    # SGLang's name for the same predicate, kept so code ported from SGLang reads the same.
    is_cuda_graph = is_batch_size_bucketed


_EXTEND_MODES = frozenset({
    ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND, ForwardMode.TARGET_VERIFY,
    ForwardMode.SPLIT_PREFILL, ForwardMode.DLLM_EXTEND,
})
_BATCH_SIZE_BUCKETED_MODES = frozenset({
    ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE, ForwardMode.DLLM_EXTEND,
})


class CaptureHiddenMode(IntEnum):
    NULL = 0  # return no hidden states
    LAST = 1  # the last token's hidden state of each request
    FULL = 2  # every token's hidden state

    def need_capture(self) -> bool:
        return self != CaptureHiddenMode.NULL

    def is_last(self) -> bool:
        return self == CaptureHiddenMode.LAST

    def is_full(self) -> bool:
        return self == CaptureHiddenMode.FULL
