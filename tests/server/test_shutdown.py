"""SIGTERM: short in-flight requests finish, long ones are aborted with a clean end of stream,
and the process exits with status 0."""

import json
import signal
import threading
import time

import httpx

from tests.support.server import MODEL_NAME, ServerProcess

# Short enough that the long requests (~2000 steps of several ms) cannot finish within it.
GRACE_S = 1.0


def _stream(url: str, max_tokens: int, started: threading.Event, out: dict):
    body = {"model": MODEL_NAME, "prompt": "Keep talking", "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                started.set()
    out["done"] = lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    out["finish"] = [c["choices"][0]["finish_reason"] for c in chunks
                     if c["choices"][0]["finish_reason"]]


def test_sigterm_finishes_or_aborts_in_flight_requests_and_exits(model_path, engine_kwargs,
                                                                 tmp_path, server):
    # `server` first: the session's compilation cache is warm, so this start is quick.
    proc = ServerProcess(model_path, engine_kwargs, tmp_path / "server.log",
                         ["--shutdown-timeout", str(GRACE_S)])
    try:
        proc.wait_ready()
        results, threads = {}, []
        # The short one starts last: it is surely still running when the signal comes.
        for name, max_tokens in (("long1", 2000), ("long2", 2000), ("short", 16)):
            started = threading.Event()
            results[name] = {}
            t = threading.Thread(target=_stream, args=(proc.url, max_tokens, started,
                                                       results[name]))
            t.start()
            assert started.wait(60)
            threads.append(t)
        t0 = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        returncode = proc.proc.wait(60)
        elapsed = time.monotonic() - t0
    finally:
        proc.stop()
    assert returncode == 0, open(proc.log_path).read()[-3000:]
    assert results["short"] == {"done": True, "finish": ["length"]}
    assert results["long1"] == results["long2"] == {"done": True, "finish": ["abort"]}
    assert elapsed < GRACE_S + 20
