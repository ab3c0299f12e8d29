"""SGLang's `meta_info` (jaxrunner/engine/output.py), which the offline engine and the server's
`/generate` both build through `meta_info`: the fields of every chunk, those of a finished
request only, and the logprob lists."""

from jaxrunner.engine.output import Logprobs, generate_answer, meta_info

PROMPT = [5, 6, 7, 8]


def _meta(finish_reason=None, **kwargs):
    return meta_info(12, PROMPT, [9, 10], finish_reason, cached_tokens=3,
                     weight_version="v1", **kwargs)


def test_every_chunk_carries_the_counts_and_a_finished_one_its_totals():
    running = _meta(spec_verify_ct=2, e2e_latency=0.5)
    assert running == {"id": "12", "finish_reason": None, "prompt_tokens": 4,
                       "completion_tokens": 2, "cached_tokens": 3, "weight_version": "v1"}
    done = _meta({"type": "length", "length": 2}, spec_verify_ct=2, e2e_latency=0.5)
    assert done == dict(running, finish_reason={"type": "length", "length": 2},
                        spec_verify_ct=2, e2e_latency=0.5)
    assert "spec_verify_ct" not in _meta({"type": "abort"})  # not speculative


def test_logprob_lists():
    tops = [[(-0.1, 9), (-2.0, 4)], [(-0.2, 10), (-1.9, 3)]]
    logprobs = Logprobs([-0.1, -0.2], tops, start=1,
                        input=[None, -1.0, -1.5, -2.5],
                        input_top=[None, [(-1.0, 6)], [(-1.5, 7)], [(-2.5, 8)]])
    meta = _meta(logprobs=logprobs, token_text=lambda t: f"<{t}>")
    assert meta["output_token_logprobs"] == [(-0.1, 9, "<9>"), (-0.2, 10, "<10>")]
    assert meta["output_top_logprobs"][1] == [(-0.2, 10, "<10>"), (-1.9, 3, "<3>")]
    assert meta["input_token_logprobs"] == [(-1.0, 6, "<6>"), (-1.5, 7, "<7>"),
                                            (-2.5, 8, "<8>")]
    assert meta["input_top_logprobs"][0] == [(-1.0, 6, "<6>")]


def test_logprobs_not_asked_for_or_not_computed():
    assert "output_token_logprobs" not in _meta()
    no_prompt = _meta(logprobs=Logprobs([-0.1, -0.2], None, start=-1))
    assert set(no_prompt) - set(_meta()) == {"output_token_logprobs"}
    assert no_prompt["output_token_logprobs"] == [(-0.1, 9, None), (-0.2, 10, None)]
    # The prompt never ran (aborted while queued): its entries are None.
    queued = _meta({"type": "abort"}, logprobs=Logprobs([], [], start=2))
    assert queued["input_token_logprobs"] == [(None, 7, None), (None, 8, None)]
    assert queued["input_top_logprobs"] == [None, None]


def test_generate_answer():
    meta = _meta()
    assert generate_answer((9, 10), meta, "hi") == {"output_ids": [9, 10], "meta_info": meta,
                                                   "text": "hi"}
    assert "text" not in generate_answer([9, 10], meta, None)
