"""The suite's one server (tests/support/server.py) on the tiny Llama, with the engine settings
the other tests use so the compiled executables come from the shared cache, and an OpenAI client
for it."""

import pytest

from tests.support.server import ServerProcess


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
