"""Fixtures of the lowering tests."""

import pytest


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    """The `triton` package (it comes with torch on Linux; None where it is missing), its kernel
    cache in this session's temp dir rather than the user's home."""
    try:
        import triton  # noqa: PLC0415
    except ImportError:
        yield None
        return
    previous = triton.knobs.cache.dir
    triton.knobs.cache.dir = str(tmp_path_factory.mktemp("triton_cache"))
    yield triton
    triton.knobs.cache.dir = previous
