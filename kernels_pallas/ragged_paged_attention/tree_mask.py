"""The tree-attention mask of a speculative verify step (`kv_tree_mask`), shared by every kernel.

A verify step of a draft tree computes W tree tokens per request; they occupy the last W KV slots
of the request (its new tokens: positions kv_len - q_len .. kv_len - 1, in tree order, parents
before children). A tree token sees the whole prefix and, of the tree, only its ancestors and
itself. `kv_tree_mask` says which: i32[T, NW] rows of 32-bit words, bit j (word j // 32, bit
j % 32) set when the token sees the request's j-th new token. Keys before the request's new tokens
keep the causal (or `kv_bound`) rule; the tree rule is ANDed with it, so a tree laid out parents
first needs nothing else. New tokens past 32 * NW are invisible.
"""

import jax
import jax.numpy as jnp
from jax import lax

MAX_TREE_WORDS = 2  # W <= 64 tree tokens per request


def check_tree_mask(tree_mask, num_tokens: int) -> None:
    """Raises ValueError unless `tree_mask` is i32[num_tokens, NW] with 1 <= NW <= 2."""
    if tree_mask is None:
        return
    if (tree_mask.ndim != 2 or tree_mask.shape[0] != num_tokens
            or not 1 <= tree_mask.shape[1] <= MAX_TREE_WORDS
            or tree_mask.dtype != jnp.int32):
        raise ValueError(f"kv_tree_mask must be i32[num_tokens, NW] = i32[{num_tokens}, 1 or "
                         f"{MAX_TREE_WORDS}], got {tree_mask.dtype}{list(tree_mask.shape)}")


def tree_visible(words, rel):
    """bool of rel's shape: whether a row sees the key `rel` slots after its request's first new
    token (rel < 0: a prefix key, always). `words`: the row's mask words, one array per word
    that broadcasts against rel[..., K] (e.g. [..., 1]; a sequence, so a kernel can load each
    word whole: Triton has no lane slices)."""
    bits = jnp.zeros(rel.shape, jnp.int32)
    word_of_key = rel >> 5
    for w, word in enumerate(words):  # static: one or two words
        bits = jnp.where(word_of_key == w, word, bits)
    in_tree = (rel >= 0) & (rel < 32 * len(words))
    bit = lax.shift_right_logical(bits, jnp.where(in_tree, rel & 31, 0)) & 1
    return (rel < 0) | (in_tree & (bit != 0))


def word_columns(words) -> list:
    """i32[..., NW] -> NW arrays i32[..., 1]: `tree_visible`'s words of jnp arrays."""
    return [words[..., w:w + 1] for w in range(words.shape[-1])]


def pack_tree_mask(visible) -> jax.Array:
    """bool[T, W] (token t sees its request's new token j) -> i32[T, ceil(W / 32)] words."""
    T, W = visible.shape
    num_words = -(-W // 32)
    padded = jnp.pad(visible, ((0, 0), (0, 32 * num_words - W))).reshape(T, num_words, 32)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
    words = jnp.sum(jnp.where(padded, weights, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)
    return lax.bitcast_convert_type(words, jnp.int32)
