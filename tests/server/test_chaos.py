"""Chaos against a real server on loopback, in bounded time: failures injected through a worker
wrapper (tests/support/fault_server.py), clients that vanish at every stage (queued, prefilling,
mid-chunk, decoding), bad requests, a burst past the queue limit, a stream that stops reading,
and last the engine loop's death. After each: every request had a terminal answer,
/get_server_info shows nothing running or waiting, and after /flush_cache every KV page and
request slot is free; the dying server answers /health 503 at once and exits with status 1.
Aborts mid-split and mid-speculative-round: tests/split_prefill/, tests/speculative/."""

import asyncio
import json
import random
import socket
import time

import httpx
import pytest

from tests.support.server import ServerProcess

POISON = 1001   # prefilling a prompt that starts with it fails at read-back (the seam)
DIE = 1002      # ... fails and takes the KV cache with it (the dying server's seam)
QUEUE = 64      # max_queued_requests of the chaos server
# The suite's engine (16 decode rows, 512-token prefills: the executables other tests compile
# come from the session's cache), with a queue limit.
CHAOS_ENGINE = dict(max_queued_requests=QUEUE)


def _prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (tokens 3..999: below the seams' tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(lo, hi + 1))] for _ in range(n)]


def _greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def _rss_mib(proc: ServerProcess) -> float:
    for line in open(f"/proc/{proc.proc.pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _assert_clean(server: ServerProcess) -> dict:
    """Nothing running or waiting; after a flush every page and slot is free."""
    deadline = time.monotonic() + 15
    while True:
        info = server.info()
        if info["num_requests_running"] == 0 and info["num_requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    info = server.info()
    assert info["kv_pages_free"] == info["kv_pages_total"], info
    assert info["req_slots_free"] == info["req_slots_total"], info
    return info


async def _generate(client, url, ids, n, **extra):
    r = await client.post(url + "/generate", json={"input_ids": ids, "sampling_params": _greedy(n),
                                                   **extra})
    return r.status_code, r.json(), r.headers


@pytest.fixture(scope="module")
def chaos(model_path, engine_kwargs, tmp_path_factory):
    """(server, the seam's record of failed steps): prefilling a prompt that starts with
    POISON fails at read-back, once; one that starts with DIE loses the KV cache."""
    root = tmp_path_factory.mktemp("chaos")
    record = root / "failed.json"
    faults = json.dumps([{"token": POISON, "at": "readback", "record": str(record)},
                         {"token": DIE, "lose_device_state": True}])
    proc = ServerProcess(model_path, dict(engine_kwargs, **CHAOS_ENGINE), root / "server.log",
                         launcher=("tests.support.fault_server", faults))
    try:
        proc.wait_ready()
        yield proc, record
    finally:
        proc.stop()


def test_one_failing_step_among_200_requests_fails_exactly_its_requests(chaos):
    server, record = chaos
    prompts = _prompts(200, 4, 24, seed=1)
    prompts[5] = [POISON] + prompts[5]  # in the first wave: prefilled beside others

    async def run(batch):
        limits = httpx.Limits(max_connections=40)  # waiting stays below the queue limit
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_generate(client, server.url, p, 6) for p in batch))

    first = asyncio.run(run(prompts))
    (rows,) = json.loads(record.read_text())
    # Each row of the failed step is a chunk of one prompt.
    failed = {tuple(p) for p in prompts for row in rows
              if any(p[i:i + len(row)] == row for i in range(len(p) - len(row) + 1))}
    assert len(failed) == len(rows) and tuple(prompts[5]) in failed
    for prompt, (status, body, _) in zip(prompts, first):
        if tuple(prompt) in failed:
            assert status == 500 and "InjectedFault" in body["error"]["message"], body
        else:
            assert status == 200 and len(body["output_ids"]) == 6, body
    # The others got the tokens they get without the fault (the fault is spent).
    others = [(p, body) for p, (_, body, _) in zip(prompts, first) if tuple(p) not in failed]
    again = asyncio.run(run([p for p, _ in others]))
    assert [b["output_ids"] for _, b in others] == [b["output_ids"] for _, b, _ in again]
    print(f"failed step: {len(failed)} of 200 requests")
    _assert_clean(server)


async def _stream_and_leave(client, url, ids, n, leave_after: int | None) -> str:
    """A /generate stream read for `leave_after` events (None: to the end)."""
    body = {"input_ids": ids, "sampling_params": _greedy(n), "stream": True}
    async with client.stream("POST", url + "/generate", json=body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}"
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "done"
            events += 1
            if leave_after is not None and events >= leave_after:
                return "left"
    return "cut"


async def _leave_early(client, url, ids, n, after_s: float) -> str:
    """A request whose client gives up after `after_s` (queued, prefilling, mid-chunk or
    mid-split by then)."""
    try:
        await asyncio.wait_for(_generate(client, url, ids, n), after_s)
        return "done"
    except asyncio.TimeoutError:
        return "left"


BAD_BODIES = [
    b"{not json",
    json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": -1}}).encode(),
    json.dumps({"input_ids": [1, 2, 10**6], "sampling_params": {}}).encode(),
    json.dumps({"input_ids": [5] * 5000, "sampling_params": {"max_new_tokens": 4}}).encode(),
    json.dumps({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}).encode(),
    # (An unknown field is accepted with a warning, as SGLang's server does: not bad input.)
    json.dumps({"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}}).encode(),
]


def test_chaos_traffic_leaves_the_server_clean(chaos):
    server, _ = chaos
    rng = random.Random(7)
    # Below the queue limit (the burst test goes past it): every client is let in.
    short = _prompts(32, 3, 30, seed=2)
    long = _prompts(12, 600, 1500, seed=3)  # chunked: 512-token prefills

    async def main():
        limits = httpx.Limits(max_connections=400)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            url = server.url
            jobs = [_stream_and_leave(client, url, p, rng.randrange(4, 40),
                                      rng.choice([None, 1, 2, 3, 5, 8])) for p in short]
            jobs += [_leave_early(client, url, p, 24, rng.uniform(0.02, 0.6)) for p in long]
            jobs += [client.post(url + "/generate", content=b, timeout=30) for b in BAD_BODIES]
            return await asyncio.gather(*jobs)

    t0 = time.monotonic()
    outcomes = asyncio.run(main())
    streams = outcomes[:len(short)]
    assert set(streams) <= {"done", "left"}, streams
    bad = outcomes[len(short) + len(long):]
    assert [r.status_code for r in bad] == [400] * len(BAD_BODIES), [r.text for r in bad]
    _assert_clean(server)
    print(f"chaos traffic: {len(outcomes)} requests in {time.monotonic() - t0:.1f}s, streams "
          f"{ {o: streams.count(o) for o in set(streams)} }")


def test_a_burst_past_the_queue_limit_gets_503_and_loses_nothing_accepted(chaos):
    server, _ = chaos
    prompts = _prompts(5 * QUEUE, 3, 12, seed=4)

    async def burst():
        limits = httpx.Limits(max_connections=len(prompts))
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_generate(client, server.url, p, 4) for p in prompts))

    before = _rss_mib(server)
    results = asyncio.run(burst())
    after = _rss_mib(server)
    refused = [(body, headers) for status, body, headers in results if status == 503]
    served = [body for status, body, _ in results if status == 200]
    assert len(refused) + len(served) == len(prompts), {s for s, _, _ in results}
    assert refused and served
    for body, headers in refused:
        assert headers["retry-after"] == "1" and "max_queued_requests" in body["error"]["message"]
    assert all(len(body["output_ids"]) == 4 for body in served)  # accepted: served whole
    print(f"burst of {len(prompts)}: {len(served)} served, {len(refused)} refused (503); "
          f"server RSS {before:.0f} -> {after:.0f} MiB")
    assert after - before < 256, (before, after)
    _assert_clean(server)


def test_a_stream_that_stops_reading_does_not_hold_the_engine(chaos):
    server, _ = chaos
    # Cumulative chunks with top logprobs: megabytes in all, past any socket buffer.
    body = json.dumps({"input_ids": [11, 12, 13], "sampling_params": _greedy(600),
                       "return_logprob": True, "top_logprobs_num": 5, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        r = httpx.post(server.url + "/generate", timeout=60,
                       json={"input_ids": [21, 22], "sampling_params": _greedy(8)})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 8
        assert time.monotonic() - t0 < 10
        # The engine finishes the unread request too: its tokens wait in the server's memory.
        deadline = time.monotonic() + 60
        while server.info()["num_requests_running"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        sock.close()
    _assert_clean(server)


def test_when_the_engine_loop_dies_health_turns_503_and_the_server_exits_non_zero(chaos):
    """Last in the module: it ends the chaos server. A step that loses the KV cache: the
    request in it gets a 500, /health answers 503 within a second, the process exits 1."""
    server, _ = chaos
    r = httpx.post(server.url + "/generate", timeout=60,
                   json={"input_ids": [DIE, 5, 6], "sampling_params": _greedy(4)})
    died = time.monotonic()
    assert r.status_code == 500, r.text
    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 503 and time.monotonic() - died < 1.0
    assert "DeviceStateLost" in health.json()["error"]["message"]
    assert server.proc.wait(timeout=60) == 1
    assert "the engine loop died" in server.log_path.read_text()
