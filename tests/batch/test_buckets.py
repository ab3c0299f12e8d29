import pytest

from jaxrunner.batch.buckets import (
    Bucket,
    all_buckets,
    decode_buckets,
    extend_buckets,
    pick_bucket,
    sample_batch_sizes,
)
from jaxrunner.batch.forward_mode import ForwardMode


def test_decode_buckets_pad_by_under_8_rows_to_64_and_under_a_quarter_past():
    assert [b.num_reqs for b in decode_buckets(48)] == [2, 4, 8, 16, 24, 32, 40, 48]
    assert [b.num_reqs for b in decode_buckets(160)] == [
        2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160]
    assert [b.num_reqs for b in decode_buckets(100)][-2:] == [96, 100]
    assert all(b.num_tokens == b.num_reqs for b in decode_buckets(48))
    buckets = decode_buckets(512)
    for batch in range(9, 513):
        padded = pick_bucket(buckets, ForwardMode.DECODE, batch, batch).num_reqs
        assert (padded - batch < 8) if batch <= 64 else (padded < batch * 1.25), (batch, padded)
    # A lone request decodes in a bucket of 2 (see MIN_DECODE_BATCH).
    assert [b.num_reqs for b in decode_buckets(1)] == [2]


def test_extend_buckets_cover_every_token_and_request_count():
    buckets = extend_buckets(max_prefill_tokens=300, max_running_requests=20)
    assert sorted({b.num_tokens for b in buckets}) == [32, 48, 64, 96, 128, 192, 256, 300]
    for tokens in range(1, 301):
        for reqs in range(1, min(tokens, 20) + 1):
            b = pick_bucket(buckets, ForwardMode.EXTEND, tokens, reqs)
            assert b.num_tokens >= tokens and b.num_reqs >= reqs
    assert all(b.num_reqs <= min(b.num_tokens, 20) for b in buckets)


def test_pick_bucket_takes_the_smallest_fit():
    buckets = all_buckets(512, 64)
    assert pick_bucket(buckets, ForwardMode.DECODE, 5, 5) == Bucket(ForwardMode.DECODE, 8, 8)
    assert pick_bucket(buckets, ForwardMode.DECODE, 1, 1) == Bucket(ForwardMode.DECODE, 2, 2)
    assert pick_bucket(buckets, ForwardMode.EXTEND, 33, 2) == Bucket(ForwardMode.EXTEND, 48, 2)
    assert pick_bucket(buckets, ForwardMode.EXTEND, 97, 9) == Bucket(ForwardMode.EXTEND, 128, 64)
    with pytest.raises(ValueError, match="no EXTEND bucket"):
        pick_bucket(buckets, ForwardMode.EXTEND, 513, 1)
    with pytest.raises(ValueError, match="no DECODE bucket"):
        pick_bucket(buckets, ForwardMode.DECODE, 65, 65)


def test_sampler_is_compiled_for_every_request_count():
    buckets = all_buckets(128, 8)
    assert sample_batch_sizes(buckets) == sorted({b.num_reqs for b in buckets})


def test_decode_bucket_has_one_token_per_request():
    with pytest.raises(ValueError):
        Bucket(ForwardMode.DECODE, 8, 4)
