"""`jaxrunner serve` over two local processes (`--nnodes 2`, joined by jax.distributed over gloo,
one TP 4 model on 2 simulated devices each): rank 0 serves HTTP, rank 1 steps in lock-step, and
the answers, streamed and not, carry the tokens of a one-process engine with the same buckets."""

import openai
import pytest

from jaxrunner import Engine
from tests.support.server import MODEL_NAME, ServerProcess, free_port

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 100, 200, 300], list(range(300, 340))]
MAX_TOKENS = 6
# Few buckets: two processes compile them at once.
TWO_HOST_ENGINE = dict(max_total_tokens=1024, max_running_requests=4, max_prefill_tokens=64,
                       context_length=256)


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
    assert leader.stop() == 0
    assert follower.proc.wait(120) == 0, open(follower.log_path).read()[-3000:]
    engine = Engine(model_path=str(model_path), **dict(engine_kwargs, **TWO_HOST_ENGINE))
    want = [o["text"] for o in engine.generate(
        input_ids=PROMPTS, sampling_params={"max_new_tokens": MAX_TOKENS, "temperature": 0.0})]
    engine.shutdown()
    assert got == want and streamed == want
