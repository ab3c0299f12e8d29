"""A jaxrunner server in a subprocess on a free loopback port, started the way users start it
(`python -m jaxrunner.serve`), on the tiny Llama with the engine settings the other tests use so
the compiled executables come from the shared persistent cache."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

MODEL_NAME = "tiny-llama"
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(kwargs: dict) -> list[str]:
    flags = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


class ServerProcess:
    def __init__(self, model_path, engine_kwargs: dict, log_path, extra: list[str] = (),
                 env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "jaxrunner.serve", "--model-path", str(model_path),
               "--port", str(self.port), "--served-model-name", MODEL_NAME,
               "--log-level", "warning", *engine_flags(engine_kwargs), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})))
        self.log_path = log_path

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   + open(self.log_path).read()[-5000:])
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError("server did not start in time:\n" + open(self.log_path).read()[-5000:])

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def info(self) -> dict:
        return httpx.get(self.url + "/get_server_info", timeout=10).json()


@pytest.fixture(scope="session")
def model_path(checkpoint):
    return checkpoint("tiny-llama")


@pytest.fixture(scope="session")
def server(model_path, engine_kwargs, tmp_path_factory):
    """One server for the suite (each start compiles or loads every bucket)."""
    # No whitespace between JSON tokens: a random model would fill its budget with it. Strict
    # request fields: what real clients send must all be known fields (the default, lenient
    # policy is tested on its own servers: tests/server/test_request_fields.py).
    proc = ServerProcess(model_path, dict(engine_kwargs,
                                          constrained_json_disable_any_whitespace=True),
                         tmp_path_factory.mktemp("server") / "server.log",
                         extra=["--strict-request-fields"])
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def wait_all_pages_free(server, timeout: float = 10.0) -> dict:
    """Aborts reach the engine between steps: poll until the KV pool is whole again."""
    deadline = time.monotonic() + timeout
    while True:
        info = server.info()
        if (info["kv_pages_free"] == info["kv_pages_total"]
                and info["req_slots_free"] == info["req_slots_total"]) \
                or time.monotonic() > deadline:
            return info
        time.sleep(0.05)
