"""A jaxrunner server in a subprocess on a free loopback port, started the way users start it
(`python -m jaxrunner.serve`)."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

MODEL_NAME = "tiny-llama"
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(kwargs: dict) -> list[str]:
    """`jaxrunner serve` flags for engine keyword arguments (False: `--no-<flag>`)."""
    flags = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


class ServerProcess:
    """`python -m jaxrunner.serve` on `model_path` with `engine_kwargs` as flags, logging to
    `log_path`; `wait_ready()` until /health answers, `stop()` with SIGTERM."""

    def __init__(self, model_path, engine_kwargs: dict, log_path, extra: list[str] = (),
                 env: dict | None = None, launcher: tuple[str, ...] = ("jaxrunner.serve",)):
        """`launcher`: the module run with `python -m` and its first arguments (a test seam's
        launcher: tests/support/fault_server.py)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", *launcher, "--model-path", str(model_path),
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
