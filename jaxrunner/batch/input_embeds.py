"""Prompts given as embeddings: `input_embeds` (a whole prompt) and `replace_embeds` at
`replace_positions` (some prompt tokens' embeddings replaced, as multimodal models place image
features), checked and held on the host until their prefill chunk runs.

A request carries an `EmbedOverride`: the prompt positions it replaces and their rows. The
scheduler cuts each prefill chunk's rows out of it (`rows_in`) and the model runner uploads them
in the step's override buffer (jaxrunner/batch/forward_batch.py). A prompt given wholly as
embeddings has placeholder ids (0) that the model never reads.

The prefix cache shares KV by token ids, which are not the content of a replaced token: a
request's tokens before its first replaced position are cached and matched as usual; that
token and everything after it (whose attention saw it) never enter the cache, so neither a
placeholder id nor an embedding is ever matched.

Host-only: no jax here (the scheduler imports it).
"""

from dataclasses import dataclass

import numpy as np

PLACEHOLDER_ID = 0


@dataclass(frozen=True, eq=False)
class EmbedOverride:
    positions: np.ndarray  # i32[k]: replaced prompt positions, ascending, unique
    embeds: np.ndarray     # f32[k, D]: their embeddings

    @property
    def first_position(self) -> int:
        return int(self.positions[0])

    def rows_in(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions in [start, end), their rows): what one prefill chunk replaces."""
        lo, hi = np.searchsorted(self.positions, [start, end])
        return self.positions[lo:hi], self.embeds[lo:hi]


def make_override(embeds, positions, prompt_len: int, hidden_size: int) -> EmbedOverride:
    """Checks embeddings [k, hidden_size] for `positions` (k distinct prompt positions).

    Raises ValueError naming the problem.
    """
    try:
        rows = np.asarray(embeds, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"embeddings must be numbers: {e}") from None
    if rows.ndim != 2 or rows.shape[1] != hidden_size:
        raise ValueError(f"embeddings must have shape [tokens, hidden_size={hidden_size}], got "
                         f"{list(rows.shape)}")
    if not np.isfinite(rows).all():
        raise ValueError("embeddings hold NaN or infinite values")
    pos = np.asarray(positions)
    if pos.ndim != 1 or (pos.size and not np.issubdtype(pos.dtype, np.integer)):
        raise ValueError(f"replace_positions must be a list of ints, got {positions!r}")
    if len(pos) != len(rows):
        raise ValueError(f"{len(rows)} embeddings for {len(pos)} replace_positions")
    if len(pos) == 0:
        raise ValueError("replace_embeds is empty")
    outside = pos[(pos < 0) | (pos >= prompt_len)]
    if len(outside):
        raise ValueError(f"replace_positions must be prompt positions in [0, {prompt_len}), "
                         f"got {int(outside[0])}")
    order = np.argsort(pos, kind="stable")
    pos = pos[order].astype(np.int32)
    repeated = pos[1:][np.diff(pos) == 0]
    if len(repeated):
        raise ValueError(f"replace_positions repeats position {int(repeated[0])}")
    return EmbedOverride(pos, rows[order])


def is_one_matrix(value) -> bool:
    """Whether `input_embeds` is one prompt's [tokens, D] (else a list of them)."""
    if isinstance(value, np.ndarray):
        return value.ndim == 2
    return len(value) > 0 and value[0] is not None and np.ndim(value[0]) == 1


def split_prompts(input_ids, input_embeds) -> tuple[bool, list, list]:
    """(single, ids per request, embeddings per request) when `input_embeds` is given, alone or
    with `input_ids` (two lists, one prompt per request, None where the other has it).

    Raises ValueError for a request with both or neither.
    """
    single = is_one_matrix(input_embeds)
    embeds = [input_embeds] if single else list(input_embeds)
    if input_ids is None:
        ids = [None] * len(embeds)
    elif single or not isinstance(input_ids, list) or len(input_ids) != len(embeds):
        raise ValueError("with both input_ids and input_embeds, give two lists with one entry "
                         "per request (None where the other list has its prompt)")
    else:
        ids = input_ids
    if not embeds:
        raise ValueError("input_embeds is empty")
    for i, (t, e) in enumerate(zip(ids, embeds)):
        if (t is None) == (e is None):
            raise ValueError(f"request {i}: give exactly one of input_ids and input_embeds")
    prompts = [list(t) if e is None else [PLACEHOLDER_ID] * len(e) for t, e in zip(ids, embeds)]
    return single, prompts, embeds
