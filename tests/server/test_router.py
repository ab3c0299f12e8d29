"""Scale-out behind SGLang's own gateway: the real `sglang-router` (the test extra's Rust
binary) in front of two replicas on loopback, with the cache-aware policy (README: "Scale-out
behind sglang-router"). Every route SGLang's clients use goes through it, streamed and not; the
replicas report their load in SGLang's shape; requests sharing a long prefix land on one
replica (its prefix cache serves them); fields no protocol defines are accepted with a warning
(the replicas run the default field policy)."""

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.support.server import MODEL_NAME, ServerProcess, free_port

sglang_router = pytest.importorskip("sglang_router")

ROUTER_TIMEOUT_S = 120
# The replicas' engines: small, with the suite's settings (compiled executables are shared).
REPLICA = dict(max_running_requests=8, max_prefill_tokens=256)


@pytest.fixture(scope="module")
def replicas(model_path, engine_kwargs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    procs = [ServerProcess(model_path, dict(engine_kwargs, **REPLICA), logs / f"replica{i}.log")
             for i in range(2)]
    try:
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("router") / "router.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
         "--port", str(port), "--policy", "cache_aware", "--log-level", "warn",
         "--worker-urls", *[r.url for r in replicas]],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_TIMEOUT_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, open(log.name).read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("the router did not start:\n" + open(log.name).read()[-3000:])
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 6}
ROUTES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 6},
    "/generate": {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 6}},
    "/v1/responses": {"model": MODEL_NAME, "input": "Hello there", "max_output_tokens": 6},
}


def test_engine_metrics_through_the_router_before_any_request(router):
    r = httpx.get(router + "/engine_metrics", timeout=30)
    assert r.status_code == 200, r.text
    assert 'jaxrunner_requests_total{finish_reason="stop"' in r.text


@pytest.mark.parametrize("path", list(ROUTES))
def test_every_route_through_the_router(router, path):
    r = httpx.post(router + path, json=ROUTES[path], timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    if path == "/generate":
        assert body["meta_info"]["completion_tokens"] == 6
    elif path == "/v1/responses":
        assert body["usage"]["output_tokens"] == 6
    else:
        assert body["usage"]["completion_tokens"] == 6
    with httpx.stream("POST", router + path, json={**ROUTES[path], "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    if path == "/v1/responses":
        assert json.loads(events[-1])["type"] == "response.completed"
    else:
        assert events[-1] == "[DONE]" and json.loads(events[-2])


def test_model_and_server_info_through_the_router(router):
    models = httpx.get(router + "/v1/models", timeout=30).json()
    assert MODEL_NAME in [m["id"] for m in models["data"]]
    info = httpx.get(router + "/get_model_info", timeout=30)
    assert info.status_code == 200 and info.json()["is_generation"] is True


def test_get_load_reflects_a_running_request(router, replicas):
    body = {"text": "Count slowly", "sampling_params": {"max_new_tokens": 400,
                                                        "ignore_eos": True}}
    thread = threading.Thread(target=lambda: httpx.post(router + "/generate", json=body,
                                                        timeout=300))
    thread.start()
    seen = []
    for _ in range(400):
        seen = [httpx.get(r.url + "/get_load", timeout=10).json()[0] for r in replicas]
        if any(load["num_reqs"] for load in seen):
            break
        time.sleep(0.02)
    thread.join(300)
    busy = [load for load in seen if load["num_reqs"]]
    assert len(busy) == 1 and busy[0]["num_tokens"] > 0, seen


def test_requests_sharing_a_prefix_land_on_one_replica(router, replicas):
    for replica in replicas:
        assert httpx.post(replica.url + "/flush_cache", timeout=30).status_code == 200
    prefix = "The shared system prompt of a long conversation about caching. " * 8
    cached = []
    for i in range(4):
        r = httpx.post(router + "/v1/completions", json={
            "model": MODEL_NAME, "prompt": prefix + f"Question number {i}?", "max_tokens": 2},
            timeout=120)
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    pages = [r.info()["kv_pages_cached"] for r in replicas]
    assert sorted(pages)[0] == 0 and sorted(pages)[1] > 0, pages
    assert cached[0] == 0 and min(cached[1:]) > 0, cached


def test_fields_no_protocol_defines_are_accepted_with_a_warning(router, replicas):
    """The router re-serialises bodies into SGLang's types (it drops unknown names), so a
    client reaching a replica directly is what sends them; the replicas run the default
    policy: accepted, a warning logged once."""
    for _ in range(2):
        r = httpx.post(replicas[0].url + "/v1/chat/completions",
                       json={**CHAT, "vendor_specific_knob": 3}, timeout=120)
        assert r.status_code == 200, r.text
    log = open(replicas[0].log_path).read()
    assert log.count("ignoring request field 'vendor_specific_knob'") == 1
    logs = "".join(open(replica.log_path).read() for replica in replicas)
    assert "Traceback" not in logs
