"""Many concurrent streaming clients, clients that vanish mid-request, and /metrics agreeing with
what was sent. Every KV page is free once the traffic is over."""

import asyncio
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import MODEL_NAME, wait_all_pages_free

NUM_PROMPTS = 16
PROMPTS = [f"Request number {i}: tell me about item {i * 7}" for i in range(NUM_PROMPTS)]


def _max_tokens(p: int) -> int:
    return 4 + p % 8


def _metrics(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"[{v}]" for _, v in sorted(s.labels.items()))
            values[key] = s.value
    return values


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


def _references(server) -> list[str]:
    """Greedy text of every prompt, in one batched /generate call."""
    r = httpx.post(server.url + "/generate", timeout=120, json={
        "text": PROMPTS,
        "sampling_params": [{"max_new_tokens": _max_tokens(p), "temperature": 0.0,
                             "ignore_eos": True} for p in range(NUM_PROMPTS)]})
    assert r.status_code == 200, r.text
    return [out["text"] for out in r.json()]


def test_64_concurrent_streaming_clients(server):
    refs = _references(server)
    before = _metrics(server)
    clients, per_client = 64, 3

    async def one_client(c: int, api: openai.AsyncOpenAI):
        results = []
        for k in range(per_client):
            p = (c + k) % NUM_PROMPTS
            stream = await api.completions.create(
                model=MODEL_NAME, prompt=PROMPTS[p], max_tokens=_max_tokens(p), temperature=0.0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            text, finishes, usage = "", [], None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    text += choice.text
                    if choice.finish_reason is not None:
                        finishes.append(choice.finish_reason)
            results.append((p, text, finishes, usage.completion_tokens))
        return results

    async def main():
        api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                 timeout=300,
                                 http_client=openai.DefaultAsyncHttpxClient(
                                     limits=httpx.Limits(max_connections=clients)))
        async with api:
            return await asyncio.gather(*(one_client(c, api) for c in range(clients)))

    t0 = time.monotonic()
    per_client_results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    results = [r for rs in per_client_results for r in rs]
    assert len(results) == clients * per_client
    for p, text, finishes, completion_tokens in results:
        assert finishes == ["length"]                  # exactly one end per request
        assert completion_tokens == _max_tokens(p)     # no token lost or repeated
        assert text == refs[p]
    after = _metrics(server)
    n = clients * per_client
    assert _delta(after, before, "jaxrunner_requests_total[length]") == n
    assert _delta(after, before, "jaxrunner_http_requests_total[/v1/completions][200]") == n
    assert _delta(after, before, "jaxrunner_generation_tokens_total") == \
        sum(_max_tokens(p) for p, *_ in results)
    assert _delta(after, before, "jaxrunner_time_to_first_token_seconds_count") == n
    assert _delta(after, before, "jaxrunner_inter_token_latency_seconds_count") == \
        sum(_max_tokens(p) - 1 for p, *_ in results)
    info = wait_all_pages_free(server)
    assert info["kv_pages_free"] == info["kv_pages_total"], info
    assert info["num_requests_waiting"] == 0 and info["num_requests_running"] == 0
    print(f"{n} streamed requests from {clients} clients in {elapsed:.1f}s")


def test_clients_that_disconnect_free_their_pages(server):
    before = _metrics(server)
    long = {"model": MODEL_NAME, "prompt": "Keep going", "max_tokens": 2000,
            "temperature": 0.0, "ignore_eos": True}
    # Streaming clients read a little and hang up.
    for _ in range(6):
        with httpx.stream("POST", server.url + "/v1/completions", json=dict(long, stream=True),
                          timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    # A non-streaming client gives up waiting.
    try:
        httpx.post(server.url + "/v1/completions", json=long, timeout=0.5)
    except httpx.TimeoutException:
        pass
    # Left alone, 2000 tokens would take far longer than this.
    t0 = time.monotonic()
    info = wait_all_pages_free(server, timeout=5.0)
    assert info["kv_pages_free"] == info["kv_pages_total"], info
    assert info["req_slots_free"] == info["req_slots_total"], info
    after = _metrics(server)
    assert _delta(after, before, "jaxrunner_requests_total[abort]") == 7
    assert _delta(after, before, "jaxrunner_requests_total[length]") == 0
    print(f"pages free {time.monotonic() - t0:.2f}s after the last disconnect")


def test_metrics_count_what_was_sent(server, client):
    before = _metrics(server)
    for _ in range(3):
        client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=5, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                   max_tokens=5, temperature=0.0, n=2,
                                   extra_body={"ignore_eos": True})
    httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0})
    after = _metrics(server)
    assert _delta(after, before, "jaxrunner_requests_total[length]") == 5
    assert _delta(after, before, "jaxrunner_generation_tokens_total") == 25
    assert _delta(after, before, "jaxrunner_http_requests_total[/v1/completions][200]") == 3
    assert _delta(after, before, "jaxrunner_http_requests_total[/v1/chat/completions][200]") == 1
    assert _delta(after, before, "jaxrunner_http_requests_total[/v1/completions][400]") == 1
    assert _delta(after, before, "jaxrunner_e2e_request_latency_seconds_count") == 5
    assert after["jaxrunner_kv_cache_usage"] == 0.0
    assert "jaxrunner_num_requests_waiting" in after
