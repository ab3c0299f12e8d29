import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.batch.buckets import Bucket
from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.batch.forward_mode import ForwardMode
from jaxrunner.batch.schedule_batch import ModelWorkerBatch
from jaxrunner.sampling.batch import SamplingBatch

NO_PREV = jnp.zeros(4, jnp.int32)
NO_EMBEDS = jnp.zeros((4, 8), jnp.float32)


def _worker_batch(mode, prefix_lens, new_lens, T, R, pages=4):
    n = len(new_lens)
    pad = lambda xs: np.array(list(xs) + [0] * (R - n), np.int32)  # noqa: E731
    return ModelWorkerBatch(
        forward_mode=mode, bucket=Bucket(mode, T, R),
        input_token_src=np.full(T, -1, np.int32), num_reqs=n, num_tokens=sum(new_lens),
        input_ids=np.arange(T, dtype=np.int32), out_cache_loc=np.zeros(T, np.int32),
        seq_lens=pad(p + q for p, q in zip(prefix_lens, new_lens)),
        extend_seq_lens=pad(new_lens), extend_prefix_lens=pad(prefix_lens),
        page_table=np.zeros((R, pages), np.int32),
        sampling=SamplingBatch.from_params([], [], [], padded_size=R))


def _prepared(worker_batch, prev_tokens=NO_PREV):
    fb, _ = ForwardBatch.init_new(worker_batch, prev_tokens, NO_EMBEDS)
    return jax.jit(ForwardBatch.prepare)(fb)


def test_extend_positions_continue_each_cached_prefix():
    prefix, new = [0, 5, 3], [4, 2, 3]
    fb = _prepared(_worker_batch(ForwardMode.EXTEND, prefix, new, T=12, R=4))
    assert isinstance(fb.positions, jax.Array)
    assert fb.positions.tolist() == [0, 1, 2, 3, 5, 6, 3, 4, 5, 0, 0, 0]
    assert fb.extend_start_loc.tolist() == [0, 4, 6, 9]
    assert fb.token_to_req.tolist()[:9] == [0, 0, 0, 0, 1, 1, 2, 2, 2]
    assert fb.last_token_indices.tolist()[:3] == [3, 5, 8]


def test_decode_positions_are_seq_len_minus_one():
    seq_lens = [7, 1, 30]
    fb = _prepared(_worker_batch(ForwardMode.DECODE, [s - 1 for s in seq_lens], [1, 1, 1],
                                 T=4, R=4))
    assert fb.positions.tolist()[:3] == [6, 0, 29]
    assert fb.last_token_indices.tolist()[:3] == [0, 1, 2]


def test_forward_batch_is_a_pytree_with_static_mode_and_derived_fields_unset():
    fb, _ = ForwardBatch.init_new(_worker_batch(ForwardMode.EXTEND, [0], [3], T=4, R=1), NO_PREV,
                                 NO_EMBEDS)
    leaves, treedef = jax.tree.flatten(fb)
    # The step's inputs only: positions and the like are computed inside the step, so every
    # call of a bucket has this one structure. The batch's own arrays stay on the host (the
    # executable moves them); what the runner keeps on the device (previous samples, the
    # override rows) is passed through.
    assert len(leaves) == 11
    assert all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)
    assert isinstance(fb.input_ids, np.ndarray) and fb.prev_tokens is NO_PREV
    assert fb.positions is None and fb.token_to_req is None
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.forward_mode == ForwardMode.EXTEND and rebuilt.batch_size == 1
    decode_fb, _ = ForwardBatch.init_new(_worker_batch(ForwardMode.DECODE, [2], [1], T=1, R=1),
                                         NO_PREV, NO_EMBEDS)
    assert jax.tree.structure(decode_fb) != jax.tree.structure(ForwardBatch.init_new(
        _worker_batch(ForwardMode.EXTEND, [2], [1], T=1, R=1), NO_PREV, NO_EMBEDS)[0])


def test_tokens_still_on_the_device_come_from_the_previous_steps_samples():
    wb = _worker_batch(ForwardMode.DECODE, [4, 9], [1, 1], T=2, R=2)
    wb.input_ids[:] = [11, 0]
    wb.input_token_src[:] = [-1, 3]  # request 1's token is row 3 of the previous step
    fb = _prepared(wb, jax.device_put(np.array([5, 6, 7, 8], np.int32)))
    assert fb.input_ids.tolist() == [11, 8]
