"""Requests aborted between speculative rounds (NGRAM drafts, so rounds accept several tokens),
at random points of their generation: the others keep the tokens they get without the aborts,
each aborted one ends with "abort" and the tokens it had, and no page or request slot leaks."""

import random

from jaxrunner import Engine

# The shapes of tests/speculative/test_speculative.py's engines: their executables are cached.
SPEC_ENGINE = dict(max_running_requests=4, max_prefill_tokens=32, max_total_tokens=8192)


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase: n-gram drafts get accepted."""
    rng = random.Random(seed)
    return [[rng.randrange(8, 1000) for _ in range(rng.randrange(3, 8))] * rng.randrange(2, 6)
            for _ in range(n)]


def test_aborts_between_rounds_leave_the_others_exact_and_free_every_page(
        checkpoint, engine_kwargs):
    engine = Engine(model_path=str(checkpoint("tiny-llama")),
                    **dict(engine_kwargs, **SPEC_ENGINE), speculative_algorithm="NGRAM",
                    speculative_num_steps=3)
    try:
        prompts = _prompts(12, seed=0)
        params = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
        want = [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                         sampling_params=params)]
        assert engine.flush_cache()
        rng = random.Random(1)
        reqs = [engine.add_request(p, params) for p in prompts]
        abort_at = {i: rng.randrange(1, 30) for i in rng.sample(range(len(reqs)), 6)}
        step = 0
        while engine.has_unfinished_requests:
            engine.step()
            step += 1
            for i, at in abort_at.items():
                if at == step:
                    engine.abort_request(reqs[i])
        mid = 0
        for i, (req, tokens) in enumerate(zip(reqs, want)):
            if i not in abort_at or req.finished_reason["type"] == "length":
                assert req.output_ids == tokens, f"request {i}"
                continue
            assert req.finished_reason["type"] == "abort"
            assert req.output_ids == tokens[:len(req.output_ids)]
            mid += 0 < len(req.output_ids) < len(tokens)
        assert mid >= 2, "no request was aborted in the middle of its rounds"
        assert engine.flush_cache()
        stats = engine.memory_stats()
        assert stats["kv_pages_free"] == stats["kv_pages_total"]
        assert stats["req_slots_free"] == stats["req_slots_total"]
    finally:
        engine.shutdown()
