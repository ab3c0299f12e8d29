"""`jaxrunner serve` over two local processes (`--nnodes 2`, joined by jax.distributed over gloo,
one TP 4 model on 2 simulated devices each): rank 0 serves HTTP, rank 1 steps in lock-step, and
the answers, streamed and not, carry the tokens of a one-process engine with the same buckets;
the lifecycle routes reach both ranks; `/generate` answers as the engine does."""

import httpx
import openai
import pytest

from jaxrunner import Engine
from tests.support.server import MODEL_NAME, ServerProcess, free_port

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 100, 200, 300], list(range(300, 340))]
MAX_TOKENS = 6
# Few buckets: two processes compile them at once.
TWO_HOST_ENGINE = dict(max_total_tokens=1024, max_running_requests=4, max_prefill_tokens=64,
                       context_length=256)
LOGPROBS = dict(return_logprob=True, top_logprobs_num=2, logprob_start_len=0,
                sampling_params={"max_new_tokens": MAX_TOKENS, "temperature": 0.0})


@pytest.fixture(scope="module")
def two_process_server(model_path, engine_kwargs, tmp_path_factory):
    addr = f"127.0.0.1:{free_port()}"
    logs = tmp_path_factory.mktemp("multihost")
    kwargs = dict(engine_kwargs, **TWO_HOST_ENGINE, tp_size=4, nnodes=2, dist_init_addr=addr)
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    procs = [ServerProcess(model_path, dict(kwargs, node_rank=rank), logs / f"rank{rank}.log",
                           env=env) for rank in (0, 1)]
    try:
        procs[0].wait_ready(timeout=900)
        assert procs[1].proc.poll() is None, open(procs[1].log_path).read()[-3000:]
        yield procs
    finally:
        for p in procs:  # rank 0 first: its shutdown releases rank 1
            p.stop()


def test_two_processes_serve_the_tokens_of_one(two_process_server, model_path, engine_kwargs):
    leader, follower = two_process_server
    client = openai.OpenAI(base_url=leader.url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    got, streamed = [], []
    for ids in PROMPTS:
        r = client.completions.create(model=MODEL_NAME, prompt=ids, temperature=0.0,
                                      max_tokens=MAX_TOKENS)
        got.append(r.choices[0].text)
        chunks = client.completions.create(model=MODEL_NAME, prompt=ids, temperature=0.0,
                                           max_tokens=MAX_TOKENS, stream=True)
        streamed.append("".join(c.choices[0].text for c in chunks if c.choices))
    assert leader.info()["engine_args"]["nnodes"] == 2
    # The lifecycle routes run on both ranks (a reload of the same weights, a flush), and the
    # hosts still compute the same.
    reload = httpx.post(leader.url + "/update_weights_from_disk", timeout=300,
                        json={"model_path": str(model_path), "weight_version": "reloaded"})
    assert reload.json()["success"], reload.text
    assert httpx.post(leader.url + "/flush_cache", timeout=60).status_code == 200
    gen = httpx.post(leader.url + "/generate", json=dict(input_ids=PROMPTS[1], **LOGPROBS),
                     timeout=300).json()
    assert leader.stop() == 0
    assert follower.proc.wait(120) == 0, open(follower.log_path).read()[-3000:]
    engine = Engine(model_path=str(model_path), **dict(engine_kwargs, **TWO_HOST_ENGINE))
    want = [o["text"] for o in engine.generate(
        input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_TOKENS, "temperature": 0.0})]
    want_gen = engine.generate(input_ids=PROMPTS[1], **LOGPROBS)
    engine.shutdown()
    assert got == want and streamed == want
    _check_same_answer(gen, want_gen)


def _check_same_answer(served: dict, offline: dict) -> None:
    """`/generate`'s answer is the engine's (jaxrunner/engine/output.py builds both), but for
    the server's `e2e_latency`, the request ids and the weight version set by the reload."""
    meta, want = served["meta_info"], offline["meta_info"]
    assert set(meta) == set(want) | {"e2e_latency"}
    assert served["output_ids"] == offline["output_ids"] and served["text"] == offline["text"]
    assert meta["weight_version"] == "reloaded" and want["weight_version"] == "default"
    for key in ("finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"):
        assert meta[key] == want[key], key
    for key in ("output_token_logprobs", "input_token_logprobs"):
        got_lps, want_lps = meta[key], want[key]
        assert [e[1:] for e in got_lps] == [list(e[1:]) for e in want_lps]  # JSON: lists
        assert [e[0] for e in got_lps] == pytest.approx([e[0] for e in want_lps], abs=1e-4)
    assert [[t[1] for t in top] for top in meta["output_top_logprobs"]] == \
        [[t[1] for t in top] for top in want["output_top_logprobs"]]
