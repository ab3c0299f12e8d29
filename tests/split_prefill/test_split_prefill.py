"""Split prefill end to end on tiny-llama: greedy tokens equal plain prefill's for ragged
requests arriving while others decode (overlap on), no compile after warm-up, no executable
copies the KV cache, abort mid-split, every page free."""

import numpy as np
import pytest

from jaxrunner import Engine
from tests.support.engine import CompileCounter, all_pages_free, assert_no_kv_cache_copy

GREEDY = {"temperature": 0.0, "ignore_eos": True}
VOCAB = 1024  # the tiny models'
_rng = np.random.default_rng(0)
# 16 ragged requests: four start decoding, twelve arrive meanwhile.
RAGGED = [(_rng.integers(3, VOCAB, size=int(_rng.integers(1, 400))).tolist(),
           24 if i < 4 else int(_rng.integers(1, 24))) for i in range(16)]
# A split of three requests, one of them aborted mid-split, beside a running one.
ABORT = [(_rng.integers(3, VOCAB, size=n).tolist(), 12) for n in (5, 150, 90, 120)]


@pytest.fixture(scope="module")
def plain_tokens(checkpoint, engine_kwargs):
    """The reference: each request's greedy tokens without split prefill, alone (test_engine's
    engine settings, so the executable cache has them), shut down before the split engine
    starts: one engine's memory at a time."""
    engine = Engine(model_path=str(checkpoint("tiny-llama")), **engine_kwargs)
    try:
        return {tuple(p): engine.generate(input_ids=p, sampling_params=dict(
                    GREEDY, max_new_tokens=n))["output_ids"] for p, n in RAGGED + ABORT}
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def split(checkpoint, engine_kwargs, plain_tokens):
    engine = Engine(model_path=str(checkpoint("tiny-llama")), **engine_kwargs,
                    enable_split_prefill=True, split_prefill_layers=1)
    ranges = []
    launch = engine.worker.forward_split_prefill

    def counted(state, end, *args, **kwargs):
        ranges.append(end)
        return launch(state, end, *args, **kwargs)

    engine.worker.forward_split_prefill = counted
    engine.ranges = ranges
    yield engine
    engine.shutdown()


def _run(engine, reqs):
    while engine.has_unfinished_requests:
        engine.step()
    return [r.output_ids for r in reqs]


def test_split_prefill_gives_plain_prefills_greedy_tokens_without_compiling(split,
                                                                            plain_tokens):
    assert split.model_config.vocab_size == VOCAB
    with CompileCounter() as counter:
        reqs = [split.add_request(p, dict(GREEDY, max_new_tokens=n)) for p, n in RAGGED[:4]]
        while len(split.scheduler.running) < 4:
            split.step()
        split.step()
        reqs += [split.add_request(p, dict(GREEDY, max_new_tokens=n)) for p, n in RAGGED[4:]]
        got = _run(split, reqs)
    assert counter.count == 0, f"{counter.count} compiles after warm-up"
    # Both layers of tiny-llama, a range each, for several batches.
    assert split.ranges.count(2) >= 2 and split.ranges.count(1) == split.ranges.count(2)
    assert got == [plain_tokens[tuple(p)] for p, _ in RAGGED]
    assert all_pages_free(split)


def test_abort_mid_split_leaves_the_others_exact_and_frees_every_page(split, plain_tokens):
    params = dict(GREEDY, max_new_tokens=12)
    with CompileCounter() as counter:
        first = split.add_request(ABORT[0][0], params)
        while not split.scheduler.running:
            split.step()
        others = [split.add_request(p, params) for p, _ in ABORT[1:]]
        while not split.scheduler.split_prefill.in_progress:
            split.step()
        victim = next(r for r in others if r in split.scheduler.split_prefill.reqs)
        split.abort_request(victim)
        _run(split, [first] + others)
    assert counter.count == 0
    assert victim.finished_reason["type"] == "abort" and victim.output_ids == []
    for req in [first] + others:
        if req is not victim:
            assert req.output_ids == plain_tokens[tuple(req.origin_input_ids)]
    assert all_pages_free(split)


def test_no_split_prefill_executable_copies_the_kv_cache(split):
    assert any(bucket.mode.is_split_prefill() for bucket, _ in split.runner.executables)
    assert_no_kv_cache_copy(split.runner)
