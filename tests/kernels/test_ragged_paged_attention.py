"""Every ragged paged attention kernel against the reference, on random ragged batches.

On CPU both kernels run in Pallas interpret mode; on a GPU (TPU) host the GPU (TPU) kernel runs
compiled, which is what scripts/device_check.sh relies on. Unused pages, page tails and padded
sequences are NaN (see tests/support/ragged_cases.py) and must not reach real tokens.

Cases cover each dimension once or twice rather than the full product, to keep the interpreted
suite fast on 2 cores.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import ragged_paged_attention
from tests.support.attention import PALLAS_KERNELS, SMALL_BLOCKS, kernel_runs
from tests.support.ragged_cases import Case, assert_matches_reference, make_inputs

KERNEL_CASES = [
    Case(seqs=((1, 5), (1, 40), (1, 17), (1, 64))),  # decode only, MHA
    Case(seqs=((12, 12), (5, 5), (20, 20)), group=4, head_dim=64),  # prefill only
    Case(seqs=((1, 33), (7, 30), (1, 1), (16, 50)), num_kv_heads=1, group=8),  # mixed, MQA
    Case(seqs=((3, 70), (1, 130), (9, 9)), group=4, page_size=64),  # prefix + big pages
    Case(seqs=((1, 40), (10, 30), (6, 6)), group=4, sliding_window=8),
    Case(seqs=((1, 20), (8, 25)), head_dim=64, soft_cap=5.0, q_scale=6.0),
    Case(seqs=((1, 45), (13, 29), (2, 2)), group=4, dtype="bfloat16"),
    Case(seqs=((5, 90), (1, 70)), group=8, num_kv_heads=1, head_dim=64, page_size=64,
         dtype="bfloat16", sliding_window=20, soft_cap=10.0, q_scale=4.0),
    Case(seqs=((1, 21), (4, 9)), group=3, padded_seqs=2),  # a group that is not a power of 2
    # bfloat16 [K | V] rows of two heads share a 32-bit word (the TPU kernel unpacks them)
    Case(seqs=((1, 37), (6, 22)), group=2, head_dim=64, dtype="bfloat16"),
    # 8-bit caches, float32 q: four rows per 32-bit word, (K_h, V_h, K_h+1, V_h+1) of a token,
    # four packed [K | V] heads, or one packed head.
    Case(seqs=((1, 33), (7, 30), (1, 1), (16, 50)), group=2, kv_dtype="float8_e4m3fn"),
    Case(seqs=((1, 37), (6, 22)), num_kv_heads=4, group=2, head_dim=64, kv_dtype="float8_e5m2"),
    Case(seqs=((5, 90), (1, 70)), group=8, num_kv_heads=1, head_dim=64, page_size=64,
         sliding_window=20, kv_dtype="float8_e4m3fn"),
    # head_dim 256 (Gemma): the TPU kernel reads each row as two 128-lane chunks.
    Case(seqs=((1, 37), (6, 22), (1, 1)), group=2, head_dim=256, dtype="bfloat16"),
    Case(seqs=((5, 40), (1, 70)), group=2, head_dim=256, sliding_window=20, soft_cap=30.0,
         q_scale=4.0, kv_dtype="float8_e4m3fn"),
]


@pytest.mark.parametrize("backend, interpret", kernel_runs())
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_kernel_matches_reference_small_blocks(case, backend, interpret):
    inputs = make_inputs(case, seed=7)
    out = PALLAS_KERNELS[backend](*inputs.args, **inputs.kwargs, block_sizes=SMALL_BLOCKS[backend],
                                  interpret=interpret)
    assert_matches_reference(case, inputs, out)


@pytest.mark.parametrize("backend, interpret", kernel_runs())
@pytest.mark.parametrize("case", [KERNEL_CASES[0], KERNEL_CASES[2], KERNEL_CASES[7]], ids=str)
def test_kernel_matches_reference_tuned_blocks(case, backend, interpret):
    """The public entry point with the block sizes the tuning table/heuristic picks."""
    inputs = make_inputs(case, seed=3)
    out = ragged_paged_attention(*inputs.args, **inputs.kwargs, backend=backend,
                                 interpret=interpret)
    assert_matches_reference(case, inputs, out)


@pytest.mark.parametrize("backend, interpret", kernel_runs())
def test_kernel_with_no_sequences_is_finite(backend, interpret):
    """A fully padded batch (num_seqs == 0) must not read any page nor produce NaN."""
    inputs = make_inputs(Case(seqs=((1, 8),)), seed=0)
    q, kv_cache, kv_lens, page_indices, cu_q_lens, _ = inputs.args
    num_seqs = np.zeros((1,), np.int32)
    out = PALLAS_KERNELS[backend](q, kv_cache, kv_lens, page_indices, cu_q_lens,
                                  jnp.asarray(num_seqs), **inputs.kwargs, interpret=interpret)
    assert np.isfinite(np.asarray(out)).all()


def _random_case(seed: int) -> Case:
    """A random small batch: 1-4 sequences, each decode (1 token) or a chunk with a prefix."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(rng.integers(1, 5)):
        q_len = 1 if rng.random() < 0.5 else int(rng.integers(2, 24))
        seqs.append((q_len, q_len + int(rng.integers(0, 60))))
    return Case(seqs=tuple(seqs), num_kv_heads=int(rng.choice([1, 2])),
                group=int(rng.choice([1, 2, 4])), head_dim=int(rng.choice([64, 128])),
                page_size=int(rng.choice([16, 32])), dtype=str(rng.choice(["float32", "bfloat16"])),
                sliding_window=int(rng.integers(4, 40)) if rng.random() < 0.3 else None,
                padded_seqs=int(rng.integers(0, 3)), padded_tokens=int(rng.integers(0, 5)))


@pytest.mark.parametrize("backend, interpret", kernel_runs())
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_kernel_matches_reference_random_batches(seed, backend, interpret):
    case = _random_case(seed)
    inputs = make_inputs(case, seed=seed)
    out = PALLAS_KERNELS[backend](*inputs.args, **inputs.kwargs, block_sizes=SMALL_BLOCKS[backend],
                                  interpret=interpret)
    assert_matches_reference(case, inputs, out)
